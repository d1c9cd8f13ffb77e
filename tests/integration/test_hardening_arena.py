"""Issue 29, the arena half: what a publisher can do with the memfd it fills, and what a reader is
handed, tried against a real daemon over a real socket while a second client's ping must stay
under 50 ms.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
from typing import Any

import pytest

from tests.integration.conftest import Daemon
from tests.integration.pings import assert_fast, pinging
from wcd.client import Client
from wcd.errors import BadRequest
from wcd.key import WeightCacheKey
from wcd.manifest import TENSOR_COLUMNS, Manifest

pytestmark = pytest.mark.slow

MiB = 1 << 20
FALLOC_FL_KEEP_SIZE = 1
_libc = ctypes.CDLL(None, use_errno=True)


def reserve_fd(c: Client, model: str, nbytes: int) -> tuple[dict[str, Any], int]:
    """A fill lease on a `nbytes` arena, and the arena's fd itself (as a hostile publisher keeps it)."""
    columns = Manifest.build([("w", "U8", [nbytes])]).to_wire(2)
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


def used(d: Daemon) -> int:
    with Client(d.socket) as c:
        [cpu] = [dev for dev in c.status()["devices"] if dev["device"] == "cpu"]
        return int(cpu["used"])


ATTACKS = {
    "grow": lambda fd, size: (os.ftruncate(fd, size + 512 * MiB), os.posix_fallocate(fd, 0, size + 512 * MiB)),
    "allocate-past-end": lambda fd, size: fallocate_keep_size(fd, size, 512 * MiB),
    "shrink": lambda fd, size: os.ftruncate(fd, 0),
}


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
        counted = used(d)
        with c.acquire(reply["entry"]) as lease:
            assert lease.tensors["w"].numel() == 4096
    assert counted == size
    assert_fast(pings)


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

