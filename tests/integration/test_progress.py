"""A load's progress as an operator watches it: the phase, bytes, rate and time left in `wcdctl
status` and the systemd status line, a log line every ~10 s, a tqdm bar for `wcdctl load --wait` on
a terminal (checked on a pseudo-terminal) and nothing extra on a pipe, and what Ctrl-C says."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.integration.test_cli import BIN, one_line_error, run

# Loaded by the daemon under test (through PYTHONPATH): a fill reports the bytes of each copy op
# 64 KiB at a time at WCD_TEST_BYTES_PER_S, and ends when all are reported, so that a small load
# lasts (and progresses) as a large one would.
SLOW_SITE = """
import os, time
from wcd import loader

_fill_arena = loader.fill_arena
_rate = float(os.environ["WCD_TEST_BYTES_PER_S"])

class _Slow:
    def __init__(self, progress):
        self.progress = progress

    def add(self, n):
        while n > 0:
            piece = min(n, 65536)
            time.sleep(piece / _rate)
            self.progress.add(piece)
            n -= piece

def _slow(arena, checkpoint, plan, progress, *args, **kwargs):
    return _fill_arena(arena, checkpoint, plan, _Slow(progress), *args, **kwargs)

loader.fill_arena = _slow
"""


def write_checkpoint(path: Path, tensors: int) -> Path:
    save_file({f"t{i}": torch.randn(256, 256) for i in range(tensors)}, str(path))
    return path


def on_a_pty(args: list[str], until: float = 120, interrupt_after: str | None = None) -> tuple[int, str]:
    """Run `args` with stdout and stderr on a pseudo-terminal; (exit status, all it wrote). With
    `interrupt_after`, Ctrl-C (SIGINT) is sent once that text has been written."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: its stdin, stdout and stderr are the terminal
        os.execv(args[0], args)
    out, deadline, sent = b"", time.monotonic() + until, False
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
        if interrupt_after and not sent and interrupt_after in out.decode(errors="replace"):
            os.kill(pid, signal.SIGINT)
            sent = True
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    return os.waitstatus_to_exitcode(status), out.decode(errors="replace")


def test_load_wait_draws_a_bar_on_a_terminal_only(make_daemon, tmp_path):
    ckpt = write_checkpoint(tmp_path / "m.safetensors", 8)
    d = make_daemon()
    code, out = on_a_pty([str(BIN / "wcdctl"), "--socket", str(d.socket), "load", "m", str(ckpt), "--wait"])
    assert code == 0, out
    assert re.search(r"m: \w+: +100%\|[^|]*\| 2\.00M/2\.00M \[", out), out  # tqdm's bar, in bytes
    assert "m: ready (2.0 MiB, 8 tensors on cpu)" in out
    piped = run("wcdctl", "--socket", str(d.socket), "load", "n", str(ckpt), "--wait")
    assert piped.returncode == 0 and piped.stderr == "" and piped.stdout == "n: ready (2.0 MiB, 8 tensors on cpu)\n"
    code, out = on_a_pty([str(BIN / "wcdctl"), "--socket", str(d.socket), "--json", "load", "o", str(ckpt), "--wait"])
    assert code == 0 and "%|" not in out and json.loads(out)["entry"]["state"] == "ready", out


@pytest.mark.slow
def test_a_long_load_shows_phase_rate_and_time_left(make_daemon, tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_SITE)
    monkeypatch.setenv("PYTHONPATH", f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("WCD_TEST_BYTES_PER_S", str(512 << 10))
    ckpt = write_checkpoint(tmp_path / "m.safetensors", 32)  # 8 MiB at 512 KiB/s with one reader: ~16 s
    d = make_daemon("load_workers = 1\n")
    started = time.monotonic()
    code, out = on_a_pty([str(BIN / "wcdctl"), "--socket", str(d.socket), "load", "m", str(ckpt), "--wait"],
                         interrupt_after="m: reading:")
    assert code == 130, out
    assert "wcdctl: interrupted: the load of m goes on in the daemon (wcdctl status shows it; " \
           "wcdctl evict m stops it)" in out
    status = run("wcdctl", "--socket", str(d.socket), "status")
    row = next(line for line in status.stdout.splitlines() if line.startswith("m "))
    # "loading reading 12% 1.0/8.0 MiB, 512.0 KiB/s, 14s left"
    assert re.search(r"loading reading \d+% [\d.]+/8\.0 MiB, [\d.]+ [KM]iB/s, \d+s left", row), row
    [entry] = json.loads(run("wcdctl", "--socket", str(d.socket), "--json", "list").stdout)["entries"]
    progress = entry["progress"]
    assert progress["phase"] == "reading" and progress["rate"] > 0 and progress["eta_s"] > 0, progress
    log_line = re.compile(r"INFO loading m: reading \d+% [\d.]+/8\.0 MiB, .*/s, \d+s left \(1\ds elapsed\)")
    while not log_line.search(d.log.read_text()):
        assert time.monotonic() - started < 60, d.log.read_text()
        time.sleep(0.2)
    with d.client() as c:
        while c.list()[0]["state"] != "ready":
            time.sleep(0.2)
    assert time.monotonic() - started > 10


def test_ctrl_c_while_connecting_says_interrupted(tmp_path):
    """Ctrl-C outside `load --wait` stays the plain one line."""
    listener = tmp_path / "hang.sock"
    import socket

    s = socket.socket(socket.AF_UNIX)
    s.bind(str(listener))
    s.listen(1)  # accepts, never answers: the hello waits
    try:
        proc = subprocess.Popen([str(BIN / "wcdctl"), "--socket", str(listener), "status"], stderr=subprocess.PIPE,
                                text=True)
        time.sleep(1.5)
        proc.send_signal(signal.SIGINT)
        err = proc.communicate(timeout=30)[1]
        assert proc.returncode == 130
        assert one_line_error(subprocess.CompletedProcess([], 130, "", err), "wcdctl") == "wcdctl: interrupted"
    finally:
        s.close()
