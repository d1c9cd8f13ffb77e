"""Issue 29, the arena half: what a publisher can do with the memfd it fills and with the layout it
reserves, tried against a real daemon over a real socket while a second client's ping must stay
under 50 ms; and what a client refuses when a reply is not what a wcd daemon sends (an `Impostor`).
"""

from __future__ import annotations

import ctypes
import fcntl
import gc
import os
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.peers import Impostor, columns
from tests.integration.pings import assert_fast, pinging
from tests.integration.test_hardening_trust import memfds, wait_until
from wcd.client import Client
from wcd.errors import BadReply, BadRequest, OutOfMemory
from wcd.integrations.transformers import _find_entry
from wcd.key import WeightCacheKey
from wcd.manifest import TENSOR_COLUMNS, Manifest

MiB = 1 << 20
FALLOC_FL_KEEP_SIZE = 1
_libc = ctypes.CDLL(None, use_errno=True)


def reserve_fd(c: Client, model: str, nbytes: int) -> tuple[dict[str, Any], int]:
    """A fill lease on a `nbytes` arena, and the arena's fd itself (as a hostile publisher keeps it)."""
    columns = Manifest.build([("w", "U8", [nbytes])]).to_wire()
    reply, fds = c.request_fds("reserve", key=WeightCacheKey(model=model, transform="test").model_dump(),
                               retention="cached", columns={k: columns[k] for k in TENSOR_COLUMNS})
    [fd] = fds
    return reply, fd


def allocated(fd: int) -> int:
    return os.fstat(fd).st_blocks * 512


def fallocate_keep_size(fd: int, offset: int, length: int) -> None:
    """fallocate(2) with FALLOC_FL_KEEP_SIZE: memory past the end, the size unchanged."""
    if _libc.fallocate(fd, FALLOC_FL_KEEP_SIZE, ctypes.c_long(offset), ctypes.c_long(length)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def host_memory(c: Client) -> dict[str, Any]:
    """The daemon's status of host memory: budget, used, mapped_after_release, ..."""
    [cpu] = [dev for dev in c.status()["devices"] if dev["device"] == "cpu"]
    return cpu


ATTACKS = {
    "grow": lambda fd, size: (os.ftruncate(fd, size + 512 * MiB), os.posix_fallocate(fd, 0, size + 512 * MiB)),
    "allocate-past-end": lambda fd, size: fallocate_keep_size(fd, size, 512 * MiB),
    "shrink": lambda fd, size: os.ftruncate(fd, 0),
}


@pytest.mark.slow
@pytest.mark.parametrize("attack", list(ATTACKS))
def test_a_publisher_cannot_resize_its_fill_arena(make_daemon, attack):
    """The attack: a publisher holding its fill arena's memfd grows it (host memory the budget never
    counts) or shrinks it (every reader's acquire fails, one mapped before dies of SIGBUS)."""
    d = make_daemon('budget = { cpu = "64MiB" }\n')
    with d.client() as c, pinging(d) as pings:
        reply, fd = reserve_fd(c, attack, 4096)
        size = reply["arena"]["size"]
        try:
            with pytest.raises(PermissionError):  # F_SEAL_GROW / F_SEAL_SHRINK
                ATTACKS[attack](fd, size)
            assert os.fstat(fd).st_size == size and allocated(fd) <= size
        finally:
            os.close(fd)
        c.request("commit", lease=reply["lease"])
        counted = host_memory(c)["used"]
        with c.acquire(reply["entry"]) as lease:
            assert lease.tensors["w"].numel() == 4096
    assert counted == size
    assert_fast(pings)


@pytest.mark.slow
def test_a_commit_of_an_arena_sealed_by_its_publisher_is_refused(make_daemon):
    """The attack: the publisher seals the memfd itself (F_SEAL_SEAL) so the daemon cannot seal it
    against writes, and keeps writing under every reader. The commit is refused, the entry dropped."""
    d = make_daemon()
    with d.client() as c, pinging(d) as pings:
        reply, fd = reserve_fd(c, "sealed-first", 4096)
        try:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL)
        finally:
            os.close(fd)
        with pytest.raises(BadRequest, match="F_SEAL_WRITE") as refused:
            c.request("commit", lease=reply["lease"])
        assert "\n" not in refused.value.message and "nothing was published" in refused.value.message
        assert [e["name"] for e in c.list()] == []
        assert c.list_leases() == []
    assert_fast(pings)
    assert "Traceback" not in d.log.read_text()



# -- 4 and 14: layouts no client can map, names no log should print ------------------------------


def manifest(shape: tuple[int, ...], name: str = "w", dtype: str = "U8") -> dict[str, Any]:
    """The same tensor as a v2 manifest at offset 0 of a 4 KiB arena, as an acquire reply carries it."""
    return {**columns([[name, dtype, shape]]), "size": 4096, "offsets": struct.pack("<Q", 0),
            "runs": struct.pack("<I", 1)}


ABSURD_SHAPES = {
    "zero-size, strides of 2**96": ((0, 1 << 48, 1 << 48), "U8"),
    "zero-size, 2**96 elements before the zero": ((1 << 48, 1 << 48, 0), "BF16"),
    "2**96 elements": ((1 << 48, 1 << 48), "U8"),
}


