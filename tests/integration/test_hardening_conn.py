"""Issue 11, the connection half: a hostile allowed peer against a real daemon over a real socket.

Each test reproduces one attack, scaled down to seconds, while a second client (its own process,
so the attacker's threads cannot delay it) pings the daemon; the ping must stay fast. Attacks are
written against the raw protocol (`Raw`), as an attacker would, not through `wcd.client`.

What counts is the time a ping waited on the daemon's loop: on a shared 2-core machine other
people's load keeps either process off a CPU for 100 ms and more, which is not what these tests
measure, so the time both spent runnable but not running (`/proc/.../schedstat`) is taken off,
and so is what the hypervisor took from every vCPU at once (`pings`). A loop that is busy or
blocked (as in a close() waiting out a linger, or a write to a journal that stopped reading)
still counts in full.
"""

from __future__ import annotations

import fcntl
import os
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from contextlib import ExitStack, closing
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import Daemon
from tests.integration.peers import Raw, columns
from tests.integration.pings import assert_fast, pinging
from wcd import wire
from wcd.client import Client, connect
from wcd.errors import Busy

REPO = Path(__file__).resolve().parents[2]
NOBODY = 65534


def model_config(path: Path) -> str:
    return f'\n[[models]]\nname = "m"\npath = "{path}"\n'




def open_fds(d: Daemon) -> int:
    assert d.proc is not None
    return len(os.listdir(f"/proc/{d.proc.pid}/fd"))


