"""safetensors shards: header parsing, arena layout and copy plans, checked against real files."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from wcd.checkpoint import Checkpoint, CopyOp, _runs
from wcd.errors import LoadFailed
from wcd.headers import read_header
from wcd.manifest import ALIGN


def sample_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(300, 17, generator=g).to(torch.bfloat16),
        "layer.0.w": torch.randn(5, 7, generator=g),
        "layer.0.b": torch.randn(3, generator=g).to(torch.float16),
        "step": torch.tensor(42, dtype=torch.int64),  # a scalar
        "empty": torch.zeros(0, 4, dtype=torch.uint8),
        "mask": torch.rand(9, generator=g) > 0.5,
        "ids": torch.randint(-100, 100, (11,), dtype=torch.int32, generator=g),
        "fp8": torch.randn(33, generator=g).to(torch.float8_e4m3fn),
    }


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def header_len(file: Path) -> int:
    with open(file, "rb") as f:
        return struct.unpack("<Q", f.read(8))[0]


def write_raw(file: Path, header: Any, data: bytes = b"", *, length: int | None = None) -> Path:
    """A hand-made safetensors file: 8-byte little-endian header length, header, data."""
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(h) if length is None else length) + h + data)
    return file


@pytest.fixture
def single(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    tensors = sample_tensors()
    file = tmp_path / "model.safetensors"
    save_file(tensors, str(file), metadata={"format": "pt"})
    return file, tensors


@pytest.fixture
def sharded(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    tensors = sample_tensors(1)
    names = sorted(tensors)
    d = tmp_path / "ckpt"
    d.mkdir()
    # written out of name order, plus files a checkpoint directory may also hold
    save_file({n: tensors[n] for n in names[4:]}, str(d / "model-00002-of-00002.safetensors"))
    save_file({n: tensors[n] for n in names[:4]}, str(d / "model-00001-of-00002.safetensors"))
    (d / "config.json").write_text("{}")
    (d / "model.safetensors.index.json").write_text("{}")
    return d, tensors


def fill_by_hand(ckpt: Checkpoint, chunk: int, batch: int = 4 << 20) -> tuple[bytearray, list[CopyOp]]:
    manifest = ckpt.manifest()
    arena = bytearray(manifest.size)
    plan = ckpt.copy_plan(manifest, chunk=chunk, batch=batch)
    for op in plan:
        data = os.pread(ckpt.fds[op.shard], op.file_nbytes, op.file_offset)
        for rel, n in op.pieces or ((0, op.nbytes),):
            arena[op.arena_offset + rel : op.arena_offset + rel + n], data = data[:n], data[n:]
        assert data == b""
    return arena, plan


# -- headers ------------------------------------------------------------------------------------


def test_read_header(single: tuple[Path, dict[str, torch.Tensor]]) -> None:
    file, tensors = single
    h = read_header(file)
    n = header_len(file)
    assert h.file == file
    assert h.data_start == 8 + n
    assert h.file_size == os.path.getsize(file)
    assert h.raw == file.read_bytes()[8 : 8 + n]
    assert {t.name for t in h.tensors} == set(tensors)
    assert [t.begin for t in h.tensors] == sorted(t.begin for t in h.tensors)
    for t in h.tensors:
        ref = tensors[t.name]
        assert t.shape == tuple(ref.shape)
        assert t.end - t.begin == ref.numel() * ref.element_size()
        assert h.data_start <= t.begin <= t.end <= h.file_size
    with open(file, "rb") as f:
        data = f.read()
    for t in h.tensors:
        assert data[t.begin : t.end] == raw_bytes(tensors[t.name])


def test_metadata_is_not_a_tensor(single: tuple[Path, dict[str, torch.Tensor]]) -> None:
    file, _ = single
    assert "__metadata__" in json.loads(read_header(file).raw)
    assert "__metadata__" not in {t.name for t in read_header(file).tensors}


def test_open_single_file(single: tuple[Path, dict[str, torch.Tensor]]) -> None:
    file, tensors = single
    ckpt = Checkpoint.open(str(file))
    assert ckpt.path == file.resolve()
    assert len(ckpt.headers) == 1
    assert ckpt.nbytes == sum(t.numel() * t.element_size() for t in tensors.values())


def test_open_directory_of_shards(sharded: tuple[Path, dict[str, torch.Tensor]]) -> None:
    d, tensors = sharded
    ckpt = Checkpoint.open(d)
    assert [h.file.name for h in ckpt.headers] == ["model-00001-of-00002.safetensors",
                                                    "model-00002-of-00002.safetensors"]
    assert {t.name for h in ckpt.headers for t in h.tensors} == set(tensors)


def test_open_resolves_the_path(sharded: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    d, _ = sharded
    link = tmp_path / "link"
    link.symlink_to(d)
    assert Checkpoint.open(link).path == d.resolve()


def test_manifest_follows_shard_then_file_order(sharded: tuple[Path, dict[str, torch.Tensor]]) -> None:
    d, tensors = sharded
    ckpt = Checkpoint.open(d)
    m = ckpt.manifest()
    assert [t.name for t in m.tensors] == [t.name for h in ckpt.headers for t in h.tensors]
    for spec in m.tensors:
        ref = tensors[spec.name]
        assert spec.shape == tuple(ref.shape)
        assert spec.nbytes == ref.numel() * ref.element_size()
        assert spec.offset % ALIGN == 0
    assert {t.dtype for t in m.tensors} == {"BF16", "F32", "F16", "I64", "U8", "BOOL", "I32", "F8_E4M3"}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chunk=st.integers(1, 12_000), batch=st.integers(1, 20_000))
def test_copy_plan_covers_every_tensor_exactly(sharded: tuple[Path, dict[str, torch.Tensor]], chunk: int,
                                               batch: int) -> None:
    d, _ = sharded
    ckpt = Checkpoint.open(d)
    m = ckpt.manifest()
    plan = ckpt.copy_plan(m, chunk=chunk, batch=batch)
    assert sum(op.file_nbytes for op in plan) == ckpt.nbytes == m.nbytes
    at = {t.name: t for t in m.tensors}
    for op in plan:
        if op.pieces:  # a run of small tensors: at most `batch` arena bytes, back to back in the file
            assert op.nbytes <= batch and op.pieces[-1][0] + op.pieces[-1][1] == op.nbytes
            assert all(a + n <= b for (a, n), (b, _) in zip(op.pieces, op.pieces[1:]))
        else:
            assert 0 < op.nbytes <= max(chunk, batch)
    # every tensor byte lands once, at its place: replay the plan byte by byte
    landed: dict[int, tuple[int, int]] = {}  # arena offset -> (shard, file offset)
    for op in plan:
        pos = op.file_offset
        for rel, n in op.pieces or ((0, op.nbytes),):
            for i in range(n):
                assert op.arena_offset + rel + i not in landed
                landed[op.arena_offset + rel + i] = (op.shard, pos + i)
            pos += n
    expected = {at[t.name].offset + i: (s, t.begin + i)
                for s, h in enumerate(ckpt.headers) for t in h.tensors for i in range(t.end - t.begin)}
    assert landed == expected
    assert all(op.arena_offset + op.nbytes <= m.size for op in plan)


def test_copy_plan_batches_small_tensors(tmp_path: Path) -> None:
    tensors = {f"t{i:04d}": torch.full((100 + i % 3,), i % 100, dtype=torch.int8) for i in range(3000)}
    save_file(tensors, str(tmp_path / "small.safetensors"))
    ckpt = Checkpoint.open(tmp_path / "small.safetensors")
    plan = ckpt.copy_plan(ckpt.manifest())
    assert len(plan) == 3  # 1024 tensors per op at most (one preadv's iovecs)
    arena, _ = fill_by_hand(ckpt, 64 << 20)
    for spec in ckpt.manifest().tensors:
        assert bytes(arena[spec.offset : spec.offset + spec.nbytes]) == raw_bytes(tensors[spec.name])


def test_copy_plan_takes_a_batch_per_shard(tmp_path: Path) -> None:
    for k in range(2):
        save_file({f"s{k}.t{i:04d}": torch.full((1000,), i % 100, dtype=torch.int8) for i in range(100)},
                  str(tmp_path / f"m{k}.safetensors"))
    ckpt = Checkpoint.open(tmp_path)
    m = ckpt.manifest()
    plan = ckpt.copy_plan(m, batch=[8192, 65536])
    sizes = {shard: [op.nbytes for op in plan if op.shard == shard] for shard in (0, 1)}
    assert max(sizes[0]) <= 8192 < max(sizes[1]) <= 65536
    assert sum(map(len, sizes.values())) < len(ckpt.copy_plan(m, batch=8192))
    with pytest.raises(ValueError, match="one batch size per shard"):
        ckpt.copy_plan(m, batch=[8192])


def test_copy_plan_splits_large_tensors(single: tuple[Path, dict[str, torch.Tensor]]) -> None:
    file, tensors = single
    ckpt = Checkpoint.open(file)
    big = tensors["embed.weight"].numel() * 2  # 10200 bytes of BF16
    plan = ckpt.copy_plan(ckpt.manifest(), chunk=4096, batch=4096)
    offset = next(t.offset for t in ckpt.manifest().tensors if t.name == "embed.weight")
    pieces = [op.nbytes for op in plan if offset <= op.arena_offset < offset + big]
    assert pieces == [4096, 4096, big - 8192]
    assert not any(op.nbytes == 0 for op in plan)  # the empty tensor needs no read


def test_copy_plan_describes_equal_tensors_as_runs(tmp_path: Path) -> None:
    """16,000-byte tensors (padded to 16,128 in the arena) make one run per op, odd ones break it."""
    tensors = {f"e.{i:04d}": torch.full((8000,), i, dtype=torch.bfloat16) for i in range(600)}
    # safetensors writes by dtype, then name: the I8 one last, the odd BF16 one and the empty one among the rest
    tensors.update({"e.0100a": torch.ones(3, dtype=torch.bfloat16), "e.0100b": torch.zeros(0, dtype=torch.bfloat16),
                    "z": torch.ones(3, dtype=torch.int8)})
    save_file(tensors, str(tmp_path / "m.safetensors"))
    ckpt = Checkpoint.open(tmp_path / "m.safetensors")
    manifest = ckpt.manifest()
    plan = ckpt.copy_plan(manifest)
    assert [op.runs for op in plan] == [
        ((0, 16000, 16128, 101), (101 * 16128, 6, 256, 1), (101 * 16128 + 256, 16000, 16128, 159)),
        ((0, 16000, 16128, 260),),
        ((0, 16000, 16128, 600 - 520), (80 * 16128, 3, 256, 1)),
    ]
    arena, _ = fill_by_hand(ckpt, 64 << 20)
    for spec in manifest.tensors:
        assert bytes(arena[spec.offset : spec.offset + spec.nbytes]) == raw_bytes(tensors[spec.name])


def test_runs_break_where_a_layout_pads_more_than_the_alignment() -> None:
    """Not `manifest()`'s layout: extra padding between equal tensors starts a new run there."""
    sizes = [1000] * 6 + [5, 5]
    ats = [0, 1024, 2048, 4096, 5120, 6144, 8192, 8448]
    assert _runs(sizes, ats, 0, 8) == ((0, 1000, 1024, 3), (4096, 1000, 1024, 3), (8192, 5, 256, 2))
    assert _runs(sizes, ats, 2, 5) == ((0, 1000, 1024, 1), (2048, 1000, 1024, 2))


