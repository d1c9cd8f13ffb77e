"""CUDA arenas: one VMM allocation (`cuMemCreate`) per entry per GPU, exported once as a POSIX fd;
their writer (files -> pinned lanes -> the arena), reader (verify's device-to-host windows) and
`CudaBackend`.

Creating and exporting needs only `cuInit`, no CUDA context (DESIGN §9); the device's primary
context is retained only while an arena is being filled (`CudaWriter`) or read back (`read`).
Devices are "cuda:N" or a GPU UUID; the UUID is canonical, so a client with another
CUDA_VISIBLE_DEVICES finds the same GPU. Needs the `cuda` extra (cuda-bindings), imported lazily.
Driver calls are in `cuda_driver`, lanes and their pool in `staging`, O_DIRECT in `direct_io`.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

from cuda.bindings import driver as cuda

from wcd.arenas.base import Arena, ArenaBackend, ArenaReader, ArenaWriter, DeviceInfo
from wcd.arenas.cuda_driver import (
    POSIX_FD,
    VaMapping,
    alloc_prop,
    check,
    cleanup,
    current,
    exclusive_process,
    find_gpu,
    gpus,
    granularity,
    nvml_memory,
    release_context,
    retain_context,
)
from wcd.arenas.cudrv import Gpu
from wcd.arenas.direct_io import REFUSALS, open_direct, warn_buffered
from wcd.arenas.staging import LINGER_S, Lane, Staging, scatter_pays
from wcd.checkpoint import Run
from wcd.errors import BadRequest, Internal, OutOfMemory
from wcd.manifest import align_up
from wcd.pagecache import LOADING, Inodes, drop_files_later, resident
from wcd.tuning import DEFAULT, LoadTuning
from wcd.units import format_size

log = logging.getLogger("wcd")

WARM_FRACTION = 0.9  # a file with at least this much in the page cache is read as warm
DROP_FRACTION = 0.02  # below this (the header and fingerprint samples this load read), it was not cached


class CudaWriter(ArenaWriter):
    """Fills an arena from files: each loader thread preads into its lane's pinned buffers and
    copies them to the arena (mapped read-write here for the fill) on the lane's stream.

    Files mostly in the page cache are read in cache-sized pieces; the others in ops of the
    tuning's `cold_read_bytes`, read with O_DIRECT in `direct_read_bytes` spans (`cold_reads =
    "direct"`, the default, where the file system allows it) or buffered, one read per op. A file
    that was not in the page cache at all is dropped from it again when the writer closes (its
    header, and everything where reads were buffered): once per file, since dropping each range as
    it is read slows a buffered cold fill down.
    """

    def __init__(self, arena: CudaArena, staging: Staging) -> None:
        self._gpu, self._size = arena._gpu, arena.size
        self._staging = staging
        self._lanes: list[Lane] = []
        self._local = threading.local()
        self._lock = threading.Lock()
        self._reads: dict[int, int] = {}  # fd -> bytes per read
        self._drop: dict[int, tuple[int, int]] = {}  # fd -> inode, to drop from the page cache at close
        self._direct: dict[int, int] = {}  # fd -> its O_DIRECT descriptor (cold files), closed at close
        self._refused: set[int] = set()  # fds whose O_DIRECT reads the file system refused: read buffered
        self._read_ahead: dict[int, tuple[int, int]] = {}  # fd -> the range the loader had read ahead
        self._inodes: list[tuple[int, int]] = []  # the files this writer reads (`LOADING`)
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
        inode = Inodes.key(fd)
        with self._lock:
            if inode not in self._inodes:
                self._inodes.append(inode)
                LOADING.add(inode)
            if cached_fraction < DROP_FRACTION:
                self._drop[fd] = inode

    def batch_bytes(self, fd: int) -> int | None:
        """One read's bytes: cold files' ops of small tensors are gathered in `cold_read_bytes` reads
        too (a disk serves a cold file faster in larger reads)."""
        return self._reads.get(fd)

    def _lane(self) -> Lane:
        lane: Lane | None = getattr(self._local, "lane", None)
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
        check(cuda.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
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
                                         min(read_bytes, self._staging.tuning.direct_read_bytes))
                return
            except OSError as e:  # a file system that opens with O_DIRECT but will not read so
                if e.errno not in REFUSALS:
                    raise
                self._refused.add(fd)  # its descriptor stays open (other threads' reads) until close
                warn_buffered(fd, e)
        # The copies an O_DIRECT attempt queued are overwritten: later on the same stream.
        self._lane().copy(fd, file_offset, dst, nbytes, read_bytes)

    def copy_scattered(self, fd: int, file_offset: int, arena_offset: int, nbytes: int, runs: tuple[Run, ...]) -> None:
        """Runs of several wide pieces each (experts of one shape, say): a plain read and a 2D copy
        per run (`Lane.scatter`). Otherwise (many short runs, or narrow rows, which the copy
        engine moves slowly one by one) one preadv gathers the pieces into the arena layout and one
        copy moves it (`Lane.gather`); where that cannot be done, `scatter` still can."""
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
                failed: list[tuple[Lane, Exception]] = []
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
                cleanup(self._map.close, *(lane.close for lane in bad))
                if failed:
                    raise failed[0][1]
        finally:
            for fd in direct.values():
                os.close(fd)
            self._staging.close()
            LOADING.remove_all(inodes)
            # Not while another load reads the same file: it would go back to the disk for it.
            drop_files_later([fd for fd, inode in drop.items() if not LOADING.has(inode)])


class CudaReader(ArenaReader):
    """Device-to-host copies through one lane of the GPU's `Staging` (pinned buffers kept between
    loads and verifies: pinning costs ~0.4 s per GiB), taken at the first read and given back at
    `close`; the reader holds the staging open meanwhile, so it lingers after a verify as after a load.

    `windows` copies the tuning's `read_window` bytes at a time, round the lane's buffers on its stream: the next
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
        self._lane: Lane | None = None
        self._turn = 0  # the buffer the next copy goes into
        self._ahead: tuple[int, int, int] | None = None  # (device address, bytes, buffer) copied for the next call
        self._broken = False

    def _take(self) -> Lane:
        if self._lane is None:
            if self._ctx is None:
                self._ctx = self._staging.open()
            with current(self._ctx):
                self._lane = self._staging.take()
        return self._lane

    def windows(self, offset: int, nbytes: int, then: tuple[int, int] | None = None) -> Iterator[memoryview]:
        _, src = self._cuda_arena._source(offset, nbytes)
        lane = self._take()
        step = min(lane.nbytes, self._staging.tuning.read_window)
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
        self.tuning = staging.tuning
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
                    check(cuda.cuMemcpyDtoH(out, src, nbytes), "cuMemcpyDtoH")
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
        cleanup(lambda: self._close_reader(reader), lambda: release_context(self._gpu))

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
        steps += [lambda: check(cuda.cuMemRelease(self._handle), "cuMemRelease"), lambda: os.close(fd)]
        cleanup(*steps)

    def _close_reader(self, reader: VaMapping) -> None:
        with current(self._reader_ctx):
            reader.close()


class CudaBackend(ArenaBackend):
    def __init__(self, tuning: LoadTuning = DEFAULT, linger_s: float = LINGER_S) -> None:
        gpus()  # fail early, with one clear line, when there is no driver
        self.tuning = tuning
        self._linger_s = linger_s
        self._direct_reads = False
        self._stagings: dict[int, Staging] = {}
        self._lock = threading.Lock()

    def staging(self, gpu: Gpu) -> Staging:
        with self._lock:
            staging = self._stagings.get(gpu.ordinal)
            if staging is None:
                staging = self._stagings[gpu.ordinal] = Staging(gpu, self.tuning, self._linger_s)
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
        cleanup(*(s.release for s in stagings))

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
            handle = check(cuda.cuMemCreate(size, alloc_prop(gpu), 0), "cuMemCreate")
        except OutOfMemory:
            raise OutOfMemory(f"{gpu.label} {gpu.uuid}: out of GPU memory for {format_size(size)} ({label!r}); "
                              "evict entries or lower this device's budget") from None
        try:
            fd = int(check(cuda.cuMemExportToShareableHandle(handle, POSIX_FD, 0), "cuMemExportToShareableHandle"))
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
            handle = check(cuda.cuMemImportFromShareableHandle(fd, POSIX_FD), "cuMemImportFromShareableHandle")
        except (Internal, BadRequest) as e:
            raise BadRequest(f"{label}: not an exported CUDA arena ({e})") from None
        try:
            prop = check(cuda.cuMemGetAllocationPropertiesFromHandle(handle), "cuMemGetAllocationPropertiesFromHandle")
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
        dev = check(cuda.cuDeviceGet(gpu.ordinal), "cuDeviceGet")
        return int(check(cuda.cuDeviceTotalMem(dev), "cuDeviceTotalMem"))

    def info(self, device: str) -> DeviceInfo:
        """Device memory from NVML when cuda-bindings ships it (no CUDA context in the daemon); else
        `cuMemGetInfo` under the primary context, which creates one if nothing holds it."""
        gpu = find_gpu(device)
        mem = nvml_memory(gpu.uuid)
        if mem is None:
            ctx = retain_context(gpu)
            try:
                with current(ctx):
                    free, total = check(cuda.cuMemGetInfo(), "cuMemGetInfo")
            finally:
                release_context(gpu)
            mem = (int(total), int(free))
        return DeviceInfo(gpu.uuid, gpu.label, *mem)

