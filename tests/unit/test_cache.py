"""Cache rules (entries, leases, budgets, eviction) as plain logic under a fake clock."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest

from wcd.cache import Cache, Entry, LeaseRecord
from wcd.errors import BadRequest, Busy, KeyMismatch, LeaseExpired, NotFound, OutOfMemory, PermissionDenied
from wcd.key import WeightCacheKey
from wcd.leasebook import describe_expired
from wcd.manifest import Manifest

TTL = 10.0
GIB = 1 << 30


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def tick(self, dt: float = 1.0) -> None:
        self.now += dt


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def cache(clock: Clock) -> Cache:
    return Cache({"cpu": 1000, "cuda:0": 500}, TTL, clock=clock)


MANIFEST = Manifest.build([("w", "F32", (4, 4)), ("b", "F32", (4,))])
LOADS = (None,)  # whose entries a lookup by key takes here: `admit` below gives none a publisher


def key(model: str, **fields: Any) -> WeightCacheKey:
    return WeightCacheKey(model=model, **fields)


def admit(cache: Cache, name: str, nbytes: int, retention: str = "cached", ready: bool = True,
          **key_fields: Any) -> Entry:
    entry, victims = cache.admit(name, key(name, **key_fields), MANIFEST, nbytes, retention, "load")  # type: ignore[arg-type]
    assert victims == []
    assert entry.state == "loading"
    if ready:
        assert cache.loaded(entry) == []
    return entry


def names(entries: list[Entry]) -> list[str]:
    return [e.name for e in entries]


# -- admission ----------------------------------------------------------------------------------


def test_admit_within_budget(cache: Cache, clock: Clock) -> None:
    a = admit(cache, "a", 400, ready=False)
    assert (a.state, a.nbytes, a.device, a.created_at, a.origin) == ("loading", 400, "cpu", clock.now, "load")
    b = admit(cache, "b", 600)  # exactly fills the budget
    assert b.state == "ready"
    assert cache.used("cpu") == 1000 and cache.used("cuda:0") == 0
    assert set(cache.entries) == {"a", "b"}


def test_budgets_are_per_device(cache: Cache) -> None:
    admit(cache, "a", 1000)
    g = admit(cache, "g", 500, device="cuda:0")
    assert g.device == "cuda:0"
    assert (cache.used("cpu"), cache.used("cuda:0")) == (1000, 500)


def test_publish_admits_in_filling_state(cache: Cache) -> None:
    entry, lease, victims = cache.reserve("p", key("p"), MANIFEST, 100, "cached", owner="conn")
    assert (entry.state, entry.origin, lease.kind, victims) == ("filling", "publish", "fill", [])
    assert cache.leases == {lease.id: lease} and entry.leases == {lease.id: lease}


def test_duplicate_name_is_busy(cache: Cache) -> None:
    admit(cache, "a", 10)
    with pytest.raises(Busy, match="named 'a' already exists"):
        cache.admit("a", key("other"), MANIFEST, 10, "cached", "load")


def test_duplicate_key_is_busy(cache: Cache) -> None:
    admit(cache, "a", 10)
    with pytest.raises(Busy, match="already has an entry with this key: .a."):
        cache.admit("a2", key("a"), MANIFEST, 10, "cached", "load")
    assert set(cache.entries) == {"a"}


def test_unknown_device_is_a_bad_request(cache: Cache) -> None:
    with pytest.raises(BadRequest, match="device 'cuda:7' is not managed"):
        cache.admit("a", key("a", device="cuda:7"), MANIFEST, 10, "cached", "load")
    assert cache.entries == {}


# -- eviction -----------------------------------------------------------------------------------


def test_lru_eviction_order(cache: Cache, clock: Clock) -> None:
    for n in "abcd":
        admit(cache, n, 250)
        clock.tick()
    lease = cache.acquire(cache.entries["a"], "conn")  # a becomes most recently used
    clock.tick()
    cache.release("conn", lease.id)
    clock.tick()
    entry, victims = cache.admit("e", key("e"), MANIFEST, 300, "cached", "load")
    assert names(victims) == ["b", "c"]  # two needed, least recently used first
    assert set(cache.entries) == {"a", "d", "e"}
    assert cache.used("cpu") == 800
    assert cache.stats["evictions"] == 2
    _, victims = cache.admit("f", key("f"), MANIFEST, 451, "cached", "load")  # e is loading: not a candidate
    assert names(victims) == ["d", "a"]


def test_eviction_takes_only_what_is_needed(cache: Cache, clock: Clock) -> None:
    for n in "abc":
        admit(cache, n, 300)
        clock.tick()
    _, victims = cache.admit("d", key("d"), MANIFEST, 150, "cached", "load")
    assert names(victims) == ["a"]


def test_eviction_stays_on_the_device(cache: Cache) -> None:
    admit(cache, "g", 500, device="cuda:0")
    admit(cache, "c", 900)
    _, victims = cache.admit("g2", key("g2", device="cuda:0"), MANIFEST, 100, "cached", "load")
    assert names(victims) == ["g"]
    assert "c" in cache.entries


def test_ephemeral_unleased_ready_entries_are_candidates(cache: Cache) -> None:
    admit(cache, "e", 800, retention="ephemeral")
    _, victims = cache.admit("x", key("x"), MANIFEST, 500, "cached", "load")
    assert names(victims) == ["e"]


def test_pinned_leased_loading_filling_never_evicted(cache: Cache, clock: Clock) -> None:
    admit(cache, "pinned", 200, retention="pinned")
    leased = admit(cache, "leased", 200)
    cache.acquire(leased, "conn")
    admit(cache, "loading", 200, ready=False)
    cache.reserve("filling", key("filling"), MANIFEST, 200, "cached", owner="conn")
    clock.tick(5)
    admit(cache, "free", 100)
    with pytest.raises(OutOfMemory) as info:
        cache.admit("big", key("big"), MANIFEST, 301, "cached", "load")
    assert info.value.details == {"device": "cpu", "need": 301, "budget": 1000, "held": 800}
    assert set(cache.entries) == {"pinned", "leased", "loading", "filling", "free"}  # nothing evicted on failure
    assert cache.stats["evictions"] == 0
    _, victims = cache.admit("fits", key("fits"), MANIFEST, 200, "cached", "load")
    assert names(victims) == ["free"]


def test_evicting_entry_is_not_a_candidate(cache: Cache) -> None:
    e = admit(cache, "e", 600)
    cache.acquire(e, "conn")
    cache.evict(e)
    with pytest.raises(OutOfMemory):
        cache.admit("x", key("x"), MANIFEST, 500, "cached", "load")


def test_out_of_memory_message() -> None:
    big = Cache({"cuda:0": 2 * GIB}, TTL, clock=Clock())
    big.admit("p", key("p", device="cuda:0"), MANIFEST, GIB, "pinned", "load")
    with pytest.raises(OutOfMemory) as info:
        big.admit("q", key("q", device="cuda:0"), MANIFEST, 3 * GIB // 2, "cached", "load")
    text = info.value.message
    assert "1.5 GiB does not fit on cuda:0" in text
    assert "budget 2.0 GiB" in text and "1.0 GiB held" in text
    assert "\n" not in text


def test_larger_than_the_budget(cache: Cache) -> None:
    with pytest.raises(OutOfMemory, match="on cuda:0"):
        cache.admit("x", key("x", device="cuda:0"), MANIFEST, 501, "cached", "load")


def test_evict_unleased_drops_at_once(cache: Cache) -> None:
    e = admit(cache, "e", 100)
    assert cache.evict(e) == [e]
    assert cache.entries == {} and cache.used("cpu") == 0
    assert cache.stats["evictions"] == 1


def test_evict_pinned_on_request(cache: Cache) -> None:
    e = admit(cache, "p", 100, retention="pinned")
    assert cache.evict(e) == [e]


def test_evict_leased_waits_for_the_last_lease(cache: Cache) -> None:
    e = admit(cache, "e", 100)
    l1, l2 = cache.acquire(e, "c1"), cache.acquire(e, "c2")
    assert cache.evict(e) == []
    assert e.state == "evicting" and cache.used("cpu") == 100
    with pytest.raises(Busy, match="evicting"):
        cache.acquire(e, "c3")
    assert cache.release("c1", l1.id) == []
    assert cache.release("c2", l2.id) == [e]
    assert cache.entries == {} and cache.leases == {}


def test_evict_loading_then_loaded_drops(cache: Cache) -> None:
    e = admit(cache, "e", 100, ready=False)
    assert cache.evict(e) == []
    assert e.state == "evicting"
    assert cache.loaded(e) == [e]
    assert cache.entries == {}


def test_evict_loading_then_load_failed_drops(cache: Cache) -> None:
    e = admit(cache, "e", 100, ready=False)
    cache.evict(e)
    assert cache.load_failed(e) == [e]
    assert cache.load_failed(e) == []  # already gone
    assert cache.entries == {}


def test_load_failed_ignores_a_stale_entry_of_the_same_name(cache: Cache) -> None:
    old = admit(cache, "e", 100, ready=False)
    assert cache.load_failed(old) == [old]
    new = admit(cache, "e", 100, ready=False)
    assert cache.load_failed(old) == []
    assert cache.entries == {"e": new}


def test_evict_filling_then_fill_lease_ends_drops(cache: Cache) -> None:
    entry, lease, _ = cache.reserve("p", key("p"), MANIFEST, 100, "cached", owner="conn")
    assert cache.evict(entry) == []
    assert entry.state == "evicting"
    assert cache.abort("conn", lease.id) == [entry]
    assert cache.entries == {}


def test_evict_filling_then_commit_does_not_resurrect(cache: Cache) -> None:
    entry, lease, _ = cache.reserve("p", key("p"), MANIFEST, 100, "cached", owner="conn")
    cache.evict(entry)
    committed, dropped = cache.commit("conn", lease.id)
    assert committed is entry and dropped == [entry]
    assert cache.entries == {} and cache.leases == {} and cache.used("cpu") == 0


# -- loading ------------------------------------------------------------------------------------


def test_loaded_makes_ready_and_touches(cache: Cache, clock: Clock) -> None:
    e = admit(cache, "e", 100, ready=False)
    clock.tick(7)
    assert cache.loaded(e) == []
    assert e.state == "ready" and e.last_used == clock.now


def test_acquire_requires_ready(cache: Cache) -> None:
    e = admit(cache, "e", 100, ready=False)
    with pytest.raises(Busy, match="is loading") as info:
        cache.acquire(e, "conn")
    assert info.value.details == {"name": "e", "state": "loading"}


# -- leases -------------------------------------------------------------------------------------


def test_acquire_creates_a_read_lease(cache: Cache, clock: Clock) -> None:
    e = admit(cache, "e", 100)
    lease = cache.acquire(e, "conn", pid=42, uid=1000)
    assert (lease.kind, lease.owner, lease.pid, lease.uid, lease.entry) == ("read", "conn", 42, 1000, e)
    assert lease.expires_at == clock.now + TTL
    assert e.acquires == 1 and e.read_leases == 1 and e.last_used == clock.now
    assert cache.acquire(e, "conn").id != lease.id


def test_lease_expires_after_ttl(cache: Cache, clock: Clock) -> None:
    e = admit(cache, "e", 100)
    lease = cache.acquire(e, "conn")
    assert cache.lease_book.next_expiry() == clock.now + TTL
    clock.tick(TTL - 1)
    assert cache.expire() == ([], [])
    clock.tick(1)  # exactly at the deadline
    expired, dropped = cache.expire()
    assert expired == [lease] and dropped == []
    assert cache.leases == {} and e.leases == {} and cache.lease_book.next_expiry() is None
    assert cache.stats["lease_expiries"] == 1
    assert "e" in cache.entries  # a cached entry outlives its leases


def test_heartbeat_renews(cache: Cache, clock: Clock) -> None:
    e = admit(cache, "e", 100)
    lease = cache.acquire(e, "conn")
    for _ in range(5):
        clock.tick(TTL * 0.8)
        assert cache.lease_book.heartbeat("conn", [lease.id]) == []
        assert cache.expire() == ([], [])
    assert lease.expires_at == clock.now + TTL
    clock.tick(TTL)
    assert cache.expire()[0] == [lease]


def test_heartbeat_reports_lost_ids(cache: Cache, clock: Clock) -> None:
    e = admit(cache, "e", 100)
    mine, theirs, gone = cache.acquire(e, "me"), cache.acquire(e, "them"), cache.acquire(e, "me")
    cache.release("me", gone.id)
    before = theirs.expires_at
    clock.tick()
    assert cache.lease_book.heartbeat("me", [mine.id, theirs.id, gone.id, 999]) == [theirs.id, gone.id, 999]
    assert mine.expires_at == clock.now + TTL
    assert theirs.expires_at == before  # someone else's lease is not renewed


def test_expiry_only_ends_leases_past_their_deadline(cache: Cache, clock: Clock) -> None:
    e = admit(cache, "e", 100)
    old = cache.acquire(e, "a")
    clock.tick(5)
    new = cache.acquire(e, "b")
    clock.tick(5)
    assert cache.expire()[0] == [old]
    assert set(cache.leases) == {new.id}


def test_release_unknown_or_foreign_lease(cache: Cache) -> None:
    e = admit(cache, "e", 100)
    lease = cache.acquire(e, "owner")
    with pytest.raises(LeaseExpired) as info:
        cache.release("intruder", lease.id)
    assert info.value.details == {"lease": lease.id}
    with pytest.raises(LeaseExpired):
        cache.release("owner", 12345)
    assert lease.id in cache.leases
    cache.release("owner", lease.id)
    with pytest.raises(LeaseExpired):
        cache.release("owner", lease.id)  # twice


def test_foreign_owner_cannot_commit_or_abort(cache: Cache) -> None:
    entry, lease, _ = cache.reserve("p", key("p"), MANIFEST, 100, "cached", owner="publisher")
    with pytest.raises(LeaseExpired):
        cache.commit("intruder", lease.id)
    with pytest.raises(LeaseExpired):
        cache.abort("intruder", lease.id)
    assert entry.state == "filling" and lease.id in cache.leases


def test_lease_kinds_are_not_interchangeable(cache: Cache) -> None:
    _, fill, _ = cache.reserve("p", key("p"), MANIFEST, 100, "cached", owner="conn")
    with pytest.raises(BadRequest, match="fill lease"):
        cache.release("conn", fill.id)
    read = cache.acquire(admit(cache, "e", 100), "conn")
    with pytest.raises(BadRequest, match="read lease"):
        cache.commit("conn", read.id)
    with pytest.raises(BadRequest, match="read lease"):
        cache.abort("conn", read.id)


def test_release_touches_lru(cache: Cache, clock: Clock) -> None:
    e = admit(cache, "e", 100)
    lease = cache.acquire(e, "conn")
    clock.tick(3)
    cache.release("conn", lease.id)
    assert e.last_used == clock.now


# -- ephemeral entries --------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["release", "expire", "drop_owner"])
def test_ephemeral_dropped_when_its_last_lease_ends(cache: Cache, clock: Clock, how: str) -> None:
    e = admit(cache, "e", 100, retention="ephemeral")
    first = cache.acquire(e, "c1")
    clock.tick(1)
    last = cache.acquire(e, "c2")
    assert cache.release("c1", first.id) == []
    assert "e" in cache.entries
    if how == "release":
        dropped = cache.release("c2", last.id)
    elif how == "expire":
        clock.tick(TTL)
        expired, dropped = cache.expire()
        assert expired == [last]
    else:
        dropped = cache.drop_owner("c2")
    assert dropped == [e] and cache.entries == {} and cache.leases == {}


def test_cached_entry_survives_its_last_lease(cache: Cache) -> None:
    e = admit(cache, "e", 100)
    assert cache.release("c", cache.acquire(e, "c").id) == []
    assert cache.entries["e"].state == "ready"


def test_drop_owner_ends_only_that_owners_leases(cache: Cache) -> None:
    e = admit(cache, "e", 100)
    f = admit(cache, "f", 100, retention="ephemeral")
    mine = [cache.acquire(e, "me"), cache.acquire(f, "me"), cache.acquire(e, "me")]
    theirs = cache.acquire(e, "them")
    assert cache.drop_owner("me") == [f]
    assert set(cache.leases) == {theirs.id}
    assert all(lease.id not in e.leases for lease in mine)
    assert cache.drop_owner("nobody") == []


# -- publishing ---------------------------------------------------------------------------------


def test_commit_makes_ready(cache: Cache, clock: Clock) -> None:
    entry, lease, _ = cache.reserve("p", key("p"), MANIFEST, 100, "cached", owner="conn", pid=7)
    clock.tick(2)
    assert cache.commit("conn", lease.id) == (entry, [])
    assert entry.state == "ready" and entry.leases == {} and cache.leases == {}
    assert entry.done_bytes == MANIFEST.nbytes and entry.last_used == clock.now
    assert cache.acquire(entry, "reader").kind == "read"
    with pytest.raises(LeaseExpired):
        cache.commit("conn", lease.id)  # a fill lease commits once


@pytest.mark.parametrize("how", ["abort", "expire", "drop_owner"])
def test_fill_lease_ending_before_commit_drops_at_once(cache: Cache, clock: Clock, how: str) -> None:
    entry, lease, _ = cache.reserve("p", key("p"), MANIFEST, 300, "pinned", owner="conn")
    assert cache.used("cpu") == 300
    if how == "abort":
        dropped = cache.abort("conn", lease.id)
    elif how == "expire":
        cache.lease_book.handed_out(lease)
        clock.tick(TTL)
        expired, dropped = cache.expire()
        assert expired == [lease]
    else:
        dropped = cache.drop_owner("conn")
    assert dropped == [entry]
    assert cache.entries == {} and cache.leases == {} and cache.used("cpu") == 0
    with pytest.raises(LeaseExpired):
        cache.commit("conn", lease.id)


def test_fill_lease_ttl_starts_when_handed_out(cache: Cache, clock: Clock) -> None:
    """Allocating a big arena may outlast the TTL: the lease must not expire before its holder knows it."""
    entry, lease, _ = cache.reserve("p", key("p"), MANIFEST, 100, "cached", owner="conn")
    clock.tick(10 * TTL)
    assert cache.expire() == ([], [])
    cache.lease_book.handed_out(lease)
    clock.tick(TTL / 2)
    assert cache.expire() == ([], [])
    clock.tick(TTL)
    assert cache.expire() == ([lease], [entry])


def test_published_entries_carry_their_publisher(cache: Cache) -> None:
    entry, _, _ = cache.reserve("p", key("p"), MANIFEST, 100, "cached", owner="conn", uid=1234)
    assert entry.publisher == 1234 and entry.describe()["publisher_uid"] == 1234
    loaded, _ = cache.admit("m", key("m"), MANIFEST, 100, "pinned", "config", publisher=998)
    assert loaded.describe()["publisher_uid"] == 998


@pytest.mark.parametrize(("origin", "publisher", "retention", "uid", "admin", "allowed"), [
    ("config", 998, "pinned", 1234, False, False),  # configured models: admins only
    ("load", 998, "cached", 1234, False, False),
    ("config", 998, "pinned", 1234, True, True),
    ("publish", 1234, "cached", 1234, False, True),  # a publisher evicts its own entry
    ("publish", 1234, "cached", 4321, False, False),  # but not someone else's
    ("publish", 1234, "pinned", 1234, False, False),  # nor one an admin pinned for it
    ("publish", 1234, "cached", 4321, True, True),
])
def test_who_may_evict(cache: Cache, origin: str, publisher: int, retention: str, uid: int, admin: bool,
                       allowed: bool) -> None:
    entry, _ = cache.admit("e", key("e"), MANIFEST, 100, retention, origin, publisher=publisher)  # type: ignore[arg-type]
    if allowed:
        cache.check_evict(entry, uid, admin)
    else:
        with pytest.raises(PermissionDenied, match="only admins evict"):
            cache.check_evict(entry, uid, admin)


def test_heartbeat_keeps_a_fill_lease(cache: Cache, clock: Clock) -> None:
    entry, lease, _ = cache.reserve("p", key("p"), MANIFEST, 100, "cached", owner="conn")
    clock.tick(TTL - 1)
    assert cache.lease_book.heartbeat("conn", [lease.id]) == []
    clock.tick(TTL - 1)
    assert cache.expire() == ([], [])
    assert cache.commit("conn", lease.id)[0].state == "ready"


def test_reserve_evicts_to_make_room(cache: Cache) -> None:
    admit(cache, "old", 900)
    entry, lease, victims = cache.reserve("p", key("p"), MANIFEST, 500, "cached", owner="conn")
    assert names(victims) == ["old"] and set(cache.entries) == {"p"}


# -- lookup -------------------------------------------------------------------------------------


def test_find_by_name(cache: Cache) -> None:
    e = admit(cache, "e", 100)
    assert cache.find("e") is e
    with pytest.raises(NotFound, match="no entry named 'x'") as info:
        cache.find("x")
    assert info.value.details == {"name": "x"}


def test_find_by_key(cache: Cache) -> None:
    e = admit(cache, "llama", 100, dtype="bf16", shard={"tp_rank": 0})
    assert cache.find(key("llama", dtype="bf16", shard={"tp_rank": 0}), LOADS) is e
    assert cache.by_key(key("llama"), LOADS) is None
    with pytest.raises(NotFound, match="no entry for model 'qwen'"):
        cache.find(key("qwen", dtype="bf16"), LOADS)


def test_find_near_miss_names_the_differing_fields(cache: Cache) -> None:
    admit(cache, "llama", 100, dtype="fp16", transform="t", device="cuda:0")
    with pytest.raises(KeyMismatch) as info:
        cache.find(key("llama", dtype="bf16"), LOADS)
    assert info.value.details["fields"] == ["dtype", "transform", "device"]
    assert info.value.details["entry"] == "llama"


def test_find_near_miss_reports_the_nearest_entry(cache: Cache) -> None:
    cache.admit("far", key("m", dtype="fp16", extra={"v": "1"}), MANIFEST, 1, "cached", "load")
    cache.admit("near", key("m", dtype="fp16"), MANIFEST, 1, "cached", "load")
    with pytest.raises(KeyMismatch) as info:
        cache.find(key("m", dtype="bf16"), LOADS)
    d = info.value.details
    assert d["fields"] == ["dtype"] and d["entry"] == "near"
    assert d["resident"] == {"dtype": "fp16"} and d["requested"] == {"dtype": "bf16"}
    assert "resident as 'near'" in info.value.message and "differs in: dtype" in info.value.message


def test_find_near_miss_details_are_plain_data(cache: Cache) -> None:
    cache.admit("a", key("m", shard={"tp_rank": 0}), MANIFEST, 1, "cached", "load")
    with pytest.raises(KeyMismatch) as info:
        cache.find(key("m", shard={"tp_rank": 1}), LOADS)
    d = info.value.details
    assert d["fields"] == ["shard"]
    assert d["resident"] == {"shard": {"tp_rank": 0}} and d["requested"] == {"shard": {"tp_rank": 1}}
    assert type(d["resident"]["shard"]) is dict


def test_describe(cache: Cache, clock: Clock) -> None:
    e = admit(cache, "e", 300, retention="pinned")
    cache.acquire(e, "c")
    d = e.describe()
    assert {k: d[k] for k in ("name", "state", "bytes", "device", "leases", "retention", "origin", "tensors",
                              "acquires")} == {
        "name": "e", "state": "ready", "bytes": 300, "device": "cpu", "leases": 1, "retention": "pinned",
        "origin": "load", "tensors": 2, "acquires": 1}
    assert d["progress"] == {"done": 0, "total": MANIFEST.nbytes, "phase": ""}
    assert d["key"]["model"] == "e"


def test_progress_while_reading_has_rate_and_time_left(cache: Cache) -> None:
    e = admit(cache, "e", 300, ready=False)
    e.load_phase, e.reading_since, e.done_bytes = "reading", time.monotonic() - 2.0, MANIFEST.nbytes // 4
    p = e.describe()["progress"]
    assert p["phase"] == "reading" and p["done"] == MANIFEST.nbytes // 4
    assert p["rate"] == pytest.approx(MANIFEST.nbytes / 8, rel=0.2)
    assert p["eta_s"] == pytest.approx(6.0, rel=0.2)


def test_a_failed_load_is_kept_until_the_name_is_admitted_again(cache: Cache) -> None:
    cache.fail("t", "t.safetensors is truncated", "config", "cpu", "/m/t.safetensors")
    d = cache.failures["t"].describe()
    assert d["state"] == "failed" and d["reason"] == "t.safetensors is truncated" and d["bytes"] == 0
    assert d["failed_at"].endswith("+00:00") and cache.stats["load_failures"] == 1
    with pytest.raises(NotFound, match="'t' failed to load at .*: t.safetensors is truncated") as info:
        cache.find("t")
    assert info.value.details["state"] == "failed"
    admit(cache, "t", 100)
    assert "t" not in cache.failures and cache.find("t").state == "ready"
    cache.fail("u", "gone", "load", "cpu", "/u")
    assert cache.forget_failure("u") is not None and not cache.failures


def test_failures_are_bounded_by_max_entries(clock: Clock) -> None:
    cache = Cache({"cpu": 1000}, TTL, clock=clock, max_entries=3)
    for i in range(5):
        cache.fail(f"m{i}", "bad", "load", "cpu", "/x")
    assert list(cache.failures) == ["m2", "m3", "m4"]  # the oldest go first


# -- indexes: what a peer can make the daemon do stays proportional to its own share ---------------


def test_a_renewed_lease_is_requeued_not_expired(cache: Cache, clock: Clock) -> None:
    e = admit(cache, "e", 100)
    kept, dropped = cache.acquire(e, "a"), cache.acquire(e, "b")
    clock.tick(TTL / 2)
    assert cache.lease_book.heartbeat("a", [kept.id]) == []
    clock.tick(TTL / 2)
    assert cache.expire() == ([dropped], [])
    clock.tick(TTL / 2)
    assert cache.expire() == ([kept], []) and cache.leases == {}
    assert len(cache.lease_book._deadlines) == 0  # every heap place was consumed


def test_a_shortened_ttl_takes_effect_at_the_next_heartbeat(cache: Cache, clock: Clock) -> None:
    lease = cache.acquire(admit(cache, "e", 100), "a")
    cache.lease_book.ttl_s = 1.0
    cache.lease_book.heartbeat("a", [lease.id])
    clock.tick(1.0)
    assert cache.expire() == ([lease], [])


def test_a_publishers_disconnect_drops_its_filling_entry_and_the_entrys_leases(cache: Cache) -> None:
    entry, fill, _ = cache.reserve("p", key("p"), MANIFEST, 100, "cached", "a")
    assert cache.drop_owner("a") == [entry]
    assert cache.entries == {} and cache.leases == {} and cache.used("cpu") == 0


def test_entries_are_indexed_by_key_and_usage_is_kept(cache: Cache) -> None:
    e = admit(cache, "e", 100, transform="fp8")
    assert cache.by_key(key("e", transform="fp8"), LOADS) is e and cache.by_key(key("e"), LOADS) is None
    assert cache.used("cpu") == 100
    cache.evict(e)
    assert cache.by_key(key("e", transform="fp8"), LOADS) is None and cache.used("cpu") == 0


def test_a_near_miss_compares_a_bounded_sample(cache: Cache) -> None:
    for i in range(40):
        cache.admit(f"m{i}", key("m", transform=f"t{i}"), MANIFEST, 1, "cached", "load")
    with pytest.raises(KeyMismatch) as info:
        cache.find(key("m", transform="nope"), LOADS)
    assert info.value.details["fields"] == ["transform"]


def test_max_entries_is_a_busy_line_only_when_nothing_can_go(clock: Clock) -> None:
    cache = Cache({"cpu": 1000}, TTL, clock=clock, max_entries=2)
    admit(cache, "a", 1, retention="pinned")
    b = admit(cache, "b", 1)
    cache.acquire(b, owner="reader")
    with pytest.raises(Busy, match="max_entries"):
        cache.admit("c", key("c"), MANIFEST, 1, "cached", "load")
    cache.drop_owner("reader")
    _, victims = cache.admit("c", key("c"), MANIFEST, 1, "cached", "load")
    assert names(victims) == ["b"] and sorted(cache.entries) == ["a", "c"]


def test_a_full_daemon_evicts_the_least_recently_used_unleased_entry(clock: Clock) -> None:
    """Another uid's cached entries, left behind, do not hold max_entries: the oldest goes, of any
    device and publisher, and not one that is leased, pinned or loading."""
    cache = Cache({"cpu": 1000, "cuda:0": 1000}, TTL, clock=clock, max_entries=4)
    old, _, _ = cache.reserve("old", key("p", transform="a", device="cuda:0"), MANIFEST, 1, "cached", "x", uid=1001)
    cache.commit("x", next(iter(old.leases)))
    clock.tick()
    for name in ("newer", "leased"):
        entry, lease, _ = cache.reserve(name, key("p", transform=name), MANIFEST, 1, "cached", "x", uid=1001)
        cache.commit("x", lease.id)
        clock.tick()
    cache.acquire(cache.entries["leased"], owner="reader")
    cache.admit("loading", key("l"), MANIFEST, 1, "cached", "load")
    clock.tick()
    _, _, victims = cache.reserve("mine", key("p", transform="a"), MANIFEST, 1, "cached", "y", uid=1000)
    assert names(victims) == ["old"] and "old" not in cache.entries and cache.used("cuda:0") == 0
    _, _, victims = cache.reserve("mine2", key("p", transform="b"), MANIFEST, 1, "cached", "y", uid=1000)
    assert names(victims) == ["newer"]


def test_entries_per_uid_are_bounded(clock: Clock) -> None:
    cache = Cache({"cpu": 1000}, TTL, clock=clock, max_entries_per_uid=2)
    for i in range(2):
        cache.reserve(f"p{i}", key("p", transform=f"t{i}"), MANIFEST, 1, "cached", "x", uid=1001)
    with pytest.raises(Busy, match="max_entries_per_uid"):
        cache.reserve("p2", key("p", transform="t2"), MANIFEST, 1, "cached", "x", uid=1001)
    cache.reserve("q", key("p", transform="t2"), MANIFEST, 1, "cached", "y", uid=1000)  # another uid's room
    admit(cache, "loaded", 1)  # the daemon's own loads are not publishes
    cache.drop_owner("x")  # fill leases end: both entries go, and with them the uid's count
    cache.reserve("p2", key("p", transform="t2"), MANIFEST, 1, "cached", "x", uid=1001)


def test_one_key_from_two_publishers_does_not_collide(cache: Cache) -> None:
    """Key squatting: uid 1001 publishing 1000's exact key first leaves 1000 free to publish,
    find and evict its own; a lookup takes the first publisher of the asker's order."""
    k = key("p", transform="fp8")
    squat, lease, _ = cache.reserve("squat", k, MANIFEST, 1, "cached", "a", uid=1001)
    cache.commit("a", lease.id)
    with pytest.raises(NotFound, match="published by uid 1001"):
        cache.find(k, (1000, 0))
    own, lease, _ = cache.reserve("own", k, MANIFEST, 1, "cached", "b", uid=1000)
    cache.commit("b", lease.id)
    with pytest.raises(Busy, match="uid 1000 already has an entry with this key"):
        cache.reserve("again", k, MANIFEST, 1, "cached", "b", uid=1000)
    assert cache.find(k, (1000, 0)) is own and cache.find(k, (1001, 0)) is squat
    assert cache.find(k, (0, 1001, 1000)) is squat  # a trusted publisher, asked for before the own uid
    cache.check_evict(own, 1000, admin=False)
    assert cache.evict(own) == [own] and cache.find(k, (1001,)) is squat


