"""Load: the daemon's `load` op against the loaders users pick, warm and cold, side by side.

Per checkpoint (synthetic BF16, equal tensors, a few shards), one run:
  - ceilings: a plain page-cache -> memfd copy (host) or pinned host->device copy (GPU), and,
    cold, the disk's parallel O_DIRECT read bandwidth (several readers; no fio needed);
  - wcd's `load` op through a real daemon (fingerprint + allocate + fill), one daemon per
    `--variant` (`wcd` is the default variant, `wcd-NAME` the others);
  - safetensors `load_file`, fastsafetensors, instanttensor, runai-model-streamer; a peer whose
    package is missing is reported as such.
Every loader runs in a fresh process that starts as an engine does, torch imported and the CUDA
context up, before its clock starts; wcd's clock then covers importing wcd.client, connecting and
the op. Cold runs drop the page cache first (root only); `--cold-reps N` runs N cold rounds, the
loaders' order rotated each round (on a VM a loader that follows another over the same files can
read faster: the hypervisor may keep what the guest dropped); `--settle S` waits S seconds after
each drop. Each cold load records what the checkpoint's block device saw while its clock ran
(`/sys/dev/block/M:N/stat`): requests, their mean size, the time it was busy and the mean queue.
Prints a line per loader and round, then a summary (`--summarize FILE` prints a stored run's).

    python bench/bench_load.py --device cpu --ckpt 1.6:1000 --ckpt 1.6:100000 --json load.json
    python bench/bench_load.py --device cuda:0 --ckpt 1.6:1000 --cold --cold-reps 5 \
        --loaders wcd,fastsafetensors --variant default,buffered --json load.json
"""

from __future__ import annotations

import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import common
from common import ROOT, Daemon, Variant, write_checkpoint

from wcd.client import Client

LOADERS = ("wcd", "safetensors", "fastsafetensors", "instanttensor", "runai")

# Every loader runs in a fresh process that starts as an engine would: torch imported and, on a GPU,
# its CUDA context up before the clock starts (after a drop of the page cache, that import reads the
# same disk for every loader alike). Each reads the disk's counters (BENCH_DISK_STAT, a sysfs stat
# file) as its clock starts and stops, and prints one JSON line.
_ENGINE = r"""
import json, os, sys, time
stat = os.environ.get("BENCH_DISK_STAT")
import torch
if sys.argv[2].startswith("cuda"):
    torch.zeros(1, device=sys.argv[2]); torch.cuda.synchronize()
start = time.perf_counter()
disk = [open(stat).read()] if stat else []
"""

# A peer: argv = loader, device, files...
_PEER = _ENGINE + r"""
loader, device, files = sys.argv[1], sys.argv[2], sys.argv[3:]
out = {}
n = 0
if loader == "safetensors":
    from safetensors.torch import load_file
    for f in files:
        n += sum(t.numel() * t.element_size() for t in load_file(f, device=device).values())
elif loader == "fastsafetensors":
    from fastsafetensors import fastsafe_open
    with fastsafe_open(filenames=files, nogds=True, device=device) as f:
        for k in f.keys():
            t = f.get_tensor(k); n += t.numel() * t.element_size()
elif loader == "instanttensor":
    import instanttensor
    with instanttensor.safe_open(files, framework="pt", device=device) as f:
        for k, t in f.tensors():
            n += t.numel() * t.element_size()
elif loader == "runai":
    from runai_model_streamer import SafetensorsStreamer
    with SafetensorsStreamer() as s:
        s.stream_files(files)
        for _, t in s.get_tensors():
            t = t.to(device); n += t.numel() * t.element_size()
if device.startswith("cuda"):
    torch.cuda.synchronize()
out["seconds"] = time.perf_counter() - start
out["disk"] = disk + [open(stat).read()] if stat else []
out["bytes"] = n
print(json.dumps(out))
"""


# The wcd `load` op: argv = socket, device, name, path. The clock covers importing the client,
# connecting and the op: what an engine asking for a load (or `wcdctl load`) pays.
_WCD_LOAD = _ENGINE + r"""
from wcd.client import Client
with Client(sys.argv[1], heartbeats=False, timeout=3600) as c:
    c.load(sys.argv[3], sys.argv[4], device=sys.argv[2], wait=True)
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "disk": disk + [open(stat).read()] if stat else []}))
"""


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def disk_stat_file(path: Path) -> str | None:
    """The sysfs counters file of the block device holding `path` (Documentation/block/stat.rst)."""
    st = path.stat()
    stat = f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat"
    return stat if os.path.exists(stat) else None


def disk_stats(path: Path) -> str | None:
    stat = disk_stat_file(path)
    return Path(stat).read_text() if stat else None


