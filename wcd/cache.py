"""Entries, leases, budgets and eviction: the cache's rules as plain logic.

No I/O and no asyncio: time comes from an injected clock, arenas are opaque handles the cache
never touches. Operations that free memory return the entries they dropped; the caller (the
`wcd.residency`) ends their life records (`wcd.life`), which closes their arenas. Theory of operation:

- An entry is admitted against its device's budget, evicting least-recently-used candidates
  (`cached`/`ephemeral`, `ready`, no leases) if needed; otherwise `OutOfMemory`.
- States: `loading` (daemon fills it, or checks one it re-adopted after a restart) or `filling`
  (a client fills it under a fill lease) -> `ready` -> `evicting` (asked to go while leased;
  dropped when the last lease ends).
- Leases are kept by `wcd.leasebook` (TTLs, heartbeats, per-uid limits, paging, deadlines); the
  cache decides what a lease's end does to its entry. A fill lease that ends before commit drops
  its entry at once; `ephemeral` entries are dropped when their last read lease ends.
- Every entry carries its publisher's uid (the daemon's for its own loads). Only admins evict
  what they did not publish, and pin.
- A key is scoped by its publisher: entries of one key from different uids never collide, so no
  uid can squat another's key. A lookup by key takes the first of the publishers its asker
  trusts, in the asker's order (its own uid, the daemon's, `trusted_publishers`).
- At most `max_entries` entries (each holds a descriptor, whatever its size): a new one evicts the
  least recently used unleased entry when the daemon is full. A uid publishes at most
  `max_entries_per_uid` of them.
- A load that ends without an entry leaves a `Failure` under its name (shown as state `failed`,
  with its reason and when) until the name is admitted again, a reload drops it, or it is evicted.
  Failures hold no memory; at most `max_entries` of them are kept, the oldest going first.
- Generations: a published entry may be generation N of a *series* (`Series`: a name, its
  publisher, one layout). Reserving generation N+1 while N is served is how weights change under
  running engines; its commit makes it `current` atomically. The generations that are not current
  are `previous` (kept for rollback, at most `keep_generations`, still served to the leases on
  them) or, past that, `evicting` until their last lease ends. Every live generation is charged
  to the budget. Only the series' publisher (or an admin) reserves its next generation or rolls
  it back, and a generation must have the series' layout, so readers can move between
  generations in place.

Every lookup a peer can trigger is indexed (entries by key and model, leases by owner and by
deadline), so no request and no disconnect costs time in proportion to the whole cache.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from datetime import datetime, timezone
from typing import Any

from wcd.entry import Entry, Failure, LeaseRecord, Origin, State
from wcd.errors import BadRequest, Busy, KeyMismatch, NotFound, OutOfMemory, PermissionDenied, WcdError
from wcd.key import WeightCacheKey
from wcd.leasebook import DEFAULT_MAX_LEASES_PER_UID, LeaseBook
from wcd.manifest import Manifest
from wcd.series import SERVED, Generations
from wcd.units import format_size
from wcd.wire import Retention

__all__ = ["Cache", "Entry", "Failure", "LeaseRecord", "Origin", "State"]

DEFAULT_MAX_ENTRIES = 4096
DEFAULT_KEEP_GENERATIONS = 1
DEFAULT_MAX_ENTRIES_PER_UID = 256
NEAR_MISS_CANDIDATES = 16  # entries of the same model a key_mismatch compares the key with


class Cache:
    def __init__(self, budgets: dict[str, int], lease_ttl_s: float,
                 clock: Callable[[], float] = time.monotonic, max_entries: int = DEFAULT_MAX_ENTRIES,
                 max_entries_per_uid: int = DEFAULT_MAX_ENTRIES_PER_UID,
                 max_leases_per_uid: int = DEFAULT_MAX_LEASES_PER_UID,
                 keep_generations: int = DEFAULT_KEEP_GENERATIONS) -> None:
        self.budgets = dict(budgets)
        self.generations = Generations(keep_generations)
        self.series = self.generations.series  # name -> Series (the same dict)

        self.clock = clock
        self.max_entries = max_entries
        self.max_entries_per_uid = max_entries_per_uid
        self.lease_book = LeaseBook(lease_ttl_s, clock, max_leases_per_uid)
        self.leases = self.lease_book.leases  # id -> LeaseRecord (the same dict)
        # Bytes of a device that entries no longer hold but other processes still map (arenas
        # reclaimed after their leases ended, whose views were kept): the residency sets it.
        self.outside: Callable[[str], int] = lambda device: 0
        self.entries: dict[str, Entry] = {}
        self.stats = {"lease_expiries": 0, "evictions": 0, "load_failures": 0}
        self.failures: dict[str, Failure] = {}  # by name, oldest first
        self._reclaimed: dict[str, str] = {}  # name -> when and why its last entry went, oldest first
        # Indexes over `entries`, kept by the methods below (nothing else mutates them):
        self._by_key: dict[WeightCacheKey, dict[int | None, Entry]] = {}  # key -> publisher uid -> entry
        self._published: Counter[int | None] = Counter()  # published entries per publisher uid
        self._by_model: dict[str, dict[str, Entry]] = {}  # model -> entry name -> entry
        self._used: dict[str, int] = dict.fromkeys(self.budgets, 0)

    @property
    def keep_generations(self) -> int:
        return self.generations.keep

    @keep_generations.setter
    def keep_generations(self, keep: int) -> None:
        self.generations.keep = keep

    # -- lookup -----------------------------------------------------------------------------

    def used(self, device: str) -> int:
        return self._used.get(device, 0)

    def by_key(self, key: WeightCacheKey, publishers: Iterable[int | None]) -> Entry | None:
        """The entry with `key` from the first of `publishers` that has one."""
        found = self._by_key.get(key)
        if found:
            for uid in publishers:
                entry = found.get(uid)
                if entry is not None:
                    return entry
        return None

    def find(self, target: str | WeightCacheKey, publishers: Sequence[int | None] = ()) -> Entry:
        """The entry named `target`, or whose key equals it from the first of `publishers` (whom the
        asker trusts, in order) that has one. A near miss reports the differing fields."""
        if isinstance(target, str):
            entry = self.entries.get(target)
            if entry is None and target in self.failures:
                failure = self.failures[target]
                raise NotFound(f"{target!r} failed to load at {failure.describe()['failed_at']}: {failure.reason} "
                               "(wcdctl status shows it; fix it, then reload the daemon or wcdctl load it)",
                               {"name": target, "state": "failed", "reason": failure.reason})
            if entry is None:
                raise NotFound(f"no entry named {target!r} (wcdctl list shows what is resident)", {"name": target})
            return entry
        entry = self.by_key(target, publishers)
        if entry is not None:
            return entry
        raise _key_miss(target, publishers, self._by_key.get(target), self._by_model.get(target.model, {}))

    # -- admission and eviction -------------------------------------------------------------

    def admit(
        self, name: str, key: WeightCacheKey, manifest: Manifest, nbytes: int, retention: Retention,
        origin: Origin, publisher: int | None = None, adopted: bool = False,
    ) -> tuple[Entry, list[Entry]]:
        """Create an entry (state `loading`, or `filling` for publishes) charged to its device.
        `adopted`: its arena survived a restart and the daemon checks it (`loading` whatever its origin).

        Returns the entry and the entries evicted to make room. Raises `Busy` if the name or key
        is taken, `OutOfMemory` if the budget cannot fit it even after eviction.
        """
        if name in self.entries:
            raise Busy(f"an entry named {name!r} already exists ({self.entries[name].state})", {"name": name})
        taken = self.by_key(key, (publisher,))
        if taken is not None:
            raise Busy(f"uid {publisher} already has an entry with this key: {taken.name!r}", {"name": taken.name})
        if origin == "publish" and self._published[publisher] >= self.max_entries_per_uid:
            raise Busy(f"uid {publisher} has published {self._published[publisher]} entries, the daemon's "
                       "max_entries_per_uid: evict some of them (wcdctl evict) first", {"limit": "max_entries_per_uid"})
        device = key.device
        if device not in self.budgets:
            raise BadRequest(f"device {device!r} is not managed by this daemon (devices: {', '.join(self.budgets)})")
        victims = self._make_room(device, nbytes)
        victims += self._make_count_room(victims)
        now = self.clock()
        state: State = "filling" if origin == "publish" and not adopted else "loading"
        entry = Entry(name, key, manifest, nbytes, retention, origin, state, now, now, publisher=publisher)
        self.failures.pop(name, None)  # tried again
        entry.previous = self._reclaimed.pop(name, "")
        self.entries[name] = entry
        self._by_key.setdefault(key, {})[publisher] = entry
        if origin == "publish":
            self._published[publisher] += 1
        self._by_model.setdefault(key.model, {})[name] = entry
        self._used[device] = self._used.get(device, 0) + nbytes
        for v in victims:
            self._drop(v)
            self.stats["evictions"] += 1
        return entry, victims

    def _make_room(self, device: str, nbytes: int) -> list[Entry]:
        budget = self.budgets[device]
        outside = self.outside(device)
        free = budget - self.used(device) - outside
        if nbytes <= free:
            return []
        # A series' current generation goes after its kept ones: they are what it rolls back to.
        candidates = sorted((e for e in self._evictable() if e.device == device),
                            key=lambda e: (e.series is not None and e.series.current == e.generation, e.last_used))
        victims = []
        for e in candidates:
            if free >= nbytes:
                break
            victims.append(e)
            free += e.nbytes
        if free < nbytes:
            held = self.used(device) - sum(e.nbytes for e in candidates)
            details = {"device": device, "need": nbytes, "budget": budget, "held": held}
            kept = ""
            if outside:
                details["outside"] = outside
                kept = (f", {format_size(outside)} by processes still mapping entries that are gone (views kept "
                        "after their leases ended: those engines must drop them or exit)")
            raise OutOfMemory(
                f"{format_size(nbytes)} does not fit on {device}: budget {format_size(budget)}, "
                f"{format_size(held)} held by pinned, leased or loading entries{kept}; "
                "evict something (wcdctl evict) or raise the budget", details)
        return victims

    def _make_count_room(self, victims: list[Entry]) -> list[Entry]:
        """One more entry than the daemon holds after `victims` go would pass `max_entries`: the
        least recently used evictable entry of any device and publisher goes too, or `Busy`.
        (A scan of the entries, only while the daemon is full.)"""
        if len(self.entries) - len(victims) < self.max_entries:
            return []
        going = set(map(id, victims))
        lru = min((e for e in self._evictable() if id(e) not in going), key=lambda e: e.last_used, default=None)
        if lru is None:
            raise Busy(f"the daemon holds {len(self.entries)} entries, its max_entries, and each is pinned, leased "
                       "or loading: release or evict some (wcdctl evict) or raise max_entries in the daemon's "
                       "config", {"limit": "max_entries"})
        return [lru]

    def _evictable(self) -> Iterator[Entry]:
        """Entries that may go to make room: ready, not pinned, unleased."""
        return (e for e in self.entries.values() if e.state in SERVED and e.retention != "pinned" and not e.leases)

    def check_evict(self, entry: Entry, uid: int, admin: bool) -> None:
        """`PermissionDenied` unless the peer may evict `entry`: admins any, others only what they published."""
        if admin or (entry.origin == "publish" and entry.publisher == uid and entry.retention != "pinned"):
            return
        whose = "a configured or loaded model" if entry.origin != "publish" else f"published by uid {entry.publisher}"
        raise PermissionDenied(
            f"uid {uid} may not evict {entry.name!r} ({whose}, {entry.retention}): only admins evict what they "
            "did not publish (admin_uids / admin_groups in the daemon's config)", {"entry": entry.name, "uid": uid})

    def evict(self, entry: Entry) -> list[Entry]:
        """Drop an entry now, or mark it `evicting` until its leases end (loads are cancelled)."""
        self.stats["evictions"] += 1
        if entry.leases or entry.state == "loading":
            entry.state = "evicting"
            return []
        return [self._drop(entry)]

    def _drop(self, entry: Entry) -> Entry:
        for lease in list(entry.leases.values()):
            self.lease_book.forget(lease)
        del self.entries[entry.name]
        same_key = self._by_key[entry.key]
        del same_key[entry.publisher]
        if not same_key:
            del self._by_key[entry.key]
        if entry.origin == "publish":
            self._published[entry.publisher] -= 1
            if not self._published[entry.publisher]:
                del self._published[entry.publisher]
        same_model = self._by_model[entry.key.model]
        del same_model[entry.name]
        if not same_model:
            del self._by_model[entry.key.model]
        self._used[entry.device] -= entry.nbytes
        if entry.series is not None:
            self.generations.forget(entry)
        return entry

    # -- loading ----------------------------------------------------------------------------

    def loaded(self, entry: Entry) -> list[Entry]:
        """A daemon-side load finished. If it was evicted meanwhile, drop it now."""
        if entry.state == "evicting":
            return [] if entry.leases else [self._drop(entry)]
        entry.state = "ready"
        entry.last_used = self.clock()
        return []

    def load_failed(self, entry: Entry) -> list[Entry]:
        return [self._drop(entry)] if entry.name in self.entries and self.entries[entry.name] is entry else []

    def fail(self, name: str, reason: str, origin: Origin, device: str, path: str) -> Failure:
        """Note that loading `name` ended without an entry (its entry, if admitted, is dropped by
        `load_failed`). Replaces an older failure of that name."""
        self.failures.pop(name, None)
        while len(self.failures) >= self.max_entries:
            del self.failures[next(iter(self.failures))]
        failure = self.failures[name] = Failure(name, reason, time.time(), origin, device, path)
        self.stats["load_failures"] += 1
        return failure

    def note_reclaimed(self, name: str, why: str) -> None:
        """Remember why the entry `name` went, for the next entry of that name (`Entry.previous`:
        why a model was loaded again). At most `max_entries` names are remembered."""
        self._reclaimed.pop(name, None)
        while len(self._reclaimed) >= self.max_entries:
            del self._reclaimed[next(iter(self._reclaimed))]
        when = datetime.now(timezone.utc).isoformat(timespec="seconds")
        self._reclaimed[name] = f"{when}: {why}"

    def forget_failure(self, name: str) -> Failure | None:
        """Drop the failure noted under `name` (evicted by an operator, or its model left the config)."""
        return self.failures.pop(name, None)

    def cancel_loads(self) -> None:
        """Mark every loading entry `evicting`, so its loader stops at the next chunk (shutdown)."""
        for entry in self.entries.values():
            if entry.state == "loading":
                entry.state = "evicting"

    # -- leases -----------------------------------------------------------------------------

    def acquire(self, entry: Entry, owner: Hashable, pid: int = 0, uid: int = 0,
                ttl_s: float | None = None) -> LeaseRecord:
        """A read lease; `ttl_s` makes it the daemon's own hold, with that TTL (infinity: no
        heartbeats) and counted against no uid's max_leases_per_uid."""
        if entry.state not in SERVED:
            raise Busy(f"entry {entry.name!r} is {entry.state}", {"name": entry.name, "state": entry.state})
        lease = self.lease_book.new(entry, "read", owner, pid, uid, ttl_s)
        entry.acquires += 1
        return lease

    def reserve(
        self, name: str, key: WeightCacheKey, manifest: Manifest, nbytes: int, retention: Retention,
        owner: Hashable, pid: int = 0, uid: int = 0, series: str | None = None, admin: bool = False,
    ) -> tuple[Entry, LeaseRecord, list[Entry]]:
        """Admit a published entry with a fill lease whose TTL starts at `handed_out`. With `series`,
        the entry is that series' next generation (named `series@N`, its key marked with both),
        under the rules of the module docstring."""
        self.lease_book.room(uid)
        if series is None:
            entry, victims = self.admit(name, key, manifest, nbytes, retention, "publish", publisher=uid)
            return entry, self.lease_book.new(entry, "fill", owner, pid, uid, held_until=math.inf), victims
        # A generation must be read through the series' views on the series' device.
        into, generation = self.generations.next(series, uid, admin, f"{manifest.layout()}@{key.device}")
        key = key.model_copy(update={"extra": {**key.extra, "series": series, "generation": str(generation)}})
        entry, victims = self.admit(f"{series}@{generation}", key, manifest, nbytes, retention, "publish",
                                    publisher=uid)
        self.generations.join(entry, into, generation)
        return entry, self.lease_book.new(entry, "fill", owner, pid, uid, held_until=math.inf), victims

    def adopted_generation(self, entry: Entry, layout: str) -> list[Entry]:
        """A generation re-adopted after a restart rejoins its series (`Generations.adopted`);
        returns the entries dropped."""
        return [self._drop(e) for e in self.generations.adopted(entry, f"{layout}@{entry.device}")]

    def current(self, name: str) -> Entry:
        """The current generation of series `name`."""
        return self.generations.current(name)

    def rollback(self, name: str, uid: int, admin: bool, to: int | None = None) -> tuple[Entry, list[Entry]]:
        """Make a kept previous generation current again (`Generations.rollback`); returns (the new
        current, the entries dropped)."""
        target, drop = self.generations.rollback(name, uid, admin, to)
        target.last_used = self.clock()
        return target, [self._drop(e) for e in drop]

    def release(self, owner: Hashable, lease_id: int) -> list[Entry]:
        lease = self.lease_book.owned(owner, lease_id)
        if lease.kind == "fill":
            raise BadRequest(f"lease {lease_id} is a fill lease: commit or abort it")
        return self._end(lease)

    def commit(self, owner: Hashable, lease_id: int) -> tuple[Entry, list[Entry]]:
        """Make a filled entry ready. If it was evicted while filling, it is dropped instead:
        returns (entry, dropped entries) and the caller reports the eviction."""
        lease = self.lease_book.owned(owner, lease_id)
        if lease.kind != "fill":
            raise BadRequest(f"lease {lease_id} is a read lease: only fill leases commit")
        entry = lease.entry
        if entry.state == "evicting":
            return entry, self._end(lease)
        self.lease_book.forget(lease)
        entry.state = "ready"
        entry.done_bytes = entry.manifest.nbytes
        entry.last_used = self.clock()
        if entry.series is None:
            return entry, []
        return entry, [self._drop(e) for e in self.generations.make_current(entry)]

    def abort(self, owner: Hashable, lease_id: int) -> list[Entry]:
        lease = self.lease_book.owned(owner, lease_id)
        if lease.kind != "fill":
            raise BadRequest(f"lease {lease_id} is a read lease: release it instead")
        return self._end(lease)

    def _end(self, lease: LeaseRecord) -> list[Entry]:
        entry = lease.entry
        self.lease_book.forget(lease)
        entry.last_used = self.clock()
        if entry.name not in self.entries:
            return []
        if lease.kind == "fill" and entry.state in ("filling", "evicting"):
            return [self._drop(entry)]
        unused = entry.state == "evicting" or (entry.retention == "ephemeral" and entry.state == "ready")
        if not entry.leases and unused:
            return [self._drop(entry)]
        return []

    def expire(self, limit: int | None = None) -> tuple[list[LeaseRecord], list[Entry]]:
        """End leases past their deadline, at most `limit` of them (the caller lets others run
        between batches and asks again while a batch comes back full). Returns (expired leases,
        dropped entries)."""
        now = self.clock()
        expired: list[LeaseRecord] = []
        dropped: list[Entry] = []
        while (limit is None or len(expired) < limit) and (lease := self.lease_book.due(now)) is not None:
            expired.append(lease)
            dropped += self._end(lease)
        self.stats["lease_expiries"] += len(expired)
        return expired, dropped

    def drop_owner(self, owner: Hashable) -> list[Entry]:
        """The owner (a connection) went away: end all its leases."""
        dropped: list[Entry] = []
        for lease in self.lease_book.held_by(owner):
            if lease.id in self.leases:  # a fill lease's end drops its entry's other leases
                dropped += self._end(lease)
        return dropped


