"""Fill an arena from a checkpoint in worker threads, off the event loop, with progress.

The plan (from `Checkpoint.copy_plan`) is a list of file ranges -> arena offsets, large tensors
already split into chunks and runs of small ones batched. Every read goes through the descriptors
the checkpoint was opened with, never by path again. Worker threads execute it through the arena's writer (host: preadv
straight into the shared mapping; CUDA: pinned staging + async copies). Progress is a byte
counter the event loop reads; cancellation is checked between chunks.

`verify` reads back the same way: per-tensor sha256 of an arena, compared in the same pass with
the checkpoint's bytes (memcmp, no hashing of the file side), from `digest_workers()` threads.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import pairwise, repeat
from operator import itemgetter
from typing import Protocol

from wcd import key
from wcd.arenas.base import Arena, ArenaReader, pread_into, scratch
from wcd.checkpoint import BATCH_BYTES, Checkpoint, CopyOp
from wcd.errors import LoadFailed
from wcd.manifest import Manifest
from wcd.pagecache import cached_fraction

log = logging.getLogger("wcd")


class Cancelled(Exception):
    """The load was cancelled (the entry was evicted while loading)."""


class ProgressSink(Protocol):
    """Where a load reports the bytes it copied; `add` is called from several worker threads."""

    def add(self, n: int) -> None: ...


@dataclass
class Progress:
    total: int
    done: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, n: int) -> None:
        with self._lock:
            self.done += n


def default_workers() -> int:
    """Loader threads per load: one per core, 4 to 16 (beyond 16 the copies from the page cache
    slow down; 4 keep a small host's fills at a plain copy's rate: bench/RESULTS.md)."""
    return max(4, min(16, len(os.sched_getaffinity(0))))  # the cores this daemon may run on


@functools.cache
def _memcmp() -> Callable[[int, int, int], int]:
    """libc's memcmp, which ctypes calls without the GIL (verify compares from several threads)."""
    memcmp = ctypes.CDLL(None, use_errno=True).memcmp
    memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    memcmp.restype = ctypes.c_int
    return memcmp


# One POSIX_FADV_WILLNEED reads at most max(io_pages, ra_pages) of what it is asked for (the kernel
# clamps it in force_page_cache_ra: 8 MiB on the CI VM, ~1 MiB on the H200's), so it is asked in
# pieces no larger than the smallest such limit Linux sets by default (BLK_DEF_MAX_SECTORS was
# 512 KiB before 6.9; read_ahead_kb defaults to 128 KiB).
ADVICE_BYTES = 512 << 10


def read_ahead(checkpoint: Checkpoint, cached: list[float], nbytes: int,
               stop: threading.Event | None = None, asked: dict[int, tuple[int, int]] | None = None) -> None:
    """Ask the kernel to read the first `nbytes` of tensor data in plan order (shard after shard,
    each from its first tensor) into the page cache, skipping shards that `cached` (their
    `cached_fraction`) says are there already. It queues the reads, ADVICE_BYTES per call, until
    all are queued or `stop` is set (a hint: an error ends it quietly). `asked` gets, per fd, the
    file range (start, end) asked for so far."""
    for h, fd, fraction in zip(checkpoint.headers, checkpoint.fds, cached):
        n = min(nbytes, h.file_size - h.data_start)
        if n <= 0:
            break
        if fraction < 1.0:
            for at in range(h.data_start, h.data_start + n, ADVICE_BYTES):
                if stop is not None and stop.is_set():
                    return
                size = min(ADVICE_BYTES, h.data_start + n - at)
                try:
                    os.posix_fadvise(fd, at, size, os.POSIX_FADV_WILLNEED)
                except OSError:
                    return
                if asked is not None:
                    asked[fd] = (h.data_start, at + size)
        nbytes -= n


