"""`Residency.close` at shutdown (`wcd.shutdown`), with fake backends: the driver calls it makes run off the loop,
and a hung driver holds shutdown for RELEASE_WAIT_S at most."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import pytest

from wcd import residency, shutdown
from wcd.cache import Cache
from wcd.config import Config
from wcd.metrics import Metrics
from wcd.residency import Residency
from wcd.state import ServerState


class StuckBackend:
    """The part of an `ArenaBackend` shutdown uses; `release` blocks in the "driver" until
    `unblock` is set (or fails)."""

    def __init__(self, fails: bool = False) -> None:
        self.unblock = threading.Event()
        self.fails = fails
        self.released_in: list[str] = []

    def release(self) -> None:
        self.released_in.append(threading.current_thread().name)
        if self.fails:
            raise RuntimeError("CUDA cuDevicePrimaryCtxRelease failed: CUDA_ERROR_UNKNOWN")
        self.unblock.wait(30)

    def lingering(self) -> list[str]:
        return ["the CUDA context and load staging of GPU 0 (cuda:0)"]


def make_residency() -> Residency:
    state = ServerState(Config(), "test", Cache({"cpu": 1 << 30}, 30.0), {"cpu": "cpu"}, 0.0)

    def spawn(coro: Any) -> Any:
        raise AssertionError("no background work in these tests")

    return Residency(state, Metrics(state), spawn)


async def close_and_answer_pings(res: Residency) -> tuple[int, float, int]:
    """(what close returns, how long it took, loop turns meanwhile: it must not block the loop)."""
    turns = 0

    async def ping() -> None:
        nonlocal turns
        while True:
            await asyncio.sleep(0.01)
            turns += 1

    pinger = asyncio.ensure_future(ping())
    started = time.monotonic()
    kept = await res.close()
    took = time.monotonic() - started
    pinger.cancel()
    return kept, took, turns


def test_a_hung_driver_holds_shutdown_for_the_bounded_wait_then_one_line_says_what_is_left(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    stuck = StuckBackend()
    monkeypatch.setattr(shutdown, "loaded_backends", lambda: [stuck])
    monkeypatch.setattr(shutdown, "RELEASE_WAIT_S", 0.3)
    caplog.set_level(logging.INFO, logger="wcd")
    try:
        kept, took, turns = asyncio.run(close_and_answer_pings(make_residency()))
    finally:
        stuck.unblock.set()
    assert kept == 0 and 0.3 <= took < 2 and turns >= 10
    assert stuck.released_in == ["wcd-release"]  # off the loop, in a daemon thread the exit does not join
    [line] = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert line.getMessage() == (
        "shutdown: the driver has not let go of the CUDA context and load staging of GPU 0 (cuda:0) after 0.3 s "
        "(a hung GPU driver?); stopping without waiting: it goes when this process exits")
    assert line.exc_info is None


def test_a_release_that_fails_is_one_line_and_shutdown_goes_on(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    failing = StuckBackend(fails=True)
    monkeypatch.setattr(shutdown, "loaded_backends", lambda: [failing])
    caplog.set_level(logging.INFO, logger="wcd")
    kept, took, _ = asyncio.run(close_and_answer_pings(make_residency()))
    assert kept == 0 and took < shutdown.RELEASE_WAIT_S
    [line] = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert line.getMessage() == "releasing load staging: CUDA cuDevicePrimaryCtxRelease failed: CUDA_ERROR_UNKNOWN"
    assert line.exc_info is None


def test_both_waits_for_both_calls_whatever_ends_it() -> None:
    """`_both` returns only once both threads have ended: on an error of either (the first's is
    raised), and when cancelled (the CancelledError goes on, not a call's error)."""
    import time

    from wcd.errors import LoadFailed
    from wcd.offloop import both as _both

    ended: list[str] = []

    def slow(name: str, fail: bool = False) -> str:
        time.sleep(0.2)
        ended.append(name)
        if fail:
            raise LoadFailed(name)
        return name

    async def main() -> None:
        assert await _both(lambda: slow("a"), lambda: slow("b")) == ("a", "b")
        ended.clear()
        with pytest.raises(LoadFailed, match="b"):
            await _both(lambda: "quick", lambda: slow("b", fail=True))
        ended.clear()
        with pytest.raises(LoadFailed, match="a"):  # the first's error, the second's retrieved
            await _both(lambda: slow("a", fail=True), lambda: slow("b", fail=True))
        assert sorted(ended) == ["a", "b"]
        ended.clear()
        task = asyncio.ensure_future(_both(lambda: slow("a", fail=True), lambda: slow("b")))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert sorted(ended) == ["a", "b"]  # both ended before the cancellation went on
        ended.clear()
        task = asyncio.ensure_future(_both(lambda: slow("a"), lambda: slow("b")))
        for _ in range(3):  # cancelled again while it waits for them
            await asyncio.sleep(0.03)
            task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert sorted(ended) == ["a", "b"]

    asyncio.run(main())


def test_what_a_cancelled_open_opened_is_closed() -> None:
    """`_opened`: cancelled while its thread opens, the result is closed once it is there."""
    import threading

    from wcd.offloop import produced as _opened

    closed = threading.Event()
    go = threading.Event()

    class Opened:
        def close(self) -> None:
            closed.set()

    def opening() -> Opened:
        go.wait(5)
        return Opened()

    async def main() -> None:
        task = asyncio.ensure_future(_opened(opening))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not closed.is_set()
        go.set()
        for _ in range(100):
            if closed.is_set():
                break
            await asyncio.sleep(0.01)
        assert closed.is_set()
        assert isinstance(await _opened(Opened), Opened)

    asyncio.run(main())


def test_both_outlasts_the_loops_end() -> None:
    """At the loop's end every task left is cancelled: `_both`'s calls are not tasks, so the one
    awaiting them still waits for both threads before it goes on (its caller closes their fds)."""
    import time

    from wcd.offloop import both as _both

    ended: list[str] = []

    def slow(name: str) -> str:
        time.sleep(0.3)
        ended.append(name)
        return name

    async def waiter() -> None:
        try:
            await _both(lambda: slow("a"), lambda: slow("b"))
        finally:
            ended.append("caller")

    async def main() -> None:
        asyncio.ensure_future(waiter())
        await asyncio.sleep(0.05)  # returns with the waiter still waiting: the loop's end cancels it

    asyncio.run(main())
    assert ended[-1] == "caller" and sorted(ended[:2]) == ["a", "b"], ended


def test_a_filled_checkpoints_headers_are_freed_in_a_thread_not_on_the_loop() -> None:
    """`_free_headers`: 100,000 tensors' columns take ms to free; the loop answers meanwhile."""
    freed_on: list[str] = []

    class Column:
        def __del__(self) -> None:
            freed_on.append(threading.current_thread().name)

    class Filled:
        def __init__(self) -> None:
            self.headers: Any = (Column(), Column())

    async def main() -> Filled:
        ckpt = Filled()
        residency._free_headers(ckpt)  # type: ignore[arg-type]
        assert ckpt.headers == ()
        deadline = time.monotonic() + 5
        while len(freed_on) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return ckpt

    asyncio.run(main())
    assert len(freed_on) == 2 and threading.main_thread().name not in freed_on
