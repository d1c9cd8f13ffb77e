"""Attach: as the engine sees it, side by side with what an engine would use instead. One run.

For each tensor count (default 1k, 10k, 100k) a synthetic transformer-shaped checkpoint is written
and loaded into a daemon. Then, in fresh processes that have already imported torch (and, on a
GPU, created their CUDA context: both are the engine's own costs, reported apart), each method's
clock runs from its first import to every tensor usable:

  wcd        import wcd.client, connect (hello), acquire, build the views; then re-acquire the same
             entry on that connection (what a process that has seen the entry pays again);
  ipc        per-tensor sharing with torch's reductions, as vLLM's Fast Start and SGLang's weight
             daemon do: a producer process holds the tensors and pickles them with torch's reductions;
             the consumer unpickles, which rebuilds every tensor (legacy CUDA IPC on a GPU, shared
             memory files on the host);
  load_file  safetensors `load_file(device=...)` of every shard (page cache warm); on the host also
             followed by a copy into the engine's own tensors (safetensors maps the file lazily).

With several `--variant`s, each variant's daemon serves the same checkpoints and its wcd rows
follow one another (the peers are measured once per count).

    python bench/bench_attach.py --device cpu --counts 1000,100000 --json attach-host.json
    python bench/bench_attach.py --device cuda:0 --json attach-h200.json
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import common
from common import ROOT as REPO
from common import Daemon, write_shaped_checkpoint

# Every consumer starts with the engine's own costs (torch, CUDA context), timed apart.
_PRELUDE = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
device = sys.argv[1]
if device != "cpu":
    torch.zeros(1, device=device)
prelude_s = time.perf_counter() - t0
out = {"prelude_s": prelude_s}
"""

_WCD = _PRELUDE + r"""
sock, name, reps = sys.argv[2], sys.argv[3], int(sys.argv[4])
t0 = time.perf_counter()
from wcd.client import Client
t1 = time.perf_counter()
c = Client(sock)
t2 = time.perf_counter()
lease = c.acquire(name)
tensors = lease.tensors
t3 = time.perf_counter()
out.update(import_s=t1 - t0, connect_s=t2 - t1, acquire_views_s=t3 - t2, total_s=t3 - t0, tensors=len(tensors))
lease.release()
del tensors
again = []
for _ in range(reps):
    t = time.perf_counter()
    lease = c.acquire(name)
    tensors = lease.tensors
    again.append(time.perf_counter() - t)
    del tensors
    lease.release()
out["reacquire_s"] = sorted(again)[len(again) // 2]
print(json.dumps(out))
"""

_IPC_PRODUCER = r"""
import sys, torch
import torch.multiprocessing as mp
from multiprocessing.reduction import ForkingPickler
from safetensors.torch import load_file
device, ckpt, dump = sys.argv[1], sys.argv[2], sys.argv[3]
mp.set_sharing_strategy("file_system")
tensors = {}
for f in sorted(__import__("pathlib").Path(ckpt).glob("*.safetensors")):
    tensors.update(load_file(f, device=device))
if device == "cpu":
    for t in tensors.values():
        t.share_memory_()
with open(dump, "wb") as f:  # torch's reductions, as torch.multiprocessing queues use them
    f.write(ForkingPickler.dumps(tensors))
print("ready", flush=True)
sys.stdin.read()  # hold the tensors until the benchmark closes our stdin
"""

_IPC = _PRELUDE + r"""
t0 = time.perf_counter()
import pickle
import torch.multiprocessing as mp
mp.set_sharing_strategy("file_system")
with open(sys.argv[2], "rb") as f:
    tensors = pickle.load(f)  # rebuilds every tensor from its handle
if device != "cpu":
    torch.cuda.synchronize()
t1 = time.perf_counter()
out.update(total_s=t1 - t0, tensors=len(tensors))
print(json.dumps(out))
"""

_LOAD_FILE = _PRELUDE + r"""
t0 = time.perf_counter()
from safetensors.torch import load_file
import pathlib
tensors = {}
for f in sorted(pathlib.Path(sys.argv[2]).glob("*.safetensors")):
    tensors.update(load_file(f, device=device))
if device != "cpu":
    torch.cuda.synchronize()
t1 = time.perf_counter()
out.update(total_s=t1 - t0, tensors=len(tensors))
if device == "cpu":
    owned = {k: v.clone() for k, v in tensors.items()}
    out["with_copy_s"] = time.perf_counter() - t0
print(json.dumps(out))
"""


