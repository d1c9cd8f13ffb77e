"""safetensors headers: reading one from an open file, parsing and validating it in bulk into
columns (`Header`), in pieces of whole members where it is large, and merging pieces' columns.

What a header helper process runs (`wcd.header_helpers`) is all here, so it imports nothing of
checkpoints. The format is parsed here with strict bounds: the safetensors package does not
expose data offsets, and the daemon must not import torch.
"""

from __future__ import annotations

import errno
import json
import math
import os
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import chain, count, islice, pairwise, repeat
from operator import add, itemgetter, le, mul, sub
from pathlib import Path
from typing import Any, NoReturn

from pydantic_core import from_json

from wcd.errors import LoadFailed, WcdError
from wcd.gcpause import gc_paused
from wcd.manifest import (
    DTYPE_CODES,
    DTYPES,
    ITEMSIZES,
    MAX_DIM,
    MAX_NDIM,
    check_overlaps,
    names_valid,
    tensor_nbytes,
)

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit


@dataclass(frozen=True, slots=True)
class StoredTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute file offset
    end: int


@dataclass(frozen=True)
class Header:
    """One shard's header, its tensors as columns in file order (stable by data offset).

    `begins` and `ends` are offsets into the data section (the header's `data_offsets`; the
    file offset is `data_start` plus them), `sizes` their differences; `shapes` holds the shard's
    distinct shapes and `shape_ids` each tensor's index into it; `dtype_codes` index `DTYPES`.
    `contiguous`: each tensor begins where the one before ends (no gaps, in header order).
    `names_checked`: every name is one a layout accepts (`manifest.names_valid`), as the columns of
    `header_columns` are: the layout need not check them again (done beside the other headers'
    parse, often in a helper process, instead of after them all).
    """

    file: Path
    raw: bytes
    data_start: int
    file_size: int
    names: tuple[str, ...]
    dtype_codes: bytes
    shapes: tuple[tuple[int, ...], ...]
    shape_ids: array[int]
    begins: list[int]
    ends: list[int]
    sizes: list[int]
    contiguous: bool = False
    names_checked: bool = False

    @cached_property
    def tensors(self) -> tuple[StoredTensor, ...]:
        """One `StoredTensor` per tensor, in file order (for tools and tests: loads use the columns)."""
        dtypes = map(DTYPES.__getitem__, self.dtype_codes)
        shapes = map(self.shapes.__getitem__, self.shape_ids)
        base = repeat(self.data_start)
        return tuple(map(StoredTensor, self.names, dtypes, shapes, map(add, base, self.begins),
                         map(add, base, self.ends)))


def read_header(file: Path) -> Header:
    """Open `file`, parse its header, close it (for tools and tests; loads use `Checkpoint.open`)."""
    try:
        fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise LoadFailed(f"{file}: cannot read: {e.strerror}") from None
    try:
        return parse_header(fd, file)
    finally:
        os.close(fd)


def parse_header(fd: int, file: Path) -> Header:
    """Parse and validate the safetensors header of the open file `fd`; every tensor must lie inside it."""
    raw, data_start, file_size = read_raw_header(fd, file)
    return header_from(file, raw, data_start, file_size)


def read_raw_header(fd: int, file: Path) -> tuple[bytes, int, int]:
    """The open file's raw header bytes, where its data section starts, and its size."""
    try:
        file_size = os.fstat(fd).st_size
        prefix = os.pread(fd, 8, 0)
        if len(prefix) < 8:
            raise LoadFailed(f"{file}: not a safetensors file (shorter than 8 bytes)")
        n = int.from_bytes(prefix, "little")
        if n > MAX_HEADER_BYTES or 8 + n > file_size:
            raise LoadFailed(f"{file}: not a safetensors file (header length {n} is implausible)")
        return _pread_all(fd, n, 8), 8 + n, file_size
    except OSError as e:
        raise LoadFailed(f"{file}: cannot read: {e.strerror}") from None


def header_from(file: Path, raw: bytes, data_start: int, file_size: int, columns: Columns | None = None) -> Header:
    """The `Header` of raw header bytes, from their `columns` if given (`header_columns`, parsed
    elsewhere, or `merge_columns` of such), else parsed here; a header that is not valid raises
    its LoadFailed here."""
    if columns is None:
        # A million small objects that form no cycles: collections would cost as much as the parse.
        # They are all freed when `_parse` returns, before the collector is back and would walk them.
        with gc_paused():
            return _parse(file, raw, data_start, file_size)
    return Header(file, raw, data_start, file_size, *columns, names_checked=True)


