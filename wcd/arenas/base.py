"""The arena interface shared by the host (memfd) and CUDA (VMM) backends.

Daemon side: a backend creates arenas on a device, reports device memory, and gives the loader
a writer that fills an arena from file ranges. Client side: `wcd.views` maps an exported fd.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from wcd.errors import NotFound
from wcd.tuning import DEFAULT, LoadTuning

if TYPE_CHECKING:  # not at run time: clients import this module, and need no checkpoint code
    from wcd.checkpoint import Run

# Guards every arena's count of workers using it: held for a few instructions twice per job.
_USES = threading.Lock()


@dataclass(frozen=True)
class DeviceInfo:
    device: str  # canonical id: "cpu" or the GPU UUID
    name: str  # human name: "host memory", "NVIDIA H200 (cuda:0)"
    total: int
    free: int


class ArenaWriter(ABC):
    """Fills an arena from files. `copy_from_file` is called from several worker threads at once."""

    @abstractmethod
    def copy_from_file(self, fd: int, file_offset: int, arena_offset: int, nbytes: int) -> None: ...

    def copy_scattered(self, fd: int, file_offset: int, arena_offset: int, nbytes: int, runs: tuple[Run, ...]) -> None:
        """Copy a contiguous file range into the pieces of `runs` (`wcd.checkpoint.Run`: offset
        relative to `arena_offset`, width, stride, count) of the `nbytes` arena bytes at
        `arena_offset`; the bytes between pieces are undefined after. This default copies piece by
        piece; writers override it with one read and few writes."""
        for rel, width, stride, count in runs:
            for at in range(arena_offset + rel, arena_offset + rel + stride * count, stride):
                self.copy_from_file(fd, file_offset, at, width)
                file_offset += width

    def hint(self, fd: int, cached_fraction: float, read_ahead: tuple[int, int] | None = None) -> None:
        """How much of the file `fd` (0..1) is in the page cache, told before any copy from it,
        and the range (start, end) of it that the loader asked the kernel to read ahead meanwhile;
        writers may read cold files differently. This default ignores it."""
        return None

    def batch_bytes(self, fd: int) -> int | None:
        """After `hint`: how many arena bytes of small tensors of the file `fd` one op should span
        (what this writer reads at once from it); None: the plan's default."""
        return None

    @abstractmethod
    def close(self) -> None:
        """Wait for outstanding copies and release staging resources."""


class ArenaReader:
    """Copies ranges out into one reusable buffer (used by `verify` from worker threads, one
    reader per thread). This default goes through `Arena.read`; backends override it."""

    def __init__(self, arena: Arena) -> None:
        self._arena = arena

    def read(self, offset: int, nbytes: int) -> memoryview:
        """The bytes, in a writable buffer (`verify` compares it by address), valid until the next call."""
        return memoryview(bytearray(self._arena.read(offset, nbytes)))

    def windows(self, offset: int, nbytes: int, then: tuple[int, int] | None = None) -> Iterator[memoryview]:
        """The `nbytes` at `offset` as consecutive writable buffers, in order, each valid until the
        next is asked for: a reader may copy the next one meanwhile. `then` (offset, nbytes) is the
        span the next call will read, which it may start on early. This default yields one `read`."""
        yield self.read(offset, nbytes)

    def close(self) -> None:
        """Release the buffer."""


SCRATCH_MMAP_BYTES = 1 << 20


def scratch(nbytes: int) -> memoryview:
    """A zeroed writable buffer for a worker thread. Past SCRATCH_MMAP_BYTES it is an anonymous
    mapping: `bytearray(n)` zeroes and faults in its pages holding the GIL (16 MiB: the loop waited
    14 ms; 64 MiB: 63 ms, on the VM) and frees them holding it, where mmap leaves the zeroing to
    the kernel's page faults in the syscalls that fill it and unmaps without the GIL (2.6 ms at
    16 MiB and 64 MiB, the ticker's own noise). The mapping goes with the last view of it."""
    if nbytes < SCRATCH_MMAP_BYTES:
        return memoryview(bytearray(nbytes))
    # Private, not mmap's default shared mapping (shmem): its pages fault in a third faster.
    return memoryview(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))


def pread_into(fd: int, view: memoryview, offset: int) -> None:
    """Fill `view` from `fd` at `offset` (preadv may return short counts); EIO at end of file."""
    while view:
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise OSError(errno.EIO, "unexpected end of file")
        view, offset = view[n:], offset + n


# A host arena's memfd seals: its size from creation on (writes stay allowed until the fill is
# done), everything once filled. Here, not in `host`, because clients check them too.
SIZE_SEALS = fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK
SEALS = fcntl.F_SEAL_WRITE | SIZE_SEALS | fcntl.F_SEAL_SEAL


def memfd_problem(fd: int, size: int, seals: int) -> str | None:
    """What is wrong with a host arena's memfd that should be `size` bytes and carry `seals`
    (F_SEAL_* bits), or None. Both sides check: the daemon at commit and re-adoption, a client
    before it maps one (a memfd that can shrink under a mapping kills its readers with SIGBUS)."""
    try:
        actual, have = os.fstat(fd).st_size, fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as e:
        return f"not a memfd ({e.strerror})"
    if actual != size:
        return f"the memfd holds {actual} bytes, the arena {size}"
    missing = seals & ~have
    if missing:
        names = [n for n, bit in _SEAL_NAMES if missing & bit]
        return f"the memfd is not sealed as it must be (missing {', '.join(names)})"
    return None


