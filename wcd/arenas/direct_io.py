"""O_DIRECT reads of cold checkpoint files: a file's O_DIRECT twin (reopened through /proc, never by
path), whole-block reads into aligned buffers, and the one warning per file system that refuses.

With `cold_reads = "direct"` (the default), cold files are read with O_DIRECT: whole aligned
blocks into pinned buffers, no page-cache copy and nothing left in the cache; buffered where the
file system refuses it. No CUDA here: any writer with aligned buffers may use it.
"""

from __future__ import annotations

import errno
import logging
import os
import threading

log = logging.getLogger("wcd")

# 4096 covers 512-byte and 4K logical blocks.
DIRECT_ALIGN = 4096
# What a file system that does not do O_DIRECT answers the open or a read with.
REFUSALS = (errno.EINVAL, errno.EOPNOTSUPP)
_BUFFERED_DEVICES: set[int] = set()  # file systems (st_dev) whose O_DIRECT refusal was logged
_BUFFERED_LOCK = threading.Lock()


def pread_direct(fd: int, view: memoryview, offset: int, need: int) -> None:
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
    (one warning per file system: `warn_buffered`)."""
    try:
        direct = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
    except OSError as e:
        if e.errno not in REFUSALS:  # out of descriptors, say: not the file system's answer
            raise
        warn_buffered(fd, e)
        return None
    a, b = os.fstat(fd), os.fstat(direct)
    if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):  # cannot happen; never read another file
        os.close(direct)
        return None
    return direct




def warn_buffered(fd: int, error: OSError) -> None:
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
