"""`ServerState`: what the daemon's rooms share while it runs.

The server creates it at start-up and alone replaces its config (on reload); residency, ops and
metrics read it. Plain data: it must not hold logic or do I/O, and must not import the server.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from wcd.cache import Cache
from wcd.config import Config
from wcd.watch import Watchers

if TYPE_CHECKING:
    from wcd.connection import Connection


@dataclass(eq=False)
class ServerState:
    config: Config
    instance: str
    cache: Cache
    devices: dict[str, str]  # configured device name ("cuda:0") -> canonical id (GPU UUID)
    started_at: float  # wall clock, for uptime
    where: str = ""  # the socket we serve, for status: a path or "socket-activated fd N"
    connections: set[Connection] = field(default_factory=set)
    watchers: Watchers = field(default_factory=Watchers)  # connections told when a series' generation changes