def _key_miss(target: WeightCacheKey, publishers: Sequence[int | None], others: dict[int | None, Entry] | None,
              same_model: dict[str, Entry]) -> WcdError:
    """Why no entry has `target` from a publisher the asker trusts: published by others only,
    no entry of the model, or the differing fields of a near miss (`others`: the key's entries
    by publisher; `same_model`: the model's entries by name)."""
    if others:
        uids = sorted(others, key=str)[:8]
        return NotFound(
            f"no entry of model {target.model!r} with this key from a publisher trusted here (uids "
            f"{', '.join(map(str, publishers))}); published by uid {', '.join(map(str, uids))}: "
            "acquire it by name if you mean to, or have the daemon list its uid in trusted_publishers",
            {"model": target.model, "publishers": uids})
    # A bounded sample: a peer may ask thousands of near misses against thousands of entries.
    sample = list(itertools.islice(same_model.values(), NEAR_MISS_CANDIDATES))
    if not sample:
        return NotFound(f"no entry for model {target.model!r}", {"model": target.model})
    nearest = min(sample, key=lambda e: len(e.key.diff(target)))
    fields = nearest.key.diff(target)
    return KeyMismatch(
        f"model {target.model!r} is resident as {nearest.name!r} but its key differs in: {', '.join(fields)}",
        {"fields": fields, "entry": nearest.name,
         "resident": {f: _plain(getattr(nearest.key, f)) for f in fields},
         "requested": {f: _plain(getattr(target, f)) for f in fields}},
    )


def _plain(v: Any) -> Any:
    return dict(v) if isinstance(v, dict) else v
