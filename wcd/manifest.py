"""Tensor layout inside one arena: names, dtypes, shapes and 256-byte-aligned byte offsets.

A manifest never allocates memory. Tensors are C-contiguous, so strides follow from the shape.
It is stored as columns (names, dtype codes, an index into a table of distinct shapes, offsets)
and travels that way: raw MoE checkpoints have 10^5 tensors, and an engine pays for every
per-tensor Python step on its start-up clock. `Manifest.from_wire` validates an untrusted
layout completely (names, dtypes, shapes, alignment, bounds, overlaps) with bulk operations on
the columns, never a Python step per tensor. No torch here.
"""

from __future__ import annotations

import hashlib
import math
import re
import sys
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Sequence
from functools import cached_property, lru_cache, partial
from itertools import accumulate, chain, compress, islice, pairwise, repeat
from operator import add, itemgetter, le, mul, ne, sub
from typing import Any, NamedTuple

from wcd.errors import BadRequest

ALIGN = 256
MAX_TENSORS = 262_144
MAX_NAME_LEN = 1024
MAX_NDIM = 16
MAX_DIM = 1 << 48

# safetensors dtype names -> bytes per element. Sub-byte formats (F4, F6_*) have no byte
# addressable layout and are refused. The order is the wire code of each dtype: append only.
DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1,
    "F8_E4M3": 1, "F8_E4M3FNUZ": 1, "F8_E5M2": 1, "F8_E5M2FNUZ": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}
DTYPES: tuple[str, ...] = tuple(DTYPE_SIZES)
ITEMSIZES: tuple[int, ...] = tuple(DTYPE_SIZES.values())
DTYPE_CODES: dict[str, int] = {d: i for i, d in enumerate(DTYPES)}
# Names may not hold control characters, whether the daemon lays them out or a client reads them
# from a reply: they would forge log lines and terminal output. NUL separates names on the wire.
_CONTROL_CHAR = re.compile(r"[\x00-\x1f\x7f]")
_CONTROL_BYTES = bytes(range(32)) + b"\x7f"
_LITTLE = sys.byteorder == "little"


def has_control(s: str, nul_ok: bool = False) -> bool:
    """`_CONTROL_CHAR.search(s)`, five times faster: UTF-8 never hides these bytes, and deleting
    bytes is a plain C loop where the regex steps through every character. `nul_ok`: NUL is
    allowed (it separates the names of a joined column)."""
    raw = s.encode("utf-8", "surrogatepass")
    return len(raw.translate(None, _CONTROL_BYTES[1:] if nul_ok else _CONTROL_BYTES)) != len(raw)


def names_valid(names: Sequence[str]) -> bool:
    """Whether every one of these strs is a name `_check_name` accepts (1..MAX_NAME_LEN characters,
    none a control character), in C-level passes: 10 ms for 100,000 names on the VM."""
    return not names or ("" not in names and max(map(len, names)) <= MAX_NAME_LEN
                         and not has_control("".join(names)))


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


class TensorSpec(NamedTuple):
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def strides(self) -> tuple[int, ...]:
        """Element strides of the C-contiguous layout."""
        return contiguous_strides(self.shape)


@lru_cache(maxsize=4096)
def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return tuple(reversed(out))


def tensor_nbytes(name: str, dtype: str, shape: Sequence[int]) -> int:
    """Validate one (dtype, shape) and return its size in bytes."""
    size = DTYPE_SIZES.get(dtype) if type(dtype) is str else None
    if size is None:
        raise BadRequest(f"tensor {name!r}: unsupported dtype {dtype!r:.40}", {"tensor": name})
    if len(shape) > MAX_NDIM:
        raise BadRequest(f"tensor {name!r}: {len(shape)} dimensions (max {MAX_NDIM})", {"tensor": name})
    for d in shape:
        if type(d) is not int or d < 0 or d > MAX_DIM:
            raise BadRequest(f"tensor {name!r}: bad dimension {d!r}", {"tensor": name})
    return _numel(tuple(shape), f"tensor {name!r}: ") * size


def _numel(shape: tuple[int, ...], what: str) -> int:
    """The element count of a shape of valid dimensions. Its strides must be addressable too (torch's
    sizes and strides are int64): past MAX_DIM elements, a zero-length dimension counted as 1, the
    shape is refused, so (0, 2**48, 2**48) is as bad as (2**48, 2**48)."""
    numel = math.prod(shape)
    if (numel or math.prod(d or 1 for d in shape)) > MAX_DIM:
        raise BadRequest(f"{what}shape {list(shape)} spans more than 2**48 elements "
                         "(zero-length dimensions counted as 1)")
    return numel


