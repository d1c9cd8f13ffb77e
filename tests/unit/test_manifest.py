"""Arena layouts: aligned offsets, sizes per dtype, C-contiguous strides, untrusted wire manifests."""

from __future__ import annotations

import math
import struct
from array import array
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from wcd.errors import BadRequest
from wcd.manifest import (
    ALIGN,
    DTYPE_CODES,
    DTYPE_SIZES,
    DTYPES,
    MAX_DIM,
    MAX_NAME_LEN,
    MAX_NDIM,
    TENSOR_COLUMNS,
    Manifest,
    TensorSpec,
    _check_name,
    tensor_nbytes,
)

SETTINGS = settings(max_examples=60, deadline=None)

# The torch dtype each safetensors name stands for: sizes are checked against torch, not restated.
TORCH_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E4M3FNUZ": torch.float8_e4m3fnuz, "F8_E5M2": torch.float8_e5m2,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz, "F8_E8M0": torch.float8_e8m0fnu,
    "I16": torch.int16, "U16": torch.uint16, "F16": torch.float16, "BF16": torch.bfloat16,
    "I32": torch.int32, "U32": torch.uint32, "F32": torch.float32,
    "I64": torch.int64, "U64": torch.uint64, "F64": torch.float64, "C64": torch.complex64,
}

shapes = st.lists(st.integers(0, 9), max_size=4).map(tuple)
layouts = st.lists(
    st.tuples(st.sampled_from(sorted(DTYPE_SIZES)), shapes), max_size=12,
).map(lambda rows: [(f"t{i}", dtype, shape) for i, (dtype, shape) in enumerate(rows)])


def element_size(dtype: str) -> int:
    return torch.empty((), dtype=TORCH_DTYPES[dtype]).element_size()


def wire(*rows: list[Any], size: int = 4096) -> dict[str, Any]:
    """The wire manifest with these [name, dtype, shape, offset] rows, one shape per row."""
    return columns(list(rows), size)


def refused(obj: Any) -> str:
    with pytest.raises(BadRequest) as info:
        Manifest.from_wire(obj)
    return info.value.message


# -- build --------------------------------------------------------------------------------------


def test_dtype_table_is_complete() -> None:
    assert set(DTYPE_SIZES) == set(TORCH_DTYPES)


@pytest.mark.parametrize("dtype", sorted(DTYPE_SIZES))
def test_size_of_every_dtype(dtype: str) -> None:
    m = Manifest.build([("a", dtype, (3, 5)), ("b", dtype, (7,))])
    a, b = m.tensors
    assert a.nbytes == 15 * element_size(dtype)
    assert b.nbytes == 7 * element_size(dtype)
    assert (a.offset, b.offset) == (0, ALIGN)
    assert m.nbytes == 22 * element_size(dtype)


@SETTINGS
@given(layout=layouts)
def test_build_aligns_and_packs_every_tensor(layout: list[tuple[str, str, tuple[int, ...]]]) -> None:
    m = Manifest.build(layout)
    assert [(t.name, t.dtype, t.shape) for t in m.tensors] == layout
    end = 0
    for t in m.tensors:
        assert t.nbytes == math.prod(t.shape) * element_size(t.dtype)
        assert t.offset % ALIGN == 0
        # the first aligned offset at or after the previous tensor's end
        assert end <= t.offset < end + ALIGN
        end = t.offset + t.nbytes
    assert m.size >= max(end, 1) and m.size % ALIGN == 0 and m.size < max(end, 1) + ALIGN
    assert m.nbytes == sum(t.nbytes for t in m.tensors)


def test_scalars_and_zero_size_tensors() -> None:
    m = Manifest.build([("s", "F32", ()), ("z", "BF16", (0, 4)), ("w", "I8", (3,)), ("z2", "F64", (5, 0))])
    s, z, w, z2 = m.tensors
    assert (s.offset, s.nbytes, s.shape, s.strides) == (0, 4, (), ())
    assert (z.offset, z.nbytes) == (ALIGN, 0)
    assert (w.offset, w.nbytes) == (ALIGN, 3)  # a zero-size tensor takes no room
    assert (z2.offset, z2.nbytes) == (2 * ALIGN, 0)
    assert m.size == 2 * ALIGN