# -- leases: bounded per uid, listed in pages, expired in batches ---------------------------------


def test_leases_per_uid_are_bounded_and_the_daemons_holds_are_not_counted(clock: Clock) -> None:
    cache = Cache({"cpu": 1000}, TTL, clock=clock, max_leases_per_uid=3)
    e = admit(cache, "e", 1)
    for owner in ("a", "a", "b"):  # over two connections of one uid
        cache.acquire(e, owner, uid=1001)
    with pytest.raises(Busy, match="uid 1001 holds 3 leases, the daemon's max_leases_per_uid"):
        cache.acquire(e, "c", uid=1001)
    with pytest.raises(Busy, match="max_leases_per_uid"):
        cache.reserve("p", key("p", transform="t"), MANIFEST, 1, "cached", "c", uid=1001)
    assert "p" not in cache.entries and e.acquires == 3
    cache.acquire(e, "d", uid=1002)
    cache.acquire(e, object(), uid=1001, ttl_s=math.inf)  # the daemon's own hold, e.g. a verify
    cache.drop_owner("b")
    cache.acquire(e, "c", uid=1001)


def test_leases_are_listed_a_page_at_a_time(cache: Cache) -> None:
    e = admit(cache, "e", 1)
    mine = [cache.acquire(e, "a", uid=1001).id if i % 2 else cache.acquire(e, "b", uid=1002).id for i in range(7)]
    everyone = sorted(cache.leases)
    seen, after = [], 0
    while True:
        page, after = cache.lease_book.page(None, after, 3)  # type: ignore[assignment]
        seen += [lease.id for lease in page]
        if after is None:
            break
    assert seen == everyone
    page, cursor = cache.lease_book.page(1001, 0, 2)
    assert [lease.id for lease in page] == [i for i in mine if cache.leases[i].uid == 1001][:2]
    rest, end = cache.lease_book.page(1001, cursor, 10)  # type: ignore[arg-type]
    assert {lease.uid for lease in page + rest} == {1001} and end is None and len(page + rest) == 3
    assert cache.lease_book.page(4242, 0, 10) == ([], None)