# Headers past two pieces are parsed a piece at a time (`_decode_in_pieces`): from_json holds the GIL
# for the whole of what it is given (tens of ms for a shard of 25,000 entries): the loop's every
# connection would wait that long behind a load.
PARSE_PIECE_BYTES = 128 << 10


def _decode(file: Path, raw: bytes, lenient: bool = True, in_pieces: bool = True) -> Any:
    """The header as `json.loads` reads it. pydantic_core's parser (already a dependency, through
    pydantic) builds the same objects in about 60% of the time. It is stricter: of 200,000 fuzzed
    headers it never accepted one that `json.loads` refuses nor read one differently (duplicate keys:
    the last wins for both), but it refuses some that `json.loads` accepts (lone surrogates, as
    escapes or as UTF-8 bytes; a BOM; UTF-16). Whatever it refuses goes to `json.loads`, so the
    accepted headers and the error of a malformed one are `json.loads`'s. `in_pieces`: a large
    header is parsed a piece at a time (`_decode_in_pieces`; a helper process, which shares no GIL,
    parses it whole)."""
    if in_pieces and len(raw) > 2 * PARSE_PIECE_BYTES:
        doc = _decode_in_pieces(raw)
        if doc is not None:
            return doc
    try:
        return from_json(raw, allow_inf_nan=True)
    except ValueError:
        if not lenient:
            raise LoadFailed(f"{file}: left to json.loads") from None
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:  # bad JSON, bad UTF-8, absurd integers, deep nesting
        raise LoadFailed(f"{file}: safetensors header is not valid JSON ({str(e)[:200]})") from None


def member_pieces(raw: bytes, every: int) -> list[bytes] | None:
    """The header object's text in pieces of about `every` bytes, cut after an entry's value, at
    `},"` (or `}, "`), each closed (or opened) with a brace: JSON objects of consecutive members,
    if every cut lies between two members; None (keep it whole) if the text is laid out otherwise
    (other whitespace between tokens, a BOM).

    The pieces parse only if every cut lies between two members of the top-level object: a cut
    inside a string leaves the first piece's string unterminated, one inside a nested object
    (`__metadata__`'s) leaves it unbalanced, one after the object's end leaves text after it. So
    when every piece parses, their members, in order, are the members of the whole. The cuts fall
    on ASCII bytes, never inside a UTF-8 sequence."""
    end = raw.rfind(b"}")  # the closing brace: safetensors pads the header to 8 bytes with spaces
    if raw[:2] != b'{"' or end < 0 or raw.count(b" ", end + 1) != len(raw) - end - 1:
        return None
    view = memoryview(raw)  # each piece is one copy of its bytes
    pieces = []
    start = 1  # the first member
    while True:
        cut = raw.find(b"},", start + every, end)
        if cut < 0:
            pieces.append(b"".join((b"{", view[start : end + 1])))
            return pieces
        after = cut + 2
        while raw[after : after + 1] == b" ":  # `}, "` as json.dumps writes it
            after += 1
        if raw[after : after + 1] != b'"':
            return None
        pieces.append(b"".join((b"{", view[start : cut + 1], b"}")))
        start = after  # the next member's key


def _decode_in_pieces(raw: bytes) -> dict[str, Any] | None:
    """The header object as from_json reads it whole, parsed in `member_pieces` of about
    PARSE_PIECE_BYTES; None (parse it whole) if any piece fails or the text cannot be cut. A key
    repeated across pieces keeps the last value at its first place, as in one parse."""
    pieces = member_pieces(raw, PARSE_PIECE_BYTES)
    if pieces is None:
        return None
    doc: dict[str, Any] = {}
    for text in pieces:
        try:
            piece = from_json(text, allow_inf_nan=True)
        except ValueError:
            return None
        if not isinstance(piece, dict):
            return None
        doc.update(piece)
    return doc


def header_columns(raw: bytes, data_size: int, lenient: bool = True, in_pieces: bool = True) -> Columns | None:
    """The columns of a valid header with `data_size` bytes of data, or None for any header that
    `_parse` refuses (which then says why): what a helper process computes (`wcd.header_helpers`).
    Not `lenient`: None also for a header that only `json.loads` reads (see `_decode`). None too
    where a name is one the layout refuses (`names_valid`): `_parse` and the layout say which."""
    try:
        doc = _decode(Path(), raw, lenient, in_pieces)
    except LoadFailed:
        return None
    if not isinstance(doc, dict):
        return None
    doc.pop("__metadata__", None)
    columns = _columns(doc, data_size)
    if columns is not None and not columns[-1]:
        names, _, _, _, begins, ends, sizes, _ = columns
        try:
            check_overlaps(names, begins, sizes, ends)
        except WcdError:
            return None
    if columns is not None and not names_valid(columns[0]):
        return None
    return columns


