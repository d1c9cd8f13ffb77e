"""Tensor layout inside one arena: names, dtypes, shapes and 256-byte-aligned byte offsets.

A manifest never allocates memory. Tensors are C-contiguous, so strides follow from the shape.
`Manifest.from_wire` validates untrusted layouts (bounds, alignment, overlap, sizes) without
pydantic's per-object cost: a 100k-tensor manifest must decode in milliseconds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any, NamedTuple

from wcd.errors import BadRequest

ALIGN = 256
MAX_TENSORS = 262_144
MAX_NAME_LEN = 1024
MAX_NDIM = 16
MAX_DIM = 1 << 48

# safetensors dtype names -> bytes per element. Sub-byte formats (F4, F6_*) have no byte
# addressable layout and are refused.
DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1,
    "F8_E4M3": 1, "F8_E4M3FNUZ": 1, "F8_E5M2": 1, "F8_E5M2FNUZ": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


class TensorSpec(NamedTuple):  # a tuple: built thousands of times per attach, it must be cheap
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def strides(self) -> tuple[int, ...]:
        """Element strides of the C-contiguous layout."""
        return contiguous_strides(self.shape)


# Models repeat a handful of shapes across thousands of tensors: per-shape results are cached so
# that decoding a manifest on every attach costs a dictionary lookup per tensor, not a loop.
@lru_cache(maxsize=4096)
def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return tuple(reversed(out))


@lru_cache(maxsize=4096)
def _layout_nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return tensor_nbytes("", dtype, shape)


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
    return math.prod(shape) * size


def _check_name(name: Any) -> str:
    if type(name) is not str or not name or len(name) > MAX_NAME_LEN:
        raise BadRequest(f"bad tensor name {name!r:.80} (1..{MAX_NAME_LEN} characters)")
    return name


@dataclass(frozen=True)
class Manifest:
    """The layout of one arena. `size` is the number of bytes the arena must hold."""

    tensors: tuple[TensorSpec, ...]
    size: int

    @classmethod
    def build(cls, items: Iterable[tuple[str, str, Sequence[int]]]) -> Manifest:
        """Lay tensors out in the given order, each at a 256-byte-aligned offset."""
        specs: list[TensorSpec] = []
        seen: set[str] = set()
        offset = 0
        for name, dtype, shape in items:
            _check_name(name)
            if name in seen:
                raise BadRequest(f"tensor {name!r} appears twice", {"tensor": name})
            seen.add(name)
            shape = tuple(shape)
            nbytes = tensor_nbytes(name, dtype, shape)
            specs.append(TensorSpec(name, dtype, shape, offset, nbytes))
            offset = align_up(offset + nbytes)
            if len(specs) > MAX_TENSORS:
                raise BadRequest(f"more than {MAX_TENSORS} tensors")
        return cls(tuple(specs), max(offset, ALIGN))

    def to_wire(self) -> dict[str, Any]:
        return {"size": self.size, "tensors": [[t.name, t.dtype, list(t.shape), t.offset] for t in self.tensors]}

    @cached_property
    def wire(self) -> dict[str, Any]:
        """`to_wire()`, built once: the daemon sends the same manifest on every acquire."""
        return self.to_wire()

    @classmethod
    def from_wire(cls, obj: Any) -> Manifest:
        """Validate an untrusted manifest: every tensor aligned, inside `size`, no overlaps."""
        if not isinstance(obj, dict) or type(obj.get("size")) is not int or not isinstance(obj.get("tensors"), list):
            raise BadRequest("manifest must be {size: int, tensors: [[name, dtype, shape, offset], ...]}")
        size, rows = obj["size"], obj["tensors"]
        if size <= 0 or size > MAX_DIM or len(rows) > MAX_TENSORS:
            raise BadRequest(f"manifest size {size} or tensor count {len(rows)} out of range")
        specs: list[TensorSpec] = []
        seen: set[str] = set()
        for row in rows:
            if not isinstance(row, (list, tuple)) or len(row) != 4 or not isinstance(row[2], (list, tuple)):
                raise BadRequest(f"manifest row {row!r:.80} is not [name, dtype, shape, offset]")
            name, dtype, shape, offset = _check_name(row[0]), row[1], tuple(row[2]), row[3]
            if name in seen:
                raise BadRequest(f"tensor {name!r} appears twice", {"tensor": name})
            seen.add(name)
            # The cache compares by ==, so 1.0 and True would pass for 1: only exact ints go through it.
            if type(dtype) is str and all(type(d) is int for d in shape):
                try:
                    nbytes = _layout_nbytes(dtype, shape)
                except BadRequest:
                    nbytes = tensor_nbytes(name, dtype, shape)  # the same error, naming the tensor
            else:
                nbytes = tensor_nbytes(name, dtype, shape)
            if type(offset) is not int or offset < 0 or offset % ALIGN or offset + nbytes > size:
                raise BadRequest(f"tensor {name!r}: offset {offset!r} not aligned or outside the arena", {"tensor": name})
            specs.append(TensorSpec(name, dtype, shape, offset, nbytes))
        ordered = sorted((t for t in specs if t.nbytes), key=lambda t: t.offset)
        for a, b in zip(ordered, ordered[1:]):
            if a.offset + a.nbytes > b.offset:
                raise BadRequest(f"tensors {a.name!r} and {b.name!r} overlap")
        return cls(tuple(specs), size)

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data (without alignment padding)."""
        return sum(t.nbytes for t in self.tensors)
