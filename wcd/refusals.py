"""Turning connections away at accept, cheaply, with a log that a flood of them cannot fill.

Owns what a refused peer gets (its one error frame, then the end of the connection: no
`Connection`, no reader, no timer) and the log of refusals: the first of a uid and reason is said
at once, the rest are counted and said once per INTERVAL_S in one line. Must not decide who is
refused: the server asks `wcd.server._allowed` and `Quotas.refusal`, then hands the socket here.
"""

from __future__ import annotations

import asyncio
import logging
import socket

from wcd import wire
from wcd.connection import discard
from wcd.errors import WcdError

log = logging.getLogger("wcd")

INTERVAL_S = 10.0


class Refusals:
    """Peers turned away at accept, and the log of it (see the module)."""

    def __init__(self, interval_s: float = INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._counts: dict[tuple[int, str], int] = {}  # (uid, what) -> refused since its last line
        self._denied: dict[int, float] = {}  # uid -> loop time until which it stays refused unasked

    def refuse(self, sock: socket.socket, uid: int, pid: int, err: WcdError, what: str) -> None:
        """Send `err` as the connection's one stream-level error frame and end it. The frame fits
        the empty send buffer of a new socket, so the send does not wait; a peer that reads it
        after the close still finds it there. The close goes off the loop, as any of a peer's."""
        try:
            sock.send(wire.encode(wire.error(None, err)), socket.MSG_DONTWAIT)
        except OSError:
            pass  # gone already, or not reading: nothing more to tell it
        discard([sock.detach()], uid)
        key = (uid, what)
        if key in self._counts:
            self._counts[key] += 1
            return
        self._counts[key] = 0
        log.warning("refused uid %d (pid %d): %s (more refusals of uid %d for %s are counted and said once "
                    "every %g s)", uid, pid, err.message, uid, what, self.interval_s)
        asyncio.get_running_loop().call_later(self.interval_s, self._say, key)

    def _say(self, key: tuple[int, str]) -> None:
        count = self._counts.pop(key, 0)
        if count:
            uid, what = key
            log.warning("refused uid %d %d more times in %g s: %s", uid, count, self.interval_s, what)
            self._counts[key] = 0
            asyncio.get_running_loop().call_later(self.interval_s, self._say, key)

    def close(self) -> None:
        """Say the refusals counted and not said yet (at shutdown: none goes unsaid)."""
        for (uid, what), count in self._counts.items():
            if count:
                log.warning("refused uid %d %d more times: %s", uid, count, what)
        self._counts.clear()

    def denied(self, uid: int) -> bool:
        """Whether `uid` was found not allowed within the interval: the decision holds that long,
        so a flood from it costs no user and group look-ups (NSS may be a network service)."""
        until = self._denied.get(uid)
        if until is None:
            return False
        if asyncio.get_running_loop().time() < until:
            return True
        del self._denied[uid]
        return False

    def deny(self, uid: int) -> None:
        self._denied[uid] = asyncio.get_running_loop().time() + self.interval_s

    def forget(self) -> None:
        """Who may connect changed (a reload): each uid is judged again at its next connection."""
        self._denied.clear()
