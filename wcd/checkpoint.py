"""safetensors checkpoints: finding shards, parsing and validating headers, planning reads.

A checkpoint is one `.safetensors` file or a directory of them. The safetensors package does
not expose data offsets, and the daemon must not import torch, so the (tiny, documented)
header format is parsed here with strict bounds. Nothing here knows about arenas.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from wcd.errors import LoadFailed, WcdError
from wcd.manifest import Manifest, tensor_nbytes

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit
SAMPLE_BYTES = 4096
SAMPLES_PER_FILE = 64


@dataclass(frozen=True, slots=True)
class StoredTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute file offset
    end: int


@dataclass(frozen=True)
class Header:
    file: Path
    raw: bytes
    data_start: int
    file_size: int
    tensors: tuple[StoredTensor, ...]


@dataclass(frozen=True, slots=True)
class CopyOp:
    """Copy `nbytes` from `file` at `file_offset` to the arena at `arena_offset`."""

    file: Path
    file_offset: int
    arena_offset: int
    nbytes: int


def checkpoint_files(path: Path) -> list[Path]:
    """The shard files of a checkpoint, sorted by name."""
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix == ".safetensors" and p.is_file())
        if not files:
            raise LoadFailed(f"{path}: no .safetensors files in this directory")
        return files
    if path.is_file():
        return [path]
    raise LoadFailed(f"{path}: no such file or directory")


def read_header(file: Path) -> Header:
    """Parse and validate one safetensors header; every tensor must lie inside the file."""
    try:
        with open(file, "rb") as f:
            file_size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise LoadFailed(f"{file}: not a safetensors file (shorter than 8 bytes)")
            n = int.from_bytes(prefix, "little")
            if n > MAX_HEADER_BYTES or 8 + n > file_size:
                raise LoadFailed(f"{file}: not a safetensors file (header length {n} is implausible)")
            raw = f.read(n)
    except OSError as e:
        raise LoadFailed(f"{file}: cannot read: {e.strerror}") from None
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:  # bad JSON, bad UTF-8, absurd integers, deep nesting
        raise LoadFailed(f"{file}: safetensors header is not valid JSON ({str(e)[:200]})") from None
    if not isinstance(doc, dict):
        raise LoadFailed(f"{file}: safetensors header is not a JSON object")
    data_start = 8 + n
    tensors = []
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
        tensors.append(StoredTensor(name, dtype, shape, data_start + begin, data_start + end))
    tensors.sort(key=lambda t: t.begin)
    reach: StoredTensor | None = None  # the tensor with data reaching furthest so far
    for t in tensors:  # no two tensors with data may share a byte (safetensors refuses that too)
        if t.end > t.begin:
            if reach is not None and t.begin < reach.end:
                raise LoadFailed(f"{file}: tensors {reach.name!r} and {t.name!r} overlap (data_offsets)")
            if reach is None or t.end > reach.end:
                reach = t
    return Header(file, raw, data_start, file_size, tuple(tensors))


@dataclass(frozen=True)
class Checkpoint:
    """All shards of one checkpoint, their headers, and how they map onto an arena."""

    path: Path
    headers: tuple[Header, ...]

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> Checkpoint:
        p = Path(path).resolve()
        headers = tuple(read_header(f) for f in checkpoint_files(p))
        names: set[str] = set()
        for h in headers:
            for t in h.tensors:
                if t.name in names:
                    raise LoadFailed(f"{p}: tensor {t.name!r} appears in more than one shard")
                names.add(t.name)
        return cls(p, headers)

    def manifest(self) -> Manifest:
        """Arena layout: shards in name order, tensors in file order (sequential reads)."""
        return Manifest.build((t.name, t.dtype, t.shape) for h in self.headers for t in h.tensors)

    def copy_plan(self, manifest: Manifest, chunk: int = 64 << 20) -> list[CopyOp]:
        """Reads that fill an arena of `manifest`; large tensors are split into `chunk`-byte pieces."""
        at = {t.name: t.offset for t in manifest.tensors}
        ops = []
        for h in self.headers:
            for t in h.tensors:
                for pos in range(0, t.end - t.begin, chunk):
                    n = min(chunk, t.end - t.begin - pos)
                    ops.append(CopyOp(h.file, t.begin + pos, at[t.name] + pos, n))
        return ops

    @property
    def nbytes(self) -> int:
        return sum(t.end - t.begin for h in self.headers for t in h.tensors)
