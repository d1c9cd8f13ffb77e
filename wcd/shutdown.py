"""Shutdown of what the residency holds: its descriptors closed without evicting, so parked
arenas stay in systemd's fd store for the next start and the others' memory returns once clients
unmap. The closes and the release of lingering GPU contexts and staging call the driver: they run
in a thread of their own, waited for at most RELEASE_WAIT_S (a hung driver must not hold shutdown
until systemd's stop timeout), then one line says what is left."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING

from wcd.arenas import loaded_backends
from wcd.life import life

if TYPE_CHECKING:
    from wcd.entry import Entry
    from wcd.header_helpers import HeaderHelpers
    from wcd.workers import Pool

log = logging.getLogger("wcd")

# How long shutdown waits for the driver to let go of arenas and lingering GPU staging: a hung
# driver must not hold it until systemd's stop timeout; what is left goes with the process.
RELEASE_WAIT_S = 5.0


async def release(entries: Collection[Entry], pools: Iterable[Pool], helpers: HeaderHelpers) -> bool:
    """Close what `entries` hold, stop `pools` and `helpers`, release the backends' staging;
    whether the driver hung (had not let go after RELEASE_WAIT_S: the process must not wait for it)."""
    for entry in entries:  # adopted, never checked (start-up failed before READY)
        record = life(entry)
        if record.adopted is not None:
            os.close(record.adopted[1])
            record.adopted = None
    for pool in pools:
        pool.shutdown(wait=False, cancel_futures=True)
    arenas = [(e.name, e.arena) for e in entries if e.arena is not None]
    backends = loaded_backends()
    arenas_left, staging_left = len(arenas), [what for b in backends for what in b.lingering()]
    loop, released = asyncio.get_running_loop(), asyncio.Event()

    def let_go() -> None:
        nonlocal arenas_left, staging_left
        try:
            try:
                helpers.close()  # kills and reaps them: not on the loop
            except Exception as e:  # noqa: BLE001 - shutting down: say it and go on
                log.warning("stopping the header helpers: %s", e)
            for name, arena in arenas:
                try:
                    arena.close()  # deferred while a worker holds it; its next read stops it
                except Exception as e:  # noqa: BLE001 - shutting down: say it and go on
                    log.warning("closing the arena of %s: %s", name, getattr(e, "message", e))
                arenas_left -= 1
            for backend in backends:
                try:
                    backend.release()  # lingering GPU contexts and staging; a fill still running keeps its own
                except Exception as e:  # noqa: BLE001 - shutting down: say it and go on
                    log.warning("releasing load staging: %s", getattr(e, "message", e))
            staging_left = []
        finally:
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
                loop.call_soon_threadsafe(released.set)

    # A daemon thread, not an executor's: the interpreter joins those at exit, hung or not.
    threading.Thread(target=let_go, name="wcd-release", daemon=True).start()
    try:
        await asyncio.wait_for(released.wait(), RELEASE_WAIT_S)
    except asyncio.TimeoutError:
        n = arenas_left
        what = ([f"{n} arena{'s' if n != 1 else ''}"] if n else []) + staging_left or ["the GPU load staging"]
        log.warning("shutdown: the driver has not let go of %s after %g s (a hung GPU driver?); stopping "
                    "without waiting: it goes when this process exits", " and ".join(what), RELEASE_WAIT_S)
        return True
    return False
