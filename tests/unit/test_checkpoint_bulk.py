"""The bulk (columnar) header parser, layout and copy plan against straightforward per-tensor
references: the parser, manifest and plan as they were written one tensor at a time. Random
headers, mostly valid and sometimes broken in each way a header can be, must give the same
tensors, layout and reads, or the same error."""

from __future__ import annotations

import json
import struct
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wcd.checkpoint import MAX_PIECES, Checkpoint, CopyOp
from wcd.errors import BadRequest, LoadFailed, WcdError
from wcd.headers import read_header
from wcd.manifest import Manifest, tensor_nbytes

Row = tuple[str, str, tuple[int, ...], int, int]  # name, dtype, shape, absolute begin, end


def reference_parse(file: Path) -> list[Row]:
    """The per-tensor parser (wcd before the columns), from the file's header on."""
    raw = file.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    try:
        doc = json.loads(raw[8 : 8 + n])
    except (ValueError, RecursionError) as e:
        raise LoadFailed(f"{file}: safetensors header is not valid JSON ({str(e)[:200]})") from None
    if not isinstance(doc, dict):
        raise LoadFailed(f"{file}: safetensors header is not a JSON object")
    data_start, file_size = 8 + n, len(raw)
    rows = []
    for name, info in doc.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            nbytes = tensor_nbytes(name, dtype, shape)
        except WcdError as bad:
            raise LoadFailed(f"{file}: {bad.message}") from None
        except (KeyError, TypeError, ValueError):
            raise LoadFailed(f"{file}: tensor {name!r} has a malformed header entry") from None
        if type(begin) is not int or type(end) is not int or not 0 <= begin <= end or end - begin != nbytes:
            raise LoadFailed(f"{file}: tensor {name!r}: data_offsets {[begin, end]} do not match dtype and shape")
        if data_start + end > file_size:
            raise LoadFailed(f"{file}: tensor {name!r} extends past the end of the file (truncated?)")
        rows.append((name, dtype, shape, data_start + begin, data_start + end))
    rows.sort(key=lambda t: t[3])
    reach: Row | None = None
    for t in rows:
        if t[4] > t[3]:
            if reach is not None and t[3] < reach[4]:
                raise LoadFailed(f"{file}: tensors {reach[0]!r} and {t[0]!r} overlap (data_offsets)")
            if reach is None or t[4] > reach[4]:
                reach = t
    return rows


def parsed(file: Path) -> list[Row]:
    return [(t.name, t.dtype, t.shape, t.begin, t.end) for t in read_header(file).tensors]


# (shard, file offset, arena offset, nbytes, pieces): a `CopyOp` with its runs as one piece per tensor
PlanOp = tuple[int, int, int, int, tuple[tuple[int, int], ...]]


