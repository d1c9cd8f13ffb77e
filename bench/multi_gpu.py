"""Multi-GPU run: one wcd daemon serving arenas on every GPU to one client process per GPU.

On a host with N >= 2 GPUs (needs root for `load` by path, cuda-bindings and torch):
  1. one daemon; the same checkpoint loaded onto GPU 0 alone, then onto all N GPUs at once
     (load throughput: one GPU vs N in parallel, aggregate and per GPU);
  2. N client processes, CUDA_VISIBLE_DEVICES=i each, attach their GPU's arena by key (GPU UUID
     in the key): bit-identical to the checkpoint, mapped read-only (cuMemGetAccess);
  3. a client that sees only GPU 0 asks for GPU 1's arena: the error it gets;
  4. per-device budgets: GPU 1's small budget evicts GPU 1's LRU entry and leaves GPU 0 alone;
     `wcdctl status` shows every device.
Prints what it finds and writes JSON (--out).

    python bench/multi_gpu.py --dir /tmp/wcd-multi --size-gb 4 --out multi.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from wcd.arenas.cuda import gpus  # noqa: E402
from wcd.client import Client, connect  # noqa: E402
from wcd.demo import write_checkpoint  # noqa: E402

_CLIENT = r"""
import json, sys, time
import torch
from safetensors.torch import load_file
from cuda.bindings import driver as cuda
from wcd.client import Client
from wcd.key import WeightCacheKey
sock, key_json, ckpt = sys.argv[1], sys.argv[2], sys.argv[3]
key = WeightCacheKey.model_validate_json(key_json)
torch.cuda.init(); torch.zeros(1, device="cuda")  # context outside the timing
out = {"visible": torch.cuda.get_device_name(0), "uuid_visible": str(torch.cuda.get_device_properties(0).uuid)}
try:
    c = Client(sock)
    t = time.perf_counter()
    lease = c.acquire(key)
    tensors = lease.tensors
    out["attach_s"] = time.perf_counter() - t
except Exception as e:
    out["error"] = f"{type(e).__name__}: {e}"
    print(json.dumps(out)); sys.exit(0)
base = next(iter(tensors.values()))
loc = cuda.CUmemLocation(); loc.type = cuda.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE; loc.id = 0
err, flags = cuda.cuMemGetAccess(loc, base.data_ptr())
out["access"] = getattr(flags, "name", str(flags)) if err == cuda.CUresult.CUDA_SUCCESS else f"error {err}"
identical = 0
import pathlib
for f in sorted(pathlib.Path(ckpt).glob("*.safetensors")):
    for name, ref in load_file(f).items():
        v = tensors[name]
        ok = v.shape == ref.shape and v.dtype == ref.dtype and (ref.numel() == 0 or torch.equal(
            v.reshape(-1).view(torch.uint8).cpu(), ref.reshape(-1).view(torch.uint8)))
        identical += ok
out["identical"], out["tensors"] = identical, len(tensors)
out["device_of_views"] = str(base.device)
print(json.dumps(out))
"""


def timed_loads(sock: Path, ckpt: Path, targets: list[tuple[str, str]]) -> dict[str, float]:
    """Load `ckpt` as each (name, device) at once, one client thread each; seconds per load."""
    times: dict[str, float] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(targets))

    def one(name: str, device: str) -> None:
        try:
            with Client(sock) as c:
                barrier.wait()
                t = time.perf_counter()
                c.load(name, ckpt, device=device, retention="cached", wait=True)
                times[name] = time.perf_counter() - t
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=one, args=t) for t in targets]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    times["wall"] = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", type=Path, default=Path("/tmp/wcd-multi"))
    ap.add_argument("--size-gb", type=float, default=4)
    ap.add_argument("--tensors", type=int, default=1000)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    visible = gpus()
    n = len(visible)
    if n < 2:
        sys.exit(f"multi_gpu: needs 2 or more GPUs, this host shows {n}")
    size = int(args.size_gb * 1e9)
    ckpt = args.dir / "ckpt"
    if not ckpt.exists():
        write_checkpoint(ckpt, size, args.tensors, shards=4)
    nbytes = sum(f.stat().st_size for f in ckpt.iterdir())
    for f in ckpt.iterdir():  # page cache warm
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass
    budget_gpu1 = int(nbytes * 1.5)  # room for one copy only: a second one evicts the first
    sock = args.dir / "wcd.sock"
    cfg = args.dir / "wcd.toml"
    budgets = ", ".join(f'"cuda:{i}" = "90%"' for i in range(n) if i != 1)
    cfg.write_text(f'[daemon]\nsocket = "{sock}"\nbudget = {{ {budgets}, "cuda:1" = {budget_gpu1} }}\n')
    log = open(args.dir / "daemon.log", "w")
    daemon = subprocess.Popen([sys.executable, "-m", "wcd", "serve", "--config", str(cfg)], cwd=str(REPO),
                              stdout=log, stderr=subprocess.STDOUT)
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "gpus": [g.label + " " + g.uuid for g in visible],
                 "checkpoint": {"bytes": nbytes, "tensors": args.tensors}}
    try:
        admin = connect(sock, wait_s=60, while_alive=lambda: daemon.poll() is None)
        one = timed_loads(sock, ckpt, [("solo", "cuda:0")])
        admin.evict("solo")
        res["one_gpu"] = {"seconds": one["solo"], "gb_per_s": nbytes / one["solo"] / 1e9}
        para = timed_loads(sock, ckpt, [(f"rank{i}", f"cuda:{i}") for i in range(n)])
        res["all_gpus"] = {"wall_s": para["wall"], "aggregate_gb_per_s": n * nbytes / para["wall"] / 1e9,
                           "per_gpu_gb_per_s": [nbytes / para[f"rank{i}"] / 1e9 for i in range(n)]}
        keys = {e["name"]: e["key"] for e in admin.list()}
        clients = []
        pythonpath = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
        for i in range(n):
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": visible[i].uuid, "PYTHONPATH": pythonpath}
            clients.append(subprocess.Popen([sys.executable, "-c", _CLIENT, str(sock), json.dumps(keys[f"rank{i}"]),
                                             str(ckpt)], env=env, stdout=subprocess.PIPE, text=True))
        res["clients"] = [json.loads(p.communicate(timeout=300)[0]) for p in clients]
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": visible[0].uuid, "PYTHONPATH": pythonpath}
        wrong = subprocess.run([sys.executable, "-c", _CLIENT, str(sock), json.dumps(keys["rank1"]), str(ckpt)],
                               env=env, capture_output=True, text=True, timeout=300)
        res["cross_device"] = json.loads(wrong.stdout)
        res["leases_after_cross_device"] = len(admin.list_leases())
        # Budgets are per device: a second copy on GPU 1 evicts GPU 1's LRU entry only.
        timed_loads(sock, ckpt, [("rank1-bis", "cuda:1")])
        res["after_gpu1_pressure"] = sorted(e["name"] for e in admin.list())
        res["wcdctl_status"] = subprocess.run([sys.executable, "-m", "wcd.cli.wcdctl", "--socket", str(sock), "status"],
                                              capture_output=True, text=True, cwd=str(REPO)).stdout
        admin.close()
    finally:
        daemon.terminate()
        daemon.wait(timeout=60)
        log.close()
    print(json.dumps({k: v for k, v in res.items() if k != "wcdctl_status"}, indent=2))
    print(res["wcdctl_status"])
    if args.out:
        args.out.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
