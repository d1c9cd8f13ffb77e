"""`wcd.workers.Pool`: a thread pool whose threads can all be started off the loop, and that runs
work as ThreadPoolExecutor does."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import CancelledError, ThreadPoolExecutor

import pytest

from wcd.workers import Pool


def named(prefix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(prefix + "_")]


def idle(pool: Pool, n: int) -> None:
    """Until `n` of its threads wait for work (a thread counts itself idle just after its work's result)."""
    deadline = time.monotonic() + 5
    while pool._idle < n:
        assert time.monotonic() < deadline
        time.sleep(0.001)


def test_work_runs_and_its_failures_are_the_futures() -> None:
    pool = Pool(3, "t-run")
    try:
        assert pool.submit(sum, [1, 2, 3]).result(5) == 6
        with pytest.raises(ZeroDivisionError):
            pool.submit(lambda: 1 / 0).result(5)
        assert sorted(pool.map(abs, [-2, -1, 0])) == [0, 1, 2]  # Executor.map over submit
        assert len(named("t-run")) <= 3
    finally:
        pool.shutdown()
    assert named("t-run") == []
    with pytest.raises(RuntimeError):
        pool.submit(abs, 1)


def test_a_submit_starts_a_thread_only_when_none_is_idle() -> None:
    pool = Pool(4, "t-lazy")
    try:
        for _ in range(5):
            pool.submit(abs, 1).result(5)
            idle(pool, 1)  # the thread is back waiting
        assert len(named("t-lazy")) == 1
        gate = threading.Event()
        busy = [pool.submit(gate.wait, 5) for _ in range(3)]
        assert len(named("t-lazy")) == 3  # one busy, so two more for the others
        gate.set()
        for f in busy:
            f.result(5)
    finally:
        pool.shutdown()


def test_start_all_starts_every_thread_without_holding_back_work_behind_a_busy_one() -> None:
    """The ThreadPoolExecutor way (work that waits until all threads run) kept a short job waiting
    behind a long one for as long as that ran."""
    pool = Pool(4, "t-all")
    try:
        gate = threading.Event()
        long = pool.submit(gate.wait, 10)  # a fill's fallocate, say
        pool.start_all()
        assert len(named("t-all")) == 4
        started = time.monotonic()
        pool.submit(abs, 1).result(5)
        assert time.monotonic() - started < 1.0
        for _ in range(3):  # the idle ones take work without starting more
            pool.submit(abs, 1).result(5)
            idle(pool, 3)
        assert len(named("t-all")) == 4
        gate.set()
        long.result(5)
    finally:
        pool.shutdown()


def test_shutdown_can_cancel_queued_work_and_does_not_wait_if_told_not_to() -> None:
    pool = Pool(1, "t-stop")
    gate = threading.Event()
    running = pool.submit(gate.wait, 5)
    deadline = time.monotonic() + 5
    while not running.running():  # taken by the thread, not still queued
        assert time.monotonic() < deadline
        time.sleep(0.001)
    queued = pool.submit(abs, 1)
    pool.shutdown(wait=False, cancel_futures=True)
    with pytest.raises(CancelledError):
        queued.result(1)
    gate.set()
    assert running.result(5) is True
    for t in named("t-stop"):
        t.join(5)
    assert named("t-stop") == []
    pool.start_all()  # after shutdown: nothing (a late start-up thread)
    assert named("t-stop") == []


def test_asyncio_takes_it_as_the_default_executor() -> None:
    async def main() -> str:
        pool = Pool(2, "t-loop")
        assert isinstance(pool, ThreadPoolExecutor)
        asyncio.get_running_loop().set_default_executor(pool)
        name = await asyncio.to_thread(lambda: threading.current_thread().name)
        await asyncio.get_running_loop().shutdown_default_executor()
        return name

    assert asyncio.run(main()) == "t-loop_0"
    assert named("t-loop") == []


def test_a_pool_nobody_shut_down_holds_neither_the_exit_nor_its_threads() -> None:
    """As with ThreadPoolExecutor: its threads end when it is collected, and at the interpreter's exit."""
    import gc
    import subprocess
    import sys

    pool = Pool(2, "t-gone")
    pool.submit(abs, 1).result(5)
    pool.start_all()
    assert len(named("t-gone")) == 2
    del pool
    gc.collect()
    for t in named("t-gone"):
        t.join(5)
    assert named("t-gone") == []
    script = "from wcd.workers import Pool; p = Pool(3, 'x'); p.start_all(); p.submit(abs, 1).result(); print('done')"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.strip() == "done", out


def test_a_shutdown_while_start_all_starts_threads_neither_fails_nor_leaves_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM right after READY: the loop's executor is shut down (and joined) while the start-up
    thread is still starting its threads, each start taking its time on a busy host."""
    real_start = threading.Thread.start

    def slow_start(self: threading.Thread) -> None:
        time.sleep(0.05)
        real_start(self)

    pool = Pool(6, "t-race")
    monkeypatch.setattr(threading.Thread, "start", slow_start)
    starter = threading.Thread(target=pool.start_all)
    real_start(starter)
    time.sleep(0.12)  # two or three started, one being started
    pool.shutdown(wait=True)
    starter.join(5)
    monkeypatch.undo()
    for t in named("t-race"):
        t.join(5)
    assert named("t-race") == [] and len(pool._started) < 6  # it stopped starting them


def test_threads_started_from_a_daemon_thread_are_not_daemons() -> None:
    """`start_all` runs in a daemon thread (started after READY); the threads it starts must still
    be ones the shutdown's bounded wait sees (`server._drained` waits for non-daemon threads): a
    fill held in a hung driver call on such a thread let the daemon exit under it at once."""
    pool = Pool(2, "t-daemon")
    try:
        starter = threading.Thread(target=pool.start_all, daemon=True)
        starter.start()
        starter.join(5)
        threads = named("t-daemon")
        assert len(threads) == 2 and not any(t.daemon for t in threads)
    finally:
        pool.shutdown()
