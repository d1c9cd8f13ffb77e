"""Admission CPU cost per phase (issue 14 item 4b): what the daemon does in Python before and
around the copy of a checkpoint, for few and many tensors of the same bytes.

Phases: `Checkpoint.open` (header parse and validation), `fingerprint`, `manifest()`,
`copy_plan`, `recheck` (the fingerprint again: the check after a fill) and `grouped()` (the wire
layout, built at the first acquire), each the median of `--reps` runs; `json` and `from_json` are
the bare `json.loads` and `pydantic_core.from_json` (what `open` parses with) of the headers, their
objects freed, cyclic GC off: the floor no per-tensor saving gets below; `open_helpers` is `open`
with `--helpers N` header helper processes (`wcd.header_helpers`). `load_op` is the load op's
CPU besides the copies (open, fingerprint, manifest, plan, recheck). Checkpoints are bench_load's
synthetic BF16 shards (written once).

    python bench/bench_admit.py --dir /var/tmp/wcd-admit --ckpt 1.6:1000 --ckpt 1.6:100000
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_load import write_checkpoint  # noqa: E402
from pydantic_core import from_json  # noqa: E402

from wcd import key  # noqa: E402
from wcd.checkpoint import Checkpoint  # noqa: E402
from wcd.header_helpers import HeaderHelpers  # noqa: E402


def bare_parse(files: list[Path], parse: Callable[[bytes], Any]) -> None:
    raws = []
    for f in files:
        with open(f, "rb") as src:
            raws.append(src.read(int.from_bytes(src.read(8), "little")))
    was = gc.isenabled()
    gc.disable()
    try:
        for raw in raws:
            parse(raw)
    finally:
        if was:
            gc.enable()


def phases(d: Path, files: list[Path], helpers: HeaderHelpers | None) -> dict[str, float]:
    out: dict[str, float] = {}

    def timed(name: str, f: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        result = f()
        out[name] = time.perf_counter() - start
        return result

    timed("json", lambda: bare_parse(files, json.loads))
    timed("from_json", lambda: bare_parse(files, lambda raw: from_json(raw, allow_inf_nan=True)))
    if helpers is not None:  # the same open, its large headers parsed by the helpers
        timed("open_helpers", lambda: Checkpoint.open(d, helpers=helpers)).close()
    with timed("open", lambda: Checkpoint.open(d)) as ckpt:
        timed("fingerprint", lambda: key.fingerprint(ckpt))
        manifest = timed("manifest", ckpt.manifest)
        timed("copy_plan", lambda: ckpt.copy_plan(manifest))
        timed("recheck", lambda: key.fingerprint(ckpt))
        timed("grouped", manifest.grouped)
    out["admission"] = out["open"] + out["manifest"] + out["copy_plan"] + out["grouped"]
    out["load_op"] = out["open"] + out["fingerprint"] + out["manifest"] + out["copy_plan"] + out["recheck"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=Path(os.environ.get("TMPDIR", "/var/tmp")) / "wcd-admit")
    p.add_argument("--ckpt", action="append", metavar="GB:TENSORS", help="default: 1.6:1000 and 1.6:100000")
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--helpers", type=int, default=0, help="header helper processes for open_helpers (0: not measured)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    helpers = HeaderHelpers(args.helpers) if args.helpers else None
    if helpers is not None:
        start = time.perf_counter()
        helpers.start()
        print(f"{args.helpers} header helpers started in {(time.perf_counter() - start) * 1e3:.0f} ms")
    results = []
    for spec in args.ckpt or ["1.6:1000", "1.6:100000"]:
        gb, tensors = spec.split(":")
        d = args.dir / f"{gb}gb-{tensors}"
        files = write_checkpoint(d, int(float(gb) * 1e9), int(tensors), args.shards)
        runs = [phases(d, files, helpers) for _ in range(args.reps)]
        median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        results.append({"gb": float(gb), "tensors": int(tensors), "median_s": median})
        print(f"{tensors:>7} tensors: " + "  ".join(f"{k} {v * 1e3:.1f} ms" for k, v in median.items())
              + f"  (admission / json: {median['admission'] / median['json']:.2f}; load_op / from_json: "
                f"{median['load_op'] / median['from_json']:.2f})")
    if helpers is not None:
        helpers.close()
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
