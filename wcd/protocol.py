"""Protocol v1: sans-IO framing, message schemas and limits. No sockets here.

A frame is a 4-byte big-endian length followed by one msgpack map. File descriptors travel as
SCM_RIGHTS ancillary data sent with the first byte of the frame that announces them in its
`nfds` field; the I/O layer hands received fds to `FrameDecoder.feed` and the decoder pairs
them with the frame that claims them. Every request is validated against a pydantic schema
with explicit bounds before the server looks at it. Never pickle.
"""

from __future__ import annotations

import array
import socket
import struct
from collections import deque
from collections.abc import Sequence
from typing import Annotated, Any, Literal, Union

import msgpack
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StringConstraints, TypeAdapter, ValidationError

from wcd.errors import BadRequest, ProtocolError
from wcd.key import WeightCacheKey
from wcd.manifest import MAX_NAME_LEN, MAX_NDIM, MAX_TENSORS

PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS = (1,)
MAX_FRAME_BYTES = 32 * 1024 * 1024
MAX_FDS_PER_FRAME = 16
MAX_LEASES_PER_HEARTBEAT = 4096
_LEN = struct.Struct(">I")

Name = Annotated[str, StringConstraints(min_length=1, max_length=256)]
Retention = Literal["pinned", "cached", "ephemeral"]


def fds_from_ancillary(ancdata: list[tuple[int, int, bytes]]) -> list[int]:
    """The file descriptors in recvmsg()'s ancillary data (SCM_RIGHTS), in order."""
    fds: list[int] = []
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            a = array.array("i")
            a.frombytes(data[: len(data) - len(data) % a.itemsize])
            fds.extend(a)
    return fds


def encode(message: dict[str, Any], nfds: int = 0) -> bytes:
    """One frame. `nfds` announces fds that the I/O layer sends with this frame's first byte."""
    if nfds:
        message = {**message, "nfds": nfds}
    body = msgpack.packb(message, use_bin_type=True)
    if len(body) > MAX_FRAME_BYTES:
        raise BadRequest(f"message of {len(body)} bytes exceeds the {MAX_FRAME_BYTES}-byte frame limit")
    return _LEN.pack(len(body)) + body


class FrameDecoder:
    """Bytes and fds in, (message, fds) out. Raises `ProtocolError` on any malformed input.

    After a `ProtocolError` the stream cannot be trusted: the caller closes the connection and
    the fds returned by `take_fds()`.
    """

    def __init__(self, max_frame: int = MAX_FRAME_BYTES) -> None:
        self._buf = bytearray()
        self._fds: deque[int] = deque()
        self._max_frame = max_frame

    def feed(self, data: bytes, fds: Sequence[int] = ()) -> None:
        self._buf += data
        self._fds.extend(fds)
        if len(self._fds) > 4 * MAX_FDS_PER_FRAME:
            raise ProtocolError(f"more than {4 * MAX_FDS_PER_FRAME} unclaimed file descriptors")

    def next_message(self) -> tuple[dict[str, Any], list[int]] | None:
        """The next complete message and the fds it announced, or None if more bytes are needed."""
        if len(self._buf) < 4:
            return None
        (n,) = _LEN.unpack_from(self._buf)
        if n > self._max_frame:
            raise ProtocolError(f"frame of {n} bytes exceeds the {self._max_frame}-byte limit")
        if len(self._buf) < 4 + n:
            return None
        body = bytes(self._buf[4 : 4 + n])
        del self._buf[: 4 + n]
        try:
            msg = msgpack.unpackb(
                body, raw=False, strict_map_key=True, max_array_len=MAX_TENSORS + 1, max_map_len=4096,
            )
        except Exception as e:  # msgpack raises several unrelated types for corrupt input
            raise ProtocolError(f"frame is not valid msgpack ({type(e).__name__})") from None
        if not isinstance(msg, dict):
            raise ProtocolError("frame is not a msgpack map")
        nfds = msg.pop("nfds", 0)
        if type(nfds) is not int or not 0 <= nfds <= MAX_FDS_PER_FRAME:
            raise ProtocolError(f"bad nfds {nfds!r}")
        if nfds > len(self._fds):
            raise ProtocolError(f"frame announces {nfds} file descriptors but {len(self._fds)} arrived")
        return msg, [self._fds.popleft() for _ in range(nfds)]

    def take_fds(self) -> list[int]:
        """Fds received but not claimed by any frame; the caller must close them."""
        fds = list(self._fds)
        self._fds.clear()
        return fds

    @property
    def buffered(self) -> int:
        return len(self._buf)