@contextlib.contextmanager
def _reading_ahead(checkpoint: Checkpoint, cached: list[float], nbytes: int) -> Iterator[dict[int, tuple[int, int]]]:
    """`read_ahead` in a thread for as long as the block runs, where there is something to read
    ahead; stopped and joined at the block's end (it reads through the checkpoint's descriptors,
    which the caller closes). Yields what it asked for per fd (`read_ahead`'s `asked`), whole
    once the block has ended."""
    asked: dict[int, tuple[int, int]] = {}
    if not nbytes or min(cached, default=1.0) >= 1.0:
        yield asked
        return
    stop = threading.Event()
    thread = threading.Thread(target=read_ahead, args=(checkpoint, cached, nbytes, stop, asked),
                              name="wcd-read-ahead")
    thread.start()
    try:
        yield asked
    finally:
        stop.set()
        thread.join()


def fill_arena(
    arena: Arena, checkpoint: Checkpoint, plan: list[CopyOp] | Manifest, progress: ProgressSink,
    cancelled: Callable[[], bool] = lambda: False, workers: int | None = None, fingerprint: str | None = None,
    reads_ahead: bool = False,
) -> None:
    """Blocking: run every copy op, `workers` at a time, through the checkpoint's open descriptors.
    Call it from a thread, never the loop. `plan` is the ops, or the manifest to plan them from
    once the writer knows which files are in the page cache (it may read the others in larger
    pieces: `ArenaWriter.batch_bytes`). With `reads_ahead` (for writers that read through the
    page cache), files not all in the page cache are read ahead (`read_ahead`, up to the
    arena's `tuning.read_ahead_bytes`) while the writer is being made, and no longer.

    Then fail (`LoadFailed`) if a shard was written meanwhile: its size or times changed since it
    was opened, or (given the fingerprint taken at admission) its sampled bytes differ now. Either
    would leave the arena with a mix of old and new bytes under the old fingerprint.
    """
    times = [time.perf_counter()]
    cached = [cached_fraction(fd) for fd in checkpoint.fds]  # before this load reads tensor data
    with _reading_ahead(checkpoint, cached, arena.tuning.read_ahead_bytes if reads_ahead else 0) as asked:
        writer = arena.writer()
    times.append(time.perf_counter())
    try:
        for fd, fraction in zip(checkpoint.fds, cached):
            writer.hint(fd, fraction, asked.get(fd))
        ops = plan if not isinstance(plan, Manifest) else \
            checkpoint.copy_plan(plan, chunk=arena.tuning.chunk_bytes,
                                 batch=[writer.batch_bytes(fd) or BATCH_BYTES for fd in checkpoint.fds])
        times.append(time.perf_counter())
        failed = threading.Event()  # one failed chunk stops the others early

        def run(op: CopyOp) -> None:
            if failed.is_set() or cancelled():
                raise Cancelled()
            try:
                fd = checkpoint.fds[op.shard]
                if op.runs:
                    writer.copy_scattered(fd, op.file_offset, op.arena_offset, op.nbytes, op.runs)
                else:
                    writer.copy_from_file(fd, op.file_offset, op.arena_offset, op.nbytes)
            except BaseException:
                failed.set()
                raise
            progress.add(op.file_nbytes)

        with ThreadPoolExecutor(workers or default_workers(), thread_name_prefix="wcd-load") as pool:
            futures = [pool.submit(run, op) for op in ops]
        errors = [e for e in (f.exception() for f in futures) if e is not None]
        real = [e for e in errors if not isinstance(e, Cancelled)]
        if real:
            raise real[0]
        if errors:
            raise Cancelled()
        times.append(time.perf_counter())
        changed = checkpoint.changed()
        if not changed and fingerprint is not None and key.fingerprint(checkpoint) != fingerprint:
            changed = [checkpoint.path]
        if changed:
            raise LoadFailed(f"{changed[0]} changed while it was being loaded (written in place?); nothing "
                             "was kept: load it again once it is complete")
        times.append(time.perf_counter())
    except OSError as e:
        raise LoadFailed(f"{checkpoint.path}: read failed: {e.strerror or e}") from None
    finally:
        writer.close()
    times.append(time.perf_counter())
    writing, planning, copying, checking, closing = (b - a for a, b in pairwise(times))
    log.debug("filled from %s: cache check and writer %.3f s, plan %.3f s, %d copies %.3f s, checks %.3f s, "
              "close %.3f s", checkpoint.path, writing, planning, len(ops), copying, checking, closing)


