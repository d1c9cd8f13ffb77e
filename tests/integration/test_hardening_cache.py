"""Issue 29, the cache's half (items 5-9): each attack of an allowed peer against a real daemon over a
real socket, while a second client's ping must stay under 50 ms where the loop is what is attacked.

Peers of other uids are subprocesses that drop to that uid (`test_hardening_trust.as_user`): those
tests need root.
"""

from __future__ import annotations

import time

import pytest

from tests.integration.peers import Raw
from tests.integration.pings import assert_fast, pinging

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
