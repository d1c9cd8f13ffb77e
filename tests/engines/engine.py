"""Start one real vLLM engine, run a fixed workload, print the results as one JSON line.

Run by the engine tests in a fresh process per engine start (vLLM keeps process-wide state), with
the environment the test prepared (TMPDIR, VLLM_CACHE_ROOT, HF_HOME inside its tmp dir,
HF_HUB_OFFLINE=1, single-process mode unless the test asks otherwise):

    python tests/engines/engine.py '{"model": DIR, "runner": "pooling"|"generate", "load_format": "auto"|"wcd",
                                     "extra": {...}, "dtype": "float32", "prompts": [...], "tp": 1,
                                     "remove_vllm_names": ["module:attr", ...]}'

The stdout line `RESULT {json}` carries: ok, timings (import_s, ready_s = LLM() constructor, i.e.
engine start to ready), the wcd plugin's record of what it did (`wcd`), and the outputs:
embeddings as hex of their float32 bytes (bit-exact comparison), or greedy token ids with the
chosen tokens' logprobs and the top-k logprob dicts. With "hold_s", the process then prints
HOLDING and keeps the engine alive that long (the test inspects the daemon's leases meanwhile);
a line "again" on stdin reruns the workload and prints `AGAIN {json}`. "tp" > 1 runs that many
tensor-parallel worker processes; "remove_vllm_names" deletes those vLLM names after `import vllm`
(what a vLLM release that moved them looks like to the plugin).
"""

from __future__ import annotations

import json
import os
import select
import sys
import time
import traceback


def main() -> int:
    spec = json.loads(sys.argv[1])
    result: dict = {"ok": False, "pid": os.getpid()}
    t0 = time.perf_counter()
    try:
        from vllm import LLM

        result["import_s"] = time.perf_counter() - t0
        for name in spec.get("remove_vllm_names", ()):
            _remove(name)  # as if a vLLM release had moved it
        if spec.get("load_format") == "wcd" and not _entry_point_installed():
            # Without the pyproject entry point (vllm.general_plugins) vLLM cannot find the plugin;
            # in single-process mode registering it here is equivalent.
            from wcd.integrations.vllm import register

            register()
            result["registered_by_hand"] = True
        kwargs = dict(
            model=spec["model"], dtype=spec.get("dtype", "float32"), enforce_eager=True,
            kv_cache_memory_bytes=1 << 30, max_model_len=256, seed=0,
            load_format=spec.get("load_format", "auto"),
        )
        tp = int(spec.get("tp", 1))
        if tp > 1:
            # One worker process per rank. vLLM's CPU backend binds each rank's threads to its own NUMA
            # node by default and refuses when there are fewer nodes than ranks (one here): one core each.
            kwargs.update(tensor_parallel_size=tp, distributed_executor_backend="mp")
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(tp)))
        elif os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0":
            kwargs["distributed_executor_backend"] = "uni"
        if spec.get("runner"):
            kwargs["runner"] = spec["runner"]
        if spec.get("extra") is not None:
            kwargs["model_loader_extra_config"] = spec["extra"]
        _time_model_loading(result)
        t1 = time.perf_counter()
        llm = LLM(**kwargs)
        result["ready_s"] = time.perf_counter() - t1
        result["wcd"] = _wcd_record()
        if spec.get("probe_external") and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
            # What this engine's loader reports as weight memory held outside the engine (vLLM asks on
            # GPUs before loading; the CPU worker never asks, so ask here, with the engine up).
            from vllm.model_executor.model_loader import get_model_loader

            vllm_config = llm.llm_engine.vllm_config
            result["external_weight_memory"] = get_model_loader(vllm_config.load_config) \
                .get_external_weight_memory(vllm_config)
        result.update(_workload(llm, spec))
        result["ok"] = True
    except BaseException as e:  # noqa: BLE001 - reported to the test
        result.update(error=type(e).__name__, message=str(e), traceback=traceback.format_exc()[-4000:])
        result["wcd"] = _wcd_record()
    print("RESULT " + json.dumps(result), flush=True)
    if result["ok"] and spec.get("hold_s"):
        # Keep the engine (and its lease) alive while the test looks at the daemon. Commands on stdin:
        # "again" runs the workload once more (e.g. after the daemon was killed) and prints AGAIN {json}.
        print("HOLDING", flush=True)
        deadline = time.monotonic() + float(spec["hold_s"])
        while time.monotonic() < deadline:
            ready, _, _ = select.select([sys.stdin], [], [], 0.5)
            if not ready:
                continue
            line = sys.stdin.readline()
            if not line or line.strip() == "exit":
                break
            if line.strip() == "again":
                try:
                    again = dict(_workload(llm, spec), ok=True)
                except BaseException as e:  # noqa: BLE001
                    again = {"ok": False, "error": type(e).__name__, "message": str(e)}
                print("AGAIN " + json.dumps(again), flush=True)
    return 0


def _workload(llm, spec: dict) -> dict:  # type: ignore[no-untyped-def]
    import torch
    from vllm import SamplingParams

    out: dict = {}
    prompts = spec.get("prompts") or ["The capital of France is"]
    if spec.get("runner") == "pooling":
        outs = llm.embed(prompts, use_tqdm=False)
        out["embeddings"] = [
            torch.tensor(o.outputs.embedding, dtype=torch.float32).numpy().tobytes().hex() for o in outs]
    else:
        params = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 12), logprobs=5, seed=0)
        outs = llm.generate(prompts, params, use_tqdm=False)
        out["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
        out["text"] = [o.outputs[0].text for o in outs]
        out["logprobs"] = [
            [{str(tok): lp.logprob for tok, lp in step.items()} for step in o.outputs[0].logprobs] for o in outs]
        out["chosen_logprobs"] = [
            [step[tok].logprob for tok, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs]
    return out


def _time_model_loading(result: dict) -> None:
    """Record how long the model runner's load_model takes (model build + weights + post-processing)."""
    try:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    except ImportError:
        return
    inner = CPUModelRunner.load_model

    def load_model(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        try:
            return inner(self, *args, **kwargs)
        finally:
            result["load_model_s"] = time.perf_counter() - t

    CPUModelRunner.load_model = load_model


def _remove(name: str) -> None:
    """Delete `module:attr` from vLLM in this process, after vLLM's own loaders imported it (a vLLM that
    lacks a name does not use it itself)."""
    import importlib

    importlib.import_module("vllm.model_executor.model_loader")
    module, _, attr = name.partition(":")
    delattr(importlib.import_module(module), attr)


def _entry_point_installed() -> bool:
    from importlib.metadata import entry_points

    return any(ep.name == "wcd" for ep in entry_points(group="vllm.general_plugins"))


def _wcd_record() -> dict | None:
    mod = sys.modules.get("wcd.integrations.vllm")
    record = getattr(mod, "last_load", None) if mod is not None else None
    return dict(record) if record else None


if __name__ == "__main__":
    sys.exit(main())
