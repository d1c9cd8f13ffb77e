"""CUDA arenas: one VMM allocation (`cuMemCreate`) per entry per GPU, exported once as a POSIX fd.

Creating and exporting needs only `cuInit`, no CUDA context (DESIGN §9); the device's primary
context is retained only while an arena is being filled (`CudaWriter`) or read back (`read`).
Devices are "cuda:N" or a GPU UUID; the UUID is canonical, so a client with another
CUDA_VISIBLE_DEVICES finds the same GPU. Needs the `cuda` extra (cuda-bindings), imported lazily.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any

from cuda.bindings import driver as cuda

from wcd.arenas.base import Arena, ArenaBackend, ArenaReader, ArenaWriter, DeviceInfo, pread_into
from wcd.arenas.cudrv import Gpu, HeldCalls, format_uuid, resolve_gpu
from wcd.checkpoint import Run
from wcd.config import format_size
from wcd.errors import BadRequest, DeviceUnavailable, Internal, OutOfMemory, WcdError
from wcd.loader import resident
from wcd.manifest import align_up

log = logging.getLogger("wcd")

POSIX_FD = cuda.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
# Pinned staging buffers, two per loader thread (read into one while the other is being copied).
# Files mostly in the page cache are read one buffer (STAGING_BYTES) at a time: on the H200 machine
# here 16 threads x 4 MiB reads filled 16 GB at 46 GB/s (8 MiB: 41, 16 MiB: 37; cache-sized copies
# win). Files mostly not in it are planned in ops of COLD_READ_BYTES, read through O_DIRECT in
# DIRECT_READ_BYTES spans (below), or buffered one op at a time (`cold_reads = "buffered"`: 16 MiB
# reads from 16 threads read that disk at 1.89 GB/s, against 1.44 GB/s with 8 x 4 MiB).
STAGING_BYTES = 4 << 20  # a lane's buffers grow to COLD_READ_BYTES at its first buffered cold read
STAGING_BUFFERS = 2
COLD_READ_BYTES = 16 << 20
# verify's device-to-host copies (`CudaReader.windows`), into a lane's buffers: cache-sized, so the
# hashing of one overlaps the copy of the next even in lanes that cold reads grew to 16 MiB.
READ_WINDOW = 4 << 20
WARM_FRACTION = 0.9  # a file with at least this much in the page cache is read as warm
# With `cold_reads = "direct"` (the default), cold files are read with O_DIRECT: whole aligned
# blocks into the pinned buffers, no page-cache copy and nothing left in the cache; buffered where
# the file system refuses it. 4096 covers 512-byte and 4K logical blocks.
DIRECT_ALIGN = 4096
# At most this much in one O_DIRECT read (0: a whole op). Ops stay COLD_READ_BYTES, so each op is
# read in equal spans across its tensors: the blocks fastsafetensors reads (its nogds reader: a
# 16 MiB bounce budget over 16 threads x 2). On the H200 machines, with the copies keeping the GIL
# (`HeldCalls`), 512 KiB spans beat buffered 16 MiB reads at 16 GB (7.29 s against 8.54, two
# rounds) and at 1.6 GB (copy phase 0.857 s against 0.940, five); whole 16 MiB O_DIRECT reads had
# lost to buffered ones (11.77 s against 10.24): 16 threads kept ~145 requests in flight. So did
# two O_DIRECT reads in flight per thread through Linux AIO (b2a9445; 16 GB: 8.23 s against 6.63,
# queue 24 against 13): that disk serves less per second with more than ~16 reads queued.
DIRECT_READ_BYTES = 512 << 10
DROP_FRACTION = 0.02  # below this (the header and fingerprint samples this load read), it was not cached
# Lanes (a stream and its pinned buffers) kept per GPU between loads, and for how long after the
# last load by default; `configure` sets the latter from the daemon's config.
POOLED_LANES = 32
LINGER_S = 30.0
# On a GPU in exclusive-process compute mode, where a context the daemon holds keeps every engine
# from creating its own, nothing lingers after a load; only what `prepare` set up for the load
# about to start waits for it, and at most this long (an admission can fail after its prepare).
EXCLUSIVE_PREPARED_S = 5.0
_SUCCESS = cuda.CUresult.CUDA_SUCCESS
_NOT_READY = cuda.CUresult.CUDA_ERROR_NOT_READY
# A loader thread asks whether its next buffer's last copy has finished (a `cuEventQuery` that
# keeps the GIL) before it waits for that copy (`cuEventSynchronize`, which gives the GIL up and
# then queues behind the other threads to take it back). The copy of a buffer's few hundred KiB
# ends long before the thread's next read does, so the wait is nearly always for nothing (the
# H200's 1.6 GB cold loads: 0.27-0.41 thread-seconds of such waits per load before, none after;
# the clock did not move beyond its noise). False: always wait (bench_load's "wcd-sync").
QUERY_FIRST = True
_BAD_DEVICE = (cuda.CUresult.CUDA_ERROR_INVALID_DEVICE, cuda.CUresult.CUDA_ERROR_NO_DEVICE)
# cuda-bindings 12.9 (the cuda extra's range) runs on R525 and later drivers.
_DRIVER_HINT = "install the NVIDIA driver (R525 or later), or use device \"cpu\""


def _check(result: tuple[Any, ...], what: str) -> Any:
    """Unwrap a cuda-bindings result `(CUresult, *values)`; a failure becomes a one-line WcdError."""
    err, values = result[0], result[1:]
    if err != _SUCCESS:
        _, desc = cuda.cuGetErrorString(err)
        message = f"CUDA {what} failed: {getattr(err, 'name', err)} ({desc.decode() if desc else 'unknown error'})"
        if err == cuda.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
            raise OutOfMemory(message)
        raise (BadRequest if err in _BAD_DEVICE else Internal)(message)
    if not values:
        return None
    return values[0] if len(values) == 1 else values


@cache
def _held() -> HeldCalls:
    """The copy loop's GIL-keeping driver calls (the unit tests' fakes replace this)."""
    return HeldCalls()


def _check_held(err: Any, what: str) -> None:
    """`_check` for a `HeldCalls` result (a bare CUresult, an int from the driver)."""
    if err != _SUCCESS:
        try:
            code = cuda.CUresult(err) if type(err) is int else err
        except ValueError:  # a code newer than these bindings
            raise Internal(f"CUDA {what} failed: error {err}") from None
        _check((code,), what)


def _cleanup(*steps: Callable[[], object]) -> None:
    """Run every release step even when one fails, then raise the first failure."""
    first: BaseException | None = None
    for step in steps:
        try:
            step()
        except Exception as e:  # noqa: BLE001 - the remaining steps must still run
            first = first or e
    if first is not None:
        raise first


@cache
def gpus() -> tuple[Gpu, ...]:
    """The GPUs this process sees, after `cuInit`. Enumeration is fixed for a process's lifetime."""
    try:
        err, = cuda.cuInit(0)
    except Exception as e:  # noqa: BLE001 - cuda-bindings raises its own loader errors without a driver
        raise DeviceUnavailable(f"CUDA driver not available ({e}); {_DRIVER_HINT}") from None
    if err == cuda.CUresult.CUDA_ERROR_NO_DEVICE:  # e.g. CUDA_VISIBLE_DEVICES=""
        return ()
    if err != _SUCCESS:  # no driver, one too old for these bindings, no /dev/nvidia* access, ...
        raise DeviceUnavailable(f"CUDA driver not usable (cuInit: {getattr(err, 'name', err)}); {_DRIVER_HINT}")
    out = []
    for i in range(_check(cuda.cuDeviceGetCount(), "cuDeviceGetCount")):
        dev = _check(cuda.cuDeviceGet(i), "cuDeviceGet")
        uuid = format_uuid(bytes(_check(cuda.cuDeviceGetUuid(dev), "cuDeviceGetUuid").bytes))
        name = _check(cuda.cuDeviceGetName(256, dev), "cuDeviceGetName").split(b"\0", 1)[0].decode()
        out.append(Gpu(i, uuid, name))
    return tuple(out)


