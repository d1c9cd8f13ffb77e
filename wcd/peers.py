"""Who a peer is beyond its uid: its groups, from its SO_PEERCRED gid and an NSS lookup of its
user, and the gids of configured group names. One lookup each, for the socket's `allowed_groups`,
the admin check and the checkpoint owner check.
"""

from __future__ import annotations

import grp
import os
import pwd
from collections.abc import Iterable


def user_gids(uid: int) -> set[int] | None:
    """The groups of user `uid` (its primary group and supplementary ones, per NSS); None when no
    such user exists."""
    try:
        user = pwd.getpwuid(uid)
    except KeyError:
        return None
    return set(os.getgrouplist(user.pw_name, user.pw_gid))


def peer_gids(uid: int, gid: int) -> set[int]:
    """A peer's groups: its primary `gid` (from SO_PEERCRED) and its user's groups."""
    return {gid, *(user_gids(uid) or ())}


def group_gids(names: Iterable[str]) -> set[int]:
    """The gids of the groups `names` (NSS); KeyError names a group that does not exist."""
    out = set()
    for name in names:
        try:
            out.add(grp.getgrnam(name).gr_gid)
        except KeyError:
            raise KeyError(name) from None
    return out
