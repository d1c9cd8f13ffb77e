"""What the page cache holds of a file, and dropping files from it: mincore(2) over untouched
mappings (or RWF_NOWAIT probes where mincore would not tell this process), and POSIX_FADV_DONTNEED
in a thread of its own for files that loads read cold, unless another load still reads them.

The loader decides warm against cold with it; arena writers ask it op by op. Nothing here reads a
file's bytes beyond a one-page probe.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import mmap
import os
import threading
from collections.abc import Iterator

log = logging.getLogger("wcd")

_RESIDENT = bytes(i & 1 for i in range(256))  # mincore: only the low bit of each byte is defined


def mincore_tells(fd: int) -> bool:
    """Whether mincore(2) tells this process the truth about the file's pages. Since Linux 5.0 it
    reports every page of a file mapping as cached unless the caller owns the file or may write
    it (mm/mincore.c, `can_do_mincore`): a daemon running as its own user, reading model files
    that it may only read, would take every cold file for a warm one."""
    if os.fstat(fd).st_uid == os.geteuid():
        return True
    try:
        return os.access(f"/proc/self/fd/{fd}", os.W_OK, effective_ids=os.access in os.supports_effective_ids)
    except OSError:
        return False


def cached_fraction(fd: int, windows: int = 64, window_pages: int = 64) -> float:
    """About how much of the file `fd` is in the page cache now (0..1): mincore(2) over `windows`
    evenly spaced windows of a mapping that is never touched (so a file truncated meanwhile cannot
    fault); a whole 4 GB file would be a million pages to look up. 1.0 when it cannot tell.
    The calls, not the pages, cost: 4 files took 5.6 ms as 256 x 16 pages, 2.6 ms as 64 x 64.
    Where mincore would not tell (`mincore_tells`), one page per window is probed instead
    (`_probed_fraction`)."""
    size = os.fstat(fd).st_size
    if size == 0:
        return 1.0
    if not mincore_tells(fd):
        return _probed_fraction(fd, size, windows)
    with _mapped(fd, 0, size) as addr:
        if addr is None:
            return 1.0
        pages = -(-size // mmap.PAGESIZE)
        span = min(window_pages, pages)
        starts = sorted({i * (pages - span) // max(1, windows - 1) for i in range(windows)})
        resident = 0
        for page in starts:
            found = _resident_pages(addr + page * mmap.PAGESIZE, span)
            if found < 0:
                return 1.0
            resident += found
        return resident / (span * len(starts))


@contextlib.contextmanager
def _mapped(fd: int, offset: int, length: int) -> Iterator[int | None]:
    """A shared read-only mapping of the file's `length` bytes from `offset` (page-aligned) for
    mincore, never touched (a file truncated meanwhile cannot fault); None if it cannot be made."""
    libc = _libc()
    addr = libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, offset)
    if addr in (None, ctypes.c_void_p(-1).value):
        yield None
        return
    try:
        yield addr
    finally:
        libc.munmap(addr, length)


def _resident_pages(addr: int, pages: int) -> int:
    """How many of the `pages` mapped pages from `addr` are in the page cache (mincore); -1 if it fails."""
    vec = (ctypes.c_ubyte * pages)()
    if _libc().mincore(addr, pages * mmap.PAGESIZE, vec) != 0:
        return -1
    return bytes(vec).translate(_RESIDENT).count(1)


def _probed_fraction(fd: int, size: int, windows: int) -> float:
    """`cached_fraction` without mincore: a one-page read with RWF_NOWAIT at each of `windows`
    evenly spaced pages, which the kernel answers from the page cache or refuses (EAGAIN). A
    refused probe starts that page's read (Linux reads it ahead), so a cold file costs `windows`
    page reads. 1.0 when it cannot tell (no RWF_NOWAIT for this file)."""
    pages = -(-size // mmap.PAGESIZE)
    starts = sorted({i * (pages - 1) // max(1, windows - 1) for i in range(windows)})
    page = bytearray(1)
    cached = 0
    for start in starts:
        try:
            cached += os.preadv(fd, [page], start * mmap.PAGESIZE, os.RWF_NOWAIT) > 0
        except BlockingIOError:
            pass
        except OSError:  # EOPNOTSUPP: a file system without it
            return 1.0
    return cached / len(starts)


def resident(fd: int, offset: int, nbytes: int) -> bool:
    """Whether every page of the file's bytes [offset, offset + nbytes) is in the page cache now:
    mincore(2) over a mapping of just that range, never touched. False when it cannot tell (or
    mincore would not tell: `mincore_tells`). A 16 MiB range costs three calls and a 4 KiB vector."""
    if nbytes <= 0:
        return True
    if not mincore_tells(fd):
        return False
    start = offset - offset % mmap.PAGESIZE
    length = offset + nbytes - start
    with _mapped(fd, start, length) as addr:
        pages = -(-length // mmap.PAGESIZE)
        return addr is not None and _resident_pages(addr, pages) == pages



@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc


class Inodes:
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


LOADING = Inodes()


def drop_files_later(fds: list[int]) -> None:
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
