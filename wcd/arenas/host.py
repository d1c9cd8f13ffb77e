"""Host-memory arenas: one memfd per entry, its size sealed from the start, its contents once filled.

The size is sealed (F_SEAL_GROW | F_SEAL_SHRINK) before the fd can leave the daemon: a publisher
holding it could otherwise grow it past what the budget counts, or shrink it under every reader's
mapping (SIGBUS). Readers map the sealed memfd MAP_PRIVATE, so a stray write in an engine lands in
its own copy-on-write page and never in the shared copy. Sealing with F_SEAL_WRITE requires that no
writable shared mapping exists, which is why fill views must be dropped before commit.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import struct
import threading
import time
from typing import Any

from wcd import HOST_DEVICE
from wcd.arenas.base import (
    SEALS,
    SIZE_SEALS,
    Arena,
    ArenaBackend,
    ArenaWriter,
    DeviceInfo,
    FileReader,
    memfd_problem,
    scratch,
)
from wcd.checkpoint import Run
from wcd.errors import BadRequest, Busy, OutOfMemory
from wcd.manifest import align_up

log = logging.getLogger("wcd")

PAGE = mmap.PAGESIZE
STAGING_BYTES = 4 << 20  # per loader thread, for runs of small tensors


class HostWriter(ArenaWriter):
    """Copies file ranges into the memfd with sendfile(2): one in-kernel copy from the page cache,
    and no mapping of the arena in the daemon. (Unmapping a filled multi-GB mapping holds the
    process's mmap lock for a large fraction of a second, stalling the event loop's page faults.)
    sendfile writes at the file position, so each loader thread gets its own open file
    description of the memfd (reopened through /proc/self/fd) and seeks it."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._local = threading.local()
        self._opened: list[int] = []
        self._lock = threading.Lock()

    def _out(self) -> int:
        out = getattr(self._local, "fd", None)
        if out is None:
            out = self._local.fd = os.open(f"/proc/self/fd/{self._fd}", os.O_WRONLY | os.O_CLOEXEC)
            with self._lock:
                self._opened.append(out)
        return out

    def copy_from_file(self, fd: int, file_offset: int, arena_offset: int, nbytes: int) -> None:
        out = self._out()
        os.lseek(out, arena_offset, os.SEEK_SET)
        while nbytes:
            n = os.sendfile(out, fd, file_offset, nbytes)
            if n == 0:
                raise OSError(errno.EIO, "unexpected end of file")
            file_offset, nbytes = file_offset + n, nbytes - n

    def copy_scattered(self, fd: int, file_offset: int, arena_offset: int, nbytes: int, runs: tuple[Run, ...]) -> None:
        """One preadv scatters the file range into a staging buffer laid out like the arena, one
        pwrite puts it in place: two syscalls for a whole run of small tensors."""
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < nbytes:
            buf = self._local.buf = scratch(max(nbytes, STAGING_BYTES))
        views = [buf[at : at + width] for rel, width, stride, count in runs
                 for at in range(rel, rel + stride * count, stride)]
        got = os.preadv(fd, views, file_offset)
        if got != sum(width * count for _, width, _, count in runs):  # short only at end of file, or a file that shrank
            super().copy_scattered(fd, file_offset, arena_offset, nbytes, runs)
            return
        out, pos = self._out(), 0
        while pos < nbytes:
            pos += os.pwrite(out, buf[pos:nbytes], arena_offset + pos)

    def close(self) -> None:
        with self._lock:
            opened, self._opened = self._opened, []
        for fd in opened:
            os.close(fd)


class HostArena(Arena):
    kind = "host"
    device = HOST_DEVICE

    def __init__(self, size: int, label: str, fd: int | None = None) -> None:
        self.size = size
        self._lock = threading.Lock()
        if fd is not None:  # adopted: already filled and sealed
            self._fd = fd
            return
        self._fd = os.memfd_create(f"wcd:{label}"[:249], os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            # fallocate commits the memory now, so running out of RAM fails here with a clear
            # error instead of SIGBUS in the loader or an engine later.
            os.posix_fallocate(self._fd, 0, size)
            fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, SIZE_SEALS)
        except OSError as e:
            os.close(self._fd)
            if e.errno in (errno.ENOSPC, errno.ENOMEM):
                raise OutOfMemory(f"host memory: cannot allocate {size} bytes for {label!r} ({e.strerror})") from None
            raise

    def fd(self) -> int:
        return self._fd

    def writer(self) -> HostWriter:
        return HostWriter(self._fd)

    def seal(self) -> None:
        """Seal against writes (in a worker thread: it scans the pages), then check that the memfd
        is still what the daemon made: a holder's own F_SEAL_SEAL, or a size or seals not ours,
        is a `BadRequest` (the commit drops the entry). EBUSY means a writable mapping, or pages
        the kernel still holds for a moment after the publisher unmapped them (per-CPU LRU
        batches: seen as a rare EBUSY right after a multi-threaded copy), so it is tried a few
        times before the publisher is told to drop its views."""
        for attempt in range(4):
            try:
                fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, SEALS)
                break
            except OSError as e:
                if e.errno == errno.EPERM:  # sealed by someone else: the check below says how
                    break
                if e.errno != errno.EBUSY:
                    raise
            time.sleep(0.05 * (attempt + 1))
        else:
            raise Busy("the arena is still mapped writable: drop every fill view before commit")
        problem = memfd_problem(self._fd, self.size, SEALS)
        if problem:
            raise BadRequest(f"the arena's memfd was changed by its holder: {problem}; nothing was published")

    def _read(self, offset: int, nbytes: int) -> bytes:
        return os.pread(self._fd, nbytes, offset)

    def reader(self) -> FileReader:
        return FileReader(self._fd)

    def _release(self) -> None:
        with self._lock:
            if self._fd >= 0:
                RELEASED.watch(self._fd, self.size)
                os.close(self._fd)
                self._fd = -1