_SEAL_NAMES = (("F_SEAL_WRITE", fcntl.F_SEAL_WRITE), ("F_SEAL_GROW", fcntl.F_SEAL_GROW),
               ("F_SEAL_SHRINK", fcntl.F_SEAL_SHRINK), ("F_SEAL_SEAL", fcntl.F_SEAL_SEAL))


class FileReader(ArenaReader):
    """`ArenaReader` over an open file or memfd: preadv into one reused buffer, no copies after."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._buf = memoryview(bytearray(0))

    def read(self, offset: int, nbytes: int) -> memoryview:
        if len(self._buf) < nbytes:
            self._buf = scratch(nbytes)
        view = self._buf[:nbytes]
        pread_into(self._fd, view, offset)
        return view


class Arena(ABC):
    """One allocation. Worker threads that touch it (fill, seal, digest) hold it with `in_use`:
    `close` then only marks it, and the last user releases it. Its descriptors are never closed
    under a worker, so a worker can neither fail with EBADF nor read a reused fd number."""

    kind: str  # "host" or "cuda": tells the client how to map the fd
    device: str  # canonical device id
    size: int  # bytes allocated (manifest size rounded up to the backend's granularity)
    tuning: LoadTuning = DEFAULT  # its backend's: how loads into it read and copy
    _users = 0  # workers inside `in_use` (class defaults: backends need not call a base __init__)
    _closing = False

    @abstractmethod
    def fd(self) -> int:
        """The exportable descriptor. The arena keeps ownership; sending dups it."""

    @abstractmethod
    def writer(self) -> ArenaWriter:
        """A writer for the daemon's loader (one at a time)."""

    @abstractmethod
    def seal(self) -> None:
        """No more writes after this: the contents are final and shared read-only."""

    def check_open(self) -> None:
        """`NotFound` once the arena is closing: a long digest of an evicted entry calls this
        between reads, so it stops instead of holding the memory."""
        if self._closing:
            raise NotFound("the arena was reclaimed while it was being read (entry evicted or daemon stopping)")

    def read(self, offset: int, nbytes: int) -> bytes:
        """Copy bytes out; refused once the arena is closing (`check_open`)."""
        self.check_open()
        return self._read(offset, nbytes)

    @contextmanager
    def in_use(self) -> Iterator[Arena]:
        """Hold the arena open for one worker's job (call it in the worker thread)."""
        with _USES:
            if self._closing:
                raise NotFound("the arena was reclaimed before the job started (entry evicted or daemon stopping)")
            self._users += 1
        try:
            yield self
        finally:
            with _USES:
                self._users -= 1
                last = self._closing and not self._users
            if last:
                self._release()

    def close(self) -> None:
        """Close every descriptor the daemon holds, now or when the last worker using it is done;
        memory returns once clients unmap. Idempotent."""
        with _USES:
            if self._closing:
                return
            self._closing = True
            now = not self._users
        if now:
            self._release()

    def check_adopted(self) -> None:  # noqa: B027 - does nothing unless a backend overrides it
        """The part of `ArenaBackend.adopt`'s validation too slow for start-up (CUDA: it needs a
        context); run in a worker after READY and before the arena is served. `BadRequest` if the
        arena is not what its record says. Backends whose `adopt` checks everything do nothing."""

    def reader(self) -> ArenaReader:
        """A reader with its own reusable buffer, for one thread (used by `verify`, under `in_use`)."""
        return ArenaReader(self)

    @abstractmethod
    def _read(self, offset: int, nbytes: int) -> bytes: ...

    @abstractmethod
    def _release(self) -> None:
        """Close the descriptors (called once, with no worker using the arena)."""


class ArenaBackend(ABC):
    tuning: LoadTuning = DEFAULT  # what its arenas' loads are built with (`wcd.arenas.set_tuning`)

    @abstractmethod
    def canonical(self, device: str) -> str:
        """The stable identity of `device` ("cpu", or the GPU UUID for "cuda:N")."""

    @abstractmethod
    def arena_size(self, nbytes: int, device: str) -> int:
        """`nbytes` rounded up to the allocation granularity."""

    @abstractmethod
    def create(self, device: str, size: int, label: str) -> Arena:
        """Allocate an arena; raises `OutOfMemory` when the device cannot hold it."""

    @abstractmethod
    def info(self, device: str) -> DeviceInfo: ...

    def released_held(self) -> int:
        """Bytes of arenas this backend closed that other processes still hold (mapped after their
        leases ended): memory the daemon cannot take back, which admission counts. This default
        knows of none."""
        return 0

    def total_memory(self, device: str) -> int:
        """The device's memory in bytes (what fractional budgets are of); backends answer faster
        than `info` where they can, because start-up asks before READY."""
        return self.info(device).total

    @abstractmethod
    def adopt(self, fd: int, device: str, size: int, label: str) -> Arena:
        """Take over an exported arena fd (from systemd's fd store after a restart) and validate
        what can be checked in microseconds; `Arena.check_adopted` does the rest."""

    def prepare(self, device: str, workers: int) -> None:
        """Get `device` ready for a load about to start, `workers` threads wide (blocking; from a
        thread). What it sets up lingers like a load's staging. This default has nothing to do."""
        return None

    def configure(self, linger_s: float, direct_reads: bool = False) -> None:
        """How long staging (and a GPU's context) stays after the last load, 0 releases it at once;
        whether files not in the page cache are read with O_DIRECT where the backend does that."""
        return None

    def release(self) -> None:
        """Release lingering staging now (daemon shutdown)."""
        return None

    def lingering(self) -> list[str]:
        """What `release` would let go now, for messages; this default keeps nothing."""
        return []