def as_pieces(plan: list[CopyOp]) -> list[PlanOp]:
    """The plan with each op's runs spelled out piece by piece; and each op's runs are maximal:
    a run is one width at one stride (the width rounded up to 256), and the next one could not
    have continued it."""
    for op in plan:
        for _, width, stride, count in op.runs:
            assert width > 0 and count > 0 and stride == -(-width // 256) * 256
        for (rel, width, stride, count), (rel2, width2, _, _) in zip(op.runs, op.runs[1:]):
            assert width2 != width or rel2 != rel + stride * count
    return [(op.shard, op.file_offset, op.arena_offset, op.nbytes, op.pieces) for op in plan]


def reference_plan(shards: list[list[Row]], offsets: list[int], chunk: int, batch: int) -> list[PlanOp]:
    """The per-tensor copy plan (wcd before the columns)."""
    ops: list[PlanOp] = []

    def run_op(shard: int, run: list[tuple[Row, int]]) -> PlanOp:
        base = run[0][1]
        pieces = tuple((at - base, t[4] - t[3]) for t, at in run)
        span = pieces[-1][0] + pieces[-1][1]
        return (shard, run[0][0][3], base, span, () if span == run[-1][0][4] - run[0][0][3] else pieces)

    i = 0
    for shard, rows in enumerate(shards):
        run: list[tuple[Row, int]] = []
        for t in rows:
            at, n = offsets[i], t[4] - t[3]
            i += 1
            if n == 0:
                continue
            if run and (n >= batch or t[3] != run[-1][0][4] or len(run) == MAX_PIECES or at + n - run[0][1] > batch):
                ops.append(run_op(shard, run))
                run = []
            if n >= batch:
                ops.extend((shard, t[3] + pos, at + pos, min(chunk, n - pos), ()) for pos in range(0, n, chunk))
            else:
                run.append((t, at))
        if run:
            ops.append(run_op(shard, run))
    return ops


def outcome(f: Any) -> tuple[str, Any]:
    try:
        return "ok", f()
    except (LoadFailed, BadRequest) as e:
        return type(e).__name__, e.message


GOOD_DTYPES = ["F32", "BF16", "U8", "I64", "BOOL"]
good_shapes = st.lists(st.integers(0, 6), max_size=3).map(tuple)
names = st.one_of(st.sampled_from(["a", "b", "c", "layer.0.w", "layer.1.w", "__metadata__", "", "x\x01", "é"]),
                  st.text(max_size=4))


def damaged(entry: dict[str, Any]) -> list[Any]:
    """Every way this test breaks a header entry (and a few odd but valid ones), one change each."""
    begin, end = entry["data_offsets"]

    def with_(**change: Any) -> dict[str, Any]:
        return {**entry, **change}

    return [
        {"format": "pt"}, "F32", [0, 8], 7, None, {},  # not a tensor entry
        *({k: v for k, v in entry.items() if k != key} for key in entry),  # a key missing
        *(with_(dtype=d) for d in ["F4", "f32", 3, None, ["F32"], ""]),
        *(with_(shape=s) for s in ["", {}, "ab", {"k": 1}, 3, None, [1] * 17, [-1], [True], [1.0], [1 << 49],
                                   ["2"], [None], [[2]], [2, False]]),
        *(with_(data_offsets=o) for o in [[begin], [begin, end, 0], [begin, end + 1], [end, begin],
                                          [-1, end - begin - 1], [float(begin), float(end)], [False, end],
                                          [begin, True], {"a": 1, "b": 2}, "ab", None, [], 5, [begin, float(end)]]),
        with_(extra=[1, {"x": None}]),  # unknown keys are ignored
    ]


@st.composite
def headers(draw: st.DrawFn) -> tuple[dict[str, Any], int]:
    """A header (name -> entry) and the length of its data section: valid entries laid out with
    gaps and now and then an overlap, and most headers with one entry damaged in one way."""
    doc: dict[str, Any] = {}
    cursor = 0
    n = draw(st.integers(0, 8))
    bad = draw(st.integers(-2, n - 1))  # the entry to damage, if any: one, so that no other error hides it
    for i in range(n):
        dtype, shape = draw(st.sampled_from(GOOD_DTYPES)), draw(good_shapes)
        cursor += draw(st.sampled_from([0, 0, 0, 0, 1, 8, 300, -4]))
        begin = max(cursor, 0)
        cursor = begin + tensor_nbytes("", dtype, shape)
        entry: Any = {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, cursor]}
        if i == bad:
            entry = draw(st.sampled_from(damaged(entry)))
        doc[draw(names)] = entry
    items = list(doc.items())
    if draw(st.booleans()):  # not in data order
        items = [items[i] for i in draw(st.permutations(range(len(items))))]
    return dict(items), max(cursor + draw(st.sampled_from([0, 0, 0, 3, -1])), 0)