def rss(d: Daemon) -> int:
    assert d.proc is not None
    for line in Path(f"/proc/{d.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def settle(check: Any, timeout: float = 10.0) -> Any:
    """Poll `check()` until it returns something true."""
    deadline = time.monotonic() + timeout
    while not (result := check()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return result


# -- item 1: descriptors passed to the daemon ----------------------------------------------------------


def lingering_socket(linger_s: int) -> tuple[socket.socket, socket.socket]:
    """A TCP socket with unsent data and SO_LINGER: closing its last reference blocks for the linger."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    server.bind(("127.0.0.1", 0))
    server.listen(1)  # never accepted, never read: what is sent stays queued
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    s.connect(server.getsockname())
    s.setblocking(False)
    try:
        while True:
            s.send(b"x" * 65536)
    except BlockingIOError:
        pass
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, linger_s))
    return s, server


def test_passed_sockets_with_linger_do_not_stall_the_loop(make_daemon, checkpoint):
    d = make_daemon(model_config(checkpoint[0]))
    base = open_fds(d)
    with ExitStack() as cleanup, pinging(d) as pings:
        attackers = []
        for _ in range(2):
            a = cleanup.enter_context(closing(Raw(d.socket)))
            s, server = lingering_socket(3)
            cleanup.enter_context(server)
            frame = wire.encode({"op": "ping", "id": 7}, 1)
            # The fd travels with the frame's first byte and the attacker drops its own copy at
            # once, before the daemon can have received it (let alone closed it): the daemon's is
            # the last reference, and closing it waits out the linger unless SO_LINGER is undone.
            a.send(frame[:1], [s.fileno()])
            s.close()
            time.sleep(0.2)
            try:
                a.send(frame[1:])
            except (BrokenPipeError, ConnectionResetError):
                pass  # already cut off
            attackers.append(a)
        words = [a.last_words() for a in attackers]
    assert_fast(pings)
    assert all(w is not None and w["error"]["code"] == "protocol_error" for w in words), words
    assert all("no file descriptors" in w["error"]["message"] for w in words if w is not None)
    assert settle(lambda: open_fds(d) <= base + 2, 15), "the passed fds are still open"


def test_unannounced_fds_are_closed_at_once(make_daemon, checkpoint):
    d = make_daemon(model_config(checkpoint[0]))
    base = open_fds(d)
    attackers = []
    with pinging(d) as pings:
        for _ in range(20):
            a = Raw(d.socket)
            # 4 x 15 fds, each with one byte of a frame header: no frame claims them yet.
            for byte in b"\0\x10\0\0":
                pipes = [os.pipe() for _ in range(8)]
                fds = [fd for pair in pipes for fd in pair][:15]
                try:
                    a.send(bytes([byte]), fds)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # already cut off
                for pair in pipes:
                    os.close(pair[0])
                    os.close(pair[1])
            attackers.append(a)
        assert settle(lambda: open_fds(d) <= base + 2, 10), (
            f"{open_fds(d) - base} fds more than before the attack")
    assert_fast(pings)
    for a in attackers:
        words = a.last_words()
        assert words is not None and words["error"]["code"] == "protocol_error"
        a.close()


# -- item 2: pipelined near-miss evicts against many entries -------------------------------------------


def publish_many(d: Daemon, n: int, model: str = "p") -> None:
    """n tiny published entries of one model (transform t0 .. t{n-1}), pipelined 32 at a time."""
    a = Raw(d.socket)
    for start in range(0, n, 32):
        batch = range(start, min(start + 32, n))
        a.send(b"".join(a.frame({"op": "reserve", "key": {"model": model, "transform": f"t{i}"},
                                 "columns": columns([["w", "U8", [8]]]), "retention": "pinned"}) for i in batch))
        leases = []
        for _ in batch:
            reply = a.recv()
            assert reply["ok"], reply
            leases.append(reply["lease"])
        a.send(b"".join(a.frame({"op": "commit", "lease": lease}) for lease in leases))
        for _ in batch:
            reply = a.recv()
            assert reply["ok"], reply
    a.close()


def test_pipelined_near_miss_evicts_do_not_stall_the_loop(make_daemon):
    d = make_daemon("max_entries_per_uid = 1000\n")  # one uid publishes them all
    publish_many(d, 1000)
    a = Raw(d.socket)
    n = 4000
    near_miss = b"".join(a.frame({"op": "evict", "key": {"model": "p", "transform": "nope"}}) for _ in range(n))
    with pinging(d) as pings:
        sender = threading.Thread(target=a.send, args=(near_miss,))
        sender.start()
        codes = {a.recv()["error"]["code"] for _ in range(n)}
        sender.join()
    assert codes == {"key_mismatch"}
    assert_fast(pings)


def cpu_seconds(d: Daemon) -> float:
    assert d.proc is not None
    fields = Path(f"/proc/{d.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_a_frame_left_unfinished_after_a_full_batch_does_not_spin_the_loop(make_daemon):
    """100 pings (more than one batch) and the first bytes of another, then nothing: the batch
    limit stops the first pass, the second ends on the unfinished frame. The daemon had served it
    again and again, never reading the rest (100% CPU for as long as the peer kept it open)."""
    d = make_daemon()
    a = Raw(d.socket)
    frames = [a.frame({"op": "ping"}) for _ in range(101)]
    with pinging(d) as pings:
        a.send(b"".join(frames[:100]) + frames[100][:3])
        assert all(a.recv()["ok"] for _ in range(100))
        before = cpu_seconds(d)
        time.sleep(1.0)
        spent = cpu_seconds(d) - before
        a.send(frames[100][3:])
        assert a.recv()["ok"]  # the rest of the frame was read
    assert spent < 0.3, f"the daemon spent {spent:.2f} s of CPU in 1 s with one unfinished frame"
    assert_fast(pings)


# -- item 4: many leases, many disconnects ------------------------------------------------------------


@pytest.mark.slow
def test_disconnects_do_not_scan_every_lease(make_daemon, checkpoint):
    d = make_daemon("max_leases_per_uid = 20300\n" + model_config(checkpoint[0]))  # all of them one uid's
    holder = Raw(d.socket)
    acquire = holder.frame({"op": "acquire", "name": "m"})
    for _ in range(20_000 // 50):  # 20,000 leases on one connection, 50 requests in flight
        holder.send(acquire * 50)
        for _ in range(50):
            assert holder.recv()["ok"]
    leavers = []
    for _ in range(300):
        r = Raw(d.socket)
        assert r.call({"op": "acquire", "name": "m"})["ok"]
        leavers.append(r)
    with pinging(d) as pings:
        for r in leavers:  # 300 disconnects at once
            r.close()

        def only_the_holders_leases_left() -> bool:
            with Client(d.socket) as c:
                return c.status()["leases"] == 20_000

        assert settle(only_the_holders_leases_left, 10)
    assert_fast(pings)


# -- item 7: buffered bytes, in and out ---------------------------------------------------------------


@pytest.mark.slow
def test_partial_frames_are_bounded_globally(make_daemon, checkpoint):
    d = make_daemon('max_buffer_bytes = "48MiB"\n' + model_config(checkpoint[0]))
    before = rss(d)
    chunk = 8 << 20
    attackers = []
    with pinging(d) as pings:
        for _ in range(16):  # 16 x 8 MiB of frames that never complete: 128 MiB offered
            a = Raw(d.socket)
            try:
                a.send(struct.pack(">I", 30 << 20) + b"\x81" + b"\0" * chunk)
            except (BrokenPipeError, ConnectionResetError):
                pass  # cut off while sending
            attackers.append(a)
        time.sleep(0.5)
        peak = rss(d) - before
    assert_fast(pings)
    cut = [w for w in (a.last_words(timeout=0.5) for a in attackers) if w is not None]
    assert cut and all(w["error"]["code"] == "busy" and "max_buffer_bytes" in w["error"]["message"] for w in cut)
    assert peak < 48 * (1 << 20) + (24 << 20), f"the daemon grew by {peak >> 20} MiB"
    for a in attackers:
        a.close()


def test_clients_that_never_read_are_not_buffered_without_bound(make_daemon, checkpoint):
    d = make_daemon(model_config(checkpoint[0]))
    before = rss(d)
    attackers = []
    with pinging(d) as pings:
        for _ in range(6):  # each asks for ~40 MB of replies and reads none
            a = Raw(d.socket)
            a.sock.setblocking(False)
            data = a.frame({"op": "metrics"}) * 10_000
            try:
                while data:
                    data = data[a.sock.send(data):]
            except BlockingIOError:
                pass  # the daemon stopped reading it: that is the point
            attackers.append(a)
        time.sleep(1.0)
        grown = rss(d) - before
    assert_fast(pings)
    assert grown < 32 << 20, f"the daemon grew by {grown >> 20} MiB for clients that do not read"
    for a in attackers:
        a.close()


# -- item 8: descriptors ------------------------------------------------------------------------------


def test_pipelined_acquires_never_read_are_bounded_per_connection(make_daemon, checkpoint):
    d = make_daemon(model_config(checkpoint[0]))
    base = open_fds(d)
    attackers = []
    with pinging(d) as pings:
        for _ in range(4):
            a = Raw(d.socket)
            a.send(a.frame({"op": "acquire", "name": "m"}) * 1000)
            attackers.append(a)
        time.sleep(1.0)
        held = open_fds(d) - base
        with d.client() as c, c.acquire("m") as lease:  # a newcomer still gets in and gets its lease
            assert lease.tensors
    assert_fast(pings)
    assert held < 4 * (64 + 4) + 16, f"{held} more fds open"
    replies = [attackers[0].recv() for _ in range(1000)]
    busy = [r["error"] for r in replies if not r["ok"]]
    # Past the 64 queued here, the granted ones are those the kernel's socket buffer took.
    assert len(replies) - len(busy) <= 300 and {e["code"] for e in busy} == {"busy"}
    assert any("max_fds_per_connection" in e["message"] for e in busy)
    for a in attackers:
        a.close()


def test_max_entries(make_daemon):
    d = make_daemon("max_entries = 5\n")
    publish_many(d, 5)
    a = Raw(d.socket)
    reply = a.call({"op": "reserve", "key": {"model": "p", "transform": "one-more"},
                    "columns": columns([["w", "U8", [8]]])})
    assert reply["error"]["code"] == "busy" and "max_entries" in reply["error"]["message"]


# -- item 10: idle connections ------------------------------------------------------------------------


def test_connections_without_hello_are_closed_at_the_deadline(make_daemon):
    d = make_daemon("max_connections = 20\nhello_timeout_s = 0.5\n")
    with pinging(d) as pings:
        squatters = [Raw(d.socket, hello=False) for _ in range(19)]  # with the pinger: the cap
        with pytest.raises(Busy, match="max_connections"):
            Client(d.socket)
        started = time.monotonic()

        def gets_in() -> bool:
            try:
                Client(d.socket).close()
                return True
            except Busy:
                return False

        assert settle(gets_in, 5)
        waited = time.monotonic() - started
    assert_fast(pings)
    assert waited < 2.0
    words = squatters[0].last_words()
    assert words is not None and "hello_timeout_s" in words["error"]["message"]


def test_idle_connections_without_leases_are_closed_quietly(make_daemon, checkpoint):
    d = make_daemon("idle_timeout_s = 0.5\n" + model_config(checkpoint[0]))
    idle, holding = Raw(d.socket), Raw(d.socket)
    assert holding.call({"op": "acquire", "name": "m"})["ok"]
    with d.client(heartbeats=False) as c:
        time.sleep(1.5)
        assert idle.last_words() is None  # closed, without an error frame
        assert holding.call({"op": "ping"})["ok"]
        c.ping()  # the library reconnects on its own


def as_nobody(sock_path: Path, frames: list[bytes], conns: int) -> list[bytes]:
    """Open `conns` connections as uid 65534 (stdlib only: it cannot read root's venv), send each the
    frames, and return the first bytes each got back."""
    script = r"""
import socket, sys
frames = bytes.fromhex(sys.argv[3])
out, socks = [], []
for _ in range(int(sys.argv[2])):
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect(sys.argv[1])
    try:
        s.sendall(frames)
    except OSError:
        pass  # turned away at once: its reply is still there to read
    socks.append(s)
for s in socks:
    data = b""
    try:
        while len(data) < 4 or len(data) < 4 + int.from_bytes(data[:4], "big"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        s.settimeout(0.5)  # then whatever else comes
        try:
            while chunk := s.recv(65536):
                data += chunk
        except socket.timeout:
            pass
    except OSError:
        pass
    out.append(data.hex())
print(" ".join(out), flush=True)
"""
    out = subprocess.run(["/usr/bin/python3", "-c", script, str(sock_path), str(conns), b"".join(frames).hex()],
                         user=NOBODY, capture_output=True, text=True, timeout=60, check=True, cwd="/")
    return [bytes.fromhex(h) for h in out.stdout.split()]


def frames_of(data: bytes) -> list[dict[str, Any]]:
    dec = wire.FrameDecoder()
    dec.feed(data)
    frames = []
    while (item := dec.next_message()) is not None:
        frames.append(item[0])
    return frames


@pytest.mark.slow
def test_one_uid_cannot_take_every_connection(make_daemon, shared_socket):
    d = make_daemon(f"allowed_uids = [{NOBODY}]\nmax_connections = 12\nmax_connections_per_uid = 6\n",
                    socket=shared_socket)
    d.socket.chmod(0o666)
    hello = wire.encode({"op": "hello", "id": 1, "versions": [2]})
    with pinging(d) as pings:
        replies = [frames_of(data)[0] for data in as_nobody(d.socket, [hello], 10)]
        with d.client() as c:  # root still gets in
            c.ping()
    assert_fast(pings)
    assert sum(r["ok"] for r in replies) == 6
    refused = [r for r in replies if not r["ok"]]
    assert refused and all("max_connections_per_uid" in r["error"]["message"] for r in refused)


# -- the log: a journal that stops reading ------------------------------------------------------------


class StuckLogDaemon(Daemon):
    """A daemon whose stderr is a one-page pipe that nobody reads until `drain`: under systemd, a
    journal that stopped reading (restarting, on a slow or full disk, hung)."""

    def start(self) -> StuckLogDaemon:
        self._read, write = os.pipe()
        fcntl.fcntl(write, fcntl.F_SETPIPE_SZ, 4096)  # one page: ~40 lines fill it
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "wcd", "serve", "--config", str(self.config),
                                          "--log-level", "info"], stdout=write, stderr=write)
        finally:
            os.close(write)
        connect(self.socket, wait_s=30, while_alive=lambda: self.proc.poll() is None, heartbeats=False).close()
        return self

    def drain(self, timeout: float = 30.0) -> str:
        """All it writes until it has exited (and its helpers, which share the pipe)."""
        out, deadline = b"", time.monotonic() + timeout
        try:
            while select.select([self._read], [], [], max(0.0, deadline - time.monotonic()))[0]:
                if not (chunk := os.read(self._read, 1 << 16)):
                    break
                out += chunk
        finally:
            os.close(self._read)
        return out.decode()


def test_a_journal_that_stops_reading_does_not_stall_the_loop(tmp_path):
    """Each connection that sends a frame too large for the limit is answered and logged (a
    warning). With the log written from the loop, the ~40th line filled the pipe and the loop
    waited on the journal, every client with it; now a thread waits, and no line is lost."""
    d = StuckLogDaemon(tmp_path, "")
    d.start()
    try:
        with pinging(d) as pings:
            for _ in range(200):
                with closing(Raw(d.socket)) as a:
                    a.send(b"\xff" * 64)
                    words = a.last_words(timeout=5)
                    assert words is not None, "no answer in 5 s: the daemon's loop is stuck"
                    assert words["error"]["code"] == "protocol_error", words
        assert_fast(pings)
    finally:
        assert d.proc is not None
        d.proc.terminate()
        log = d.drain()  # the reader is back: what was queued is written, then the daemon exits
    assert d.proc.wait(timeout=30) == 0
    assert log.count("exceeds") == 200, log[-2000:]
    assert "log lines dropped" not in log and "stopped" in log


# -- item 15, the connection's share --------------------------------------------------------------------


def test_an_op_that_is_a_list_or_map_gets_a_reply_and_the_pipeline_goes_on(make_daemon):
    d = make_daemon()
    a = Raw(d.socket)
    a.send(a.frame({"op": ["ping"]}) + a.frame({"op": {"x": 1}}) + a.frame({"op": "ping"}))
    replies = [a.recv() for _ in range(3)]
    assert [r["ok"] for r in replies] == [False, False, True]
    assert {r["error"]["code"] for r in replies[:2]} == {"bad_request"}


def test_a_reserve_too_big_for_uint64_gets_a_reply(make_daemon):
    d = make_daemon()
    a = Raw(d.socket)
    # Each dimension within bounds, their product (2^70 bytes) past what msgpack can carry.
    reply = a.call({"op": "reserve", "key": {"model": "huge", "transform": "test/huge"},
                    "columns": columns([["w", "U8", [1 << 40, 1 << 30]]])})
    assert reply["error"]["code"] == "bad_request" and "spans more than 2**48 elements" in reply["error"]["message"], \
        reply
    assert a.call({"op": "ping"})["ok"]


def test_leases_shows_other_uids_only_to_admins(make_daemon, checkpoint, shared_socket):
    d = make_daemon(f"allowed_uids = [{NOBODY}]\n" + model_config(checkpoint[0]), socket=shared_socket)
    d.socket.chmod(0o666)
    with d.client() as c, c.acquire("m"):
        hello = wire.encode({"op": "hello", "id": 1, "versions": [2]})
        leases = wire.encode({"op": "leases", "id": 2})
        (data,) = as_nobody(d.socket, [hello, leases], 1)
        assert frames_of(data)[1]["leases"] == []
        assert [lease["uid"] for lease in c.list_leases()] == [os.getuid()]


def test_a_socket_that_cannot_be_created_is_one_line(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    config = tmp_path / "wcd.toml"
    config.write_text(f'[daemon]\nsocket = "{blocker}/wcd.sock"\n')
    out = subprocess.run([sys.executable, "-m", "wcd", "serve", "--config", str(config)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 1
    assert "Traceback" not in out.stderr
    assert f"cannot create the socket {blocker}/wcd.sock" in out.stderr.strip().splitlines()[-1]
