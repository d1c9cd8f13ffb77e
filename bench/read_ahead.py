"""What reading ahead while the writer is made buys (issue 14), on any machine, no GPU needed.

A GPU load with no context lingering waits ~0.1 s (0.096-0.124 s on the H200 machines) for its
writer's context and pinned staging before the first read; `fill_arena(reads_ahead=True)` asks
the kernel for the first READ_AHEAD_BYTES of a cold checkpoint meanwhile. Here the writer is a
host arena's, made to take `--wait` seconds (the stand-in for the GPU writer), and every round
drops the checkpoint's pages (POSIX_FADV_DONTNEED, no root needed) before the fill, with reads
ahead on and off alternately, order swapped each round. The clock is the whole `fill_arena`
call, the wait included. `--wait 0` is the lingering case: it must cost nothing there.

    python bench/read_ahead.py --dir /var/tmp/wcd-read-ahead --wait 0.1,0 --rounds 6
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_load import write_checkpoint  # noqa: E402
from wcd.arenas.host import HostArena, HostWriter  # noqa: E402
from wcd.checkpoint import Checkpoint  # noqa: E402
from wcd.loader import Progress, cached_fraction, fill_arena  # noqa: E402


class SlowWriterArena(HostArena):
    """A host arena whose writer takes `wait` seconds to make, as a GPU writer's context does; it
    notes how many of the checkpoint's bytes were in the page cache when the writer was ready."""

    wait = 0.0
    ckpt: Checkpoint | None = None
    cached_at_writer = 0.0

    def writer(self) -> HostWriter:
        time.sleep(self.wait)
        assert self.ckpt is not None
        self.cached_at_writer = sum(cached_fraction(fd) * os.fstat(fd).st_size for fd in self.ckpt.fds)
        return super().writer()


def fill_once(d: Path, wait: float, ahead: bool) -> tuple[float, float, float]:
    """Drop `d`'s pages, then one timed fill: (seconds, fraction cached before it, bytes cached
    when the writer was ready)."""
    with Checkpoint.open(d) as ckpt:
        for fd in ckpt.fds:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        before = max(cached_fraction(fd) for fd in ckpt.fds)
        manifest = ckpt.manifest()
        arena = SlowWriterArena(manifest.size, "read-ahead-bench")
        arena.wait, arena.ckpt = wait, ckpt
        try:
            t = time.perf_counter()
            fill_arena(arena, ckpt, manifest, Progress(ckpt.nbytes), reads_ahead=ahead)
            return time.perf_counter() - t, before, arena.cached_at_writer
        finally:
            arena.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path("/var/tmp/wcd-read-ahead"))
    ap.add_argument("--ckpt", default="1.6:1000", help="GB:TENSORS (four shards)")
    ap.add_argument("--wait", default="0.1,0", help="writer waits to try, seconds, comma-separated")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    gb, tensors = args.ckpt.split(":")
    d = args.dir / f"{gb}gb-{tensors}"
    write_checkpoint(d, int(float(gb) * 1e9), int(tensors), 4)
    nbytes = sum(f.stat().st_size for f in d.glob("*.safetensors"))
    result: dict[str, object] = {"date": time.strftime("%Y-%m-%d %H:%M"), "host": platform.node(),
                                 "cpus": os.cpu_count(), "bytes": nbytes, "rows": []}
    rows: list[dict[str, object]] = result["rows"]  # type: ignore[assignment]
    for wait in (float(w) for w in args.wait.split(",")):
        times: dict[bool, list[float]] = {True: [], False: []}
        ready: dict[bool, list[float]] = {True: [], False: []}  # MB cached when the writer was ready
        for r in range(args.rounds):
            for ahead in ((True, False) if r % 2 == 0 else (False, True)):
                s, before, at_writer = fill_once(d, wait, ahead)
                times[ahead].append(s)
                ready[ahead].append(at_writer / 1e6)
                print(json.dumps({"wait": wait, "round": r, "ahead": ahead, "s": round(s, 3),
                                  "cached_before": round(before, 3), "MB_at_writer": round(at_writer / 1e6, 1)}),
                      flush=True)
        rows.append({"wait_s": wait, **{("ahead" if a else "noahead"): {
            "median_s": statistics.median(times[a]), "all_s": times[a],
            "median_MB_at_writer": statistics.median(ready[a])} for a in (True, False)}})
        a, n = statistics.median(times[True]), statistics.median(times[False])
        print(f"writer wait {wait:.3f} s: {nbytes / 1e9:.2f} GB cold, median {a:.3f} s reading ahead, "
              f"{n:.3f} s not ({n - a:+.3f} s, {nbytes / a / 1e9:.2f} against {nbytes / n / 1e9:.2f} GB/s); "
              f"in the page cache when the writer was ready: {statistics.median(ready[True]):.0f} MB reading "
              f"ahead, {statistics.median(ready[False]):.0f} MB not (medians)")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