@st.composite
def expert_headers(draw: st.DrawFn) -> tuple[dict[str, Any], int]:
    """Headers as MoE expert shards have them (one dtype and shape, back to back in order), which the
    parser checks with fewer passes; now and then one entry damaged, moved, or equal to the others
    only by value (a float or bool dimension or offset), or a boundary between two moved, or the
    data cut short."""
    n = draw(st.integers(1, 30))
    dtype, shape = draw(st.sampled_from(GOOD_DTYPES)), draw(good_shapes)
    size, start = tensor_nbytes("", dtype, shape), draw(st.sampled_from([0, 0, 8, 300]))
    doc: dict[str, Any] = {f"e.{i}": {"dtype": dtype, "shape": list(shape), "data_offsets": [start + i * size,
                                                                                          start + (i + 1) * size]}
                           for i in range(n)}
    if draw(st.booleans()):
        name = f"e.{draw(st.integers(0, n - 1))}"
        entry = doc[name]
        begin, end = entry["data_offsets"]
        doc[name] = draw(st.sampled_from([
            *damaged(entry),
            {**entry, "shape": [float(d) for d in shape] or [1.0]}, {**entry, "shape": [True] * len(shape) or [True]},
            {**entry, "data_offsets": [begin + 1, end + 1]}, {**entry, "data_offsets": [begin - 1, end - 1]},
            {**entry, "data_offsets": [float(begin), end]}, {**entry, "data_offsets": [begin, float(end)]},
        ]))
    elif n > 1 and draw(st.booleans()):  # a boundary moved: still back to back, two sizes wrong
        i, by = draw(st.integers(0, n - 2)), draw(st.sampled_from([1, -1, size, -size]))
        doc[f"e.{i}"]["data_offsets"][1] += by
        doc[f"e.{i + 1}"]["data_offsets"][0] += by
    return doc, max(start + n * size + draw(st.sampled_from([0, 0, 0, 5, -1])), 0)


any_headers = st.one_of(headers(), expert_headers())


def write(file: Path, doc: dict[str, Any], data_len: int) -> Path:
    raw = json.dumps(doc).encode()
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\xab" * data_len)
    return file


@pytest.mark.slow
@settings(max_examples=800, deadline=None)
@given(header=any_headers)
def test_parser_accepts_exactly_what_the_per_tensor_parser_accepts(header: tuple[dict[str, Any], int]) -> None:
    doc, data_len = header
    with tempfile.TemporaryDirectory() as tmp:
        file = write(Path(tmp) / "m.safetensors", doc, data_len)
        want = outcome(partial(reference_parse, file))
        assert outcome(partial(parsed, file)) == want
        if want[0] == "ok":
            h = read_header(file)
            assert h.sizes == [t[4] - t[3] for t in want[1]]
            assert [h.data_start + b for b in h.begins] == [t[3] for t in want[1]]


def test_each_damage_alone_is_refused_as_the_per_tensor_parser_refuses_it(tmp_path: Path) -> None:
    """Every damage of `damaged`, to the first, middle or last of three tensors, nothing else wrong."""
    good = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "b": {"dtype": "U8", "shape": [], "data_offsets": [8, 9]},
            "c": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [9, 17]}}
    refused = 0
    for name in good:
        for bad in damaged(good[name]):
            file = write(tmp_path / "m.safetensors", {**good, name: bad}, 17)
            want = outcome(partial(reference_parse, file))
            assert outcome(partial(parsed, file)) == want
            refused += want[0] != "ok"
    assert refused > 100  # the damages do damage


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(shards=st.lists(any_headers, min_size=1, max_size=3), chunk=st.integers(1, 600), data=st.data())
def test_layout_and_plan_match_the_per_tensor_ones(shards: list[tuple[dict[str, Any], int]], chunk: int,
                                                   data: st.DataObject) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        files = [write(Path(tmp) / f"m{i}.safetensors", doc, n) for i, (doc, n) in enumerate(shards)]
        references = [outcome(partial(reference_parse, f)) for f in files]
        if any(r[0] != "ok" for r in references):
            return  # refusals: the other tests
        rows: list[list[Row]] = [r[1] for r in references]
        seen: set[str] = set()
        dup = next((t[0] for shard in rows for t in shard if t[0] in seen or seen.add(t[0])), None)  # type: ignore[func-returns-value]
        opened = outcome(lambda: Checkpoint.open(tmp))
        if dup is not None:
            assert opened == ("LoadFailed", f"{Path(tmp).resolve()}: tensor {dup!r} appears in more than one shard")
            return
        assert opened[0] == "ok"
        with opened[1] as ckpt:
            want = outcome(lambda: Manifest.build((t[0], t[1], t[2]) for shard in rows for t in shard))
            got = outcome(ckpt.manifest)
            if want[0] != "ok":
                assert got == want  # a bad name, say: the same error as `build`'s
            else:
                assert got[0] == "ok" and got[1] == want[1]
                assert (got[1].names, got[1].offsets, got[1].size) == (want[1].names, want[1].offsets, want[1].size)
                m = got[1]
                # Batch limits at, just under and just over where runs of tensors end in the arena.
                ends = [m.offsets[j] + m.sizes[j] - m.offsets[i] for i in range(len(m)) for j in range(i, len(m))]
                batch = max(1, data.draw(st.sampled_from(ends or [1])) + data.draw(st.sampled_from([-1, 0, 1, 1000])))
                plan = as_pieces(ckpt.copy_plan(got[1], chunk, batch))
                assert plan == reference_plan(rows, list(want[1].offsets), chunk, batch)
                assert ckpt.nbytes == sum(t[4] - t[3] for shard in rows for t in shard)


