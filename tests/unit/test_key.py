"""WeightCacheKey equality, hashing and diffs; checkpoint fingerprints over real safetensors files."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from safetensors.torch import load_file, save_file

from wcd.checkpoint import SAMPLE_BYTES, SAMPLES_PER_FILE
from wcd.errors import LoadFailed
from wcd.headers import read_header
from wcd.key import HOST_DEVICE, WeightCacheKey, _sample_positions, fingerprint_checkpoint

# A value different from the default for every field.
OTHER: dict[str, Any] = {
    "model": "other",
    "path": "/models/x",
    "fingerprint": "ab12",
    "dtype": "bf16",
    "transform": "vllm-0.33/fp8-marlin",
    "shard": {"tp_rank": 1, "tp_size": 2},
    "device": "GPU-8f1c",
    "extra": {"quant": "abc"},
}


def test_defaults() -> None:
    k = WeightCacheKey(model="x")
    assert k.model_dump() == {"model": "x", "path": "", "fingerprint": "", "dtype": "", "transform": "raw",
                              "shard": {}, "device": HOST_DEVICE, "extra": {}}


def test_other_values_cover_every_field() -> None:
    assert set(OTHER) == set(WeightCacheKey.model_fields)


def test_equal_keys_are_equal_and_hash_alike() -> None:
    a = WeightCacheKey(model="x", **{f: v for f, v in OTHER.items() if f != "model"})
    b = WeightCacheKey.model_validate(a.model_dump())
    assert a == b and hash(a) == hash(b) and a.digest() == b.digest()
    assert a.diff(b) == []
    assert len({a, b}) == 1


@pytest.mark.parametrize("field", list(OTHER))
def test_every_field_takes_part_in_equality(field: str) -> None:
    a = WeightCacheKey(model="x")
    b = WeightCacheKey(model="x", **{field: OTHER[field]}) if field != "model" else WeightCacheKey(model="other")
    assert a != b
    assert a.diff(b) == [field] and b.diff(a) == [field]
    assert hash(a) != hash(b) and a.digest() != b.digest()
    assert len({a, b}) == 2


def test_diff_names_exactly_the_differing_fields_in_order() -> None:
    a = WeightCacheKey(model="m", dtype="bf16", shard={"tp_rank": 0}, extra={"v": "1"})
    b = WeightCacheKey(model="m", dtype="fp16", shard={"tp_rank": 0}, extra={"v": "2"}, device="cuda:0")
    assert a.diff(b) == ["dtype", "device", "extra"]


@settings(max_examples=40, deadline=None)
@given(fields=st.sets(st.sampled_from(list(OTHER))))
def test_diff_property(fields: set[str]) -> None:
    a = WeightCacheKey(model="x")
    b = WeightCacheKey(**{"model": "x", **{f: OTHER[f] for f in fields}})
    assert a.diff(b) == [f for f in WeightCacheKey.model_fields if f in fields]
    assert (a == b) == (not fields)


def test_digest_is_short_hex() -> None:
    d = WeightCacheKey(model="x").digest()
    assert len(d) == 16 and int(d, 16) >= 0


def test_frozen() -> None:
    k = WeightCacheKey(model="x")
    with pytest.raises(ValidationError):
        k.model = "y"  # type: ignore[misc]
    with pytest.raises(ValidationError):
        k.dtype = "bf16"  # type: ignore[misc]
    assert k == WeightCacheKey(model="x")


@pytest.mark.parametrize(
    "fields",
    [{"model": "x", "colour": "red"}, {"model": "x", "tp_rank": 0}, {}, {"model": ""}, {"model": "m" * 257},
     {"model": "x", "shard": {"tp": "one"}}, {"model": "x", "extra": {"k": 1}},
     {"model": "x", "shard": {f"k{i}": i for i in range(17)}}],
    ids=["extra-key", "shard-at-top", "no-model", "empty-model", "long-model", "shard-str", "extra-int",
         "too-many-shard-keys"],
)
def test_refused(fields: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        WeightCacheKey(**fields)


def test_equal_keys_with_differently_ordered_dicts_hash_alike() -> None:
    a = WeightCacheKey(model="x", shard={"tp_rank": 0, "tp_size": 2}, extra={"a": "1", "b": "2"})
    b = WeightCacheKey(model="x", shard={"tp_size": 2, "tp_rank": 0}, extra={"b": "2", "a": "1"})
    assert a == b
    assert hash(a) == hash(b)
    assert a.digest() == b.digest()
    assert len({a, b}) == 1


# -- fingerprints -------------------------------------------------------------------------------


def save(path: Path, seed: int = 0, n: int = 1000, prefix: str = "") -> Path:
    g = torch.Generator().manual_seed(seed)
    save_file({prefix + "w": torch.randn(n, generator=g), prefix + "b": torch.arange(7, dtype=torch.int32)},
              str(path))
    return path


def flip(path: Path, pos: int) -> None:
    with open(path, "r+b") as f:
        f.seek(pos)
        byte = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([byte ^ 0xFF]))


def test_fingerprint_is_stable(tmp_path: Path) -> None:
    file = save(tmp_path / "m.safetensors")
    fp = fingerprint_checkpoint(file)
    assert fp == fingerprint_checkpoint(file) == fingerprint_checkpoint(str(file))
    assert len(fp) == 32 and int(fp, 16) >= 0


def test_fingerprint_does_not_depend_on_where_the_checkpoint_lives(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    save(tmp_path / "a" / "m.safetensors")
    shutil.copy(tmp_path / "a" / "m.safetensors", tmp_path / "b" / "m.safetensors")
    assert fingerprint_checkpoint(tmp_path / "a") == fingerprint_checkpoint(tmp_path / "b")


def test_fingerprint_differs_for_different_weights(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b = save(tmp_path / "a" / "m.safetensors", seed=0), save(tmp_path / "b" / "m.safetensors", seed=1)
    assert read_header(a).raw == read_header(b).raw  # same name, size and header: only values differ
    assert fingerprint_checkpoint(a) != fingerprint_checkpoint(b)


def test_value_change_under_the_same_header_in_a_large_file(tmp_path: Path) -> None:
    file = tmp_path / "big.safetensors"
    original = torch.randn(2 << 20, generator=torch.Generator().manual_seed(3))  # 8 MiB of F32
    save_file({"w": original}, str(file))
    header = read_header(file)
    span = header.file_size - header.data_start
    assert span > SAMPLE_BYTES * SAMPLES_PER_FILE  # the sampled (not exhaustive) regime
    before = fingerprint_checkpoint(file)

    positions = _sample_positions(header.data_start, header.file_size)
    pos = positions[len(positions) // 2] + 100  # inside a sampled window, mid-file
    assert header.data_start + span // 4 < pos < header.file_size - span // 4
    flip(file, pos)

    assert read_header(file).raw == header.raw and read_header(file).file_size == header.file_size
    changed = load_file(str(file))["w"]
    assert (changed != original).sum().item() == 1  # exactly one value differs
    assert fingerprint_checkpoint(file) != before


@pytest.mark.parametrize("where", ["first", "last"])
def test_first_and_last_data_bytes_are_sampled(tmp_path: Path, where: str) -> None:
    file = tmp_path / "big.safetensors"
    save_file({"w": torch.zeros(2 << 20)}, str(file))
    header = read_header(file)
    before = fingerprint_checkpoint(file)
    flip(file, header.data_start if where == "first" else header.file_size - 1)
    assert fingerprint_checkpoint(file) != before


@pytest.mark.parametrize("offset", [0, 1, 4000, 4096, 4097, -1])
def test_small_file_is_hashed_in_full(tmp_path: Path, offset: int) -> None:
    file = save(tmp_path / "m.safetensors", n=3000)
    header = read_header(file)
    before = fingerprint_checkpoint(file)
    flip(file, (header.data_start if offset >= 0 else header.file_size) + offset)
    assert fingerprint_checkpoint(file) != before


def test_header_change_changes_fingerprint(tmp_path: Path) -> None:
    file = tmp_path / "m.safetensors"
    t = torch.randn(64, generator=torch.Generator().manual_seed(0))
    save_file({"w": t}, str(file))
    before = fingerprint_checkpoint(file)
    save_file({"w": t.reshape(8, 8)}, str(file))  # same bytes, other shape
    assert fingerprint_checkpoint(file) != before


def test_renaming_a_shard_changes_fingerprint(tmp_path: Path) -> None:
    save(tmp_path / "model-1.safetensors", seed=1, prefix="s1.")
    save(tmp_path / "model-2.safetensors", seed=2, prefix="s2.")
    before = fingerprint_checkpoint(tmp_path)
    (tmp_path / "model-2.safetensors").rename(tmp_path / "model-3.safetensors")
    assert fingerprint_checkpoint(tmp_path) != before


def test_renaming_a_single_file_changes_fingerprint(tmp_path: Path) -> None:
    file = save(tmp_path / "a.safetensors")
    before = fingerprint_checkpoint(file)
    assert fingerprint_checkpoint(file.rename(tmp_path / "b.safetensors")) != before


def test_adding_a_shard_changes_fingerprint(tmp_path: Path) -> None:
    save(tmp_path / "model-1.safetensors", seed=1, prefix="s1.")
    before = fingerprint_checkpoint(tmp_path)
    save(tmp_path / "model-2.safetensors", seed=2, prefix="s2.")
    after = fingerprint_checkpoint(tmp_path)
    assert after != before
    (tmp_path / "README.md").write_text("not a shard")
    assert fingerprint_checkpoint(tmp_path) == after


def test_directory_versus_file(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    d.mkdir()
    one = save(d / "model-1.safetensors", seed=1, prefix="s1.")
    # per file: name, size, header and samples; a directory of one shard is that shard
    assert fingerprint_checkpoint(d) == fingerprint_checkpoint(one)
    two = save(d / "model-2.safetensors", seed=2, prefix="s2.")
    fp = fingerprint_checkpoint(d)
    assert fp not in (fingerprint_checkpoint(one), fingerprint_checkpoint(two))


def test_fingerprint_of_missing_or_corrupt_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(LoadFailed, match="no such file"):
        fingerprint_checkpoint(tmp_path / "nope")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10" + b"\0" * 7 + b"not json")
    with pytest.raises(LoadFailed, match="bad.safetensors"):
        fingerprint_checkpoint(bad)


@settings(max_examples=80, deadline=None)
@given(start=st.integers(8, 10_000), span=st.integers(0, 50 * SAMPLE_BYTES * SAMPLES_PER_FILE))
def test_sample_positions(start: int, span: int) -> None:
    end = start + span
    positions = _sample_positions(start, end)
    assert positions == sorted(positions)
    assert all(start <= p < end for p in positions)
    if span <= SAMPLE_BYTES * SAMPLES_PER_FILE:
        covered: set[int] = set()
        for p in positions:
            covered.update(range(p, min(p + SAMPLE_BYTES, end)))
        assert covered == set(range(start, end))  # small files: every byte
    else:
        assert len(positions) == SAMPLES_PER_FILE
        assert positions[0] == start and positions[-1] + SAMPLE_BYTES <= end
        assert all(b - a >= SAMPLE_BYTES for a, b in zip(positions, positions[1:]))  # no window read twice


def test_last_window_always_reaches_the_end(tmp_path: Path) -> None:
    for start, end in [(8, 8 + 524_077), (72, 264_210), (72, 522_433), (80, 1_036_893)]:
        assert _sample_positions(start, end)[-1] + SAMPLE_BYTES == end, (start, end)
    # the same on a real file: its last data byte must take part in the fingerprint
    n = 264_138
    text = json.dumps({"w": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}}, separators=(",", ":"))
    header = text.encode().ljust(64)
    file = tmp_path / "m.safetensors"
    file.write_bytes(struct.pack("<Q", len(header)) + header + bytes(n))
    assert (read_header(file).data_start, read_header(file).file_size) == (72, 264_210)
    before = fingerprint_checkpoint(file)
    flip(file, 264_210 - 1)
    assert fingerprint_checkpoint(file) != before


def test_asked_again_an_open_checkpoint_reads_only_the_samples(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The check after a fill: the same fingerprint without hashing the headers again, and a
    changed sample (written in place, through the open file) gives the fingerprint it now has."""
    import wcd.key
    from wcd.checkpoint import Checkpoint

    save(tmp_path / "model-1.safetensors", seed=1, prefix="a.")
    big = tmp_path / "model-2.safetensors"
    save_file({"w": torch.zeros(2 << 20)}, str(big))  # sampled, not hashed in full
    with Checkpoint.open(tmp_path) as ckpt:
        fp = wcd.key.fingerprint(ckpt)
        with monkeypatch.context() as m:
            m.setattr(wcd.key, "_hash_head", lambda *_: pytest.fail("the headers were hashed again"))
            assert wcd.key.fingerprint(ckpt) == fp
        header = read_header(big)
        flip(big, _sample_positions(header.data_start, header.file_size)[5] + 7)
        changed = wcd.key.fingerprint(ckpt)
        assert changed != fp and changed == fingerprint_checkpoint(tmp_path) == wcd.key.fingerprint(ckpt)
        flip(big, _sample_positions(header.data_start, header.file_size)[5] + 7)
        assert wcd.key.fingerprint(ckpt) == fp


def test_unparsed_fingerprint_is_the_fingerprint(tmp_path: Path) -> None:
    from wcd.checkpoint import Checkpoint, open_files
    from wcd.key import fingerprint_unparsed

    save(tmp_path / "model-1.safetensors", seed=1, prefix="a.")
    save(tmp_path / "model-2.safetensors", seed=2, n=5000, prefix="b.")
    files = open_files(tmp_path)
    try:
        assert fingerprint_unparsed(files) == fingerprint_checkpoint(tmp_path)
    finally:
        for _, fd in files:
            os.close(fd)
    with Checkpoint.open(tmp_path) as ckpt:
        assert ckpt.fds and len(ckpt.headers) == 2
