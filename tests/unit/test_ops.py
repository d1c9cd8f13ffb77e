"""The dispatch table and `dispatch` itself, driven with a fake connection: no sockets, no daemon."""

from __future__ import annotations

import asyncio
import inspect
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from wcd import ops, protocol
from wcd.cache import Cache
from wcd.config import Config
from wcd.metrics import Metrics
from wcd.residency import Residency
from wcd.state import ServerState


class FakeConnection:
    def __init__(self) -> None:
        self.pid, self.uid, self.gid = 1234, 1000, 1000
        self.hello = False
        self.client = ""
        self.tasks: set[asyncio.Task[None]] = set()
        self.sent: list[tuple[dict[str, Any], list[int]]] = []

    def send(self, message: dict[str, Any], fds: Any = ()) -> None:
        self.sent.append((message, list(fds)))


def make_context() -> ops.Context:
    state = ServerState(Config(), "test", Cache({"cpu": 1 << 30}, 30.0), {"cpu": "cpu"}, 0.0)
    metrics = Metrics(state)

    def spawn(coro: Any) -> Any:
        raise AssertionError("no background work in these tests")

    return ops.Context(state, Residency(state, metrics, spawn), metrics)


def test_table_covers_every_op_of_the_protocol_with_its_schema() -> None:
    assert sorted(ops.OPS) == sorted(protocol.OPS)
    for name, spec in ops.OPS.items():
        assert spec.schema.model_fields["op"].annotation.__args__ == (name,)
        request_type = inspect.signature(spec.handler).parameters["req"].annotation
        assert request_type == f"protocol.{spec.schema.__name__}"


def test_only_ops_that_may_wait_run_as_tasks() -> None:
    slow = {name for name, spec in ops.OPS.items() if spec.slow}
    assert slow == {"acquire", "reserve", "commit", "load", "verify"}


def test_hello_comes_first_then_ops_answer() -> None:
    ctx, conn = make_context(), FakeConnection()
    ops.dispatch(ctx, conn, {"op": "ping", "id": 1})
    ops.dispatch(ctx, conn, {"op": "hello", "id": 2, "versions": [2], "client": "t"})
    ops.dispatch(ctx, conn, {"op": "ping", "id": 3})
    first, hello, ping = (message for message, _ in conn.sent)
    assert first["error"]["code"] == "bad_request" and "hello" in first["error"]["message"]
    assert hello["ok"] and hello["instance"] == "test" and hello["peer"]["uid"] == 1000
    assert ping == {"id": 3, "ok": True}
    assert conn.hello and conn.client == "t"


def test_malformed_requests_get_error_replies() -> None:
    ctx, conn = make_context(), FakeConnection()
    conn.hello = True
    ops.dispatch(ctx, conn, {"op": ["ping"], "id": 1})
    ops.dispatch(ctx, conn, {"op": {"a": 1}, "id": 2})
    ops.dispatch(ctx, conn, {"op": "explode", "id": 3})
    ops.dispatch(ctx, conn, {"op": "release", "id": 4, "lease": 99})
    codes = [message["error"]["code"] for message, _ in conn.sent]
    assert codes == ["bad_request", "bad_request", "bad_request", "lease_expired"]
    assert "wcd_request_duration_seconds_count{op=\"release\"} 1.0" in ctx.metrics.render()


def test_metrics_before_the_import_are_answered_by_a_task_and_bounded_per_connection(monkeypatch) -> None:
    """Until prometheus-client is imported, `metrics` hands back a coroutine that dispatch runs as a
    task of the connection (counted in its MAX_INFLIGHT); after, it answers at once."""
    monkeypatch.setattr(Metrics, "_warmed", False)

    async def scrape() -> None:
        ctx, conn = make_context(), FakeConnection()
        conn.hello = True
        conn.loop = asyncio.get_running_loop()  # type: ignore[attr-defined]
        for i in range(ops.MAX_INFLIGHT + 1):
            ops.dispatch(ctx, conn, {"op": "metrics", "id": i})
        assert [m["error"]["code"] for m, _ in conn.sent] == ["busy"]  # the one past MAX_INFLIGHT
        await asyncio.gather(*conn.tasks)
        texts = {m["text"] for m, _ in conn.sent[1:]}
        assert len(conn.sent) == ops.MAX_INFLIGHT + 1 and len(texts) == 1
        ops.dispatch(ctx, conn, {"op": "metrics", "id": 99})
        assert conn.sent[-1][0]["id"] == 99 and "wcd_device_budget_bytes" in conn.sent[-1][0]["text"]

    asyncio.run(scrape())
    assert Metrics._warmed


def test_the_rooms_import_neither_the_server_nor_torch() -> None:
    code = ("import sys, wcd.metrics, wcd.state, wcd.residency, wcd.ops, wcd.connection; "
            "print(sorted(m for m in sys.modules if m in ('torch', 'wcd.server')))")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
