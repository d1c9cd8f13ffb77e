"""A large header is parsed in pieces (`checkpoint._decode_in_pieces`) so that no one call holds the
GIL for the whole of it: the pieces read exactly what one parse reads, or the header is parsed whole."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic_core import from_json

from wcd import checkpoint

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
def test_pieces_read_what_one_parse_reads(entries: list[tuple[str, Any]], separators: tuple[str, str], pad: int,
                                          piece: int) -> None:
    raw = header(entries, separators, pad)
    whole = from_json(raw, allow_inf_nan=True)
    saved, checkpoint.PARSE_PIECE_BYTES = checkpoint.PARSE_PIECE_BYTES, piece
    try:
        pieces = checkpoint._decode_in_pieces(raw)
        decoded = checkpoint._decode(checkpoint.Path("h"), raw)
    finally:
        checkpoint.PARSE_PIECE_BYTES = saved
    if pieces is not None:
        assert list(pieces.items()) == list(whole.items())  # values, and the order of the keys
    assert list(decoded.items()) == list(whole.items())


def test_a_cut_inside_a_name_or_the_metadata_falls_back_to_one_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checkpoint, "PARSE_PIECE_BYTES", 1)
    raw = header([("__metadata__", {"a": {"b": 1}, "c": 2}), ('x},"y', {"dtype": "F32"})], (",", ":"), 0)
    assert checkpoint._decode_in_pieces(raw) is None
    raw = header([(f"t{i}", {"dtype": "F32"}) for i in range(5)], (",", ":"), 3)
    assert checkpoint._decode_in_pieces(raw) == {f"t{i}": {"dtype": "F32"} for i in range(5)}


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
            assert len(checkpoint.read_header(path).names) == n
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
