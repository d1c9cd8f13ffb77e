"""Load benchmark (issue 14): the daemon's `load` op against the loaders users pick, warm and cold.

Per checkpoint (synthetic BF16, equal tensors, a few shards), one run, side by side:
  - ceilings: a plain page-cache -> memfd copy (host) or pinned host->device copy (GPU), and,
    cold, the disk's parallel O_DIRECT read bandwidth (several readers; no fio needed);
  - wcd `load` op through a real daemon (fingerprint + allocate + fill), as configured by default;
    `wcd-buffered` and the other `wcd-*` variants are further daemons (their settings: `variants`);
  - safetensors `load_file`, fastsafetensors, instanttensor, runai-model-streamer; a peer whose
    package is missing is reported as such.
Every loader runs in a fresh process that starts as an engine does, torch imported and the CUDA
context up, before its clock starts; wcd's clock then covers importing wcd.client, connecting and
the op. (Until 2026-12-03 wcd's process imported no torch: after a drop of the page cache its clock
started a few ms after the drop, the peers' after seconds of torch import; see `--settle`.)
Cold runs drop the page cache first (`sync; echo 3 > /proc/sys/vm/drop_caches`, root only);
`--cold-reps N` runs N cold rounds, the loaders' order rotated each round (on a VM a loader that
follows another over the same files can read faster: the hypervisor may keep what the guest dropped).
`--settle S` waits S seconds after each drop, before each cold load (a VM's disk may read faster
after an idle spell: `bench/disk_idle.py`). Each cold load records what the checkpoint's block
device saw while its clock ran (`/sys/dev/block/M:N/stat`): requests, their mean size, the time it
was busy and the mean queue.
Works with host arenas (`--device cpu`, any Linux VM) and on a GPU (`--device cuda:0`).
`BENCH_DAEMON_CONFIG="load_workers = 4"` adds lines (`;` between them) to the daemons' `[daemon]` table.

    python bench/bench_load.py --device cpu --ckpt 1.6:1000 --ckpt 1.6:100000 --out load.json
    python bench/bench_load.py --device cuda:0 --ckpt 16:1000 --ckpt 1.6:100000 --cold --out load.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from wcd.client import Client, connect  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
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


def write_checkpoint(d: Path, nbytes: int, tensors: int, shards: int) -> list[Path]:
    """Synthetic BF16 shards of equal tensors (content: a repeated random block; a load does not care)."""
    per = max(2, nbytes // tensors // 2 * 2)
    stamp = d / f".spec-{nbytes}-{tensors}-{shards}"
    files = [d / f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    if stamp.exists() and all(f.exists() for f in files):
        return files
    d.mkdir(parents=True, exist_ok=True)
    for f in d.glob("*.safetensors"):
        f.unlink()
    block = os.urandom(64 << 20)
    for i, f in enumerate(files):
        names = range(i * tensors // shards, (i + 1) * tensors // shards)
        header = {f"layers.{j}.weight": {"dtype": "BF16", "shape": [per // 2], "data_offsets": [k * per, (k + 1) * per]}
                  for k, j in enumerate(names)}
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(f, "wb") as out:
            out.write(len(raw).to_bytes(8, "little") + raw)
            left = per * len(names)
            while left:
                n = min(left, len(block))
                out.write(block[:n])
                left -= n
    stamp.touch()
    return files


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


class Daemon:
    def __init__(self, root: Path, device: str, cold_reads: str | None = None,
                 sets: dict[str, int] | None = None, config_lines: str = "") -> None:
        root.mkdir(exist_ok=True)
        self.socket = root / "wcd.sock"
        config = root / "wcd.toml"
        budget = '"90%"' if device != "cpu" else '"80%"'
        extra = os.environ.get("BENCH_DAEMON_CONFIG", "").replace(";", "\n")  # e.g. "load_workers = 4"
        reads = f'cold_reads = "{cold_reads}"' if cold_reads else ""  # none: the daemon's default
        config.write_text(f'[daemon]\nsocket = "{self.socket}"\nbudget = {{ "{device}" = {budget} }}\n'
                          f'{reads}\n{config_lines}\n{extra}\n')
        self.last_disk: list[str] = []  # the disk's counters as the last load's clock started and stopped
        self.log = open(root / "daemon.log", "wb")
        # `sets` (experiments, no config knobs): module constants set before the daemon starts,
        # e.g. {"wcd.arenas.cuda.COLD_READ_BYTES": 4 << 20}.
        start = ["-m", "wcd"] if not sets else [
            "-c", "import importlib, json, sys\n"
                  "for k, v in json.loads(sys.argv[1]).items():\n"
                  "    m, _, a = k.rpartition('.'); setattr(importlib.import_module(m), a, v)\n"
                  "from wcd.cli.wcd import main; sys.exit(main(sys.argv[2:]))", json.dumps(sets)]
        self.proc = subprocess.Popen([sys.executable, *start, "serve", "--config", str(config),
                                      "--log-level", os.environ.get("BENCH_DAEMON_LOG_LEVEL", "info")],
                                     stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)
        connect(self.socket, wait_s=60, while_alive=lambda: self.proc.poll() is None, heartbeats=False).close()

    def load(self, path: Path, device: str, name: str, verify: dict[str, object] | None = None) -> float:
        """Seconds of one `load` op; with `verify`, also times a `verify` op of the entry into it."""
        # Like the peers: a fresh process with torch up before its clock (`_ENGINE`).
        r = subprocess.run([sys.executable, "-c", _WCD_LOAD, str(self.socket), device, name, str(path)],
                           capture_output=True, text=True, timeout=3600, cwd=ROOT,
                           env={**os.environ, "BENCH_DISK_STAT": disk_stat_file(path) or "", "PYTHONPATH":
                                os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)})
        if r.returncode != 0:
            raise RuntimeError(f"wcd load failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
        got = json.loads(r.stdout.strip().splitlines()[-1])
        seconds, self.last_disk = float(got["seconds"]), got["disk"]
        with Client(self.socket, heartbeats=False, timeout=3600) as c:
            if verify is not None:
                start = time.perf_counter()
                verify["match"] = c.verify(name)["match"]
                verify["seconds"] = time.perf_counter() - start  # reads the arena and the files, hashes the arena
            c.evict(name)
        return seconds

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)
        self.log.close()


def peer(loader: str, device: str, files: list[Path]) -> dict[str, object]:
    r = subprocess.run([sys.executable, "-c", _PEER, loader, device, *map(str, files)], capture_output=True,
                       text=True, timeout=600, env={**os.environ, "BENCH_DISK_STAT": disk_stat_file(files[0]) or ""})
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["failed"])[-1]
        return {"error": last[:300]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "wcd-bench-load")
    ap.add_argument("--ckpt", action="append", help="GB:TENSORS, repeatable (default 1.6:1000 and 1.6:100000)")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--loaders", default=",".join(LOADERS))
    ap.add_argument("--cold", action="store_true", help="also with the page cache dropped (root)")
    ap.add_argument("--cold-reps", type=int, default=1,
                    help="cold rounds, the loaders' order rotated each round (best and median reported)")
    ap.add_argument("--settle", type=float, default=0.0,
                    help="seconds to wait after each drop, before each cold load (every loader alike)")
    ap.add_argument("--reps", type=int, default=2, help="warm repetitions (best is reported)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--daemon-log", type=Path, help="copy the daemon's log here at the end")
    args = ap.parse_args()
    from wcd.loader import default_workers

    loaders = [x for x in args.loaders.split(",") if x]
    specs = [(float(g), int(t)) for g, t in (s.split(":") for s in args.ckpt or ["1.6:1000", "1.6:100000"])]
    result: dict[str, object] = {"date": time.strftime("%Y-%m-%d %H:%M"), "host": platform.node(),
                                 "cpus": os.cpu_count(), "python": platform.python_version(),
                                 "device": args.device, "runs": []}
    runs: list[dict[str, object]] = result["runs"]  # type: ignore[assignment]
    with tempfile.TemporaryDirectory() as tmp:
        # "wcd" is the daemon as configured by default: cold files read with O_DIRECT in 512 KiB spans
        # (`cuda.DIRECT_READ_BYTES`) within ops of 16 MiB (`cuda.COLD_READ_BYTES`); "wcd-buffered"
        # reads them through the page cache, one 16 MiB read per op (the default until 2026-12-03);
        # "wcd-direct" with O_DIRECT in whole ops (the direct mode until then); "wcd-direct-tiled-1m"
        # in 1 MiB spans; "wcd-direct-tiled-24" with 24 loader threads (`load_workers`), not 16;
        # "wcd-direct-512k" in ops of 512 KiB or one tensor, read whole. Buffered: "wcd-noahead" reads
        # nothing ahead while its writer is being made (`loader.READ_AHEAD_BYTES` = 0; in round16, at
        # 10e6a00, it was the default config without the read-ahead its O_DIRECT loads do);
        # "wcd-sweep" in BENCH_SWEEP_BYTES reads (default 4 MiB), "wcd-direct-sweep" the same with
        # O_DIRECT; "wcd-chunk16" copies tensors larger than a read in 16 MiB ops (`checkpoint.CHUNK_BYTES`),
        # not 64 MiB. Tensors larger than a sweep's read are copied in ops of one read too
        # (`checkpoint.CHUNK_BYTES`): the loader threads then take the file one read at a time, in
        # order, whatever the tensors. A read has room for one more block: an op that starts inside
        # a block is still one O_DIRECT read. "wcd-sync" is the default, but waits for every buffer's
        # last copy without first asking whether it has finished (`cuda.QUERY_FIRST`);
        # "wcd-ahead128" reads up to 128 MiB ahead while its writer is made (`loader.READ_AHEAD_BYTES`),
        # the default until round20 (whose "wcd-ahead256" is today's default, and its "wcd" this). The
        # eighteenth round's "wcd" (Linux AIO, two O_DIRECT reads in flight per thread),
        # "wcd-aio4" and "wcd-preadv" (today's read loop) went with that code (b2a9445). Rounds before
        # 2026-12-03's thirteenth ran the names as bench_load.py defined them at the time (git log).
        sweep_bytes = int(os.environ.get("BENCH_SWEEP_BYTES", 4 << 20))
        sweep = {"wcd.arenas.cuda.COLD_READ_BYTES": sweep_bytes + 4096, "wcd.checkpoint.CHUNK_BYTES": sweep_bytes}
        whole = {"wcd.arenas.cuda.DIRECT_READ_BYTES": 0}
        variants: dict[str, tuple[str | None, dict[str, int]] | tuple[str, dict[str, int], str]] = {
            "wcd": (None, {}), "wcd-buffered": ("buffered", {}), "wcd-direct": ("direct", whole),
            "wcd-direct-tiled-1m": ("direct", {"wcd.arenas.cuda.DIRECT_READ_BYTES": 1 << 20}),
            "wcd-direct-tiled-24": ("direct", {}, "load_workers = 24"),
            "wcd-direct-512k": ("direct", {**whole, "wcd.arenas.cuda.COLD_READ_BYTES": 512 << 10}),
            "wcd-sweep": ("buffered", sweep), "wcd-direct-sweep": ("direct", {**whole, **sweep}),
            "wcd-noahead": ("buffered", {"wcd.loader.READ_AHEAD_BYTES": 0}),
            "wcd-chunk16": ("buffered", {"wcd.checkpoint.CHUNK_BYTES": 16 << 20}),
            "wcd-sync": (None, {"wcd.arenas.cuda.QUERY_FIRST": 0}),
            "wcd-ahead128": (None, {"wcd.loader.READ_AHEAD_BYTES": 128 << 20})}
        daemons = {name: Daemon(Path(tmp) / name, args.device, *variant)
                   for name, variant in variants.items() if name in loaders}
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
                        # As many readers as a load's threads, and 8 (the figure before 2026-12-01).
                        row["direct_read_GBps"] = direct_read(files, default_workers()) / 1e9
                        prepare()
                        row["direct_read_8_GBps"] = direct_read(files, 8) / 1e9
                    if args.device == "cpu":
                        best = 1e9
                        for _ in range(reps):
                            prepare()
                            best = min(best, plain_memfd_copy(files, default_workers()))
                        row["plain_memfd_copy_GBps"] = nbytes / best / 1e9
                    elif mode == "warm" and "h2d" not in result:
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
                                times[loader].append(daemons[loader].load(d, args.device, f"b{len(runs)}-{i}", verify))
                            except RuntimeError as e:  # one variant failing leaves the others' rounds
                                row[loader] = {"error": str(e)[:300]}
                                print(json.dumps({"mode": mode, "round": i, "loader": loader, **row[loader]}),
                                      flush=True)
                                continue
                            disk_seen = daemons[loader].last_disk
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
                        shown = {k: row[k] for k in ("gb", "tensors", "mode", loader) if k in row}
                        print(json.dumps(shown), flush=True)
                    runs.append(row)
                    print(json.dumps(row), flush=True)
        finally:
            for name, daemon in daemons.items():
                daemon.stop()
                if args.daemon_log:  # wcd's there, wcd-direct's beside it (NAME.wcd-direct.log)
                    log = args.daemon_log if name == "wcd" else args.daemon_log.with_suffix(f".{name}.log")
                    log.write_bytes((Path(tmp) / name / "daemon.log").read_bytes())
            if args.out:  # also what was measured before an interruption
                args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
