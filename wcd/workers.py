"""Worker threads that exist before the loop needs them.

`ThreadPoolExecutor` starts a thread on a submit that finds none idle, and `Thread.start` waits
until the new thread has run once. On a busy host that wait is the scheduler's to decide: on the
2-core CI machine, with two digest threads hashing, a `Thread.start` from the loop took up to
19 ms (10 ms for a bare start beside two busy threads), a stall of every connection. So each pool
the loop submits to is a `Pool`, and `start_all` brings all their threads up at once, from a thread
of its own, once READY is sent (`Server.startup`); before then, and for a pool that shrank, the
pool still starts what it lacks on the submit, as ThreadPoolExecutor does.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger("wcd")

START_WAIT_S = 5.0  # how long a pool's threads wait for each other at `start_all`


class Pool(ThreadPoolExecutor):
    def __init__(self, workers: int, name: str) -> None:
        super().__init__(workers, thread_name_prefix=name)
        self.workers = workers

    def start_all(self) -> None:
        """Start every thread now (blocking; not from the loop, nor from one of this pool's own
        threads). Tasks that each wait until all have started make the pool start one thread per
        submit; a pool busy with real work meanwhile may reuse a thread instead, and the wait
        then ends at START_WAIT_S with fewer threads started, which only costs a later start."""
        meet = threading.Barrier(self.workers)

        def started() -> None:
            try:
                meet.wait(START_WAIT_S)
            except threading.BrokenBarrierError:
                pass

        for future in [self.submit(started) for _ in range(self.workers)]:
            future.result()


def loop_executor() -> Pool:
    """The loop's default executor (asyncio.to_thread), as many threads as asyncio's own."""
    return Pool(min(32, (os.cpu_count() or 1) + 4), "wcd-worker")


def start_all(starters: Iterable[Callable[[], None]]) -> None:
    """Run each pool's `start_all` in a thread of its own; the loop is not waited on."""
    starters = list(starters)

    def run() -> None:
        for start in starters:
            try:
                start()
            except Exception:  # noqa: BLE001 - shut down meanwhile (submit refused, or cancelled)
                return
        log.debug("worker threads started")

    threading.Thread(target=run, name="wcd-start", daemon=True).start()
