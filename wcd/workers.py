"""Worker threads that exist before the loop needs them.

`ThreadPoolExecutor` starts a thread on a submit that finds none idle, and `Thread.start` waits
until the new thread has run once. On a busy host that wait is the scheduler's to decide: on the
2-core CI machine, with two digest threads hashing, a `Thread.start` from the loop took up to
19 ms (a bare start beside two busy threads: p90 3.4 ms, up to 9.3), a stall of every connection.
So each pool the loop submits to is a `Pool`, whose `start_all` brings its missing threads up from
a thread of its own once READY is sent (`Server.startup`); before that a submit that finds no
thread idle starts one, as ThreadPoolExecutor does.

A `Pool` is a ThreadPoolExecutor by type only (asyncio's `set_default_executor` requires one):
it queues and runs work itself, because ThreadPoolExecutor can be made to start a thread only by
handing it work, and work that waits for the others to start holds back the real work queued
behind it (a fill's fallocate holding one thread kept a `to_thread` waiting 2.45 s).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

log = logging.getLogger("wcd")

_Work = tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]
_pools: weakref.WeakSet[Pool] = weakref.WeakSet()  # every pool, for `_wake_at_exit`


class Pool(ThreadPoolExecutor):
    def __init__(self, workers: int, name: str) -> None:
        super().__init__(workers, thread_name_prefix=name)  # its own queue and threads stay unused
        self.workers, self._name = workers, name
        self._work: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._started: list[threading.Thread] = []
        self._idle = 0  # threads waiting for work that no submit has counted on yet
        self._closed = False
        _pools.add(self)

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._work.put((future, fn, args, kwargs))
            thread = None
            if self._idle:
                self._idle -= 1
            elif len(self._started) < self.workers:
                thread = self._new_thread()
        if thread is not None:
            try:
                thread.start()
            except BaseException:  # no thread (limits, memory): the work is not left queued for none
                future.cancel()
                with self._lock:
                    self._started.remove(thread)
                raise
        return future

    def start_all(self) -> None:
        """Start the threads not started yet (blocking: not from the loop), one at a time, so that
        a shutdown meanwhile stops it. They begin idle."""
        while True:
            with self._lock:
                if self._closed or len(self._started) >= self.workers:
                    return
                thread = self._new_thread()
                self._idle += 1
            try:
                thread.start()
            except BaseException:
                with self._lock:
                    self._started.remove(thread)
                    self._idle -= 1
                raise

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._closed = True
            threads = list(self._started)
            if cancel_futures:
                while True:
                    try:
                        work = self._work.get_nowait()
                    except queue.Empty:
                        break
                    if work is not None:
                        work[0].cancel()
            self._work.put(None)  # each thread passes it on as it ends
        super().shutdown(wait=False)
        if wait:
            for thread in threads:
                with contextlib.suppress(RuntimeError):  # still being started by `start_all`: it ends
                    thread.join()                        # at once, on the sentinel

    def _new_thread(self) -> threading.Thread:  # under the lock; started by the caller
        # The thread holds the pool weakly, as ThreadPoolExecutor's do: a pool nobody shut down
        # ends its threads when it is collected, and at the interpreter's exit (`_wake_at_exit`).
        work = self._work
        # Never a daemon thread, whoever starts it (`start_all` runs in one, and a thread inherits
        # that): the shutdown waits a bounded time for the pools' threads (`server._drained`) and
        # must see a hung one, or it exits under a fill still writing.
        thread = threading.Thread(target=_run, args=(weakref.ref(self, lambda _: work.put(None)), work),
                                  name=f"{self._name}_{len(self._started)}", daemon=False)
        self._started.append(thread)
        return thread


def _run(pool_ref: weakref.ref[Pool], work_queue: queue.SimpleQueue[_Work | None]) -> None:
    while (work := work_queue.get()) is not None:
        _call(*work)
        del work  # nothing of it outlives its call
        pool = pool_ref()
        if pool is None:
            return
        with pool._lock:
            pool._idle += 1
        del pool
    work_queue.put(None)  # for the next thread


def _call(future: Future[Any], fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if future.set_running_or_notify_cancel():
        try:
            result = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - the future's, as in ThreadPoolExecutor
            future.set_exception(e)
        else:
            future.set_result(result)


def _wake_at_exit() -> None:
    """Before the interpreter joins its threads at exit (as concurrent.futures does for its own):
    no more work, and each pool's threads end after what is queued."""
    for pool in list(_pools):
        with pool._lock:
            pool._closed = True
            pool._work.put(None)


threading._register_atexit(_wake_at_exit)  # type: ignore[attr-defined]


def loop_executor() -> Pool:
    """The loop's default executor (asyncio.to_thread), as many threads as asyncio's own."""
    return Pool(min(32, (os.cpu_count() or 1) + 4), "wcd-worker")


def start_all(starters: Iterable[Callable[[], object]]) -> None:
    """Run each starter in turn in a thread of its own; the loop is not waited on."""
    starters = list(starters)

    def run() -> None:
        for start in starters:
            try:
                start()
            except Exception as e:  # noqa: BLE001 - a thread that cannot start waits for a submit
                log.warning("starting worker threads: %s: %s", type(e).__name__, e)
                return
        log.debug("worker threads started")

    threading.Thread(target=run, name="wcd-start", daemon=True).start()
