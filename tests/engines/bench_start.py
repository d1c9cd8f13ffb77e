"""Engine start-to-ready: vLLM's default loader against wcd's attach path, interleaved, medians.

    "$(tests/engines/setup-venv.sh)/bin/python" tests/engines/bench_start.py [--runs 3] [--server]

Starts a daemon, publishes each model once (first wcd start: disk + publish), then alternates
default-loader and wcd starts (each a fresh process, single-process mode as in the tests) and
prints the medians of: process start to `LLM()` ready (import + engine init + load), `LLM()`
alone, and the model runner's load_model. With --server, SmolLM2 through vLLM's OpenAI server
instead (`python -m vllm.entrypoints.openai.api_server`, multiprocess, the engine tests' flags):
process start to /health answering 200.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.engines import models  # noqa: E402
from tests.engines.conftest import ApiServer, Daemon, Engine, engine_env  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--server", action="store_true", help="time vLLM's OpenAI server instead of LLM()")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="wcd-bench-"))
    for sub in ("tmp", "vllm-cache", "hf-home"):
        (root / sub).mkdir()
    daemon = Daemon(root / "daemon").start()
    if args.server:
        try:
            return bench_server(root, daemon, args.runs)
        finally:
            daemon.stop()
            shutil.rmtree(root, ignore_errors=True)
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


def bench_server(root: Path, daemon: Daemon, runs: int) -> int:
    model = models.smollm2_dir()
    wcd = ["--load-format", "wcd", "--model-loader-extra-config", json.dumps({"socket": str(daemon.socket)})]
    n = 0

    def start(args: list[str]) -> tuple[float, str]:
        nonlocal n
        n += 1
        with ApiServer(model, root, args, root / f"server-{n}.log") as server:
            server.complete("The capital of France is")
            return server.ready_s, server.log()

    _, log = start(wcd)
    assert "published processed weights as entry" in log
    start([])  # warm-up: page cache
    times: dict[str, list[float]] = {"default loader": [], "wcd attach": []}
    for _ in range(runs):
        for label, args in (("default loader", []), ("wcd attach", wcd)):
            ready_s, log = start(args)
            if label == "wcd attach":
                assert "wcd: attached processed weights" in log
            times[label].append(ready_s)
    print(f"\n{'model':<14} {'loader':<16} {'server start->/health 200':>26}   (OpenAI server, medians of {runs}, "
          "seconds; each run:)")
    for label, ts in times.items():
        print(f"{'smollm2-135m':<14} {label:<16} {statistics.median(ts):>26.2f}   "
              f"{' '.join(f'{t:.2f}' for t in ts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
