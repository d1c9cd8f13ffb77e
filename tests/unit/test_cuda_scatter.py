"""The CUDA writer's copies of batched small tensors, without a GPU, over `fake_cuda.FakeDriver`
(copies land in a bytearray standing in for device memory, only when waited for, so a staging
buffer reused too early shows up as wrong bytes). Checked: every tensor byte lands at its arena
offset, through 2D copies (`_Lane.scatter`) and preadv gathers (`_Lane.gather`) alike, and padding
is not written by a scatter."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from tests.unit import test_staging
from tests.unit.fake_cuda import DEVICE_BASE, PAD, FakeDriver
from wcd.checkpoint import Checkpoint, run_pieces
from wcd.loader import Progress, fill_arena
from wcd.tuning import LoadTuning

cuda_module = test_staging.cuda_module  # the fixture: wcd.arenas.cuda as it is, without a GPU


@pytest.fixture
def cuda(cuda_module: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """wcd.arenas.cuda over a FakeDriver."""
    fake = FakeDriver(cuda_module.SUCCESS, cuda_module.NOT_READY)
    monkeypatch.setattr(cuda_module, "cuda", fake)
    cuda_module.fake = fake
    return cuda_module


def gpu(cuda: Any) -> Any:
    return cuda.Gpu(0, "GPU-fake", "fake")


def fill(cuda: Any, path: Path, lane_bytes: int = 4 << 20, batch: int = 4 << 20,
         workers: int = 3, staging: Any = None) -> tuple[Checkpoint, Any]:
    """Fill a CUDA arena (over the fake driver) from `path` with the daemon's loader; the manifest.
    With no `staging` given, one that lingers not at all, released when the fill is done."""
    ckpt = Checkpoint.open(path)
    manifest = ckpt.manifest()
    own = staging is None
    staging = staging or cuda.Staging(gpu(cuda), LoadTuning(staging_bytes=lane_bytes), 0)
    arena = cuda.CudaArena(gpu(cuda), manifest.size, object(), os.open(os.devnull, os.O_RDONLY), staging, "test")
    progress = Progress(ckpt.nbytes)
    fill_arena(arena, ckpt, ckpt.copy_plan(manifest, batch=batch), progress, workers=workers)
    arena.close()
    for thread in staging._releasing:  # with no linger, released on a thread after the close
        thread.join(5)
    assert progress.done == ckpt.nbytes and (not own or not staging.held)
    return ckpt, manifest


def assert_landed(cuda: Any, ckpt: Checkpoint, manifest: Any) -> None:
    """Every tensor's bytes at its arena offset, exactly."""
    at = {t.name: t for t in manifest.tensors}
    for h, fd in zip(ckpt.headers, ckpt.fds):
        for t in h.tensors:
            spec = at[t.name]
            want = os.pread(fd, t.end - t.begin, t.begin)
            assert bytes(cuda.fake.device[spec.offset : spec.offset + spec.nbytes]) == want, t.name


