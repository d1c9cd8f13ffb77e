"""Why an entry went, said where an operator looks: each `reclaimed` log line names what ended it
(LRU for which load, a lease that expired and whose, an eviction and by whom, a reload), and
`wcdctl list` shows it beside the entry of that name that was loaded again. Real daemon and CLI."""

from __future__ import annotations

import json
import os
import re
import signal
import time

from tests.integration.conftest import sparse_checkpoint
from tests.integration.test_cli import run
from tests.integration.test_daemon import model_config


def logged(d, pattern: str, timeout: float = 30.0) -> re.Match[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(pattern, d.log.read_text())
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"no {pattern!r} in the log:\n{d.log.read_text()}")


def test_lru_eviction_says_for_which_load_and_list_shows_it_on_reload(make_daemon, tmp_path):
    a = sparse_checkpoint(tmp_path / "a.safetensors", 2 << 20)
    b = sparse_checkpoint(tmp_path / "b.safetensors", 2 << 20)
    d = make_daemon('budget = { cpu = "3MiB" }\n')
    sock = str(d.socket)
    assert run("wcdctl", "--socket", sock, "load", "a", str(a), "--wait").returncode == 0
    assert run("wcdctl", "--socket", sock, "load", "b", str(b), "--wait").returncode == 0
    logged(d, r"reclaimed a \(2\.0 MiB on cpu\): least recently used, to make room for b \(2\.0 MiB\)")
    assert run("wcdctl", "--socket", sock, "load", "a", str(a), "--wait").returncode == 0
    listed = run("wcdctl", "--socket", sock, "list").stdout
    assert re.search(r"  a: loaded again; the copy before went at \S+\+00:00: least recently used, to make room "
                     r"for b \(2\.0 MiB\)", listed), listed
    [entry] = json.loads(run("wcdctl", "--socket", sock, "list", "--json").stdout)["entries"]
    assert entry["name"] == "a" and entry["previous"].endswith("to make room for b (2.0 MiB)")
    logged(d, r"reclaimed b \(2\.0 MiB on cpu\): least recently used, to make room for a \(2\.0 MiB\)")


def test_an_expired_lease_says_whose(make_daemon, tmp_path):
    e = sparse_checkpoint(tmp_path / "e.safetensors", 1 << 20)
    d = make_daemon("lease_ttl_s = 1\n")
    assert run("wcdctl", "--socket", str(d.socket), "load", "e", str(e), "--retention", "ephemeral",
               "--wait").returncode == 0
    with d.client(heartbeats=False) as c:
        c.acquire("e")  # never renewed
        logged(d, rf"reclaimed e \(1\.0 MiB on cpu\): ephemeral, and its last lease expired: no heartbeat "
                  rf"\(pid {os.getpid()}, uid {os.getuid()}\)")


def test_an_eviction_says_by_whom_when_the_entry_goes(make_daemon, tmp_path):
    d = make_daemon(model_config(sparse_checkpoint(tmp_path / "m.safetensors", 1 << 20)))
    with d.client() as c:
        lease = c.acquire("m")
        out = run("wcdctl", "--socket", str(d.socket), "evict", "m")
        assert "m: evicting" in out.stdout
        lease.release()
        logged(d, rf"reclaimed m \(1\.0 MiB on cpu\): evicted by uid {os.getuid()} \(pid \d+\), and its last lease "
                  rf"was released \(pid {os.getpid()}, uid {os.getuid()}\)")


def test_a_reload_that_drops_a_model_says_superseded(make_daemon, tmp_path):
    d = make_daemon(model_config(sparse_checkpoint(tmp_path / "m.safetensors", 1 << 20)))
    d.config.write_text(f'[daemon]\nsocket = "{d.socket}"\n')
    d.proc.send_signal(signal.SIGHUP)
    logged(d, r"reclaimed m \(1\.0 MiB on cpu\): superseded: a reload changed or removed its model")