def disk_delta(before: str | None, after: str | None, seconds: float) -> dict[str, float]:
    """Reads, merges, mean request size and busy time between two readings of the disk's counters."""
    if not before or not after:
        return {}
    d = [int(b) - int(a) for a, b in zip(before.split(), after.split())]
    reads, merges, sectors, read_ms, busy_ms = d[0], d[1], d[2], d[3], d[9]
    return {"reads": reads, "merges": merges, "MB": round(sectors * 512 / 1e6, 1),
            "KiB_per_read": round(sectors / 2 / reads, 1) if reads else 0.0,
            "busy_s": busy_ms / 1e3, "busy_of_wall": round(busy_ms / 1e3 / seconds, 3) if seconds else 0.0,
            "mean_queue": round(read_ms / 1e3 / seconds, 2) if seconds else 0.0}


def warm(files: list[Path]) -> None:
    for f in files:
        with open(f, "rb") as src:
            while src.read(64 << 20):
                pass


def plain_memfd_copy(files: list[Path], workers: int) -> float:
    """Ceiling for host arenas: memfd + fallocate + parallel sendfile of 64 MiB ranges, no daemon."""
    sizes = [f.stat().st_size for f in files]
    start = time.perf_counter()
    fd = os.memfd_create("bench", os.MFD_CLOEXEC)
    os.posix_fallocate(fd, 0, sum(sizes))
    jobs, base = [], 0
    for f, size in zip(files, sizes):
        jobs += [(f, pos, base + pos, min(64 << 20, size - pos)) for pos in range(0, size, 64 << 20)]
        base += size
    local = threading.local()

    def one(job: tuple[Path, int, int, int]) -> None:
        f, pos, at, n = job
        if getattr(local, "out", None) is None:
            local.out = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY)
        src = os.open(f, os.O_RDONLY)
        try:
            os.lseek(local.out, at, os.SEEK_SET)
            while n:
                k = os.sendfile(local.out, src, pos, n)
                pos, n = pos + k, n - k
        finally:
            os.close(src)

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, jobs))
    seconds = time.perf_counter() - start
    os.close(fd)
    return seconds