def test_empty_manifest_still_has_one_aligned_block() -> None:
    m = Manifest.build([])
    assert m.tensors == () and m.size == ALIGN and m.nbytes == 0


@SETTINGS
@given(shape=st.lists(st.integers(1, 6), max_size=MAX_NDIM // 2).map(tuple))
def test_strides_are_c_contiguous(shape: tuple[int, ...]) -> None:
    # (torch writes max(d, 1) for empty dims; any stride addresses an empty tensor, so none here)
    spec = Manifest.build([("t", "F32", shape)]).tensors[0]
    assert spec.strides == torch.empty(shape).stride()


def test_strides_of_a_known_shape() -> None:
    assert TensorSpec("t", "F16", (2, 3, 4), 0, 48).strides == (12, 4, 1)


def test_duplicate_names() -> None:
    with pytest.raises(BadRequest, match="'w' appears twice") as info:
        Manifest.build([("w", "F32", (1,)), ("b", "F32", (1,)), ("w", "F16", (2,))])
    assert info.value.details == {"tensor": "w"}


@pytest.mark.parametrize("dtype", ["F4", "F6_E2M3", "f32", "", "STRING"])
def test_unsupported_dtype(dtype: str) -> None:
    with pytest.raises(BadRequest, match="unsupported dtype") as info:
        Manifest.build([("w", dtype, (1,))])
    assert info.value.details == {"tensor": "w"}


def test_dimension_limit() -> None:
    Manifest.build([("w", "U8", (1,) * MAX_NDIM)])
    with pytest.raises(BadRequest, match=f"{MAX_NDIM + 1} dimensions"):
        Manifest.build([("w", "U8", (1,) * (MAX_NDIM + 1))])


@pytest.mark.parametrize("shape", [(-1,), (2, 1.5), (True,), ("3",), (1 << 49,)])
def test_bad_dimensions(shape: tuple[Any, ...]) -> None:
    with pytest.raises(BadRequest, match="bad dimension"):
        Manifest.build([("w", "F32", shape)])


@pytest.mark.parametrize("name", ["", "x" * (MAX_NAME_LEN + 1), 7, None, "a\nFAKE LOG LINE", "nul\0", "del\x7f"])
def test_bad_names(name: Any) -> None:
    with pytest.raises(BadRequest, match="bad tensor name"):
        Manifest.build([(name, "F32", (1,))])


def test_name_length_limit_is_inclusive() -> None:
    assert Manifest.build([("x" * MAX_NAME_LEN, "F32", (1,))]).tensors[0].name == "x" * MAX_NAME_LEN


# -- wire form ----------------------------------------------------------------------------------


def test_to_wire_columns() -> None:
    m = Manifest.build([("w", "BF16", (2, 3)), ("b", "F32", ()), ("v", "BF16", (2, 3))])
    w = m.to_wire()
    assert w["size"] == m.size and w["names"].split("\0") == ["w", "b", "v"]
    assert [DTYPES[c] for c in w["dtypes"]] == ["BF16", "F32", "BF16"]
    assert list(w["shape_ndims"]) == [2, 0]  # two distinct shapes: (2, 3) and ()
    assert struct.unpack("<2Q", w["shape_dims"]) == (2, 3)
    assert struct.unpack("<3I", w["shape_ids"]) == (0, 1, 0)
    assert struct.unpack("<3Q", w["offsets"]) == (0, 256, 512)
    assert struct.unpack("<3I", w["runs"]) == (1, 1, 1)


def test_grouped_puts_interleaved_layers_into_runs() -> None:
    layout = []
    for i in range(50):  # k and v share a shape and interleave; norms too
        layout += [(f"{i}.q", "BF16", (8, 8)), (f"{i}.k", "BF16", (2, 8)), (f"{i}.v", "BF16", (2, 8)),
                   (f"{i}.n1", "F32", (8,)), (f"{i}.n2", "F32", (8,))]
    layout += [("odd", "BF16", (2, 8))]  # one more of k's shape, off the layer stride
    m = Manifest.build(layout)
    g = m.grouped()
    assert g == m  # the same tensors at the same offsets
    assert sorted(g.runs) == [1, 50, 50, 50, 50, 50] and sum(g.runs) == len(m)
    assert not m.wire_ready()
    assert Manifest.from_wire(m.wire()).runs == g.runs
    assert m.wire() is m.wire() and m.wire_ready()


def reference_grouped(m: Manifest) -> Manifest:
    """`Manifest.grouped` as it was written a tensor at a time (wcd before the columnar one)."""
    ndt, codes, ids, offs = len(DTYPES), m.dtype_codes, m.shape_ids, m.offsets

    def stride_runs(lane: list[int]) -> list[int]:
        out, i = [], 0
        while i < len(lane):
            j = i + 1
            if j < len(lane):
                step = offs[lane[j]] - offs[lane[i]]
                j += 1
                while j < len(lane) and offs[lane[j]] - offs[lane[j - 1]] == step:
                    j += 1
            out.append(j - i)
            i = j
        return out

    groups: dict[int, list[int]] = {}
    for i in sorted(range(len(m.names)), key=offs.__getitem__):
        groups.setdefault(ids[i] * ndt + codes[i], []).append(i)
    order: list[int] = []
    runs: list[int] = []
    for members in groups.values():
        best: tuple[list[int], list[int]] | None = None
        for k in range(1, min(8, len(members)) + 1):
            lanes = [members[r::k] for r in range(k)]
            counts = [c for lane in lanes for c in stride_runs(lane)]
            if best is None or len(counts) < len(best[1]):
                best = ([i for lane in lanes for i in lane], counts)
            if len(counts) <= k:
                break
        assert best is not None
        order += best[0]
        runs += best[1]
    return Manifest(tuple(m.names[i] for i in order), bytes(codes[i] for i in order), m.shapes,
                    array("I", [ids[i] for i in order]), array("Q", [offs[i] for i in order]),
                    [m.sizes[i] for i in order], m.size, runs=array("I", runs))


@st.composite
def shuffled_columns(draw: st.DrawFn) -> Manifest:
    """Columns as `grouped` may meet them: groups of (dtype, shape) interleaved with a period or at
    random, offsets at one or several strides, in order or not, shared, with gaps and outliers."""
    n = draw(st.integers(0, 80))
    kinds = draw(st.integers(1, 4))
    period = draw(st.integers(1, 5))
    periodic = draw(st.booleans())
    group = [i % period % kinds if periodic else draw(st.integers(0, kinds - 1)) for i in range(n)]
    stride = draw(st.sampled_from([0, 256, 512, 4096]))
    offsets = [i * stride for i in range(n)]
    for _ in range(draw(st.integers(0, 4)) if n else 0):  # outliers: a gap, a shared offset, a step back
        i = draw(st.integers(0, n - 1))
        offsets[i] = draw(st.sampled_from([offsets[i] + 256, offsets[max(i - 1, 0)], max(offsets[i] - 768, 0)]))
    if draw(st.booleans()):  # a stride change half-way
        half = n // 2
        offsets[half:] = [offsets[half - 1 if half else 0] + (i + 1) * 768 for i in range(n - half)]
    if draw(st.booleans()):
        perm = draw(st.permutations(range(n)))
        group, offsets = [group[i] for i in perm], [offsets[i] for i in perm]
    codes = bytes(draw(st.sampled_from([0, 11, 14])) if k == 3 else (11 if k < 2 else 14) for k in group)
    ids = array("I", [k % 3 for k in group])
    names = tuple(f"t{i}" for i in range(n))
    size = max(offsets, default=0) + 256
    return Manifest(names, codes, ((4,), (2, 2), (1,)), ids, array("Q", offsets), [8] * n, size)


@settings(max_examples=600, deadline=None)
@given(m=shuffled_columns())
def test_grouped_is_the_per_tensor_grouping(m: Manifest) -> None:
    got, want = m.grouped(), reference_grouped(m)
    assert (got.names, got.dtype_codes, got.shapes, got.shape_ids, got.offsets, got.sizes, got.size, got.runs) == \
        (want.names, want.dtype_codes, want.shapes, want.shape_ids, want.offsets, want.sizes, want.size, want.runs)


def test_grouped_of_experts_is_one_run_of_the_same_columns() -> None:
    m = Manifest.build((f"e.{i}", "BF16", (8000,)) for i in range(1000))
    g = m.grouped()
    assert list(g.runs) == [1000] and g.names is m.names and g.offsets is m.offsets


def test_v2_refuses_runs_that_are_not_runs() -> None:
    rows = [["a", "F32", [64], 0], ["b", "F32", [64], 256], ["c", "F32", [64], 768], ["d", "U8", [256], 1024]]
    good = {**columns(rows), "shape_ids": struct.pack("<4I", 0, 0, 0, 3)}  # a, b and c share a shape
    Manifest.from_wire({**good, "runs": struct.pack("<3I", 2, 1, 1)})  # a and b: one stride
    for runs, why in [((3, 1), "not one dtype, shape and stride"), ((1, 1, 2), "not one dtype, shape and stride"),
                      ((2, 1), "cover 3 of 4"), ((2, 0, 2), "cover"), ((5,), "cover")]:
        assert why in refused({**good, "runs": struct.pack(f"<{len(runs)}I", *runs)}), runs
    one_shape = {**columns([["a", "F32", [64], 512], ["b", "F32", [64], 0]]), "shape_ids": struct.pack("<2I", 0, 0)}
    assert "negative stride" in refused({**one_shape, "runs": struct.pack("<1I", 2)})


@SETTINGS
@given(layout=layouts)
def test_wire_round_trip(layout: list[tuple[str, str, tuple[int, ...]]]) -> None:
    m = Manifest.build(layout)
    assert Manifest.from_wire(m.to_wire()) == m
    over_msgpack = msgpack.unpackb(msgpack.packb(m.to_wire(), use_bin_type=True), raw=False)
    assert Manifest.from_wire(over_msgpack) == m


def columns(rows: list[list[Any]], size: int = 4096) -> dict[str, Any]:
    """A wire manifest with the given [name, dtype, shape, offset] rows, one shape per row."""
    return {
        "size": size, "names": "\0".join(r[0] for r in rows), "dtypes": bytes(DTYPES.index(r[1]) for r in rows),
        "shape_ndims": bytes(len(r[2]) for r in rows),
        "shape_dims": struct.pack(f"<{sum(len(r[2]) for r in rows)}Q", *(d for r in rows for d in r[2])),
        "shape_ids": struct.pack(f"<{len(rows)}I", *range(len(rows))),
        "offsets": struct.pack(f"<{len(rows)}Q", *(r[3] for r in rows)),
        "runs": struct.pack(f"<{len(rows)}I", *[1] * len(rows)),
    }


def test_v2_accepts_any_order_gaps_and_shared_zero_size_offsets() -> None:
    m = Manifest.from_wire(columns([["b", "F32", [64], 1024], ["a", "F32", [64], 0], ["z", "F32", [0], 0],
                                    ["y", "F32", [0], 1024]]))
    assert [(t.name, t.offset, t.nbytes) for t in m.tensors] == [("b", 1024, 256), ("a", 0, 256), ("z", 0, 0),
                                                                  ("y", 1024, 0)]


@pytest.mark.parametrize(
    ("rows", "size", "why"),
    [
        ([["a", "F32", [64], 128]], 4096, "not aligned or outside"),
        ([["a", "F32", [65], 256]], 512, "not aligned or outside"),
        ([["a", "U8", [0], 768]], 512, "not aligned or outside"),
        ([["a", "U8", [257], 0], ["b", "U8", [1], 256]], 4096, "overlap"),
        ([["b", "U8", [1], 256], ["a", "U8", [257], 0]], 4096, "overlap"),
        ([["a", "U8", [1], 0], ["a", "U8", [1], 256]], 4096, "'a' appears twice"),
        ([["", "U8", [1], 0]], 4096, "bad tensor name"),
        ([["x" * (MAX_NAME_LEN + 1), "U8", [1], 0]], 4096, "bad tensor name"),
        ([["a", "U8", [1] * (MAX_NDIM + 1), 0]], 4096, "dimensions"),
        ([["a", "U8", [(1 << 48) + 1], 0]], 4096, "bad dimension"),
        ([], 0, "out of range"),
    ],
)
def test_v2_refuses(rows: list[list[Any]], size: int, why: str) -> None:
    assert why in refused(columns(rows, size))


def test_v2_refuses_inconsistent_columns() -> None:
    good = columns([["a", "U8", [1], 0], ["b", "U8", [1], 256]])
    for field, value, why in [
        ("dtypes", bytes([len(DTYPES)]) * 2, "unsupported dtype code"),
        ("shape_ids", struct.pack("<2I", 0, 2), "shape index"),
        ("shape_ids", struct.pack("<1I", 0), "do not agree"),
        ("offsets", struct.pack("<3Q", 0, 256, 512), "do not agree"),
        ("shape_dims", struct.pack("<1Q", 1), "do not agree"),
        ("names", "a\0b\0c", "do not agree"),
        ("names", "a\0\0", "do not agree"),
        ("names", b"a\0b", "manifest must be"),
        ("offsets", "x", "manifest must be"),
    ]:
        assert why in refused({**good, field: value}), field


def test_v2_accepts_what_v1_accepts() -> None:
    rows = [["a", "F32", [64], 0], ["b", "BF16", [3, 5], 256], ["c", "F32", [], 512]]
    assert Manifest.from_wire(columns(rows)) == Manifest.from_wire(wire(*rows))


_row = st.tuples(
    st.sampled_from(["a", "b", "c", "", "d\n", "e\0"]), st.sampled_from(sorted(DTYPE_SIZES)),
    st.lists(st.integers(0, 40), max_size=3), st.integers(0, 20).map(lambda k: k * 128),
).map(list)


@SETTINGS
@given(size=st.integers(0, 4096), rows=st.lists(_row, max_size=6))
def test_the_bulk_validator_agrees_with_a_per_row_one(size: int, rows: list[list[Any]]) -> None:
    """`from_wire`'s bulk checks of the columns accept exactly the layouts a check of one row at a
    time accepts, and build the same manifest."""
    try:
        bulk = Manifest.from_wire(columns(rows, size))
    except BadRequest:
        bulk = None
    assert bulk == per_row(size, rows)


def per_row(size: int, rows: list[list[Any]]) -> Manifest | None:
    """The reference: each row checked on its own (name, dtype, shape, alignment, bounds), then
    overlaps; None where it is refused."""
    if size <= 0 or size > MAX_DIM:
        return None
    names, seen, shape_index, offsets, sizes = [], set(), {}, array("Q"), []
    codes, ids = bytearray(), array("I")
    for name, dtype, shape, offset in rows:
        try:
            _check_name(name)
            nbytes = tensor_nbytes(name, dtype, tuple(shape))
        except BadRequest:
            return None
        if name in seen or offset % ALIGN or offset + nbytes > size:
            return None
        seen.add(name)
        names.append(name)
        codes.append(DTYPE_CODES[dtype])
        ids.append(shape_index.setdefault(tuple(shape), len(shape_index)))
        offsets.append(offset)
        sizes.append(nbytes)
    live = sorted((o, o + n) for o, n in zip(offsets, sizes) if n)
    if any(end > start for (_, end), (start, _) in zip(live, live[1:])):
        return None
    return Manifest(tuple(names), bytes(codes), tuple(shape_index), ids, offsets, sizes, size)


@SETTINGS
@given(size=st.integers(-10, 1 << 50) | st.none(), data=st.data())
def test_v2_never_raises_anything_but_bad_request(size: Any, data: Any) -> None:
    obj = columns([["a", "U8", [3], 0], ["b", "F32", [2, 2], 256]])
    obj["size"] = size
    for field in ("names", "dtypes", "shape_ndims", "shape_dims", "shape_ids", "offsets"):
        if data.draw(st.booleans()):
            obj[field] = data.draw(st.binary(max_size=24) | st.text(max_size=8) | st.none() | st.integers())
    try:
        m = Manifest.from_wire(obj)
    except BadRequest:
        return
    live = sorted((t for t in m.tensors if t.nbytes), key=lambda t: t.offset)
    for t in m.tensors:
        assert t.offset % ALIGN == 0 and t.offset + t.nbytes <= m.size and t.dtype in DTYPE_SIZES
    for a, b in zip(live, live[1:]):
        assert a.offset + a.nbytes <= b.offset


def test_from_wire_accepts_any_order_gaps_and_shared_zero_size_offsets() -> None:
    m = Manifest.from_wire(wire(["b", "F32", [64], 1024], ["a", "F32", [64], 0], ["z", "F32", [0], 0],
                                ["e", "U8", [0], 4096]))
    assert [(t.name, t.offset, t.nbytes) for t in m.tensors] == [("b", 1024, 256), ("a", 0, 256), ("z", 0, 0),
                                                                 ("e", 4096, 0)]
    assert m.size == 4096


def test_from_wire_tensor_may_end_exactly_at_size() -> None:
    assert Manifest.from_wire(wire(["a", "F32", [64], 256], size=512)).tensors[0].offset == 256


def test_from_wire_misaligned_offset() -> None:
    assert "offset 128 not aligned" in refused(wire(["a", "F32", [4], 128]))


def test_from_wire_overlap() -> None:
    text = refused(wire(["a", "F32", [128], 0], ["b", "F32", [1], 256]))
    assert "'a' and 'b' overlap" in text


def test_from_wire_one_byte_overlap_and_exact_adjacency() -> None:
    assert "'a' and 'b' overlap" in refused(wire(["a", "U8", [257], 0], ["b", "U8", [1], 256]))
    m = Manifest.from_wire(wire(["a", "U8", [256], 0], ["b", "U8", [1], 256]))
    assert [t.offset + t.nbytes for t in m.tensors] == [256, 257]


def test_from_wire_overlap_regardless_of_row_order() -> None:
    assert "overlap" in refused(wire(["b", "F32", [1], 768], ["c", "U8", [1], 256], ["a", "F32", [128], 512]))


def test_from_wire_out_of_bounds() -> None:
    assert "outside the arena" in refused(wire(["a", "F32", [65], 256], size=512))
    assert "outside the arena" in refused(wire(["a", "U8", [0], 768], size=512))


@pytest.mark.parametrize(
    "obj",
    [None, [], {"size": 256}, {"tensors": []}, {"size": "256", "tensors": []}, {"size": True, "tensors": []},
     {"size": 256.0, "tensors": []}, {"size": 256, "tensors": {}}],
)
def test_from_wire_bad_envelope(obj: Any) -> None:
    assert refused(obj).startswith("manifest must be")


@pytest.mark.parametrize("size", [0, -256, (1 << 48) + 256])
def test_from_wire_size_out_of_range(size: int) -> None:
    assert "out of range" in refused(wire(["a", "F32", [1], 0], size=size))


@pytest.mark.parametrize(
    ("row", "why"),
    [
        (["", "F32", [1], 0], "bad tensor name"),
        (["a", "F32", [1 << 60], 0], "bad dimension"),
        (["a", "F32", [1] * (MAX_NDIM + 1), 0], "dimensions"),
    ],
)
def test_from_wire_bad_field_types(row: list[Any], why: str) -> None:
    assert why in refused(wire(row))


def test_from_wire_duplicate_names() -> None:
    assert "'a' appears twice" in refused(wire(["a", "F32", [1], 0], ["a", "F32", [1], 256]))


def test_layout_columns_lays_out_what_build_does() -> None:
    rows = [("a", "BF16", (2, 3)), ("b", "F32", ()), ("c", "BF16", (2, 3)), ("d", "U8", (0,))]
    wire = Manifest.build(rows).to_wire()
    columns = {k: wire[k] for k in TENSOR_COLUMNS}
    assert Manifest.layout_columns(columns) == Manifest.build(rows)
    assert "appears twice" in refused_columns({**columns, "names": "a\0b\0a\0d"})
    assert "do not agree" in refused_columns({**columns, "shape_ids": b"\0\0\0\0"})
    assert "tensors must be" in refused_columns({**columns, "dtypes": "x"})
    assert "tensors must be" in refused_columns(None)


@pytest.mark.parametrize("rows", [
    [],
    [("a", "U8", (0,))],  # all of one size, and that size 0
    [("a", "U8", (0,)), ("b", "BF16", (0, 4))],
    [(f"e{i}", "BF16", (8, 8)) for i in range(5)],  # all of one size: laid out as one range
    [("a", "BF16", (128,)), ("b", "U8", (256,)), ("c", "F32", (7,)), ("d", "U8", (0,)), ("e", "BF16", (128,))],
])
def test_columns_are_laid_out_as_build_lays_out_rows(rows: list[tuple[str, str, tuple[int, ...]]]) -> None:
    built = Manifest.build(rows)
    m = Manifest.from_columns(built.names, built.dtype_codes, built.shapes, built.shape_ids, built.sizes)
    assert (m.offsets, m.size, m.tensors) == (built.offsets, built.size, built.tensors)


def refused_columns(obj: Any) -> str:
    with pytest.raises(BadRequest) as info:
        Manifest.layout_columns(obj)
    return info.value.message