DIGEST_CHUNK = 16 << 20
# Arena bytes between two pieces that one read still covers (the layout pads tensors to 256).
READ_GAP = 4096
# (name, arena offset, nbytes, (fd, file offset) of the same bytes to compare with, or None)
_Range = tuple[str, int, int, "tuple[int, int] | None"]
# (arena offset, nbytes, fd or -1, file offset)
_Piece = tuple[int, int, int, int]


def _address(view: memoryview) -> int:
    """The address of a writable buffer's first byte. The temporary ctypes object that exports it
    is gone when this returns, so the owner can still release its buffer; the address stays valid
    as long as that buffer does (a reader's: until its next read)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class _FileBuffer:
    """One thread's reusable buffer for file bytes: preadv fills it, memcmp reads it by address."""

    def __init__(self) -> None:
        self.view = scratch(0)

    def reserve(self, nbytes: int) -> int:
        """Make room for `nbytes`; returns the buffer's address (valid until the next `reserve`)."""
        if len(self.view) < nbytes:
            self.view.release()
            self.view = scratch(nbytes)
        return _address(self.view) if nbytes else 0


def _tasks(ranges: list[_Range]) -> list[list[_Piece]]:
    """Ranges (sorted by offset) split into `DIGEST_CHUNK` pieces, grouped into tasks that each read
    one arena span of at most `DIGEST_CHUNK` bytes (so a reader's buffer never grows past it):
    100,000 small tensors make ~100 tasks, not 100,000 reads."""
    tasks: list[list[_Piece]] = []
    start, end = -DIGEST_CHUNK, -DIGEST_CHUNK
    for _, offset, nbytes, source in ranges:
        fd, file_offset = source if source is not None else (-1, 0)
        for pos in range(0, nbytes, DIGEST_CHUNK):
            n, at = min(DIGEST_CHUNK, nbytes - pos), offset + pos
            if at + n - start > DIGEST_CHUNK or not end <= at <= end + READ_GAP:
                tasks.append([])
                start = at
            tasks[-1].append((at, n, fd, file_offset + pos))
            end = at + n
    return tasks


def _span(task: list[_Piece]) -> tuple[int, int]:
    """(arena offset, nbytes) of the arena span a task reads."""
    return task[0][0], task[-1][0] + task[-1][1] - task[0][0]


def _run_task(reader: ArenaReader, files: _FileBuffer, task: list[_Piece],
              then: tuple[int, int] | None = None) -> list[tuple[bytes, bool]]:
    """(sha256, same as the file) of each piece. The task's arena span is read in windows (one, or
    several from a reader that copies the next while this one is compared: `ArenaReader.windows`;
    `then` is the span of this thread's next task); per window, the pieces' parts in it are
    compared with their file bytes (`_compare`) and fed to their hashes; all of it without the GIL."""
    first, nbytes = _span(task)
    hashes = [hashlib.sha256() for _ in task]
    same = [fd >= 0 for _, _, fd, _ in task]
    start, i = first, 0  # the window's arena offset; the first piece that does not end before it
    for window in reader.windows(first, nbytes, then):
        stop = start + len(window)
        parts: list[tuple[int, int, int, int, int]] = []  # (piece, offset in window, nbytes, fd, file offset)
        k = i
        while k < len(task) and task[k][0] < stop:
            at, n, fd, file_offset = task[k]
            lo, hi = max(at, start), min(at + n, stop)
            if lo < hi:
                parts.append((k, lo - start, hi - lo, fd, file_offset + lo - at))
            k += 1
        for k, ok in _compare(window, parts, files):
            same[k] = same[k] and ok
        for k, rel, n, _, _ in parts:
            hashes[k].update(window[rel : rel + n])
        while i < len(task) and task[i][0] + task[i][1] <= stop:
            i += 1
        start = stop
    return [(h.digest(), ok) for h, ok in zip(hashes, same)]


