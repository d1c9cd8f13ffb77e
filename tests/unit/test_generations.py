"""Generations of a series in the cache: pure logic, no I/O (`wcd.cache.Series`)."""

from __future__ import annotations

import pytest

from wcd.cache import Cache, Entry
from wcd.errors import BadRequest, Busy, NotFound, OutOfMemory, PermissionDenied
from wcd.key import WeightCacheKey
from wcd.manifest import Manifest

LAYOUT = Manifest.build([("w", "F32", (4, 4)), ("b", "F32", (4,))])
OTHER = Manifest.build([("w", "F32", (4, 4)), ("b", "F16", (4,))])
PUBLISHER, OTHER_UID = 1000, 1001


def publish(cache: Cache, series: str = "s", nbytes: int = 100, uid: int = PUBLISHER,
            manifest: Manifest = LAYOUT, admin: bool = False) -> tuple[Entry, list[Entry]]:
    """Reserve and commit the next generation: (entry, what the commit dropped)."""
    entry, lease, _ = cache.reserve("ignored", WeightCacheKey(model=series, transform="t"), manifest, nbytes,
                                    "cached", object(), 1, uid, series=series, admin=admin)
    committed, dropped = cache.commit(lease.owner, lease.id)
    assert committed is entry
    return entry, dropped


def read(cache: Cache, entry: Entry) -> object:
    owner = object()
    cache.acquire(entry, owner)
    return owner


@pytest.fixture
def cache() -> Cache:
    return Cache({"cpu": 1000}, 10.0, keep_generations=1)


def test_each_commit_makes_the_next_generation_current(cache: Cache) -> None:
    one, _ = publish(cache)
    assert (one.name, one.generation, one.key.extra) == ("s@1", 1, {"series": "s", "generation": "1"})
    assert cache.current("s") is one
    two, dropped = publish(cache)
    assert cache.current("s") is two and two.state == "ready" and one.state == "previous" and dropped == []
    assert one.describe()["current"] is False and two.describe()["current"] is True


def test_past_keep_generations_unleased_generations_go_and_leased_ones_wait(cache: Cache) -> None:
    one, _ = publish(cache)
    reader = read(cache, one)
    publish(cache)
    three, dropped = publish(cache)
    assert dropped == [] and one.state == "evicting", "leased: it goes with its last lease"
    assert [e.name for e in cache.drop_owner(reader)] == ["s@1"]
    four, dropped = publish(cache)
    assert [e.name for e in dropped] == ["s@2"] and three.state == "previous"
    assert list(cache.series["s"].generations) == [3, 4]


def test_keep_generations_zero_keeps_only_the_current(cache: Cache) -> None:
    cache.keep_generations = 0
    publish(cache)
    _, dropped = publish(cache)
    assert [e.name for e in dropped] == ["s@1"]


def test_rollback_makes_the_previous_generation_current_and_back(cache: Cache) -> None:
    one, _ = publish(cache)
    two, _ = publish(cache)
    back, dropped = cache.rollback("s", PUBLISHER, admin=False)
    assert back is one and cache.current("s") is one and two.state == "previous" and dropped == []
    forward, _ = cache.rollback("s", PUBLISHER, admin=False)
    assert forward is two
    three, _ = publish(cache)
    assert three.generation == 3, "numbers never repeat while the series lives"


def test_rollback_needs_a_kept_generation_and_the_publisher(cache: Cache) -> None:
    publish(cache)
    with pytest.raises(NotFound, match="not kept"):
        cache.rollback("s", PUBLISHER, admin=False)
    publish(cache)
    with pytest.raises(PermissionDenied, match="published by uid 1000"):
        cache.rollback("s", OTHER_UID, admin=False)
    assert cache.rollback("s", OTHER_UID, admin=True)[0].generation == 1
    with pytest.raises(NotFound, match="no series named 'nope'"):
        cache.rollback("nope", PUBLISHER, admin=True)


def test_only_the_publisher_or_an_admin_publishes_the_next_generation(cache: Cache) -> None:
    publish(cache)
    with pytest.raises(PermissionDenied):
        publish(cache, uid=OTHER_UID)
    assert publish(cache, uid=OTHER_UID, admin=True)[0].generation == 2


def test_a_generation_must_have_the_series_layout(cache: Cache) -> None:
    publish(cache)
    with pytest.raises(BadRequest, match="another layout"):
        publish(cache, manifest=OTHER)
    assert list(cache.series["s"].generations) == [1]