def direct_read(files: list[Path], readers: int, block: int = 16 << 20) -> float:
    """The disk's parallel O_DIRECT read bandwidth: `readers` threads, `block`-byte aligned reads."""
    jobs = [(f, pos) for f in files for pos in range(0, f.stat().st_size // block * block, block)]
    local = threading.local()

    def one(job: tuple[Path, int]) -> int:
        f, pos = job
        if getattr(local, "buf", None) is None:
            local.buf = mmap.mmap(-1, block)
        fd = os.open(f, os.O_RDONLY | os.O_DIRECT)
        try:
            return os.preadv(fd, [local.buf], pos)
        finally:
            os.close(fd)

    start = time.perf_counter()
    with ThreadPoolExecutor(readers) as pool:
        total = sum(pool.map(one, jobs))
    return total / (time.perf_counter() - start)


def pinned_h2d(device: str) -> float:
    import torch

    src = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(4):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return 4 * (1 << 30) / (time.perf_counter() - start)


def wcd_daemon(root: Path, v: Variant, device: str, log_level: str) -> Daemon:
    budget = '"90%"' if device != "cpu" else '"80%"'
    return Daemon(root / v.name, v, f'budget = {{ "{device}" = {budget} }}\n', log_level=log_level, wait_s=60)


def wcd_load(daemon: Daemon, path: Path, device: str, name: str,
             verify: dict[str, object] | None = None) -> tuple[float, list[str]]:
    """Seconds of one `load` op and the disk's counters as its clock started and stopped; with
    `verify`, also times a `verify` op of the entry into it. The entry is evicted after."""
    # Like the peers: a fresh process with torch up before its clock (`_ENGINE`).
    r = subprocess.run([sys.executable, "-c", _WCD_LOAD, str(daemon.socket), device, name, str(path)],
                       capture_output=True, text=True, timeout=3600, cwd=ROOT,
                       env={**os.environ, "BENCH_DISK_STAT": disk_stat_file(path) or "", "PYTHONPATH":
                            os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)})
    if r.returncode != 0:
        raise RuntimeError(f"wcd load failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
    got = json.loads(r.stdout.strip().splitlines()[-1])
    with Client(daemon.socket, heartbeats=False, timeout=3600) as c:
        if verify is not None:
            start = time.perf_counter()
            verify["match"] = c.verify(name)["match"]
            verify["seconds"] = time.perf_counter() - start  # reads the arena and the files, hashes the arena
        c.evict(name)
    return float(got["seconds"]), got["disk"]


def peer(loader: str, device: str, files: list[Path]) -> dict[str, object]:
    r = subprocess.run([sys.executable, "-c", _PEER, loader, device, *map(str, files)], capture_output=True,
                       text=True, timeout=600, env={**os.environ, "BENCH_DISK_STAT": disk_stat_file(files[0]) or ""})
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["failed"])[-1]
        return {"error": last[:300]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def loader_name(v: Variant) -> str:
    return "wcd" if v.name == "default" else f"wcd-{v.name}"


def main() -> int:
    ap = common.parser(__doc__)
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "wcd-bench-load")
    ap.add_argument("--ckpt", action="append", help="GB:TENSORS, repeatable (default 1.6:1000 and 1.6:100000)")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--loaders", default=",".join(LOADERS), help="wcd (each --variant) and peers, comma-separated")
    ap.add_argument("--cold", action="store_true", help="also with the page cache dropped (root)")
    ap.add_argument("--cold-reps", type=int, default=1,
                    help="cold rounds, the loaders' order rotated each round (best and median reported)")
    ap.add_argument("--settle", type=float, default=0.0,
                    help="seconds to wait after each drop, before each cold load (every loader alike)")
    ap.add_argument("--reps", type=int, default=2, help="warm repetitions (best is reported)")
    ap.add_argument("--daemon-log", type=Path, help="copy the default daemon's log here (others' beside it)")
    ap.add_argument("--log-level", default="info", help="the daemons' log level")
    ap.add_argument("--summarize", type=Path, nargs="+", metavar="JSON", help="print stored runs' summaries; no run")
    args = ap.parse_args()
    if args.summarize:
        for path in args.summarize:
            print("\n".join(summary(json.loads(path.read_text()), str(path))))
        return 0
    from wcd.loader import default_workers

    variants: dict[str, Variant] = {loader_name(v): v for v in args.variant}
    loaders = []
    for x in args.loaders.split(","):
        loaders += list(variants) if x == "wcd" else [x] if x else []
    specs = common.ckpt_specs(args.ckpt)
    result: dict[str, object] = {**common.run_info(args.device, args.variant), "runs": []}
    runs: list[dict[str, object]] = result["runs"]  # type: ignore[assignment]
    with tempfile.TemporaryDirectory() as tmp:
        daemons = {name: wcd_daemon(Path(tmp), v, args.device, args.log_level)
                   for name, v in variants.items() if name in loaders}
        try:
            for gb, tensors in specs:
                d = args.dir / f"{gb:g}gb-{tensors}"
                files = write_checkpoint(d, int(gb * 1e9), tensors, args.shards)
                nbytes = sum(f.stat().st_size for f in files)
                modes = ["warm"] + (["cold"] if args.cold else [])
                for mode in modes:
                    row: dict[str, object] = {"gb": nbytes / 1e9, "tensors": tensors, "mode": mode}
                    if mode == "cold" and not drop_caches():
                        row["error"] = "cannot drop the page cache (not root)"
                        runs.append(row)
                        continue

                    def prepare(mode: str = mode, files: list[Path] = files) -> None:
                        if mode == "cold":
                            drop_caches()
                        else:
                            warm(files)

                    reps = args.reps if mode == "warm" else 1
                    if mode == "cold":
                        prepare()
                        # As many readers as a load's threads, and 8.
                        row["direct_read_GBps"] = direct_read(files, default_workers()) / 1e9
                        prepare()
                        row["direct_read_8_GBps"] = direct_read(files, 8) / 1e9
                    if args.device == "cpu":
                        best = 1e9
                        for _ in range(reps):
                            prepare()
                            best = min(best, plain_memfd_copy(files, default_workers()))
                        row["plain_memfd_copy_GBps"] = nbytes / best / 1e9
                    elif mode == "warm" and "pinned_h2d_GBps" not in result:
                        result["pinned_h2d_GBps"] = pinned_h2d(args.device) / 1e9
                    # Warm: each loader's reps back to back. Cold: round after round, the loaders' order
                    # rotated each round (the hypervisor may keep what the guest dropped: a loader right
                    # after another read the same files reads faster).
                    if mode == "warm":
                        schedule = [(loader, i) for loader in loaders for i in range(reps)]
                    else:
                        schedule = [(loader, i) for i in range(args.cold_reps)
                                    for loader in loaders[i % len(loaders):] + loaders[: i % len(loaders)]]
                    times: dict[str, list[float]] = {loader: [] for loader in loaders}
                    for loader, i in schedule:
                        if isinstance(row.get(loader), dict) and "error" in row[loader]:  # type: ignore[operator]
                            continue
                        prepare()
                        if mode == "cold":
                            time.sleep(args.settle)
                        if loader in daemons:
                            verify: dict[str, object] | None = \
                                {} if loader == "wcd" and mode == "warm" and i == 0 else None
                            try:
                                seconds, disk_seen = wcd_load(daemons[loader], d, args.device, f"b{len(runs)}-{i}",
                                                              verify)
                            except RuntimeError as e:  # one variant failing leaves the others' rounds
                                row[loader] = {"error": str(e)[:300]}
                                print(json.dumps({"mode": mode, "round": i, "loader": loader, **row[loader]}),
                                      flush=True)
                                continue
                            times[loader].append(seconds)
                            if verify:
                                row["wcd_verify"] = {**verify, "GBps_each_side": nbytes / verify["seconds"] / 1e9}  # type: ignore[operator]
                        else:
                            got = peer(loader, args.device, files)
                            if "error" in got:
                                row[loader] = got
                                continue
                            times[loader].append(float(got["seconds"]))  # type: ignore[arg-type]
                            disk_seen = got.get("disk") or []  # type: ignore[assignment]
                        if mode == "cold":  # what the disk saw while the load's clock ran
                            disk = disk_delta(*(disk_seen or [None, None])[:2], times[loader][-1])
                            row.setdefault("disk", []).append({"loader": loader, "round": i, **disk})  # type: ignore[union-attr]
                            print(json.dumps({"mode": mode, "round": i, "loader": loader,
                                              "seconds": round(times[loader][-1], 3), "disk": disk}), flush=True)
                    for loader in loaders:
                        got_times = times[loader]
                        if got_times:  # first: the first load of this run (for wcd: before staging lingers)
                            failed = row.get(loader) if isinstance(row.get(loader), dict) else {}
                            row[loader] = {**failed, "seconds": min(got_times),  # type: ignore[dict-item]
                                           "GBps": nbytes / min(got_times) / 1e9,
                                           "median_seconds": statistics.median(got_times),
                                           "first_seconds": got_times[0], "all_seconds": got_times}
                    runs.append(row)
                    common.write_json(args.json, result)
        finally:
            for name, daemon in daemons.items():
                daemon.stop()
                if args.daemon_log:  # the default's there, wcd-NAME's beside it (LOG.wcd-NAME.log)
                    log = args.daemon_log if name == "wcd" else args.daemon_log.with_suffix(f".{name}.log")
                    log.write_bytes(daemon.log_path.read_bytes())
            common.write_json(args.json, result)  # also what was measured before an interruption
    print("\n".join(summary(result)))
    return 0


def summary(result: dict[str, Any], title: str = "") -> list[str]:
    """A line per checkpoint and cache state: each loader's best seconds (with the median and the
    first of several), the ceilings; per cold row, a line per loader with the disk's rate while
    busy, its mean request and queue (medians over the rounds)."""
    lines = [f"{title or 'load'}: {result.get('device', '?')}, {result.get('revision', '?')}, {result.get('date', '?')}"
             + (f"; pinned H2D {result['pinned_h2d_GBps']:.1f} GB/s" if "pinned_h2d_GBps" in result else "")]
    for row in result["runs"]:
        parts = [f"{row['gb']:.1f} GB/{row['tensors']} {row['mode']}:"]
        for key, value in row.items():
            if isinstance(value, dict) and "seconds" in value and key != "wcd_verify":
                several = len(value.get("all_seconds", [])) > 1
                extra = (f" (median {value['median_seconds']:.3f}, first {value['first_seconds']:.3f})"
                         if several else "")
                parts.append(f"{key} {value['seconds']:.3f}{extra}")
            elif isinstance(value, dict) and "error" in value:
                parts.append(f"{key} error: {value['error'][:80]}")
            elif key.endswith("GBps"):
                parts.append(f"{key} {value:.2f}")
        verify = row.get("wcd_verify")
        if isinstance(verify, dict):
            parts.append(f"verify {verify['seconds']:.3f} s match={verify['match']}")
        lines.append(" ".join(parts))
        seen: dict[str, list[dict[str, float]]] = {}
        for d in row.get("disk", []):
            if d.get("busy_s"):
                seen.setdefault(d["loader"], []).append(d)
        for loader, ds in seen.items():
            lines.append(f"  {loader}: disk {statistics.median(d['MB'] / 1e3 / d['busy_s'] for d in ds):.2f} GB/s "
                         f"while busy ({statistics.median(d['busy_of_wall'] for d in ds):.0%} of the clock), "
                         f"{statistics.median(d['KiB_per_read'] for d in ds):.0f} KiB per request, "
                         f"queue {statistics.median(d['mean_queue'] for d in ds):.1f} ({len(ds)} loads)")
    return lines


if __name__ == "__main__":
    sys.exit(main())