class Released:
    """Host arenas the daemon has closed whose memory other processes still hold: a mapping kept
    after its lease ended (views outlive `release`), an fd passed on or reopened. The daemon cannot
    unmap them, so admission counts them (`Cache.outside`) until they are gone.

    Each closed memfd gets an inotify watch. The kernel sends IN_DELETE_SELF, then IN_IGNORED,
    when the last reference to the memfd (any mapping, fd, or description reopened through
    /proc/PID/fd) is gone, and the watch itself pins no memory: measured on 6.18 for a 256 MiB
    memfd closed while another process mapped it, Shmem stayed +256 MiB until that process exited
    and went back to +0 with the event. (Memfds send no IN_CLOSE: they are pseudo files.) Without
    inotify (or past max_user_watches) nothing is counted, said once in the log."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fd: int | None = None  # the inotify instance, made at the first watch; -1: none to be had
        self._sizes: dict[int, int] = {}  # watch descriptor -> arena bytes

    def watch(self, fd: int, size: int) -> None:
        """Count `size` bytes until the memfd `fd` (which the caller closes next) is gone everywhere."""
        with self._lock:
            if self._fd is None:
                self._fd = _inotify.init()
            if self._fd < 0:
                return
            wd = _inotify.watch(self._fd, f"/proc/self/fd/{fd}")
            if wd >= 0:
                self._sizes[wd] = size

    def held(self) -> int:
        """Bytes of closed arenas still held elsewhere (reads the events that arrived; no wait)."""
        with self._lock:
            if self._fd is None or self._fd < 0 or not self._sizes:
                return 0
            gone, overflowed = _inotify.ignored(self._fd)
            for wd in gone:
                self._sizes.pop(wd, None)
            if overflowed:  # events were lost: the watches still alive say what is held
                live = _inotify.live_watches(self._fd)
                self._sizes = {wd: n for wd, n in self._sizes.items() if wd in live}
            return sum(self._sizes.values())


class _Inotify:
    """inotify(7) through libc (the os module has no binding): one instance, one watch per memfd."""

    IN_DELETE_SELF, IN_Q_OVERFLOW, IN_IGNORED = 0x400, 0x4000, 0x8000
    _EVENT = struct.Struct("iIII")  # wd, mask, cookie, len (of a name: none for a watched file)

    def __init__(self) -> None:
        self._libc: Any = None
        self._warned = False

    def init(self) -> int:
        self._libc = ctypes.CDLL(None, use_errno=True)
        return self._checked(self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC))

    def watch(self, fd: int, path: str) -> int:
        return self._checked(self._libc.inotify_add_watch(fd, os.fsencode(path), self.IN_DELETE_SELF))

    def _checked(self, result: int) -> int:
        if result < 0 and not self._warned:
            self._warned = True
            log.warning("memory of host arenas still mapped after their entries went is not counted against the "
                        "budget: inotify failed (%s; raise fs.inotify.max_user_watches if that is it)",
                        os.strerror(ctypes.get_errno()))
        return int(result)

    def ignored(self, fd: int) -> tuple[list[int], bool]:
        """Watches the kernel has dropped since the last call, and whether events were lost."""
        gone: list[int] = []
        overflowed = False
        while True:
            try:
                data = os.read(fd, 64 * self._EVENT.size)
            except BlockingIOError:
                return gone, overflowed
            at = 0
            while at < len(data):
                wd, mask, _, name_len = self._EVENT.unpack_from(data, at)
                at += self._EVENT.size + name_len
                if mask & self.IN_IGNORED:
                    gone.append(wd)
                overflowed |= bool(mask & self.IN_Q_OVERFLOW)

    @staticmethod
    def live_watches(fd: int) -> set[int]:
        """The watch descriptors alive on the inotify instance `fd` (its /proc fdinfo lists them)."""
        with open(f"/proc/self/fdinfo/{fd}") as f:
            return {int(line.split()[1].removeprefix("wd:")) for line in f if line.startswith("inotify wd:")}


_inotify = _Inotify()
RELEASED = Released()


class HostBackend(ArenaBackend):
    def canonical(self, device: str) -> str:
        if device != HOST_DEVICE:
            raise BadRequest(f"unknown host device {device!r}")
        return HOST_DEVICE

    def arena_size(self, nbytes: int, device: str) -> int:
        return align_up(nbytes, PAGE)

    def create(self, device: str, size: int, label: str) -> HostArena:
        arena = HostArena(size, label)
        arena.tuning = self.tuning
        return arena

    def adopt(self, fd: int, device: str, size: int, label: str) -> HostArena:
        problem = memfd_problem(fd, size, SEALS)
        if problem:
            raise BadRequest(f"{label}: {problem}")
        return HostArena(size, label, fd)

    def released_held(self) -> int:
        return RELEASED.held()

    def info(self, device: str) -> DeviceInfo:
        total = os.sysconf("SC_PHYS_PAGES") * PAGE
        free = _mem_available()
        return DeviceInfo(HOST_DEVICE, "host memory", total, free)


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * PAGE
