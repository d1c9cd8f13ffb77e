"""An entry of the cache and what hangs off it, as plain data: `Entry`, the `LeaseRecord`s on it,
and the `Failure` a load that ended without an entry leaves in its place. `wcd.cache` keeps the
rules over them, `wcd.leasebook` the leases."""

from __future__ import annotations

import math
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Literal

from wcd.key import WeightCacheKey
from wcd.manifest import Manifest
from wcd.series import Series
from wcd.wire import Retention

State = Literal["loading", "filling", "ready", "previous", "evicting"]
LeaseKind = Literal["read", "fill"]
Origin = Literal["config", "load", "publish"]


@dataclass(eq=False)
class LeaseRecord:
    """The daemon's record of one lease (an engine holds its side as `wcd.client.Lease`)."""

    id: int
    entry: Entry
    kind: LeaseKind
    owner: Hashable
    pid: int
    uid: int
    expires_at: float
    queued_at: float = math.inf  # the deadline its place in the expiry heap was taken for
    held_by_daemon: bool = False  # the daemon's own hold (a verify): no heartbeats, no uid's quota


@dataclass(eq=False)
class Entry:
    name: str
    key: WeightCacheKey
    manifest: Manifest
    nbytes: int  # arena bytes charged against the device budget
    retention: Retention
    origin: Origin
    state: State
    created_at: float
    last_used: float
    leases: dict[int, LeaseRecord] = field(default_factory=dict)
    arena: Any = None  # opaque to the cache: the arena residency allocated
    life: Any = None  # opaque to the cache: residency's record of what this entry owns (`wcd.life`)
    done_bytes: int = 0  # load progress
    # While loading: "allocating" (the arena), "reading" (the checkpoint into it) or "checking" (a
    # copy kept across a restart); set by `wcd.residency`, shown in status and metrics.
    load_phase: str = ""
    reading_since: float | None = None  # time.monotonic() when the reading began: rate and time left
    evicted_why: str = ""  # evicted while leased or loading: by whom (said when it goes)
    previous: str = ""  # when and why the last entry of this name went, if one did (`note_reclaimed`)
    acquires: int = 0
    notes: list[str] = field(default_factory=list)  # shown in status, e.g. "checkpoint missing"
    source: str = ""  # where its bytes came from ("disk", "peer HOST:PORT"), and at what rate (bytes/s)
    fill_rate: float = 0.0
    publisher: int | None = None  # uid whose bytes these are: the daemon's for its loads
    # The uid whose `load` of a path made the entry (an admin's, perhaps not the daemon's): its bytes
    # are what that uid pointed the daemon at. None for configured models and publishes.
    asked_by: int | None = None
    # Re-adopted after a restart, until checked: the tensor count its record gives (status shows
    # it meanwhile; the manifest is an empty stand-in until the record's is validated).
    recorded_tensors: int | None = None
    series: Series | None = None  # the series this entry is a generation of
    generation: int = 0

    @property
    def device(self) -> str:
        return self.key.device

    @property
    def read_leases(self) -> int:
        return sum(1 for lease in self.leases.values() if lease.kind == "read")

    def describe(self, now: float | None = None) -> dict[str, Any]:
        """The entry for status/list replies. `now` is a reading of the clock `last_used` comes
        from (the cache's; monotonic by default): it becomes idle seconds and a wall-clock time."""
        idle_s = max(0.0, (time.monotonic() if now is None else now) - self.last_used)
        return {
            "name": self.name,
            "state": self.state,
            "bytes": self.nbytes,
            "device": self.device,
            "leases": len(self.leases),
            "retention": self.retention,
            "origin": self.origin,
            "publisher_uid": self.publisher,
            "asked_by": self.asked_by,
            "tensors": len(self.manifest) if self.recorded_tensors is None else self.recorded_tensors,
            "progress": self._progress(),
            "acquires": self.acquires,
            "notes": self.notes,
            "last_used": datetime.fromtimestamp(time.time() - idle_s, timezone.utc).isoformat(timespec="seconds"),
            "idle_s": round(idle_s, 3),
            "key": self.key.model_dump(),
            "previous": self.previous,
            **({"source": self.source, "fill_rate": round(self.fill_rate)} if self.source else {}),
            **({"series": self.series.name, "generation": self.generation,
                "current": self.series.current == self.generation} if self.series is not None else {}),
        }

    def _progress(self) -> dict[str, Any]:
        """Bytes done of the total; while loading, the phase, and once reading, bytes/s and seconds left."""
        done, total = self.done_bytes, self.manifest.nbytes
        progress: dict[str, Any] = {"done": done, "total": total, "phase": self.load_phase}
        if self.load_phase == "reading" and self.reading_since is not None:
            elapsed = time.monotonic() - self.reading_since
            rate = done / elapsed if elapsed > 0 else 0.0
            progress["rate"] = round(rate)
            progress["eta_s"] = round((total - done) / rate, 1) if rate > 0 else None
        return progress


@dataclass(frozen=True, slots=True)
class Failure:
    """A load that ended without an entry: what an operator sees in its place (`describe`)."""

    name: str
    reason: str  # one line
    at: float  # wall clock
    origin: Origin
    device: str
    path: str

    def describe(self) -> dict[str, Any]:
        """The same fields as `Entry.describe`, state `failed`, with `reason` and `failed_at`."""
        when = datetime.fromtimestamp(self.at, timezone.utc).isoformat(timespec="seconds")
        return {
            "name": self.name, "state": "failed", "bytes": 0, "device": self.device, "leases": 0,
            "retention": None, "origin": self.origin, "publisher_uid": None, "tensors": 0,
            "progress": {"done": 0, "total": 0}, "acquires": 0, "notes": [f"failed: {self.reason}"],
            "last_used": when, "idle_s": round(max(0.0, time.time() - self.at), 3), "key": {},
            "reason": self.reason, "failed_at": when, "path": self.path,
        }