# ---------------------------------------------------------------------------------------------
# Requests. Every field is bounded; unknown fields are refused so typos fail loudly.


class _Req(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    id: Annotated[StrictInt, Field(ge=0, lt=1 << 63)]


class Hello(_Req):
    op: Literal["hello"]
    versions: Annotated[list[StrictInt], Field(min_length=1, max_length=16)]
    client: Annotated[str, StringConstraints(max_length=256)] = ""


class Ping(_Req):
    op: Literal["ping"]


class Status(_Req):
    op: Literal["status"]


class ListEntries(_Req):
    op: Literal["list"]


class Leases(_Req):
    op: Literal["leases"]


class _Target(_Req):
    """An entry named either by its unique entry name or by its full key."""

    name: Name | None = None
    key: WeightCacheKey | None = None

    def target(self) -> str | WeightCacheKey:
        if (self.name is None) == (self.key is None):
            raise BadRequest("give exactly one of 'name' or 'key'")
        return self.name if self.name is not None else self.key  # type: ignore[return-value]


class Acquire(_Target):
    op: Literal["acquire"]
    wait: StrictBool = True
    timeout_s: Annotated[float, Field(gt=0, le=24 * 3600)] = 3600.0


class Heartbeat(_Req):
    op: Literal["heartbeat"]
    leases: Annotated[list[StrictInt], Field(max_length=MAX_LEASES_PER_HEARTBEAT)]


class Release(_Req):
    op: Literal["release"]
    lease: StrictInt


TensorRow = tuple[
    Annotated[str, StringConstraints(min_length=1, max_length=MAX_NAME_LEN)],
    Annotated[str, StringConstraints(max_length=16)],
    Annotated[list[StrictInt], Field(max_length=MAX_NDIM)],
]


class Reserve(_Req):
    op: Literal["reserve"]
    key: WeightCacheKey
    tensors: Annotated[list[TensorRow], Field(max_length=MAX_TENSORS)]
    retention: Retention = "cached"


class Commit(_Req):
    op: Literal["commit"]
    lease: StrictInt


class Abort(_Req):
    op: Literal["abort"]
    lease: StrictInt


class Load(_Req):
    op: Literal["load"]
    name: Name
    path: Annotated[str, StringConstraints(min_length=1, max_length=4096)] | None = None
    device: Annotated[str, StringConstraints(max_length=256)] | None = None
    retention: Retention | None = None
    wait: StrictBool = False


class Evict(_Target):
    op: Literal["evict"]


class Verify(_Target):
    op: Literal["verify"]


class Metrics(_Req):
    op: Literal["metrics"]


_REQUESTS = (Hello, Ping, Status, ListEntries, Leases, Acquire, Heartbeat, Release, Reserve, Commit,
             Abort, Load, Evict, Verify, Metrics)
Request = Annotated[Union[_REQUESTS], Field(discriminator="op")]  # type: ignore[valid-type]
_REQUEST: TypeAdapter[Any] = TypeAdapter(Request)
OPS: tuple[str, ...] = tuple(m.model_fields["op"].annotation.__args__[0] for m in _REQUESTS)  # type: ignore[union-attr]


def parse_request(message: dict[str, Any]) -> Any:
    """Validate one decoded request. Raises `BadRequest` with a one-line reason."""
    op = message.get("op")
    if op not in OPS:
        raise BadRequest(f"unknown op {op!r:.40}; known ops: {', '.join(OPS)}")
    try:
        return _REQUEST.validate_python(message)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"][1:]) or "request"
        raise BadRequest(f"{op}: {where}: {err['msg']}") from None


def ok(req_id: int, **body: Any) -> dict[str, Any]:
    return {"id": req_id, "ok": True, **body}


def error(req_id: int | None, err: Any) -> dict[str, Any]:
    return {"id": req_id, "ok": False, "error": err.to_wire()}
