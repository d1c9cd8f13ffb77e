"""Admit: the CPU cost of admitting a checkpoint, per phase: what the daemon does in Python before
and around the copy of a checkpoint, for few and many tensors of the same bytes.

Phases: `Checkpoint.open` (header parse and validation), `fingerprint`, `manifest()`,
`copy_plan`, `recheck` (the fingerprint again: the check after a fill) and `grouped()` (the wire
layout, built at the first acquire), each the median of `--reps` runs; `json` and `from_json` are
the bare `json.loads` and `pydantic_core.from_json` (what `open` parses with) of the headers, their
objects freed, cyclic GC off: the floor no per-tensor saving gets below; `open_helpers` is `open`
with `--helpers N` header helper processes (`wcd.header_helpers`). `load_op` is the load op's
CPU besides the copies (open, fingerprint, manifest, plan, recheck). Checkpoints are bench_load's
synthetic BF16 shards (written once). A `--variant`'s tuning is passed to the plan here (its daemon
config does not apply: no daemon runs); each variant's phases are measured in turn.

    python bench/bench_admit.py --dir /var/tmp/wcd-admit --ckpt 1.6:1000 --ckpt 1.6:100000 --helpers 8
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import common
from common import write_checkpoint
from pydantic_core import from_json

from wcd import key
from wcd.checkpoint import Checkpoint
from wcd.header_helpers import HeaderHelpers
from wcd.tuning import LoadTuning


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


def phases(d: Path, files: list[Path], helpers: HeaderHelpers | None, tuning: LoadTuning) -> dict[str, float]:
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
        timed("copy_plan", lambda: ckpt.copy_plan(manifest, chunk=tuning.chunk_bytes))
        timed("recheck", lambda: key.fingerprint(ckpt))
        timed("grouped", manifest.grouped)
    out["admission"] = out["open"] + out["manifest"] + out["copy_plan"] + out["grouped"]
    out["load_op"] = out["open"] + out["fingerprint"] + out["manifest"] + out["copy_plan"] + out["recheck"]
    return out


def main() -> None:
    p = common.parser(__doc__)
    p.add_argument("--dir", type=Path, default=Path(os.environ.get("TMPDIR", "/var/tmp")) / "wcd-admit")
    p.add_argument("--ckpt", action="append", metavar="GB:TENSORS", help="default: 1.6:1000 and 1.6:100000")
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--helpers", type=int, default=0, help="header helper processes for open_helpers (0: not measured)")
    args = p.parse_args()
    helpers = HeaderHelpers(args.helpers) if args.helpers else None
    result: dict[str, Any] = {**common.run_info("cpu", args.variant), "helpers": args.helpers, "rows": []}
    if helpers is not None:
        start = time.perf_counter()
        helpers.start()
        result["helpers_start_s"] = time.perf_counter() - start
        print(f"{args.helpers} header helpers started in {result['helpers_start_s'] * 1e3:.0f} ms")
    try:
        for gb, tensors in common.ckpt_specs(args.ckpt):
            d = args.dir / f"{gb:g}gb-{tensors}"
            files = write_checkpoint(d, int(gb * 1e9), tensors, args.shards)
            for v in args.variant:
                runs = [phases(d, files, helpers, LoadTuning(**v.tuning)) for _ in range(args.reps)]
                median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                result["rows"].append({"gb": gb, "tensors": tensors, "variant": v.name, "median_s": median})
                shown = "  ".join(f"{k} {x * 1e3:.1f} ms" for k, x in median.items())
                print(f"{tensors:>7} tensors, {v.name}: {shown}"
                      + f"  (admission / json: {median['admission'] / median['json']:.2f}; load_op / from_json: "
                        f"{median['load_op'] / median['from_json']:.2f})", flush=True)
    finally:
        if helpers is not None:
            helpers.close()
        common.write_json(args.json, result)


if __name__ == "__main__":
    main()
