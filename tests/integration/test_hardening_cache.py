"""Issue 29, the cache's half (items 5-9): each attack of an allowed peer against a real daemon over a
real socket, while a second client's ping must stay under 50 ms where the loop is what is attacked.

Peers of other uids are subprocesses that drop to that uid (`test_hardening_trust.as_user`): those
tests need root.
"""

from __future__ import annotations

import textwrap
import time

import pytest
import torch

from tests.integration.peers import Raw
from tests.integration.pings import assert_fast, pinging
from tests.integration.test_hardening_trust import as_user, needs_root, results
from wcd.key import WeightCacheKey

ATTACKER, VICTIM = 1234, 1236
KEY = WeightCacheKey(model="shared-name", transform="vllm/fp8")

# -- 5: key squatting -------------------------------------------------------------------------------


@needs_root
def test_another_uid_publishing_my_key_first_does_not_lock_me_out(make_daemon, shared_dir):
    """uid 1234 publishes uid 1236's exact key first. 1236 still publishes under it, attaches its
    own entry by key, and evicts it; 1234's entry is left as it was."""
    d = make_daemon(f"allowed_uids = [{ATTACKER}, {VICTIM}]\n", socket=shared_dir / "wcd.sock")
    publish = textwrap.dedent(f"""
        c = Client({str(d.socket)!r})
        key = WeightCacheKey.model_validate({KEY.model_dump()!r})
        name = c.publish(key, {{"w": torch.full((4,), float(os.getuid()))}})
    """)
    with pinging(d) as pings:
        squat = results(as_user(ATTACKER, publish + "print(json.dumps({'entry': name}))\n"))
        victim = results(as_user(VICTIM, publish + """
lease = c.acquire(key)
out = {"entry": name, "publish": "ok", "acquired": lease.entry, "publisher": lease.publisher_uid,
       "value": lease.tensors["w"][0].item()}
lease.release()
out["evict"] = code(lambda: c.evict(key))
print(json.dumps(out))
"""))
    assert_fast(pings)
    assert victim["entry"] != squat["entry"]
    assert victim["acquired"] == victim["entry"] and victim["publisher"] == VICTIM and victim["value"] == VICTIM
    assert victim["evict"] == "ok"
    with d.client() as c:
        assert [(e["name"], e["publisher_uid"]) for e in c.list()] == [(squat["entry"], ATTACKER)]


# -- 6: max_entries held by another uid's cached entries ------------------------------------------------


@needs_root
def test_entries_left_by_another_uid_make_room_and_a_uid_has_a_bound(make_daemon, checkpoint, shared_dir):
    """uid 1234 fills max_entries with unleased cached entries and disconnects: 1236's publishes and
    root's load get room (the least recently used go); one uid publishes at most max_entries_per_uid."""
    path, _ = checkpoint
    d = make_daemon(f"allowed_uids = [{ATTACKER}, {VICTIM}]\nmax_entries = 4\nmax_entries_per_uid = 3\n",
                    socket=shared_dir / "wcd.sock")
    fill = textwrap.dedent(f"""
        c = Client({str(d.socket)!r})
        t = {{"w": torch.ones(4)}}
        names = [c.publish(WeightCacheKey(model="p", transform=f"t{{i}}"), t) for i in range(3)]
        over = code(lambda: c.publish(WeightCacheKey(model="p", transform="t3"), t))
    """)
    with pinging(d) as pings:
        attacker = results(as_user(ATTACKER, fill + "print(json.dumps({'names': names, 'over': over}))\n"))
        with d.client() as c:
            c.publish(WeightCacheKey(model="root", transform="t"), {"w": torch.ones(4)})  # the 4th entry
        victim = results(as_user(VICTIM, fill + "print(json.dumps({'names': names, 'over': over}))\n"))
        with d.client() as c:
            c.load("loaded", str(path), wait=True)
            held = {e["name"]: e["publisher_uid"] for e in c.list()}
    assert_fast(pings)
    assert attacker["over"] == victim["over"] == "busy"
    assert len(held) == 4 and "loaded" in held and list(held.values()).count(VICTIM) == 3
    assert not set(attacker["names"]) & set(held)

# -- 9: protocol v1 rows ----------------------------------------------------------------------------


@pytest.mark.slow
def test_a_reserve_in_v1_rows_is_refused_before_it_is_parsed(make_daemon):
    """262,144 tensors as protocol v1 rows (one msgpack array each): the decoder refuses the frame at
    its first long array, so the loop never builds or validates the rows (which stalled it 0.7-1.2 s)."""
    d = make_daemon()
    rows = [[f"model.layers.{i // 8}.experts.{i % 8}.w", "BF16", [4, 4]] for i in range(262_144)]
    attacker = Raw(d.socket)
    frame = attacker.frame({"op": "reserve", "key": {"model": "moe", "transform": "test"}, "tensors": rows})
    with pinging(d) as pings:
        started = time.monotonic()
        attacker.send(frame)
        words = attacker.last_words()
        took = time.monotonic() - started
    assert_fast(pings)
    assert words is not None and words["error"]["code"] == "protocol_error", words
    assert "longer than 4096 items" in words["error"]["message"]
    print(f"refused in {took * 1000:.1f} ms")
    with d.client() as c:
        c.ping()