def merge_columns(parts: Sequence[Columns]) -> Columns | None:
    """One header's columns from those of its `member_pieces`, in order, each read as a header
    (`header_columns`: valid, within the data section), or None where they could differ from the
    whole's (then it is parsed whole): a piece with tensors before the last one of the piece
    before it (the whole's stable sort by offset would interleave them), or tensors of two pieces
    that overlap (the whole's parse says so). A name in two pieces is the caller's to find (one
    parse keeps the last value at the first place: `Shards.parse` finds the names of all shards
    repeated in one pass, and parses such a header whole). C-level passes, and a Python step per
    piece and shape."""
    parts = [part for part in parts if part[0]]  # a piece of `__metadata__` alone has no tensors
    if len(parts) < 2:
        return parts[0] if parts else ((), b"", (), array("I"), [], [], [], True)
    if any(b[4][0] < a[4][-1] for a, b in pairwise(parts)):  # each piece is in file order already
        return None
    names = tuple(chain.from_iterable(part[0] for part in parts))
    index: dict[tuple[int, ...], int] = {}
    ids = array("I")
    for part in parts:
        local = [index.setdefault(s, len(index)) for s in part[2]]
        ids.extend(part[3] if local == list(range(len(local))) else map(local.__getitem__, part[3]))
    begins = list(chain.from_iterable(part[4] for part in parts))
    ends = list(chain.from_iterable(part[5] for part in parts))
    sizes = list(chain.from_iterable(part[6] for part in parts))
    # A contiguous piece is in header order: its last tensor is the one the next piece's first follows.
    contiguous = all(part[7] for part in parts) and all(b[4][0] == a[5][-1] for a, b in pairwise(parts))
    if not contiguous:
        try:
            check_overlaps(names, begins, sizes, ends)
        except WcdError:
            return None
    return names, b"".join(part[1] for part in parts), tuple(index), ids, begins, ends, sizes, contiguous


def _parse(file: Path, raw: bytes, data_start: int, file_size: int) -> Header:
    doc = _decode(file, raw)
    if not isinstance(doc, dict):
        raise LoadFailed(f"{file}: safetensors header is not a JSON object")
    doc.pop("__metadata__", None)
    columns = _columns(doc, file_size - data_start)
    if columns is None:
        _refuse_entries(file, doc, file_size - data_start)
    names, codes, shapes, ids, begins, ends, sizes, contiguous = columns
    if not contiguous:  # back to back, in order: nothing can overlap
        try:
            check_overlaps(names, begins, sizes, ends)
        except WcdError as bad:
            raise LoadFailed(f"{file}: {bad.message} (data_offsets)") from None
    return Header(file, raw, data_start, file_size, names, codes, shapes, ids, begins, ends, sizes, contiguous)


Columns = tuple[tuple[str, ...], bytes, tuple[tuple[int, ...], ...], "array[int]", list[int], list[int], list[int],
                 bool]