def find_gpu(device: str) -> Gpu:
    """Resolve "cuda", "cuda:N" or a GPU UUID (any case) against this process's GPUs."""
    return resolve_gpu(device, gpus())


def retain_context(gpu: Gpu) -> Any:
    """Retain the device's primary context (the one torch's runtime uses); pair with `release_context`."""
    return _check(cuda.cuDevicePrimaryCtxRetain(gpu.ordinal), "cuDevicePrimaryCtxRetain")


def release_context(gpu: Gpu) -> None:
    _check(cuda.cuDevicePrimaryCtxRelease(gpu.ordinal), "cuDevicePrimaryCtxRelease")


def exclusive_process(gpu: Gpu) -> bool:
    """Whether the device is in EXCLUSIVE_PROCESS compute mode: one process's context at a time
    (`nvidia-smi -c`). Needs no context."""
    mode = _check(cuda.cuDeviceGetAttribute(cuda.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_MODE, gpu.ordinal),
                  "cuDeviceGetAttribute")
    return int(mode) == int(cuda.CUcomputemode.CU_COMPUTEMODE_EXCLUSIVE_PROCESS)


@contextmanager
def current(ctx: Any) -> Iterator[None]:
    """Make `ctx` current for a block and restore the caller's context after (push/pop)."""
    _check(cuda.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")
    try:
        yield
    finally:
        cuda.cuCtxPopCurrent()


class VaMapping:
    """`size` bytes of an allocation handle (from `offset`) mapped at a fresh virtual address,
    accessible from `gpu` read-only or read-write. `close` unmaps and frees the address range."""

    def __init__(self, handle: Any, gpu: Gpu, size: int, writable: bool, offset: int = 0) -> None:
        self.size = size
        self.ptr = int(_check(cuda.cuMemAddressReserve(size, 0, 0, 0), "cuMemAddressReserve"))
        try:
            _check(cuda.cuMemMap(self.ptr, size, offset, handle, 0), "cuMemMap")
            try:
                access = cuda.CUmemAccessDesc()
                access.location.type = cuda.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                access.location.id = gpu.ordinal
                access.flags = (cuda.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE if writable
                                else cuda.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ)
                _check(cuda.cuMemSetAccess(self.ptr, size, [access], 1), "cuMemSetAccess")
            except BaseException:
                cuda.cuMemUnmap(self.ptr, size)
                raise
        except BaseException:
            cuda.cuMemAddressFree(self.ptr, size)
            raise

    def close(self) -> None:
        if self.ptr:
            ptr, self.ptr = self.ptr, 0
            _cleanup(lambda: _check(cuda.cuMemUnmap(ptr, self.size), "cuMemUnmap"),
                     lambda: _check(cuda.cuMemAddressFree(ptr, self.size), "cuMemAddressFree"))


def _alloc_prop(gpu: Gpu) -> Any:
    prop = cuda.CUmemAllocationProp()
    prop.type = cuda.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cuda.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = gpu.ordinal
    prop.requestedHandleTypes = POSIX_FD
    return prop


@cache
def granularity(gpu: Gpu) -> int:
    flag = cuda.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    return int(_check(cuda.cuMemGetAllocationGranularity(_alloc_prop(gpu), flag), "cuMemGetAllocationGranularity"))


# `CudaWriter.copy_scattered` copies runs in 2D (a driver call each, ~a few us) rather than gathering
# them with preadv (a Python slice and an iovec per piece, ~0.3 us) when runs hold at least this many
# pieces on average, and each row of a 2D copy is at least this wide. Not yet measured on a GPU.
SCATTER_PIECES_PER_COPY = 8
SCATTER_MIN_ROW = 1024


def scatter_pays(runs: tuple[Run, ...]) -> bool:
    """Whether 2D copies of `runs` (one per run) beat gathering their pieces (`CudaWriter.copy_scattered`)."""
    pieces = sum(count for _, _, _, count in runs)
    return bool(runs) and pieces >= SCATTER_PIECES_PER_COPY * len(runs) and \
        min((width for _, width, stride, count in runs if count > 1 and stride != width),
            default=SCATTER_MIN_ROW) >= SCATTER_MIN_ROW


class _Lane:
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
        self.stream = _check(cuda.cuStreamCreate(cuda.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        try:
            # Blocking-sync events: a waiting loader thread sleeps instead of spinning on a core that
            # the other threads' preadv needs.
            flags = cuda.CUevent_flags.CU_EVENT_DISABLE_TIMING | cuda.CUevent_flags.CU_EVENT_BLOCKING_SYNC
            for _ in range(count):
                self.events.append(_check(cuda.cuEventCreate(flags), "cuEventCreate"))
            self._pin(nbytes, count)
        except BaseException:
            self.close()
            raise

    def _pin(self, nbytes: int, count: int) -> None:
        for _ in range(count):
            self.ptrs.append(int(_check(cuda.cuMemHostAlloc(nbytes, 0), "cuMemHostAlloc")))
            # ctypes only to view the pinned bytes as a buffer that preadv can fill (no bindings).
            self.views.append(memoryview((ctypes.c_char * nbytes).from_address(self.ptrs[-1])).cast("B"))
        self.nbytes = nbytes

    def _grow(self, nbytes: int) -> None:
        """Replace the buffers with larger ones (pinning costs ~0.4 s per GiB: only cold reads need it)."""
        start = time.perf_counter()
        try:
            self.synchronize()
            views, ptrs, self.views, self.ptrs = self.views, self.ptrs, [], []
            _cleanup(*(v.release for v in views),
                     *(lambda p=p: _check(cuda.cuMemFreeHost(p), "cuMemFreeHost") for p in ptrs))
            self._pin(nbytes, len(self.events))
        finally:
            self.pinning += time.perf_counter() - start

    def fit(self, read_bytes: int) -> None:
        """Buffers of at least `read_bytes` (grown at a lane's first cold read)."""
        if read_bytes > self.nbytes:
            self._grow(read_bytes)

    def _next(self) -> int:
        """The next buffer in turn, once the copy that last used it has finished."""
        i, self.turn = self.turn, (self.turn + 1) % len(self.ptrs)
        if QUERY_FIRST:
            err = _held().event_query(self.events[i])
            if err == _SUCCESS:
                return i
            if err != _NOT_READY:
                _check_held(err, "cuEventQuery")
        start = time.perf_counter()
        _check(cuda.cuEventSynchronize(self.events[i]), "cuEventSynchronize")
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
            self._read(_pread_direct, fd, self.views[i][:span], file_offset - skip, skip + n)
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
        _check(cuda.cuMemcpyDtoHAsync(self.ptrs[i], src, nbytes, self.stream), "cuMemcpyDtoHAsync")
        _check(cuda.cuEventRecord(self.events[i], self.stream), "cuEventRecord")

    def landed(self, i: int, nbytes: int) -> memoryview:
        """The first `nbytes` of buffer `i`, once the copy that last used it has finished."""
        _check(cuda.cuEventSynchronize(self.events[i]), "cuEventSynchronize")
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
        _check_held(_held().memcpy_htod_async(dst, src, nbytes, self.stream), "cuMemcpyHtoDAsync")

    def _record(self, i: int) -> None:
        """Mark buffer `i` as in use until the copies queued on the stream so far have finished."""
        _check_held(_held().event_record(self.events[i], self.stream), "cuEventRecord")

    def _copy_rows(self, dst: int, src: int, width: int, stride: int, rows: int) -> None:
        """`rows` rows of `width` bytes, back to back at host address `src`, to `dst` every `stride` bytes."""
        if rows == 1 or stride == width:
            self._copy1d(dst, src, width * rows)
            return
        p = self._2d
        p.srcHost, p.srcPitch, p.dstDevice, p.dstPitch = src, width, dst, stride
        p.WidthInBytes, p.Height = width, rows
        _check(cuda.cuMemcpy2DAsync(p, self.stream), "cuMemcpy2DAsync")

    def synchronize(self) -> None:
        _check(cuda.cuStreamSynchronize(self.stream), "cuStreamSynchronize")

    @property
    def whole(self) -> bool:
        """Every buffer there (a grow that failed part-way leaves some missing: never pool that)."""
        return bool(self.ptrs) and len(self.ptrs) == len(self.events)

    def close(self) -> None:
        views, ptrs, events, self.views, self.ptrs, self.events = self.views, self.ptrs, self.events, [], [], []
        _cleanup(
            lambda: _check(cuda.cuStreamSynchronize(self.stream), "cuStreamSynchronize"),
            *(v.release for v in views),
            *(lambda p=p: _check(cuda.cuMemFreeHost(p), "cuMemFreeHost") for p in ptrs),
            *(lambda e=e: _check(cuda.cuEventDestroy(e), "cuEventDestroy") for e in events),
            lambda: _check(cuda.cuStreamDestroy(self.stream), "cuStreamDestroy"),
        )


def _pread_direct(fd: int, view: memoryview, offset: int, need: int) -> None:
    """Read at least `need` bytes into `view` (aligned, as its length and `offset` are) through an
    O_DIRECT descriptor, which reads whole blocks: only the file's end may be short."""
    done = 0
    while done < need:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0 or (n % DIRECT_ALIGN and done + n < need):
            raise OSError(errno.EIO, "unexpected end of file")
        done += n


def open_direct(fd: int) -> int | None:
    """An O_DIRECT descriptor of the file open as `fd` (reopened through /proc/self/fd, which names
    that open file, not a path anyone could swap), or None where the file system refuses O_DIRECT
    (one warning per file system: `_warn_buffered`)."""
    try:
        direct = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
    except OSError as e:
        if e.errno not in _REFUSALS:  # out of descriptors, say: not the file system's answer
            raise
        _warn_buffered(fd, e)
        return None
    a, b = os.fstat(fd), os.fstat(direct)
    if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):  # cannot happen; never read another file
        os.close(direct)
        return None
    return direct


_BUFFERED_DEVICES: set[int] = set()  # file systems (st_dev) whose O_DIRECT refusal was logged
# What a file system that does not do O_DIRECT answers the open or a read with.
_REFUSALS = (errno.EINVAL, errno.EOPNOTSUPP)
_BUFFERED_LOCK = threading.Lock()


def _warn_buffered(fd: int, error: OSError) -> None:
    """Say once per file system, not per file or load, that `cold_reads = "direct"` reads its files
    buffered (it refused to open them with O_DIRECT, or an O_DIRECT read of them)."""
    device = os.fstat(fd).st_dev
    with _BUFFERED_LOCK:
        if device in _BUFFERED_DEVICES:
            return
        _BUFFERED_DEVICES.add(device)
    try:
        path = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        path = f"fd {fd}"
    log.warning('cannot read %s with O_DIRECT (%s): cold reads from its file system go through the page cache '
                'instead (cold_reads = "direct", the default); set cold_reads = "buffered" to silence this',
                path, error.strerror or error)


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

    def __init__(self, gpu: Gpu, lane_bytes: int, lane_buffers: int, linger_s: float) -> None:
        self.gpu = gpu
        self.linger_s = linger_s
        self._lane_shape = (lane_bytes, lane_buffers)
        self._lock = threading.Lock()
        self._lane_made = threading.Condition(self._lock)
        self._ctx: Any = None
        self._users = 0
        self._free: list[_Lane] = []
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

    def take(self) -> _Lane:
        """A lane for the calling thread: pooled, one `prepare` is making, or made now (the context
        is current). Waiting for prepared lanes keeps a load's threads from pinning memory beside
        `prepare` (pinning serialises in the driver: twice the lanes would take twice as long)."""
        with self._lock:
            while not self._free and self._making:
                self._lane_made.wait()
            if self._free:
                return self._free.pop()
        return _Lane(*self._lane_shape)

    def give(self, lanes: list[_Lane]) -> None:
        """Lanes back from a writer whose copies have all finished (context current); extras, and
        lanes left without buffers by a failed grow, are closed."""
        whole = [lane for lane in lanes if lane.whole]
        with self._lock:
            keep = max(0, POOLED_LANES - len(self._free))
            self._free += whole[:keep]
        _cleanup(*(lane.close for lane in whole[keep:] + [lane for lane in lanes if not lane.whole]))

    def close(self, prepared: bool = False) -> None:
        """One writer done: release everything once no writer is left and `linger_s` has passed.
        `prepared`: the hold of a `prepare`, whose load is about to take over what it set up.

        With no linger the release runs on a thread of its own, so the answer does not wait for
        it: unpinning the lanes and releasing the context took 0.13-0.18 s on the H200, and the
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
                _cleanup(*(lane.close for lane in lanes))
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
                    lane = _Lane(*self._lane_shape)
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
        its buffers to it then; O_DIRECT reads it in DIRECT_READ_BYTES spans, in the buffers a
        lane has)."""
        return COLD_READ_BYTES

    @property
    def held(self) -> bool:
        return self._ctx is not None


class CudaWriter(ArenaWriter):
    """Fills an arena from files: each loader thread preads into its lane's pinned buffers and
    copies them to the arena (mapped read-write here for the fill) on the lane's stream.

    Files mostly in the page cache are read in cache-sized pieces; the others in ops of
    COLD_READ_BYTES, read with O_DIRECT in DIRECT_READ_BYTES spans (`cold_reads = "direct"`, the
    default, where the file system allows it) or buffered, one read per op. A file that
    was not in the page cache at all is dropped from it again when the writer closes (its header,
    and everything where reads were buffered): once per file, because dropping each range as it
    was read made the H200 machine's buffered cold fill 20% slower (1.63 against 2.06 GB/s).
    """

    def __init__(self, arena: CudaArena, staging: Staging) -> None:
        self._gpu, self._size = arena._gpu, arena.size
        self._staging = staging
        self._lanes: list[_Lane] = []
        self._local = threading.local()
        self._lock = threading.Lock()
        self._reads: dict[int, int] = {}  # fd -> bytes per read
        self._drop: dict[int, tuple[int, int]] = {}  # fd -> inode, to drop from the page cache at close
        self._direct: dict[int, int] = {}  # fd -> its O_DIRECT descriptor (cold files), closed at close
        self._refused: set[int] = set()  # fds whose O_DIRECT reads the file system refused: read buffered
        self._read_ahead: dict[int, tuple[int, int]] = {}  # fd -> the range the loader had read ahead
        self._inodes: list[tuple[int, int]] = []  # the files this writer reads (`_LOADING`)
        self._ctx = staging.open()
        try:
            with current(self._ctx):
                self._map = VaMapping(arena._handle, self._gpu, arena.size, writable=True)
        except BaseException:
            staging.close()
            raise

    def hint(self, fd: int, cached_fraction: float, read_ahead: tuple[int, int] | None = None) -> None:
        cold = cached_fraction < WARM_FRACTION
        self._reads[fd] = self._staging.cold_read if cold else self._staging.warm_read
        if read_ahead is not None:
            self._read_ahead[fd] = read_ahead
        if cold and self._staging.direct_reads and fd not in self._direct:
            direct = open_direct(fd)
            if direct is not None:
                self._direct[fd] = direct
        inode = _Inodes.key(fd)
        with self._lock:
            if inode not in self._inodes:
                self._inodes.append(inode)
                _LOADING.add(inode)
            if cached_fraction < DROP_FRACTION:
                self._drop[fd] = inode

    def batch_bytes(self, fd: int) -> int | None:
        """One read's bytes: cold files' ops of small tensors are gathered in COLD_READ_BYTES reads
        too (4 MiB reads of a cold file left the H200 machine's disk at 1.50 GB/s, 16 MiB at 1.68)."""
        return self._reads.get(fd)

    def _lane(self) -> _Lane:
        lane: _Lane | None = getattr(self._local, "lane", None)
        if lane is None:
            lane = self._local.lane = self._staging.take()
            lane.reading = lane.waiting = lane.pinning = 0.0  # pooled lanes carry an earlier load's
            with self._lock:
                self._lanes.append(lane)
        return lane

    def _target(self, arena_offset: int, nbytes: int) -> int:
        """The device address of an arena range, with this writer's context current in the calling thread."""
        if arena_offset < 0 or nbytes < 0 or arena_offset + nbytes > self._size:
            raise BadRequest(f"copy of {nbytes} bytes at {arena_offset} falls outside the arena ({self._size} bytes)")
        if self._map.ptr == 0:
            raise Internal("copy into a CUDA arena writer that is already closed")
        # Loader threads are plain threads: bind the context each call (cheap) rather than trusting
        # whatever an earlier task left current in this thread.
        _check(cuda.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
        return self._map.ptr + arena_offset

    def copy_from_file(self, fd: int, file_offset: int, arena_offset: int, nbytes: int) -> None:
        """An op of a cold file read with O_DIRECT is read from the page cache instead where all of
        it is there: what the loader read ahead while this writer was made (`hint`), and in a file
        that was partly cached (under WARM_FRACTION) whatever the cache holds, op by op (a
        `resident` check costs three calls per 16 MiB op). A file whose O_DIRECT reads its file
        system refuses (it opened) is read buffered from then on."""
        dst = self._target(arena_offset, nbytes)
        read_bytes = self._reads.get(fd, self._staging.warm_read)
        direct = self._direct.get(fd) if fd not in self._refused else None
        start, end = self._read_ahead.get(fd, (0, 0))
        if direct is not None and (start <= file_offset and file_offset + nbytes <= end
                                   or resident(fd, file_offset, nbytes)):
            read_bytes = self._staging.warm_read
        elif direct is not None:
            try:
                self._lane().copy_direct(direct, file_offset, dst, nbytes,
                                         min(read_bytes, DIRECT_READ_BYTES or read_bytes))
                return
            except OSError as e:  # a file system that opens with O_DIRECT but will not read so
                if e.errno not in _REFUSALS:
                    raise
                self._refused.add(fd)  # its descriptor stays open (other threads' reads) until close
                _warn_buffered(fd, e)
        # The copies an O_DIRECT attempt queued are overwritten: later on the same stream.
        self._lane().copy(fd, file_offset, dst, nbytes, read_bytes)

    def copy_scattered(self, fd: int, file_offset: int, arena_offset: int, nbytes: int, runs: tuple[Run, ...]) -> None:
        """Runs of several wide pieces each (experts of one shape, say): a plain read and a 2D copy
        per run (`_Lane.scatter`). Otherwise (many short runs, or narrow rows, which the copy
        engine moves slowly one by one) one preadv gathers the pieces into the arena layout and one
        copy moves it (`_Lane.gather`); where that cannot be done, `scatter` still can."""
        dst = self._target(arena_offset, nbytes)
        lane = self._lane()
        read_bytes = self._reads.get(fd, self._staging.warm_read)
        lane.fit(read_bytes)
        if scatter_pays(runs) or not lane.gather(fd, file_offset, dst, nbytes, runs):
            lane.scatter(fd, file_offset, dst, runs, read_bytes)

    def close(self) -> None:
        with self._lock:
            lanes, self._lanes = self._lanes, []
            drop, self._drop = self._drop, {}
            inodes, self._inodes = self._inodes, []
            direct, self._direct = self._direct, {}
            if self._map.ptr == 0:
                return
        try:
            with current(self._ctx):
                failed: list[tuple[_Lane, Exception]] = []
                for lane in lanes:
                    try:
                        lane.synchronize()
                    except Exception as e:  # noqa: BLE001 - its copies failed: closed below, never pooled
                        failed.append((lane, e))
                if lanes:
                    log.debug("CUDA writer: %d loader threads spent %.3f s in reads, %.3f s waiting for a buffer's "
                              "last copy and %.3f s pinning larger buffers (thread-seconds, against the threads "
                              "times the copy phase)", len(lanes), sum(lane.reading for lane in lanes),
                              sum(lane.waiting for lane in lanes), sum(lane.pinning for lane in lanes))
                bad = [lane for lane, _ in failed]
                self._staging.give([lane for lane in lanes if lane not in bad])
                _cleanup(self._map.close, *(lane.close for lane in bad))
                if failed:
                    raise failed[0][1]
        finally:
            for fd in direct.values():
                os.close(fd)
            self._staging.close()
            _LOADING.remove_all(inodes)
            # Not while another load reads the same file: it would go back to the disk for it.
            _drop_later([fd for fd, inode in drop.items() if not _LOADING.has(inode)])


class _Inodes:
    """Files (device, inode) that loads in this process are reading, counted."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count: dict[tuple[int, int], int] = {}

    @staticmethod
    def key(fd: int) -> tuple[int, int]:
        st = os.fstat(fd)
        return st.st_dev, st.st_ino

    def add(self, inode: tuple[int, int]) -> None:
        with self._lock:
            self._count[inode] = self._count.get(inode, 0) + 1

    def remove_all(self, inodes: list[tuple[int, int]]) -> None:
        with self._lock:
            for inode in inodes:
                left = self._count.pop(inode, 1) - 1
                if left:
                    self._count[inode] = left

    def has(self, inode: tuple[int, int]) -> bool:
        with self._lock:
            return inode in self._count


_LOADING = _Inodes()


def _drop_later(fds: list[int]) -> None:
    """Drop whole files from the page cache in a thread of their own (through dups, as the caller
    closes its fds): freeing 16 GB of pages takes a while, and nothing needs to wait for it. A file
    that cannot be dropped stays cached: a log line, never a failed load."""
    dups: list[int] = []
    try:
        for fd in fds:
            dups.append(os.dup(fd))
    except OSError as e:
        for fd in dups:
            os.close(fd)
        log.warning("cannot drop loaded files from the page cache: %s", e.strerror)
        return
    if not dups:
        return

    def drop() -> None:
        for fd in dups:
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError as e:
                log.warning("cannot drop a loaded file from the page cache: %s", e.strerror)
            finally:
                os.close(fd)

    threading.Thread(target=drop, name="wcd-drop-cache", daemon=True).start()


class CudaReader(ArenaReader):
    """Device-to-host copies through one lane of the GPU's `Staging` (pinned buffers kept between
    loads and verifies: pinning costs ~0.4 s per GiB), taken at the first read and given back at
    `close`; the reader holds the staging open meanwhile, so it lingers after a verify as after a load.

    `windows` copies READ_WINDOW bytes at a time, round the lane's buffers on its stream: the next
    window (and, told the next span, that span's first) is on its way while the caller hashes
    this one. A lane whose copies failed is closed at `close`, never pooled.
    """

    def __init__(self, arena: CudaArena) -> None:
        super().__init__(arena)
        self._cuda_arena = arena
        arena._hold_reads()
        self._holding = True  # until `close`: the arena's read mapping stays while any reader is open
        self._staging = arena._staging
        self._ctx: Any = None
        self._lane: _Lane | None = None
        self._turn = 0  # the buffer the next copy goes into
        self._ahead: tuple[int, int, int] | None = None  # (device address, bytes, buffer) copied for the next call
        self._broken = False

    def _take(self) -> _Lane:
        if self._lane is None:
            if self._ctx is None:
                self._ctx = self._staging.open()
            with current(self._ctx):
                self._lane = self._staging.take()
        return self._lane

    def windows(self, offset: int, nbytes: int, then: tuple[int, int] | None = None) -> Iterator[memoryview]:
        _, src = self._cuda_arena._source(offset, nbytes)
        lane = self._take()
        step = min(lane.nbytes, READ_WINDOW)
        parts = [(src + pos, min(step, nbytes - pos)) for pos in range(0, nbytes, step)]
        queued: list[tuple[int, int]] = []  # (buffer, bytes) of the copies this call issued, in order
        ahead, self._ahead = self._ahead, None
        if ahead is not None and parts and ahead[:2] == parts[0]:
            queued.append((ahead[2], ahead[1]))
            parts = parts[1:]
        parts.reverse()  # popped from the end, in order

        def issue(address: int, n: int) -> int:
            i, self._turn = self._turn, (self._turn + 1) % len(lane.ptrs)
            with current(self._ctx):
                lane.fetch(i, address, n)
            return i

        def fill() -> None:
            """Every free buffer gets the next window; once none is left, the next call's first."""
            while parts and len(queued) < len(lane.ptrs):
                address, n = parts.pop()
                queued.append((issue(address, n), n))
            if not parts and then is not None and self._ahead is None and len(queued) < len(lane.ptrs):
                _, address = self._cuda_arena._source(*then)
                n = min(step, then[1])
                if n:
                    self._ahead = (address, n, issue(address, n))

        try:
            fill()
            while queued:
                i, n = queued[0]
                with current(self._ctx):
                    view = lane.landed(i, n)
                yield view
                del queued[0]
                fill()
        except Exception:
            self._broken = True  # a copy failed (or may be in flight unrecorded): close the lane, never pool it
            raise

    def close(self) -> None:
        """Give the lane back once its copies have finished, or close it if they failed (as
        `CudaWriter.close` does); then this reader's hold on the staging ends."""
        ctx, lane, self._ctx, self._lane, self._ahead = self._ctx, self._lane, None, None, None
        broken, self._broken = self._broken, False
        holding, self._holding = self._holding, False
        if ctx is None:
            if holding:
                self._cuda_arena._end_reads()
            return
        try:
            if lane is not None:
                with current(ctx):
                    error: Exception | None = None
                    if not broken:
                        try:
                            lane.synchronize()
                        except Exception as e:  # noqa: BLE001 - its copies failed: closed below, never pooled
                            error = e
                    if broken or error is not None:
                        lane.close()
                    else:
                        self._staging.give([lane])
                    if error is not None:
                        raise error
        finally:
            try:
                self._staging.close()
            finally:
                if holding:
                    self._cuda_arena._end_reads()


class CudaArena(Arena):
    kind = "cuda"

    def __init__(self, gpu: Gpu, size: int, handle: Any, fd: int, staging: Staging, label: str) -> None:
        """Owns `handle` (an allocation handle) and `fd` (its exported POSIX fd) from now on."""
        self.label = label  # the entry's name, for messages
        self.device = gpu.uuid
        self.size = size
        self._gpu = gpu
        self._handle = handle
        self._fd = fd
        self._staging = staging
        self._lock = threading.Lock()
        self._reader: VaMapping | None = None
        self._reader_ctx: Any = None
        self._readers = 0  # readers open (`_hold_reads`): the read mapping goes with the last

    def fd(self) -> int:
        return self._fd

    def writer(self) -> CudaWriter:
        return CudaWriter(self, self._staging)

    def seal(self) -> None:
        """Nothing to do: readers map CUDA arenas read-only (CU_MEM_ACCESS_FLAGS_PROT_READ)."""

    def check_adopted(self) -> None:
        """An adopted allocation holds at least `size` bytes: no size query exists for a handle, and
        mapping `size` bytes fails if it is smaller. Mapping needs a context: the GPU's staging
        context (`Staging.open`), so the checks of every entry re-adopted on one GPU, and the loads
        after them, create it once; it lingers like a load's.

        Not on a GPU in exclusive-process compute mode: an engine that stayed attached across the
        restart may hold its only context, and the daemon must not take it from engines reattaching
        either. There the record's size stands (the daemon sealed that record itself, and only it
        can put fds in its fd store); a short allocation would fail the engine's mapping instead."""
        if exclusive_process(self._gpu):
            return
        ctx = self._staging.open()
        try:
            with current(ctx):
                VaMapping(self._handle, self._gpu, self.size, writable=False).close()
        except Internal as e:
            raise BadRequest(f"{self.label}: the arena is smaller than the {self.size} bytes its record says "
                             f"({e})") from None
        finally:
            self._staging.close()

    def _source(self, offset: int, nbytes: int) -> tuple[Any, int]:
        """(context, device address) of an arena range for reading, between `_hold_reads` and
        `_end_reads`. The first call maps the arena read-only and retains the primary context; both
        stay while any reader is open (`verify` reads thousands of ranges from several threads),
        and go with the last: a daemon that verified an arena keeps no context for it (523 MiB of
        an H200's memory, and an exclusive-process GPU kept from engines) beyond the staging's linger."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise BadRequest(f"read of {nbytes} bytes at {offset} falls outside the arena ({self.size} bytes)")
        with self._lock:
            if self._fd < 0:
                raise Internal("read from a CUDA arena that is already closed")
            if self._reader is None:
                ctx = retain_context(self._gpu)
                try:
                    with current(ctx):
                        self._reader = VaMapping(self._handle, self._gpu, self.size, writable=False)
                except BaseException:
                    release_context(self._gpu)
                    raise
                self._reader_ctx = ctx
            return self._reader_ctx, self._reader.ptr + offset

    def _read(self, offset: int, nbytes: int) -> bytes:
        """Device-to-host copy into fresh pageable memory (for small reads; `reader` for many)."""
        self._hold_reads()
        try:
            ctx, src = self._source(offset, nbytes)
            out = bytearray(nbytes)
            if nbytes:
                with current(ctx):
                    _check(cuda.cuMemcpyDtoH(out, src, nbytes), "cuMemcpyDtoH")
            return bytes(out)
        finally:
            self._end_reads()

    def _hold_reads(self) -> None:
        with self._lock:
            self._readers += 1

    def _end_reads(self) -> None:
        """A reader is done; the last one unmaps the read mapping and releases its context."""
        with self._lock:
            self._readers -= 1
            if self._readers or self._reader is None:
                return
            reader, self._reader = self._reader, None
        _cleanup(lambda: self._close_reader(reader), lambda: release_context(self._gpu))

    def reader(self) -> CudaReader:
        return CudaReader(self)

    def _release(self) -> None:
        """Release the allocation and close the exported fd; the memory returns to the driver once
        every other fd and mapping of it (clients, a writer still open) is gone."""
        with self._lock:
            if self._fd < 0:
                return
            fd, self._fd = self._fd, -1
            reader, self._reader = self._reader, None
        steps: list[Callable[[], object]] = []
        if reader is not None:
            steps += [lambda: self._close_reader(reader), lambda: release_context(self._gpu)]
        steps += [lambda: _check(cuda.cuMemRelease(self._handle), "cuMemRelease"), lambda: os.close(fd)]
        _cleanup(*steps)

    def _close_reader(self, reader: VaMapping) -> None:
        with current(self._reader_ctx):
            reader.close()


class CudaBackend(ArenaBackend):
    def __init__(self, staging_bytes: int = STAGING_BYTES, staging_buffers: int = STAGING_BUFFERS,
                 linger_s: float = LINGER_S) -> None:
        gpus()  # fail early, with one clear line, when there is no driver
        self._shape = (staging_bytes, staging_buffers)
        self._linger_s = linger_s
        self._direct_reads = False
        self._stagings: dict[int, Staging] = {}
        self._lock = threading.Lock()

    def staging(self, gpu: Gpu) -> Staging:
        with self._lock:
            staging = self._stagings.get(gpu.ordinal)
            if staging is None:
                staging = self._stagings[gpu.ordinal] = Staging(gpu, *self._shape, self._linger_s)
                staging.direct_reads = self._direct_reads
            return staging

    def configure(self, linger_s: float, direct_reads: bool = False) -> None:
        """How long a GPU's context and staging stay after its last load, and whether cold files
        are read with O_DIRECT (the daemon's config)."""
        with self._lock:
            changed, self._linger_s = linger_s != self._linger_s, linger_s
            self._direct_reads = direct_reads
            stagings = list(self._stagings.values())
        for staging in stagings:
            staging.direct_reads = direct_reads
            if changed:
                staging.set_linger(linger_s)

    def prepare(self, device: str, lanes: int) -> None:
        """Ready `device` for a load about to start (blocking: call it from a thread)."""
        self.staging(find_gpu(device)).prepare(lanes)

    def release(self) -> None:
        """Release every GPU's lingering context and staging now (daemon shutdown)."""
        with self._lock:
            stagings = list(self._stagings.values())
        _cleanup(*(s.release for s in stagings))

    def lingering(self) -> list[str]:
        with self._lock:
            stagings = list(self._stagings.values())
        return [f"the CUDA context and load staging of {s.gpu.label}" for s in stagings if s.held]

    def canonical(self, device: str) -> str:
        return find_gpu(device).uuid

    def arena_size(self, nbytes: int, device: str) -> int:
        gpu = find_gpu(device)
        return align_up(max(nbytes, 1), granularity(gpu))

    def create(self, device: str, size: int, label: str) -> CudaArena:
        gpu = find_gpu(device)
        size = align_up(max(size, 1), granularity(gpu))
        try:
            handle = _check(cuda.cuMemCreate(size, _alloc_prop(gpu), 0), "cuMemCreate")
        except OutOfMemory:
            raise OutOfMemory(f"{gpu.label} {gpu.uuid}: out of GPU memory for {format_size(size)} ({label!r}); "
                              "evict entries or lower this device's budget") from None
        try:
            fd = int(_check(cuda.cuMemExportToShareableHandle(handle, POSIX_FD, 0), "cuMemExportToShareableHandle"))
            os.set_inheritable(fd, False)
        except BaseException:
            cuda.cuMemRelease(handle)
            raise
        return CudaArena(gpu, size, handle, fd, self.staging(gpu), label)

    def adopt(self, fd: int, device: str, size: int, label: str) -> CudaArena:
        """Take over an exported arena fd (systemd's fd store after a restart). Checks that it is a
        CUDA allocation on `device`, without a CUDA context (retaining one creates it: ~0.25 s on an
        H200, which the daemon must not spend before READY); whether it holds `size` bytes is
        `CudaArena.check_adopted`'s question. The fd is left open on failure."""
        gpu = find_gpu(device)
        try:
            handle = _check(cuda.cuMemImportFromShareableHandle(fd, POSIX_FD), "cuMemImportFromShareableHandle")
        except (Internal, BadRequest) as e:
            raise BadRequest(f"{label}: not an exported CUDA arena ({e})") from None
        try:
            prop = _check(cuda.cuMemGetAllocationPropertiesFromHandle(handle), "cuMemGetAllocationPropertiesFromHandle")
            if prop.location.id != gpu.ordinal:
                raise BadRequest(f"{label}: the arena lives on cuda:{prop.location.id}, its record says {gpu.label}")
        except BaseException:
            cuda.cuMemRelease(handle)
            raise
        return CudaArena(gpu, size, handle, fd, self.staging(gpu), label)

    def total_memory(self, device: str) -> int:
        """`cuDeviceTotalMem`: no context and no NVML, whose loading and start took most of the
        0.35 s that start-up spent on devices on the H200 machine (cuInit ~0.1 s is the rest)."""
        gpu = find_gpu(device)
        dev = _check(cuda.cuDeviceGet(gpu.ordinal), "cuDeviceGet")
        return int(_check(cuda.cuDeviceTotalMem(dev), "cuDeviceTotalMem"))

    def info(self, device: str) -> DeviceInfo:
        """Device memory from NVML when cuda-bindings ships it (no CUDA context in the daemon); else
        `cuMemGetInfo` under the primary context, which creates one if nothing holds it."""
        gpu = find_gpu(device)
        mem = _nvml_memory(gpu.uuid)
        if mem is None:
            ctx = retain_context(gpu)
            try:
                with current(ctx):
                    free, total = _check(cuda.cuMemGetInfo(), "cuMemGetInfo")
            finally:
                release_context(gpu)
            mem = (int(total), int(free))
        return DeviceInfo(gpu.uuid, gpu.label, *mem)


@cache
def _nvml() -> Any:
    try:
        from cuda.bindings import nvml

        nvml.init_v2()
        return nvml
    except Exception:  # noqa: BLE001 - older cuda-bindings (no nvml module) or no libnvidia-ml
        return None


def _nvml_memory(uuid: str) -> tuple[int, int] | None:
    nvml = _nvml()
    if nvml is None:
        return None
    try:
        mem = nvml.device_get_memory_info_v2(nvml.device_get_handle_by_uuid(uuid))
    except nvml.NvmlError:
        return None
    return int(mem.total), int(mem.free)