def _check_name(name: Any) -> str:
    if type(name) is not str or not name or len(name) > MAX_NAME_LEN:
        raise BadRequest(f"bad tensor name {name!r:.80} (1..{MAX_NAME_LEN} characters)")
    if _CONTROL_CHAR.search(name):
        raise BadRequest(f"bad tensor name {name!r:.80} (control characters)")
    return name


def _le_bytes(a: array[int]) -> bytes:
    """The array's items as little-endian bytes (the wire's byte order)."""
    if _LITTLE:
        return a.tobytes()
    b = array(a.typecode, a)
    b.byteswap()
    return b.tobytes()


def _le_array(typecode: str, data: bytes) -> array[int]:
    a = array(typecode)
    a.frombytes(data)
    if not _LITTLE:
        a.byteswap()
    return a


class Manifest:
    """The layout of one arena. `size` is the number of bytes the arena must hold.

    Columns, one item per tensor in layout order: `names`, `dtype_codes` (index into `DTYPES`),
    `shape_ids` (index into `shapes`, the distinct shapes), `offsets` and `sizes` (bytes).
    `runs` splits the columns into consecutive runs, each of one dtype and shape at one constant
    stride (all ones unless `grouped()` made them): views of a run come from one C++ call.
    `view_plan` is a slot for the client's views code to cache its per-layout work in; the
    manifest itself never reads it.
    """

    def __init__(self, names: tuple[str, ...], dtype_codes: bytes, shapes: tuple[tuple[int, ...], ...],
                 shape_ids: array[int], offsets: array[int], sizes: list[int], size: int,
                 runs: array[int] | None = None) -> None:
        self.names, self.dtype_codes, self.shapes = names, dtype_codes, shapes
        self.shape_ids, self.offsets, self.sizes, self.size = shape_ids, offsets, sizes, size
        self.runs = runs if runs is not None else array("I", [1]) * len(names)
        self._wire: dict[str, Any] | None = None
        self._layout: str | None = None
        self.view_plan: Any = None

    # -- building (trusted input: checkpoint headers, reserve requests) ---------------------

    @classmethod
    def build(cls, items: Iterable[tuple[str, str, Sequence[int]]]) -> Manifest:
        """Lay tensors out in the given order, each at a 256-byte-aligned offset."""
        names: list[str] = []
        codes = bytearray()
        shape_index: dict[tuple[int, ...], int] = {}
        ids, offsets, sizes = array("I"), array("Q"), []
        seen: set[str] = set()
        offset = 0
        for name, dtype, shape in items:
            _check_name(name)
            if name in seen:
                raise BadRequest(f"tensor {name!r} appears twice", {"tensor": name})
            seen.add(name)
            shape = tuple(shape)
            nbytes = tensor_nbytes(name, dtype, shape)
            names.append(name)
            codes.append(DTYPE_CODES[dtype])
            ids.append(shape_index.setdefault(shape, len(shape_index)))
            offsets.append(offset)
            sizes.append(nbytes)
            offset = align_up(offset + nbytes)
            if len(names) > MAX_TENSORS:
                raise BadRequest(f"more than {MAX_TENSORS} tensors")
        return cls(tuple(names), bytes(codes), tuple(shape_index), ids, offsets, sizes, max(offset, ALIGN))

    # -- reading ------------------------------------------------------------------------------

    @cached_property
    def tensors(self) -> tuple[TensorSpec, ...]:
        """One `TensorSpec` per tensor (built on first use: the daemon's loader wants rows)."""
        dtypes = map(DTYPES.__getitem__, self.dtype_codes)
        shapes = map(self.shapes.__getitem__, self.shape_ids)
        return tuple(map(TensorSpec, self.names, dtypes, shapes, self.offsets, self.sizes))

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data (without alignment padding)."""
        return sum(self.sizes)

    def __len__(self) -> int:
        return len(self.names)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Manifest):
            return NotImplemented
        # The same tensors at the same places, whatever the column order (`grouped` reorders).
        return self.size == other.size and sorted(self.tensors) == sorted(other.tensors)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"<Manifest {len(self.names)} tensors, {self.size} bytes>"

    def grouped(self) -> Manifest:
        """The same tensors at the same offsets, columns reordered into runs (see `runs`).

        Tensors are grouped by (dtype, shape) in offset order. A group often interleaves: a
        layer's k_proj and v_proj share a shape, so the group reads k0 v0 k1 v1 ... and only
        every second tensor is at a constant stride; each group is split into the k (1..8)
        interleaved lanes that leave the fewest runs. Daemon side, once per entry; done with
        C-level passes over the columns and a Python step per group, lane and run, never per
        tensor (100,000 tensors of one shape: 8 ms on the CI VM).
        """
        n, ndt, codes, ids, offs = len(self.names), len(DTYPES), self.dtype_codes, self.shape_ids, self.offsets
        # Tensors in (stable) offset order: the identity for a manifest laid out by `_laid_out`.
        in_order = _one_step(offs) or all(map(le, offs, islice(offs, 1, None)))
        by_offset: Sequence[int] = range(n) if in_order else sorted(range(n), key=offs.__getitem__)
        groups: list[Sequence[int]] = [by_offset] if n else []
        if n > 1 and (ids.count(ids[0]) != n or codes.count(codes[0]) != n):
            keys = list(map(add, map(mul, ids, repeat(ndt)), codes))
            if not in_order:
                keys = list(map(keys.__getitem__, by_offset))
            rank = {k: r for r, k in enumerate(dict.fromkeys(keys))}  # groups in order of first appearance
            ranks = list(map(rank.__getitem__, keys))
            pos = sorted(range(n), key=ranks.__getitem__)  # stable: each group in offset order
            members = list(map(by_offset.__getitem__, pos))
            ranks.sort()
            bounds = [*map(partial(bisect_left, ranks), range(len(rank))), n]
            groups = [members[a:b] for a, b in pairwise(bounds)]
        order: list[Sequence[int]] = []
        runs = array("I")
        for group in groups:
            at: Sequence[int] = offs[group.start : group.stop] if isinstance(group, range) else \
                list(map(offs.__getitem__, group))
            best: tuple[list[Sequence[int]], list[int]] | None = None
            for k in range(1, min(8, len(group)) + 1):
                # Past `limit` runs this k neither wins nor ends the search: no need to count further.
                limit = max(len(best[1]), k + 1) if best is not None else len(group) + 1
                counts: list[int] = []
                for r in range(k):
                    counts += _stride_runs(at[r::k], limit - len(counts))
                    if len(counts) >= limit:
                        break
                if len(counts) < limit and (best is None or len(counts) < len(best[1])):
                    best = ([group[r::k] for r in range(k)], counts)
                if len(counts) <= k:
                    break
            assert best is not None
            order += best[0]
            runs.extend(best[1])
        if len(order) == 1 and order[0] == range(n):  # already in runs: the columns as they are
            return Manifest(self.names, codes, self.shapes, ids, offs, self.sizes, self.size, runs=runs)
        picked = list(chain.from_iterable(order))
        pick = itemgetter(*picked) if n > 1 else (lambda c: tuple(c[i] for i in picked))
        return Manifest(tuple(pick(self.names)), bytes(pick(codes)), self.shapes, array("I", pick(ids)),
                        array("Q", pick(offs)), list(pick(self.sizes)), self.size, runs=runs)

    # -- the wire -----------------------------------------------------------------------------

    def to_wire(self) -> dict[str, Any]:
        """The manifest as the wire sends it: columns."""
        return {
            "size": self.size,
            "names": "\0".join(self.names),
            "dtypes": self.dtype_codes,
            "shape_ndims": bytes(map(len, self.shapes)),
            "shape_dims": _le_bytes(array("Q", [d for s in self.shapes for d in s])),
            "shape_ids": _le_bytes(self.shape_ids),
            "offsets": _le_bytes(self.offsets),
            "runs": _le_bytes(self.runs),
        }

    def wire(self) -> dict[str, Any]:
        """What the daemon sends on every acquire, built once: the columns in runs."""
        if self._wire is None:
            self._wire = self.grouped().to_wire()
        return self._wire

    def layout(self) -> str:
        """A digest of the layout (names, dtypes, shapes, offsets, size): equal for two manifests
        exactly when one arena's bytes can be read through the other's views. Kept once computed."""
        digest = self._layout
        if digest is None:
            wire = self.to_wire()
            h = hashlib.blake2b(digest_size=16)
            for column in ("names", "dtypes", "shape_ndims", "shape_dims", "shape_ids", "offsets"):
                data = wire[column]
                h.update(len(data).to_bytes(8, "little"))
                h.update(data.encode() if isinstance(data, str) else data)
            h.update(self.size.to_bytes(8, "little"))
            digest = self._layout = h.hexdigest()
        return digest

    def wire_ready(self) -> bool:
        """Whether `wire()` is built (building it for 10^5 tensors takes a while)."""
        return self._wire is not None

    @classmethod
    def from_wire(cls, obj: Any) -> Manifest:
        """Validate an untrusted manifest's columns: names, dtypes and shapes valid, every tensor
        aligned and inside `size`, no two overlapping. Raises `BadRequest` only."""
        if not isinstance(obj, dict) or type(obj.get("size")) is not int or not isinstance(obj.get("names"), str) \
                or not all(type(obj.get(k)) is bytes for k in _COLUMNS):
            raise BadRequest("manifest must be {size: int, names: str, " + ", ".join(f"{k}: bin" for k in _COLUMNS)
                             + "}")
        size, offs_b, n = obj["size"], obj["offsets"], len(obj["dtypes"])
        if size <= 0 or size > MAX_DIM:
            raise BadRequest(f"manifest size {size} out of range")
        if len(offs_b) != 8 * n:
            raise BadRequest(f"manifest columns do not agree on {n} tensors")
        names, codes, shapes, numels, ids = _tensor_columns(obj)
        offsets = _le_array("Q", offs_b)
        runs = _le_array("I", obj["runs"])
        _check_runs(runs, codes, ids, offsets)
        sizes: list[int] = []
        if len(runs) * 4 < n:  # a run's tensors all have one size
            at = 0
            for count in runs:
                sizes += [numels[ids[at]] * ITEMSIZES[codes[at]]] * count
                at += count
        else:
            sizes = list(map(mul, map(numels.__getitem__, ids), map(ITEMSIZES.__getitem__, codes)))
        # 256 = 2**8: an offset is aligned when its low (first, little-endian) byte is zero.
        ends = list(map(add, offsets, sizes))
        if any(offs_b[0::8]) or (n and max(ends) > size):
            i = next(i for i in range(n) if offsets[i] % ALIGN or ends[i] > size)
            raise BadRequest(f"tensor {names[i]!r}: offset {offsets[i]} not aligned or outside the arena",
                             {"tensor": names[i]})
        manifest = cls(names, codes, tuple(shapes), ids, offsets, sizes, size, runs)
        check_overlaps(names, offsets, sizes, ends)
        return manifest

    @classmethod
    def layout_columns(cls, obj: Any) -> Manifest:
        """Lay out tensors given as untrusted columns (a v2 reserve: `names`, `dtypes`,
        `shape_ndims`, `shape_dims`, `shape_ids`, as in `to_wire`), validated in bulk."""
        if not isinstance(obj, dict) or not isinstance(obj.get("names"), str) \
                or not all(type(obj.get(k)) is bytes for k in TENSOR_COLUMNS[1:]):
            raise BadRequest("tensors must be {names: str, " + ", ".join(f"{k}: bin" for k in TENSOR_COLUMNS[1:]) + "}")
        names, codes, shapes, numels, ids = _tensor_columns(obj)
        sizes: list[int] = []
        for i in range(0, len(codes), STEP):  # in steps, as `_tensor_columns` checks
            part_ids, part_codes = ids[i : i + STEP], codes[i : i + STEP]
            sizes += map(mul, map(numels.__getitem__, part_ids), map(ITEMSIZES.__getitem__, part_codes))
        return cls._laid_out(names, codes, tuple(shapes), ids, sizes)

    @classmethod
    def from_columns(cls, names: tuple[str, ...], codes: bytes, shapes: tuple[tuple[int, ...], ...],
                     ids: array[int], sizes: list[int], unique: bool = False, checked: bool = False) -> Manifest:
        """`build` for tensors given as valid columns (dtype codes, distinct shapes, each tensor's
        shape index and size in bytes, as a parsed checkpoint has them): the same layout and the
        same checks of the names (same errors, first one first), in bulk. `unique`: the caller
        has checked that the names are distinct strings (a checkpoint's: the keys of JSON objects,
        none in two shards, checked when it was opened); `checked`: and that each is valid
        (`names_valid`: a checkpoint's headers, as they were parsed)."""
        n = len(names)
        if n and ((not unique and (set(map(type, names)) != {str} or len(set(names)) != n))
                  or (not (unique and checked) and not names_valid(names))) or n > MAX_TENSORS:
            seen: set[str] = set()
            for name in names[: MAX_TENSORS + 1]:  # what `build` would raise, in its order
                _check_name(name)
                if name in seen:
                    raise BadRequest(f"tensor {name!r} appears twice", {"tensor": name})
                seen.add(name)
            raise BadRequest(f"more than {MAX_TENSORS} tensors")
        return cls._laid_out(names, codes, shapes, ids, sizes)

    @classmethod
    def _laid_out(cls, names: tuple[str, ...], codes: bytes, shapes: tuple[tuple[int, ...], ...],
                  ids: array[int], sizes: list[int]) -> Manifest:
        # Each offset is aligned, so the next one is it plus the size rounded up (as `build` lays out).
        # Sizes repeat (one per shape and dtype): each distinct one is rounded once, and tensors all
        # of one rounded size (experts, a synthetic checkpoint) are laid out as one range.
        distinct = sizes[:1] if sizes and sizes.count(sizes[0]) == len(sizes) else dict.fromkeys(sizes)
        strides = {n: (n + ALIGN - 1) & -ALIGN for n in distinct}
        ends: list[int] = []
        if len(strides) == 1:
            (stride,) = strides.values()
            end = stride * len(sizes)
        else:
            ends = list(accumulate(map(strides.__getitem__, sizes), initial=0))
            end = ends[-1]
        if end > MAX_DIM:  # before the offsets become uint64s
            raise BadRequest(f"the tensors need {end} bytes, more than an arena can hold")
        if ends:
            offsets = array("Q", ends[:-1])
        else:
            offsets = array("Q", range(0, end, stride)) if stride else array("Q", [0]) * len(sizes)
        return cls(names, codes, shapes, ids, offsets, sizes, max(end, ALIGN))


_COLUMNS = ("dtypes", "shape_ndims", "shape_dims", "shape_ids", "offsets", "runs")
# What a v2 reserve sends: the tensors, without a layout.
TENSOR_COLUMNS = ("names", "dtypes", "shape_ndims", "shape_dims", "shape_ids")


# A peer's columns are checked STEP names per C-level pass: the reserve's worker holds the GIL for
# each pass, and the loop waits for the GIL as long as the longest (a split of 100,000 names in one
# call: 13 ms on the VM; MAX_TENSORS of long names, ten times that).
STEP = 16_384


def _split(joined: str, sep: str) -> list[str]:
    """`joined.split(sep)` (a one-character `sep`) in pieces of about STEP * 64 characters: a cut at
    a separator splits into the same strings."""
    out: list[str] = []
    start, size = 0, STEP * 64
    while True:
        cut = joined.find(sep, start + size) if start + size < len(joined) else -1
        if cut < 0:
            out += joined[start:].split(sep)
            return out
        out += joined[start:cut].split(sep)
        start = cut + 1


def _tensor_columns(obj: dict[str, Any]) -> tuple[tuple[str, ...], bytes, list[tuple[int, ...]], list[int], array[int]]:
    """Names, dtype codes, distinct shapes, their element counts and each tensor's shape index,
    from untrusted columns, checked in bulk (one Python step per distinct shape, not per tensor)."""
    joined, codes, ndims, dims_b, ids_b = (obj[k] for k in TENSOR_COLUMNS)
    n = len(codes)
    if n > MAX_TENSORS:
        raise BadRequest(f"tensor count {n} out of range (max {MAX_TENSORS})")
    if len(ids_b) != 4 * n or len(ndims) > max(n, 1) or len(dims_b) != 8 * sum(ndims):
        raise BadRequest(f"manifest columns do not agree on {n} tensors")
    names = tuple(_split(joined, "\0")) if n else ()
    if len(names) != n or (joined and not n):
        raise BadRequest(f"manifest names do not agree on {n} tensors")
    if n and (not joined or "\0\0" in joined or joined[0] == "\0" or joined[-1] == "\0"
              or max(max(map(len, names[i : i + STEP])) for i in range(0, n, STEP)) > MAX_NAME_LEN):
        _check_name(next(s for s in names if not s or len(s) > MAX_NAME_LEN))
    if has_control(joined, nul_ok=True):
        _check_name(next(s for s in names if _CONTROL_CHAR.search(s)))
    distinct: set[str] = set()
    for i in range(0, n, STEP):
        distinct.update(names[i : i + STEP])
    if len(distinct) != n:
        seen: set[str] = set()
        dup = next(s for s in names if s in seen or seen.add(s))  # type: ignore[func-returns-value]
        raise BadRequest(f"tensor {dup!r} appears twice", {"tensor": dup})
    if n and max(codes) >= len(DTYPES):
        raise BadRequest(f"unsupported dtype code {max(codes)} (known: 0..{len(DTYPES) - 1})")
    if ndims and max(ndims) > MAX_NDIM:
        raise BadRequest(f"a shape has {max(ndims)} dimensions (max {MAX_NDIM})")
    dims = _le_array("Q", dims_b)
    if dims and max(dims) > MAX_DIM:
        raise BadRequest(f"bad dimension {max(dims)} (max {MAX_DIM})")
    shapes, numels, at = [], [], 0
    for k in ndims:  # one step per distinct shape, not per tensor
        shape = tuple(dims[at : at + k])
        at += k
        shapes.append(shape)
        numels.append(_numel(shape, "a tensor's "))
    ids = _le_array("I", ids_b)
    if n and max(ids) >= len(shapes):
        raise BadRequest(f"shape index {max(ids)} outside the {len(shapes)} shapes")
    return names, codes, shapes, numels, ids


def _stride_runs(at: Sequence[int], limit: int) -> list[int]:
    """Lengths of the maximal runs at one constant stride in the offsets `at` (in offset order),
    taken greedily: a run is its first two tensors and every next one at their step. With `d`
    the steps between neighbours, the run from `i` ends at the first change of `d` after `i`.
    Stops once it has `limit` runs."""
    m = len(at)
    if m <= 2:
        return [m] if m else []
    if isinstance(at, array) and _one_step(at):  # one C-level comparison
        return [m]
    d = list(map(sub, islice(at, 1, None), at))
    if d.count(d[0]) == m - 1:
        return [m]
    changes = list(compress(range(1, m - 1), map(ne, islice(d, 1, None), d)))
    out: list[int] = []
    i = 0
    while i < m and len(out) < limit:
        c = bisect_right(changes, i)
        if c == len(changes):
            out.append(m - i)
            break
        out.append(changes[c] - i + 1)
        i = changes[c] + 1
    return out


def _one_step(at: array[int]) -> bool:
    """Whether the offsets `at` go up by one step (0 included): in order, and one run."""
    if len(at) < 2:
        return True
    first, step = at[0], at[1] - at[0]
    return step >= 0 and at == (array(at.typecode, range(first, first + step * len(at), step)) if step
                                else array(at.typecode, [first]) * len(at))


def _check_runs(runs: array[int], codes: bytes, ids: array[int], offsets: array[int]) -> None:
    """Each run is one dtype, one shape and one constant stride: one C-level comparison per column."""
    if sum(runs) != len(codes) or (runs and min(runs) < 1):
        raise BadRequest(f"manifest runs cover {sum(runs)} of {len(codes)} tensors")
    at = 0
    for count in runs:
        if count > 1:
            end = at + count
            first, step = offsets[at], offsets[at + 1] - offsets[at]
            if step < 0:
                raise BadRequest(f"manifest run of {count} tensors at column {at} has a negative stride")
            expected = array("Q", range(first, first + step * count, step)) if step else array("Q", [first]) * count
            if codes.count(codes[at], at, end) != count or ids[at:end].count(ids[at]) != count \
                    or offsets[at:end] != expected:
                raise BadRequest(f"manifest run of {count} tensors at column {at} is not one dtype, shape and stride")
        at += count


def check_overlaps(names: Sequence[str], starts: Sequence[int], sizes: Sequence[int], ends: Sequence[int]) -> None:
    """No two tensors with data share a byte (zero-size tensors may sit anywhere). Of overlapping
    ones, names the first pair of neighbours in (stable) order of starts.

    Intervals are disjoint exactly when, with starts and ends each sorted on their own, every
    start but the first is at or after the previous end: two plain sorts of integers, no key.
    """
    live_starts, live_ends = starts, ends
    if 0 in sizes:
        live_starts, live_ends = list(compress(starts, sizes)), list(compress(ends, sizes))
    if len(live_starts) < 2:
        return
    s, e = sorted(live_starts), sorted(live_ends)
    if not all(map(le, e[:-1], s[1:])):
        live = [i for i in range(len(names)) if sizes[i]]
        live.sort(key=starts.__getitem__)
        a, b = next((a, b) for a, b in zip(live, live[1:]) if ends[a] > starts[b])
        raise BadRequest(f"tensors {names[a]!r} and {names[b]!r} overlap")
