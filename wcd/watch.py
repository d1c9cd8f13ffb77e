"""Who is told when a generation of a series becomes current: connections that sent `watch`.

An announcement is one event frame per watching connection (`{"event": "generation", ...}`, no
request id), queued with `Connection.send` like a reply: a watcher that stops reading is bounded
and closed by its connection's output limits, never waited for. Watches end with `watch(stop)`
or when their connection goes.
"""

from __future__ import annotations

from typing import Any, Protocol

from wcd.errors import Busy


class Sink(Protocol):
    def send(self, message: dict[str, Any]) -> None: ...


class Watchers:
    def __init__(self) -> None:
        self._by_series: dict[str, dict[Sink, None]] = {}  # insertion-ordered sets
        self._of: dict[Sink, set[str]] = {}

    def add(self, conn: Sink, series: str, limit: int) -> None:
        watched = self._of.setdefault(conn, set())
        if series not in watched and len(watched) >= limit:
            raise Busy(f"this connection watches {len(watched)} series, its max_watches_per_connection: "
                       "stop watching one first", {"limit": "max_watches_per_connection"})
        watched.add(series)
        self._by_series.setdefault(series, {})[conn] = None

    def remove(self, conn: Sink, series: str) -> None:
        watched = self._of.get(conn)
        if watched is None or series not in watched:
            return
        watched.discard(series)
        if not watched:
            del self._of[conn]
        conns = self._by_series[series]
        del conns[conn]
        if not conns:
            del self._by_series[series]

    def drop(self, conn: Sink) -> None:
        """The connection went away."""
        for series in list(self._of.get(conn, ())):
            self.remove(conn, series)

    def count(self, series: str) -> int:
        return len(self._by_series.get(series, ()))

    def announce(self, series: str, event: dict[str, Any]) -> int:
        """Send `event` to every watcher of `series`; how many were told."""
        conns = list(self._by_series.get(series, ()))
        for conn in conns:
            conn.send({"event": "generation", "series": series, **event})
        return len(conns)
