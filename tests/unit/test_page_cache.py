"""`cached_fraction`: how much of a file the page cache holds, the loader's warm/cold decision."""

from __future__ import annotations

import os
from pathlib import Path

from wcd.loader import cached_fraction


def test_a_file_just_read_is_cached_and_one_dropped_is_not(tmp_path: Path) -> None:
    path = tmp_path / "blob"
    path.write_bytes(os.urandom(8 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.pread(fd, 8 << 20, 0)
        assert cached_fraction(fd) == 1.0
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        dropped = cached_fraction(fd)
        if _fs_type(path) not in ("tmpfs", "ramfs"):  # those keep every page: nothing to drop
            assert dropped < 0.1
        os.pread(fd, 4 << 20, 0)  # the first half back (and whatever readahead adds)
        partly = cached_fraction(fd)
        assert 0.0 <= dropped <= partly <= 1.0
        assert partly >= 0.4  # sampled windows: about, not exactly, a half
    finally:
        os.close(fd)


def _fs_type(path: Path) -> str:
    """The file system type of the mount holding `path` (longest matching mount point)."""
    best, kind = "", ""
    with open("/proc/self/mounts") as mounts:
        for line in mounts:
            _, point, fstype, *_ = line.split()
            if (str(path).startswith(point.rstrip("/") + "/") or str(path) == point) and len(point) > len(best):
                best, kind = point, fstype
    return kind


def test_empty_and_tiny_files(tmp_path: Path) -> None:
    empty, tiny = tmp_path / "empty", tmp_path / "tiny"
    empty.write_bytes(b"")
    tiny.write_bytes(b"x" * 100)
    for p in (empty, tiny):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.pread(fd, 100, 0)
            assert cached_fraction(fd) == 1.0
        finally:
            os.close(fd)