def bf16(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def test_experts_of_one_shape_are_one_read_and_one_2d_copy_per_op(cuda: Any, tmp_path: Path) -> None:
    # 16,000-byte tensors (not a multiple of 256): ~260 per 4 MiB op, each op one run.
    save_file({f"e.{i:04d}": bf16(8000, i) for i in range(700)}, str(tmp_path / "m.safetensors"))
    ckpt, manifest = fill(cuda, tmp_path / "m.safetensors")
    ops = ckpt.copy_plan(manifest)
    assert len(ops) == 3 and all(len(op.runs) == 1 for op in ops)
    assert cuda.fake.calls == {"2d": 3} and sum(cuda.fake.rows) == 700
    assert_landed(cuda, ckpt, manifest)


def mixed(seed: int) -> dict[str, torch.Tensor]:
    """Runs of equal tensors of several widths, odd sizes, aligned ones, zero-size ones, a big one."""
    rng = random.Random(seed)
    tensors: dict[str, torch.Tensor] = {}
    i = 0
    for _ in range(40):
        n = rng.choice([1, 1, 2, 3, 9, 30, 100])
        elems = rng.choice([8000, 8000, 1, 3, 128, 700, 8001, 0, 4096, 20000])
        for _ in range(n):
            tensors[f"t.{i:05d}"] = bf16(elems, i)
            i += 1
    tensors["t.big"] = bf16(3 << 20, 7)  # 6 MiB: a direct copy between runs
    tensors["u.i8"] = torch.randint(-128, 127, (33,), dtype=torch.int8, generator=torch.Generator().manual_seed(1))
    return tensors


@pytest.mark.slow
@pytest.mark.parametrize("path", ["scatter", "gather", "chosen"])
@pytest.mark.parametrize("lane_bytes", [4 << 20, 40_000, 16_000, 777])
def test_mixed_runs_land_exactly_through_either_copy(cuda: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     path: str, lane_bytes: int) -> None:
    """Buffers smaller than an op make `scatter` cut runs and rows at buffer ends (and `gather`,
    which cannot fit, leave the op to `scatter`)."""
    if path == "scatter":
        monkeypatch.setattr(cuda, "SCATTER_PIECES_PER_COPY", 0)
        monkeypatch.setattr(cuda, "SCATTER_MIN_ROW", 0)
    elif path == "gather":
        monkeypatch.setattr(cuda, "SCATTER_PIECES_PER_COPY", 10**9)
    d = tmp_path / "ckpt"
    d.mkdir()
    tensors = mixed(lane_bytes)
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[: len(names) // 2]}, str(d / "a.safetensors"))
    save_file({n: tensors[n] for n in names[len(names) // 2 :]}, str(d / "b.safetensors"))
    ckpt, manifest = fill(cuda, d, lane_bytes=lane_bytes, batch=1 << 20)
    assert any(count > 1 and width % 256 for op in ckpt.copy_plan(manifest, batch=1 << 20)
               for _, width, _, count in op.runs)
    if path == "scatter":
        assert cuda.fake.calls["2d"] > 0
    if path == "gather" and lane_bytes >= 1 << 20:
        assert "2d" not in cuda.fake.calls
    assert_landed(cuda, ckpt, manifest)


def lane_scatter(cuda: Any, lane_bytes: int, data: bytes, runs: tuple[tuple[int, int, int, int], ...],
                 file_offset: int, tmp_path: Path, read_bytes: int = 0) -> bytearray:
    """One `_Lane.scatter` of `data[file_offset:]` into a fresh device arena; what the arena holds."""
    f = tmp_path / "data"
    f.write_bytes(data)
    end = max(rel + stride * (count - 1) + width for rel, width, stride, count in runs)
    cuda.fake.cuMemAddressReserve(end + 512)
    lane = cuda.Lane(lane_bytes, 2)
    fd = os.open(f, os.O_RDONLY)
    try:
        lane.scatter(fd, file_offset, DEVICE_BASE + 256, runs, read_bytes)
        lane.synchronize()
    finally:
        os.close(fd)
        lane.close()
    return cuda.fake.device


@pytest.mark.parametrize("lane_bytes", [1, 5, 100, 999, 1000, 1001, 2999, 1 << 16])
@pytest.mark.parametrize("runs", [
    ((0, 1000, 1024, 3),),  # one run
    ((0, 5, 256, 1),),  # a single piece
    ((0, 1000, 1024, 2), (2048, 1, 256, 1), (2304, 300, 512, 4), (4352, 512, 512, 3), (5888, 1000, 1024, 1)),
    ((0, 256, 256, 1), (256, 7, 256, 9), (2560, 2000, 2048, 2)),
])
@pytest.mark.slow
def test_scatter_puts_every_piece_in_place_and_nothing_between(cuda: Any, tmp_path: Path, lane_bytes: int,
                                                              runs: tuple[tuple[int, int, int, int], ...]) -> None:
    data = random.Random(lane_bytes).randbytes(20_000)
    file_offset = 123
    device = lane_scatter(cuda, lane_bytes, data, runs, file_offset, tmp_path)
    want = bytearray([PAD]) * len(device)
    pos = file_offset
    for run in runs:
        for rel, n in run_pieces(run):
            want[256 + rel : 256 + rel + n] = data[pos : pos + n]
            pos += n
    assert device == want
    expected_2d = 0 if lane_bytes < 1000 else sum(1 for _, w, s, c in runs if c > 1 and s != w)
    if lane_bytes >= 1 << 16:  # one buffer: a 2D copy per run of several unpadded rows, else plain copies
        assert cuda.fake.calls.get("2d", 0) == expected_2d


@pytest.mark.parametrize("read_bytes", [999, 1000, 4096])
def test_scatter_reads_at_most_the_files_read_size_from_a_grown_lane(cuda: Any, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     read_bytes: int) -> None:
    """A pooled lane a cold load grew keeps its large buffers: a later scatter reads the file's own
    read size at a time (a warm file's 4 MiB, not 16), and still lands every piece."""
    runs = ((0, 1000, 1024, 3), (3072, 300, 512, 4), (5120, 512, 512, 3))
    data = random.Random(read_bytes).randbytes(20_000)
    reads: list[int] = []
    real = cuda.pread_into

    def pread_into(fd: int, view: memoryview, offset: int) -> None:
        reads.append(len(view))
        real(fd, view, offset)

    monkeypatch.setattr(cuda, "pread_into", pread_into)
    device = lane_scatter(cuda, 1 << 16, data, runs, 7, tmp_path, read_bytes)
    total = sum(width * count for _, width, _, count in runs)
    assert reads and max(reads) <= read_bytes and sum(reads) == total
    want = bytearray([PAD]) * len(device)
    pos = 7
    for run in runs:
        for rel, n in run_pieces(run):
            want[256 + rel : 256 + rel + n] = data[pos : pos + n]
            pos += n
    assert device == want


def test_scatter_at_the_end_of_a_file_fails_with_eio(cuda: Any, tmp_path: Path) -> None:
    with pytest.raises(OSError, match="unexpected end of file"):
        lane_scatter(cuda, 4096, b"x" * 3000, ((0, 1000, 1024, 3),), 1, tmp_path)


def test_scatter_pays_for_many_wide_pieces_per_run_only(cuda: Any) -> None:
    assert cuda.scatter_pays(((0, 16000, 16128, 260),))
    assert cuda.scatter_pays(((0, 16000, 16128, 100), (1612800, 3, 256, 1)))
    assert not cuda.scatter_pays(((0, 16000, 16128, 1), (16128, 2, 256, 1)))  # few pieces: gather them
    assert not cuda.scatter_pays(((0, 64, 256, 500),))  # narrow rows
    assert cuda.scatter_pays(((0, 64, 64, 500),))  # unpadded: one plain copy
    assert not cuda.scatter_pays(())


@pytest.mark.parametrize("path", ["scatter", "gather"])
def test_cold_files_are_planned_in_cold_reads_and_land_exactly(cuda: Any, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """Given the manifest, the loader plans after the writer's hints: a file not in the page cache
    gets ops of small tensors as large as one cold read, and the lanes grow to carry them."""
    import wcd.loader

    if path == "scatter":
        monkeypatch.setattr(cuda, "SCATTER_PIECES_PER_COPY", 0)
        monkeypatch.setattr(cuda, "SCATTER_MIN_ROW", 0)
    else:
        monkeypatch.setattr(cuda, "SCATTER_PIECES_PER_COPY", 10**9)
    d = tmp_path / "ckpt"
    d.mkdir()
    tensors = mixed(5)
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[: len(names) // 2]}, str(d / "a.safetensors"))
    save_file({n: tensors[n] for n in names[len(names) // 2 :]}, str(d / "b.safetensors"))
    ckpt = Checkpoint.open(d)
    manifest = ckpt.manifest()
    cold_fd = ckpt.fds[1]
    monkeypatch.setattr(wcd.loader, "cached_fraction", lambda fd: 0.0 if fd == cold_fd else 1.0)
    planned: list[Any] = []
    plan = ckpt.copy_plan

    def spy(m: Any, chunk: int = 64 << 20, batch: Any = 4 << 20) -> Any:
        planned.append(batch)
        return plan(m, chunk, batch)

    monkeypatch.setattr(ckpt, "copy_plan", spy)
    staging = cuda.Staging(gpu(cuda), LoadTuning(staging_bytes=40_000, cold_read_bytes=200_000), 0)
    grown: list[int] = []
    give = staging.give
    monkeypatch.setattr(staging, "give", lambda lanes: (grown.extend(lane.nbytes for lane in lanes), give(lanes)))
    arena = cuda.CudaArena(gpu(cuda), manifest.size, object(), os.open(os.devnull, os.O_RDONLY), staging, "test")
    progress = Progress(ckpt.nbytes)
    fill_arena(arena, ckpt, manifest, progress, workers=3)
    arena.close()
    assert planned == [[40_000, 200_000]]
    assert 200_000 in grown and progress.done == ckpt.nbytes
    ops = plan(manifest, batch=[40_000, 200_000])
    assert max(op.nbytes for op in ops if op.shard == 1 and op.runs) > 40_000
    if path == "gather":  # the grown lanes gathered the cold ops whole: nothing fell back to 2D copies
        assert "2d" not in cuda.fake.calls
    assert_landed(cuda, ckpt, manifest)
    ckpt.close()


def test_the_writers_debug_line_counts_its_threads_time_in_reads_and_waits(cuda: Any, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    """Reads made 20 ms slower show in the line's seconds in reads; the next load, through the
    same pooled lanes with plain reads, starts its count from zero."""
    import logging
    import re
    import time

    def line() -> tuple[int, float, float]:
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("CUDA writer:")]
        assert len(lines) == 1, lines
        caplog.clear()
        m = re.match(r"CUDA writer: (\d+) loader threads spent ([\d.]+) s in reads, ([\d.]+) s waiting for a "
                     r"buffer's last copy and ([\d.]+) s pinning", lines[0])
        assert m, lines[0]
        return int(m[1]), float(m[2]), float(m[3])

    save_file(mixed(3), str(tmp_path / "m.safetensors"))
    real = cuda.pread_into
    reads: list[int] = []

    def slow(fd: int, view: memoryview, offset: int) -> None:
        time.sleep(0.02)
        reads.append(len(view))
        real(fd, view, offset)

    monkeypatch.setattr(cuda, "scatter_pays", lambda runs: True)  # every op reads through pread_into
    staging = cuda.Staging(gpu(cuda), LoadTuning(), 60.0)  # lanes pooled between the two loads
    try:
        with caplog.at_level(logging.DEBUG, logger="wcd"):
            monkeypatch.setattr(cuda, "pread_into", slow)
            ckpt, manifest = fill(cuda, tmp_path / "m.safetensors", workers=3, staging=staging)
            threads, reading, _ = line()
            assert 1 <= threads <= 3
            assert 0.02 * len(reads) <= reading < 0.02 * len(reads) + 1.0, (reading, len(reads))
            assert_landed(cuda, ckpt, manifest)
            ckpt.close()
            monkeypatch.setattr(cuda, "pread_into", real)
            again, _ = fill(cuda, tmp_path / "m.safetensors", workers=3, staging=staging)
            again.close()
            assert line()[1] < 0.02 * len(reads) / 2  # not the first load's seconds again
    finally:
        staging.release()
