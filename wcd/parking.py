"""Records that let arenas outlive the daemon in systemd's fd store.

For each ready entry the daemon parks two fds: the arena's, and a small sealed memfd holding
this record (key, manifest, retention, arena kind and size). After `systemctl restart` both come
back through LISTEN_FDS; `parse_record` validates the record before anything trusts it, except
the manifest's layout, which `ParkedEntry.manifest()` validates (10^5 tensors take ~0.1 s: the
daemon does it after READY, before it serves the entry). fd names cannot contain ':', so they are
derived from a hash of the entry's key.
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass
from typing import Any, cast

import msgpack

from wcd.cache import Entry, Origin
from wcd.errors import BadRequest
from wcd.key import WeightCacheKey
from wcd.manifest import Manifest
from wcd.wire import Retention

RECORD_VERSION = 1
MAX_RECORD_BYTES = 64 << 20
ARENA_SUFFIX, RECORD_SUFFIX = ".arena", ".record"
_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL


@dataclass(frozen=True)
class ParkedEntry:
    name: str
    key: WeightCacheKey
    manifest_wire: dict[str, Any]  # as `Manifest.to_wire` wrote it; not validated yet: see `manifest()`
    manifest_size: int  # the arena bytes it lays out (its "size"), checked against `arena_size`
    retention: Retention
    origin: Origin
    arena_kind: str
    arena_size: int
    publisher: int | None  # the publisher's uid (published entries); older records lack it
    asked_by: int | None = None  # the uid whose `load` of a path made it (`Entry.asked_by`)

    def manifest(self) -> Manifest:
        """The manifest, validated like one from a peer; `BadRequest` says what is wrong with it."""
        return Manifest.from_wire(self.manifest_wire)  # its size is `manifest_size`: from_wire keeps it


def fd_names(key: WeightCacheKey, publisher: int | None) -> tuple[str, str]:
    """(arena name, record name) in the fd store for the entry with `key` from `publisher`."""
    stem = f"wcd-{key.digest(publisher)}"
    return stem + ARENA_SUFFIX, stem + RECORD_SUFFIX


def record_memfd(entry: Entry) -> int:
    """A sealed memfd holding the park record of `entry` (which has an arena)."""
    body = msgpack.packb({
        "v": RECORD_VERSION, "name": entry.name, "key": entry.key.model_dump(),
        "manifest": entry.manifest.to_wire(), "retention": entry.retention, "origin": entry.origin,
        "arena": {"kind": entry.arena.kind, "size": entry.arena.size}, "publisher": entry.publisher,
        "asked_by": entry.asked_by,
    }, use_bin_type=True)
    fd = os.memfd_create(f"wcd-record:{entry.name}"[:249], os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.write(fd, body)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def parse_record(fd: int) -> ParkedEntry:
    """Read and validate a park record but for its manifest's layout (`ParkedEntry.manifest`):
    what is left takes microseconds whatever the tensor count. `BadRequest` says what is wrong."""
    size = os.fstat(fd).st_size
    if not 0 < size <= MAX_RECORD_BYTES:
        raise BadRequest(f"record of {size} bytes")
    data = os.pread(fd, size, 0)
    try:
        rec = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:
        raise BadRequest(f"record is not msgpack ({type(e).__name__})") from None
    if not isinstance(rec, dict) or rec.get("v") != RECORD_VERSION:
        raise BadRequest("record has an unknown version")
    try:
        arena, manifest = rec["arena"], rec["manifest"]
        if not isinstance(manifest, dict) or type(manifest.get("size")) is not int:
            raise TypeError("manifest has no size")
        parked = ParkedEntry(
            name=str(rec["name"]), key=WeightCacheKey.model_validate(rec["key"]),
            manifest_wire=manifest, manifest_size=manifest["size"], retention=cast(Retention, str(rec["retention"])),
            origin=cast(Origin, str(rec["origin"])), arena_kind=str(arena["kind"]), arena_size=int(arena["size"]),
            publisher=rec.get("publisher"), asked_by=rec.get("asked_by") if type(rec.get("asked_by")) is int else None,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise BadRequest(f"record is incomplete ({e})") from None
    if parked.retention not in ("pinned", "cached", "ephemeral") or parked.origin not in ("config", "load", "publish"):
        raise BadRequest("record has an unknown retention or origin")
    if parked.arena_size < parked.manifest_size:
        raise BadRequest("record's arena is smaller than its manifest")
    if parked.origin == "publish" and type(parked.publisher) is not int:
        raise BadRequest("record of a published entry does not say who published it (from an older wcd)")
    return parked
