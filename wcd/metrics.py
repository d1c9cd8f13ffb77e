"""Prometheus metrics for the `metrics` op, in the text exposition format (prometheus-client).

Gauges are read at scrape time from a read-only view of the daemon's state (`StateView`, a
custom collector), so nothing is kept twice; only request latencies and load throughput are
recorded as they happen. Must not import the server or change the state it reads.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from wcd.cache import Cache

_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.25, 1.0, 5.0, 30.0)


class StateView(Protocol):
    """What the gauges read (`wcd.state.ServerState` is one)."""

    @property
    def cache(self) -> Cache: ...

    @property
    def connections(self) -> Collection[object]: ...


class Metrics:
    def __init__(self, state: StateView) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Histogram("wcd_request_duration_seconds", "Request handling time by op", ["op"],
                                  buckets=_BUCKETS, registry=self.registry)
        self.load_bytes = Counter("wcd_load_bytes", "Bytes loaded from checkpoints", ["device"],
                                  registry=self.registry)
        self.load_seconds = Counter("wcd_load_seconds", "Time spent loading checkpoints", ["device"],
                                    registry=self.registry)
        self.registry.register(_StateCollector(state))
        self._by_op: dict[object, Histogram] = {}

    def observe(self, op: object, seconds: float) -> None:
        child = self._by_op.get(op)
        if child is None:
            if not isinstance(op, str) or op not in _known_ops():
                op = "invalid"
            child = self._by_op.setdefault(op, self.requests.labels(op=op))
        child.observe(seconds)

    def loaded(self, device: str, nbytes: int, seconds: float) -> None:
        self.load_bytes.labels(device=device).inc(nbytes)
        self.load_seconds.labels(device=device).inc(seconds)

    def render(self) -> str:
        return generate_latest(self.registry).decode()


def _known_ops() -> tuple[str, ...]:
    from wcd.protocol import OPS

    return OPS


class _StateCollector:
    def __init__(self, state: StateView) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        cache = self.state.cache
        budget = GaugeMetricFamily("wcd_device_budget_bytes", "Configured budget per device", labels=["device"])
        used = GaugeMetricFamily("wcd_device_used_bytes", "Bytes held by wcd per device", labels=["device"])
        for device, size in cache.budgets.items():
            budget.add_metric([device], size)
            used.add_metric([device], cache.used(device))
        states = GaugeMetricFamily("wcd_entries", "Entries by state", labels=["state"])
        for state in ("loading", "filling", "ready", "evicting"):
            states.add_metric([state], sum(1 for e in cache.entries.values() if e.state == state))
        leases = GaugeMetricFamily("wcd_leases", "Live leases by kind", labels=["kind"])
        for kind in ("read", "fill"):
            leases.add_metric([kind], sum(1 for lease in cache.leases.values() if lease.kind == kind))
        yield budget
        yield used
        yield states
        yield leases
        yield GaugeMetricFamily("wcd_connections", "Open client connections", value=len(self.state.connections))
        yield CounterMetricFamily("wcd_lease_expiries", "Leases ended by missed heartbeats",
                                  value=cache.stats["lease_expiries"])
        yield CounterMetricFamily("wcd_evictions", "Entries evicted", value=cache.stats["evictions"])