def _compare(window: memoryview, parts: list[tuple[int, int, int, int, int]],
             files: _FileBuffer) -> list[tuple[int, bool]]:
    """(piece, equal) for each part with a file source: one preadv per run of parts that lie back
    to back in a file, one memcmp per run back to back in the window (part by part only where
    that run differs)."""
    memcmp = _memcmp()
    # The file bytes of the compared parts go one after the other into the file buffer, in order.
    runs: list[tuple[int, int, int]] = []  # (fd, file offset, nbytes)
    places: list[int] = []  # per part: where its file bytes landed, -1 if it has none
    filled = 0
    for _, _, n, fd, file_offset in parts:
        if fd < 0:
            places.append(-1)
            continue
        if runs and runs[-1][0] == fd and runs[-1][1] + runs[-1][2] == file_offset:
            runs[-1] = (fd, runs[-1][1], runs[-1][2] + n)
        else:
            runs.append((fd, file_offset, n))
        places.append(filled)
        filled += n
    if not filled:
        return []
    file_at, window_at = files.reserve(filled), _address(window)
    pos = 0
    for fd, file_offset, n in runs:
        pread_into(fd, files.view[pos : pos + n], file_offset)
        pos += n
    out: list[tuple[int, bool]] = []
    i = 0
    while i < len(parts):
        if places[i] < 0:
            i += 1
            continue
        j, end = i + 1, parts[i][1] + parts[i][2]
        while j < len(parts) and places[j] >= 0 and parts[j][1] == end:  # no padding between them
            end += parts[j][2]
            j += 1
        if memcmp(window_at + parts[i][1], file_at + places[i], end - parts[i][1]) == 0:
            out += [(parts[k][0], True) for k in range(i, j)]
        else:
            out += [(parts[k][0], memcmp(window_at + parts[k][1], file_at + places[k], parts[k][2]) == 0)
                    for k in range(i, j)]
        i = j
    return out


