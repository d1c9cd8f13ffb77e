"""A large header is parsed in pieces (`headers._decode_in_pieces`) so that no one call holds the
GIL for the whole of it: the pieces read exactly what one parse reads, or the header is parsed whole."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from pydantic_core import from_json

from tests.unit.test_checkpoint_bulk import any_headers
from wcd import headers

TRICKY = st.sampled_from(['},"', '}, "', '"', "\\", "{", "}", ",", ":", "é", "\u2028", "\0", " "])
NAMES = st.lists(st.one_of(TRICKY, st.text(max_size=4)), max_size=6).map("".join)
ENTRY = st.fixed_dictionaries({"dtype": st.sampled_from(["BF16", "F32"]),
                               "shape": st.lists(st.integers(0, 9), max_size=3),
                               "data_offsets": st.tuples(st.integers(0, 99), st.integers(0, 99)).map(list)})
METADATA = st.recursive(st.text(max_size=3) | st.integers(), lambda inner: st.dictionaries(NAMES, inner, max_size=3),
                        max_leaves=6)


def header(entries: list[tuple[str, Any]], separators: tuple[str, str], pad: int) -> bytes:
    """A JSON object with these members in this order (a name may repeat), as a writer lays it out."""
    comma, colon = separators
    members = [json.dumps(k) + colon + json.dumps(v, separators=separators) for k, v in entries]
    return ("{" + comma.join(members) + "}").encode() + b" " * pad


@settings(max_examples=400, deadline=None)
@given(entries=st.lists(st.tuples(NAMES, ENTRY | METADATA), min_size=1, max_size=12),
       separators=st.sampled_from([(",", ":"), (", ", ": ")]), pad=st.integers(0, 7), piece=st.integers(1, 40))
@pytest.mark.slow
def test_pieces_read_what_one_parse_reads(entries: list[tuple[str, Any]], separators: tuple[str, str], pad: int,
                                          piece: int) -> None:
    raw = header(entries, separators, pad)
    whole = from_json(raw, allow_inf_nan=True)
    saved, headers.PARSE_PIECE_BYTES = headers.PARSE_PIECE_BYTES, piece
    try:
        pieces = headers._decode_in_pieces(raw)
        decoded = headers._decode(headers.Path("h"), raw)
    finally:
        headers.PARSE_PIECE_BYTES = saved
    if pieces is not None:
        assert list(pieces.items()) == list(whole.items())  # values, and the order of the keys
    assert list(decoded.items()) == list(whole.items())


def test_a_cut_inside_a_name_or_the_metadata_falls_back_to_one_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(headers, "PARSE_PIECE_BYTES", 1)
    raw = header([("__metadata__", {"a": {"b": 1}, "c": 2}), ('x},"y', {"dtype": "F32"})], (",", ":"), 0)
    assert headers._decode_in_pieces(raw) is None
    raw = header([(f"t{i}", {"dtype": "F32"}) for i in range(5)], (",", ":"), 3)
    assert headers._decode_in_pieces(raw) == {f"t{i}": {"dtype": "F32"} for i in range(5)}


@pytest.mark.slow
def test_a_big_header_does_not_hold_the_gil_for_its_whole_parse(tmp_path: Path) -> None:
    """200,000 entries (about 15 MB) in one shard, opened as a load opens it (`parse_header`, the
    collector paused): parsed whole, one call held the GIL for 150-400 ms of it on the VM."""
    n = 200_000
    raw = header([(f"model.layers.{i // 8}.experts.{i % 8}.w", {"dtype": "BF16", "shape": [4, 4],
                                                                 "data_offsets": [32 * i, 32 * i + 32]})
                  for i in range(n)], (",", ":"), 0)
    path = tmp_path / "model.safetensors"
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(8 + len(raw) + 32 * n)
    waits: list[float] = []
    done = threading.Event()

    def parse() -> None:
        try:
            assert len(headers.read_header(path).names) == n
        finally:
            done.set()

    worker = threading.Thread(target=parse)
    started = time.perf_counter()
    worker.start()
    while not done.is_set():
        t = time.perf_counter()
        time.sleep(0.0005)
        waits.append(time.perf_counter() - t)
    worker.join()
    took = time.perf_counter() - started
    assert max(waits) < max(0.03, took / 8), (
        f"a thread waited {max(waits) * 1000:.0f} ms for the GIL during a {took * 1000:.0f} ms parse")


def columns_of(raw: bytes, data_size: int) -> Any:
    got = headers.header_columns(raw, data_size, lenient=False, in_pieces=False)
    return None if got is None else (*got[:3], list(got[3]), *got[4:])


@settings(max_examples=600, deadline=None)
@given(header_doc=any_headers, repeats=st.lists(st.integers(0, 7), max_size=2),
       separators=st.sampled_from([(",", ":"), (", ", ": ")]), every=st.integers(1, 200))
@pytest.mark.slow
def test_pieces_parsed_apart_and_merged_are_the_header_parsed_whole(header_doc: tuple[dict[str, Any], int],
                                                                      repeats: list[int],
                                                                      separators: tuple[str, str],
                                                                      every: int) -> None:
    """What header helpers do with a large header (`header_helpers.split`): its `member_pieces`
    parsed as headers of their own and merged (`merge_columns`) give the whole's columns, or None
    (then it is parsed whole), but for a name repeated in two pieces, which `Shards.parse` finds;
    valid headers in file order always merge."""
    doc, data_size = header_doc
    entries = list(doc.items())
    for k in repeats:  # a name again, further on: one parse keeps the last value at the first place
        if entries:
            entries.append((entries[k % len(entries)][0], entries[-1][1]))
    raw = header(entries, separators, 0)
    whole = columns_of(raw, data_size)
    pieces = headers.member_pieces(raw, every)
    if pieces is None:
        return
    parts = [headers.header_columns(p, data_size, lenient=False, in_pieces=False) for p in pieces]
    if None in parts:  # a piece that is no header (a cut inside the metadata): parsed whole
        return
    merged = headers.merge_columns(parts)
    event("merged" if merged is not None else "left to one parse")
    names = [name for part in parts for name in part[0]]
    if merged is not None and len(set(names)) == len(names):
        assert (*merged[:3], list(merged[3]), *merged[4:]) == whole
    elif merged is not None:  # a name in two pieces: `Shards.parse` finds it and parses the whole
        assert list(merged[0]) == names
    elif whole is not None:  # refused for a reason of its own: pieces out of order, or a name
        begins = [b for part in parts for b in part[4]]  # twice at offsets that then overlap
        assert begins != sorted(begins) or len(set(names)) < len(names)


def test_a_name_in_two_pieces_or_pieces_out_of_order_are_left_to_one_parse() -> None:
    def entry(begin: int) -> dict[str, Any]:
        return {"dtype": "U8", "shape": [4], "data_offsets": [begin, begin + 4]}

    def parts(entries: list[tuple[str, Any]]) -> list[Any]:
        pieces = headers.member_pieces(header(entries, (",", ":"), 0), 1)
        assert pieces is not None and len(pieces) == len(entries)
        return [headers.header_columns(p, 64) for p in pieces]

    in_order = [("a", entry(0)), ("b", entry(4)), ("__metadata__", {"k": "v"}), ("c", entry(8))]
    merged = headers.merge_columns(parts(in_order))
    assert merged is not None and merged[0] == ("a", "b", "c") and merged[4] == [0, 4, 8] and merged[-1]
    twice = headers.merge_columns(parts([("a", entry(0)), ("b", entry(4)), ("a", entry(8))]))
    assert twice is not None and twice[0] == ("a", "b", "a")  # for `Shards.parse` to find
    assert headers.merge_columns(parts([("a", entry(4)), ("b", entry(0))])) is None
    assert headers.merge_columns(parts([("a", entry(0)), ("b", entry(2))])) is None  # overlap across pieces
    gap = headers.merge_columns(parts([("a", entry(0)), ("b", entry(16))]))
    assert gap is not None and gap[4] == [0, 16] and not gap[-1]


@given(groups=st.lists(st.tuples(st.lists(st.sampled_from("abcdefgh"), max_size=5), st.booleans()), max_size=8))
def test_a_name_check_is_distinct_only_for_names_that_do_not_repeat(groups: list[tuple[list[str], bool]]) -> None:
    """Groups of names added to a `NameCheck`, some taken back after (pieces of a header parsed
    whole): `distinct` never says so of names that repeat among those kept, and says so of those
    that do not when none was taken back."""
    check = headers.NameCheck()
    for names, _ in groups:
        check.add(names)
    for names, back in groups:
        if back:
            check.take_back(names)
    kept = [name for names, back in groups if not back for name in names]
    if len(set(kept)) != len(kept):
        assert not check.distinct
    if not any(back for _, back in groups):
        assert check.distinct == (len(set(kept)) == len(kept))
