"""Layer 2: a real daemon process over a real Unix socket."""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.integration.conftest import flip_stored_byte, same, sparse_checkpoint
from wcd import protocol
from wcd.client import Client
from wcd.errors import BadRequest, Busy, DaemonUnavailable, KeyMismatch, NotFound, OutOfMemory, PermissionDenied
from wcd.key import WeightCacheKey
from wcd.loader import DIGEST_CHUNK


def model_config(path: Path, name: str = "m", retention: str = "pinned") -> str:
    return f'\n[[models]]\nname = "{name}"\npath = "{path}"\nretention = "{retention}"\n'


def test_acquire_configured_model_is_bit_identical_to_load_file(make_daemon, checkpoint):
    path, _ = checkpoint
    d = make_daemon(model_config(path))
    expected = {}
    for f in sorted(path.iterdir()):
        expected.update(load_file(f))
    with d.client() as c, c.acquire("m") as lease:
        assert set(lease.tensors) == set(expected)
        for name, t in expected.items():
            assert same(lease.tensors[name], t), name
        assert lease.key.fingerprint and lease.key.device == "cpu"
        assert c.list_leases()[0]["entry"] == "m"
    assert d.stop() == 0


def test_views_are_zero_copy_and_private(make_daemon, checkpoint):
    path, tensors = checkpoint
    d = make_daemon(model_config(path))
    with d.client() as a, d.client() as b, a.acquire("m") as la, b.acquire("m") as lb:
        w = la.tensors["w.f32"]
        # Zero-copy: every view of one lease shares a single mapping.
        ptrs = {t.untyped_storage().data_ptr() for t in la.tensors.values()}
        assert len(ptrs) == 1
        w.fill_(0)  # a stray write lands in a's private copy-on-write page only
        assert torch.count_nonzero(w) == 0
        assert same(lb.tensors["w.f32"], tensors["w.f32"])
    with d.client() as c, c.acquire("m") as lc:
        assert same(lc.tensors["w.f32"], tensors["w.f32"])


def test_concurrent_clients(make_daemon, checkpoint):
    path, tensors = checkpoint
    d = make_daemon(model_config(path))
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def engine() -> None:
        try:
            with d.client() as c:
                barrier.wait()
                for _ in range(5):
                    with c.acquire("m") as lease:
                        assert same(lease.tensors["w.bf16"], tensors["w.bf16"])
                    c.ping()
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=engine) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    with d.client() as c:
        assert c.list_leases() == []
        assert c.status()["counters"]["lease_expiries"] == 0


def test_lease_expires_without_heartbeats_and_survives_with_them(make_daemon, checkpoint):
    path, _ = checkpoint
    d = make_daemon("lease_ttl_s = 0.6\n" + model_config(path, retention="ephemeral"))
    with d.client(heartbeats=True) as alive:
        kept = alive.acquire("m")
        with d.client(heartbeats=False) as silent:
            silent.acquire("m")
            time.sleep(1.5)
            leases = alive.list_leases()
            assert [x["id"] for x in leases] == [kept.id], leases
            assert alive.status()["counters"]["lease_expiries"] == 1
        kept.release()
    # Ephemeral: the last lease ending reclaims the entry.
    with d.client() as c:
        assert c.list() == []


