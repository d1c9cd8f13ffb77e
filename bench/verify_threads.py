"""`verify` and `digest` passes over one arena with a range of thread counts, for 1,000 and 100,000
tensors of the same bytes (`loader.digest_threads`: how many threads a pass of small tensors uses).

    python bench/verify_threads.py --device cuda:0 --threads 16,8,4,2 --reps 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_load import write_checkpoint  # noqa: E402

from wcd import loader  # noqa: E402
from wcd.checkpoint import Checkpoint  # noqa: E402
from wcd.loader import Progress, digest_arena, fill_arena, verify_arena  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/wcd-bench-load"))
    ap.add_argument("--threads", default="16,8,4,2")
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    counts = [int(n) for n in args.threads.split(",")]
    chosen = loader.digest_threads
    out = []
    for tensors in (1000, 100_000):
        d = args.dir / f"1.6gb-{tensors}"
        write_checkpoint(d, int(1.6e9), tensors, 4)
        with Checkpoint.open(d) as ckpt:
            manifest = ckpt.manifest()
            if args.device == "cpu":
                from wcd.arenas.host import HostArena

                arena = HostArena(manifest.size, "bench")
            else:
                from wcd.arenas.cuda import CudaBackend

                backend = CudaBackend()
                uuid = backend.canonical(args.device)
                arena = backend.create(uuid, backend.arena_size(manifest.size, uuid), "bench")
            try:
                fill_arena(arena, ckpt, ckpt.copy_plan(manifest), Progress(ckpt.nbytes), workers=8)
                default = chosen(len(manifest), manifest.nbytes, 1 << 30)
                row = {"tensors": tensors, "default_threads": default, "verify_s": {}, "digest_s": {}}
                for n in counts:
                    loader.digest_threads = lambda *_, n=n: n  # type: ignore[assignment]
                    v, g = [], []
                    for _ in range(args.reps):
                        t = time.perf_counter()
                        assert not verify_arena(arena, manifest, ckpt)[1]
                        v.append(time.perf_counter() - t)
                        t = time.perf_counter()
                        digest_arena(arena, manifest)
                        g.append(time.perf_counter() - t)
                    row["verify_s"][n] = round(statistics.median(v), 3)
                    row["digest_s"][n] = round(statistics.median(g), 3)
                    print(json.dumps({"tensors": tensors, "threads": n, "verify_s": row["verify_s"][n],
                                      "digest_s": row["digest_s"][n]}), flush=True)
                out.append(row)
            finally:
                arena.close()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