@pytest.mark.parametrize("chunk", [1 << 26, 4096, 1000, 7])
def test_copy_by_hand_reproduces_load_file(sharded: tuple[Path, dict[str, torch.Tensor]], chunk: int) -> None:
    d, _ = sharded
    ckpt = Checkpoint.open(d)
    arena, _ = fill_by_hand(ckpt, chunk)
    loaded = {k: v for h in ckpt.headers for k, v in load_file(str(h.file)).items()}
    for spec in ckpt.manifest().tensors:
        assert bytes(arena[spec.offset : spec.offset + spec.nbytes]) == raw_bytes(loaded[spec.name]), spec.name


def test_copy_by_hand_single_file(single: tuple[Path, dict[str, torch.Tensor]]) -> None:
    file, tensors = single
    ckpt = Checkpoint.open(file)
    arena, _ = fill_by_hand(ckpt, 512)
    for spec in ckpt.manifest().tensors:
        assert bytes(arena[spec.offset : spec.offset + spec.nbytes]) == raw_bytes(tensors[spec.name])


def test_hand_made_file_without_tensors(tmp_path: Path) -> None:
    file = write_raw(tmp_path / "e.safetensors", {"__metadata__": {"a": "b"}})
    ckpt = Checkpoint.open(file)
    assert ckpt.headers[0].tensors == () and ckpt.nbytes == 0 and ckpt.copy_plan(ckpt.manifest()) == []


