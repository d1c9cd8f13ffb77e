"""Fill an entry from a peer daemon over NIXL, against the disk and against the link's ceiling.

Two network namespaces joined by a veth pair (made and removed here; needs root, `ip`, NIXL).
Daemon A (namespace 0) loads the checkpoint; then, in namespace 1, in the same run:
  - peer:  daemon B (`[fleet]`, peers = [A]) loads the same key: A's arena is read over NIXL
           (UCX over TCP on the veth), hashed and checked, then sealed. Reported: the transfer
           alone (`transfer_gbps`) and load request -> ready (`ready_s`, with the digest check);
  - disk:  daemon C (no fleet) loads it with the checkpoint's pages dropped first (fadvise);
  - tcp:   one plain TCP stream of the same bytes from namespace 0 to 1 (the link's ceiling).
And the registration a transfer needs: one region for the arena vs one per tensor.

    python bench/bench_fleet.py --gb 1 --tensors 1000 --runs 3 --json out.json
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402
from common import write_checkpoint  # noqa: E402

from tests.fleet.netns import Net  # noqa: E402
from wcd.client import Client, connect  # noqa: E402

PORT = 7460
TCP_PORT = 7461
UCX = {"UCX_TLS": "tcp", "UCX_TCP_TX_SEG_SIZE": "256k", "UCX_TCP_RX_SEG_SIZE": "256k"}

TCP_SENDER = r"""
import os, socket, sys
n = int(sys.argv[2])
fd = os.memfd_create("src"); os.ftruncate(fd, n)
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[3]))); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); sent = 0
while sent < n:
    sent += os.sendfile(c.fileno(), fd, sent, n - sent)
c.close()
"""
TCP_RECEIVER = r"""
import socket, sys, time
n = int(sys.argv[2]); c = socket.create_connection((sys.argv[1], int(sys.argv[3])))
buf = bytearray(8 << 20); view = memoryview(buf); got = 0; t = time.perf_counter()
while got < n:
    k = c.recv_into(view)
    if not k: break
    got += k
