"""Engine start-to-ready: vLLM's default loader against wcd's attach path, interleaved, medians.

    "$(tests/engines/setup-venv.sh)/bin/python" tests/engines/bench_start.py [--runs 3]

Starts a daemon, publishes each model once (first wcd start: disk + publish), then alternates
default-loader and wcd starts (each a fresh process, single-process mode as in the tests) and
prints the medians of: process start to `LLM()` ready (import + engine init + load), `LLM()`
alone, and the model runner's load_model.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.engines import models  # noqa: E402
from tests.engines.conftest import Daemon, Engine, engine_env  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="wcd-bench-"))
    for sub in ("tmp", "vllm-cache", "hf-home"):
        (root / sub).mkdir()
    daemon = Daemon(root / "daemon").start()
    n = 0

    def start(spec: dict) -> dict:
        nonlocal n
        n += 1
        r = Engine(spec, engine_env(root, daemon.socket), root / f"engine-{n}.log").finish()
        assert r["ok"], r.get("message")
        return r

    try:
        rows = []
        for name, spec in (("minilm", {"model": str(models.minilm_dir()), "runner": "pooling"}),
                           ("smollm2-135m", {"model": str(models.smollm2_dir())})):
            wcd = dict(spec, load_format="wcd", extra={"socket": str(daemon.socket)})
            first = start(wcd)
            assert first["wcd"]["path"] == "disk" and first["wcd"]["published"]
            start(spec)  # warm-up: first-run compile caches, page cache
            times: dict[str, list[tuple[float, float, float]]] = {"default loader": [], "wcd attach": []}
            for _ in range(args.runs):
                for label, s in (("default loader", spec), ("wcd attach", wcd)):
                    r = start(s)
                    if label == "wcd attach":
                        assert r["wcd"]["path"] == "attach", r["wcd"]
                    times[label].append((r["import_s"] + r["ready_s"], r["ready_s"], r["load_model_s"]))
            for label, ts in times.items():
                rows.append((name, label, *(statistics.median(x[i] for x in ts) for i in range(3))))
        print(f"\n{'model':<14} {'loader':<16} {'start->ready':>12} {'LLM() ready':>11} {'load_model':>10}   "
              f"(medians of {args.runs}, seconds)")
        for name, label, total, ready, load in rows:
            print(f"{name:<14} {label:<16} {total:>12.2f} {ready:>11.2f} {load:>10.3f}")
    finally:
        daemon.stop()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
