"""Whom integrations trust: which daemon to talk to, and whose published entries to attach.

A published entry carries its publisher's uid (DESIGN §10). Integrations attach one only if it
comes from their own uid, the daemon's (its own loads), a uid the daemon's config lists in
`trusted_publishers`, or one the caller trusts; and they talk only to a daemon served by root
(socket activation), their own uid, the packaged `wcd` user or `$WCD_SERVER_UID`. The one place
these rules live: every integration calls `accepted_publisher` and `server_uids`.
"""

from __future__ import annotations

import os
import pwd
from collections.abc import Iterable
from typing import Any

from wcd.errors import ConfigError

DAEMON_USER = "wcd"  # the packaged unit's user


def server_uids() -> frozenset[int]:
    """Who may serve the socket: root, this process's uid, the `wcd` user, and `$WCD_SERVER_UID`
    (comma-separated uids or user names)."""
    uids = {0, os.getuid()}
    try:
        uids.add(pwd.getpwnam(DAEMON_USER).pw_uid)
    except KeyError:
        pass
    for item in filter(None, (s.strip() for s in os.environ.get("WCD_SERVER_UID", "").split(","))):
        try:
            uids.add(int(item) if item.isdigit() else pwd.getpwnam(item).pw_uid)
        except KeyError:
            raise ConfigError(f"WCD_SERVER_UID: no user named {item!r}") from None
    return frozenset(uids)


def accepted_publisher(client: Any, lease: Any, trusted: Iterable[int] = ()) -> str | None:
    """Why `lease`'s entry may be attached ("the daemon (uid N)", "own uid N", "trusted publisher
    uid N"), or None: its publisher is none of those, or the daemon does not say who it is. An
    entry an admin's `load` made is judged by the uid that asked (`asked_by`): the daemon read
    what that uid pointed it at, so it is the daemon's own load only if the daemon's uid asked.
    (`client` is a `wcd.client.Client`, `lease` one of its leases: typed loosely so that
    `wcd.follower` may use this module without an import circle.)"""
    uid = lease.asked_by if lease.origin == "load" and lease.asked_by is not None else lease.publisher_uid
    if type(uid) is not int:
        return None
    own_load = lease.origin in ("config", "load")
    if uid == client.server.get("uid"):
        return f"the daemon (uid {uid}{', its own load' if own_load else ''})"
    if uid == os.getuid():
        return f"own uid {uid}{' (its load)' if own_load else ''}"
    if uid in set(client.server.get("trusted_publishers", ())) | set(trusted):
        return f"trusted {'uid' if own_load else 'publisher uid'} {uid}{' (its load)' if own_load else ''}"
    return None


def whose(lease: Any) -> str:
    """Who put `lease`'s bytes there, for a refusal: "published by uid N" or "loaded from a path
    uid N gave" (`accepted_publisher` judges that uid)."""
    if lease.origin == "load" and lease.asked_by is not None:
        return f"loaded from a path uid {lease.asked_by} gave"
    return f"published by uid {lease.publisher_uid}"


__all__ = ["DAEMON_USER", "accepted_publisher", "server_uids", "whose"]
