"""A running vLLM OpenAI server takes a new generation of a wcd series through vLLM's own RL
endpoints (`backend: wcd`), without a restart, and answers as a fresh server on that generation.

TP=2 too: every worker runs the backend, so each rank leases the generation itself and feeds it to
its own `load_weights`, which keeps that rank's shard. The fresh server compared with has the same
TP size: the same shards and the same all-reduce order give the same floats, so greedy output must
be identical; TP=1 sums in another order and may break a near-tie differently."""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs the engines venv: tests/engines/setup-venv.sh (make test-engines)")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from tests.engines.conftest import NOTES, ApiServer  # noqa: E402
from wcd.client import Client  # noqa: E402

PROMPT = "The capital of France is"
DEV = {"VLLM_SERVER_DEV_MODE": "1"}  # vLLM serves its RL endpoints (/pause, /update_weights, ...) only then


def second_generation(model: Path, out: Path) -> dict[str, torch.Tensor]:
    """Generation 2: the checkpoint with noise on every decoder layer; written as a model folder
    too, for the fresh server to compare with."""
    tensors = load_file(model / "model.safetensors")
    g = torch.Generator().manual_seed(2)
    changed = {n: (t + 0.05 * torch.randn(t.shape, generator=g, dtype=t.dtype)) if ".layers." in n else t
               for n, t in tensors.items()}
    shutil.copytree(model, out, ignore=shutil.ignore_patterns("model.safetensors"))
    save_file(changed, out / "model.safetensors")
    return changed


def update(server: ApiServer, series: str, generation: int | None) -> float:
    """vLLM's update sequence for a trainer; its seconds."""
    started = time.perf_counter()
    server.post("/pause")
    server.post("/start_weight_update")
    server.post("/update_weights", {"update_info": {"series": series, "generation": generation}})
    server.post("/finish_weight_update")
    server.post("/resume")
    return time.perf_counter() - started


def tp_args(tp: int) -> tuple[list[str], dict[str, str]]:
    """Server flags and environment for `tp` ranks (one worker process per rank, one core each: vLLM's
    CPU backend binds each rank to its own NUMA node by default and refuses with fewer nodes)."""
    if tp == 1:
        return [], {}
    return ["--tensor-parallel-size", str(tp), "--distributed-executor-backend", "mp"], \
        {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i) for i in range(tp))}


def ranks_that(log: str, marker: str) -> dict[int, list[int]]:
    """tp_rank -> pids of the worker processes whose log lines contain `marker` (TP > 1)."""
    found: dict[int, list[int]] = {}
    for rank, pid in re.findall(r"\(Worker_TP(\d+) pid=(\d+)\)[^\n]*" + re.escape(marker), log):
        found.setdefault(int(rank), []).append(int(pid))
    return found


def refused_update(server: ApiServer, first: str) -> None:
    server.post("/pause")
    server.post("/start_weight_update")
    status, body = server.refused("/update_weights", {"update_info": {"series": "policy", "generation": 9}})
    assert status >= 400 and "policy@9" in body, (status, body)
    server.post("/resume")
    assert server.complete(PROMPT) == first, "a refused update leaves the model as it was"


@pytest.mark.parametrize("tp", [1, 2])
def test_a_running_server_takes_generation_2_and_rolls_back(make_daemon: Any, engine_root: Path,
                                                            request: pytest.FixtureRequest, tp: int) -> None:
    # SmolLM2's 9 heads / 3 KV heads split over no TP size > 1: TP=2 runs it padded with zero heads.
    smollm2: Path = request.getfixturevalue("smollm2" if tp == 1 else "smollm2_even_heads")
    d = make_daemon()
    tp_flags, tp_env = tp_args(tp)
    trainer = Client(d.socket)
    assert trainer.publish_generation("policy", load_file(smollm2 / "model.safetensors")) == 1
    args = ["--load-format", "wcd", "--model-loader-extra-config", json.dumps({"socket": str(d.socket)}),
            "--weight-transfer-config", json.dumps({"backend": "wcd"}), *tp_flags]
    gen2_dir = engine_root / f"smollm2-gen2-tp{tp}"
    gen2 = second_generation(smollm2, gen2_dir)
    with ApiServer(smollm2, engine_root, args, engine_root / f"transfer-tp{tp}.log", env={**DEV, **tp_env}) as server:
        server.post("/init_weight_transfer_engine", {"init_info": {"series": "policy", "socket": str(d.socket)}})
        first = server.complete(PROMPT)
        assert first.startswith(" Paris"), first

        if tp == 1:
            # A generation that does not exist: refused before anything loads (vLLM then ends the
            # update without a finish); the server answers on generation 1 as before. Not at TP=2:
            # vLLM 0.32's multiprocess executor stops reading replies at the first failed worker
            # (multiproc_executor.py, get_response), so the other ranks' refusals answer its next
            # calls. tests/integration/test_transfer_ranks.py tests that every rank refuses.
            refused_update(server, first)

        committed = time.perf_counter()
        assert trainer.publish_generation("policy", gen2) == 2
        publish_s = time.perf_counter() - committed
        update_s = update(server, "policy", 2)
        changed = server.complete(PROMPT)
        first_token_s = time.perf_counter() - committed
        assert changed != first, "generation 2 is what the server answers with now"
        log = server.log()
        assert "wcd: took generation 2 of 'policy'" in log, log[-3000:]
        if tp > 1:  # every rank took it, each in its own worker process
            took = ranks_that(log, "wcd: took generation 2 of 'policy'")
            assert sorted(took) == list(range(tp)), log[-3000:]
            assert len({pid for pids in took.values() for pid in pids}) == tp, took
        held = [x for x in d.leases() if x["entry"].startswith("policy@")]
        assert not held, f"each rank's lease on the generation ends with its update: {held}"

        assert trainer.rollback("policy")["generation"] == 1
        update(server, "policy", None)  # the current one: 1 again
        assert server.complete(PROMPT) == first, "rolled back: generation 1's answer again"
        if tp > 1:
            assert sorted(ranks_that(server.log(), "wcd: took generation 1 of 'policy'")) == list(range(tp))
    NOTES.append(f"vLLM CPU weight update (TP={tp}): publish {publish_s:.2f} s, update {update_s:.2f} s, trainer "
                 f"commit to the first answer of generation 2 {first_token_s:.2f} s")
    trainer.close()
    with ApiServer(gen2_dir, engine_root, tp_flags, engine_root / f"transfer-fresh-tp{tp}.log", env=tp_env) as fresh:
        assert fresh.complete(PROMPT) == changed, "the updated server answers as a fresh one on generation 2"
