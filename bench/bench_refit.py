"""Refit: a trainer publishes generation 2 of a series while engines follow it; how long until
every engine reads generation 2, side by side with what a user would pick instead.

One run measures, for the same tensors (`--gb` over `--tensors`, on `--device`):

- publish: reserve + device-to-device copy into the new arena + commit (the trainer's cost);
- in place: trainer commit -> every engine on generation 2, engines mapping the new arena at the
  same addresses (`Follower.update`); rollback the same way back;
- copy-in: the same, engines copying the generation into tensors they own;
- ipc (CUDA only): vLLM's `ipc` backend path: one `reduce_tensor` handle per tensor exported by
  the trainer, rebuilt and copied by each engine;
- floor: one `copy_` of all the bytes inside one process (device to device).

Engines are separate processes, started and following before any clock starts; every figure
ends when the last engine has its bytes (checked: each tensor's first and last element hold the
generation's value). Run: `python bench/bench_refit.py --device cuda:0 --gb 16 --engines 4`
(or `--device cpu --gb 1`); `--json` prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SERIES = "bench"


def shapes(gb: float, count: int) -> list[tuple[str, tuple[int, ...]]]:
    per = int(gb * 1e9 / 2 / count)  # bf16 elements per tensor
    return [(f"layers.{i}.w", (per,)) for i in range(count)]


def make(layout: list[tuple[str, tuple[int, ...]]], value: float, device: str) -> dict[str, Any]:
    import torch

    return {n: torch.full(s, value, dtype=torch.bfloat16, device=device) for n, s in layout}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def check(tensors: dict[str, Any], value: float) -> bool:
    return all(float(t[0]) == value and float(t[-1]) == value for t in tensors.values())


# -- engine processes ---------------------------------------------------------------------------


def engine(args: argparse.Namespace) -> None:
    """Follow the series; for each line on stdin ("follow N", "ipc"), do it and print when done."""
    import torch

    from wcd.client import Client

    client = Client(args.socket)
    layout = shapes(args.gb, args.tensors)
    owned = None
    if args.mode == "copy":
        owned = {n: torch.empty(s, dtype=torch.bfloat16, device=args.device) for n, s in layout}
    follower = client.follow(SERIES, copy_into=owned)
    print(json.dumps({"ready": follower.generation}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "follow":
            want = int(cmd[1])
            while follower.poll(timeout=30) != want:
                pass
            follower.update()
            sync(args.device)
            done = time.monotonic()
            print(json.dumps({"done": done, "update_s": follower.taken_s,
                              "ok": check(follower.tensors, float(want)) and follower.generation == want}), flush=True)
        elif cmd[0] == "quit":
            break
    follower.close()
    client.close()


# -- the trainer ----------------------------------------------------------------------------------


def start_daemon(root: Path, device: str) -> tuple[subprocess.Popen[bytes], Path]:
    sock = root / "wcd.sock"
    budget = f'{{ "{device}" = "90%" }}' if device.startswith("cuda") else '{ cpu = "80%" }'
    (root / "wcd.toml").write_text(f'[daemon]\nsocket = "{sock}"\nbudget = {budget}\nkeep_generations = 1\n')
    log = open(root / "daemon.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "wcd", "serve", "--config", str(root / "wcd.toml")],
                            stdout=log, stderr=subprocess.STDOUT)
    from wcd.client import connect

    connect(sock, wait_s=60, while_alive=lambda: proc.poll() is None, heartbeats=False).close()
    return proc, sock


def publish(client: Any, layout: list[tuple[str, tuple[int, ...]]], tensors: dict[str, Any] | float, device: str,
            ) -> tuple[float, float]:
    """(reserve + copy + commit seconds, the time the commit was sent). A float for `tensors` fills
    the new arena with that value instead of copying (`--source arena`: sizes where the trainer's
    own copy does not fit beside two generations)."""
    import torch

    from wcd.follower import device_of
    from wcd.key import WeightCacheKey

    started = time.monotonic()
    probe = {"": torch.empty(1, device=device)} if isinstance(tensors, float) else tensors
    where = device_of(probe)
    fill = client.reserve(WeightCacheKey(model=SERIES, transform="generations", device=where),
                          {n: (torch.bfloat16, s) for n, s in layout}, series=SERIES, mapped=False)
    if isinstance(tensors, float):
        views = fill.tensors
        for n in views:
            views[n].fill_(tensors)
        sync(device)
        del views
    else:
        fill.write(tensors)  # what `publish_generation` does: host tensors into a host arena by pwrite
    committing = time.monotonic()
    fill.commit()
    return time.monotonic() - started, committing


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from wcd.client import Client

    root = Path(tempfile.mkdtemp(prefix="wcd-refit-"))
    daemon, sock = start_daemon(root, args.device)
    out: dict[str, Any] = {"device": args.device, "gb": args.gb, "tensors": args.tensors, "engines": args.engines}
    try:
        client = Client(sock)
        layout = shapes(args.gb, args.tensors)
        source = (lambda value: value) if args.source == "arena" else (lambda value: make(layout, value, args.device))
        out["source"] = args.source
        out["publish_1_s"], _ = publish(client, layout, source(1.0), args.device)
        for mode in args.modes.split(","):
            procs = [subprocess.Popen([sys.executable, __file__, "--engine", "--socket", str(sock), "--mode",
                                       "copy" if mode == "copy" else "place", "--device", args.device,
                                       "--gb", str(args.gb), "--tensors", str(args.tensors)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                     for _ in range(args.engines)]
            for p in procs:
                assert json.loads(p.stdout.readline())["ready"] >= 1  # type: ignore[union-attr]
            last = max(g["generation"] for g in client.status()["series"][0]["generations"])
            for label in ("update", "rollback"):
                if label == "update":
                    target = last + 1
                else:  # the newest generation kept besides the current one
                    [series] = client.status()["series"]
                    target = max(g["generation"] for g in series["generations"] if g["state"] == "previous")
                for p in procs:
                    p.stdin.write(f"follow {target}\n")  # type: ignore[union-attr]
                    p.stdin.flush()  # type: ignore[union-attr]
                if label == "update":
                    tensors = source(float(target))
                    publish_s, committed = publish(client, layout, tensors, args.device)
                    del tensors
                    out[f"publish_s_{mode}"] = publish_s
                else:
                    committed = time.monotonic()
                    client.rollback(SERIES)
                done = [json.loads(p.stdout.readline()) for p in procs]  # type: ignore[union-attr]
                assert all(d["ok"] for d in done), done
                out[f"{mode}_{label}_s"] = max(d["done"] for d in done) - committed
                out[f"{mode}_{label}_engine_s"] = max(d["update_s"] for d in done)
                if label == "update":
                    last = target
            for p in procs:
                p.stdin.write("quit\n")  # type: ignore[union-attr]
                p.stdin.flush()  # type: ignore[union-attr]
                p.wait(timeout=60)
        if args.device.startswith("cuda") and "copy" in args.modes and args.source == "tensors":
            out["ipc_s"] = ipc(layout, make(layout, 2.0, args.device), args)
        client.close()
        try:
            src = torch.ones(sum(s[0] for _, s in layout), dtype=torch.bfloat16, device=args.device)
            dst = torch.empty_like(src)
        except torch.OutOfMemoryError:  # the daemon holds two generations: no room for two more copies
            out["copy_floor_s"] = None
        else:
            sync(args.device)
            started = time.monotonic()
            dst.copy_(src)
            sync(args.device)
            out["copy_floor_s"] = time.monotonic() - started
    finally:
        daemon.terminate()
        daemon.wait(timeout=60)
    if "ipc_s" in out and "in_place_update_s" in out:
        out["in_place_vs_ipc"] = out["ipc_s"] / out["in_place_update_s"]
    if "copy_update_s" in out and out["copy_floor_s"] is not None:
        out["copy_vs_floor"] = out["copy_floor_s"] / out["copy_update_s"]
    return out


IPC_ENGINE = r"""
import json, sys, time, torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor
device = sys.argv[1]
names, shapes = json.loads(sys.stdin.readline())
owned = {n: torch.empty(s, dtype=torch.bfloat16, device=device) for n, s in zip(names, shapes)}
torch.cuda.synchronize(device)
print("ready", flush=True)
import pickle, base64
handles = pickle.loads(base64.b64decode(sys.stdin.readline()))
index = torch.device(device).index or 0
for name, args in zip(names, handles):
    args = list(args)
    args[6] = index
    owned[name].copy_(rebuild_cuda_tensor(*args))
