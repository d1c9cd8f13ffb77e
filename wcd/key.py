"""`WeightCacheKey`, what makes two weight sets interchangeable, and checkpoint fingerprints.

Keys compare strictly on every field (DESIGN §6); `diff` names the fields that differ so a
mismatch can be reported precisely. The fingerprint covers every safetensors file's name,
size and header *and* sampled tensor bytes, so a checkpoint whose values changed under the
same header is not served as the old one. No torch here.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from wcd import HOST_DEVICE
from wcd.checkpoint import SAMPLE_BYTES, SAMPLES_PER_FILE, Checkpoint, Shards
from wcd.errors import LoadFailed
from wcd.headers import MAX_HEADER_BYTES

Text = Annotated[str, StringConstraints(max_length=1024)]
ShortText = Annotated[str, StringConstraints(max_length=256)]


class WeightCacheKey(BaseModel):
    """Identity of one cached weight set. Every field takes part in equality."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: Annotated[str, StringConstraints(min_length=1, max_length=256)]
    path: Text = ""
    fingerprint: ShortText = ""
    dtype: ShortText = ""
    transform: ShortText = "raw"
    shard: Annotated[dict[ShortText, int], Field(max_length=16)] = Field(default_factory=dict)
    device: ShortText = HOST_DEVICE
    extra: Annotated[dict[ShortText, Text], Field(max_length=64)] = Field(default_factory=dict)

    def diff(self, other: WeightCacheKey) -> list[str]:
        """Names of the fields whose values differ, in declaration order."""
        return [f for f in type(self).model_fields if getattr(self, f) != getattr(other, f)]

    def canonical(self) -> str:
        """The key as JSON with sorted keys: equal keys give equal strings whatever the dict order."""
        return json.dumps(self.model_dump(), sort_keys=True, separators=(",", ":"))

    def digest(self, publisher: int | None = None) -> str:
        """A short stable hash of the whole key, and of its publisher's uid if given (generated
        entry names, fd store names)."""
        scope = "" if publisher is None else f"@{publisher}"
        return hashlib.blake2b((self.canonical() + scope).encode(), digest_size=8).hexdigest()

    def __hash__(self) -> int:
        return hash(self.canonical())


def fingerprint_checkpoint(path: str | os.PathLike[str]) -> str:
    """Fingerprint a safetensors file or directory of shards, read with the caller's own rights
    (links followed: this is the client side; the daemon opens checkpoints guarded and calls `fingerprint`)."""
    with Checkpoint.open(path, follow_links=True, owner_check=False) as ckpt:
        return fingerprint(ckpt)


def fingerprint(ckpt: Checkpoint) -> str:
    """Fingerprint an open checkpoint, through its descriptors.

    Hashes, per file in name order: the file name, its size, its header bytes and
    `SAMPLES_PER_FILE` evenly spaced `SAMPLE_BYTES`-byte windows of its data section (first
    and last included). Cost: a few hundred small reads, independent of checkpoint size.

    An open checkpoint's names, sizes and headers are fixed, so asked again (the check after a
    fill) only the samples are read and hashed, each file's from the hash's state before them the
    first time (`Checkpoint.fingerprinted`): the headers of 100,000 tensors are 10 MB to hash (17 ms
    on the VM). While each file's samples give the state they gave then, the fingerprint is the same.
    """
    known = ckpt.fingerprinted
    if known is not None and all(_hash_samples(before.copy(), fd, h.data_start, h.file_size).digest() == after
                                 for (before, after), h, fd in zip(known[1], ckpt.headers, ckpt.fds)):
        return known[0]
    ckpt.fingerprinted = _fingerprint((h.file, h.file_size, h.raw, h.data_start, fd)
                                      for h, fd in zip(ckpt.headers, ckpt.fds))
    return ckpt.fingerprinted[0]


def first_fingerprint(shards: Shards) -> tuple[str, tuple[tuple[Any, bytes], ...]]:
    """`fingerprint`'s value and memo for the checkpoint these shards parse into, from their raw
    headers: the daemon computes it beside the parse (hashing and reading drop the GIL), and sets
    it as the checkpoint's `fingerprinted`."""
    return _fingerprint((file, size, raw, start, fd)
                        for (file, fd), (raw, start, size) in zip(shards.files, shards.raws))


def _fingerprint(shards: Iterable[tuple[Path, int, bytes, int, int]]) -> tuple[str, tuple[tuple[Any, bytes], ...]]:
    """The fingerprint of (file, file size, raw header, data start, fd) per shard, and per shard the
    hash's state before its samples and its digest after them; a failed read is a LoadFailed
    naming its shard."""
    h = hashlib.blake2b(digest_size=16)
    marks = []
    for file, size, raw, data_start, fd in shards:
        _hash_head(h, file.name, size, raw)
        before = h.copy()
        try:
            marks.append((before, _hash_samples(h, fd, data_start, size).digest()))
        except OSError as e:
            raise LoadFailed(f"{file}: cannot read: {e.strerror or e}") from None
    return h.hexdigest(), tuple(marks)


def fingerprint_unparsed(files: list[tuple[Path, int]]) -> str:
    """`fingerprint` of open shards without parsing their headers (the same value for a valid
    checkpoint): what a restart needs to tell a parked entry stale, in time independent of the
    number of tensors (parsing 100,000 header entries takes ~0.8 s)."""
    h = hashlib.blake2b(digest_size=16)
    for file, fd in files:
        size = os.fstat(fd).st_size
        n = int.from_bytes(os.pread(fd, 8, 0), "little")
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise LoadFailed(f"{file}: not a safetensors file (header length {n} is implausible)")
        raw = os.pread(fd, n, 8)
        _hash_head(h, file.name, size, raw)
        _hash_samples(h, fd, 8 + len(raw), size)
    return h.hexdigest()


def _hash_head(h: Any, name: str, size: int, raw: bytes) -> None:
    h.update(name.encode() + b"\0")
    h.update(size.to_bytes(8, "little"))
    h.update(raw)


def _hash_samples(h: Any, fd: int, start: int, end: int) -> Any:
    """Feed `h` the sampled windows of a file's data section (`start` to `end`); returns `h`."""
    for pos in _sample_positions(start, end):
        h.update(os.pread(fd, SAMPLE_BYTES, pos))
    return h


def _sample_positions(start: int, end: int) -> list[int]:
    span = end - start
    if span <= SAMPLE_BYTES * SAMPLES_PER_FILE:
        return list(range(start, end, SAMPLE_BYTES))
    last = end - SAMPLE_BYTES  # integer steps: the last window always ends at the file's end
    return [start + i * (last - start) // (SAMPLES_PER_FILE - 1) for i in range(SAMPLES_PER_FILE)]
