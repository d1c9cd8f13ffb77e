"""`Metrics` records plain counts and renders them with prometheus-client at scrape time."""

from __future__ import annotations

from wcd.cache import Cache
from wcd.config import Config
from wcd.metrics import Metrics
from wcd.state import ServerState


def _samples(text: str) -> dict[str, float]:
    """Sample name with labels -> value (no label here holds a space)."""
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines() if line[:1] not in ("", "#"))}


def test_request_times_render_as_cumulative_buckets_with_their_sum() -> None:
    state = ServerState(Config(), "test", Cache({"cpu": 1 << 30}, 30.0), {"cpu": "cpu"}, 0.0)
    metrics = Metrics(state)
    for op, seconds in (("ping", 0.0001), ("ping", 0.003), ("ping", 40.0), ("no-such-op", 0.2), (7, 0.1)):
        metrics.observe(op, seconds)
    metrics.loaded("cpu", 100, 0.5)
    metrics.loaded("cpu", 50, 0.25)
    s = _samples(metrics.render())
    ping = 'wcd_request_duration_seconds_bucket{le="%s",op="ping"}'
    assert s[ping % "0.0001"] == 1  # a bucket holds the values up to and including its bound
    assert s[ping % "0.0025"] == 1 and s[ping % "0.005"] == 2 and s[ping % "30.0"] == 2 and s[ping % "+Inf"] == 3
    assert s['wcd_request_duration_seconds_count{op="ping"}'] == 3
    assert abs(s['wcd_request_duration_seconds_sum{op="ping"}'] - 40.0031) < 1e-9
    assert s['wcd_request_duration_seconds_count{op="invalid"}'] == 2  # unknown ops and non-strings
    assert s['wcd_load_bytes_total{device="cpu"}'] == 150 and s['wcd_load_seconds_total{device="cpu"}'] == 0.75
    assert s['wcd_device_budget_bytes{device="cpu"}'] == 1 << 30  # the state's gauges are there too
    assert _samples(metrics.render())[ping % "+Inf"] == 3  # rendering twice counts nothing twice


def test_scrapes_during_the_import_wait_for_it_off_the_loop_and_share_one_rendering(monkeypatch) -> None:
    """Before `warm` has run, a scrape imports prometheus-client in a thread (not on the loop);
    every scrape that arrives meanwhile waits for that one import and gets the same rendering."""
    import asyncio
    import threading
    import time

    state = ServerState(Config(), "test", Cache({"cpu": 1 << 30}, 30.0), {"cpu": "cpu"}, 0.0)
    metrics = Metrics(state)
    imports: list[str] = []
    renders: list[str] = []
    real_warm, real_render = Metrics.warm.__func__, metrics.render  # type: ignore[attr-defined]

    def warm(cls: type[Metrics]) -> None:
        imports.append(threading.current_thread().name)
        time.sleep(0.05)
        real_warm(cls)

    def render() -> str:
        renders.append(threading.current_thread().name)
        return real_render()

    monkeypatch.setattr(Metrics, "_warmed", False)
    monkeypatch.setattr(Metrics, "warm", classmethod(warm))
    monkeypatch.setattr(metrics, "render", render)

    async def scrapes() -> list[str]:
        assert not metrics.warmed
        return await asyncio.gather(*(metrics.text() for _ in range(50)))

    texts = asyncio.run(scrapes())
    assert len(imports) == 1 and imports[0] != threading.main_thread().name
    assert len(renders) == 1 and len(set(texts)) == 1 and "wcd_device_budget_bytes" in texts[0]
    assert metrics.warmed
    asyncio.run(metrics.text())
    assert len(imports) == 1 and len(renders) == 2  # once imported, each scrape renders (at once)
