"""A GPU's loading resources: lanes (a stream, pinned host buffers and their events, one per loader
thread) and `Staging`, which keeps a GPU's retained primary context and a pool of lanes between
loads. Lanes copy file bytes to device addresses (plain, O_DIRECT, gathered or scattered in 2D)
and device bytes back to host buffers (verify). Needs the `cuda` extra.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from cuda.bindings import driver as cuda

from wcd.arenas.base import pread_into
from wcd.arenas.cuda_driver import (
    NOT_READY,
    SUCCESS,
    check,
    check_held,
    cleanup,
    current,
    exclusive_process,
    held,
    release_context,
    retain_context,
)
from wcd.arenas.cudrv import Gpu
from wcd.arenas.direct_io import DIRECT_ALIGN, pread_direct
from wcd.checkpoint import Run
from wcd.errors import WcdError
from wcd.tuning import LoadTuning

log = logging.getLogger("wcd")

# Lanes (a stream and its pinned buffers) kept per GPU between loads, and for how long after the
# last load by default; `configure` sets the latter from the daemon's config.
POOLED_LANES = 32
LINGER_S = 30.0
# On a GPU in exclusive-process compute mode, where a context the daemon holds keeps every engine
# from creating its own, nothing lingers after a load; only what `prepare` set up for the load
# about to start waits for it, and at most this long (an admission can fail after its prepare).
EXCLUSIVE_PREPARED_S = 5.0


# `CudaWriter.copy_scattered` copies runs in 2D (a driver call each, ~a few us) rather than gathering
# them with preadv (a Python slice and an iovec per piece, ~0.3 us) when runs hold at least this many
# pieces on average, and each row of a 2D copy is at least this wide (estimates from those costs).
SCATTER_PIECES_PER_COPY = 8
SCATTER_MIN_ROW = 1024


def scatter_pays(runs: tuple[Run, ...]) -> bool:
    """Whether 2D copies of `runs` (one per run) beat gathering their pieces (`CudaWriter.copy_scattered`)."""
    pieces = sum(count for _, _, _, count in runs)
    return bool(runs) and pieces >= SCATTER_PIECES_PER_COPY * len(runs) and \
        min((width for _, width, stride, count in runs if count > 1 and stride != width),
            default=SCATTER_MIN_ROW) >= SCATTER_MIN_ROW


class Lane:
    """One loader thread's stream and pinned staging buffers, each with an event marking the end of
    the copy that last used it. `reading`, `waiting` and `pinning` add up the seconds its thread spent
    in reads, waiting for a buffer's last copy and pinning larger buffers: the writer's debug line,
    whose sum against the loader threads' time in the copy phase leaves the work around them
    (driver calls, Python, hand-offs)."""

    def __init__(self, nbytes: int, count: int) -> None:
        self.nbytes = nbytes
        self.turn = 0
        self.reading = self.waiting = self.pinning = 0.0
        self.ptrs: list[int] = []
        self.views: list[memoryview] = []
        self.events: list[Any] = []
        # One 2D copy's parameters, reused (the driver reads them during the call): a lane is one thread's.
        self._2d = cuda.CUDA_MEMCPY2D()
        self._2d.srcMemoryType = cuda.CUmemorytype.CU_MEMORYTYPE_HOST
        self._2d.dstMemoryType = cuda.CUmemorytype.CU_MEMORYTYPE_DEVICE
        self.stream = check(cuda.cuStreamCreate(cuda.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        try:
            # Blocking-sync events: a waiting loader thread sleeps instead of spinning on a core that
            # the other threads' preadv needs.
            flags = cuda.CUevent_flags.CU_EVENT_DISABLE_TIMING | cuda.CUevent_flags.CU_EVENT_BLOCKING_SYNC
            for _ in range(count):
                self.events.append(check(cuda.cuEventCreate(flags), "cuEventCreate"))
            self._pin(nbytes, count)
        except BaseException:
            self.close()
            raise

    def _pin(self, nbytes: int, count: int) -> None:
        for _ in range(count):
            self.ptrs.append(int(check(cuda.cuMemHostAlloc(nbytes, 0), "cuMemHostAlloc")))
            # ctypes only to view the pinned bytes as a buffer that preadv can fill (no bindings).
            self.views.append(memoryview((ctypes.c_char * nbytes).from_address(self.ptrs[-1])).cast("B"))
        self.nbytes = nbytes

    def _grow(self, nbytes: int) -> None:
        """Replace the buffers with larger ones (pinning costs ~0.4 s per GiB: only cold reads need it)."""
        start = time.perf_counter()
        try:
            self.synchronize()
            views, ptrs, self.views, self.ptrs = self.views, self.ptrs, [], []
            cleanup(*(v.release for v in views),
                     *(lambda p=p: check(cuda.cuMemFreeHost(p), "cuMemFreeHost") for p in ptrs))
            self._pin(nbytes, len(self.events))
        finally:
            self.pinning += time.perf_counter() - start

    def fit(self, read_bytes: int) -> None:
        """Buffers of at least `read_bytes` (grown at a lane's first cold read)."""
        if read_bytes > self.nbytes:
            self._grow(read_bytes)

    def _next(self) -> int:
        """The next buffer in turn, once the copy that last used it has finished. Asked first with
        a query that keeps the GIL (`HeldCalls`): that copy nearly always ended long before this
        thread's next read did, and `cuEventSynchronize` gives the GIL up, then queues behind the
        other loader threads to take it back."""
        i, self.turn = self.turn, (self.turn + 1) % len(self.ptrs)
        err = held().event_query(self.events[i])
        if err == SUCCESS:
            return i
        if err != NOT_READY:
            check_held(err, "cuEventQuery")
        start = time.perf_counter()
        check(cuda.cuEventSynchronize(self.events[i]), "cuEventSynchronize")
        self.waiting += time.perf_counter() - start
        return i

    def _read(self, read: Callable[..., Any], *args: Any) -> Any:
        start = time.perf_counter()
        try:
            return read(*args)
        finally:
            self.reading += time.perf_counter() - start

    def copy(self, fd: int, file_offset: int, dst: int, nbytes: int, read_bytes: int) -> None:
        """Copy `nbytes` of `fd` to device address `dst`, `read_bytes` per read."""
        self.fit(read_bytes)
        while nbytes:
            i = self._next()
            n = min(nbytes, read_bytes)
            self._read(pread_into, fd, self.views[i][:n], file_offset)
            self._copy1d(dst, self.ptrs[i], n)
            self._record(i)
            file_offset, dst, nbytes = file_offset + n, dst + n, nbytes - n

    def copy_direct(self, fd: int, file_offset: int, dst: int, nbytes: int, read_bytes: int) -> None:
        """`copy` through an O_DIRECT descriptor: each read covers whole DIRECT_ALIGN blocks around
        the wanted bytes (at least one block, whatever `read_bytes` says), and the device copy
        starts at the first wanted byte in the buffer."""
        read_bytes = max(read_bytes, DIRECT_ALIGN)
        self.fit(read_bytes)
        room = min(read_bytes, self.nbytes) // DIRECT_ALIGN * DIRECT_ALIGN  # whole blocks per read, >= 1
        while nbytes:
            i = self._next()
            skip = file_offset % DIRECT_ALIGN
            n = min(nbytes, room - skip)
            span = -(-(skip + n) // DIRECT_ALIGN) * DIRECT_ALIGN
            self._read(pread_direct, fd, self.views[i][:span], file_offset - skip, skip + n)
            self._copy1d(dst, self.ptrs[i] + skip, n)
            self._record(i)
            file_offset, dst, nbytes = file_offset + n, dst + n, nbytes - n

    def gather(self, fd: int, file_offset: int, dst: int, nbytes: int, runs: tuple[Run, ...]) -> bool:
        """One preadv scatters a file range into a staging buffer laid out like the arena's `nbytes`
        at `dst` (an iovec per piece of `runs`), one async copy moves it. False (nothing done) if it
        does not fit one buffer or the read came up short."""
        if nbytes > self.nbytes:
            return False
        i = self._next()
        staging = self.views[i]
        want = sum(width * count for _, width, _, count in runs)
        got = self._read(os.preadv, fd, [staging[at : at + width] for rel, width, stride, count in runs
                                         for at in range(rel, rel + stride * count, stride)], file_offset)
        if got != want:  # short only at end of file, or a file that shrank: let the caller redo it
            return False
        self._copy1d(dst, self.ptrs[i], nbytes)
        self._record(i)
        return True

    def fetch(self, i: int, src: int, nbytes: int) -> None:
        """Start copying `nbytes` at device address `src` into buffer `i` (reads: verify); `landed` waits."""
        check(cuda.cuMemcpyDtoHAsync(self.ptrs[i], src, nbytes, self.stream), "cuMemcpyDtoHAsync")
        check(cuda.cuEventRecord(self.events[i], self.stream), "cuEventRecord")

    def landed(self, i: int, nbytes: int) -> memoryview:
        """The first `nbytes` of buffer `i`, once the copy that last used it has finished."""
        check(cuda.cuEventSynchronize(self.events[i]), "cuEventSynchronize")
        return self.views[i][:nbytes]

    def scatter(self, fd: int, file_offset: int, dst: int, runs: tuple[Run, ...], read_bytes: int) -> None:
        """Copy a contiguous file range into the pieces of `runs` at device address `dst`: reads of
        the file as it is (one buffer at a time, at most `read_bytes` unless 0: the file's read size,
        not the 16 MiB an earlier cold load grew a pooled lane to), and per run one 2D copy
        (`cuMemcpy2DAsync`: rows of the run's width, at the width's pitch in the buffer and the
        stride's on the device), which the copy engine scatters. O(runs) Python, not O(tensors). A
        row that a buffer's end cuts goes in two plain copies."""
        total = sum(width * count for _, width, _, count in runs)
        r, row, part = 0, 0, 0  # the run, row and bytes of that row that the next buffer byte goes to
        pos = 0
        while pos < total:
            i = self._next()
            n = min(total - pos, self.nbytes, read_bytes or self.nbytes)
            self._read(pread_into, fd, self.views[i][:n], file_offset + pos)
            src, end = self.ptrs[i], self.ptrs[i] + n
            while src < end:
                rel, width, stride, count = runs[r]
                if not width:  # no bytes (copy_plan leaves such tensors out)
                    r += 1
                    continue
                at = dst + rel + row * stride + part
                if part or end - src < width:  # a row cut by a buffer's end: its rest, or what fits
                    k = min(width - part, end - src)
                    self._copy1d(at, src, k)
                    part += k
                    if part == width:
                        row, part = row + 1, 0
                    src += k
                else:
                    rows = min(count - row, (end - src) // width)
                    self._copy_rows(at, src, width, stride, rows)
                    row += rows
                    src += rows * width
                if row == count:
                    r, row = r + 1, 0
            self._record(i)
            pos += n

    def _copy1d(self, dst: int, src: int, nbytes: int) -> None:
        """Queue a copy from pinned memory, keeping the GIL (`HeldCalls`): it never blocks."""
        check_held(held().memcpy_htod_async(dst, src, nbytes, self.stream), "cuMemcpyHtoDAsync")

    def _record(self, i: int) -> None:
        """Mark buffer `i` as in use until the copies queued on the stream so far have finished."""
        check_held(held().event_record(self.events[i], self.stream), "cuEventRecord")

    def _copy_rows(self, dst: int, src: int, width: int, stride: int, rows: int) -> None:
        """`rows` rows of `width` bytes, back to back at host address `src`, to `dst` every `stride` bytes."""
        if rows == 1 or stride == width:
            self._copy1d(dst, src, width * rows)
            return
        p = self._2d
        p.srcHost, p.srcPitch, p.dstDevice, p.dstPitch = src, width, dst, stride
        p.WidthInBytes, p.Height = width, rows
        check(cuda.cuMemcpy2DAsync(p, self.stream), "cuMemcpy2DAsync")

    def synchronize(self) -> None:
        check(cuda.cuStreamSynchronize(self.stream), "cuStreamSynchronize")

    @property
    def whole(self) -> bool:
        """Every buffer there (a grow that failed part-way leaves some missing: never pool that)."""
        return bool(self.ptrs) and len(self.ptrs) == len(self.events)

    def close(self) -> None:
        views, ptrs, events, self.views, self.ptrs, self.events = self.views, self.ptrs, self.events, [], [], []
        cleanup(
            lambda: check(cuda.cuStreamSynchronize(self.stream), "cuStreamSynchronize"),
            *(v.release for v in views),
            *(lambda p=p: check(cuda.cuMemFreeHost(p), "cuMemFreeHost") for p in ptrs),
            *(lambda e=e: check(cuda.cuEventDestroy(e), "cuEventDestroy") for e in events),
            lambda: check(cuda.cuStreamDestroy(self.stream), "cuStreamDestroy"),
        )


class Staging:
    """A GPU's loading resources, kept between loads: its retained primary context and a pool of
    lanes (a stream and pinned buffers each).

    Creating a context and pinning host memory is most of a load's fixed cost, so writers (and
    verify's readers) `open` this and take lanes from it instead. When the last closes, the lanes and the context
    stay `linger_s` seconds for the next load (0: released as it ends, beside its answer; inf: for the daemon's life),
    then are released: the daemon holds no CUDA context while it is not loading. On a GPU in
    exclusive-process compute mode they are released as soon as the last closes (see
    EXCLUSIVE_PREPARED_S): engines could not create their context there meanwhile.
    """

    def __init__(self, gpu: Gpu, tuning: LoadTuning, linger_s: float) -> None:
        self.gpu = gpu
        self.tuning = tuning
        self.linger_s = linger_s
        self._lane_shape = (tuning.staging_bytes, tuning.staging_buffers)
        self._lock = threading.Lock()
        self._lane_made = threading.Condition(self._lock)
        self._ctx: Any = None
        self._users = 0
        self._free: list[Lane] = []
        self._making = 0  # lanes `prepare` is making: a load's threads wait for those first
        self._timer: threading.Timer | None = None
        self._releasing: list[threading.Thread] = []  # releases on threads of their own (finished ones pruned)
        self._exclusive = False  # the GPU's compute mode when the context was retained
        self._exclusive_told = False  # the log line about it, once per GPU
        self.direct_reads = False  # cold files through O_DIRECT (`CudaBackend.configure`)

    def open(self) -> Any:
        """Hold the context (retained now if it is not) for one writer; pair with `close`."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if self._ctx is None:
                exclusive = exclusive_process(self.gpu)  # an operator may change it while no context exists
                self._ctx = retain_context(self.gpu)
                self._exclusive = exclusive
                if exclusive and not self._exclusive_told:
                    self._exclusive_told = True
                    log.info("%s %s is in exclusive-process compute mode: its CUDA context and load staging are "
                             "released as each load ends (no staging_linger_s), so that engines can create theirs",
                             self.gpu.label, self.gpu.uuid)
            self._users += 1
            return self._ctx

    def take(self) -> Lane:
        """A lane for the calling thread: pooled, one `prepare` is making, or made now (the context
        is current). Waiting for prepared lanes keeps a load's threads from pinning memory beside
        `prepare` (pinning serialises in the driver: twice the lanes would take twice as long)."""
        with self._lock:
            while not self._free and self._making:
                self._lane_made.wait()
            if self._free:
                return self._free.pop()
        return Lane(*self._lane_shape)

    def give(self, lanes: list[Lane]) -> None:
        """Lanes back from a writer whose copies have all finished (context current); extras, and
        lanes left without buffers by a failed grow, are closed."""
        whole = [lane for lane in lanes if lane.whole]
        with self._lock:
            keep = max(0, POOLED_LANES - len(self._free))
            self._free += whole[:keep]
        cleanup(*(lane.close for lane in whole[keep:] + [lane for lane in lanes if not lane.whole]))

    def close(self, prepared: bool = False) -> None:
        """One writer done: release everything once no writer is left and `linger_s` has passed.
        `prepared`: the hold of a `prepare`, whose load is about to take over what it set up.

        With no linger the release runs on a thread of its own, so the answer does not wait for
        it: unpinning the lanes and releasing the context takes a tenth of a second or more, and the
        load is whole without it (its copies finished before this). A GPU in exclusive-process
        mode is released before this returns: the engine told of the load creates its context there
        next. So is any GPU when no thread can be started."""
        with self._lock:
            self._users -= 1
            now = self._linger_locked(prepared)
            exclusive = self._exclusive
        if now and exclusive:
            self._release_now()
        elif now:
            self._release_soon()

    def _release_soon(self) -> None:
        """Release on a thread of its own (here if none can be started: a tasks limit)."""
        thread = threading.Thread(target=self._release_logged, daemon=True, name=f"wcd-release-{self.gpu.ordinal}")
        with self._lock:
            self._releasing = [t for t in self._releasing if t.is_alive()] + [thread]
        try:
            thread.start()
        except RuntimeError:
            with self._lock:
                self._releasing.remove(thread)
            self._release_now()

    def _release_logged(self) -> None:
        """`_release_now` on a thread of its own, its failure said in the log (nobody waits for it)."""
        try:
            self._release_now()
        except Exception as e:  # noqa: BLE001 - the load it followed is whole; the log says what was left
            log.warning("%s: releasing the CUDA context and load staging failed: %s", self.gpu.label,
                        e.message if isinstance(e, WcdError) else f"{type(e).__name__}: {e}")

    def set_linger(self, linger_s: float) -> None:
        """A new linger (the config was reloaded); an idle, lingering GPU is rescheduled by it, or
        released on a thread of its own (this runs on the event loop, before a load's admission)."""
        with self._lock:
            self.linger_s = linger_s
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            now = self._linger_locked()
        if now:
            self._release_soon()

    def _linger_locked(self, prepared: bool = False) -> bool:
        """With the lock held and no writer left: start the linger timer; True: release now."""
        if self._users or self._ctx is None or self._timer is not None:
            return False
        linger = self.linger_s
        if self._exclusive:
            if not prepared:
                return True
            linger = min(linger, EXCLUSIVE_PREPARED_S)
        if linger <= 0:
            return True
        if linger < threading.TIMEOUT_MAX:  # larger, or inf: kept for the daemon's life
            self._timer = threading.Timer(linger, self.release)
            self._timer.daemon = True
            self._timer.start()
        return False

    def release(self) -> None:
        """Close the pooled lanes and release the context, unless a writer holds it; first wait
        for the releases left running on threads of their own (daemon shutdown)."""
        for thread in list(self._releasing):
            if thread.is_alive():
                thread.join()
        self._release_now()

    def _release_now(self) -> None:
        with self._lock:
            if self._users or self._ctx is None:
                return
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            ctx, lanes, self._ctx, self._free = self._ctx, self._free, None, []
        try:
            with current(ctx):
                cleanup(*(lane.close for lane in lanes))
        finally:
            release_context(self.gpu)

    def prepare(self, lanes: int) -> None:
        """Retain the context and have `lanes` lanes pooled ahead of a load (they linger like a
        load's): at most POOLED_LANES, counting those pooled and those other prepares are making."""
        ctx = self.open()
        todo = 0
        try:
            with self._lock:
                todo = max(0, min(lanes, POOLED_LANES) - len(self._free) - self._making)
                self._making += todo
            with current(ctx):
                while todo:
                    lane = Lane(*self._lane_shape)
                    with self._lock:
                        self._making -= 1
                        todo -= 1
                        self._free.append(lane)
                        self._lane_made.notify()
        finally:
            if todo:  # failed part-way: nobody makes the rest, so nobody may wait for them
                with self._lock:
                    self._making -= todo
                    self._lane_made.notify_all()
            self.close(prepared=True)

    @property
    def warm_read(self) -> int:
        """Bytes per read from a file in the page cache: one staging buffer."""
        return self._lane_shape[0]

    @property
    def cold_read(self) -> int:
        """Bytes per op of a file not in the page cache, and per buffered read of it (a lane grows
        its buffers to it then; O_DIRECT reads it in `direct_read_bytes` spans, in the buffers a
        lane has)."""
        return self.tuning.cold_read_bytes

    @property
    def held(self) -> bool:
        return self._ctx is not None
