"""Cold GPU loads read through O_DIRECT: whole aligned blocks into a lane's pinned buffer, the
device copy starting at the wanted byte. Checked here byte for byte with the lane's CUDA calls
replaced by copies into host memory (no GPU needed), over a real file on the test's file system."""

from __future__ import annotations

import ctypes
import fcntl
import os
import random
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.unit import test_staging

cuda_module = test_staging.cuda_module  # the fixture: wcd.arenas.cuda as it is, without a GPU


@pytest.fixture
def direct_file(tmp_path: Path, cuda_module: Any) -> Iterator[tuple[bytes, int, int]]:
    """(contents, fd, its O_DIRECT descriptor) of an 8 MiB + 1234 byte file."""
    cuda = cuda_module
    data = random.Random(7).randbytes((8 << 20) + 1234)
    path = tmp_path / "shard"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    direct = cuda.open_direct(fd)
    if direct is None:
        os.close(fd)
        with pytest.raises(OSError):  # open_direct said no: the file system really refuses O_DIRECT
            os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    assert os.O_DIRECT & fcntl.fcntl(direct, fcntl.F_GETFL)
    yield data, fd, direct
    os.close(direct)
    os.close(fd)


def _host_lane(cuda: Any, monkeypatch: pytest.MonkeyPatch, nbytes: int, device: bytearray) -> Any:
    """A real `Lane` whose buffers are page-aligned host memory and whose 'device' is `device`."""
    lane = object.__new__(cuda.Lane)
    lane.nbytes, lane.turn, lane.stream = nbytes, 0, None
    lane.reading = lane.waiting = lane.pinning = 0.0
    lane.ptrs, lane.views, lane.events, keep = [], [], [None, None], []
    for _ in range(2):
        raw = (ctypes.c_char * (nbytes + 4096))()
        ptr = -(-ctypes.addressof(raw) // 4096) * 4096
        keep.append(raw)
        lane.ptrs.append(ptr)
        lane.views.append(memoryview((ctypes.c_char * nbytes).from_address(ptr)).cast("B"))
    lane.keep = keep
    base = ctypes.addressof((ctypes.c_char * len(device)).from_buffer(device))

    def htod(dst: int, src: int, n: int, stream: Any) -> tuple[int]:
        assert 0 <= dst and dst + n <= len(device)
        ctypes.memmove(base + dst, src, n)
        return (0,)

    monkeypatch.setattr(cuda, "check", lambda result, what: None)
    monkeypatch.setattr(cuda.cuda, "cuEventSynchronize", lambda e: (0,), raising=False)
    monkeypatch.setattr(cuda.cuda, "cuEventQuery", lambda e: (cuda.NOT_READY,), raising=False)
    monkeypatch.setattr(cuda.cuda, "cuEventRecord", lambda e, s: (0,), raising=False)
    monkeypatch.setattr(cuda.cuda, "cuMemcpyHtoDAsync", htod, raising=False)
    return lane


@pytest.mark.parametrize(("offset", "nbytes", "read_bytes"), [
    (0, 8 << 20, 1 << 20),  # aligned, many reads
    (4095, 3 << 20, 1 << 20),  # starts one byte before a block boundary
    (12345, (1 << 20) + 1, 1 << 20),  # neither end aligned, the last read one byte
    ((8 << 20) - 100, 1334, 1 << 20),  # up to the end of the file (a short, unaligned last read)
    (1, 1, 1 << 20),
    (4095, 9000, 1000),  # a read size under one block still reads whole blocks (it looped forever)
])
def test_direct_copies_put_every_byte_where_it_belongs(cuda_module: Any, monkeypatch: pytest.MonkeyPatch,
                                                       direct_file: tuple[bytes, int, int], offset: int,
                                                       nbytes: int, read_bytes: int) -> None:
    cuda, (data, _, direct) = cuda_module, direct_file
    device = bytearray(len(data) + 8192)
    lane = _host_lane(cuda, monkeypatch, read_bytes + cuda.DIRECT_ALIGN, device)
    lane.copy_direct(direct, offset, 100, nbytes, read_bytes)
    assert device[100 : 100 + nbytes] == data[offset : offset + nbytes]
    assert not any(device[:100]) and not any(device[100 + nbytes :])


def test_a_direct_read_past_the_end_is_an_error_not_garbage(cuda_module: Any, monkeypatch: pytest.MonkeyPatch,
                                                           direct_file: tuple[bytes, int, int]) -> None:
    cuda, (data, _, direct) = cuda_module, direct_file
    lane = _host_lane(cuda, monkeypatch, (1 << 20) + cuda.DIRECT_ALIGN, bytearray(len(data) + 8192))
    with pytest.raises(OSError, match="unexpected end of file"):
        lane.copy_direct(direct, len(data) - 10, 0, 11, 1 << 20)


def test_open_direct_reopens_the_same_open_file_not_its_path(cuda_module: Any, tmp_path: Path) -> None:
    cuda, path = cuda_module, tmp_path / "shard"
    path.write_bytes(b"a" * 8192)
    fd = os.open(path, os.O_RDONLY)
    path.rename(tmp_path / "moved")
    path.write_bytes(b"b" * 8192)  # another file at the old path
    direct = cuda.open_direct(fd)
    try:
        if direct is None:
            pytest.skip(f"{tmp_path} refuses O_DIRECT")
        assert os.fstat(direct).st_ino == os.fstat(fd).st_ino != path.stat().st_ino
    finally:
        os.close(fd)
        if direct is not None:
            os.close(direct)


def test_the_copy_loop_queues_its_copies_and_records_through_the_calls_that_keep_the_gil(
        cuda_module: Any, monkeypatch: pytest.MonkeyPatch, direct_file: tuple[bytes, int, int]) -> None:
    """cuda-bindings' copy, record and query release the GIL around each call (the threads then
    queue to take it back): the loop must use `HeldCalls` for them, never the bindings, and wait
    for a buffer's last copy (`cuEventSynchronize`, which gives the GIL up) only when its query
    says that copy has not finished."""
    cuda, (data, _, direct) = cuda_module, direct_file
    device = bytearray(len(data) + 8192)
    lane = _host_lane(cuda, monkeypatch, (1 << 20) + cuda.DIRECT_ALIGN, device)
    bindings_copy = cuda.cuda.cuMemcpyHtoDAsync
    calls: list[str] = []

    def refuse(*args: Any) -> None:
        raise AssertionError("a copy-loop call went through cuda-bindings")

    for name in ("cuMemcpyHtoDAsync", "cuEventRecord", "cuEventQuery"):
        monkeypatch.setattr(cuda.cuda, name, refuse, raising=False)
    monkeypatch.setattr(cuda.cuda, "cuEventSynchronize", lambda e: calls.append("wait") or (0,), raising=False)
    answers = iter([cuda.SUCCESS, cuda.NOT_READY] * 2)  # done, not yet, done, not yet
    held = types.SimpleNamespace(
        memcpy_htod_async=lambda dst, src, n, stream: calls.append("copy") or bindings_copy(dst, src, n, stream)[0],
        event_record=lambda event, stream: calls.append("record") or cuda.SUCCESS,
        event_query=lambda event: calls.append("query") or next(answers))
    monkeypatch.setattr(cuda, "held", lambda: held)
    lane.copy_direct(direct, 4095, 100, 3 << 20, 1 << 20)
    # 3 MiB from an unaligned offset: four 1 MiB reads, a wait only after the "not yet"s
    assert calls == ["query", "copy", "record", "query", "wait", "copy", "record"] * 2
    assert device[100 : 100 + (3 << 20)] == data[4095 : 4095 + (3 << 20)]


def test_a_query_that_fails_fails_the_copy_in_one_line(cuda_module: Any, monkeypatch: pytest.MonkeyPatch,
                                                       direct_file: tuple[bytes, int, int]) -> None:
    """A query answers an earlier copy's failure (e.g. an illegal address) rather than "not ready":
    that is the load's error, said once, not a wait that hides it."""
    cuda, (_, _, direct) = cuda_module, direct_file
    lane = _host_lane(cuda, monkeypatch, (1 << 20) + cuda.DIRECT_ALIGN, bytearray(4 << 20))
    waits: list[object] = []
    monkeypatch.setattr(cuda.cuda, "cuEventSynchronize", lambda e: waits.append(e) or (0,), raising=False)

    def check_held(err: int, what: str) -> None:  # the real one words the code through the bindings
        raise cuda.Internal(f"{what} {err}")

    monkeypatch.setattr(cuda, "check_held", check_held)
    monkeypatch.setattr(cuda, "held", lambda: types.SimpleNamespace(event_query=lambda event: 700))
    with pytest.raises(cuda.Internal, match="^cuEventQuery 700$"):
        lane.copy_direct(direct, 0, 0, 1 << 20, 1 << 20)
    assert not waits
