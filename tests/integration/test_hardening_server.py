"""Issue 29, the server's share: the socket path an operator gives, a second daemon, and peers
against the accept loop, the log, framing and the metrics endpoint, each against a real daemon
over a real socket.
"""

from __future__ import annotations

import fcntl
import os
import re
import select
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.integration.conftest import sparse_checkpoint
from tests.integration.peers import Raw
from tests.integration.pings import assert_fast, pinging
from wcd import wire
from wcd.client import connect
from wcd.metrics_http import MAX_CONNECTIONS

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
    assert sorted(p.name for p in tmp_path.iterdir()) == ["wcd.toml"]  # no lock file left either


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


# -- item 10: a flood of connects from a uid that is not allowed ---------------------------------------

FLOOD = r"""
import socket, sys, time
end, n = time.monotonic() + float(sys.argv[2]), 0
while time.monotonic() < end:
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(sys.argv[1])
        n += 1
    except OSError:
        pass
    s.close()
print(n)
"""


def flood(path: Path, uid: int, seconds: float) -> int:
    """Connect and hang up as `uid` as fast as one process can for `seconds`; connects made."""
    out = subprocess.run(["/usr/bin/python3", "-c", FLOOD, str(path), str(seconds)], user=uid, cwd="/",
                         capture_output=True, text=True, timeout=seconds + 60, check=True)
    return int(out.stdout)


@pytest.mark.slow
def test_a_flood_of_refused_connects_costs_the_loop_little_and_the_log_a_line(make_daemon, shared_socket):
    d = make_daemon(socket=shared_socket)  # uid 65534 is not allowed
    d.socket.chmod(0o666)
    with pinging(d) as pings:
        connects = flood(d.socket, NOBODY, 5.0)
    assert_fast(pings)
    assert d.stop() == 0
    lines = [line for line in d.log.read_text().splitlines() if f"uid {NOBODY}" in line]
    # One line when it starts, then its count (said at stop here, the interval being 10 s): none lost.
    said = sum(int(m.group(1)) if (m := re.search(r"(\d+) more times", line)) else 1 for line in lines)
    assert connects > 1000 and len(lines) <= 3 and said == connects, (connects, lines)


def test_a_refused_peer_is_still_told_why(make_daemon, shared_socket):
    d = make_daemon(socket=shared_socket)
    d.socket.chmod(0o666)
    hello = wire.encode({"op": "hello", "id": 1, "versions": [2]}).hex()
    out = subprocess.run(["/usr/bin/python3", "-c", TOLD, str(d.socket), hello], user=NOBODY, cwd="/",
                         capture_output=True, text=True, timeout=60, check=True)
    for told in out.stdout.splitlines():  # one that asked first, one that did not ask
        assert f"uid {NOBODY} is not allowed to use this daemon" in told, out.stdout


TOLD = r"""
import socket, sys, time
hello = bytes.fromhex(sys.argv[2])
for ask in (True, False):
    s = socket.socket(socket.AF_UNIX)
    s.connect(sys.argv[1])
    if ask:
        try:
            s.sendall(hello)
        except OSError:
            pass
    time.sleep(0.2)
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except OSError:
        pass
    print(data[4:].decode("utf-8", "replace").replace("\n", " "))
"""


# -- item 12: peers' strings in the log ----------------------------------------------------------------


def test_a_peer_cannot_forge_log_lines(make_daemon):
    d = make_daemon()
    forged = "ERROR forged: the daemon is compromised"
    with pinging(d, tail_s=0.2) as pings:
        a = Raw(d.socket, hello=False)
        assert a.call({"op": "hello", "versions": [2], "client": f"x\n{forged}\r\x1b[2K"})["ok"]
        a.send(b"\xff" * 64)  # a frame past the limit: its warning names the connection, client and all
        assert a.last_words() is not None
    assert_fast(pings)
    assert d.stop() == 0
    log = d.log.read_text()
    assert "x\\nERROR forged" in log and "\\x1b[2K" in log
    assert not any(line.startswith("ERROR forged") for line in log.splitlines()) and "\x1b" not in log


# -- item 13: a request trickled in ------------------------------------------------------------------


@pytest.mark.slow
def test_a_request_trickled_a_byte_a_second_is_cut_off_at_the_frame_deadline(make_daemon):
    d = make_daemon("frame_timeout_s = 2\nidle_timeout_s = 4\n")
    a = Raw(d.socket)
    frame = wire.encode({"op": "ping", "id": 2, "pad": "x" * 64})
    began = time.monotonic()
    with pinging(d, tail_s=0.2) as pings:
        for byte in frame:  # 80 s to send whole: each byte keeps the connection from looking idle
            try:
                a.send(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                break
            if select.select([a.sock], [], [], 1.0)[0] or time.monotonic() - began > 8:
                break
        closed_after = time.monotonic() - began
    assert_fast(pings)
    words = a.last_words(timeout=1)
    assert words is not None and "frame_timeout_s" in words["error"]["message"], (closed_after, words)
    assert 2 <= closed_after < 4.5, closed_after


# -- item 11: clients that trickle an HTTP request head ----------------------------------------------

TRICKLERS = r"""
import selectors, socket, sys, time
host, port, n, seconds, again = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
head = b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"y" * 4000  # never ends with an empty line
sel, sent = selectors.DefaultSelector(), {}

def connect():
    s = socket.socket()
    s.setblocking(False)
    try:
        s.connect((host, port))
    except BlockingIOError:
        pass
    sent[s] = 0
    sel.register(s, selectors.EVENT_READ)

for _ in range(n):
    connect()
print("trickling", flush=True)
end, last = time.monotonic() + seconds, 0.0
while time.monotonic() < end:
    for key, _ in sel.select(0.1):  # readable: answered (408) or closed; come back at once if `again`
        sel.unregister(key.fileobj)
        del sent[key.fileobj]
        key.fileobj.close()
        if again == "again":
            connect()
    if time.monotonic() - last > 0.5:  # a byte from each, every half second
        last = time.monotonic()
        for s in list(sent):
            try:
                s.send(head[sent[s]:sent[s] + 1])
                sent[s] += 1
            except OSError:
                pass
"""


@pytest.mark.slow
@pytest.mark.parametrize(("tricklers", "again"), [(60, "again"), (MAX_CONNECTIONS + 60, "once")])
def test_scrapes_are_answered_while_clients_trickle_their_heads(make_daemon, tricklers, again):
    """60 clients that come back as soon as they are cut off (16 held every slot before), and more
    than there are slots, the oldest of which make room for each scrape."""
    d = make_daemon('metrics_listen = "127.0.0.1:0"\n')
    url = re.search(r"metrics on (http://\S+)", d.log.read_text()).group(1)  # said before READY
    host, port = url.split("/")[2].rsplit(":", 1)
    proc = subprocess.Popen([sys.executable, "-c", TRICKLERS, host, port, str(tricklers), "60", again],
                            stdout=subprocess.PIPE, text=True)
    answered = 0
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "trickling"
        time.sleep(1.0)  # every slot they can take is taken
        with pinging(d, tail_s=0.2) as pings:
            for _ in range(20):
                try:
                    with urllib.request.urlopen(url, timeout=3) as r:
                        answered += r.status == 200 and b"wcd_" in r.read()
                except OSError:
                    pass
                time.sleep(0.2)
        assert proc.poll() is None  # still trickling throughout
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    assert_fast(pings)
    assert answered == 20
