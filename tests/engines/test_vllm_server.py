"""The command users type: vLLM's OpenAI server with `--load-format wcd`, against a real daemon, over HTTP.

First start: disk + publish; restart: attach (lease held by the worker process, no disk read), same
answer. The server runs as in production (API server, EngineCore and worker processes).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs the engines venv: tests/engines/setup-venv.sh (make test-engines)")

from tests.engines.conftest import TIMINGS, ApiServer  # noqa: E402

PROMPT = "The capital of France is"


def wcdctl_leases(socket: Path) -> list[dict[str, Any]]:
    """`wcdctl --socket S --json leases`, as an operator would look."""
    out = subprocess.run([str(Path(sys.executable).parent / "wcdctl"), "--socket", str(socket), "--json", "leases"],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)["leases"]  # type: ignore[no-any-return]


def ancestors(pid: int) -> list[int]:
    chain = []
    while pid > 1:
        status = Path(f"/proc/{pid}/status").read_text()
        pid = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
        chain.append(pid)
    return chain


def test_openai_server_restart_attaches_and_answers_the_same(make_daemon, engine_root, smollm2):
    d = make_daemon()
    args = ["--load-format", "wcd", "--model-loader-extra-config", json.dumps({"socket": str(d.socket)})]
    with ApiServer(smollm2, engine_root, args, engine_root / "server-1.log") as first:
        text = first.complete(PROMPT)
        assert text.startswith(" Paris"), text
        log = first.log()
    assert "wcd: loaded weights from disk" in log and "published processed weights as entry" in log, log[-3000:]
    [entry] = d.entries()
    assert entry["origin"] == "publish" and entry["key"]["shard"]["tp_size"] == 1

    with ApiServer(smollm2, engine_root, args, engine_root / "server-2.log") as second:
        leases = wcdctl_leases(d.socket)
        assert [(x["entry"], x["kind"]) for x in leases] == [(entry["name"], "read")], leases
        assert second.proc.pid in ancestors(leases[0]["pid"])  # the server's worker process holds it
        assert second.complete(PROMPT) == text
        log = second.log()
    assert "wcd: attached processed weights from entry " + entry["name"] in log and "no disk read" in log
    assert "wcd: loaded weights from" not in log
    assert [e["name"] for e in d.entries()] == [entry["name"]]
    deadline = time.monotonic() + 15
    while wcdctl_leases(d.socket):  # the server is gone: its worker's lease ended with it
        assert time.monotonic() < deadline, "the server's lease outlived it"
        time.sleep(0.2)
    for label, server in (("server wcd disk+publish", first), ("server wcd attach", second)):
        TIMINGS.append({"model": "smollm2-135m", "label": label, "import_s": 0.0, "ready_s": server.ready_s,
                        "load_model_s": 0.0})
