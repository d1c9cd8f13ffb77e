"""`wcd.arenas.aio`: Linux native AIO through syscall(2), on a real file (no GPU)."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from pathlib import Path

import pytest

from wcd.arenas.aio import Aio


@pytest.fixture
def aio() -> Aio:
    try:
        return Aio(3)
    except OSError as e:
        pytest.skip(f"no Linux AIO here ({e})")


def test_reads_land_in_place_and_free_their_room(aio: Aio, tmp_path: Path) -> None:
    data = os.urandom(3 * 8192)
    (tmp_path / "f").write_bytes(data)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    buf = mmap.mmap(-1, 3 * 8192)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    try:
        aio.submit([(k + 10, fd, base + k * 8192, 8192, (2 - k) * 8192) for k in range(3)])
        with pytest.raises(ValueError, match="1 reads with room for 0"):
            aio.submit([(99, fd, base, 8192, 0)])
        done: list[tuple[int, int]] = []
        while aio.in_flight:
            done += aio.reap()
        assert sorted(done) == [(10, 8192), (11, 8192), (12, 8192)] and aio.reap() == []
        assert buf[:] == data[16384:] + data[8192:16384] + data[:8192]  # each read from its offset
        aio.submit([(7, fd, base, 100, 3 * 8192 - 50)])  # past the end: short, not an error
        with pytest.raises(OSError) as e:  # a bad descriptor fails at submit, and gives its room back
            aio.submit([(8, 0x7FFFFFFF, base, 100, 0)])
        assert e.value.errno == errno.EBADF and aio.in_flight == 1 and len(aio._free) == 2
        assert aio.reap() == [(7, 50)]
    finally:
        del base
        buf.close()
        os.close(fd)
        aio.close()
        aio.close()  # twice: harmless
