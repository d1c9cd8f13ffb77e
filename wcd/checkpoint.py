"""safetensors checkpoints: finding shards, parsing and validating headers, planning reads.

A checkpoint is one `.safetensors` file or a directory of them. The safetensors package does
not expose data offsets, and the daemon must not import torch, so the (tiny, documented)
header format is parsed here with strict bounds. Nothing here knows about arenas.
"""

from __future__ import annotations

import errno
import json
import math
import os
import pwd
import stat
from array import array
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import chain, compress, count, islice, pairwise, repeat
from operator import add, ge, itemgetter, le, mul, ne, sub
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from pydantic_core import from_json

from wcd.errors import LoadFailed, WcdError
from wcd.gcpause import gc_paused
from wcd.manifest import (
    ALIGN,
    DTYPE_CODES,
    DTYPES,
    ITEMSIZES,
    MAX_DIM,
    MAX_NDIM,
    Manifest,
    _le_bytes,
    check_overlaps,
    names_valid,
    tensor_nbytes,
)

if TYPE_CHECKING:
    from wcd.header_helpers import HeaderHelpers

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit
SAMPLE_BYTES = 4096
SAMPLES_PER_FILE = 64
BATCH_BYTES = 4 << 20  # one staging buffer
# A tensor of at least its file's batch is copied in pieces of this many bytes, one op each: the
# loader threads take ops in file order, so a large tensor's pieces are read by several threads at
# once, each piece front to back. Read when a plan is made, so that benchmarks can set it.
CHUNK_BYTES = 64 << 20
MAX_PIECES = 1024  # IOV_MAX: one preadv scatters a run


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


# A run of pieces in a `CopyOp`: (arena offset relative to the op's, width, stride, count): `count`
# tensors of `width` bytes each, back to back in the file, the k-th at `offset + k * stride` in the
# arena (stride: the width rounded up to the layout's alignment, so never 0).
Run = tuple[int, int, int, int]


@dataclass(frozen=True, slots=True)
class CopyOp:
    """Fill `nbytes` of the arena at `arena_offset` from shard number `shard` at `file_offset`.

    Without `runs`, the file range has the same length. With them, the file range is contiguous
    and `file_nbytes` long, and lands in the pieces of the runs, in order; the arena bytes between
    pieces (alignment padding) are left undefined. A run of equal tensors at one stride (experts of
    one shape, say) is one item however many tensors it holds, so writers can move it in one step.
    """

    shard: int
    file_offset: int
    arena_offset: int
    nbytes: int
    runs: tuple[Run, ...] = ()

    @property
    def pieces(self) -> tuple[tuple[int, int], ...]:
        """The runs' pieces, one (arena offset relative to `arena_offset`, length) per tensor."""
        return tuple(piece for run in self.runs for piece in run_pieces(run))

    @property
    def file_nbytes(self) -> int:
        return sum(width * count for _, width, _, count in self.runs) if self.runs else self.nbytes


def run_pieces(run: Run) -> zip[tuple[int, int]]:
    """(relative arena offset, length) of each piece of `run`."""
    rel, width, stride, count = run
    return zip(range(rel, rel + stride * count, stride), repeat(width, count))


