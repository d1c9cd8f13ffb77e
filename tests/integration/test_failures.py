"""A load that fails is seen where an operator looks: `wcdctl status` (exit 4 for a configured
model), `list --json`, the systemd status line, metrics and the engine's error, each with its
one-line reason, until it is retried, fixed by a reload or evicted. Real daemon, real CLI."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.integration.test_cli import one_line_error, run
from tests.integration.test_daemon import model_config
from tests.integration.test_systemd_harness import FakeSystemd, config
from wcd.errors import NotFound


def truncated(path: Path) -> Path:
    """A checkpoint whose last bytes are gone, as after an interrupted copy."""
    save_file({"w": torch.randn(64, 64), "b": torch.randn(64)}, str(path))
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 100)
    return path


def wait_until(check, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError("timed out")


def entries(sock: Path) -> dict[str, dict]:
    out = run("wcdctl", "--socket", str(sock), "list", "--json")
    assert out.returncode == 0, out.stderr
    return {e["name"]: e for e in json.loads(out.stdout)["entries"]}


def test_a_configured_model_that_fails_stays_listed_until_a_reload_fixes_it(make_daemon, tmp_path):
    ckpt = truncated(tmp_path / "t.safetensors")
    d = make_daemon(model_config(ckpt, name="t"))
    t = wait_until(lambda: entries(d.socket).get("t"))
    assert t["state"] == "failed" and t["origin"] == "config" and t["bytes"] == 0
    assert t["reason"] and "\n" not in t["reason"] and t["failed_at"].endswith("+00:00")
    status = run("wcdctl", "--socket", str(d.socket), "status")
    assert status.returncode == 4, status
    row = next(line for line in status.stdout.splitlines() if line.startswith("t "))
    assert row.split()[1] == "failed" and f"  t: failed: {t['reason']}" in status.stdout
    assert f"cannot load t: {t['reason']}" in d.log.read_text()
    with d.client() as c:
        with pytest.raises(NotFound, match="'t' failed to load at .*: " + t["reason"][:20]):
            c.acquire("t")
        assert 'wcd_entries{state="failed"} 1.0' in c.metrics()
    # Fixed on disk, then SIGHUP: loaded, the failure gone, status exits 0 again.
    save_file({"w": torch.randn(64, 64)}, str(ckpt))
    d.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: entries(d.socket)["t"]["state"] == "ready")
    assert run("wcdctl", "--socket", str(d.socket), "status").returncode == 0
    with d.client() as c:
        assert 'wcd_entries{state="failed"} 0.0' in c.metrics() and "wcd_load_failures_total 1.0" in c.metrics()


def test_a_failed_wcdctl_load_is_logged_listed_and_evicted(make_daemon, tmp_path):
    bad = truncated(tmp_path / "x.safetensors")
    d = make_daemon()
    out = run("wcdctl", "--socket", str(d.socket), "load", "x", str(bad))
    line = one_line_error(out, "wcdctl")
    assert out.returncode == 1 and line.endswith("]")
    x = entries(d.socket)["x"]
    assert x["state"] == "failed" and x["origin"] == "load" and "wcdctl load by uid" in x["reason"]
    assert "cannot load x:" in d.log.read_text()
    assert run("wcdctl", "--socket", str(d.socket), "status").returncode == 0  # not a configured model
    ev = run("wcdctl", "--socket", str(d.socket), "evict", "x")
    assert ev.returncode == 0 and "x: evicted" in ev.stdout
    assert "x" not in entries(d.socket)
    save_file({"w": torch.randn(8)}, str(tmp_path / "good.safetensors"))
    out = run("wcdctl", "--socket", str(d.socket), "load", "x", str(bad))  # failed again, then retried right
    assert out.returncode == 1 and entries(d.socket)["x"]["state"] == "failed"
    out = run("wcdctl", "--socket", str(d.socket), "load", "x", str(tmp_path / "good.safetensors"), "--wait")
    assert out.returncode == 0, out.stderr
    assert entries(d.socket)["x"]["state"] == "ready"


def test_a_model_removed_from_the_config_takes_its_failure_with_it(make_daemon, tmp_path):
    d = make_daemon(model_config(truncated(tmp_path / "t.safetensors"), name="t"))
    wait_until(lambda: "t" in entries(d.socket))
    d.config.write_text(f'[daemon]\nsocket = "{d.socket}"\n')
    d.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: "t" not in entries(d.socket))
    assert run("wcdctl", "--socket", str(d.socket), "status").returncode == 0


def test_the_systemd_status_line_names_the_failure(tmp_path):
    fake = FakeSystemd(tmp_path)
    try:
        fake.start(config(tmp_path, {"t": truncated(tmp_path / "t.safetensors")}))
        line = fake.messages[fake.wait_for("READY", "1")]["STATUS"]
        assert line.startswith("serving 0 entries, 0 leases, 0 B; t failed: "), line
    finally:
        fake.close()
