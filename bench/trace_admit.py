"""The admission of a many-tensor checkpoint with header helpers, taken apart in time (issue 14
item 4b): when each batch goes to a helper and when its answer comes back, what the calling
thread does after the last answer, and each step of the admission alone (open, parse, the
fingerprint beside it, layout, plan), next to what one piece costs to parse in this process.

    python bench/trace_admit.py --helpers 8 --ckpt /tmp/wcd-bench-load/1.6gb-100000
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from wcd import header_helpers  # noqa: E402
from wcd.checkpoint import Shards  # noqa: E402
from wcd.headers import header_columns, member_pieces
from wcd.key import first_fingerprint  # noqa: E402

events: list[tuple[float, str, int, int]] = []
_t0 = 0.0


def _patch() -> None:
    """Record each batch's send and each answer's arrival (the helper's id, the batch's bytes)."""
    send, receive = header_helpers._Helper.send, header_helpers._Helper.receive

    def traced_send(self: Any, jobs: list[tuple[bytes, int]]) -> None:
        events.append((time.perf_counter() - _t0, "send", self.proc.pid, sum(len(r) for r, _ in jobs)))
        send(self, jobs)

    def traced_receive(self: Any, jobs: list[tuple[bytes, int]]) -> list[bytes]:
        events.append((time.perf_counter() - _t0, "answer", self.proc.pid, sum(len(r) for r, _ in jobs)))
        return receive(self, jobs)

    header_helpers._Helper.send = traced_send  # type: ignore[method-assign]
    header_helpers._Helper.receive = traced_receive  # type: ignore[method-assign]


def _ms(s: float) -> float:
    return round(s * 1e3, 2)


def main() -> None:
    global _t0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", type=Path, required=True)
    p.add_argument("--helpers", type=int, default=8)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--pieces-per-helper", default="", help="comma-separated PIECES_PER_HELPER values to sweep "
                   "(each: --reps parses, medians reported); default: the module's")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    helpers = header_helpers.HeaderHelpers(args.helpers)
    helpers.start()
    time.sleep(0.5)
    _patch()
    pool = ThreadPoolExecutor(2)
    runs = []
    for _ in range(args.reps):
        run: dict[str, Any] = {}
        start = time.perf_counter()
        shards = Shards.open(args.ckpt)
        run["open_ms"] = _ms(time.perf_counter() - start)
        events.clear()
        ckpt = None  # the last run's, freed before the clock starts
        _t0 = time.perf_counter()
        ckpt = shards.parse(helpers)
        run["parse_ms"] = _ms(time.perf_counter() - _t0)
        run["last_answer_ms"] = _ms(max((t for t, kind, _, _ in events if kind == "answer"), default=0.0))
        run["events"] = [(_ms(t), kind, pid, n) for t, kind, pid, n in events]
        start = time.perf_counter()
        first_fingerprint(shards)
        run["fingerprint_ms"] = _ms(time.perf_counter() - start)
        start = time.perf_counter()
        manifest = ckpt.manifest()
        run["layout_ms"] = _ms(time.perf_counter() - start)
        start = time.perf_counter()
        ckpt.copy_plan(manifest)
        run["plan_ms"] = _ms(time.perf_counter() - start)
        ckpt.close()
        shards = Shards.open(args.ckpt)  # as the daemon runs them: parse and fingerprint at once
        start = time.perf_counter()
        both = [pool.submit(shards.parse, helpers), pool.submit(first_fingerprint, shards)]
        both[1].result()
        both[0].result().close()  # after the fingerprint: it reads through these descriptors
        run["parse_beside_fingerprint_ms"] = _ms(time.perf_counter() - start)
        runs.append(run)
        print(json.dumps({k: v for k, v in run.items() if k != "events"}))
    sweep: dict[str, dict[str, float]] = {}
    for value in [int(v) for v in args.pieces_per_helper.split(",") if v]:
        header_helpers.PIECES_PER_HELPER = value
        parses, tails, jobs_n = [], [], 0
        for _ in range(args.reps):
            shards = Shards.open(args.ckpt)
            events.clear()
            _t0 = time.perf_counter()
            ckpt = shards.parse(helpers)
            parses.append(time.perf_counter() - _t0)
            ckpt.close()
            del ckpt  # freed outside the clock (as the daemon frees it: after the fill, in a thread)
            tails.append(parses[-1] - max((t for t, kind, _, _ in events if kind == "answer"), default=0.0))
            jobs_n = sum(1 for _, kind, _, _ in events if kind == "send")
        sweep[str(value)] = {"parse_ms": _ms(statistics.median(parses)), "best_ms": _ms(min(parses)),
                             "after_last_answer_ms": _ms(statistics.median(tails)), "batches": jobs_n}
        print(f"pieces per helper {value}: {json.dumps(sweep[str(value)])}")
    print("events of the last run (ms, what, helper pid, bytes):")
    for e in runs[-1]["events"]:
        print("  ", e)
    # One piece as a helper parses it, here, warm, cyclic GC off (as in a helper).
    shards = Shards.open(args.ckpt)
    raw, start_, size = shards.raws[0]
    jobs, _ = header_helpers.split([(raw, size - start_)], args.helpers)
    piece = jobs[0][0]
    gc.disable()
    costs = []
    for _ in range(5):
        start = time.perf_counter()
        columns = header_columns(piece, size - start_, lenient=False, in_pieces=False)
        middle = time.perf_counter()
        header_helpers._encode(columns)  # type: ignore[arg-type]
        costs.append((middle - start, time.perf_counter() - middle))
    gc.enable()
    shards.close()
    piece_info = {"pieces_of_first_header": len(jobs), "piece_bytes": len(piece),
                  "columns_ms": _ms(min(c for c, _ in costs)), "encode_ms": _ms(min(e for _, e in costs)),
                  "member_pieces_ms": None}
    start = time.perf_counter()
    member_pieces(raw, len(raw) // max(1, len(jobs)))
    piece_info["member_pieces_ms"] = _ms(time.perf_counter() - start)
    print(json.dumps(piece_info))
    summary = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k.endswith("_ms")}
    print("medians:", json.dumps(summary))
    helpers.close()
    if args.out:
        args.out.write_text(json.dumps({"runs": runs, "piece": piece_info, "medians": summary, "sweep": sweep},
                                       indent=1) + "\n")


if __name__ == "__main__":
    main()