def _runs(sizes: list[int], ats: Sequence[int], s: int, j: int, one_size: bool = False) -> tuple[Run, ...]:
    """The tensors `s:j` (back to back in the file, at increasing aligned offsets `ats` that do not
    overlap) as maximal runs. Where equal sizes run from `a` to `b`, every step between offsets is
    a multiple of 256 at least the size, that is at least the stride: so they are all the stride
    when the ends are that many strides apart, and the run is checked in O(1). `one_size`: the
    caller knows that every size is the same."""
    base, size = ats[s], sizes[s]
    if one_size or sizes[s:j].count(size) == j - s:  # the common case: all one size (experts of one shape)
        firsts = [s, j]
    else:
        firsts = [s, *compress(range(s + 1, j), map(ne, sizes[s + 1 : j], sizes[s : j - 1])), j]
    runs: list[Run] = []
    for a, b in zip(firsts, firsts[1:]):
        size = sizes[a]
        stride = (size + ALIGN - 1) & -ALIGN
        if ats[b - 1] - ats[a] != stride * (b - 1 - a):  # padding between some (not `manifest`'s layout)
            steps = compress(range(a + 1, b), map(ne, map(sub, ats[a + 1 : b], ats[a : b - 1]), repeat(stride)))
            for c, d in pairwise([a, *steps, b]):
                runs.append((ats[c] - base, size, stride, d - c))
            continue
        runs.append((ats[a] - base, size, stride, b - a))
    return tuple(runs)


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
# for the whole of what it is given, 50-120 ms for one shard's 2.5 MB of 25,000 entries on the VM:
# the loop's every connection would wait that long behind a load.
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


