"""`Staging`'s bookkeeping (a GPU's context and loader lanes kept between loads), without a GPU:
CUDA calls are replaced by fakes, so what is checked is who holds what, and when it is released."""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import sys
import threading
import time
import types
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest


@pytest.fixture
def cuda_module(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """wcd.arenas.cuda as it is, over a stand-in for cuda-bindings if that is not installed."""
    try:
        importlib.import_module("cuda.bindings.driver")
    except ImportError:
        pkg, bindings = types.ModuleType("cuda"), types.ModuleType("cuda.bindings")
        bindings.driver = mock.MagicMock()  # type: ignore[attr-defined]
        pkg.bindings = bindings  # type: ignore[attr-defined]
        for name, module in (("cuda", pkg), ("cuda.bindings", bindings), ("cuda.bindings.driver", bindings.driver)):
            monkeypatch.setitem(sys.modules, name, module)
        monkeypatch.delitem(sys.modules, "wcd.arenas.cuda", raising=False)
    yield importlib.import_module("wcd.arenas.cuda")
    if isinstance(sys.modules.get("cuda.bindings.driver"), mock.MagicMock):
        sys.modules.pop("wcd.arenas.cuda", None)  # the stand-in goes with the fixture


@pytest.fixture
def cuda(cuda_module: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """wcd.arenas.cuda with fake lanes and contexts."""
    module = cuda_module
    state = types.SimpleNamespace(contexts=0, push_fails=False, lanes=[])

    class FakeLane:
        def __init__(self, nbytes: int, count: int) -> None:
            time.sleep(0.002)  # pinning takes a while: lets concurrent callers overlap
            self.nbytes, self.whole, self.closed = nbytes, True, False
            state.lanes.append(self)

        def close(self) -> None:
            assert not self.closed, "lane closed twice"
            self.closed = True

    def retain(gpu: Any) -> object:
        state.contexts += 1
        return object()

    def release(gpu: Any) -> None:
        state.contexts -= 1

    @contextlib.contextmanager
    def current(ctx: Any) -> Iterator[None]:
        if state.push_fails:
            raise module.Internal("CUDA cuCtxPushCurrent failed")
        yield

    monkeypatch.setattr(module, "_Lane", FakeLane)
    monkeypatch.setattr(module, "retain_context", retain)
    monkeypatch.setattr(module, "release_context", release)
    monkeypatch.setattr(module, "current", current)
    module.state = state
    return module


def staging(cuda: Any, linger_s: float) -> Any:
    return cuda.Staging(cuda.Gpu(0, "GPU-x", "test"), 4 << 20, 2, linger_s)


def test_concurrent_prepares_pin_at_most_the_pool(cuda: Any) -> None:
    s = staging(cuda, 30)
    threads = [threading.Thread(target=s.prepare, args=(16,)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(cuda.state.lanes) == 16 and len(s._free) == 16 and s._making == 0
    s.release()
    assert cuda.state.contexts == 0 and all(lane.closed for lane in cuda.state.lanes)


def test_a_failed_prepare_leaves_no_lane_to_wait_for(cuda: Any) -> None:
    s = staging(cuda, 30)
    cuda.state.push_fails = True
    with pytest.raises(cuda.Internal):
        s.prepare(4)
    cuda.state.push_fails = False
    assert s._making == 0
    s.open()
    taker = threading.Thread(target=s.take, daemon=True)
    taker.start()
    taker.join(5)
    assert not taker.is_alive(), "take() waits for lanes that nobody is making"
    s.close()
    s.release()
    assert cuda.state.contexts == 0


def test_a_load_waits_for_prepared_lanes_instead_of_making_its_own(cuda: Any) -> None:
    s = staging(cuda, 30)
    prep = threading.Thread(target=s.prepare, args=(8,))
    prep.start()
    while not s._making and prep.is_alive():
        time.sleep(0.0005)
    s.open()
    lanes = [s.take() for _ in range(8)]
    prep.join()
    assert len(cuda.state.lanes) == 8 and len({id(lane) for lane in lanes}) == 8
    s.give(lanes)
    s.close()
    s.release()


def test_lanes_broken_by_a_failed_grow_are_closed_not_pooled(cuda: Any) -> None:
    s = staging(cuda, 30)
    s.open()
    lanes = [s.take() for _ in range(3)]
    lanes[1].whole = False
    s.give(lanes)
    s.close()
    assert s._free == [lanes[0], lanes[2]] and lanes[1].closed and not lanes[0].closed
    s.release()


def test_linger_then_release_and_a_new_linger_applies_at_once(cuda: Any) -> None:
    s = staging(cuda, 0.2)
    s.open()
    s.give([s.take()])
    s.close()
    assert s.held and cuda.state.contexts == 1  # lingering for the next load
    time.sleep(0.5)
    assert not s.held and cuda.state.contexts == 0 and cuda.state.lanes[0].closed
    s.set_linger(30)
    s.open()
    s.close()
    assert s.held
    s.set_linger(0)  # an idle, lingering GPU is released by the new value
    assert not s.held and cuda.state.contexts == 0


@pytest.mark.parametrize("linger", [0.0, float("inf"), 1e12])
def test_zero_releases_at_once_and_inf_or_huge_keep(cuda: Any, linger: float) -> None:
    s = staging(cuda, linger)
    s.open()
    s.close()
    assert s.held == (linger > 0) and s._timer is None
    s.release()
    assert cuda.state.contexts == 0


class FakeMapping:
    def __init__(self, handle: Any, gpu: Any, size: int, writable: bool) -> None:
        self.ptr, self.size = 1 << 40, size

    def close(self) -> None:
        self.ptr = 0


@pytest.fixture
def writer_parts(cuda: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """CudaWriter over fake lanes that record their copies; `sync_fails` makes a lane's copies fail."""
    parts = types.SimpleNamespace(copies=[], sync_fails=False, direct_fds=[])

    class CopyLane:
        def __init__(self, nbytes: int, count: int) -> None:
            self.nbytes, self.whole, self.closed = nbytes, True, False
            cuda.state.lanes.append(self)

        def copy(self, fd: int, file_offset: int, dst: int, nbytes: int, read_bytes: int) -> None:
            parts.copies.append((fd, nbytes, read_bytes))

        def copy_direct(self, fd: int, file_offset: int, dst: int, nbytes: int, read_bytes: int) -> None:
            import os

            assert os.O_DIRECT & fcntl.fcntl(fd, fcntl.F_GETFL)
            parts.copies.append(("direct", os.fstat(fd).st_ino, nbytes, read_bytes))
            parts.direct_fds.append(fd)

        def synchronize(self) -> None:
            if parts.sync_fails:
                raise cuda.Internal("CUDA cuStreamSynchronize failed: CUDA_ERROR_ILLEGAL_ADDRESS")

        def close(self) -> None:
            self.closed = True

    monkeypatch.setattr(cuda, "_Lane", CopyLane)
    monkeypatch.setattr(cuda, "VaMapping", FakeMapping)
    monkeypatch.setattr(cuda, "_check", lambda result, what: None)
    monkeypatch.setattr(cuda.cuda, "cuCtxSetCurrent", lambda ctx: None, raising=False)
    parts.staging = staging(cuda, 30)
    parts.arena = types.SimpleNamespace(_gpu=parts.staging.gpu, size=64 << 20, _handle=object())
    return parts


def _open_fds(tmp_path: Any, n: int) -> list[int]:
    import os

    fds = []
    for i in range(n):
        path = tmp_path / f"shard{i}"
        path.write_bytes(b"x" * 4096)
        fds.append(os.open(path, os.O_RDONLY))
    return fds


def _wait_dropped(cuda: Any, drops: list[int], want: int) -> None:
    deadline = time.monotonic() + 5
    while len(drops) < want and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_writer_reads_cold_files_large_and_drops_them_once_no_load_reads_them(
        cuda: Any, writer_parts: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    dropped: list[int] = []
    real = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, advice: dropped.append(os.fstat(fd).st_ino)
                        if advice == os.POSIX_FADV_DONTNEED else real(fd, off, n, advice))
    warm, cold = _open_fds(tmp_path, 2)
    first = cuda.CudaWriter(writer_parts.arena, writer_parts.staging)
    second = cuda.CudaWriter(writer_parts.arena, writer_parts.staging)  # another load of the cold file
    first.hint(warm, 1.0)
    first.hint(cold, 0.0)
    second.hint(cold, 0.0)
    first.copy_from_file(warm, 0, 0, 4096)
    first.copy_from_file(cold, 0, 4096, 4096)
    assert writer_parts.copies == [(warm, 4096, 4 << 20), ("direct", os.fstat(cold).st_ino, 4096, 16 << 20)]
    first.close()
    with pytest.raises(OSError):  # the writer's O_DIRECT descriptor of the cold file is closed
        os.fstat(writer_parts.direct_fds[0])
    time.sleep(0.2)
    assert dropped == [], "dropped a file another load is still reading"
    second.close()
    _wait_dropped(cuda, dropped, 1)
    assert dropped == [os.fstat(cold).st_ino]
    assert not cuda._LOADING.has(cuda._Inodes.key(cold)) and writer_parts.staging.held
    for fd in (warm, cold):
        os.close(fd)
    writer_parts.staging.release()
    assert cuda.state.contexts == 0


def test_cold_reads_buffered_by_config_go_through_the_page_cache(
        cuda: Any, writer_parts: Any, tmp_path: Any) -> None:
    import os

    backend = object.__new__(cuda.CudaBackend)  # no driver: only its configure is used
    backend._lock, backend._linger_s, backend._stagings = threading.Lock(), 30.0, {0: writer_parts.staging}
    backend.configure(30.0, direct_reads=False)
    (cold,) = _open_fds(tmp_path, 1)
    w = cuda.CudaWriter(writer_parts.arena, writer_parts.staging)
    w.hint(cold, 0.0)
    w.copy_from_file(cold, 0, 0, 4096)
    assert writer_parts.copies == [(cold, 4096, 16 << 20)]
    w.close()
    backend.configure(30.0, direct_reads=True)
    assert writer_parts.staging.direct_reads
    os.close(cold)
    writer_parts.staging.release()


def test_a_lane_whose_copies_failed_is_closed_and_the_load_fails(
        cuda: Any, writer_parts: Any, tmp_path: Any) -> None:
    import os

    (fd,) = _open_fds(tmp_path, 1)
    w = cuda.CudaWriter(writer_parts.arena, writer_parts.staging)
    w.hint(fd, 1.0)
    w.copy_from_file(fd, 0, 0, 4096)
    writer_parts.sync_fails = True
    with pytest.raises(cuda.Internal, match="ILLEGAL_ADDRESS"):
        w.close()
    (lane,) = cuda.state.lanes
    assert lane.closed and writer_parts.staging._free == [] and writer_parts.staging._users == 0
    assert not cuda._LOADING.has(cuda._Inodes.key(fd))
    os.close(fd)
    writer_parts.staging.release()
    assert cuda.state.contexts == 0
