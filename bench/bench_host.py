"""Host control plane: attach vs safetensors load_file in host memory, and round trips per second.

One run, side by side, on a synthetic checkpoint (default ~1 GiB, 1000 tensors, page cache warm):
  - attach: client time from connect to usable tensor views (fresh process, `import torch`
    excluded and reported apart), and acquire alone on an open connection;
  - safetensors `load_file`: lazy (mmap, nothing read) and followed by the copy into the
    engine's own tensors that an engine makes;
  - ping and heartbeat round trips per second with 64 concurrent clients.
Prints a table per `--variant` and writes JSON (--json). `make bench` runs it.

    python bench/bench_host.py [--size-mb 1024] [--tensors 1000] [--clients 64] [--json host.json]
"""

from __future__ import annotations

import json
import multiprocessing as mp
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import common
from common import ROOT, Daemon, Variant

from wcd.client import Client
from wcd.demo import write_checkpoint

_ENGINE = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
import_s = time.perf_counter() - t0
mode, where, reps = sys.argv[1], sys.argv[2], int(sys.argv[3])
out = {"import_torch_s": import_s}
if mode == "wcd":
    from wcd.client import Client
    start = time.perf_counter()
    c = Client(where)
    lease = c.acquire("bench")
    tensors = lease.tensors
    out["first_attach_s"] = time.perf_counter() - start
    assert len(tensors) > 0
    lease.release()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        lease = c.acquire("bench")
        tensors = lease.tensors
        times.append(time.perf_counter() - start)
        del tensors
        lease.release()
    out["attach_s"] = times
else:
    from safetensors.torch import load_file
    import pathlib
    files = sorted(pathlib.Path(where).glob("*.safetensors"))
    lazy, full = [], []
    for _ in range(reps):
        start = time.perf_counter()
        tensors = {}
        for f in files:
            tensors.update(load_file(f))
        lazy.append(time.perf_counter() - start)
        owned = {k: v.clone() for k, v in tensors.items()}
        full.append(time.perf_counter() - start)
        del tensors, owned
    out["lazy_s"], out["full_s"] = lazy, full
print(json.dumps(out))
"""


def engine(mode: str, where: str, reps: int) -> dict:
    out = subprocess.run([sys.executable, "-c", _ENGINE, mode, where, str(reps)], capture_output=True, text=True,
                         check=True, cwd=str(ROOT))
    return json.loads(out.stdout)


def _hammer(sock: str, op: str, clients: int, seconds: float, start_at: float, q: mp.Queue) -> None:
    """One process driving `clients` connections from threads, each doing round trips back to back."""
    import threading

    conns = [Client(sock, heartbeats=False) for _ in range(clients)]
    leases = [c.acquire("bench") for c in conns] if op == "heartbeat" else [None] * clients
    counts = [0] * clients

    def loop(i: int) -> None:
        c, lease = conns[i], leases[i]
        fields = {"leases": [lease.id]} if lease else {}
        while time.time() < start_at:
            time.sleep(0.001)
        end = start_at + seconds
        n = 0
        while time.time() < end:
            c.request(op, **fields)
            n += 1
        counts[i] = n

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in conns:
        c.close()
    q.put(sum(counts))


def round_trips(sock: str, op: str, clients: int, procs: int, seconds: float) -> float:
    q: mp.Queue = mp.Queue()
    start_at = time.time() + 1.5
    per = [clients // procs + (1 if i < clients % procs else 0) for i in range(procs)]
    ps = [mp.Process(target=_hammer, args=(sock, op, n, seconds, start_at, q)) for n in per]
    for p in ps:
        p.start()
    total = sum(q.get() for _ in ps)
    for p in ps:
        p.join()
    return total / seconds


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--size-mb", type=int, default=1024)
    ap.add_argument("--tensors", type=int, default=1000)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--procs", type=int, default=4, help="client processes sharing the clients")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    if args.device != "cpu":
        raise SystemExit("bench_host measures host arenas (--device cpu); bench_attach and bench_load take a GPU")
    result = {**common.run_info("cpu", args.variant), "rows": []}
    with tempfile.TemporaryDirectory(prefix="wcd-bench-") as tmp:
        root = Path(tmp)
        ckpt = write_checkpoint(root / "ckpt", args.size_mb << 20, args.tensors, shards=4)
        try:
            for v in args.variant:
                result["rows"].append(one(root / v.name, ckpt, v, args))
        finally:
            common.write_json(args.json, result)


def one(root: Path, ckpt: Path, v: Variant, args: Any) -> dict[str, Any]:
    """The figures of one variant's daemon, printed as they are measured."""
    nbytes = sum(f.stat().st_size for f in ckpt.iterdir())
    with Daemon(root, v, f'lease_ttl_s = 30\n[[models]]\nname = "bench"\npath = "{ckpt}"\n') as daemon:
        sock = daemon.socket
        t = time.perf_counter()
        with Client(sock) as c, c.acquire("bench"):
            load_s = time.perf_counter() - t
        disk = engine("disk", str(ckpt), 3)  # page cache warm from writing and loading
        attach = engine("wcd", str(sock), args.reps)
        ping = round_trips(str(sock), "ping", args.clients, args.procs, args.seconds)
        hb = round_trips(str(sock), "heartbeat", args.clients, args.procs, args.seconds)

    attach_med = statistics.median(attach["attach_s"])
    lazy = min(disk["lazy_s"])
    full = min(disk["full_s"])
    res = {
        "variant": v.name, "checkpoint": {"bytes": nbytes, "tensors": args.tensors, "shards": 4},
        "daemon_load_s": load_s,
        "attach_first_s": attach["first_attach_s"], "attach_median_s": attach_med,
        "attach_min_s": min(attach["attach_s"]), "import_torch_s": attach["import_torch_s"],
        "load_file_lazy_s": lazy, "load_file_and_copy_s": full,
        "ping_rt_per_s": ping, "heartbeat_rt_per_s": hb, "clients": args.clients, "client_procs": args.procs,
    }
    print(f"variant {v.name}: checkpoint {nbytes / 2**30:.2f} GiB, {args.tensors} tensors, 4 shards, page cache warm")
    print(f"daemon cold load into its arena:                {load_s * 1e3:9.1f} ms "
          f"({nbytes / load_s / 1e9:.2f} GB/s)")
    print(f"safetensors load_file (lazy mmap, nothing read): {lazy * 1e3:9.1f} ms")
    print(f"safetensors load_file + copy into own tensors:   {full * 1e3:9.1f} ms")
    print(f"wcd attach, first (connect+hello+acquire+views): {attach['first_attach_s'] * 1e3:9.2f} ms "
          f"-> {full / attach['first_attach_s']:.0f}x faster than load_file + copy")
    print(f"wcd attach, median of {args.reps} on an open connection:  {attach_med * 1e3:9.2f} ms "
          f"(min {min(attach['attach_s']) * 1e3:.2f} ms)")
    print(f"import torch (excluded above):                   {attach['import_torch_s'] * 1e3:9.0f} ms")
    print(f"ping round trips/s, {args.clients} clients in {args.procs} processes:   {ping:9.0f}")
    print(f"heartbeat round trips/s, {args.clients} clients:             {hb:9.0f}")
    print(f"goals: attach <= 10 ms: {'met' if attach['first_attach_s'] <= 0.010 else 'MISSED'}; "
          f">= 20k round trips/s: {'met' if min(ping, hb) >= 20000 else 'MISSED'}", flush=True)
    return res


if __name__ == "__main__":
    main()
