"""Generations on the GPU: a follower's tensors keep their device addresses while the arena behind
them changes (cuMemUnmap + cuMemMap at the same VA), a CUDA graph captured over them reads the new
generation on replay, and copy-in followers copy device to device. Bytes checked by hashes."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import torch

from tests.integration.conftest import make_daemon  # noqa: F401  (fixture)
from wcd.errors import BadRequest

pytestmark = pytest.mark.gpu

GPU_BUDGET = '[daemon.budget]\n"cuda:0" = "8GiB"\n'


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda:0").manual_seed(seed)
    out = {f"layers.{i}.w": torch.randn(1 << 16, generator=g, device="cuda:0", dtype=torch.bfloat16)
           for i in range(16)}
    out["embed"] = torch.randint(0, 1 << 30, (4096,), generator=g, device="cuda:0")
    return out


def digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def test_an_in_place_follower_keeps_its_addresses_and_a_captured_graph_reads_each_generation(
        make_daemon: Any) -> None:  # noqa: F811
    d = make_daemon(GPU_BUDGET)
    trainer, engine = d.client(), d.client()
    assert trainer.publish_generation("p", weights(1)) == 1
    follower = engine.follow("p")
    views = follower.tensors
    assert views["embed"].is_cuda and digest(views) == digest(weights(1))
    addresses = {n: t.data_ptr() for n, t in views.items()}

    out = torch.zeros((), device="cuda:0", dtype=torch.float32)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out.copy_(views["layers.3.w"].float().sum())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.allclose(out, weights(1)["layers.3.w"].float().sum())

    trainer.publish_generation("p", weights(2))
    assert follower.poll(timeout=10) == 2 and follower.update()
    assert {n: t.data_ptr() for n, t in follower.tensors.items()} == addresses
    assert digest(views) == digest(weights(2)), "the same tensors read generation 2's bytes"
    graph.replay()
    torch.cuda.synchronize()
    assert torch.allclose(out, weights(2)["layers.3.w"].float().sum()), "the captured graph reads generation 2"

    trainer.rollback("p")
    assert follower.update() and digest(views) == digest(weights(1))
    follower.close()
    trainer.close()
    engine.close()


def test_a_copy_in_follower_copies_each_generation_device_to_device(make_daemon: Any) -> None:  # noqa: F811
    d = make_daemon(GPU_BUDGET)
    trainer, engine = d.client(), d.client()
    trainer.publish_generation("p", weights(1))
    owned = {n: torch.empty_like(t) for n, t in weights(0).items()}
    follower = engine.follow("p", copy_into=owned)
    assert digest(owned) == digest(weights(1))
    trainer.publish_generation("p", weights(2))
    assert follower.update() and digest(owned) == digest(weights(2))
    follower.close()
    trainer.close()
    engine.close()


def test_a_generation_of_another_layout_leaves_the_follower_on_its_own(make_daemon: Any) -> None:  # noqa: F811
    d = make_daemon(GPU_BUDGET)
    trainer, engine = d.client(), d.client()
    trainer.publish_generation("p", weights(1))
    follower = engine.follow("p")
    wrong = dict(weights(2))
    wrong["embed"] = wrong["embed"].to(torch.int32)
    with pytest.raises(BadRequest, match="another layout"):
        trainer.publish_generation("p", wrong)
    assert follower.update() is False and digest(follower.tensors) == digest(weights(1))
    follower.close()
    trainer.close()
    engine.close()
