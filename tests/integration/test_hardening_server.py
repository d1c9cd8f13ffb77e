"""Issue 29, the server's share: the socket path an operator gives, a second daemon, and peers
against the accept loop, the log, framing and the metrics endpoint, each against a real daemon
over a real socket.
"""

from __future__ import annotations

import fcntl
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import sparse_checkpoint
from wcd.client import connect

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving files to another uid needs root")


def serve(config: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "wcd", "serve", "--config", str(config), *args],
                          capture_output=True, text=True, timeout=timeout)


def refused(out: subprocess.CompletedProcess[str], status: int, words: str) -> None:
    """The daemon exited with `status` and said why in one line, `words` in it."""
    lines = out.stderr.strip().splitlines()
    assert out.returncode == status and "Traceback" not in out.stderr, out.stderr
    assert len(lines) == 1 and words in lines[0], out.stderr


# -- item 2: only a stale socket is replaced ------------------------------------------------------


def test_swapped_config_and_socket_leave_the_config_alone(tmp_path):
    config = tmp_path / "wcd.toml"
    config.write_text(f'[daemon]\nsocket = "{tmp_path / "wcd.sock"}"\n')
    before = config.read_text()
    out = serve(config, "--socket", str(config))  # the swap: --socket names the config file
    refused(out, 2, f"{config} is a regular file, not a socket")
    assert config.read_text() == before


def test_a_symlink_at_the_socket_path_is_not_replaced(tmp_path):
    target = tmp_path / "kept"
    target.write_text("kept")
    link = tmp_path / "wcd.sock"
    link.symlink_to(target)
    config = tmp_path / "wcd.toml"
    config.write_text(f'[daemon]\nsocket = "{link}"\n')
    refused(serve(config), 2, f"{link} is a symlink, not a socket")
    assert link.is_symlink() and target.read_text() == "kept"


def test_a_stale_socket_is_still_replaced(make_daemon, tmp_path):
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(tmp_path / "wcd.sock"))
    stale.close()  # bound, never listening: what a crashed daemon leaves
    d = make_daemon()
    with d.client() as c:
        c.ping()
    assert d.stop() == 0
    assert not d.socket.exists() and not (tmp_path / "wcd.sock.lock").exists()


# -- item 3: a second daemon claims the socket before it admits anything ------------------------------


def test_a_second_daemon_admits_nothing_before_it_finds_the_socket_busy(make_daemon, tmp_path):
    model = sparse_checkpoint(tmp_path / "big.safetensors", 64 << 20)
    d = make_daemon(f'\n[[models]]\nname = "m"\npath = "{model}"\n')
    out = serve(d.config, "--log-level", "debug")
    refused(out, 1, "another daemon already serves")  # one line: no "admitting m", no "loading m"
    with d.client() as c:
        assert [e["name"] for e in c.list()] == ["m"]


def test_a_daemon_holding_the_lock_keeps_a_second_off_a_stale_socket(tmp_path):
    """Two daemons that both found the socket stale would each rename their own over it, and one
    would serve a socket nobody reaches: the one holding the lock file goes on, the other does not."""
    path = tmp_path / "wcd.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()
    config = tmp_path / "wcd.toml"
    config.write_text(f'[daemon]\nsocket = "{path}"\n')
    with open(tmp_path / "wcd.sock.lock", "w") as lock:  # the first daemon, between its lock and its bind
        fcntl.flock(lock, fcntl.LOCK_EX)
        refused(serve(config), 1, f"another daemon already serves {path}")
    assert path.exists()  # the stale socket was not touched: it is the first daemon's to replace


# -- item 15: a socket directory another uid controls ---------------------------------------------------


@needs_root
def test_a_socket_directory_owned_by_another_uid_is_refused(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, NOBODY, NOBODY)
    config = tmp_path / "wcd.toml"
    config.write_text(f'[daemon]\nsocket = "{theirs / "wcd.sock"}"\n')
    refused(serve(config), 2, f"{theirs} is a directory owned by uid {NOBODY}")
    assert list(theirs.iterdir()) == []


@needs_root
def test_a_socket_directory_through_another_uids_symlink_is_refused(tmp_path):
    ours = tmp_path / "ours"
    ours.mkdir()
    link = tmp_path / "link"
    link.symlink_to(ours)
    os.chown(link, NOBODY, NOBODY, follow_symlinks=False)
    config = tmp_path / "wcd.toml"
    config.write_text(f'[daemon]\nsocket = "{link / "wcd.sock"}"\n')
    refused(serve(config), 2, f"{link} is a symlink owned by uid {NOBODY}")
    assert list(ours.iterdir()) == []


def test_a_world_writable_socket_directory_must_be_sticky(tmp_path):
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    config = tmp_path / "wcd.toml"
    config.write_text(f'[daemon]\nsocket = "{open_dir / "wcd.sock"}"\n')
    refused(serve(config), 2, "writable by every user and not sticky")
    open_dir.chmod(0o1777)  # as /tmp: others cannot remove what is ours
    proc = subprocess.Popen([sys.executable, "-m", "wcd", "serve", "--config", str(config)],
                            stderr=subprocess.DEVNULL)
    try:
        connect(open_dir / "wcd.sock", wait_s=30, while_alive=lambda: proc.poll() is None, heartbeats=False).close()
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