# -- corrupt and missing files ------------------------------------------------------------------


def load_failure(path: Path) -> str:
    with pytest.raises(LoadFailed) as info:
        Checkpoint.open(path)
    text = info.value.message
    assert "\n" not in text
    return text


def test_truncated_file(single: tuple[Path, dict[str, torch.Tensor]]) -> None:
    file, _ = single
    data = file.read_bytes()
    file.write_bytes(data[:-10])
    text = load_failure(file)
    assert str(file) in text and "extends past the end of the file" in text


def test_file_shorter_than_its_length_prefix(tmp_path: Path) -> None:
    file = tmp_path / "tiny.safetensors"
    file.write_bytes(b"\x01\x02\x03")
    assert load_failure(file) == f"{file}: not a safetensors file (shorter than 8 bytes)"


@pytest.mark.parametrize("length", [1 << 40, 10_000, (100 << 20) + 1])
def test_header_length_too_large(tmp_path: Path, length: int) -> None:
    file = write_raw(tmp_path / "big.safetensors", {}, b"\0" * 64, length=length)
    text = load_failure(file)
    assert str(file) in text and f"header length {length} is implausible" in text


@pytest.mark.parametrize("header", [b"{not json", b"\xff\xfe\x00garbage", b"", b"{}}"])
def test_header_not_json(tmp_path: Path, header: bytes) -> None:
    file = write_raw(tmp_path / "bad.safetensors", header)
    text = load_failure(file)
    assert text.startswith(f"{file}: safetensors header is not valid JSON")


