"""Issue 29, the cache's half (items 5-9): each attack of an allowed peer against a real daemon over a
real socket, while a second client's ping must stay under 50 ms where the loop is what is attacked.

Peers of other uids are subprocesses that drop to that uid (`test_hardening_trust.as_user`): those
tests need root.
"""

from __future__ import annotations

import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.peers import Raw
from tests.integration.pings import assert_fast, pinging
from tests.integration.test_hardening_trust import as_user, needs_root, results
from wcd.errors import BadRequest, KeyMismatch
from wcd.integrations import trust
from wcd.integrations.transformers import _find_entry
from wcd.key import WeightCacheKey, fingerprint_checkpoint

ATTACKER, VICTIM = 1234, 1236
KEY = WeightCacheKey(model="shared-name", transform="vllm/fp8")

# -- 5: key squatting -------------------------------------------------------------------------------


@pytest.mark.slow
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


@pytest.mark.slow
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


# -- 8: leases ------------------------------------------------------------------------------------------


def acquire_many(peer: Raw, target: str, n: int) -> list[dict[str, Any]]:
    """`n` acquires of `target`, pipelined 64 at a time (a connection's requests in flight); the replies."""
    replies: list[dict[str, Any]] = []
    while len(replies) < n:
        batch = min(64, n - len(replies))
        peer.send(b"".join(peer.frame({"op": "acquire", "name": target}) for _ in range(batch)))
        replies += [peer.recv() for _ in range(batch)]
    return replies


def published(d: Any, name: str = "p") -> str:
    with d.client() as c:
        return c.publish(WeightCacheKey(model=name, transform="t"), {"w": torch.ones(4)}, retention="pinned")


def test_a_uids_leases_are_bounded_and_listed_in_pages(make_daemon):
    """One uid pipelines acquires past max_leases_per_uid: the rest are refused busy in one line, and
    `leases` answers in pages (the client follows the cursor) rather than one reply of everything."""
    d = make_daemon("max_leases_per_uid = 1500\n")
    entry = published(d)
    peer = Raw(d.socket)
    with pinging(d) as pings:
        replies = acquire_many(peer, entry, 1600)
    assert_fast(pings)
    refused = [r["error"] for r in replies if not r["ok"]]
    assert sum(r["ok"] for r in replies) == 1500 and len(refused) == 100
    assert {e["code"] for e in refused} == {"busy"} and "max_leases_per_uid" in refused[0]["message"]
    first = peer.call({"op": "leases"})
    assert len(first["leases"]) == 1000 and first["next"] == first["leases"][-1]["id"]
    with d.client() as c:
        listed = c.list_leases()
    assert sorted(lease["id"] for lease in listed) == sorted(r["lease"] for r in replies if r["ok"])


@pytest.mark.slow
def test_leases_expiring_at_once_are_ended_in_batches_with_one_log_line_each(make_daemon):
    """20,000 leases renewed in one go, then left to expire together: the loop ends them a batch at a
    time (pings stay fast) and the log says so in a line per batch, not a line per lease."""
    n = 20_000
    d = make_daemon(f"lease_ttl_s = 3.0\nmax_leases_per_uid = {n}\n")
    entry = published(d)
    peer = Raw(d.socket)
    ids = []
    for _ in range(0, n, 2000):  # renewed as they are made: building them takes longer than the TTL
        ids += [r["lease"] for r in acquire_many(peer, entry, 2000)]
        peer.send(b"".join(peer.frame({"op": "heartbeat", "leases": ids[i:i + 4096]})
                           for i in range(0, len(ids), 4096)))
        for _ in range(0, len(ids), 4096):
            assert peer.recv()["ok"]
    lines_before = d.log.read_text().count("expired")
    with pinging(d, tail_s=0.5) as pings:
        deadline = time.monotonic() + 30
        while peer.call({"op": "leases", "limit": 1})["leases"] and time.monotonic() < deadline:
            time.sleep(0.2)
    assert_fast(pings)
    with d.client() as c:
        assert c.list_leases() == [] and c.status()["counters"]["lease_expiries"] == n
    lines = d.log.read_text().count("expired") - lines_before
    assert 0 < lines <= n // 1024 + 3, f"{lines} log lines for {n} expiries"


