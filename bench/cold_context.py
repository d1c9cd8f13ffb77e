"""Cold loads and the daemon's CUDA context (issue 14 items 2 and 5): how much of the cold gap to
fastsafetensors is the context and pinned staging a daemon makes for a load when none lingers.

Per round, page cache dropped before each, in rotation: fastsafetensors (fresh process, its CUDA
context up before the clock, as in bench_load); wcd whose staging lingers from a small load a few
seconds before (`staging_linger_s` default: the context and the pinned buffers are up); wcd with
`staging_linger_s = 0` (each load makes them: what a load pays when the last one was long ago).
The wcd clock is bench_load's: a fresh process importing the client, connecting, the `load` op.

    python bench/cold_context.py --device cuda:0 --ckpt 1.6:1000 --rounds 3 --out cold-context.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_load import Daemon, direct_read, drop_caches, peer, write_checkpoint  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "wcd-bench-load")
    p.add_argument("--ckpt", default="1.6:1000", help="GB:TENSORS")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if not drop_caches():
        sys.exit("cold_context: cannot drop the page cache (run as root)")
    gb, tensors = args.ckpt.split(":")
    d = args.dir / f"{gb}gb-{tensors}"
    files = write_checkpoint(d, int(float(gb) * 1e9), int(tensors), 4)
    small = args.dir / "0.1gb-200"
    write_checkpoint(small, int(0.1e9), 200, 1)
    nbytes = sum(f.stat().st_size for f in files)
    rows: dict[str, list[float]] = {"fastsafetensors": [], "wcd_context_up": [], "wcd_no_linger": [],
                                    "direct_read_GBps": []}
    with tempfile.TemporaryDirectory() as tmp:
        lingers = Daemon(Path(tmp) / "lingers", args.device)
        os.environ["BENCH_DAEMON_CONFIG"] = "staging_linger_s = 0"
        fresh = Daemon(Path(tmp) / "fresh", args.device)
        try:
            for r in range(args.rounds):
                drop_caches()
                rows["direct_read_GBps"].append(direct_read(files, 16) / 1e9)
                order = ["fastsafetensors", "wcd_context_up", "wcd_no_linger"]
                order = order[r % 3:] + order[: r % 3]
                for what in order:
                    if what == "wcd_context_up":
                        lingers.load(small, args.device, f"small-{r}")  # the context and staging up, evicted
                        time.sleep(1)
                    drop_caches()
                    if what == "fastsafetensors":
                        got = peer("fastsafetensors", args.device, files)
                        seconds = float(got["seconds"]) if "seconds" in got else float("nan")
                    else:
                        daemon = lingers if what == "wcd_context_up" else fresh
                        seconds = daemon.load(d, args.device, f"{what}-{r}")
                    rows[what].append(seconds)
                    print(json.dumps({"round": r, "what": what, "seconds": round(seconds, 3)}), flush=True)
        finally:
            lingers.stop()
            fresh.stop()
            logs = {name: (Path(tmp) / name / "daemon.log").read_text()[-4000:] for name in ("lingers", "fresh")}
    summary = {k: {"median": statistics.median(v), "all": [round(x, 3) for x in v]} for k, v in rows.items()}
    summary["GB"] = nbytes / 1e9
    print(json.dumps(summary))
    if args.out:
        args.out.write_text(json.dumps({"summary": summary, "daemon_logs": logs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