def test_killed_publisher_loses_its_reservation(make_daemon):
    d = make_daemon()
    script = f"""
import sys, time, torch
from wcd.headers import read_header
from wcd.client import Client
from wcd.key import WeightCacheKey
c = Client({str(d.socket)!r})
fill = c.reserve(WeightCacheKey(model="half", transform="test"), {{"w": (torch.float32, (1024, 1024))}})
fill.tensors["w"].fill_(1)
print("reserved", flush=True)
time.sleep(60)
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "reserved"
        with d.client() as c:
            [entry] = c.list()
            assert entry["state"] == "filling" and entry["bytes"] >= 4 << 20
            used = next(x["used"] for x in c.status()["devices"] if x["device"] == "cpu")
            assert used >= 4 << 20
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            deadline = time.monotonic() + 5
            while c.list() and time.monotonic() < deadline:
                time.sleep(0.02)
            assert c.list() == []
            assert next(x["used"] for x in c.status()["devices"] if x["device"] == "cpu") == 0
            with pytest.raises(NotFound):
                c.acquire(WeightCacheKey(model="half", transform="test"))
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def _raw(d) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(d.socket))
    s.settimeout(5)
    return s


def _read_reply(s: socket.socket) -> dict:
    dec = protocol.FrameDecoder()
    while True:
        data = s.recv(65536)
        if not data:
            raise EOFError
        dec.feed(data)
        item = dec.next_message()
        if item is not None:
            return item[0]


def _closed(s: socket.socket) -> bool:
    try:
        while s.recv(65536):
            pass
        return True
    except (TimeoutError, ConnectionResetError):
        return False


def test_malformed_and_oversize_frames_get_errors_and_daemon_keeps_serving(make_daemon):
    d = make_daemon()
    with d.client() as healthy:
        # Garbage msgpack: protocol error reply, connection closed.
        s = _raw(d)
        s.sendall(struct.pack(">I", 3) + b"\xc1\xc1\xc1")
        reply = _read_reply(s)
        assert reply["ok"] is False and reply["error"]["code"] == "protocol_error"
        assert _closed(s)
        s.close()
        # Oversize length prefix: refused before the body is read.
        s = _raw(d)
        s.sendall(struct.pack(">I", protocol.MAX_FRAME_BYTES + 1))
        reply = _read_reply(s)
        assert reply["error"]["code"] == "protocol_error" and "exceeds" in reply["error"]["message"]
        assert _closed(s)
        s.close()
        # A valid frame that is not a map.
        s = _raw(d)
        body = msgpack.packb([1, 2, 3])
        s.sendall(struct.pack(">I", len(body)) + body)
        assert _read_reply(s)["error"]["code"] == "protocol_error"
        s.close()
        # Requests before hello, unknown ops and bad fields: error replies, connection stays usable.
        s = _raw(d)
        s.sendall(protocol.encode({"op": "ping", "id": 1}))
        r = _read_reply(s)
        assert r["id"] == 1 and r["error"]["code"] == "bad_request" and "hello" in r["error"]["message"]
        s.sendall(protocol.encode({"op": "hello", "id": 2, "versions": [2]}))
        assert _read_reply(s)["ok"] is True
        s.sendall(protocol.encode({"op": "explode", "id": 3}))
        r = _read_reply(s)
        assert r["id"] == 3 and r["error"]["code"] == "bad_request" and "unknown op" in r["error"]["message"]
        s.sendall(protocol.encode({"op": "heartbeat", "id": 4, "leases": "nope"}))
        assert _read_reply(s)["error"]["code"] == "bad_request"
        s.sendall(protocol.encode({"op": "hello", "id": 5, "versions": [99]}))
        assert _read_reply(s)["error"]["code"] == "unsupported_version"
        s.sendall(protocol.encode({"op": "ping", "id": 6}))
        assert _read_reply(s) == {"id": 6, "ok": True}
        s.close()
        healthy.ping()
        assert d.proc.poll() is None


def test_client_that_disconnects_mid_frame_does_not_hurt(make_daemon):
    d = make_daemon()
    s = _raw(d)
    s.sendall(struct.pack(">I", 1000) + b"\x80" * 10)
    s.close()
    with d.client() as c:
        c.ping()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another uid")
def test_peer_whose_uid_is_not_allowed_is_refused(make_daemon):
    import tempfile

    sockdir = Path(tempfile.mkdtemp(prefix="wcd-peer-"))
    sockdir.chmod(0o755)  # reachable by uid 65534, so SO_PEERCRED is what decides
    d = make_daemon("allowed_uids = [65533]\n", socket=sockdir / "wcd.sock")
    os.chmod(d.socket, 0o666)

    def connect_as(uid: int) -> str:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: modules are already imported, so no file access is needed as uid 65534
            os.close(r)
            try:
                os.setgid(uid)
                os.setuid(uid)
                try:
                    Client(d.socket, heartbeats=False).close()
                    msg = "accepted"
                except PermissionDenied as e:
                    msg = "refused: " + e.message
                except BaseException as e:
                    msg = f"error: {e!r}"
                os.write(w, msg.encode())
            finally:
                os._exit(0)
        os.close(w)
        with os.fdopen(r) as f:
            out = f.read()
        os.waitpid(pid, 0)
        return out

    assert connect_as(65534).startswith("refused: uid 65534 is not allowed to use this daemon")
    d.config.write_text(d.config.read_text().replace("[65533]", "[65533, 65534]"))
    d.stop()
    d.start()
    os.chmod(d.socket, 0o666)
    assert connect_as(65534) == "accepted"
    with d.client() as c:  # the daemon's own uid is always allowed
        c.ping()


def test_eviction_under_small_budget(make_daemon):
    d = make_daemon('budget = { cpu = "9MiB" }\n')
    w = torch.ones(1024, 1024)  # 4 MiB arena each

    with d.client() as c:
        a = c.publish(WeightCacheKey(model="a", transform="test"), {"w": w})
        b = c.publish(WeightCacheKey(model="b", transform="test"), {"w": w * 2})
        with c.acquire(WeightCacheKey(model="a", transform="test")):
            pass  # a is now more recently used than b
        c.publish(WeightCacheKey(model="c", transform="test"), {"w": w * 3})
        names = {e["name"] for e in c.list()}
        assert a in names and b not in names, names  # LRU: b went
        assert c.status()["counters"]["evictions"] == 1
        # Everything leased: nothing can be evicted.
        la = c.acquire(WeightCacheKey(model="a", transform="test"))
        lc = c.acquire(WeightCacheKey(model="c", transform="test"))
        with pytest.raises(OutOfMemory, match="does not fit on cpu"):
            c.publish(WeightCacheKey(model="d", transform="test"), {"w": w})
        la.release()
        lc.release()


def test_evict_waits_for_leases(make_daemon, checkpoint):
    path, _ = checkpoint
    d = make_daemon(model_config(path))
    with d.client() as c:
        lease = c.acquire("m")
        r = c.evict("m")
        assert r["state"] == "evicting" and r["leases"] == 1
        with pytest.raises(Busy):
            c.acquire("m", wait=False)
        lease.release()
        assert c.list() == []
        with pytest.raises(NotFound, match="no entry named 'm'"):
            c.evict("m")


@pytest.mark.slow
def test_loop_answers_while_a_large_load_runs(make_daemon, tmp_path):
    big = sparse_checkpoint(tmp_path / "big.safetensors", 3 << 30)
    d = make_daemon("load_workers = 2\n")
    with d.client() as admin, d.client() as probe:
        entry = admin.load("big", big, retention="cached")
        assert entry["state"] == "loading"
        worst, samples, saw_progress = 0.0, 0, False
        while True:
            t = time.perf_counter()
            probe.ping()
            worst = max(worst, time.perf_counter() - t)
            samples += 1
            st = probe.status()
            state = next(e for e in st["entries"] if e["name"] == "big")
            if state["state"] == "loading" and 0 < state["progress"]["done"] < state["progress"]["total"]:
                saw_progress = True
            if state["state"] == "ready":
                break
        assert samples >= 3 and worst < 0.25, (samples, worst)
        assert saw_progress
        with probe.acquire("big") as lease:
            t = lease.tensors["big"]
            assert t.numel() == 3 << 30 and int(t[:: 1 << 20].sum()) == 0


def test_acquire_waits_while_loading(make_daemon, tmp_path):
    big = sparse_checkpoint(tmp_path / "big.safetensors", 1 << 30)
    d = make_daemon(model_config(big, "big"))
    with d.client() as c, c.acquire("big") as lease:
        assert lease.tensors["big"].shape == (1 << 30,)
        assert c.status()["entries"][0]["state"] == "ready"


def test_publish_and_acquire_by_key(make_daemon):
    d = make_daemon()
    key = WeightCacheKey(model="llama", dtype="bf16", transform="fp8-marlin", shard={"tp_rank": 0, "tp_size": 2},
                         extra={"vllm": "0.33"})
    tensors = {"a": torch.randn(7, 5), "b": torch.arange(10, dtype=torch.int64)}
    with d.client() as pub:
        name = pub.publish(key, tensors)
    with d.client() as c:
        with c.acquire(key) as lease:
            assert all(same(lease.tensors[n], t) for n, t in tensors.items())
            assert lease.entry == name
        with pytest.raises(KeyMismatch) as e:
            c.acquire(key.model_copy(update={"shard": {"tp_rank": 1, "tp_size": 2}, "dtype": "fp16"}))
        assert e.value.details["fields"] == ["dtype", "shard"]
        with pytest.raises(NotFound):
            c.acquire(WeightCacheKey(model="other", transform="test"))
        assert c.verify(name)["match"] is True


def test_fill_commit_needs_views_dropped_and_abort_frees(make_daemon):
    d = make_daemon()
    with d.client() as c:
        fill = c.reserve(WeightCacheKey(model="x", transform="test"), {"w": (torch.float32, (4, 4))})
        w = fill.tensors["w"]
        w.fill_(2)
        with pytest.raises(BadRequest, match="drop every reference"):
            fill.commit()
        del w
        name = fill.commit()
        with c.acquire(name) as lease:
            assert torch.equal(lease.tensors["w"], torch.full((4, 4), 2.0))
        fill = c.reserve(WeightCacheKey(model="y", transform="test"), {"w": (torch.float32, (4, 4))})
        assert {e["name"] for e in c.list()} == {name, fill.entry}
        fill.abort()
        assert {e["name"] for e in c.list()} == {name}


def test_verify_detects_a_changed_checkpoint(make_daemon, checkpoint):
    path, tensors = checkpoint
    d = make_daemon(model_config(path))
    with d.client() as c:
        with c.acquire("m"):
            pass
        assert c.verify("m")["match"] is True
        first = sorted(path.iterdir())[0]
        changed = load_file(first)
        changed["w.f32"] = changed["w.f32"] + 1
        save_file(changed, str(first))
        r = c.verify("m")
        assert r["match"] is False and r["mismatched"] == ["w.f32"] and r["mismatched_count"] == 1


def content_digest(tensors: dict[str, torch.Tensor]) -> str:
    """verify's `digest`, computed here from the bytes: sha256 over (name, per-tensor digest) in name
    order; a tensor's digest is sha256 of its bytes, or of its DIGEST_CHUNK pieces' sha256 digests."""
    total = hashlib.sha256()
    for name in sorted(tensors):
        data = tensors[name].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        pieces = [data[i : i + DIGEST_CHUNK] for i in range(0, len(data), DIGEST_CHUNK)]
        one = hashlib.sha256(pieces[0] if len(pieces) == 1 else b"".join(hashlib.sha256(p).digest() for p in pieces))
        total.update(name.encode() + b"\0" + one.digest())
    return total.hexdigest()


def test_verify_names_the_one_tensor_whose_file_byte_changed(make_daemon, checkpoint):
    """One byte of one tensor changed in place after the load: verify (one pass, comparing the
    files' bytes) reports exactly that tensor; its digest stays that of what is resident, the same
    as for a published copy of the same tensors."""
    path, tensors = checkpoint
    d = make_daemon(model_config(path))
    with d.client() as c:
        r = c.verify("m")
        assert (r["match"], r["mismatched"], r["tensors"]) == (True, [], len(tensors))
        assert r["digest"] == content_digest(tensors)
        flip_stored_byte(sorted(path.iterdir())[0], "w.bf16")
        r = c.verify("m")
        assert (r["match"], r["mismatched"], r["against"]) == (False, ["w.bf16"], str(path))
        assert r["digest"] == content_digest(tensors)
        published = c.publish(WeightCacheKey(model="copy", transform="test"), tensors)
        r = c.verify(published)
        assert (r["match"], r["against"], r["digest"]) == (True, "digest at commit", content_digest(tensors))


def test_sigterm_exits_cleanly_and_removes_socket(make_daemon, checkpoint):
    path, _ = checkpoint
    d = make_daemon(model_config(path))
    c = d.client()
    c.acquire("m")
    assert d.stop() == 0
    assert not d.socket.exists()
    c.close()


def test_client_reconnects_after_a_daemon_restart(make_daemon, checkpoint):
    path, tensors = checkpoint
    d = make_daemon(model_config(path))
    c = d.client()
    lease = c.acquire("m")
    view = lease.tensors["w.f32"]
    d.stop()
    for _ in range(2):  # down: each call says so, and the next one tries again
        with pytest.raises(DaemonUnavailable):
            c.ping()
    d.start()
    c.ping()
    assert lease.lost and c.leases == []
    assert same(view, tensors["w.f32"])  # views of the old lease stay usable
    with c.acquire("m") as again:
        assert same(again.tensors["w.f32"], tensors["w.f32"])
    lease.release()  # a lost lease releases without asking the daemon
    c.close()


def test_second_daemon_on_same_socket_refuses(make_daemon):
    d = make_daemon()
    out = subprocess.run([sys.executable, "-m", "wcd", "serve", "--config", str(d.config)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "another daemon already serves" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    with d.client() as c:
        c.ping()


def test_protocol_v1_is_refused_in_one_line(make_daemon, checkpoint):
    """Protocol v1 (manifests as rows) never shipped: a peer that speaks only it is told to upgrade;
    one that also speaks v2 gets v2 and columns."""
    path, tensors = checkpoint
    d = make_daemon(model_config(path))
    s = _raw(d)
    s.sendall(protocol.encode({"op": "hello", "id": 1, "versions": [1]}))
    refused = _read_reply(s)["error"]
    assert refused["code"] == "unsupported_version" and "upgrade the older side" in refused["message"]
    assert "\n" not in refused["message"]
    s.close()
    s = _raw(d)
    dec = protocol.FrameDecoder()
    replies = []
    s.sendall(protocol.encode({"op": "hello", "id": 1, "versions": [1, 2]}) +
              protocol.encode({"op": "acquire", "id": 2, "name": "m"}))
    while len(replies) < 2:
        data, anc, _, _ = s.recvmsg(1 << 20, socket.CMSG_SPACE(64))
        dec.feed(data, protocol.fds_from_ancillary(anc))
        while (item := dec.next_message()) is not None:
            replies.append(item)
    (hello, _), (acquired, fds) = replies
    assert hello["version"] == 2 and len(fds) == 1 and "names" in acquired["manifest"]
    os.close(fds[0])
    s.close()
    with d.client() as c, c.acquire("m") as lease:
        assert all(same(lease.tensors[n], t) for n, t in tensors.items())