def consumer(script: str, *args: str) -> dict[str, Any]:
    res = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, cwd=str(REPO))
    if res.returncode:
        raise SystemExit(f"consumer failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--counts", default="1000,10000,100000")
    ap.add_argument("--sizes-mb", default=None, help="checkpoint size per count (default: 16 GB, 16 GB, 1.6 GB on "
                                                      "a GPU; 1 GiB, 1 GiB, 1.6 GB on the host)")
    ap.add_argument("--reps", type=int, default=3, help="fresh processes per method and count")
    ap.add_argument("--dir", type=Path, default=None)
    args = ap.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    gpu = args.device != "cpu"
    default_mb = {1000: 16000 if gpu else 1024, 10000: 16000 if gpu else 1024, 100000: 1600}
    sizes = ([int(s) for s in args.sizes_mb.split(",")] if args.sizes_mb
             else [default_mb.get(c, 1024) for c in counts])

    res = {**common.run_info(args.device, args.variant), "host": host(args.device), "reps": args.reps, "rows": []}
    rows: list[dict[str, Any]] = res["rows"]
    with tempfile.TemporaryDirectory(prefix="wcd-attach-", dir=args.dir) as tmp, contextlib.ExitStack() as stack:
        root = Path(tmp)
        models = ""
        ckpts = {}
        for n, mb in zip(counts, sizes):
            ckpts[n] = write_shaped_checkpoint(root / f"ckpt-{n}", mb * 1_000_000, n)
            models += (f'[[models]]\nname = "n{n}"\npath = "{ckpts[n]}"\ndevice = "{args.device}"\n'
                       'retention = "cached"\n')
        budget = f'budget = {{ "{args.device}" = "90%" }}\n' if gpu else ""
        daemons = [stack.enter_context(Daemon(root / v.name, v, budget + models)) for v in args.variant]
        from wcd.client import Client

        for daemon in daemons:
            with Client(daemon.socket) as c:
                for n in counts:
                    with c.acquire(f"n{n}"):  # waits for the daemon's load
                        pass
        for n in counts:
            dump = root / f"ipc-{n}.pickle"
            cmd = [sys.executable, "-c", _IPC_PRODUCER, args.device, str(ckpts[n]), str(dump)]
            producer = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, cwd=str(REPO))
            try:
                assert producer.stdout is not None and producer.stderr is not None
                ipc_ok = producer.stdout.readline().strip() == "ready"
                ipc_error = "" if ipc_ok else producer.stderr.read().strip().splitlines()[-1][:300]
                runs: dict[str, list[dict[str, Any]]] = {"ipc": [], "load_file": []}
                runs.update({d.variant.name: [] for d in daemons})
                for _ in range(args.reps):  # interleaved, so drift hits every method alike
                    for d in daemons:
                        runs[d.variant.name].append(consumer(_WCD, args.device, str(d.socket), f"n{n}", "5"))
                    if ipc_ok:
                        runs["ipc"].append(consumer(_IPC, args.device, str(dump)))
                    runs["load_file"].append(consumer(_LOAD_FILE, args.device, str(ckpts[n])))
            finally:
                if producer.stdin:
                    producer.stdin.close()
                producer.wait()
                dump.unlink(missing_ok=True)
            nbytes = sum(f.stat().st_size for f in ckpts[n].iterdir())
            for d in daemons:
                rows.append(summarize(n, nbytes, {**runs, "wcd": runs[d.variant.name]}, ipc_error, d.variant.name))
                print(json.dumps(rows[-1]), flush=True)  # partial results survive a timeout
            common.write_json(args.json, res)
    print(report(res))
    common.write_json(args.json, res)


def med(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def summarize(n: int, nbytes: int, runs: dict[str, list[dict[str, Any]]], ipc_error: str,
              variant: str) -> dict[str, Any]:
    w = runs["wcd"]
    for r in runs.values():
        assert all(x["tensors"] == n for x in r), "a method did not produce every tensor"
    row = {"tensors": n, "variant": variant, "bytes": nbytes, "prelude_s": med(w, "prelude_s"),
           "wcd": {k: med(w, k) for k in ("import_s", "connect_s", "acquire_views_s", "total_s", "reacquire_s")},
           "wcd_total_all": [x["total_s"] for x in w],
           "ipc_s": med(runs["ipc"], "total_s") if runs["ipc"] else None,
           "ipc_all": [x["total_s"] for x in runs["ipc"]], "ipc_error": ipc_error,
           "load_file_s": med(runs["load_file"], "total_s")}
    if "with_copy_s" in runs["load_file"][0]:
        row["load_file_copy_s"] = med(runs["load_file"], "with_copy_s")
    return row


def report(res: dict[str, Any]) -> str:
    ms = lambda s: f"{s * 1e3:.1f}"  # noqa: E731
    lines = [f"# attach, {res['device']}, {res['host']}, {res['date']}; medians of {res['reps']} fresh processes",
             "", "| tensors | variant | size | wcd import | connect | acquire+views | **wcd total** | re-acquire | "
             "per-tensor IPC | load_file | IPC / wcd | load_file / wcd |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        w = r["wcd"]
        ipc = ms(r["ipc_s"]) if r["ipc_s"] is not None else f"failed: {r['ipc_error'][:80]}"
        ipc_ratio = f"{r['ipc_s'] / w['total_s']:.1f}x" if r["ipc_s"] is not None else "-"
        lf = ms(r["load_file_s"]) + (f" ({ms(r['load_file_copy_s'])} with copy)" if "load_file_copy_s" in r else "")
        lines.append(f"| {r['tensors']:,} | {r['variant']} | {r['bytes'] / 1e9:.1f} GB | {ms(w['import_s'])} | "
                     f"{ms(w['connect_s'])} | "
                     f"{ms(w['acquire_views_s'])} | **{ms(w['total_s'])}** | {ms(w['reacquire_s'])} | "
                     f"{ipc} | {lf} | {ipc_ratio} | "
                     f"{r['load_file_s'] / w['total_s']:.1f}x |")
    lines.append("")
    lines.append(f"(ms; not counted above: the engine's own `import torch`"
                 f"{' + CUDA context' if res['device'] != 'cpu' else ''}, median "
                 f"{ms(statistics.median(r['prelude_s'] for r in res['rows']))} ms)")
    return "\n".join(lines)


def host(device: str) -> str:
    desc = f"{platform.node()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    try:
        import torch

        desc += f", torch {torch.__version__}"
        if device != "cpu":
            desc += f", {torch.cuda.get_device_name(0)}"
    except ImportError:
        pass
    return desc


if __name__ == "__main__":
    main()
