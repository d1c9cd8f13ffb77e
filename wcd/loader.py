"""Fill an arena from a checkpoint in worker threads, off the event loop, with progress.

The plan (from `Checkpoint.copy_plan`) is a list of file ranges -> arena offsets, large tensors
already split into chunks and runs of small ones batched. Every read goes through the descriptors
the checkpoint was opened with, never by path again. Worker threads execute it through the arena's writer (host: preadv
straight into the shared mapping; CUDA: pinned staging + async copies). Progress is a byte
counter the event loop reads; cancellation is checked between chunks.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import mmap
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import repeat
from operator import add
from typing import Protocol

from wcd import key
from wcd.arenas.base import Arena, ArenaReader, FileReader
from wcd.checkpoint import Checkpoint, CopyOp
from wcd.errors import LoadFailed
from wcd.manifest import Manifest


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
    """Loader threads per load: one per core, 4 to 16 (16 filled an H200 from the page cache at
    46 GB/s, 8 at 44, 24 at 31; 4 on a 2-core VM kept host fills at the plain copy's rate)."""
    return max(4, min(16, os.cpu_count() or 2))


_RESIDENT = bytes(i & 1 for i in range(256))  # mincore: only the low bit of each byte is defined


def cached_fraction(fd: int, windows: int = 256, window_pages: int = 16) -> float:
    """About how much of the file `fd` is in the page cache now (0..1): mincore(2) over `windows`
    evenly spaced windows of a mapping that is never touched (so a file truncated meanwhile cannot
    fault); a whole 4 GB file would be a million pages to look up. 1.0 when it cannot tell."""
    size = os.fstat(fd).st_size
    if size == 0:
        return 1.0
    libc = _libc()
    addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        return 1.0
    try:
        pages = -(-size // mmap.PAGESIZE)
        span = min(window_pages, pages)
        starts = sorted({i * (pages - span) // max(1, windows - 1) for i in range(windows)})
        vec = (ctypes.c_ubyte * span)()
        resident = 0
        for page in starts:
            if libc.mincore(addr + page * mmap.PAGESIZE, span * mmap.PAGESIZE, vec) != 0:
                return 1.0
            resident += bytes(vec).translate(_RESIDENT).count(1)
        return resident / (span * len(starts))
    finally:
        libc.munmap(addr, size)


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc


def fill_arena(
    arena: Arena, checkpoint: Checkpoint, ops: list[CopyOp], progress: ProgressSink,
    cancelled: Callable[[], bool] = lambda: False, workers: int | None = None, fingerprint: str | None = None,
) -> None:
    """Blocking: run every copy op, `workers` at a time, through the checkpoint's open descriptors.
    Call it from a thread, never the loop.

    Then fail (`LoadFailed`) if a shard was written meanwhile: its size or times changed since it
    was opened, or (given the fingerprint taken at admission) its sampled bytes differ now. Either
    would leave the arena with a mix of old and new bytes under the old fingerprint.
    """
    writer = arena.writer()
    try:
        for fd in checkpoint.fds:
            writer.hint(fd, cached_fraction(fd))
        failed = threading.Event()  # one failed chunk stops the others early

        def run(op: CopyOp) -> None:
            if failed.is_set() or cancelled():
                raise Cancelled()
            try:
                fd = checkpoint.fds[op.shard]
                if op.pieces:
                    writer.copy_scattered(fd, op.file_offset, op.arena_offset, op.nbytes, op.pieces)
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
        changed = checkpoint.changed()
        if not changed and fingerprint is not None and key.fingerprint(checkpoint) != fingerprint:
            changed = [checkpoint.path]
        if changed:
            raise LoadFailed(f"{changed[0]} changed while it was being loaded (written in place?); nothing "
                             "was kept: load it again once it is complete")
    except OSError as e:
        raise LoadFailed(f"{checkpoint.path}: read failed: {e.strerror or e}") from None
    finally:
        writer.close()


DIGEST_CHUNK = 16 << 20


def _digest_ranges(reader: Callable[[], ArenaReader], ranges: list[tuple[str, int, int]]) -> dict[str, str]:
    """blake2b of each named (offset, nbytes) range, read through one reusable `reader()` per thread.

    Work is split into `DIGEST_CHUNK` pieces so that one large tensor does not serialise on one
    core: a range of one piece digests as blake2b of its bytes, a longer one as blake2b of its
    pieces' digests. hashlib releases the GIL, so threads hash in parallel (~1 GB/s each).
    """
    pieces = [(offset + pos, min(DIGEST_CHUNK, nbytes - pos))
              for _, offset, nbytes in ranges for pos in range(0, nbytes, DIGEST_CHUNK)]
    local = threading.local()
    readers: list[ArenaReader] = []
    lock = threading.Lock()

    # Tasks of about one piece's bytes: 100,000 small tensors make ~100 tasks, not 100,000.
    tasks: list[list[tuple[int, int]]] = []
    size = DIGEST_CHUNK
    for piece in pieces:
        if size + piece[1] > DIGEST_CHUNK:
            tasks.append([])
            size = 0
        tasks[-1].append(piece)
        size += piece[1]

    def one(task: list[tuple[int, int]]) -> list[bytes]:
        r = getattr(local, "reader", None)
        if r is None:
            r = local.reader = reader()
            with lock:
                readers.append(r)
        return [hashlib.blake2b(r.read(*piece), digest_size=16).digest() for piece in task]

    try:
        with ThreadPoolExecutor(digest_workers(), thread_name_prefix="wcd-digest") as pool:
            digests = (d for ds in pool.map(one, tasks) for d in ds)
            out = {}
            for name, _, nbytes in ranges:
                n = -(-nbytes // DIGEST_CHUNK)
                if n == 0:
                    out[name] = hashlib.blake2b(b"", digest_size=16).hexdigest()
                elif n == 1:
                    out[name] = next(digests).hex()
                else:
                    out[name] = hashlib.blake2b(b"".join(next(digests) for _ in range(n)), digest_size=16).hexdigest()
            return out
    finally:
        for r in readers:
            r.close()


def digest_workers() -> int:
    return max(2, min(32, os.cpu_count() or 2))


def digest_arena(arena: Arena, manifest: Manifest) -> dict[str, str]:
    """Per-tensor content digest of what is resident in an arena (blocking)."""
    return _digest_ranges(arena.reader, [(t.name, t.offset, t.nbytes) for t in manifest.tensors])


def digest_checkpoint(checkpoint: Checkpoint) -> dict[str, str]:
    """Per-tensor content digest of a checkpoint on disk, through its open descriptors (blocking)."""
    out: dict[str, str] = {}
    for h, fd in zip(checkpoint.headers, checkpoint.fds):
        begins = map(add, repeat(h.data_start), h.begins)
        out.update(_digest_ranges(functools.partial(FileReader, fd), list(zip(h.names, begins, h.sizes))))
    return out