# -- 7: an admin's load is the admin's, not the daemon's own ------------------------------------------


@pytest.mark.slow
@needs_root
def test_an_admins_load_is_judged_by_the_uid_that_asked(make_daemon, checkpoint, shared_dir):
    """uid 1237, an admin, loads a path: the entry records who asked, and the integrations' raw
    lookup no longer takes it for the daemon's own load (it did: `publisher_uid` was the daemon's)."""
    path, _ = checkpoint
    admin = 1237
    d = make_daemon(f'allowed_uids = [{admin}]\nadmin_uids = [{admin}]\n\n[[models]]\nname = "m"\npath = "{path}"\n',
                    socket=shared_dir / "wcd.sock")
    with pinging(d) as pings:
        loaded = results(as_user(admin, f"""
            c = Client({str(d.socket)!r})
            print(json.dumps(c.load("theirs", {str(path)!r}, wait=True)))
        """))
    assert_fast(pings)
    assert loaded["asked_by"] == admin and loaded["origin"] == "load"
    fp = fingerprint_checkpoint(path)
    with d.client() as c:
        assert {e["name"]: e["asked_by"] for e in c.list()} == {"m": None, "theirs": admin}
        assert _find_entry(c, path, fp, "theirs", False, 10) is None
        found = _find_entry(c, path, fp, None, False, 10)  # the configured model is the daemon's own
        assert found is not None and found[0].entry == "m" and found[1] == "the daemon (uid 0, its own load)"
        found[0].release()
        with c.acquire("theirs") as lease:
            assert lease.asked_by == admin and trust.accepted_publisher(c, lease) is None
            assert trust.accepted_publisher(c, lease, trusted=[admin]) == f"trusted uid {admin} (its load)"
            assert trust.whose(lease) == f"loaded from a path uid {admin} gave"


def unsampled_byte(shard: Path) -> int:
    """A byte of `shard`'s tensor data that no fingerprint sample reads."""
    from wcd.headers import read_header
    from wcd.key import SAMPLE_BYTES, _sample_positions

    header = read_header(shard)
    sampled = {p + i for p in _sample_positions(header.data_start, header.file_size) for i in range(SAMPLE_BYTES)}
    return next(p for p in range(header.data_start, header.file_size) if p not in sampled)


def test_a_copy_modified_between_the_samples_keeps_its_fingerprint_but_not_its_digest(make_daemon, tmp_path):
    """What the README says the fingerprint does not prove: a copy with one byte changed where no
    sample reads keeps the fingerprint. A reader that asks for the content digest is not given it."""
    from safetensors.torch import save_file

    original, copy = tmp_path / "orig", tmp_path / "copy"
    for d in (original, copy):
        d.mkdir()
        save_file({"w": torch.arange(1 << 20, dtype=torch.float32)}, str(d / "model.safetensors"))
    shard = copy / "model.safetensors"
    at = unsampled_byte(shard)
    data = bytearray(shard.read_bytes())
    data[at] ^= 0x40
    shard.write_bytes(bytes(data))
    assert fingerprint_checkpoint(original) == fingerprint_checkpoint(copy)
    d = make_daemon(f'[[models]]\nname = "orig"\npath = "{original}"\n\n[[models]]\nname = "copy"\npath = "{copy}"\n')
    with d.client() as c:
        digest = c.verify("orig")["digest"]
        with c.acquire("orig", digest=digest) as lease:
            assert lease.tensors["w"][-1].item() == (1 << 20) - 1
        with pytest.raises(KeyMismatch, match="holds other bytes than the content digest asked for") as refused:
            c.acquire("copy", digest=digest)
        assert refused.value.details["fields"] == ["digest"]
        assert refused.value.details["resident"] == c.verify("copy")["digest"] != digest
        published = c.publish(WeightCacheKey(model="p", transform="t"), {"w": torch.ones(4)})
        mine = c.verify(published)["digest"]
        c.acquire(published, digest=mine).release()
        with pytest.raises(BadRequest, match="digest"):
            c.acquire(published, digest="not hex")