# Headers where pydantic_core's JSON parser and `json.loads` part ways (the parse tries the first
# and falls back to the second): each must be read, or refused, exactly as `json.loads` reads it.
_T = b'{"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}'
JSON_EDGES = {
    "lone surrogate escape": b'{"\\ud800": ' + _T + b"}",
    "surrogate pair escape": b'{"\\ud83d\\ude00": ' + _T + b"}",
    "surrogate as UTF-8 bytes": b'{"\xed\xa0\x80": ' + _T + b"}",
    "invalid UTF-8": b'{"\xff": ' + _T + b"}",
    "BOM": b"\xef\xbb\xbf{\"a\": " + _T + b"}",
    "UTF-16": ('{"a": ' + _T.decode() + "}").encode("utf-16-le"),
    "duplicate name, last wins": b'{"a": {"dtype": "F32", "shape": [9], "data_offsets": [0, 36]}, "a": ' + _T + b"}",
    "duplicate key in an entry": b'{"a": {"dtype": "F32", "dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}',
    "NaN offset": b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [NaN, 1]}}',
    "Infinity dimension": b'{"a": {"dtype": "U8", "shape": [Infinity], "data_offsets": [0, 1]}}',
    "30-digit offset": b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, ' + b"9" * 30 + b"]}}",
    "5000-digit offset": b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, ' + b"9" * 5000 + b"]}}",
    "-0": b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [-0, 1]}}',
    "1e0": b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1e0]}}',
    "leading zero": b'{"a": {"dtype": "U8", "shape": [01], "data_offsets": [0, 1]}}',
    "control character in a name": b'{"a\x01": ' + _T + b"}",
    "escaped control character": b'{"a\\u0001": ' + _T + b"}",
    "trailing data": b'{"a": ' + _T + b"} x",
    "trailing NUL": b'{"a": ' + _T + b"}\x00",
    "trailing comma": b'{"a": ' + _T + b",}",
    "deep metadata": b'{"__metadata__": ' + b"[" * 100_000 + b"]" * 100_000 + b', "a": ' + _T + b"}",
    "metadata not strings": b'{"__metadata__": {"x": [1, null, 2.5]}, "a": ' + _T + b"}",
}


@pytest.mark.parametrize("raw", JSON_EDGES.values(), ids=JSON_EDGES.keys())
def test_json_edges_are_read_as_json_loads_reads_them(tmp_path: Path, raw: bytes) -> None:
    file = tmp_path / "m.safetensors"
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\xab" * 40)
    assert outcome(partial(parsed, file)) == outcome(partial(reference_parse, file))


@settings(max_examples=500, deadline=None)
@given(header=headers(), cuts=st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 3),
                                                 st.sampled_from([b"", b"\\ud800", b"\xed\xa0\x80", b"\xff", b",",
                                                                  b"}", b'"', b"NaN", b"-", b"0", b"\x00", b" "])),
                                       max_size=3))
@pytest.mark.slow
def test_damaged_json_is_read_as_json_loads_reads_it(header: tuple[dict[str, Any], int],
                                                     cuts: list[tuple[int, int, bytes]]) -> None:
    """A header's bytes cut and spliced: whatever JSON comes of it, or none, `json.loads`'s reading."""
    doc, data_len = header
    raw = bytearray(json.dumps(doc).encode())
    for at, width, insert in cuts:
        at %= len(raw) + 1
        raw[at : at + width] = insert
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "m.safetensors"
        file.write_bytes(struct.pack("<Q", len(raw)) + bytes(raw) + b"\xab" * data_len)
        assert outcome(partial(parsed, file)) == outcome(partial(reference_parse, file))
