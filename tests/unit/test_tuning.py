"""`LoadTuning`: the one typed setting loads read and copy by. A bad value is one line naming the
field; a variant set before the backends are made reaches the arenas they make and the plans of
the loads into them (what a benchmark's `--variant` relies on)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import wcd.arenas
from tests.unit.test_page_cache import _shards
from wcd.checkpoint import Checkpoint
from wcd.loader import Progress, fill_arena
from wcd.tuning import DEFAULT, LoadTuning


@pytest.mark.parametrize("field", ["staging_bytes", "staging_buffers", "cold_read_bytes", "direct_read_bytes",
                                   "read_window", "chunk_bytes"])
def test_a_size_that_is_not_a_positive_int_is_refused_in_one_line_naming_it(field: str) -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=rf"^LoadTuning\.{field} must be a positive int of bytes, got {bad!r}$"):
            LoadTuning(**{field: bad})
    assert getattr(LoadTuning(**{field: 4096}), field) == 4096


def test_nothing_read_ahead_is_a_tuning_and_unknown_fields_are_refused() -> None:
    assert LoadTuning(read_ahead_bytes=0).read_ahead_bytes == 0
    with pytest.raises(TypeError):
        LoadTuning(query_first=False)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        LoadTuning(4 << 20)  # type: ignore[misc]  # keywords only: a variant names what it changes


def test_a_variant_set_before_the_backend_is_made_reaches_its_arenas_and_their_plans(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    variant = LoadTuning(chunk_bytes=1 << 20, read_ahead_bytes=0)
    monkeypatch.setattr(wcd.arenas, "_backends", {})
    monkeypatch.setattr(wcd.arenas, "_tuning", DEFAULT)
    wcd.arenas.set_tuning(variant)
    backend = wcd.arenas.backend_for("cpu")
    assert backend.tuning is variant
    with Checkpoint.open(_shards(tmp_path, [9 << 20])) as ckpt:
        manifest = ckpt.manifest()
        chunks: list[Any] = []
        plan = ckpt.copy_plan

        def spy(m: Any, chunk: int | None = None, batch: Any = 4 << 20) -> Any:
            chunks.append(chunk)
            return plan(m, chunk, batch)

        monkeypatch.setattr(ckpt, "copy_plan", spy)
        arena = backend.create("cpu", backend.arena_size(manifest.size, "cpu"), "tuned")
        try:
            assert arena.tuning is variant
            fill_arena(arena, ckpt, manifest, Progress(ckpt.nbytes), workers=2)
            assert chunks == [1 << 20]
            assert [op.nbytes for op in plan(manifest, chunks[0])] == [1 << 20] * 9
            assert arena.read(0, 9 << 20) == (ckpt.path / "m-0.safetensors").read_bytes()[-(9 << 20):]
        finally:
            arena.close()
    monkeypatch.setattr(wcd.arenas, "_backends", {})
    wcd.arenas.set_tuning(DEFAULT)
    assert wcd.arenas.backend_for("cpu").tuning is DEFAULT
