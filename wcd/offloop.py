"""Work that runs off the event loop: jobs in worker threads whose results must not leak.

Every helper here keeps one rule: something a worker opens or allocates for a waiter that was
cancelled meanwhile (its client went away, shutdown) is closed once the worker is done, never
under it and never dropped. Nothing here knows what an entry is.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, Protocol, TypeVar

T = TypeVar("T")
U = TypeVar("U")


class Closable(Protocol):
    def close(self) -> None: ...


class Usable(Protocol):
    def in_use(self) -> contextlib.AbstractContextManager[Any]: ...


C = TypeVar("C", bound=Closable)
A = TypeVar("A", bound=Usable)


async def produced(call: Callable[[], C], pool: Executor | None = None) -> C:
    """`call()` in a worker (the loop's default executor unless `pool`): what it opens or
    allocates. Cancelled meanwhile, that is closed once the worker has produced it."""
    future = asyncio.get_running_loop().run_in_executor(pool, call)  # a future, not a task: never cancelled
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        future.add_done_callback(_close_result)
        raise


def _close_result(future: asyncio.Future[Any]) -> None:
    if not future.cancelled() and future.exception() is None:
        close_later(future.result())


async def using(pool: Executor | None, held: A, job: Callable[[A], T]) -> T:
    """Run `job(held)` in `pool` (None: the loop's default executor, for short work) while holding
    `held` (`in_use`: an arena is not closed under a worker)."""
    def run() -> T:
        with held.in_use():
            return job(held)

    return await asyncio.get_running_loop().run_in_executor(pool, run)


async def both(first: Callable[[], T], second: Callable[[], U]) -> tuple[T, U]:
    """Run two calls in threads at once and return both results, or raise the first's error, then
    the second's, only once both have ended (they read through descriptors their caller closes on
    an error). Cancelled, even again and again, it still waits for both before the CancelledError
    goes on."""
    # Futures, not tasks: the loop's end cancels every task left, and these must stay until their
    # threads end.
    loop = asyncio.get_running_loop()
    calls = loop.run_in_executor(None, first), loop.run_in_executor(None, second)
    try:
        await asyncio.shield(asyncio.wait(calls))
    except asyncio.CancelledError:
        while not all(call.done() for call in calls):
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait(calls)
        for call in calls:
            if call.done() and not call.cancelled():
                call.exception()  # retrieved: the cancellation is what goes on
        raise
    for error in [call.exception() for call in calls]:  # both retrieved
        if error is not None:
            raise error
    return calls[0].result(), calls[1].result()


def off_loop(call: Callable[[], object]) -> None:
    """Run `call` in the default executor, not waited for; inline if the loop is shutting down."""
    try:
        asyncio.get_running_loop().run_in_executor(None, call)
    except RuntimeError:  # the loop or its executor is shutting down
        call()


def close_later(what: Closable) -> None:
    """Close off the loop: freeing an arena's last reference takes ~0.3 s per GB."""
    off_loop(what.close)


def free_later(held: list[Any]) -> None:
    """Drop the last references to large objects (a checkpoint's header columns) in a thread,
    beside the reply, rather than on the loop."""
    off_loop(held.clear)


def quiet(future: asyncio.Future[Any]) -> None:
    """Retrieve a background future's failure so it is not logged as never retrieved."""
    if not future.cancelled():
        future.exception()
