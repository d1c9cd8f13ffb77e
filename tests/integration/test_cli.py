"""The CLIs as a user runs them: exit codes, one-line errors, tables and JSON."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from tests.integration.conftest import sparse_checkpoint
from tests.integration.test_daemon import model_config
from wcd import __version__

BIN = Path(sys.executable).parent


def run(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / args[0]), *args[1:]], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def one_line_error(out: subprocess.CompletedProcess[str], prog: str) -> str:
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: "), out.stderr
    assert "Traceback" not in out.stderr
    return lines[0]


def test_wcdctl_against_a_running_daemon(make_daemon, checkpoint):
    path, tensors = checkpoint
    d = make_daemon(model_config(path))
    sock = str(d.socket)
    with d.client() as c:
        lease = c.acquire("m")
        st = run("wcdctl", "--socket", sock, "status")
        assert st.returncode == 0, st.stderr
        assert "instance wcd" in st.stdout and "host memory" in st.stdout and "m  " in st.stdout
        doc = json.loads(run("wcdctl", "--socket", sock, "--json", "status").stdout)
        [entry] = doc["entries"]
        assert {k: entry[k] for k in ("name", "state", "device", "leases")} == {
            "name": "m", "state": "ready", "device": "cpu", "leases": 1}
        assert entry["bytes"] >= sum(t.numel() * t.element_size() for t in tensors.values())
        assert doc["devices"][0]["used"] == entry["bytes"]
        listed = json.loads(run("wcdctl", "--json", "list", env={"WCD_SOCKET": sock}).stdout)
        assert [e["name"] for e in listed["entries"]] == ["m"]
        leases = json.loads(run("wcdctl", "--socket", sock, "--json", "leases").stdout)["leases"]
        assert [x["id"] for x in leases] == [lease.id] and leases[0]["pid"] == os.getpid()
        assert "µs round trip" in run("wcdctl", "--socket", sock, "ping").stdout
        assert "wcd_device_used_bytes" in run("wcdctl", "--socket", sock, "metrics").stdout
        v = run("wcdctl", "--socket", sock, "verify", "m")
        assert v.returncode == 0 and ": OK" in v.stdout
        ev = run("wcdctl", "--socket", sock, "evict", "m")
        assert ev.returncode == 0 and "freed when its 1 lease end" in ev.stdout
        lease.release()
        assert "no entries" in run("wcdctl", "--socket", sock, "list").stdout
        ld = run("wcdctl", "--socket", sock, "load", "m", "--wait")
        assert ld.returncode == 0 and "m: ready" in ld.stdout
        ld2 = run("wcdctl", "--socket", sock, "--json", "load", "again", str(path), "--wait")
        assert json.loads(ld2.stdout)["entry"]["state"] == "ready"


def test_wcdctl_errors_are_one_line_with_exit_codes(make_daemon, tmp_path):
    missing = str(tmp_path / "nothing.sock")
    out = run("wcdctl", "--socket", missing, "status")
    assert out.returncode == 3
    assert "daemon not running at" in one_line_error(out, "wcdctl")
    out = run("wcdctl", "status", env={"WCD_SOCKET": "", "WCD_RUN_DIR": str(tmp_path)})
    assert out.returncode == 3 and "WCD_SOCKET" in one_line_error(out, "wcdctl")
    assert run("wcdctl", "--socket", missing, "frobnicate").returncode == 2
    d = make_daemon()
    out = run("wcdctl", "--socket", str(d.socket), "evict", "ghost")
    assert out.returncode == 1 and "no entry named 'ghost'" in one_line_error(out, "wcdctl")
    out = run("wcdctl", "--socket", str(d.socket), "load", "ghost")
    assert out.returncode == 1 and "no configured model named 'ghost'" in one_line_error(out, "wcdctl")
    out = run("wcdctl", "--socket", str(d.socket), "load", "bad", str(tmp_path / "missing.safetensors"))
    assert out.returncode == 1 and "no such file or directory" in one_line_error(out, "wcdctl")


@pytest.mark.parametrize(("config", "expected"), [
    ("[daemon]\nlease_ttl_s = 'soon'\n", "daemon.lease_ttl_s: Input should be a valid number"),
    ("[daemon]\nsockett = '/x'\n", "daemon.sockett: unknown key"),
    ("[[models]]\nname = 'm'\npath = '/no/such/model'\n", "models.0.path: /no/such/model does not exist"),
    ("[daemon]\nbudget = { cpu = 'lots' }\n", "daemon.budget: cpu: cannot read size 'lots'"),
    ("[daemon\n", "not valid TOML"),
])
def test_wcd_serve_bad_config_is_one_line_exit_2(tmp_path, config, expected):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(config)
    out = run("wcd", "serve", "--config", str(cfg))
    assert out.returncode == 2
    assert expected in one_line_error(out, "wcd")


def test_wcd_serve_missing_config(tmp_path):
    out = run("wcd", "serve", "--config", str(tmp_path / "nope.toml"))
    assert out.returncode == 2 and "file not found" in one_line_error(out, "wcd")


def test_wcd_serve_serves_with_the_collector_on_and_start_up_frozen(tmp_path):
    """Start-up runs with the cyclic GC paused; what it built is frozen before the daemon serves,
    and the collector is on again by then. No pydantic plugins: the daemon runs none."""
    cfg = tmp_path / "wcd.toml"
    cfg.write_text(f'[daemon]\nsocket = "{tmp_path / "wcd.sock"}"\n')
    code = f"""if True:
        import gc, os, sys, wcd.server
        wcd.server.run = lambda *args: print(gc.isenabled(), gc.get_freeze_count() > 0,
                                             os.environ.get("PYDANTIC_DISABLE_PLUGINS")) or 0
        from wcd.cli.wcd import main
        sys.exit(main(["serve", "--config", {str(cfg)!r}]))
    """
    env = {k: v for k, v in os.environ.items() if k != "PYDANTIC_DISABLE_PLUGINS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True, env=env)
    assert out.stdout.split() == ["True", "True", "__all__"]


def test_wcd_serve_serves_with_stderr_closed(tmp_path):
    """No stderr at all (`2>&-`): nowhere to log, still a daemon."""
    from wcd.client import Client, connect

    sock = tmp_path / "wcd.sock"
    cfg = tmp_path / "wcd.toml"
    cfg.write_text(f'[daemon]\nsocket = "{sock}"\n')
    proc = subprocess.Popen([sys.executable, "-m", "wcd", "serve", "--config", str(cfg)], stdout=subprocess.DEVNULL,
                            preexec_fn=lambda: os.close(2))
    try:
        connect(sock, wait_s=30, while_alive=lambda: proc.poll() is None, heartbeats=False).close()
        with Client(sock) as c:
            c.ping()
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


@pytest.mark.slow
def test_wcd_demo_runs_and_proves_bit_identical():
    out = run("wcd", "demo", timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "bit-identical: yes, all 300 tensors" in out.stdout
    assert "engine start attached from wcd" in out.stdout


def test_version() -> None:
    for prog in ("wcd", "wcdctl"):
        out = run(prog, "--version")
        assert out.returncode == 0 and out.stdout == f"{prog} {__version__}\n", out


def test_global_options_before_and_after_the_subcommand(make_daemon, tmp_path):
    d = make_daemon(model_config(sparse_checkpoint(tmp_path / "m.safetensors", 25 << 20)))
    sock = str(d.socket)
    env = {"WCD_SOCKET": str(tmp_path / "elsewhere.sock")}  # --socket wins, wherever it is
    for args in (["--json", "--socket", sock, "list"], ["list", "--json", "--socket", sock],
                 ["--socket", sock, "list", "--json"], ["--json", "list", "--socket", sock]):
        out = run("wcdctl", *args, env=env)
        assert out.returncode == 0, (args, out.stderr)
        [entry] = json.loads(out.stdout)["entries"]
        assert entry["name"] == "m"
    assert json.loads(run("wcdctl", "status", "--json", "--socket", sock).stdout)["entries"][0]["name"] == "m"
    ld = run("wcdctl", "load", "again", str(tmp_path / "m.safetensors"), "--wait", "--socket", sock, "--json")
    assert ld.returncode == 0 and json.loads(ld.stdout)["entry"]["state"] == "ready", ld.stderr
    assert run("wcdctl", "evict", "again", "--socket", sock).returncode == 0


def test_last_used_is_wall_clock_time_and_idle_seconds(make_daemon, checkpoint):
    path, _ = checkpoint
    d = make_daemon(model_config(path))
    with d.client() as c, c.acquire("m"):
        used = datetime.now(timezone.utc)
    time.sleep(1.1)
    [entry] = json.loads(run("wcdctl", "--socket", str(d.socket), "list", "--json").stdout)["entries"]
    last_used = datetime.fromisoformat(entry["last_used"])
    assert last_used.tzinfo is not None and abs((last_used - used).total_seconds()) < 2
    assert 1.0 <= entry["idle_s"] < 30
    table = run("wcdctl", "--socket", str(d.socket), "list").stdout.splitlines()
    assert table[0].split()[-1] == "IDLE" and table[1].split()[-1].endswith("s")


def test_sizes_use_units_that_fit(make_daemon, tmp_path):
    d = make_daemon(model_config(sparse_checkpoint(tmp_path / "m.safetensors", 25 << 20)))
    listed = run("wcdctl", "--socket", str(d.socket), "list").stdout
    assert "25.0 MiB" in listed, listed
    status = run("wcdctl", "--socket", str(d.socket), "status").stdout
    assert "25.0 MiB" in status and " GB" not in status, status


@pytest.mark.parametrize("command", [["status"], ["list"], ["metrics"], ["list", "--json"]])
def test_a_closed_stdout_pipe_is_a_quiet_exit(make_daemon, checkpoint, command):
    path, _ = checkpoint
    d = make_daemon(model_config(path))
    read, write = os.pipe()
    os.close(read)  # the reader is gone before wcdctl writes a byte: every write fails (EPIPE)
    try:
        out = subprocess.run([str(BIN / "wcdctl"), "--socket", str(d.socket), *command], stdout=write,
                             stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write)
    assert out.returncode == 0 and out.stderr == ""
    # As users type it: a shell pipeline whose reader stops early, status and stderr of wcdctl kept.
    for reader in ("head -1", "true"):
        sh = subprocess.run(["bash", "-c", f'"$0" --socket "$1" {" ".join(command)} 2>"$2" | {reader}; '
                             'exit "${PIPESTATUS[0]}"', str(BIN / "wcdctl"), str(d.socket), str(d.root / "err")],
                            capture_output=True, text=True, timeout=60)
        assert sh.returncode == 0 and (d.root / "err").read_text() == "", (reader, sh)


needs_no_cuda = pytest.mark.skipif(importlib.util.find_spec("cuda") is not None,
                                   reason="cuda-bindings is installed here")


@needs_no_cuda
def test_gpu_model_without_cuda_bindings_is_one_line(tmp_path, checkpoint):
    path, _ = checkpoint
    cfg = tmp_path / "gpu.toml"
    cfg.write_text(f'[daemon]\nsocket = "{tmp_path / "g.sock"}"\n{model_config(path)}device = "cuda:0"\n')
    out = run("wcd", "serve", "--config", str(cfg))
    assert out.returncode == 1
    line = one_line_error(out, "wcd")
    assert "'cuda:0' needs cuda-bindings" in line and "wcd-cuda package" in line and "pip install" in line


@needs_no_cuda
def test_wcdctl_load_on_a_gpu_without_cuda_bindings_is_device_unavailable(make_daemon, checkpoint):
    path, _ = checkpoint
    d = make_daemon()
    out = run("wcdctl", "--socket", str(d.socket), "load", "g", str(path), "--device", "cuda:0")
    assert out.returncode == 1
    line = one_line_error(out, "wcdctl")
    assert "wcd-cuda package" in line and line.endswith("[device_unavailable]") and "internal" not in line
