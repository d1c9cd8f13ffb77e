"""`Client.list_leases` follows the daemon's cursor page by page, and refuses one that does not move on."""

from __future__ import annotations

from typing import Any

import pytest

from wcd.client import Client
from wcd.errors import BadReply


def client_answering(pages: dict[int, dict[str, Any]]) -> tuple[Client, list[int]]:
    """A client whose `leases` requests are answered from `pages` (by `after`), no daemon; the cursors asked."""
    client = object.__new__(Client)
    asked: list[int] = []

    def request(op: str, **fields: Any) -> dict[str, Any]:
        assert op == "leases"
        asked.append(fields["after"])
        return pages[fields["after"]]

    client.request = request  # type: ignore[method-assign]
    return client, asked


def test_pages_are_followed_to_the_end() -> None:
    client, asked = client_answering({0: {"leases": [{"id": 1}, {"id": 4}], "next": 4},
                                      4: {"leases": [{"id": 9}], "next": None}})
    assert [lease["id"] for lease in client.list_leases()] == [1, 4, 9] and asked == [0, 4]


@pytest.mark.parametrize("cursor", [0, -1, "4", 4.5])
def test_a_cursor_that_does_not_move_on_is_a_bad_reply(cursor: Any) -> None:
    client, _ = client_answering({0: {"leases": [], "next": cursor}})
    with pytest.raises(BadReply, match="does not follow 0"):
        client.list_leases()
