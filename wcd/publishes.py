"""A published entry's way in, on the daemon's side: `reserve` admits it and allocates its empty
arena for the client to fill, `commit` seals it and makes it ready (and its series' current
generation), `rollback` makes a kept generation current again. `Publishes` is a mixin of
`wcd.residency.Residency`; the residency's state and steps it uses are declared here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from wcd import adoption
from wcd.arenas import Arena, ArenaBackend, backend_for
from wcd.errors import BadRequest, NotFound
from wcd.life import Life, life
from wcd.offloop import close_later, using
from wcd.units import format_size

if TYPE_CHECKING:
    from wcd.cache import Cache
    from wcd.entry import Entry, LeaseRecord
    from wcd.key import WeightCacheKey
    from wcd.manifest import Manifest
    from wcd.verifying import Verifier
    from wcd.wire import Retention


class Publishes:
    """Reserve, commit and roll back published entries (a mixin of `wcd.residency.Residency`)."""

    cache: Cache
    _verifier: Verifier

    if TYPE_CHECKING:
        def reclaim(self, entries: Iterable[Entry], why: str) -> None: ...

        def _set_ready(self, entry: Entry) -> None: ...

        async def _create(self, backend: ArenaBackend, device: str, size: int, label: str) -> Arena: ...

    async def reserve(self, name: str, key: WeightCacheKey, manifest: Manifest, retention: Retention,
                      owner: Any, pid: int, uid: int, series: str | None = None,
                      admin: bool = False) -> LeaseRecord:
        """Admit a published entry (carrying `uid`; with `series`, its next generation) and allocate
        its empty arena: the fill lease, whose TTL starts when the caller hands it out
        (`LeaseBook.handed_out`)."""
        backend = backend_for(key.device)
        entry, lease, victims = self.cache.reserve(
            name, key, manifest, backend.arena_size(manifest.size, key.device), retention, owner, pid, uid,
            series, admin)
        name = entry.name
        self.reclaim(victims, f"least recently used, to make room for {name} ({format_size(entry.nbytes)}, "
                     f"published by uid {uid})")
        entry.life = Life(phase="filling")
        try:
            arena = await self._create(backend, key.device, entry.nbytes, name)
        except BaseException:
            self.reclaim(self.cache.load_failed(entry), "its arena could not be allocated")
            raise
        if self.cache.entries.get(name) is not entry:
            close_later(arena)
            raise NotFound(f"{name} went away while its arena was being allocated; nothing was reserved")
        entry.arena = arena
        return lease

    async def commit(self, owner: Any, lease_id: int) -> Entry:
        """Seal a filled arena and make its entry ready; `NotFound` if it was evicted while filling."""
        lease = self.cache.leases.get(lease_id)
        if lease is None or lease.owner is not owner or lease.kind != "fill":
            self.cache.commit(owner, lease_id)  # raises the precise error
        assert lease is not None
        record = life(lease.entry)
        if record.committing:
            raise BadRequest(f"lease {lease_id} is already being committed", {"lease": lease_id})
        if lease.entry.state != "evicting":
            # Sealing scans the arena's pages (~25 ms per GB): off the loop. Busy if the publisher
            # still maps it writable; the lease stays, so it can drop its views and commit again.
            record.committing = True
            try:
                await using(None, lease.entry.arena, lambda arena: arena.seal())
            except BadRequest:  # the arena is not what the daemon handed out: it is never published
                if self.cache.leases.get(lease_id) is lease:
                    self.reclaim(self.cache.abort(owner, lease_id), "its commit was refused: the arena is not the "
                                 "one handed out")
                raise
            finally:
                record.committing = False
        entry, dropped = self.cache.commit(owner, lease_id)
        if self.cache.entries.get(entry.name) is not entry:
            self.reclaim(dropped, "evicted while it was being filled")
            raise NotFound(f"{entry.name} was evicted while it was being filled; nothing was published")
        self.reclaim(dropped, f"past keep_generations ({self.cache.keep_generations}) once {entry.name} became "
                     "current")
        self._set_ready(entry)
        self._verifier.keep_digest(entry, "digest at commit")
        return entry

    def rollback(self, series: str, uid: int, admin: bool, to: int | None = None) -> Entry:
        """Make a kept previous generation of `series` current again. The generations after it leave
        systemd's fd store: a restart makes the newest generation it finds current."""
        entry, dropped = self.cache.rollback(series, uid, admin, to)
        self.reclaim(dropped, f"past keep_generations ({self.cache.keep_generations}) once {series} was rolled "
                     f"back to {entry.name} (uid {uid})")
        assert entry.series is not None
        for newer in [e for g, e in entry.series.generations.items() if g > entry.generation]:
            adoption.unpark(newer)
        adoption.park(entry)  # a rollback forward again: the generation current now is kept again
        return entry
