"""Parking in systemd's fd store, and re-adoption of what was parked after a restart.

A ready entry's arena fd and a record of it (`wcd.parking`) are stored in the fd store, so a
restarted daemon serves it without reading the disk. At start-up, before READY, the stored fds
are only sorted into (record, arena fd) pairs: what takes microseconds per entry whatever its
size and imports nothing. After READY each is checked (`check`): the arena opened by its backend
(host: seals and size; CUDA: import), the record's layout validated, the checkpoint
re-fingerprinted (a changed one is never served) and the backend's own check of the arena, tried
again while the GPU has no memory for it yet. The decisions (admit, drop, load from disk instead)
are `Adopting`'s, a mixin of `wcd.residency.Residency`.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Coroutine, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wcd import parking, systemd
from wcd.arenas import Arena, ArenaBackend
from wcd.checkpoint import open_files
from wcd.errors import BadRequest, WcdError
from wcd.key import fingerprint_unparsed
from wcd.life import Life, life, unstore
from wcd.manifest import Manifest
from wcd.offloop import close_later, produced, using
from wcd.units import format_size

if TYPE_CHECKING:
    from wcd.cache import Cache
    from wcd.devices import Devices
    from wcd.entry import Entry
    from wcd.verifying import Verifier

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

class Adopting:
    """Re-adoption's decisions (admit, check, serve or drop), a mixin of `wcd.residency.Residency`:
    the residency's state and steps they use are declared here for the type checker."""

    cache: Cache
    devices: Devices
    _verifier: Verifier
    _spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task[Any]]

    if TYPE_CHECKING:
        def reclaim(self, entries: Iterable[Entry], why: str) -> None: ...

        async def _drop_loading(self, entry: Entry, failed_check: bool = False) -> bool: ...

        def _set_ready(self, entry: Entry) -> None: ...

        def _follow_links(self, name: str) -> bool: ...

    def adopt_parked(self, fds: list[tuple[int, str]]) -> None:
        """Re-adopt arenas systemd kept for us; drop (and unstore) anything unknown or corrupt.

        Before READY only what takes microseconds per entry whatever its size and needs nothing
        imported: the record less its manifest's layout. Each entry is then `loading`, without an
        arena, charged to its budget under its name, so an engine that connects at once waits for it
        and the configured model is not loaded again from disk; `start_checks` starts the rest
        (opening the arena fd: a CUDA one needs cuda-bindings imported), once READY is out."""
        sort_stored(fds, self._adopt)

    def _adopt(self, rec: parking.ParkedEntry, fd: int) -> Entry:
        """Admit a parked entry (state `loading`, its arena opened by `_check_adopted`); it owns `fd`."""
        device = rec.key.device
        if device not in self.cache.budgets:
            raise BadRequest(f"device {device} is no longer configured")
        # An empty manifest stands in until the check validates the record's; status shows the
        # record's counts meanwhile, unvalidated (its dtype column has a byte per tensor).
        entry, victims = self.cache.admit(rec.name, rec.key, Manifest.build(()), rec.arena_size, rec.retention,
                                          rec.origin, rec.publisher if rec.origin == "publish" else os.getuid(),
                                          adopted=True)
        entry.asked_by = rec.asked_by
        # systemd still holds the fds: never store them twice
        entry.life = Life(phase="checking", adopted=(rec, fd), parked=True)
        entry.load_phase = "checking"
        self.reclaim(victims, f"least recently used, to make room for {rec.name} kept across a restart")
        entry.notes = [ADOPTING_NOTE]
        codes = rec.manifest_wire.get("dtypes")
        entry.recorded_tensors = len(codes) if isinstance(codes, bytes) else None
        return entry

    def start_checks(self) -> None:
        """Start checking the entries `adopt_parked` admitted, in the background. Called after READY:
        started before, their worker threads' Python would compete with start-up's for the GIL."""
        for entry in list(self.cache.entries.values()):
            if life(entry).adopted is not None:
                self._spawn(self._check_adopted(entry))

    async def _check_adopted(self, entry: Entry) -> None:
        """After READY: check a re-adopted entry (`check`); then it is ready. A failure
        drops the entry and its fds with one line; a configured model is then loaded from disk,
        and acquires waiting for the entry wait for that load instead."""
        def gone() -> bool:  # dropped meanwhile (evicted twice, say): `reclaim` closed what it held
            return self.cache.entries.get(entry.name) is not entry

        try:
            checked = await check(entry, self.devices.backend(entry.device),
                                           self._follow_links(entry.name), gone)
        except Exception as e:  # noqa: BLE001 - whatever went wrong, the entry must not stay unchecked
            if gone():
                return
            log.warning("fd store: dropping %s: %s", entry.name,
                        e.message if isinstance(e, WcdError) else f"{type(e).__name__}: {e}")
            await self._drop_loading(entry, failed_check=True)
            return
        if checked is None or gone():
            return
        entry.manifest, entry.notes = checked
        entry.done_bytes, entry.load_phase = entry.manifest.nbytes, ""
        entry.recorded_tensors = None
        layout = await asyncio.to_thread(entry.manifest.layout) if "series" in entry.key.extra else None
        if gone():
            return
        if entry.state == "evicting":  # evicted while it was checked
            await self._drop_loading(entry)
            return
        self.cache.loaded(entry)
        if layout is not None:  # a generation rejoins its series before anything is served from it
            try:
                self.reclaim(self.cache.adopted_generation(entry, layout),
                             f"past keep_generations ({self.cache.keep_generations}) once {entry.name} was adopted")
            except BadRequest as e:
                log.warning("fd store: dropping %s: %s", entry.name, e.message)
                self.reclaim(self.cache.load_failed(entry), f"re-adopted but {e.message}")
                return
        if entry.origin == "publish":
            self._verifier.keep_digest(entry, "digest at re-adoption after a restart")
        self._set_ready(entry)
        log.info("adopted %s from systemd's fd store (%s on %s, no disk read)%s", entry.name,
                 format_size(entry.nbytes), entry.device, f"; {entry.notes[0]}" if entry.notes else "")
