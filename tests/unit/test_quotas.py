"""`Quotas`, the limits on what peers hold, driven with fake connections: no sockets, no loop."""

from __future__ import annotations

from typing import Any

import pytest

from wcd.connection import Limits, Quotas
from wcd.errors import Busy, WcdError

MIB = 1 << 20
LIMITS = Limits(max_connections=4, max_connections_per_uid=2, max_buffer_bytes=100 * MIB,
                max_buffer_bytes_per_uid=60 * MIB, max_fds_per_connection=3, max_fds_per_uid=5, max_fds=8)


class FakeConnection:
    """What Quotas reads of a connection; `fail` frees its bytes as the real one does."""

    def __init__(self, quotas: Quotas, uid: int) -> None:
        self.quotas, self.uid = quotas, uid
        self.closed, self.failed, self.buffered, self.unread_fds = False, None, 0, 0
        quotas.join(self)  # type: ignore[arg-type]
        quotas.charge(self, 0, 1)  # type: ignore[arg-type]

    @property
    def droppable(self) -> int:
        return 0 if self.failed else self.buffered

    def hold(self, nbytes: int) -> None:
        self.buffered += nbytes
        self.quotas.charge(self, nbytes, 0)  # type: ignore[arg-type]

    def fail(self, err: WcdError, drop_output: bool = False) -> None:
        self.failed = err
        freed, self.buffered = self.buffered, 0
        self.quotas.charge(self, -freed, 0)  # type: ignore[arg-type]


def conns(quotas: Quotas, *uids: int) -> list[Any]:
    return [FakeConnection(quotas, uid) for uid in uids]


def test_connections_are_capped_in_all_and_per_uid() -> None:
    q = Quotas(LIMITS)
    conns(q, 1, 1)
    refusal = q.refusal(1)
    assert isinstance(refusal, Busy) and "max_connections_per_uid" in refusal.message
    assert q.refusal(2) is None
    conns(q, 2, 3)
    refusal = q.refusal(4)
    assert isinstance(refusal, Busy) and "max_connections" in refusal.message


def test_leaving_gives_everything_back() -> None:
    q = Quotas(LIMITS)
    (a,) = conns(q, 1)
    a.hold(10 * MIB)
    a.quotas.charge(a, -10 * MIB, -1)
    q.leave(a)
    assert q.total.connections == q.total.bytes == q.total.fds == 0 and q.usage(1).connections == 0


def test_descriptors_per_connection_per_uid_and_in_all() -> None:
    q = Quotas(LIMITS)
    a, b = conns(q, 1, 1)
    a.unread_fds = 3
    with pytest.raises(Busy, match="max_fds_per_connection"):
        q.fd_room(a)
    q.charge(a, 0, 3)  # uid 1: two sockets and three unread fds
    with pytest.raises(Busy, match="max_fds_per_uid"):
        q.fd_room(b)
    held = Quotas(LIMITS, held_elsewhere=lambda: 7)  # arenas
    (c,) = conns(held, 2)
    with pytest.raises(Busy, match="short of file descriptors.*LimitNOFILE"):
        held.fd_room(c)
    refusal = held.refusal(3)
    assert refusal is not None and refusal.details == {"limit": "max_fds"}


def test_past_a_byte_limit_the_biggest_holder_is_cut_off() -> None:
    q = Quotas(LIMITS)
    small, big, other = conns(q, 1, 1, 2)
    small.hold(10 * MIB)
    big.hold(45 * MIB)
    assert not big.failed
    small.hold(10 * MIB)  # uid 1 past 60 MiB: its biggest goes, not the one that asked
    assert "max_buffer_bytes_per_uid" in big.failed.message and not small.failed
    other.hold(55 * MIB)
    (newcomer,) = conns(q, 3)
    newcomer.hold(40 * MIB)  # 20 + 55 + 40 > 100 MiB in all: uid 2's connection holds the most
    assert "max_buffer_bytes" in other.failed.message and not newcomer.failed
    assert q.total.bytes == 60 * MIB
