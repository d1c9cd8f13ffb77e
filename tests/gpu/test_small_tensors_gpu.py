"""Many small tensors onto a GPU: runs of 16,000-byte tensors (padded to 16,128 in the arena, so
every op scatters) and odd sizes among them, loaded through a real daemon and through the CUDA
writer directly with either copy path (2D copies or preadv gathers) and staging buffers that cut
rows, then compared byte for byte with what safetensors reads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.gpu.test_daemon_gpu import GPU_BUDGET, expected_tensors, gpu_model
from tests.integration.conftest import make_daemon, same  # noqa: F401  (fixtures)

pytestmark = pytest.mark.gpu

MiB = 1 << 20


def small_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t: dict[str, torch.Tensor] = {}
    for i in range(3000):  # experts of one shape: 16,000 bytes each
        t[f"layers.{i // 100:02d}.experts.{i % 100:03d}.w"] = torch.randn(8000, generator=g).to(torch.bfloat16)
    for i in range(300):  # the same bytes in another shape, and a run of 2-D ones
        t[f"layers.{i // 100:02d}.experts.{i % 100:03d}.v"] = torch.randn(80, 100, generator=g).to(torch.bfloat16)
    for i in range(40):  # unpadded (a multiple of 256 bytes): contiguous in the arena too
        t[f"layers.{i:02d}.norm"] = torch.randn(4096, generator=g).to(torch.bfloat16)
    for i in range(30):  # narrow rows: gathered
        t[f"layers.{i:02d}.scale"] = torch.randn(24, generator=g).to(torch.bfloat16)
    t.update({
        "odd.i8": torch.randint(-128, 127, (3,), dtype=torch.int8, generator=g),
        "odd.i8.wide": torch.randint(-128, 127, (16001,), dtype=torch.int8, generator=g),
        "odd.bf16": torch.randn(8001, generator=g).to(torch.bfloat16),
        "odd.one": torch.randn(1, generator=g).to(torch.bfloat16),
        "odd.f32": torch.randn(5, 7, generator=g),
        "odd.fp8": torch.randn(1000, generator=g).to(torch.float8_e4m3fn),
        "odd.mask": torch.rand(13, generator=g) > 0.5,
        "odd.empty": torch.zeros(0, 8, dtype=torch.bfloat16),
        "odd.scalar": torch.tensor(2.5, dtype=torch.float64),
        "big": torch.randn(3 << 20, generator=g).to(torch.bfloat16),  # 6 MiB: a direct copy among the runs
    })
    return t


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("small") / "ckpt"
    d.mkdir()
    tensors = small_tensors()
    names = sorted(tensors)
    for s in range(4):
        part = names[s * len(names) // 4 : (s + 1) * len(names) // 4]
        save_file({n: tensors[n] for n in part}, str(d / f"model-{s + 1:05d}-of-00004.safetensors"))
    return d


def test_daemon_loads_many_small_tensors_exactly(make_daemon: Any, small_ckpt: Path) -> None:  # noqa: F811
    d = make_daemon(GPU_BUDGET + gpu_model(small_ckpt))
    expected = expected_tensors(small_ckpt)
    with d.client() as c:
        with c.acquire("m") as lease:
            assert set(lease.tensors) == set(expected)
            for name, want in expected.items():
                got = lease.tensors[name]
                assert got.is_cuda and same(got.cpu(), want), name
            del got
        assert c.verify("m")["match"] is True
    assert d.stop() == 0


def test_a_cold_load_lands_exactly_and_does_not_stall_the_loop(make_daemon: Any, small_ckpt: Path) -> None:  # noqa: F811
    """Cold (`cold_reads = "direct"`, the default): the big tensor's ops read with O_DIRECT, the
    small tensors' scattered ops buffered in 16 MiB reads, which grow the fresh loader lanes'
    pinned buffers (cuMemHostAlloc) while other loader threads queue copies keeping the GIL
    (`HeldCalls`). A second client's pings must stay fast all the while, and every byte land."""
    import os

    from tests.integration.pings import assert_fast, pinging

    d = make_daemon(GPU_BUDGET)
    expected = expected_tensors(small_ckpt)
    for shard in sorted(small_ckpt.glob("*.safetensors")):
        fd = os.open(shard, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    with pinging(d) as pings, d.client() as c:
        c.load("m", small_ckpt, device="cuda:0", wait=True)
    assert_fast(pings)
    with d.client() as c, c.acquire("m") as lease:
        for name, want in expected.items():
            got = lease.tensors[name]
            assert same(got.cpu(), want), name
        del got
    assert d.stop() == 0


@pytest.mark.parametrize("path", ["chosen", "scatter", "gather"])
@pytest.mark.parametrize("staging", [4 * MiB, 40_000])
def test_writer_fills_small_tensors_exactly_either_way(small_ckpt: Path, monkeypatch: pytest.MonkeyPatch,
                                                       path: str, staging: int) -> None:
    """40,000-byte buffers cut 16,000-byte rows at their ends, and are too small to gather into."""
    from wcd.arenas import cuda
    from wcd.arenas import staging as lanes
    from wcd.checkpoint import Checkpoint
    from wcd.loader import Progress, fill_arena
    from wcd.tuning import LoadTuning

    backend = cuda.CudaBackend(LoadTuning(staging_bytes=staging), linger_s=0)
    uuid = backend.canonical("cuda:0")
    with Checkpoint.open(small_ckpt) as ckpt:
        manifest = ckpt.manifest()
        plan = ckpt.copy_plan(manifest)
        assert sum(1 for op in plan if op.runs and cuda.scatter_pays(op.runs)) > 10  # the writer's own choice
        if path == "scatter":
            monkeypatch.setattr(lanes, "SCATTER_PIECES_PER_COPY", 0)
            monkeypatch.setattr(lanes, "SCATTER_MIN_ROW", 0)
        elif path == "gather":
            monkeypatch.setattr(lanes, "SCATTER_PIECES_PER_COPY", 10**9)
        arena = backend.create(uuid, backend.arena_size(manifest.size, uuid), "small-test")
        try:
            progress = Progress(ckpt.nbytes)
            fill_arena(arena, ckpt, plan, progress, workers=8)
            assert progress.done == ckpt.nbytes
            ref: dict[str, torch.Tensor] = {}
            for f in sorted(small_ckpt.glob("*.safetensors")):
                ref.update(load_file(f))
            image = arena.read(0, manifest.size)  # one device-to-host copy of the whole arena
            for spec in manifest.tensors:
                want = ref[spec.name].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                assert image[spec.offset : spec.offset + spec.nbytes] == want, spec.name
        finally:
            arena.close()
            backend.release()
