"""The daemon's leases as plain logic: who holds which, until when, and how many per uid.

No I/O and no entry rules: `wcd.cache` decides what a lease's end does to its entry; the book
keeps the records and their indexes (by id, owner, uid and deadline), so no request and no
disconnect costs time in proportion to all leases.

- A lease lives until released, expired (no heartbeat within the TTL) or its owner (the
  connection) goes away. A uid holds at most `max_per_uid` (the daemon's own holds are not
  counted); leases are listed a page at a time (`page`) and expired a batch at a time.
- A fill lease's TTL starts when its holder is told its id (`handed_out`), not when the arena
  allocation it waits for begins: a large allocation cannot expire it unseen.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter
from collections.abc import Callable, Hashable, Iterable

from wcd.entry import Entry, LeaseKind, LeaseRecord
from wcd.errors import Busy, LeaseExpired

DEFAULT_MAX_LEASES_PER_UID = 4096


class LeaseBook:
    def __init__(self, ttl_s: float, clock: Callable[[], float],
                 max_per_uid: int = DEFAULT_MAX_LEASES_PER_UID) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self.max_per_uid = max_per_uid
        self.leases: dict[int, LeaseRecord] = {}
        self._ids = itertools.count(1)
        self._by_owner: dict[Hashable, dict[int, LeaseRecord]] = {}
        self._by_uid: dict[int, dict[int, LeaseRecord]] = {}  # peers' leases (not the daemon's holds), in id order
        # (deadline, lease id), one per finite lease; a heartbeat moves the deadline later without
        # touching the heap, and `due` re-queues such leases when their old deadline comes up.
        self._deadlines: list[tuple[float, int]] = []

    def held_by(self, owner: Hashable) -> list[LeaseRecord]:
        return list(self._by_owner.get(owner, {}).values())

    def count_of(self, owner: Hashable) -> int:
        return len(self._by_owner.get(owner, ()))

    def page(self, uid: int | None, after: int, limit: int) -> tuple[list[LeaseRecord], int | None]:
        """Up to `limit` leases with ids above `after`, in id order: every lease (`uid` None), or
        the peer leases of `uid`. Returns them and the cursor for the next page (None at the end).
        Ids grow, so the dicts hold leases in id order; skipping to the cursor costs a C-level
        step per lease before it, nothing per lease after the page."""
        held = self.leases if uid is None else self._by_uid.get(uid, {})
        page = list(itertools.islice(itertools.dropwhile(after.__ge__, held), limit + 1))
        more = len(page) > limit
        del page[limit:]
        return [held[i] for i in page], (page[-1] if more else None)

    def new(self, entry: Entry, kind: LeaseKind, owner: Hashable, pid: int, uid: int,
            ttl_s: float | None = None, held_until: float | None = None) -> LeaseRecord:
        """A peer's lease (its TTL the heartbeat's, or `held_until` for a fill lease until it is
        handed out), or with `ttl_s` the daemon's own hold."""
        if ttl_s is None:
            self.room(uid)
        now = self.clock()
        expires = held_until if held_until is not None else now + (ttl_s or self.ttl_s)
        lease = LeaseRecord(next(self._ids), entry, kind, owner, pid, uid, expires, held_by_daemon=ttl_s is not None)
        entry.leases[lease.id] = lease
        entry.last_used = now
        self.leases[lease.id] = lease
        self._by_owner.setdefault(owner, {})[lease.id] = lease
        if not lease.held_by_daemon:
            self._by_uid.setdefault(uid, {})[lease.id] = lease
        self._queue(lease)
        return lease

    def room(self, uid: int) -> None:
        """`Busy` if `uid` holds its `max_per_uid` leases already."""
        held = len(self._by_uid.get(uid, ()))
        if held >= self.max_per_uid:
            raise Busy(f"uid {uid} holds {held} leases, the daemon's max_leases_per_uid: release leases it does "
                       "not use (or close the connections holding them)", {"limit": "max_leases_per_uid"})

    def handed_out(self, lease: LeaseRecord) -> None:
        """Its holder is being told the lease's id: the heartbeat TTL runs from now."""
        lease.expires_at = self.clock() + self.ttl_s
        self._queue(lease)

    def _queue(self, lease: LeaseRecord) -> None:
        if math.isfinite(lease.expires_at):  # the daemon's own holds never expire
            lease.queued_at = lease.expires_at
            heapq.heappush(self._deadlines, (lease.expires_at, lease.id))

    def forget(self, lease: LeaseRecord) -> None:
        """Remove a lease from every index and from its entry (its heap place goes stale and is skipped)."""
        del self.leases[lease.id]
        del lease.entry.leases[lease.id]
        owned = self._by_owner[lease.owner]
        del owned[lease.id]
        if not owned:
            del self._by_owner[lease.owner]
        if not lease.held_by_daemon:
            of_uid = self._by_uid[lease.uid]
            del of_uid[lease.id]
            if not of_uid:
                del self._by_uid[lease.uid]

    def owned(self, owner: Hashable, lease_id: int) -> LeaseRecord:
        """The lease `lease_id` if `owner` holds it, else `LeaseExpired`."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.owner != owner:
            raise LeaseExpired(f"lease {lease_id} is not held by this connection (expired or released)",
                               {"lease": lease_id})
        return lease

    def heartbeat(self, owner: Hashable, lease_ids: Iterable[int]) -> list[int]:
        """Renew the owner's leases; returns the ids that are no longer held."""
        deadline = self.clock() + self.ttl_s
        lost = []
        for lease_id in lease_ids:
            lease = self.leases.get(lease_id)
            if lease is None or lease.owner != owner:
                lost.append(lease_id)
            else:
                lease.expires_at = deadline
                if deadline < lease.queued_at:  # the TTL was shortened by a reload
                    self._queue(lease)
        return lost

    def due(self, now: float) -> LeaseRecord | None:
        """The next lease past its deadline at `now` (still in the book: the caller ends it), or
        None. Leases renewed since they were queued are queued again on the way."""
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            deadline, lease_id = heapq.heappop(heap)
            lease = self.leases.get(lease_id)
            if lease is None or lease.queued_at != deadline:
                continue  # a stale place: released, or queued again since
            if lease.expires_at > now:  # renewed since it was queued
                self._queue(lease)
                continue
            return lease
        return None

    def next_expiry(self) -> float | None:
        """When the next lease may expire (no later than that; a heartbeat may have moved it on)."""
        heap = self._deadlines
        while heap and (heap[0][1] not in self.leases or self.leases[heap[0][1]].queued_at != heap[0][0]):
            heapq.heappop(heap)
        return heap[0][0] if heap else None


def describe_expired(expired: list[LeaseRecord], named: int = 3) -> str:
    """One log line for leases that expired together: how many, and on which entries (by count)."""
    if len(expired) == 1:
        lease = expired[0]
        return f"lease {lease.id} on {lease.entry.name} (pid {lease.pid}, uid {lease.uid}) expired: no heartbeat"
    per_entry = Counter(lease.entry.name for lease in expired)
    most = ", ".join(f"{n} on {name}" for name, n in per_entry.most_common(named))
    rest = f" and {len(per_entry) - named} more entries" if len(per_entry) > named else ""
    uids = sorted({lease.uid for lease in expired})
    return (f"{len(expired)} leases expired, no heartbeat: {most}{rest} (uids {', '.join(map(str, uids[:8]))}"
            f"{', ...' if len(uids) > 8 else ''})")