def test_one_generation_fills_at_a_time(cache: Cache) -> None:
    publish(cache)
    cache.reserve("x", WeightCacheKey(model="s", transform="t"), LAYOUT, 100, "cached", object(), 1, PUBLISHER,
                  series="s")
    with pytest.raises(Busy, match="generation 2 of series 's' is being filled"):
        publish(cache)


def test_a_fill_that_ends_before_commit_leaves_the_series_as_it_was(cache: Cache) -> None:
    one, _ = publish(cache)
    owner = object()
    entry, lease, _ = cache.reserve("x", WeightCacheKey(model="s", transform="t"), LAYOUT, 100, "cached", owner, 1,
                                    PUBLISHER, series="s")
    assert [e.name for e in cache.drop_owner(owner)] == ["s@2"]
    assert cache.current("s") is one and list(cache.series["s"].generations) == [1]
    assert publish(cache)[0].generation == 2


def test_every_live_generation_counts_against_the_budget(cache: Cache) -> None:
    one, _ = publish(cache, nbytes=600)
    read(cache, one)
    with pytest.raises(OutOfMemory, match="does not fit"):
        publish(cache, nbytes=600)
    assert cache.used("cpu") == 600 and cache.current("s") is one


def test_a_series_goes_with_its_last_generation(cache: Cache) -> None:
    one, _ = publish(cache)
    assert cache.evict(one) == [one]
    assert "s" not in cache.series
    with pytest.raises(NotFound):
        cache.current("s")


def test_an_evicted_current_generation_leaves_no_current(cache: Cache) -> None:
    publish(cache)
    two, _ = publish(cache)
    cache.evict(two)
    with pytest.raises(NotFound, match="no current generation"):
        cache.current("s")


def test_re_adopted_generations_rejoin_their_series_newest_current(cache: Cache) -> None:
    entries = []
    for generation in (2, 1):
        key = WeightCacheKey(model="s", transform="t", extra={"series": "s", "generation": str(generation)})
        entry, _ = cache.admit(f"s@{generation}", key, LAYOUT, 100, "cached", "publish", publisher=PUBLISHER,
                               adopted=True)
        cache.loaded(entry)
        cache.adopted_generation(entry, LAYOUT.layout())
        entries.append(entry)
    assert cache.current("s") is entries[0] and entries[1].state == "previous"
    assert publish(cache)[0].generation == 3


def test_after_a_rollback_the_next_commit_keeps_the_known_good_generation(cache: Cache) -> None:
    one, _ = publish(cache)
    two, _ = publish(cache)
    cache.rollback("s", PUBLISHER, admin=False)  # 2 was bad: back to 1
    three, dropped = publish(cache)
    assert [e.name for e in dropped] == ["s@2"], "the rolled-back-from generation goes, not the good one"
    assert one.state == "previous" and cache.current("s") is three


def test_a_rollback_does_not_bring_back_a_current_generation_being_evicted(cache: Cache) -> None:
    publish(cache)
    two, _ = publish(cache)
    read(cache, two)
    cache.evict(two)  # leased: evicting
    cache.rollback("s", PUBLISHER, admin=False)
    assert two.state == "evicting"


def test_room_is_made_from_kept_generations_before_the_current_one(cache: Cache) -> None:
    one, _ = publish(cache, nbytes=400)
    two, _ = publish(cache, nbytes=400)
    entry, victims = cache.admit("other", WeightCacheKey(model="o"), LAYOUT, 300, "cached", "load")
    assert [e.name for e in victims] == ["s@1"] and cache.current("s") is two


def test_a_rollback_works_when_the_current_generation_was_evicted(cache: Cache) -> None:
    one, _ = publish(cache)
    two, _ = publish(cache)
    cache.evict(two)
    assert cache.rollback("s", PUBLISHER, admin=False)[0] is one


def test_a_generation_keeps_the_series_device() -> None:
    cache = Cache({"cpu": 1000, "cuda:0": 1000}, 10.0)
    publish(cache)
    with pytest.raises(BadRequest, match="another layout"):
        cache.reserve("x", WeightCacheKey(model="s", transform="t", device="cuda:0"), LAYOUT, 100, "cached", object(),
                      1, PUBLISHER, series="s")