torch.cuda.synchronize(device)
print(json.dumps({"done": time.monotonic()}), flush=True)
sys.stdin.readline()
"""


def ipc(layout: list[tuple[str, tuple[int, ...]]], tensors: dict[str, Any], args: argparse.Namespace) -> float:
    """vLLM's ipc backend's path: per-tensor `reduce_tensor` handles (pickled, as over HTTP),
    rebuilt and copied into each engine's own tensors."""
    import base64
    import pickle

    from torch.multiprocessing.reductions import reduce_tensor

    procs = [subprocess.Popen([sys.executable, "-c", IPC_ENGINE, args.device], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for _ in range(args.engines)]
    for p in procs:
        p.stdin.write(json.dumps([[n for n, _ in layout], [list(s) for _, s in layout]]) + "\n")  # type: ignore[union-attr]
        p.stdin.flush()  # type: ignore[union-attr]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"  # type: ignore[union-attr]
    started = time.monotonic()
    handles = [reduce_tensor(tensors[n])[1] for n, _ in layout]
    line = base64.b64encode(pickle.dumps(handles)).decode() + "\n"
    for p in procs:
        p.stdin.write(line)  # type: ignore[union-attr]
        p.stdin.flush()  # type: ignore[union-attr]
    done = max(json.loads(p.stdout.readline())["done"] for p in procs)  # type: ignore[union-attr]
    for p in procs:
        p.stdin.write("\n")  # type: ignore[union-attr]
        p.stdin.flush()  # type: ignore[union-attr]
        p.wait(timeout=60)
    return done - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--tensors", type=int, default=1000)
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--modes", default="in_place,copy",
                        help="in_place, copy or both (copy-in engines each hold a copy: large sizes fit in place only)")
    parser.add_argument("--source", choices=("tensors", "arena"), default="tensors",
                        help="tensors: the trainer copies its own tensors in (the publish a trainer pays); arena: it "
                        "fills the new arena in place (64 GB on one H200: no room for the trainer's copy)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--engine", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--socket", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="place", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        engine(args)
        return
    out = run(args)
    if args.json:
        print(json.dumps(out))
        return
    for k, v in out.items():
        print(f"{k:>26}: {v:.4f}" if isinstance(v, float) else f"{k:>26}: {v}")


if __name__ == "__main__":
    main()
