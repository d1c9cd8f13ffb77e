"""What an operator meets first, through the real CLIs and a real daemon: finding the socket,
one-line usage and config errors with exit 2, counts, metrics as JSON, hints that fit the cause."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import sparse_checkpoint
from tests.integration.test_cli import one_line_error, run
from tests.integration.test_daemon import model_config

NO_SOCKET = {"WCD_SOCKET": ""}  # wcdctl looks for the daemon itself


def test_wcdctl_finds_the_instance_socket(make_daemon, tmp_path):
    rundir = tmp_path / "run"
    rundir.mkdir()
    d = make_daemon(socket=rundir / "llm.sock")
    env = {**NO_SOCKET, "WCD_RUN_DIR": str(rundir)}
    for args in (["--instance", "llm"], ["-i", "llm"], ["status", "-i", "llm"], []):
        out = run("wcdctl", *args, *([] if "status" in args else ["status"]), env=env)
        assert out.returncode == 0, (args, out.stderr)
        assert f"instance wcd  pid {d.proc.pid}" in out.stdout and str(d.socket) in out.stdout
    out = run("wcdctl", "-i", "other", "status", env=env)
    assert out.returncode == 3 and f"daemon not running at {rundir / 'other.sock'}" in one_line_error(out, "wcdctl")
    make_daemon(socket=rundir / "second.sock")
    out = run("wcdctl", "status", env=env)
    line = one_line_error(out, "wcdctl")
    assert out.returncode == 2 and "2 daemons in" in line and "(llm, second)" in line and "--instance" in line
    out = run("wcdctl", "status", env={**NO_SOCKET, "WCD_RUN_DIR": str(tmp_path / "none")})
    line = one_line_error(out, "wcdctl")
    assert out.returncode == 3 and "no daemon socket in" in line and "--instance NAME" in line
    out = run("wcdctl", "--socket", str(d.socket), "-i", "llm", "status")
    assert out.returncode == 2 and "not allowed with" in one_line_error(out, "wcdctl")


def test_wcd_serve_instance_follows_wcd_run_dir(tmp_path):
    """`wcd serve --instance NAME` listens where `wcdctl -i NAME` looks, both under WCD_RUN_DIR."""
    from wcd.client import connect

    rundir = tmp_path / "run"
    cfg = tmp_path / "etc"
    cfg.mkdir()
    (cfg / "x.toml").write_text("")
    code = (f"import sys, wcd.configfile as f; f.CONFIG_DIR = __import__('pathlib').Path({str(cfg)!r}); "
            "from wcd.cli.wcd import main; sys.exit(main(['serve', '--instance', 'x']))")
    proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "WCD_RUN_DIR": str(rundir)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        connect(rundir / "x.sock", wait_s=30, while_alive=lambda: proc.poll() is None, heartbeats=False).close()
        out = run("wcdctl", "-i", "x", "ping", env={**NO_SOCKET, "WCD_RUN_DIR": str(rundir)})
        assert out.returncode == 0 and "round trip" in out.stdout, out.stderr
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


def test_wcdctl_socket_that_is_not_a_socket(tmp_path):
    cfg = tmp_path / "llm.toml"
    cfg.write_text("[daemon]\n")
    out = run("wcdctl", "--socket", str(cfg), "status")
    line = one_line_error(out, "wcdctl")
    assert out.returncode == 3 and f"{cfg} is not a socket but a regular file" in line and "NAME.sock" in line
    out = run("wcdctl", "--socket", str(tmp_path), "status")
    assert out.returncode == 3 and "is not a socket but a directory" in one_line_error(out, "wcdctl")


@pytest.mark.parametrize(("prog", "args", "expected"), [
    ("wcdctl", ["frobnicate"], "invalid choice: 'frobnicate'"),
    ("wcdctl", [], "the following arguments are required: command"),
    ("wcdctl", ["load"], "the following arguments are required: name (see wcdctl load --help)"),
    ("wcdctl", ["--bogus", "status"], "unrecognized arguments: --bogus"),
    ("wcd", ["serve"], "one of the arguments --config --instance is required (see wcd serve --help)"),
    ("wcd", ["demo", "--size-mb", "x"], "invalid int value: 'x'"),
])
def test_usage_errors_are_one_line_exit_2(prog, args, expected):
    out = run(prog, *args, env={"WCD_SOCKET": "/nonexistent"})
    assert out.returncode == 2 and out.stdout == ""
    line = one_line_error(out, prog)
    assert expected in line and "--help" in line, line


def test_counts_are_singular_for_one(make_daemon, tmp_path):
    d = make_daemon(model_config(sparse_checkpoint(tmp_path / "m.safetensors", 1 << 20)))
    out = run("wcdctl", "--socket", str(d.socket), "status")
    assert "1 entry, 0 leases, 1 connection," in out.stdout, out.stdout  # wcdctl's own
    with d.client() as c, c.acquire("m"):
        out = run("wcdctl", "--socket", str(d.socket), "status")
        assert "1 entry, 1 lease, 2 connections," in out.stdout, out.stdout
        ev = run("wcdctl", "--socket", str(d.socket), "evict", "m")
        assert "m: evicting; freed when its 1 lease end" in ev.stdout, ev.stdout


def test_metrics_json_is_samples(make_daemon, tmp_path):
    d = make_daemon(model_config(sparse_checkpoint(tmp_path / "m.safetensors", 1 << 20)))
    out = run("wcdctl", "--socket", str(d.socket), "metrics", "--json")
    assert out.returncode == 0, out.stderr
    families = {f["name"]: f for f in json.loads(out.stdout)["metrics"]}
    used = families["wcd_device_used_bytes"]
    assert used["type"] == "gauge" and used["help"]
    [sample] = used["samples"]
    assert sample["labels"] == {"device": "cpu"} and sample["value"] >= 1 << 20
    [entry] = json.loads(run("wcdctl", "--socket", str(d.socket), "list", "--json").stdout)["entries"]
    assert sample["value"] == entry["bytes"]


@pytest.mark.parametrize(("config", "expected"), [
    ('[[models]]\nname = "m"\npath = "{ckpt}"\ndevice = "gpu0"\n',
     'models.0.device: unknown device \'gpu0\': use "cpu", "cuda:N" or a GPU UUID'),
    ('[daemon]\nbudget = {{ gpu0 = "1GiB" }}\n', "daemon.budget: gpu0: unknown device 'gpu0'"),
])
def test_a_misspelt_device_is_a_config_error_exit_2(tmp_path, config, expected):
    ckpt = sparse_checkpoint(tmp_path / "m.safetensors", 1 << 20)
    cfg = tmp_path / "bad.toml"
    cfg.write_text(config.format(ckpt=ckpt))
    out = run("wcd", "serve", "--config", str(cfg))
    assert out.returncode == 2
    line = one_line_error(out, "wcd")
    assert line.startswith(f"wcd: config {cfg}: ") and expected in line, line


def test_a_budget_above_the_device_memory_is_warned(make_daemon):
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    d = make_daemon(f'budget = {{ cpu = {total * 2} }}\n')
    d.stop()
    log = d.log.read_text()
    assert "WARNING daemon.budget.cpu: budget" in log and "is more than cpu's" in log and '"90%"' in log, log
    seen = len(log)
    d = make_daemon('budget = { cpu = "50%" }\n')  # the same log file, appended to
    d.stop()
    assert "is more than" not in d.log.read_text()[seen:]


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1)")
def test_socket_on_a_read_only_file_system_says_so(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    cfg = tmp_path / "wcd.toml"
    cfg.write_text(f'[daemon]\nsocket = "{ro / "wcd.sock"}"\n')
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o ro tmpfs {ro}"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount in a user namespace here: {probe.stderr.decode().strip()}")
    out = subprocess.run(["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o ro tmpfs "$0" && exec "$@"', str(ro),
                          sys.executable, "-m", "wcd", "serve", "--config", str(cfg)],
                         capture_output=True, text=True, timeout=60)
    line = one_line_error(out, "wcd")
    assert out.returncode == 1 and "Read-only file system" in line and "writable file system" in line, line
    assert "free space" not in line


def test_demo_help_states_the_size_it_writes():
    out = run("wcd", "demo", "--help")
    assert out.returncode == 0 and "~330 MiB" in out.stdout and "$TMPDIR" in out.stdout


def test_demo_without_numpy_is_one_line():
    """The `[torch]` extra brings numpy, which safetensors.torch writes through; without it, one line."""
    code = "import sys; sys.modules['numpy'] = None\nfrom wcd.cli.wcd import main\nsys.exit(main(['demo']))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    line = one_line_error(out, "wcd demo")
    assert out.returncode == 1 and "needs numpy" in line and "[torch]" in line, line


def test_the_torch_extra_brings_numpy():
    import tomllib

    extras = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    assert any(r.startswith("numpy") for r in extras["optional-dependencies"]["torch"])
