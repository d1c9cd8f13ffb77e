"""Parking in systemd's fd store, and re-adoption of what was parked after a restart.

A ready entry's arena fd and a record of it (`wcd.parking`) are stored in the fd store, so a
restarted daemon serves it without reading the disk. At start-up, before READY, the stored fds
are only sorted into (record, arena fd) pairs: what takes microseconds per entry whatever its
size and imports nothing. After READY each is checked (`check`): the arena opened by its backend
(host: seals and size; CUDA: import), the record's layout validated, the checkpoint
re-fingerprinted (a changed one is never served) and the backend's own check of the arena, tried
again while the GPU has no memory for it yet. The decisions (admit, drop, load from disk instead)
are `wcd.residency`'s.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from wcd import parking, systemd
from wcd.arenas import Arena, ArenaBackend
from wcd.checkpoint import open_files
from wcd.errors import BadRequest, WcdError
from wcd.key import fingerprint_unparsed
from wcd.life import life, unstore
from wcd.manifest import Manifest
from wcd.offloop import close_later, produced, using

if TYPE_CHECKING:
    from wcd.cache import Entry

log = logging.getLogger("wcd")

# A check of a re-adopted arena that fails for want of memory or in the driver, not because the
# arena or its checkpoint differ from the record, is tried again after each of these waits before
# the entry is dropped (and its copy taken out of the fd store): an engine may be freeing memory.
CHECK_RETRY_S = (1.0, 2.0, 4.0, 8.0, 16.0)
ADOPTING_NOTE = "re-adopted from systemd's fd store: checking it before serving"


def park(entry: Entry) -> None:
    """Put a ready entry's arena fd and its record into systemd's fd store (if there is one)."""
    record = life(entry)
    if not systemd.store_enabled() or record.parked or entry.arena is None:
        return
    arena_name, record_name = parking.fd_names(entry.key, entry.publisher)
    try:
        fd = parking.record_memfd(entry)
        try:
            systemd.store_fds([entry.arena.fd()], arena_name)
            systemd.store_fds([fd], record_name)
        finally:
            os.close(fd)
    except (systemd.SystemdError, OSError, ValueError) as e:
        log.warning("cannot park %s in systemd's fd store (%s): it will be reloaded after a restart",
                    entry.name, e)
        return
    record.parked = True


def unpark(entry: Entry) -> None:
    """Take a parked entry's fds out of systemd's fd store: a restart will not find it."""
    record = life(entry)
    if record.parked:
        record.parked = False
        for name in parking.fd_names(entry.key, entry.publisher):
            unstore(name)


def sort_stored(fds: list[tuple[int, str]], admit: Callable[[parking.ParkedEntry, int], object]) -> None:
    """Pair the fds systemd kept for us into (record, arena fd) and `admit` each pair (which owns
    the arena fd from then on); drop and unstore anything unknown, corrupt, or that `admit` refuses
    with a `WcdError`."""
    groups: dict[str, dict[str, int]] = {}
    for fd, name in fds:
        stem, dot, suffix = name.rpartition(".")
        if dot and "." + suffix in (parking.ARENA_SUFFIX, parking.RECORD_SUFFIX):
            groups.setdefault(stem, {})["." + suffix] = fd
        else:
            log.warning("fd store: dropping unknown fd %r", name)
            os.close(fd)
            unstore(name)
    for stem, parts in groups.items():
        arena_fd = parts.pop(parking.ARENA_SUFFIX, None)
        record_fd = parts.pop(parking.RECORD_SUFFIX, None)
        try:
            if arena_fd is None or record_fd is None:
                raise BadRequest("its arena or record is missing")
            admit(parking.parse_record(record_fd), arena_fd)
            arena_fd = None  # its check owns it now
        except (WcdError, OSError) as e:
            log.warning("fd store: dropping %s: %s", stem, getattr(e, "message", e))
            for suffix in (parking.ARENA_SUFFIX, parking.RECORD_SUFFIX):
                unstore(stem + suffix)
        finally:
            for leftover in (arena_fd, record_fd):
                if leftover is not None:
                    os.close(leftover)


async def check(entry: Entry, backend: ArenaBackend, follow_links: bool,
                gone: Callable[[], bool]) -> tuple[Manifest, list[str]] | None:
    """Open and check a re-adopted entry's arena (`entry.arena` from then on); its validated
    manifest and notes, or None if the entry was dropped meanwhile (`gone`: what it held is then
    closed). Raises whatever makes it unfit to serve."""
    rec, fd = life(entry).start_check()
    arena = await _open(backend, entry, rec, fd)
    if gone():
        close_later(arena)
        return None
    entry.arena = arena
    manifest = await asyncio.to_thread(rec.manifest)
    notes = await asyncio.to_thread(_refingerprint, rec, follow_links) if rec.origin != "publish" else []
    if gone() or not await _check_arena(entry, arena, gone):
        return None
    return manifest, notes


async def _open(backend: ArenaBackend, entry: Entry, rec: parking.ParkedEntry, fd: int) -> Arena:
    """The arena of a re-adopted entry, opened by its backend in a worker; `fd` is the arena's from
    then on, and closed here if that fails."""
    def open_it() -> Arena:
        try:
            return backend.adopt(fd, entry.device, rec.arena_size, rec.name)
        except BaseException:
            os.close(fd)
            raise

    return await produced(open_it)


async def _check_arena(entry: Entry, arena: Arena, gone: Callable[[], bool]) -> bool:
    """The backend's check of a re-adopted arena (`Arena.check_adopted`), tried again after each
    CHECK_RETRY_S wait while it fails with a `WcdError` other than `BadRequest` (which says the
    arena is not what its record says): no GPU memory for a context, or a driver error, is the
    GPU's state of the moment. False if the entry was dropped meanwhile; an entry evicted
    meanwhile is not checked again (its caller drops it)."""
    for wait_s in (*CHECK_RETRY_S, None):
        try:
            await using(None, arena, lambda arena: arena.check_adopted())
            return True
        except BadRequest:
            raise
        except WcdError as e:
            if wait_s is None or gone():
                raise
            log.warning("fd store: cannot check %s yet (%s): it stays kept, and is checked again in %g s",
                        entry.name, e.message, wait_s)
            entry.notes = [f"{ADOPTING_NOTE}; checked again in {wait_s:g} s ({e.message})"]
        await asyncio.sleep(wait_s)
        if gone():
            return False
        if entry.state == "evicting":
            return True
    return True  # not reached: the last attempt returns or raises


def _refingerprint(rec: parking.ParkedEntry, follow_links: bool) -> list[str]:
    """The notes of a checkpoint's parked entry; `BadRequest` if the checkpoint changed since it was
    loaded. A checkpoint that is gone does not stop the kept copy being served (it is noted)."""
    if not Path(rec.key.path).exists():
        return [f"checkpoint {rec.key.path} is missing: serving the copy kept across the restart"]
    files = open_files(Path(rec.key.path).resolve(), follow_links)
    try:
        if fingerprint_unparsed(files) != rec.key.fingerprint:
            raise BadRequest(f"stale: {rec.key.path} changed since it was loaded")
    finally:
        for _, fd in files:
            os.close(fd)
    return []
