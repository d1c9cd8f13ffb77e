"""Reading the daemon's replies as untrusted input: one `BadReply` line for anything malformed,
and the validated manifests a process has seen, remembered by their bytes."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from wcd.errors import BadReply, BadRequest, ProtocolError, WcdError
from wcd.manifest import Manifest, has_control

# Validated manifests by their wire columns: re-acquiring an entry this process has seen skips
# validation and view planning. Keyed by the bytes themselves, so a hit is an exact match.
_MANIFESTS: OrderedDict[tuple[Any, ...], Manifest] = OrderedDict()
_MANIFESTS_LOCK = threading.Lock()
_MANIFESTS_KEPT = 16
_MANIFEST_FIELDS = ("size", "names", "dtypes", "shape_ndims", "shape_dims", "shape_ids", "offsets", "runs")


def validated_manifest(obj: Any) -> Manifest:
    """`Manifest.from_wire(obj)`, remembering the last few manifests validated in this process."""
    try:
        key = tuple(obj[f] for f in _MANIFEST_FIELDS)
        hash(key)
    except (TypeError, KeyError):  # not v2 columns: validate without caching (and fail there if bad)
        return Manifest.from_wire(obj)
    with _MANIFESTS_LOCK:
        manifest = _MANIFESTS.get(key)
        if manifest is not None:
            _MANIFESTS.move_to_end(key)
            return manifest
    manifest = Manifest.from_wire(obj)
    with _MANIFESTS_LOCK:
        _MANIFESTS[key] = manifest
        while len(_MANIFESTS) > _MANIFESTS_KEPT:
            _MANIFESTS.popitem(last=False)
    return manifest


@contextmanager
def decoding(what: str) -> Iterator[None]:
    """Whatever goes wrong decoding `what` (part of a reply) is one `BadReply` line: a reply (say,
    an entry another uid crafted) must never reach an engine as a TypeError or KeyError, which its
    fallback to loading from disk would not catch. Other `WcdError`s (a missing CUDA backend) pass."""
    try:
        yield
    except BadRequest as e:  # the local checks of a manifest or an arena
        raise BadReply(f"{what}: {e.message}", e.details) from None
    except WcdError:
        raise
    except Exception as e:
        detail = next(iter(str(e).splitlines()), "")[:200]
        raise BadReply(f"{what} is malformed ({type(e).__name__}: {detail}); the entry cannot be used") from None


T = TypeVar("T")


def field(reply: dict[str, Any], name: str, kind: type[T]) -> T:
    value = reply.get(name)
    if not isinstance(value, kind):
        raise BadReply(f"reply field {name!r} is {type(value).__name__}, not {kind.__name__}")
    return value


def entry_name(reply: dict[str, Any]) -> str:
    """The reply's entry name, refused if it holds control characters (they would forge the
    engine's log lines and an operator's terminal output)."""
    name = field(reply, "entry", str)
    if has_control(name):
        raise BadReply(f"the daemon named an entry {name!r:.80}, with control characters: refusing it")
    return name


def one_fd(fds: list[int]) -> int:
    if len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise ProtocolError(f"expected one arena descriptor, got {len(fds)}")
    return fds[0]