print(got / (time.perf_counter() - t) / 1e9)
"""


def start(net: Net, i: int, root: Path, config: str) -> tuple[subprocess.Popen[bytes], Path]:
    root.mkdir(parents=True, exist_ok=True)
    sock = root / "wcd.sock"
    (root / "wcd.toml").write_text(f'[daemon]\nsocket = "{sock}"\n{config}')
    log = open(root / "daemon.log", "ab")  # noqa: SIM115 - the daemon's until it exits
    proc = subprocess.Popen([*net.prefix_cmd(i), sys.executable, "-m", "wcd", "serve", "--config",
                             str(root / "wcd.toml"), "--log-level", "info"], stdout=log, stderr=subprocess.STDOUT)
    connect(sock, wait_s=60, while_alive=lambda: proc.poll() is None, heartbeats=False).close()
    return proc, sock


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def timed_load(sock: Path, path: Path) -> tuple[float, dict[str, Any]]:
    with Client(sock) as c:
        began = time.perf_counter()
        c.load("m", str(path), wait=True)
        seconds = time.perf_counter() - began
        entry = next(e for e in c.status()["entries"] if e["name"] == "m")
        c.evict("m")
    return seconds, entry


def drop_pages(files: list[Path]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def tcp_ceiling(net: Net, nbytes: int) -> float:
    sender = subprocess.Popen([*net.prefix_cmd(0), sys.executable, "-c", TCP_SENDER, net.address(0, towards=1),
                               str(nbytes), str(TCP_PORT)], stdout=subprocess.PIPE, text=True)
    try:
        assert sender.stdout is not None and sender.stdout.readline().strip() == "ready"
        out = subprocess.run([*net.prefix_cmd(1), sys.executable, "-c", TCP_RECEIVER, net.address(0, towards=1),
                              str(nbytes), str(TCP_PORT)], capture_output=True, text=True, check=True, timeout=600)
        return float(out.stdout.strip())
    finally:
        sender.wait(timeout=60)
        assert sender.stdout is not None
        sender.stdout.close()


def registration(nbytes: int, tensors: int) -> dict[str, float]:
    """Seconds to register one arena-sized region, and the same bytes as one region per tensor."""
    import mmap

    from wcd.fleet.agent import _address, make_agent

    agent = make_agent(f"bench-{os.getpid()}")
    region = mmap.mmap(-1, nbytes)
    view, addr = _address(region)
    t = time.perf_counter()
    reg = agent.register_memory([(addr, nbytes, 0, "")], "DRAM")
    one = time.perf_counter() - t
    agent.deregister_memory(reg)
    per = nbytes // tensors
    t = time.perf_counter()
    reg = agent.register_memory([(addr + i * per, per, 0, "") for i in range(tensors)], "DRAM")
    many = time.perf_counter() - t
    agent.deregister_memory(reg)
    del view
    region.close()
    return {"per_arena_ms": one * 1e3, "per_tensor_ms": many * 1e3}


def main() -> None:
    p = common.parser(__doc__)
    p.add_argument("--gb", type=float, default=1.0)
    p.add_argument("--tensors", type=int, default=1000)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    nbytes = int(args.gb * 1e9)
    work = Path(tempfile.mkdtemp(prefix="wcd-bench-fleet-"))
    ckpt = work / "ckpt"
    files = write_checkpoint(ckpt, nbytes, args.tensors, 1)
    secret = work / "secret"
    secret.write_bytes(os.urandom(48).hex().encode())
    secret.chmod(0o600)
    net = Net(f"wcdb{os.getpid() % 100000}", 2)
    procs: list[subprocess.Popen[bytes]] = []
    result: dict[str, Any] = {**common.run_info("cpu"), "bytes": nbytes, "tensors": args.tensors, "runs": []}
    try:
        ucx = ", ".join(f'{k} = "{v}"' for k, v in UCX.items())
        fleet = (f'[fleet]\nsecret_file = "{secret}"\nfetch_timeout_s = 600\n'
                 f'ucx = {{ {ucx}, UCX_NET_DEVICES = "%s" }}\n')
        a, _ = start(net, 0, work / "a", f'[[models]]\nname = "m"\npath = "{ckpt}"\n'
                     + fleet % net.device(0, towards=1)
                     + f'listen = "{net.address(0, towards=1)}:{PORT}"\noffer = {{ cpu = "64GiB" }}\n')
        procs.append(a)
        with Client(work / "a" / "wcd.sock") as c:
            c.acquire("m", timeout_s=600).release()
        b, b_sock = start(net, 1, work / "b", fleet % net.device(1)
                          + f'listen = "{net.address(1)}:{PORT}"\npeers = ["{net.address(0, towards=1)}:{PORT}"]\n')
        procs.append(b)
        d, d_sock = start(net, 1, work / "d", "")
        procs.append(d)
        for run in range(args.runs):
            ceiling = tcp_ceiling(net, nbytes)
            peer_s, peer = timed_load(b_sock, ckpt)
            drop_pages(files)
            disk_s, disk = timed_load(d_sock, ckpt)
            row = {"run": run, "tcp_gbps": ceiling, "peer_source": peer.get("source"),
                   "peer_transfer_gbps": peer.get("fill_rate", 0) / 1e9, "peer_ready_s": peer_s,
                   "peer_ready_gbps": nbytes / peer_s / 1e9, "disk_ready_s": disk_s,
                   "disk_ready_gbps": nbytes / disk_s / 1e9, "disk_source": disk.get("source")}
            row["transfer_of_ceiling"] = row["peer_transfer_gbps"] / ceiling
            print(json.dumps(row), flush=True)
            result["runs"].append(row)
        result["registration"] = registration(nbytes, args.tensors)
        print(json.dumps(result["registration"]), flush=True)
    finally:
        for proc in procs:
            stop(proc)
        net.remove()
    for k in ("tcp_gbps", "peer_transfer_gbps", "peer_ready_gbps", "disk_ready_gbps", "transfer_of_ceiling"):
        result[f"median_{k}"] = common.median([r[k] for r in result["runs"]])
    common.write_json(args.json, result)


if __name__ == "__main__":
    socket.setdefaulttimeout(None)
    main()
