"""A running vLLM OpenAI server takes a new generation of a wcd series through vLLM's own RL
endpoints (`backend: wcd`), without a restart, and answers as a fresh server on that generation."""

from __future__ import annotations

import json
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


def test_a_running_server_takes_generation_2_and_rolls_back(make_daemon: Any, engine_root: Path,
                                                            smollm2: Path) -> None:
    d = make_daemon()
    trainer = Client(d.socket)
    assert trainer.publish_generation("policy", load_file(smollm2 / "model.safetensors")) == 1
    args = ["--load-format", "wcd", "--model-loader-extra-config", json.dumps({"socket": str(d.socket)}),
            "--weight-transfer-config", json.dumps({"backend": "wcd"})]
    gen2_dir = engine_root / "smollm2-gen2"
    gen2 = second_generation(smollm2, gen2_dir)
    with ApiServer(smollm2, engine_root, args, engine_root / "transfer-1.log", env=DEV) as server:
        server.post("/init_weight_transfer_engine", {"init_info": {"series": "policy", "socket": str(d.socket)}})
        first = server.complete(PROMPT)
        assert first.startswith(" Paris"), first

        committed = time.perf_counter()
        assert trainer.publish_generation("policy", gen2) == 2
        publish_s = time.perf_counter() - committed
        update_s = update(server, "policy", 2)
        changed = server.complete(PROMPT)
        first_token_s = time.perf_counter() - committed
        assert changed != first, "generation 2 is what the server answers with now"
        log = server.log()
        assert "wcd: took generation 2 of 'policy'" in log, log[-3000:]

        assert trainer.rollback("policy")["generation"] == 1
        update(server, "policy", None)  # the current one: 1 again
        assert server.complete(PROMPT) == first, "rolled back: generation 1's answer again"
        pid = server.proc.pid
    NOTES.append(f"vLLM CPU weight update: publish {publish_s:.2f} s, update {update_s:.2f} s, trainer commit "
                   f"to the first answer of generation 2 {first_token_s:.2f} s")
    assert pid > 0
    trainer.close()
    with ApiServer(gen2_dir, engine_root, [], engine_root / "transfer-fresh.log") as fresh:
        assert fresh.complete(PROMPT) == changed, "the updated server answers as a fresh one on generation 2"