@dataclass(frozen=True, slots=True)
class FileState:
    """What must not change while a load reads a file: which file it is, its size and its times."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, fd: int) -> FileState:
        st = os.fstat(fd)
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


_OPEN = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK  # O_NONBLOCK: a planted FIFO must not hang the open
_RESOLVE_BENEATH, _RESOLVE_NO_MAGICLINKS = 0x08, 0x02
_SYS_OPENAT2 = 437  # x86_64 and aarch64 alike


def _openat2_beneath(dir_fd: int, name: str) -> int:
    """openat2(2) with RESOLVE_BENEATH: follow links only while they stay inside `dir_fd`, atomically.
    Raises OSError (EXDEV: a link leads out; ENOSYS: a kernel older than 5.6)."""
    import ctypes  # only when a shard is a link

    class OpenHow(ctypes.Structure):
        _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]

    libc = ctypes.CDLL(None, use_errno=True)
    how = OpenHow(_OPEN, 0, _RESOLVE_BENEATH | _RESOLVE_NO_MAGICLINKS)
    fd = libc.syscall(_SYS_OPENAT2, dir_fd, os.fsencode(name), ctypes.byref(how), ctypes.sizeof(how))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(fd)


def _open_shard(dir_fd: int, name: str, where: Path, follow_links: bool) -> int:
    """Open one shard of the directory `dir_fd` without following links out of it (unless allowed)."""
    try:
        return os.open(name, _OPEN | os.O_NOFOLLOW, dir_fd=dir_fd)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
    if follow_links:
        return os.open(name, _OPEN, dir_fd=dir_fd)
    try:
        return _openat2_beneath(dir_fd, name)
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.EACCES):
            raise
    raise LoadFailed(f"{where / name}: a symbolic link out of the model directory: refusing to follow it "
                     "(set follow_symlinks = true for this model if the link is meant)")


def _owner_may_read(file: Path, st: os.stat_result, owner: os.stat_result) -> None:
    """Refuse a file that the owner of its directory could not read: the daemon may have more rights
    than whoever put the file there (a hard link to a root-only file, say)."""
    uid = owner.st_uid
    if uid in (0, os.geteuid()):
        return
    if st.st_uid == uid:
        ok = st.st_mode & stat.S_IRUSR
    elif st.st_gid in _groups(uid, owner.st_gid):
        ok = st.st_mode & stat.S_IRGRP
    else:
        ok = st.st_mode & stat.S_IROTH
    if not ok:
        raise LoadFailed(f"{file}: the owner of its directory (uid {uid}) may not read it, so neither will the "
                         "daemon (give the file to that user, or make it readable)")


def _groups(uid: int, gid: int) -> set[int]:
    try:
        user = pwd.getpwuid(uid)
    except KeyError:
        return {gid}
    return set(os.getgrouplist(user.pw_name, user.pw_gid))


def open_files(path: Path, follow_links: bool = False, owner_check: bool = True) -> list[tuple[Path, int]]:
    """(file, open fd) of every shard of `path`, sorted by name; links are not followed out of the
    directory unless `follow_links`. The caller owns the fds."""
    try:
        top = os.open(path, _OPEN | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise LoadFailed(f"{path}: no such file or directory") from None
    except OSError as e:
        raise LoadFailed(f"{path}: cannot read: {e.strerror}") from None
    opened: list[tuple[Path, int]] = []
    try:
        st = os.fstat(top)
        if stat.S_ISREG(st.st_mode):
            if owner_check:
                _owner_may_read(path, st, os.stat(path.parent))
            opened.append((path, os.dup(top)))
            return opened
        if not stat.S_ISDIR(st.st_mode):
            raise LoadFailed(f"{path}: not a file or a directory")
        for name in sorted(n for n in os.listdir(top) if n.endswith(".safetensors")):
            fd = _open_shard(top, name, path, follow_links)
            opened.append((path / name, fd))
            fst = os.fstat(fd)
            if not stat.S_ISREG(fst.st_mode):
                os.close(opened.pop()[1])  # a directory or device named *.safetensors: not a shard
                continue
            if owner_check:
                _owner_may_read(path / name, fst, st)
        if not opened:
            raise LoadFailed(f"{path}: no .safetensors files in this directory")
        return opened
    except BaseException as e:
        for _, fd in opened:
            os.close(fd)
        if isinstance(e, OSError):
            raise LoadFailed(f"{path}: cannot read: {e.strerror}") from None
        raise
    finally:
        os.close(top)


class Shards:
    """A checkpoint's shards, open, and their raw headers read but not parsed (`Checkpoint.open`
    in two steps): what the fingerprint reads (`key.first_fingerprint`) while `parse` runs. Until a
    parse succeeds, `close` is the caller's (another thread may still read the descriptors)."""

    def __init__(self, path: Path, files: list[tuple[Path, int]], raws: list[tuple[bytes, int, int]]) -> None:
        self.path, self.files, self.raws = path, files, raws  # raws: (raw header, data start, file size)

    @classmethod
    def open(cls, path: str | os.PathLike[str], follow_links: bool = False, owner_check: bool = True) -> Shards:
        """Open every shard of `path` and read its raw header (see `Checkpoint.open`). A shard that
        cannot be read raises its error after those of the shards before it that are not valid, as
        a parse shard by shard would (they are parsed then, to find out)."""
        p = Path(path).resolve()
        files = open_files(p, follow_links, owner_check)
        try:
            raws = []
            for file, fd in files:
                try:
                    raws.append(read_raw_header(fd, file))
                except LoadFailed:  # the first bad shard's error
                    for (before, _), raw in zip(files, raws):
                        header_from(before, *raw)
                    raise
            return cls(p, files, raws)
        except BaseException:
            for _, fd in files:
                os.close(fd)
            raise

    def parse(self, helpers: HeaderHelpers | None = None) -> Checkpoint:
        """The checkpoint of these shards, their headers parsed (by `helpers` too, if given), and
        owning their descriptors; a shard that is not valid raises its LoadFailed (nothing closed).
        With helpers, each header that comes back is made a `Header`, and each piece's names are
        added to the check that no name is in two places, while the helpers still parse the rest."""
        files, raws = self.files, self.raws
        helped = 0
        parsed: list[Header | None] = [None] * len(files)
        names = NameCheck() if len(files) > 1 or helpers is not None else None

        def landed(k: int, columns: Columns | None = None) -> None:
            h = parsed[k] = header_from(files[k][0], *raws[k], columns)
            if columns is None and names is not None:  # the helpers' are added as they come
                names.add(h.names)

        if helpers is not None:
            helped = helpers.columns([(raw, size - start) for raw, start, size in raws], landed, names)[1]
        for k, h in enumerate(parsed):
            if h is None:  # not parsed by the helpers (or none): here, in order
                landed(k)
        headers = tuple(h for h in parsed if h is not None)
        if names is not None and not names.distinct:
            # A header merged from pieces (`merge_columns`) may hold a name twice, which one parse
            # reads as one tensor (the last value at the first place): those are parsed whole here.
            again = [len(set(h.names)) != len(h.names) for h in headers]
            headers = tuple(header_from(file, *raw) if redo else h
                            for (file, _), raw, h, redo in zip(files, raws, headers, again))
            helped -= min(helped, sum(again))
            if not _distinct(headers):
                seen: set[str] = set()
                for name in chain.from_iterable(h.names for h in headers):  # the first duplicate, in load order
                    if name in seen:
                        raise LoadFailed(f"{self.path}: tensor {name!r} appears in more than one shard")
                    seen.add(name)
        ckpt = Checkpoint(self.path, headers, tuple(fd for _, fd in files), unique=True)
        ckpt.helped = helped
        return ckpt

    def close(self) -> None:
        files, self.files = self.files, []
        for _, fd in files:
            os.close(fd)


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


