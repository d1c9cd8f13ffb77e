"""`Staging`'s bookkeeping (a GPU's context and loader lanes kept between loads), without a GPU:
CUDA calls are replaced by fakes, so what is checked is who holds what, and when it is released.
verify's reader runs real lanes over a fake driver whose copies land only when waited for."""

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

from tests.unit.fake_cuda import CUDA_MODULES, ArenaModules, forget_cuda_modules, held_calls
from wcd.tuning import LoadTuning


@pytest.fixture
def cuda_module(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """wcd.arenas.cuda and the modules under it as they are (`ArenaModules`), over a stand-in for
    cuda-bindings if that is not installed."""
    try:
        importlib.import_module("cuda.bindings.driver")
    except ImportError:
        pkg, bindings = types.ModuleType("cuda"), types.ModuleType("cuda.bindings")
        bindings.driver = mock.MagicMock()  # type: ignore[attr-defined]
        pkg.bindings = bindings  # type: ignore[attr-defined]
        for name, module in (("cuda", pkg), ("cuda.bindings", bindings), ("cuda.bindings.driver", bindings.driver)):
            monkeypatch.setitem(sys.modules, name, module)
        for name in CUDA_MODULES:
            monkeypatch.delitem(sys.modules, name, raising=False)
    module = ArenaModules()
    monkeypatch.setattr(module, "held", lambda: held_calls(module))  # through the fakes, never libcuda
    yield module
    if isinstance(sys.modules.get("cuda.bindings.driver"), mock.MagicMock):
        forget_cuda_modules()  # the stand-in goes with the fixture


@pytest.fixture
def cuda(cuda_module: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """wcd.arenas.cuda with fake lanes and contexts."""
    module = cuda_module
    state = types.SimpleNamespace(contexts=0, push_fails=False, lanes=[], exclusive=False)

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

    state.Lane = module.Lane  # the real one, for tests that fake the driver under it
    state.exclusive_process = module.exclusive_process  # the same
    monkeypatch.setattr(module, "Lane", FakeLane)
    monkeypatch.setattr(module, "exclusive_process", lambda gpu: state.exclusive)
    monkeypatch.setattr(module, "retain_context", retain)
    monkeypatch.setattr(module, "release_context", release)
    monkeypatch.setattr(module, "current", current)
    module.state = state
    return module


def staging(cuda: Any, linger_s: float) -> Any:
    return cuda.Staging(cuda.Gpu(0, "GPU-x", "test"), LoadTuning(), linger_s)


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
    for thread in s._releasing:
        thread.join(5)
    assert not s.held and cuda.state.contexts == 0


def test_a_linger_lowered_to_zero_releases_off_the_calling_thread(cuda: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """`set_linger` runs on the event loop (a reloaded config, applied at a load's admission): the
    release it starts must not hold the loop for the 0.13-0.18 s it takes on an H200."""
    s = staging(cuda, 30)
    s.open()
    s.close()
    go = threading.Event()
    release_context = cuda.release_context
    monkeypatch.setattr(cuda, "release_context", lambda gpu: (go.wait(5), release_context(gpu)))
    t = time.monotonic()
    s.set_linger(0)
    assert time.monotonic() - t < 0.5 and not s.held and cuda.state.contexts == 1  # under way, not done
    go.set()
    for thread in s._releasing:
        thread.join(5)
    assert cuda.state.contexts == 0


@pytest.mark.parametrize("linger", [0.0, float("inf"), 1e12])
def test_zero_releases_after_the_close_and_inf_or_huge_keep(cuda: Any, linger: float) -> None:
    s = staging(cuda, linger)
    s.open()
    s.give([s.take()])
    s.close()
    for thread in s._releasing:
        thread.join(5)
    assert s.held == (linger > 0) and s._timer is None
    assert (cuda.state.contexts, cuda.state.lanes[0].closed) == ((0, True) if linger == 0 else (1, False))
    s.release()
    assert cuda.state.contexts == 0


def test_with_no_linger_the_release_is_off_the_closing_thread_and_a_new_load_is_not_hurt(
        cuda: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unpinning lanes and releasing the context is not the load's time: `close` returns before
    it ends. A load that opens meanwhile gets a context of its own; a shutdown's `release` waits
    for every release under way, not only the last one started."""
    s = staging(cuda, 0)
    entered = threading.Semaphore(0)
    go = threading.Event()
    release_context = cuda.release_context

    def slow_release(gpu: Any) -> None:
        entered.release()
        assert go.wait(5)
        release_context(gpu)

    monkeypatch.setattr(cuda, "release_context", slow_release)
    s.open()
    s.give([s.take()])
    t = time.monotonic()
    s.close()
    assert time.monotonic() - t < 0.5 and entered.acquire(timeout=5)  # returned while the release waits
    assert not s.held and cuda.state.lanes[0].closed
    s.open()  # the next load, while the last one's release is still under way
    assert s.held and cuda.state.contexts == 2
    s.give([s.take()])
    s.close()  # a second release, beside the first
    assert entered.acquire(timeout=5) and len(s._releasing) == 2 and cuda.state.contexts == 2
    shutdown = threading.Thread(target=s.release)
    shutdown.start()
    shutdown.join(0.3)
    assert shutdown.is_alive()  # waiting for both releases
    go.set()
    shutdown.join(5)
    assert not shutdown.is_alive() and not s.held and cuda.state.contexts == 0
    assert all(lane.closed for lane in cuda.state.lanes)


def test_with_no_thread_to_be_had_the_release_happens_before_close_returns(
        cuda: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tasks limit that refuses a thread does not fail the load or leave the context held."""
    s = staging(cuda, 0)

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    s.open()
    s.give([s.take()])
    s.close()
    assert not s.held and cuda.state.contexts == 0 and cuda.state.lanes[0].closed and s._releasing == []
    s.release()  # as at shutdown: nothing left to wait for, nothing raised


def test_a_release_that_fails_on_its_thread_is_one_log_line(
        cuda: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    def failing(gpu: Any) -> None:
        raise cuda.Internal("CUDA cuDevicePrimaryCtxRelease failed: CUDA_ERROR_UNKNOWN")

    monkeypatch.setattr(cuda, "release_context", failing)
    caplog.set_level(logging.WARNING, logger="wcd")
    s = staging(cuda, 0)
    s.open()
    s.close()
    for thread in s._releasing:
        thread.join(5)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [f"{s.gpu.label}: releasing the CUDA context and load staging failed: "
                     "CUDA cuDevicePrimaryCtxRelease failed: CUDA_ERROR_UNKNOWN"], lines


def test_an_exclusive_process_gpu_keeps_nothing_after_a_load_and_says_so_once(
        cuda: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """In EXCLUSIVE_PROCESS compute mode the context a load leaves would keep every engine from
    creating one on that GPU: released as the load ends. A prepare's hold waits for its load, briefly."""
    import logging

    driver = cuda.cuda
    # The driver's int, the bindings' enum: as cuda-bindings has them (CUcomputemode in cuda.h).
    monkeypatch.setattr(driver, "CUcomputemode", types.SimpleNamespace(CU_COMPUTEMODE_DEFAULT=0,
                                                                       CU_COMPUTEMODE_EXCLUSIVE_PROCESS=3))
    modes = {0: 3, 1: 0}
    asked: list[tuple[Any, int]] = []

    def get_attribute(attribute: Any, device: int) -> tuple[Any, Any]:
        asked.append((attribute, device))
        return cuda.SUCCESS, modes[device]

    monkeypatch.setattr(driver, "cuDeviceGetAttribute", get_attribute, raising=False)
    monkeypatch.setattr(cuda, "exclusive_process", cuda.state.exclusive_process)
    monkeypatch.setattr(cuda, "EXCLUSIVE_PREPARED_S", 0.2)
    caplog.set_level(logging.INFO, logger="wcd")
    s = staging(cuda, 30)
    s.prepare(2)  # the load it prepares for comes soon: kept for it, not for staging_linger_s
    assert s.held and s._timer is not None and s._timer.interval == 0.2
    s.open()
    s.give([s.take(), s.take()])
    s.close()
    assert not s.held and cuda.state.contexts == 0 and all(lane.closed for lane in cuda.state.lanes)
    assert asked == [(driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_MODE, 0)]
    s.open()  # a verify, an adoption check: the same
    s.close()
    assert not s.held
    s.prepare(1)  # its admission failed: nothing takes it over
    time.sleep(0.5)
    assert not s.held and cuda.state.contexts == 0
    other = cuda.Staging(cuda.Gpu(1, "GPU-y", "test"), LoadTuning(), 30)  # default mode: lingers
    other.open()
    other.close()
    assert other.held and other._timer is not None and other._timer.interval == 30
    other.release()
    [line] = [r for r in caplog.records if "compute mode" in r.getMessage()]
    assert line.levelno == logging.INFO
    assert line.getMessage().startswith("test (cuda:0) GPU-x is in exclusive-process compute mode")


class FakeMapping:
    def __init__(self, handle: Any, gpu: Any, size: int, writable: bool) -> None:
        self.ptr, self.size = 1 << 40, size

    def close(self) -> None:
        self.ptr = 0


@pytest.fixture
def writer_parts(cuda: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """CudaWriter over fake lanes that record their copies; `sync_fails` makes a lane's copies fail."""
    parts = types.SimpleNamespace(copies=[], sync_fails=False)

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

        def synchronize(self) -> None:
            if parts.sync_fails:
                raise cuda.Internal("CUDA cuStreamSynchronize failed: CUDA_ERROR_ILLEGAL_ADDRESS")

        def close(self) -> None:
            self.closed = True

    monkeypatch.setattr(cuda, "Lane", CopyLane)
    monkeypatch.setattr(cuda, "VaMapping", FakeMapping)
    monkeypatch.setattr(cuda, "check", lambda result, what: None)
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
    assert writer_parts.copies == [(warm, 4096, 4 << 20), (cold, 4096, 16 << 20)]
    first.close()
    time.sleep(0.2)
    assert dropped == [], "dropped a file another load is still reading"
    second.close()
    _wait_dropped(cuda, dropped, 1)
    assert dropped == [os.fstat(cold).st_ino]
    assert not cuda.LOADING.has(cuda.Inodes.key(cold)) and writer_parts.staging.held
    for fd in (warm, cold):
        os.close(fd)
    writer_parts.staging.release()
    assert cuda.state.contexts == 0


def _direct_fds_of(inode: int) -> list[int]:
    import os

    found = []
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.fstat(int(name)).st_ino == inode and fcntl.fcntl(int(name), fcntl.F_GETFL) & os.O_DIRECT:
                found.append(int(name))
    return found


def test_cold_reads_direct_by_config_go_through_an_o_direct_descriptor_closed_with_the_writer(
        cuda: Any, writer_parts: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    monkeypatch.setattr(cuda, "resident", lambda fd, offset, nbytes: False)  # none of it in the page cache
    backend = object.__new__(cuda.CudaBackend)  # no driver: only its configure is used
    backend._lock, backend._linger_s, backend._stagings = threading.Lock(), 30.0, {0: writer_parts.staging}
    backend.configure(30.0, direct_reads=True)
    warm, cold = _open_fds(tmp_path, 2)
    w = cuda.CudaWriter(writer_parts.arena, writer_parts.staging)
    w.hint(warm, 1.0)
    w.hint(cold, 0.0)
    w.copy_from_file(warm, 0, 0, 4096)
    w.copy_from_file(cold, 0, 4096, 4096)
    # warm: one staging buffer per read; cold: O_DIRECT reads of `direct_read_bytes` (512 KiB)
    assert writer_parts.copies == [(warm, 4096, 4 << 20), ("direct", os.fstat(cold).st_ino, 4096, 512 << 10)]
    w.close()
    assert not _direct_fds_of(os.fstat(cold).st_ino), "the writer left its O_DIRECT descriptor open"
    backend.configure(30.0)
    assert not writer_parts.staging.direct_reads  # buffered unless configured
    for fd in (warm, cold):
        os.close(fd)
    writer_parts.staging.release()


@pytest.mark.parametrize(("direct_read_bytes", "read"), [(1 << 20, 1 << 20), (16 << 20, 16 << 20)])
def test_direct_reads_span_at_most_direct_read_bytes_in_ops_of_the_cold_read_size(
        cuda: Any, writer_parts: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch, direct_read_bytes: int,
        read: int) -> None:
    """`direct_read_bytes` tiles ops in O_DIRECT reads of that size (as large as `cold_read_bytes`:
    one read per op); the ops stay `cold_read_bytes`."""
    import os

    monkeypatch.setattr(writer_parts.staging, "tuning", LoadTuning(direct_read_bytes=direct_read_bytes))
    monkeypatch.setattr(cuda, "resident", lambda fd, offset, nbytes: False)
    w, cold = _direct_writer(cuda, writer_parts, tmp_path)
    w.hint(cold, 0.0)
    assert w.batch_bytes(cold) == LoadTuning().cold_read_bytes == 16 << 20
    w.copy_from_file(cold, 0, 0, 4096)
    assert writer_parts.copies == [("direct", os.fstat(cold).st_ino, 4096, read)]
    w.close()
    os.close(cold)
    writer_parts.staging.release()


def test_ops_of_a_direct_file_that_the_page_cache_holds_are_read_from_it(
        cuda: Any, writer_parts: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the page cache holds of a cold file (here: its first 8 KiB) is read buffered, in warm
    reads (lanes keep their buffers); the rest of it with O_DIRECT."""
    import os

    asked: list[tuple[int, int, int]] = []

    def resident(fd: int, offset: int, nbytes: int) -> bool:
        asked.append((fd, offset, nbytes))
        return offset + nbytes <= 8192

    monkeypatch.setattr(cuda, "resident", resident)
    w, cold = _direct_writer(cuda, writer_parts, tmp_path)
    w.hint(cold, 0.0)
    w.copy_from_file(cold, 0, 0, 8192)
    w.copy_from_file(cold, 8192, 8192, 4096)
    assert asked == [(cold, 0, 8192), (cold, 8192, 4096)]  # the buffered descriptor's pages
    assert writer_parts.copies == [(cold, 8192, 4 << 20), ("direct", os.fstat(cold).st_ino, 4096, 512 << 10)]
    w.close()
    os.close(cold)
    writer_parts.staging.release()


def test_ops_of_a_direct_file_within_what_was_read_ahead_are_read_from_the_page_cache(
        cuda: Any, writer_parts: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loader's read-ahead range (`hint`) counts as cached even where mincore cannot tell (a
    daemon that may only read the file); an op that runs past it goes O_DIRECT."""
    import os

    monkeypatch.setattr(cuda, "resident", lambda fd, offset, nbytes: False)
    w, cold = _direct_writer(cuda, writer_parts, tmp_path)
    w.hint(cold, 0.0, (100, 100 + 8192))
    w.copy_from_file(cold, 100, 0, 8192)
    w.copy_from_file(cold, 100 + 4096, 8192, 8192)
    assert writer_parts.copies == [(cold, 8192, 4 << 20), ("direct", os.fstat(cold).st_ino, 8192, 512 << 10)]
    w.close()
    os.close(cold)
    writer_parts.staging.release()


def test_a_file_system_that_refuses_o_direct_is_read_buffered_and_said_once(
        cuda: Any, writer_parts: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """One warning per file system (naming the first file, saying what to do), not per file or load."""
    import errno
    import logging
    import os

    _o_direct_opens_fail(monkeypatch, errno.EINVAL, "Invalid argument")
    monkeypatch.setattr(cuda, "_BUFFERED_DEVICES", set())
    caplog.set_level(logging.INFO, logger="wcd")
    writer_parts.staging.direct_reads = True
    first, second = _open_fds(tmp_path, 2)
    other = os.open("/dev/null", os.O_RDONLY)  # another file system
    if os.fstat(other).st_dev == os.fstat(first).st_dev:
        pytest.skip(f"{tmp_path} is on /dev's file system")
    for fds in ([first, second], [first, second, other]):  # two loads
        w = cuda.CudaWriter(writer_parts.arena, writer_parts.staging)
        for fd in fds:
            w.hint(fd, 0.5)  # cold, but cached enough not to be dropped after
            w.copy_from_file(fd, 0, 0, 4096)
        w.close()
    assert all(copy[0] != "direct" for copy in writer_parts.copies) and len(writer_parts.copies) == 5
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert lines == [
        _refused_line(f"{tmp_path}/shard0"), _refused_line("/dev/null")]
    for fd in (first, second, other):
        os.close(fd)
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
    assert not cuda.LOADING.has(cuda.Inodes.key(fd))
    os.close(fd)
    writer_parts.staging.release()
    assert cuda.state.contexts == 0


class FakeDriver:
    """The driver calls a lane and a reader make. An async copy first scribbles over its
    destination and lands only when an event recorded after it (or its stream) is waited for, so
    a reader that hands out a buffer too early, or refills one still in use, returns wrong bytes."""

    def __init__(self, cuda: Any, device_bytes: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
        import ctypes

        self.ok, self.not_ready = cuda.SUCCESS, cuda.NOT_READY
        self.device = ctypes.create_string_buffer(device_bytes, len(device_bytes))
        self.pinned: dict[int, Any] = {}
        self.pins = self.streams = self.copies = self.most_in_flight = 0
        self.fail_copy = 0  # the copy (1-based) that fails, 0: none
        self.queue: dict[int, list[tuple[int, Any]]] = {}  # stream -> (seq, copy args or event)
        self.recorded: dict[int, tuple[int, int]] = {}  # event -> (stream, seq)
        self.seq = 0
        for name in ("cuStreamCreate", "cuStreamDestroy", "cuStreamSynchronize", "cuEventCreate",
                     "cuEventDestroy", "cuEventRecord", "cuEventQuery", "cuEventSynchronize", "cuMemHostAlloc",
                     "cuMemFreeHost", "cuMemcpyDtoHAsync", "cuGetErrorString", "cuMemRelease"):
            monkeypatch.setattr(cuda.cuda, name, getattr(self, name), raising=False)

    def cuGetErrorString(self, err: Any) -> tuple[Any, bytes]:
        return self.ok, b"fake"

    def cuMemRelease(self, handle: Any) -> tuple[Any]:
        return (self.ok,)

    def cuStreamCreate(self, flags: Any) -> tuple[Any, int]:
        self.streams += 1
        self.queue[self.streams] = []
        return self.ok, self.streams

    def cuStreamDestroy(self, stream: int) -> tuple[Any]:
        assert not self.queue.pop(stream), "destroyed a stream with copies pending"
        return (self.ok,)

    def cuEventCreate(self, flags: Any) -> tuple[Any, object]:
        return self.ok, object()

    def cuEventDestroy(self, event: object) -> tuple[Any]:
        return (self.ok,)

    def cuMemHostAlloc(self, nbytes: int, flags: int) -> tuple[Any, int]:
        import ctypes

        buf = ctypes.create_string_buffer(nbytes)
        self.pinned[ctypes.addressof(buf)] = buf
        self.pins += 1
        return self.ok, ctypes.addressof(buf)

    def cuMemFreeHost(self, ptr: int) -> tuple[Any]:
        del self.pinned[ptr]
        return (self.ok,)

    def cuMemcpyDtoHAsync(self, dst: int, src: int, nbytes: int, stream: int) -> tuple[Any]:
        import ctypes

        self.copies += 1
        if self.copies == self.fail_copy:
            return (types.SimpleNamespace(name="CUDA_ERROR_ILLEGAL_ADDRESS"),)
        ctypes.memset(dst, 0xA5, nbytes)
        self.seq += 1
        self.queue[stream].append((self.seq, (dst, src, nbytes)))
        self.most_in_flight = max(self.most_in_flight, sum(1 for _, c in self.queue[stream] if c))
        return (self.ok,)

    def cuEventRecord(self, event: object, stream: int) -> tuple[Any]:
        self.seq += 1
        self.recorded[id(event)] = (stream, self.seq)
        self.queue[stream].append((self.seq, None))
        return (self.ok,)

    def _land(self, stream: int, upto: float) -> None:
        import ctypes

        queue = self.queue[stream]
        while queue and queue[0][0] <= upto:
            _, copy = queue.pop(0)
            if copy:
                ctypes.memmove(*copy)

    def cuEventQuery(self, event: object) -> tuple[Any]:
        """Not ready while a copy queued before the event's record is still queued (this GPU runs
        nothing until it is waited for)."""
        stream, seq = self.recorded.get(id(event), (0, 0))
        pending = any(s <= seq for s, _ in self.queue.get(stream, ()))
        return (self.not_ready if pending else self.ok,)

    def cuEventSynchronize(self, event: object) -> tuple[Any]:
        if id(event) in self.recorded:
            self._land(*self.recorded[id(event)])
        return (self.ok,)

    def cuStreamSynchronize(self, stream: int) -> tuple[Any]:
        self._land(stream, float("inf"))
        return (self.ok,)


@pytest.fixture
def gpu_arena(cuda: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Any:
    """A CudaArena over fake device bytes (real lanes, fake driver), the same bytes in a file, and
    ranges of them like a checkpoint's tensors: a large one over several pieces, then small ones
    with padding between, in 64 KiB pieces read 20,000 bytes per window (pieces cut at its edges)."""
    import hashlib
    import os

    from wcd import loader

    monkeypatch.setattr(cuda, "Lane", cuda.state.Lane)
    monkeypatch.setattr(loader, "DIGEST_CHUNK", 64 << 10)
    data = os.urandom(1 << 20)
    driver = FakeDriver(cuda, data, monkeypatch)

    class DeviceMapping(FakeMapping):
        def __init__(self, handle: Any, gpu: Any, size: int, writable: bool) -> None:
            import ctypes

            self.ptr, self.size = ctypes.addressof(driver.device), size

    monkeypatch.setattr(cuda, "VaMapping", DeviceMapping)
    shard = tmp_path / "shard"
    shard.write_bytes(b"header" + data)
    fd = os.open(shard, os.O_RDONLY)
    ranges = [("big", 0, 200_000 + 3, (fd, 6))]
    at = 204_800
    for i in range(300):
        ranges.append((f"s.{i}", at, 1000 + i, (fd, 6 + at)))
        at += 1280 + i // 256 * 256
    s = cuda.Staging(cuda.Gpu(0, "GPU-x", "test"), LoadTuning(read_window=20_000), 30)
    arena = cuda.CudaArena(s.gpu, len(data), object(), os.open(os.devnull, os.O_RDONLY), s, "fake")

    def scheme(name: str) -> str:
        _, offset, n, _ = next(r for r in ranges if r[0] == name)
        b, chunk = data[offset : offset + n], 64 << 10
        pieces = [hashlib.sha256(b[i : i + chunk]).digest() for i in range(0, n, chunk)]
        return pieces[0].hex() if len(pieces) == 1 else hashlib.sha256(b"".join(pieces)).hexdigest()

    parts = types.SimpleNamespace(driver=driver, staging=s, arena=arena, ranges=ranges, shard=shard, fd=fd,
                                  want={name: scheme(name) for name, *_ in ranges})
    yield parts
    arena.close()
    os.close(fd)
    s.release()
    assert cuda.state.contexts == 0 and not driver.pinned, "pinned memory left after the staging's release"


def test_pipelined_reads_give_exactly_the_arena_bytes(cuda: Any, gpu_arena: Any) -> None:
    from wcd.loader import _digest_ranges

    g = gpu_arena
    assert _digest_ranges(g.arena, g.ranges) == (g.want, set())
    assert g.driver.most_in_flight >= 2, "no copy was on its way while a window was hashed"
    with open(g.shard, "r+b") as f:  # one file byte of "big" in its third piece, one of s.17
        for at in (6 + 2 * (64 << 10) + 5, 6 + g.ranges[18][1] + 999):
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ 1]))
    assert _digest_ranges(g.arena, g.ranges) == (g.want, {"big", "s.17"})


def test_a_verify_while_the_staging_is_held_pins_nothing(cuda: Any, gpu_arena: Any) -> None:
    """Readers take the GPU's pooled lanes (here prepared as before a load) and give them back:
    the pinning happens once, not per verify, and the staging lingers after it."""
    from wcd.loader import _digest_ranges, digest_workers

    g = gpu_arena
    g.staging.prepare(digest_workers())
    pinned = g.driver.pins
    for _ in range(2):
        assert _digest_ranges(g.arena, g.ranges)[0] == g.want
    assert g.driver.pins == pinned and g.driver.streams == digest_workers()
    assert g.staging.held and g.staging._users == 0 and len(g.staging._free) == digest_workers()


def test_after_a_verify_the_arena_keeps_no_context_beyond_the_staging_linger(cuda: Any, gpu_arena: Any) -> None:
    """The read mapping and the context it retained go with the last reader, not with the arena:
    otherwise a daemon that verified (or digested, after a restart) a CUDA arena would hold a GPU
    context for as long as the entry lives."""
    from wcd.loader import _digest_ranges

    g = gpu_arena
    assert _digest_ranges(g.arena, g.ranges)[0] == g.want
    assert g.arena._reader is None and g.arena._readers == 0
    assert cuda.state.contexts == 1 and g.staging.held  # the staging's, lingering as after a load
    g.staging.release()
    assert cuda.state.contexts == 0 and g.arena.fd() >= 0  # the arena is still open


def test_a_failed_copy_closes_its_lane_and_a_failed_file_read_pools_it(cuda: Any, gpu_arena: Any) -> None:
    import os

    from wcd.loader import _digest_ranges

    g = gpu_arena
    g.driver.fail_copy = 7
    with pytest.raises(cuda.Internal, match="cuMemcpyDtoHAsync failed: CUDA_ERROR_ILLEGAL_ADDRESS"):
        _digest_ranges(g.arena, g.ranges)
    lanes = g.driver.streams
    assert g.staging._users == 0 and len(g.staging._free) == lanes - 1  # the lane of the failed copy: closed
    assert len(g.driver.pinned) == 2 * len(g.staging._free)
    g.driver.fail_copy = 0
    os.truncate(g.shard, 100_000)  # the file side fails: those lanes' copies were fine
    with pytest.raises(OSError, match="unexpected end of file"):
        _digest_ranges(g.arena, g.ranges)
    assert g.staging._users == 0 and len(g.staging._free) == g.driver.streams - 1
    assert all(not q for q in g.driver.queue.values()), "a lane was pooled with copies pending"


def test_a_reader_announced_one_span_and_asked_for_another_reads_the_other(cuda: Any, gpu_arena: Any) -> None:
    g = gpu_arena
    reader = g.arena.reader()
    device = bytes(g.driver.device)
    try:
        for (offset, nbytes), then in [((0, 50_000), (100_000, 30_000)), ((7, 45_001), (300_001, 1)),
                                       ((300_001, 1), (0, 10)), ((0, 10), None)]:
            got = b"".join(bytes(w) for w in reader.windows(offset, nbytes, then))
            assert got == device[offset : offset + nbytes]
    finally:
        reader.close()
    assert g.staging._users == 0 and len(g.staging._free) == 1


def test_on_an_exclusive_process_gpu_the_check_after_a_restart_takes_no_context(
        cuda: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine attached across the restart may hold the GPU's only context: the check of a
    re-adopted arena must not need one there (elsewhere it maps the arena under the staging's)."""
    import os

    mapped: list[int] = []

    class Mapping:
        def __init__(self, handle: Any, gpu: Any, size: int, writable: bool) -> None:
            mapped.append(size)

        def close(self) -> None:
            pass

    monkeypatch.setattr(cuda, "VaMapping", Mapping)
    s = staging(cuda, 30)
    arena = cuda.CudaArena(s.gpu, 4 << 20, object(), os.open(os.devnull, os.O_RDONLY), s, "t")
    try:
        cuda.state.exclusive = True
        arena.check_adopted()
        assert mapped == [] and cuda.state.contexts == 0 and not s.held
        cuda.state.exclusive = False
        arena.check_adopted()
        assert mapped == [4 << 20] and s.held  # the staging's context, lingering as after a load
        s.release()
    finally:
        os.close(arena.fd())
        arena._fd = -1  # closed: its fake handle is not the driver's to release


def _direct_writer(cuda: Any, writer_parts: Any, tmp_path: Any) -> tuple[Any, int]:
    """A CudaWriter that reads cold files with O_DIRECT, and one 4 KiB file for it (the caller closes both)."""
    writer_parts.staging.direct_reads = True
    (cold,) = _open_fds(tmp_path, 1)
    return cuda.CudaWriter(writer_parts.arena, writer_parts.staging), cold


def _o_direct_opens_fail(monkeypatch: pytest.MonkeyPatch, error: int, message: str) -> None:
    """`os.open` with O_DIRECT fails with `error`; other opens go through."""
    import os

    real_open = os.open

    def opener(path: Any, flags: int, *args: Any) -> int:
        if flags & os.O_DIRECT:
            raise OSError(error, message)
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", opener)


def _refused_line(path: str) -> str:
    return (f'cannot read {path} with O_DIRECT (Invalid argument): cold reads from its file system go through the '
            'page cache instead (cold_reads = "direct", the default); set cold_reads = "buffered" to silence this')


def test_a_file_system_that_opens_with_o_direct_but_refuses_its_reads_is_read_buffered(
        cuda: Any, writer_parts: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The op that met the refusal is read again buffered (its copies land after the attempt's, on
    the same stream), later ops go buffered at once, and the log says it once."""
    import errno
    import logging
    import os

    tried: list[int] = []

    def refused(lane: Any, fd: int, *args: Any) -> None:
        tried.append(fd)
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(cuda.Lane, "copy_direct", refused)
    monkeypatch.setattr(cuda, "resident", lambda fd, offset, nbytes: False)
    monkeypatch.setattr(cuda, "_BUFFERED_DEVICES", set())
    caplog.set_level(logging.INFO, logger="wcd")
    w, cold = _direct_writer(cuda, writer_parts, tmp_path)
    w.hint(cold, 0.5)
    w.copy_from_file(cold, 0, 0, 4096)
    w.copy_from_file(cold, 0, 4096, 4096)
    assert len(tried) == 1 and writer_parts.copies == [(cold, 4096, 16 << 20)] * 2
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        _refused_line(f"{tmp_path}/shard0")]
    direct = tried[0]
    w.close()
    with pytest.raises(OSError):  # closed with the writer all the same
        os.fstat(direct)
    os.close(cold)
    writer_parts.staging.release()


def test_out_of_descriptors_for_o_direct_fails_the_load_not_the_file_system(
        cuda: Any, writer_parts: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno
    import os

    _o_direct_opens_fail(monkeypatch, errno.EMFILE, "Too many open files")
    monkeypatch.setattr(cuda, "_BUFFERED_DEVICES", set())
    w, cold = _direct_writer(cuda, writer_parts, tmp_path)
    with pytest.raises(OSError, match="Too many open files"):
        w.hint(cold, 0.0)
    assert not cuda._BUFFERED_DEVICES  # the file system was not marked as refusing O_DIRECT
    w.close()
    os.close(cold)
    writer_parts.staging.release()


def test_a_held_call_that_fails_says_so_in_one_line(cuda_module: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """`HeldCalls` return the driver's bare CUresult: a failure is one line naming the call, out of
    memory its own error, and a code newer than the bindings still a line, not a ValueError."""
    import enum

    class CUresult(enum.IntEnum):
        CUDA_SUCCESS = 0
        CUDA_ERROR_INVALID_VALUE = 1
        CUDA_ERROR_OUT_OF_MEMORY = 2

    monkeypatch.setattr(cuda_module, "SUCCESS", CUresult.CUDA_SUCCESS)
    monkeypatch.setattr(cuda_module.cuda, "CUresult", CUresult, raising=False)
    monkeypatch.setattr(cuda_module.cuda, "cuGetErrorString", lambda err: (CUresult.CUDA_SUCCESS, b"bad value"),
                        raising=False)
    cuda_module.check_held(0, "cuEventRecord")
    line = r"^CUDA cuEventRecord failed: CUDA_ERROR_INVALID_VALUE \(bad value\)$"
    with pytest.raises(cuda_module.Internal, match=line):
        cuda_module.check_held(1, "cuEventRecord")
    with pytest.raises(cuda_module.OutOfMemory, match="cuMemcpyHtoDAsync failed: CUDA_ERROR_OUT_OF_MEMORY"):
        cuda_module.check_held(2, "cuMemcpyHtoDAsync")
    with pytest.raises(cuda_module.Internal, match=r"^CUDA cuMemcpyHtoDAsync failed: error 999$"):
        cuda_module.check_held(999, "cuMemcpyHtoDAsync")