@pytest.mark.parametrize("header", [b"[]", b"42", b'"x"'])
def test_header_not_an_object(tmp_path: Path, header: bytes) -> None:
    file = write_raw(tmp_path / "bad.safetensors", header)
    assert load_failure(file) == f"{file}: safetensors header is not a JSON object"


def test_deeply_nested_header_is_a_load_failure(tmp_path: Path) -> None:
    file = write_raw(tmp_path / "deep.safetensors", b"[" * 100_000 + b"]" * 100_000)
    assert load_failure(file).startswith(f"{file}: ")


def test_header_with_a_huge_integer_is_a_load_failure(tmp_path: Path) -> None:
    header = b'{"w": {"dtype": "U8", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 1]}}'
    file = write_raw(tmp_path / "huge.safetensors", header, b"\0")
    assert load_failure(file).startswith(f"{file}: ")


def entry(dtype: str = "F32", shape: Any = (2,), offsets: Any = (0, 8)) -> dict[str, Any]:
    return {"dtype": dtype, "shape": list(shape) if isinstance(shape, tuple) else shape,
            "data_offsets": list(offsets) if isinstance(offsets, tuple) else offsets}


@pytest.mark.parametrize(
    ("info", "why"),
    [
        (entry(offsets=(0, 12)), "data_offsets [0, 12] do not match dtype and shape"),
        (entry(offsets=(4, 8)), "do not match dtype and shape"),
        (entry(offsets=(8, 0)), "do not match dtype and shape"),
        (entry(offsets=(-8, 0)), "do not match dtype and shape"),
        (entry(offsets=(0.0, 8.0)), "do not match dtype and shape"),
        (entry(dtype="F4"), "unsupported dtype 'F4'"),
        (entry(shape=(-2,)), "bad dimension -2"),
        (entry(shape=(1,) * 17, offsets=(0, 4)), "17 dimensions"),
        (entry(offsets=(0,)), "malformed header entry"),
        (entry(shape=3), "malformed header entry"),
        ({"dtype": "F32", "shape": [2]}, "malformed header entry"),
        ("F32", "malformed header entry"),
        ([0, 8], "malformed header entry"),
    ],
)
def test_inconsistent_header_entry(tmp_path: Path, info: Any, why: str) -> None:
    file = write_raw(tmp_path / "bad.safetensors", {"w": info}, b"\0" * 64)
    text = load_failure(file)
    assert text.startswith(f"{file}: ") and why in text


def test_tensor_past_end_of_file(tmp_path: Path) -> None:
    file = write_raw(tmp_path / "short.safetensors", {"a": entry(offsets=(0, 8)), "b": entry(offsets=(8, 16))},
                     b"\0" * 12)
    assert load_failure(file) == f"{file}: tensor 'b' extends past the end of the file (truncated?)"


def test_tensor_ending_exactly_at_end_of_file(tmp_path: Path) -> None:
    file = write_raw(tmp_path / "ok.safetensors", {"a": entry(offsets=(0, 8)), "b": entry(offsets=(8, 16))},
                     bytes(range(16)))
    h = read_header(file)
    assert [(t.name, t.end - t.begin) for t in h.tensors] == [("a", 8), ("b", 8)]
    assert h.tensors[-1].end == h.file_size


def test_duplicate_tensor_across_shards(sharded: tuple[Path, dict[str, torch.Tensor]]) -> None:
    d, tensors = sharded
    dup = sorted(tensors)[0]
    save_file({dup: tensors[dup]}, str(d / "model-extra.safetensors"))
    text = load_failure(d)
    assert str(d.resolve()) in text and f"tensor {dup!r} appears in more than one shard" in text


