"""Daemons in separate network namespaces fill entries from each other over NIXL (host memory):
the checkpoint on the first only, or on both with the peer asked first; every byte checked."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from tests.fleet.conftest import PORT
from tests.integration.conftest import same

pytestmark = pytest.mark.fleet


def model(name: str, path: Path) -> str:
    return f'[[models]]\nname = "{name}"\npath = "{path}"\n'


def wait_ready(d: Any, name: str, timeout: float = 60.0) -> dict[str, Any]:
    with d.client() as c:
        c.acquire(name, timeout_s=timeout).release()
        return next(e for e in c.status()["entries"] if e["name"] == name)


def tensors_of(d: Any, name: str) -> dict[str, torch.Tensor]:
    with d.client() as c:
        with c.acquire(name, timeout_s=60) as lease:
            return {k: v.clone() for k, v in lease.tensors.items()}


@pytest.fixture
def ckpt(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    tensors = {f"layer.{i}.w": torch.randn(256, 64, generator=g).to(torch.bfloat16) for i in range(40)}
    tensors["ids"] = torch.randint(0, 1 << 30, (77,), generator=g)
    d = tmp_path / "ckpt"
    d.mkdir()
    save_file(tensors, str(d / "model.safetensors"))
    return d, tensors


def test_fills_from_a_peer_when_the_checkpoint_is_only_on_the_first(fleet: Any, ckpt: Any, tmp_path: Path) -> None:
    path, tensors = ckpt
    a = fleet(0, model("m", path))
    wait_ready(a, "m")
    moved = tmp_path / "elsewhere"  # the path B is configured with does not exist on B's side
    b = fleet(1, model("m", path.parent / "missing"), peers=(0,), offer=False, start=False)
    b.config.write_text(b.config.read_text().replace(str(path.parent / "missing"), str(path)))
    path.rename(moved)  # hidden while B starts: B must take it from A
    try:
        b.start()
        entry = wait_ready(b, "m")
    finally:
        moved.rename(path)
    assert entry["source"].startswith("peer 10."), entry
    assert entry["fill_rate"] > 0
    got = tensors_of(b, "m")
    assert set(got) == set(tensors) and all(same(got[k], tensors[k]) for k in tensors)
    with a.client() as c:
        fleet_a = c.status()["fleet"]
    assert fleet_a["served"] >= 1 and fleet_a["exported"] == 1


def model_on_both(fleet: Any, ckpt: Any, b_peers: tuple[int, ...] = (0,), **kw: Any) -> tuple[Any, Any]:
    """A serves the checkpoint; B (namespace 1) has it too, and asks its peers first."""
    path, _ = ckpt
    a = fleet(0, model("m", path))
    wait_ready(a, "m")
    return a, fleet(1, model("m", path), peers=b_peers, offer=False, **kw)


def arena_holders(pids: list[int], name: str) -> int:
    """How many open fds and mappings of memfds named for entry `name` the processes hold."""
    n = 0
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                n += os.readlink(fd).startswith(f"/memfd:wcd:{name} ")
            except OSError:
                pass
        n += sum(f"/memfd:wcd:{name} " in line for line in Path(f"/proc/{pid}/maps").read_text().splitlines())
    return n


def family(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [pid] + [q for p in out for q in family(int(p))]


def slow_link(net: Any, i: int, rate: str) -> None:
    """Rate-limit what namespace 0 sends towards namespace i (the peer's bytes)."""
    subprocess.run(["tc", "-n", net.names[0], "qdisc", "add", "dev", net.links[i][0], "root", "tbf", "rate", rate,
                    "burst", "64kb", "latency", "2s"], check=True, capture_output=True)


@pytest.fixture
def big_ckpt(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    tensors = {f"w.{i}": torch.randn(1024, 256, generator=g) for i in range(8)}  # 8 MiB
    d = tmp_path / "big"
    d.mkdir()
    save_file(tensors, str(d / "model.safetensors"))
    return d, tensors


def check_whole(b: Any, tensors: dict[str, torch.Tensor], source: str) -> dict[str, Any]:
    entry = wait_ready(b, "m")
    assert entry["source"].startswith(source), entry
    got = tensors_of(b, "m")
    assert set(got) == set(tensors) and all(same(got[k], tensors[k]) for k in tensors)
    assert b.proc is not None
    assert arena_holders(family(b.proc.pid), "m") == 1  # the live arena's fd: nothing of an aborted read left
    with b.client() as c:
        status = c.status()
    assert status["devices"][0]["used"] == entry["bytes"]  # one arena charged, not two
    return status


def test_the_disk_fills_it_when_the_peer_is_killed_mid_transfer(fleet: Any, net: Any, big_ckpt: Any) -> None:
    path, tensors = big_ckpt
    a = fleet(0, model("m", path))
    wait_ready(a, "m")
    slow_link(net, 1, "8mbit")  # 8 MiB: about 8 s
    b = fleet(1, model("m", path), peers=(0,), offer=False)
    with b.client() as c:
        for _ in range(400):
            phase = next(e for e in c.status()["entries"] if e["name"] == "m")["progress"]["phase"]
            if phase.startswith("reading from peer"):
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"B never read from its peer: {b.log.read_text()[-2000:]}")
    time.sleep(0.5)
    a.proc.kill()
    check_whole(b, tensors, "disk")
    assert "reading the disk" in b.log.read_text()


def test_a_slow_peer_past_the_deadline_gives_way_to_the_disk(fleet: Any, net: Any, big_ckpt: Any) -> None:
    path, tensors = big_ckpt
    a = fleet(0, model("m", path))
    wait_ready(a, "m")
    slow_link(net, 1, "4mbit")
    b = fleet(1, model("m", path), peers=(0,), offer=False, timeout=2)
    check_whole(b, tensors, "disk")
    assert "did not end within 2 s" in b.log.read_text()


def test_a_cut_link_mid_transfer_gives_way_to_the_disk(fleet: Any, net: Any, big_ckpt: Any) -> None:
    path, tensors = big_ckpt
    a = fleet(0, model("m", path))
    wait_ready(a, "m")
    slow_link(net, 1, "8mbit")
    b = fleet(1, model("m", path), peers=(0,), offer=False, timeout=6)
    with b.client() as c:
        for _ in range(400):
            phase = next(e for e in c.status()["entries"] if e["name"] == "m")["progress"]["phase"]
            if phase.startswith("reading from peer"):
                break
            time.sleep(0.05)
    net.link(1, up=False)
    try:
        check_whole(b, tensors, "disk")
    finally:
        net.link(1, up=True)


def test_a_peer_serving_other_bytes_is_refused_and_the_next_peer_fills_it(fleet: Any, net: Any, ckpt: Any,
                                                                          secret: Path) -> None:
    path, tensors = ckpt
    a = fleet(0, model("m", path))
    entry = wait_ready(a, "m")
    with a.client() as c:
        digest = c.verify("m")["digest"]
    # The rogue shares namespace 0 with A, on the next port: B asks it first.
    rogue = subprocess.Popen([*net.prefix_cmd(0), sys.executable, "-m", "tests.fleet.rogue",
                              f"{net.address(0, towards=1)}:{PORT + 1}", str(secret), str(entry["bytes"]), digest],
                             env={**os.environ, "PYTHONPATH": os.getcwd(), "UCX_TLS": "tcp",
                                  "UCX_NET_DEVICES": net.device(0, towards=1)},
                             stdout=subprocess.PIPE, text=True)
    try:
        assert rogue.stdout is not None and rogue.stdout.readline().strip() == "serving"
        b = fleet(1, model("m", path), peers=(0,), offer=False, start=False)
        b.config.write_text(b.config.read_text().replace(
            "peers = [", f'peers = ["{net.address(0, towards=1)}:{PORT + 1}", '))
        b.start()
        check_whole(b, tensors, f"peer {net.address(0, towards=1)}")
        log = b.log.read_text()
        assert "do not match the digest it sent" in log and "refused" in log
        with b.client() as c:
            assert c.status()["fleet"]["wrong_bytes"] == 1
    finally:
        rogue.kill()
        rogue.wait()
        assert rogue.stdout is not None
        rogue.stdout.close()


def test_a_peer_without_the_secret_gets_nothing(fleet: Any, ckpt: Any, tmp_path: Path) -> None:
    path, tensors = ckpt
    wrong = tmp_path / "wrong.secret"
    wrong.write_bytes(os.urandom(48).hex().encode())
    wrong.chmod(0o600)
    a, b = model_on_both(fleet, ckpt, secret_file=wrong)
    check_whole(b, tensors, "disk")
    with a.client() as c:
        assert c.status()["fleet"]["refused_peers"] >= 1
    assert "does not know the fleet's shared secret" in a.log.read_text()
    assert "did not prove the fleet's shared secret" in b.log.read_text() or "cannot be asked" in b.log.read_text()


FLOOD = r"""
import socket, struct, sys, time
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
socks = []
for i in range(n):
    s = socket.create_connection((host, port), timeout=10)
    # half announce a huge frame, half a bad proof: nobody without the secret gets past the handshake
    s.sendall(struct.pack(">I", 1 << 30) if i % 2 else struct.pack(">I", 40) + bytes(40))
    socks.append(s)
time.sleep(1)
print(sum(1 for s in socks if s.recv(1 << 16, socket.MSG_DONTWAIT | socket.MSG_PEEK) is not None), flush=True)
"""


def test_a_flood_of_peers_without_the_secret_leaves_the_daemon_answering(fleet: Any, net: Any, ckpt: Any) -> None:
    from tests.integration.pings import assert_fast, pinging

    path, tensors = ckpt
    a = fleet(0, model("m", path), extra="max_connections = 64\nconnect_timeout_s = 2\n")
    wait_ready(a, "m")
    with pinging(a) as pings:
        flood = subprocess.run([*net.prefix_cmd(1), sys.executable, "-c", FLOOD, net.address(0, towards=1), str(PORT),
                                "1000"], capture_output=True, text=True, timeout=120)
    assert flood.returncode == 0, flood.stderr[-2000:]
    assert_fast(pings)
    with a.client() as c:
        status = c.status()["fleet"]
    assert status["refused_peers"] >= 1 and status["served"] == 0  # no bytes to anyone without the secret
    # Once the flood is gone, a peer with the secret is served as before.
    time.sleep(2.5)
    b = fleet(1, model("m", path), peers=(0,), offer=False)
    check_whole(b, tensors, "peer")
