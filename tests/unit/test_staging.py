"""`Staging`'s bookkeeping (a GPU's context and loader lanes kept between loads), without a GPU:
CUDA calls are replaced by fakes, so what is checked is who holds what, and when it is released."""

from __future__ import annotations

import contextlib
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
def cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """wcd.arenas.cuda with fake lanes and contexts (and a stand-in for cuda-bindings if it is not installed)."""
    try:
        importlib.import_module("cuda.bindings.driver")
    except ImportError:
        pkg, bindings = types.ModuleType("cuda"), types.ModuleType("cuda.bindings")
        bindings.driver = mock.MagicMock()  # type: ignore[attr-defined]
        pkg.bindings = bindings  # type: ignore[attr-defined]
        for name, module in (("cuda", pkg), ("cuda.bindings", bindings), ("cuda.bindings.driver", bindings.driver)):
            monkeypatch.setitem(sys.modules, name, module)
        monkeypatch.delitem(sys.modules, "wcd.arenas.cuda", raising=False)
    module = importlib.import_module("wcd.arenas.cuda")
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
    yield module
    if not isinstance(sys.modules.get("cuda.bindings.driver"), mock.MagicMock):
        return
    sys.modules.pop("wcd.arenas.cuda", None)  # the stand-in goes with the fixture


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