def test_one_corrupt_shard_names_that_shard(sharded: tuple[Path, dict[str, torch.Tensor]]) -> None:
    d, _ = sharded
    bad = d / "model-00002-of-00002.safetensors"
    bad.write_bytes(bad.read_bytes()[:-1])
    assert load_failure(d).startswith(f"{bad.resolve()}: ")


def test_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("no weights here")
    (tmp_path / "dir.safetensors").mkdir()  # a directory is not a shard
    assert load_failure(tmp_path) == f"{tmp_path.resolve()}: no .safetensors files in this directory"


def test_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    assert load_failure(missing) == f"{missing.resolve()}: no such file or directory"


def test_unreadable_file(single: tuple[Path, dict[str, torch.Tensor]]) -> None:
    if os.geteuid() == 0:
        pytest.skip("root reads files whatever their mode")
    file, _ = single
    file.chmod(0)
    text = load_failure(file)
    assert text.startswith(f"{file}: cannot read: ")


# -- links and owners: what a peer who can write the model directory may plant ------------------


def test_a_link_out_of_the_directory_is_refused(sharded: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    d, _ = sharded
    secret = write_raw(tmp_path / "secret.safetensors", {"s": entry()}, b"\0" * 8)
    (d / "model-00003-of-00003.safetensors").symlink_to(secret)
    text = load_failure(d)
    assert "model-00003-of-00003.safetensors: a symbolic link out of the model directory" in text
    ckpt = Checkpoint.open(d, follow_links=True)  # what an operator may allow (a Hugging Face cache)
    assert {t.name for h in ckpt.headers for t in h.tensors} >= {"s"}
    ckpt.close()


def test_a_link_inside_the_directory_is_followed(sharded: tuple[Path, dict[str, torch.Tensor]]) -> None:
    d, tensors = sharded
    (d / "blobs").mkdir()
    (d / "model-00002-of-00002.safetensors").rename(d / "blobs" / "abc")
    (d / "model-00002-of-00002.safetensors").symlink_to("blobs/abc")
    with Checkpoint.open(d) as ckpt:
        assert {t.name for h in ckpt.headers for t in h.tensors} == set(tensors)


def test_a_link_through_the_parent_is_refused(sharded: tuple[Path, dict[str, torch.Tensor]]) -> None:
    d, _ = sharded
    (d / "model-00002-of-00002.safetensors").rename(d.parent / "elsewhere.safetensors")
    (d / "model-00002-of-00002.safetensors").symlink_to("../elsewhere.safetensors")
    assert "a symbolic link out of the model directory" in load_failure(d)


def test_reads_go_through_the_descriptors_opened_first(sharded: tuple[Path, dict[str, torch.Tensor]],
                                                       tmp_path: Path) -> None:
    d, tensors = sharded
    with Checkpoint.open(d) as ckpt:
        for f in d.glob("*.safetensors"):  # swapped by path after the open: not read
            f.unlink()
            f.symlink_to(tmp_path / "nowhere")
        arena, _ = fill_by_hand(ckpt, 64 << 20)
        assert ckpt.changed() == [h.file for h in ckpt.headers]  # unlinking changed their ctime
    for spec in ckpt.manifest().tensors:
        assert bytes(arena[spec.offset : spec.offset + spec.nbytes]) == raw_bytes(tensors[spec.name])


def test_writing_an_open_shard_is_seen(single: tuple[Path, dict[str, torch.Tensor]]) -> None:
    file, _ = single
    with Checkpoint.open(file) as ckpt:
        assert ckpt.changed() == []
        with open(file, "r+b") as f:
            f.seek(-4, os.SEEK_END)
            f.write(b"\1\2\3\4")
        os.utime(file, ns=(1, 1))  # whatever the clock's granularity
        assert ckpt.changed() == [file]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: files of another user")
def test_a_file_the_directory_owner_cannot_read_is_refused(sharded: tuple[Path, dict[str, torch.Tensor]],
                                                           tmp_path: Path) -> None:
    d, _ = sharded
    nobody = 65534
    os.chown(d, nobody, nobody)
    for f in d.glob("*.safetensors"):
        os.chown(f, nobody, nobody)
    with Checkpoint.open(d):
        pass
    secret = d / "model-00003-of-00003.safetensors"
    write_raw(secret, {"s": entry()}, b"\0" * 8)  # root's, 0600: as a hard link to /etc/shadow would be
    secret.chmod(0o600)
    assert load_failure(d) == (f"{secret}: the owner of its directory (uid {nobody}) may not read it, so "
                               "neither will the daemon (give the file to that user, or make it readable)")
    secret.chmod(0o644)
    with Checkpoint.open(d):
        pass