def _columns(doc: dict[str, Any], data_size: int) -> Columns | None:
    """The header's entries as columns sorted by data offset, and whether they lie back to back,
    or None if any entry is not a valid tensor within `data_size` bytes of data. Checked in bulk
    (C-level passes over each column, one Python step per distinct shape), never a Python step per
    tensor; `_refuse_entries` names the first bad entry. The usual header (entries back to back in
    order, experts of one shape) skips the passes that others need: hashing each shape, the order
    check, the overlap check, each size's subtraction."""
    n = len(doc)
    if not n:
        return (), b"", (), array("I"), [], [], [], True
    infos = doc.values()
    # Each pass raises (or its check fails) exactly where `_refuse_entries` finds a bad entry: an
    # entry that is not an object, a missing key, an unknown or unhashable dtype, a shape that
    # does not iterate to exact ints (`tuple()` of "" or {} is a scalar shape there too), data
    # offsets that are not a pair of exact ints matching the size, data past the end.
    try:
        dtypes = list(map(itemgetter("dtype"), infos))
        if dtypes.count(dtypes[0]) == n:  # one dtype (the usual case): one lookup
            codes = bytes([DTYPE_CODES[dtypes[0]]]) * n
        else:
            codes = bytes(map(DTYPE_CODES.__getitem__, dtypes))
        shape_lists = list(map(itemgetter("shape"), infos))
        offsets = list(map(itemgetter("data_offsets"), infos))
        if set(map(type, chain.from_iterable(shape_lists))) - {int} or set(map(len, offsets)) != {2}:
            return None  # exactly int: 1.0 and True would pass for 1 in the dict of shapes below
        begins = list(map(itemgetter(0), offsets))
        ends = list(map(itemgetter(1), offsets))
    except (KeyError, TypeError, IndexError):
        return None
    first = shape_lists[0]
    if shape_lists[-1] == first and shape_lists.count(first) == n:  # one shape: equal lists of exact ints
        shapes: tuple[tuple[int, ...], ...] = (tuple(first),)
        ids = array("I", [0]) * n
    else:
        tuples = list(map(tuple, shape_lists))
        shapes = tuple(dict.fromkeys(tuples))
        ids = array("I", map(dict(zip(shapes, count())).__getitem__, tuples))
    if any(len(s) > MAX_NDIM or (s and (min(s) < 0 or max(s) > MAX_DIM)) for s in shapes):
        return None
    numels = list(map(math.prod, shapes))
    one_dtype = codes.count(codes[0]) == n
    if one_dtype:  # a size per shape
        per_shape = [numel * ITEMSIZES[codes[0]] for numel in numels]
        sizes = [per_shape[0]] * n if len(per_shape) == 1 else list(map(per_shape.__getitem__, ids))
    else:
        sizes = list(map(mul, map(numels.__getitem__, ids), map(ITEMSIZES.__getitem__, codes)))
    if set(map(type, begins)) != {int} or set(map(type, ends)) != {int}:
        return None
    # Back to back (each begins where the one before ends; sizes are never negative): in order,
    # the first begin the least and the last end the most.
    contiguous = begins[1:] == ends[:-1]
    if contiguous and one_dtype and len(shapes) == 1:  # all of one size: the begins step by it
        size, b = sizes[0], begins[0]
        fits = begins == (list(range(b, b + size * n, size)) if size else [b] * n) and ends[-1] - begins[-1] == size
    else:
        fits = list(map(sub, ends, begins)) == sizes
    if not fits or (min(begins) if not contiguous else begins[0]) < 0 or \
            (max(ends) if not contiguous else ends[-1]) > data_size:
        return None
    names = tuple(doc)
    if not contiguous and not all(map(le, begins, islice(begins, 1, None))):  # safetensors writes them in order
        pick = itemgetter(*sorted(range(n), key=begins.__getitem__))  # stable: ties keep header order
        names, codes, ids = tuple(pick(names)), bytes(pick(codes)), array("I", pick(ids))
        begins, ends, sizes = list(pick(begins)), list(pick(ends)), list(pick(sizes))
    return names, codes, shapes, ids, begins, ends, sizes, contiguous


def _refuse_entries(file: Path, doc: dict[str, Any], data_size: int) -> NoReturn:
    """Raise the error of the first header entry (in header order) that is not a valid tensor."""
    for name, info in doc.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            nbytes = tensor_nbytes(name, dtype, shape)
        except WcdError as bad:
            raise LoadFailed(f"{file}: {bad.message}") from None
        except (KeyError, TypeError, ValueError):
            raise LoadFailed(f"{file}: tensor {name!r} has a malformed header entry") from None
        if type(begin) is not int or type(end) is not int or not 0 <= begin <= end or end - begin != nbytes:
            raise LoadFailed(f"{file}: tensor {name!r}: data_offsets {[begin, end]} do not match dtype and shape")
        if end > data_size:
            raise LoadFailed(f"{file}: tensor {name!r} extends past the end of the file (truncated?)")
    raise AssertionError(f"{file}: the bulk header check refused what the per-entry one accepts")


def _pread_all(fd: int, n: int, offset: int) -> bytes:
    parts = []
    while n:
        chunk = os.pread(fd, n, offset)
        if not chunk:
            raise OSError(errno.EIO, "unexpected end of file")
        parts.append(chunk)
        n, offset = n - len(chunk), offset + len(chunk)
    return b"".join(parts)


class NameCheck:
    """The names of a checkpoint's headers as they are parsed, to tell whether one is in two places:
    the count of names added against the size of their set. Names taken back leave the set at most
    smaller than the names it still counts, so `distinct` is never true of names that repeat."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.count = 0

    def add(self, names: Sequence[str]) -> None:
        self.names.update(names)
        self.count += len(names)

    def take_back(self, names: Sequence[str]) -> None:
        """Names added that are not the checkpoint's after all (pieces of a header parsed whole)."""
        self.names.difference_update(names)
        self.count -= len(names)

    @property
    def distinct(self) -> bool:
        return len(self.names) == self.count