def _digest_ranges(arena: Arena, ranges: list[_Range]) -> tuple[dict[str, str], set[str]]:
    """sha256 of each named arena range, read through one reusable reader per thread; and the
    names of the ranges with a file source whose bytes there differ.

    Work is split into `DIGEST_CHUNK` pieces so that one large tensor does not serialise on one
    core: a range of one piece digests as sha256 of its bytes, a longer one as sha256 of its
    pieces' digests. hashlib, memcmp (through ctypes), preadv and the device copies all release
    the GIL, so threads work in parallel (sha256 with SHA-NI: ~1.2 GB/s per core). Each thread
    claims its next task before it runs the current one, so its reader can start on that early.
    """
    ranges = sorted(ranges, key=itemgetter(1))  # by arena offset: neighbours share a read
    tasks = _tasks(ranges)
    results: list[list[tuple[bytes, bool]]] = [[] for _ in tasks]
    order = iter(range(len(tasks)))
    lock = threading.Lock()
    failed = threading.Event()  # one failed task stops the other threads after their current one

    def claim() -> int | None:
        with lock:
            return None if failed.is_set() else next(order, None)

    def work() -> None:
        reader: ArenaReader | None = None
        try:
            reader, files = arena.reader(), _FileBuffer()
            upcoming = claim()
            while upcoming is not None:
                task, upcoming = upcoming, claim()
                arena.check_open()  # an entry evicted meanwhile: stop here rather than hold its memory
                then = _span(tasks[upcoming]) if upcoming is not None else None
                results[task] = _run_task(reader, files, tasks[task], then)
        except BaseException:
            failed.set()
            if reader is not None:
                with contextlib.suppress(Exception):  # the task's failure is the one to report
                    reader.close()
            raise
        reader.close()

    threads = digest_threads(len(ranges), sum(nbytes for _, _, nbytes, _ in ranges), len(tasks))
    with ThreadPoolExecutor(threads, thread_name_prefix="wcd-digest") as pool:
        futures = [pool.submit(work) for _ in range(threads)]
    for future in futures:
        future.result()
    pieces = (r for rs in results for r in rs)
    digests: dict[str, str] = {}
    differ: set[str] = set()
    chunk = DIGEST_CHUNK
    for name, _, nbytes, source in ranges:
        if 0 < nbytes <= chunk:
            digest, same = next(pieces)
            digests[name] = digest.hex()
        else:  # no piece (an empty range) or several
            parts = [next(pieces) for _ in range(-(-nbytes // chunk))]
            digests[name] = hashlib.sha256(b"".join(d for d, _ in parts)).hexdigest()
            same = all(ok for _, ok in parts)
        if source is not None and not same:
            differ.add(name)
    return digests, differ


def digest_workers() -> int:
    return max(2, min(32, os.cpu_count() or 2))


# Each tensor costs its thread a few Python steps holding the GIL (a memcmp and a sha256 update
# that drop and take it again): with tensors of tens of KB, more threads than a few only wait for
# each other (`bench/verify_threads.py`).
SMALL_TENSOR_BYTES = 1 << 20
SMALL_TENSOR_THREADS = 4


def digest_threads(tensors: int, nbytes: int, tasks: int) -> int:
    """Threads for a digest or verify pass: `digest_workers()`, but at most SMALL_TENSOR_THREADS
    where the tensors average under SMALL_TENSOR_BYTES, and never more than there are tasks."""
    threads = digest_workers()
    if tensors and nbytes < SMALL_TENSOR_BYTES * tensors:
        threads = min(threads, SMALL_TENSOR_THREADS)
    return max(1, min(threads, tasks))


def digest_arena(arena: Arena, manifest: Manifest) -> dict[str, str]:
    """Per-tensor content digest (sha256) of what is resident in an arena (blocking)."""
    digests, _ = _digest_ranges(arena, list(zip(manifest.names, manifest.offsets, manifest.sizes, repeat(None))))
    return digests


def content_digest(digests: dict[str, str]) -> str:
    """verify's `digest` of what is resident: sha256 over (name, NUL, per-tensor sha256) in name order."""
    total = hashlib.sha256()
    for name in sorted(digests):
        total.update(name.encode() + b"\0" + bytes.fromhex(digests[name]))
    return total.hexdigest()


def verify_arena(arena: Arena, manifest: Manifest, checkpoint: Checkpoint) -> tuple[dict[str, str], list[str]]:
    """One pass over an arena and a checkpoint on disk (blocking): the arena's per-tensor content
    digest (as `digest_arena`), and the tensors that differ: bytes not equal to the checkpoint's
    (compared, not hashed, on the file side), or missing on either side, or of another size.

    The checkpoint is read through its open descriptors; a shard written meanwhile fails with
    `LoadFailed`, since what was compared may then be a mix of old and new bytes.
    """
    stored = {name: (fd, h.data_start + begin, size) for h, fd in zip(checkpoint.headers, checkpoint.fds)
              for name, begin, size in zip(h.names, h.begins, h.sizes)}
    ranges: list[_Range] = []
    missing: set[str] = set()
    for name, offset, size in zip(manifest.names, manifest.offsets, manifest.sizes):
        fd, begin, nbytes = stored.pop(name, (-1, 0, -1))
        ranges.append((name, offset, size, (fd, begin) if nbytes == size else None))
        if nbytes != size:
            missing.add(name)
    missing.update(stored)  # in the checkpoint only
    try:
        digests, differ = _digest_ranges(arena, ranges)
    except OSError as e:
        raise LoadFailed(f"{checkpoint.path}: read failed: {e.strerror or e}") from None
    changed = checkpoint.changed()
    if changed:
        raise LoadFailed(f"{changed[0]} changed while it was being verified (written in place?): "
                         "verify again once it is complete")
    return digests, sorted(missing | differ)
