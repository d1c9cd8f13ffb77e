"""Prometheus metrics for the `metrics` op, in the text exposition format (prometheus-client).

Gauges are read at scrape time from a read-only view of the daemon's state (`StateView`, a
custom collector), so nothing is kept twice; only request latencies and load throughput are
recorded as they happen, as plain counts here. prometheus-client (with http.server, email and
ssl under it: ~40 ms of a 2-core VM's start-up) is imported at the first scrape, or by `warm` after
READY, never before the daemon serves. Must not import the server or change the state it reads.
"""

from __future__ import annotations

import asyncio
from bisect import bisect_left
from collections import Counter
from collections.abc import Collection, Iterator
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from wcd.cache import Cache

LOAD_PHASES = ("allocating", "reading", "checking")  # `Entry.load_phase` while loading
_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.25, 1.0, 5.0, 30.0)


class StateView(Protocol):
    """What the gauges read (`wcd.state.ServerState` is one)."""

    @property
    def cache(self) -> Cache: ...

    @property
    def connections(self) -> Collection[object]: ...


class _Histogram:
    """One op's request times: a count per bucket (the last is +Inf), their sum."""

    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(_BUCKETS) + 1)
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(_BUCKETS, seconds)] += 1  # a bucket counts values <= its bound
        self.total += seconds


class Metrics:
    def __init__(self, state: StateView) -> None:
        self._state = state
        self._by_op: dict[str, _Histogram] = {}
        self._load_bytes: dict[str, float] = {}
        self._load_seconds: dict[str, float] = {}
        self._registry: Any = None
        self._first: asyncio.Future[str] | None = None  # the rendering of those who asked during the import

    def observe(self, op: object, seconds: float) -> None:
        child = self._by_op.get(op) if isinstance(op, str) else None
        if child is None:
            if not isinstance(op, str) or op not in _known_ops():
                op = "invalid"
            child = self._by_op.setdefault(op, _Histogram())
        child.observe(seconds)

    def loaded(self, device: str, nbytes: int, seconds: float) -> None:
        self._load_bytes[device] = self._load_bytes.get(device, 0) + nbytes
        self._load_seconds[device] = self._load_seconds.get(device, 0.0) + seconds

    _warmed = False  # prometheus-client imported (by `warm`)

    @classmethod
    def warm(cls) -> None:
        """Import prometheus-client now (blocking: from a thread), so that no scrape pays for it on the loop."""
        import prometheus_client  # noqa: F401
        import prometheus_client.core  # noqa: F401 - the collectors' (not imported by the package itself)

        cls._warmed = True

    @property
    def warmed(self) -> bool:
        return Metrics._warmed

    async def text(self) -> str:
        """`render`, with prometheus-client imported in a thread first if `warm` has not run yet (it
        runs 1 s after READY): on the loop, the import stalled every connection by ~30 ms on the VM,
        and any peer could make it happen by asking for metrics at once. Those who ask during the
        import share one rendering after it: 384 pipelined requests rendering each took 0.24 s."""
        if Metrics._warmed:
            return self.render()
        if self._first is None:
            self._first = asyncio.ensure_future(self._import_and_render())
        return await asyncio.shield(self._first)

    async def _import_and_render(self) -> str:
        try:
            await asyncio.to_thread(Metrics.warm)
        finally:
            self._first = None  # the next to ask renders anew (or tries the import again)
        return self.render()

    def render(self) -> str:
        from prometheus_client import CollectorRegistry, generate_latest

        if self._registry is None:
            registry = CollectorRegistry(auto_describe=False)
            registry.register(_Recorded(self))
            registry.register(_StateCollector(self._state))
            self._registry = registry
        return generate_latest(self._registry).decode()


class _Recorded:
    """What `Metrics` recorded, as metric families at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        m = self.metrics
        requests = HistogramMetricFamily("wcd_request_duration_seconds", "Request handling time by op",
                                         labels=["op"])
        bounds = [*map(str, _BUCKETS), "+Inf"]
        for op, h in m._by_op.items():
            running, buckets = 0, []
            for bound, n in zip(bounds, h.counts):
                running += n
                buckets.append((bound, running))
            requests.add_metric([op], buckets, h.total)
        yield requests
        for name, doc, values in (("wcd_load_bytes", "Bytes loaded from checkpoints", m._load_bytes),
                                  ("wcd_load_seconds", "Time spent loading checkpoints", m._load_seconds)):
            family = CounterMetricFamily(name, doc, labels=["device"])
            for device, value in values.items():
                family.add_metric([device], value)
            yield family


def _known_ops() -> tuple[str, ...]:
    from wcd.protocol import OPS

    return OPS


class _StateCollector:
    def __init__(self, state: StateView) -> None:
        self.state = state

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        cache = self.state.cache
        budget = GaugeMetricFamily("wcd_device_budget_bytes", "Configured budget per device", labels=["device"])
        used = GaugeMetricFamily("wcd_device_used_bytes", "Bytes held by wcd per device", labels=["device"])
        outside = GaugeMetricFamily("wcd_device_mapped_after_release_bytes",
                                    "Bytes of gone entries other processes still map (counted against the budget)",
                                    labels=["device"])
        for device, size in cache.budgets.items():
            budget.add_metric([device], size)
            used.add_metric([device], cache.used(device))
            outside.add_metric([device], cache.outside(device))
        states = GaugeMetricFamily("wcd_entries", "Entries by state (failed: loads that ended without one)",
                                   labels=["state"])
        for state in ("loading", "filling", "ready", "evicting"):
            states.add_metric([state], sum(1 for e in cache.entries.values() if e.state == state))
        states.add_metric(["failed"], len(cache.failures))
        leases = GaugeMetricFamily("wcd_leases", "Live leases by kind", labels=["kind"])
        for kind in ("read", "fill"):
            leases.add_metric([kind], sum(1 for lease in cache.leases.values() if lease.kind == kind))
        by_uid = GaugeMetricFamily("wcd_leases_by_uid", "Live leases by the uid holding them", labels=["uid"])
        for uid, n in sorted(Counter(lease.uid for lease in cache.leases.values()).items()):
            by_uid.add_metric([str(uid)], n)
        phases = GaugeMetricFamily("wcd_loads", "Loads in progress by phase", labels=["phase"])
        for phase in LOAD_PHASES:
            phases.add_metric([phase], sum(1 for e in cache.entries.values()
                                           if e.state in ("loading", "evicting") and e.load_phase == phase))
        rates = GaugeMetricFamily("wcd_fill_rate_bytes_per_second",
                                  "How fast each entry was filled, and from where (disk, or a fleet peer)",
                                  labels=["name", "source"])
        for e in cache.entries.values():
            if e.source:
                rates.add_metric([e.name, e.source], e.fill_rate)
        yield rates
        yield budget
        yield used
        yield outside
        yield states
        yield phases
        yield leases
        yield by_uid
        yield GaugeMetricFamily("wcd_connections", "Open client connections", value=len(self.state.connections))
        yield CounterMetricFamily("wcd_lease_expiries", "Leases ended by missed heartbeats",
                                  value=cache.stats["lease_expiries"])
        yield CounterMetricFamily("wcd_evictions", "Entries evicted", value=cache.stats["evictions"])
        yield CounterMetricFamily("wcd_load_failures", "Loads that ended without an entry",
                                  value=cache.stats["load_failures"])