def test_leases_expire_in_batches_and_are_told_in_one_line(cache: Cache, clock: Clock) -> None:
    a, b = admit(cache, "a", 1), admit(cache, "b", 1)
    for i in range(10):
        cache.acquire(a if i < 7 else b, f"c{i}", pid=100 + i, uid=1001)
    clock.tick(TTL + 1)
    batches = []
    while True:
        expired, _ = cache.expire(4)
        batches.append(len(expired))
        if len(expired) < 4:
            break
    assert batches == [4, 4, 2] and not cache.leases and cache.stats["lease_expiries"] == 10
    one = LeaseRecord(1, a, "read", "x", 7, 1001, 0.0)
    assert describe_expired([one]) == "lease 1 on a (pid 7, uid 1001) expired: no heartbeat"
    many = [LeaseRecord(i, a if i < 7 else b, "read", "x", i, 1001 + i % 2, 0.0) for i in range(10)]
    assert describe_expired(many) == "10 leases expired, no heartbeat: 7 on a, 3 on b (uids 1001, 1002)"


def test_memory_still_mapped_outside_the_cache_counts_against_its_device(cache: Cache, clock: Clock) -> None:
    """What reclaimed arenas still take (mapped by processes whose leases ended) leaves less room:
    candidates are evicted for it, and past that the refusal says where the memory is."""
    outside = {"cpu": 300, "cuda:0": 0}
    cache.outside = outside.__getitem__
    admit(cache, "a", 400)
    clock.tick()
    _, victims = cache.admit("b", key("b"), MANIFEST, 400, "cached", "load")  # 400 + 300 + 400 > 1000
    assert names(victims) == ["a"]
    with pytest.raises(OutOfMemory) as info:
        cache.admit("c", key("c"), MANIFEST, 301, "cached", "load")
    assert info.value.details == {"device": "cpu", "need": 301, "budget": 1000, "held": 400, "outside": 300}
    assert "300 B by processes still mapping entries that are gone" in info.value.message
    outside["cpu"] = 0  # they dropped their views
    cache.admit("c", key("c"), MANIFEST, 301, "cached", "load")


def test_who_asked_for_a_load_survives_parking(cache: Cache) -> None:
    """The fd store's record keeps `asked_by`, and the entry's fd names are its publisher's."""
    import os

    from wcd import parking

    entry = admit(cache, "e", 1)
    entry.asked_by, entry.publisher = 1237, 0
    entry.arena = type("A", (), {"kind": "host", "size": 4096})()
    fd = parking.record_memfd(entry)
    try:
        rec = parking.parse_record(fd)
    finally:
        os.close(fd)
    assert (rec.asked_by, rec.publisher, rec.origin) == (1237, 0, "load")
    assert parking.fd_names(entry.key, 0) != parking.fd_names(entry.key, 1237)