@pytest.mark.slow
def test_reserves_of_unaddressable_shapes_are_refused(make_daemon):
    """The attack: reserve tensors whose element counts or strides overflow int64 (the daemon
    answered `internal` with a traceback in its log; readers got TypeError or RuntimeError)."""
    d = make_daemon()
    with d.client() as c, pinging(d) as pings:
        for i, (shape, dtype) in enumerate(ABSURD_SHAPES.values()):
            key = WeightCacheKey(model=f"absurd{i}", transform="test").model_dump()
            with pytest.raises(BadRequest, match="spans more than 2\\*\\*48 elements") as e:
                c.request_fds("reserve", key=key, retention="cached", columns=columns([["w", dtype, shape]]))
            assert "\n" not in e.value.message
        two = columns([["a", "U8", (1 << 48, 1 << 48)], ["b", "U8", (1 << 48, 1 << 48)]])
        with pytest.raises(BadRequest):
            c.request_fds("reserve", key=WeightCacheKey(model="two", transform="test").model_dump(),
                          retention="cached", columns=two)
        assert c.list() == [] and c.list_leases() == []
    assert_fast(pings)
    assert "Traceback" not in d.log.read_text()


@pytest.mark.slow
def test_entry_names_with_control_characters_are_refused(make_daemon, checkpoint):
    """An admin's `load` named with an escape sequence or a newline made an entry every `list`,
    log line and client then carried (and that clients now refuse to attach)."""
    path, _ = checkpoint
    d = make_daemon()
    with d.client() as c, pinging(d) as pings:
        for name in ("m\x1b[2J", "m\nERROR forged line"):
            with pytest.raises(BadRequest, match="control characters are not allowed in entry names"):
                c.load(name, path)
        assert c.list() == []
    assert_fast(pings)


GOOD_REPLY: dict[str, Any] = {
    "lease": 1, "kind": "read", "entry": "m#0", "key": WeightCacheKey(model="m", transform="test").model_dump(),
    "origin": "publish", "publisher_uid": 0, "manifest": manifest((16,)), "ttl_s": 30.0,
    "arena": {"kind": "host", "size": 4096, "device": "cpu"},
}
CRAFTED: dict[str, dict[str, Any]] = {
    **{f"manifest: {what}": {"manifest": manifest(shape, dtype=dtype)}
       for what, (shape, dtype) in ABSURD_SHAPES.items()},
    "lease id not an int": {"lease": "1"},
    "arena size not a number": {"arena": {"kind": "host", "size": "big", "device": "cpu"}},
    "arena without a size": {"arena": {"kind": "host", "device": "cpu"}},
    "manifest not a map": {"manifest": [1, 2]},
    "entry name with an escape sequence": {"entry": "m#0\x1b[2J"},
    "tensor name with a newline": {"manifest": manifest((16,), name="w\nERROR forged line")},
}


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("case", list(CRAFTED))
def test_a_crafted_lease_reply_is_one_wcd_error(tmp_path: Path, case: str) -> None:
    """Whatever is wrong in an acquire's reply, the engine gets one `BadReply` line (never a
    TypeError, KeyError or OverflowError its fallback would not catch) and keeps no descriptor."""
    impostor = Impostor(tmp_path / "impostor.sock", GOOD_REPLY)
    try:
        with Client(tmp_path / "impostor.sock", heartbeats=False) as c:
            with c.acquire("m#0") as lease:  # the impostor's honest reply maps: what differs is the case
                assert lease.tensors["w"].numel() == 16
            before = open_fds()
            impostor.lease_reply = {**GOOD_REPLY, **CRAFTED[case]}
            with pytest.raises(BadReply) as e:
                c.acquire("m#0")
            assert "\n" not in e.value.message and open_fds() == before
    finally:
        impostor.close()


# -- 16: memory still mapped after the leases ended ---------------------------------------------


@pytest.mark.slow
def test_memory_mapped_after_release_counts_against_the_budget(make_daemon):
    """The attack: attach, keep the views, release the lease, have the entry evicted and loaded
    again: the kept mapping holds the old arena's memory, which the budget no longer counted. A
    new load past the budget is refused, with a line saying why, until the views are dropped."""
    d = make_daemon('budget = { cpu = "64MiB" }\n')
    key = WeightCacheKey(model="kept", transform="test")
    weights = {"w": torch.ones(40 * MiB, dtype=torch.uint8)}
    with d.client() as c, pinging(d) as pings:
        entry = c.publish(key, weights)
        lease = c.acquire(entry)
        kept = lease.tensors["w"]  # views outlive release(): the mapping stays
        lease.release()
        c.evict(entry)
        wait_until(lambda: memfds(d) == 0)  # the daemon closed the arena
        with pytest.raises(OutOfMemory, match="still mapping entries that are gone") as refused:
            c.publish(key, weights)
        assert "\n" not in refused.value.message
        assert host_memory(c)["mapped_after_release"] == 40 * MiB
        [gauge] = [line for line in c.metrics().splitlines()
                   if line.startswith('wcd_device_mapped_after_release_bytes{device="cpu"}')]
        assert float(gauge.split()[-1]) == 40 * MiB
        assert kept.sum().item() == 40 * MiB  # the kept views still read the old bytes
        del kept, lease
        gc.collect()
        wait_until(lambda: host_memory(c)["mapped_after_release"] == 0)
        c.publish(key, weights)
    assert_fast(pings)


def test_the_transformers_integration_passes_over_a_crafted_entry(tmp_path: Path) -> None:
    """`from_pretrained(fallback=True)` loads from disk when the entry's reply cannot be mapped: its
    lookup passes over it (one warning) instead of raising."""
    impostor = Impostor(tmp_path / "impostor.sock", {**GOOD_REPLY, **CRAFTED["manifest: 2**96 elements"]})
    try:
        with Client(tmp_path / "impostor.sock", heartbeats=False) as c:
            assert _find_entry(c, tmp_path, "fingerprint", "m#0", load=False, timeout_s=5) is None
    finally:
        impostor.close()