def _distinct(headers: Sequence[Header]) -> bool:
    """No tensor name in two places."""
    return len(set(chain.from_iterable(h.names for h in headers))) == sum(len(h.names) for h in headers)


class Checkpoint:
    """All shards of one checkpoint, open: their headers, and how they map onto an arena.

    Each shard is opened once (`open`) and everything after (fingerprint, fill, digest) reads
    through these descriptors, so a file swapped or re-linked by path after the open is never
    read. `changed` tells whether an open file was written since. Close it (or use `with`).
    `fingerprinted` is `key.fingerprint`'s memo: the fingerprint and, per shard, the hash's state
    before its samples and its digest after them.
    """

    def __init__(self, path: Path, headers: tuple[Header, ...], fds: tuple[int, ...], unique: bool = False) -> None:
        """`unique`: the caller checked that no name is in two shards (`open` does)."""
        self.path = path
        self.headers = headers
        self.fds = fds
        self.opened = tuple(FileState.of(fd) for fd in fds)
        self._unique = unique or len(headers) < 2  # one header's names are a dict's keys
        self.helped = 0  # headers parsed by header helpers (`open`)
        self.fingerprinted: tuple[str, tuple[tuple[Any, bytes], ...]] | None = None

    @classmethod
    def open(cls, path: str | os.PathLike[str], follow_links: bool = False, owner_check: bool = True,
             helpers: HeaderHelpers | None = None) -> Checkpoint:
        """Open every shard of `path` (a file or a directory of shards) and parse its header.

        Symbolic links to shards are followed only while they stay inside the directory, unless
        `follow_links`; with `owner_check`, a file the directory's owner could not read is refused.
        `helpers` parse large headers in other processes, beside each other (the same outcome).
        """
        shards = Shards.open(path, follow_links, owner_check)
        try:
            return shards.parse(helpers)
        except BaseException:
            shards.close()
            raise

    def close(self) -> None:
        fds, self.fds = self.fds, ()
        for fd in fds:
            os.close(fd)

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def changed(self) -> list[Path]:
        """Shards whose size, times or identity differ from when they were opened."""
        return [h.file for h, fd, was in zip(self.headers, self.fds, self.opened) if FileState.of(fd) != was]

    def manifest(self) -> Manifest:
        """Arena layout: shards in name order, tensors in file order (sequential reads)."""
        headers = self.headers
        index: dict[tuple[int, ...], int] = {}  # the checkpoint's distinct shapes
        ids = array("I")
        for h in headers:
            local = [index.setdefault(s, len(index)) for s in h.shapes]
            ids.extend(h.shape_ids if local == list(range(len(local))) else map(local.__getitem__, h.shape_ids))
        checked = all(names_valid(h.names) for h in headers if not h.names_checked)
        return Manifest.from_columns(tuple(chain.from_iterable(h.names for h in headers)),
                                     b"".join(h.dtype_codes for h in headers), tuple(index), ids,
                                     list(chain.from_iterable(h.sizes for h in headers)), unique=self._unique,
                                     checked=checked)

    def copy_plan(self, manifest: Manifest, chunk: int | None = None,
                  batch: int | Sequence[int] = BATCH_BYTES) -> list[CopyOp]:
        """Reads that fill an arena of `manifest`, in file order.

        `batch` is one for all shards or one per shard (the writer reads cold files in larger pieces).
        Tensors of at least `batch` bytes become direct copies, split into `chunk`-byte pieces
        (CHUNK_BYTES unless given).
        Runs of smaller tensors that lie back to back in the file become one op each, of at most
        `batch` arena bytes and `MAX_PIECES` tensors: one read of the whole file range, scattered
        into the arena layout (which pads each tensor to 256 bytes), and few writes. An op's tensors
        are described as runs of equal tensors at one stride (`Run`): 100,000 16,000-byte tensors
        make ~400 ops of one run each. The plan is found with C-level passes over the columns and
        a Python step per op and per run.
        """
        chunk = chunk or CHUNK_BYTES
        offsets = manifest.offsets  # the manifest lists tensors in this very order (`manifest`)
        if len(offsets) != sum(len(h.names) for h in self.headers):
            raise ValueError("copy_plan needs the manifest of this checkpoint")
        if any(_le_bytes(offsets)[0::8]):  # 256 = 2**8: aligned offsets have a zero low byte
            raise ValueError("copy_plan needs a manifest of aligned offsets")
        ops: list[CopyOp] = []
        batches = [batch] * len(self.headers) if isinstance(batch, int) else list(batch)
        if len(batches) != len(self.headers):
            raise ValueError("copy_plan needs one batch size per shard")
        i = 0
        for shard, h in enumerate(self.headers):
            batch = batches[shard]
            n = len(h.names)
            begins, ends, sizes = h.begins, h.ends, h.sizes
            ats: Sequence[int] = offsets[i : i + n]
            i += n
            if 0 in sizes:  # zero-size tensors need no read and break no run
                begins, ends, ats, sizes = (list(compress(c, h.sizes)) for c in (begins, ends, ats, sizes))
            m, start = len(sizes), h.data_start
            one_size = bool(sizes) and sizes.count(sizes[0]) == m  # experts of one shape: one C-level pass
            # Runs break where the file has a gap and around tensors of `batch` bytes or more.
            big = list(compress(range(m), map(ge, sizes, repeat(batch)))) if m and max(sizes) >= batch else []
            gaps = () if h.contiguous or begins[1:] == ends[:-1] else \
                compress(range(1, m), map(ne, islice(begins, 1, None), ends))
            cuts = sorted({0, m, *gaps, *big, *(k + 1 for k in big)})
            for s, e in zip(cuts, cuts[1:]):
                if sizes[s] >= batch:
                    at, size, first = ats[s], sizes[s], start + begins[s]
                    ops.extend(CopyOp(shard, first + pos, at + pos, min(chunk, size - pos))
                               for pos in range(0, size, chunk))
                    continue
                while s < e:  # greedy: as many tensors as `batch` arena bytes and MAX_PIECES allow
                    # Offsets increase with the file's (the layout follows it), so the tensors that
                    # end within `batch` are those that start within it, but perhaps the last.
                    base = ats[s]
                    j = min(bisect_right(ats, base + batch, s, e), s + MAX_PIECES)
                    if ats[j - 1] + sizes[j - 1] - base > batch:
                        j -= 1
                    span = ats[j - 1] + sizes[j - 1] - base
                    runs = () if span == ends[j - 1] - begins[s] else _runs(sizes, ats, s, j, one_size)
                    ops.append(CopyOp(shard, start + begins[s], base, span, runs))
                    s = j
        return ops

    @property
    def nbytes(self) -> int:
        return sum(sum(h.sizes) for h in self.headers)
