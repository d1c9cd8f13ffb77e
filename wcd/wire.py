"""The wire: sans-IO framing, protocol versions and reply envelopes. No sockets, no pydantic.

A frame is a 4-byte big-endian length followed by one msgpack map. File descriptors travel as
SCM_RIGHTS ancillary data sent with the first byte of the frame that announces them in its
`nfds` field; the I/O layer hands received fds to `FrameDecoder.feed` and the decoder pairs
them with the frame that claims them. Never pickle. This is all a client needs to talk to the
daemon (validating requests is the daemon's job: `wcd.protocol` holds the request schemas), so
it must stay cheap to import: an engine pays for it on its start-up clock.
"""

from __future__ import annotations

import array
import socket
import struct
from collections import deque
from collections.abc import Sequence
from typing import Any, Literal

import msgpack

from wcd.errors import BadRequest, ProtocolError

# Version 2: manifests travel as columns (`Manifest.to_wire`). Version 1's rows (one msgpack array
# per tensor) never shipped in a release and are not spoken.
PROTOCOL_VERSION = 2
SUPPORTED_VERSIONS = (2,)
MAX_FRAME_BYTES = 32 * 1024 * 1024
MAX_FDS_PER_FRAME = 16
MAX_LEASES_PER_HEARTBEAT = 4096
# The longest array a request holds (a heartbeat's lease ids): the decoder refuses a longer one
# before building it, so a frame of 10^5 small arrays costs the loop a refusal, not a parse.
MAX_REQUEST_ARRAY = MAX_LEASES_PER_HEARTBEAT
# The longest array a reply holds (`list`'s entries, up to the daemon's max_entries).
MAX_REPLY_ARRAY = 1 << 20
# What becomes of an entry nobody leases: kept (`pinned`), kept until memory is needed (`cached`),
# or dropped with its last lease (`ephemeral`). Requests, the cache and the config share this one.
Retention = Literal["pinned", "cached", "ephemeral"]
_LEN = struct.Struct(">I")


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

    def __init__(self, max_frame: int = MAX_FRAME_BYTES, max_array: int = MAX_REQUEST_ARRAY) -> None:
        """`max_array`: the longest msgpack array a frame may hold (requests by default; a client
        reading replies gives `MAX_REPLY_ARRAY`)."""
        self._buf = bytearray()
        self._fds: deque[int] = deque()
        self._max_frame = max_frame
        self._max_array = max_array

    def feed(self, data: bytes, fds: Sequence[int] = ()) -> None:
        self._buf += data
        self._fds.extend(fds)
        if len(self._fds) > 4 * MAX_FDS_PER_FRAME:
            raise ProtocolError(f"more than {4 * MAX_FDS_PER_FRAME} unclaimed file descriptors")

    def has_frame(self) -> bool:
        """Whether `next_message` has more than None to give: a whole frame, or a length past the
        limit (its error). Bytes of a frame still arriving are not one."""
        if len(self._buf) < 4:
            return False
        (n,) = _LEN.unpack_from(self._buf)
        return n > self._max_frame or len(self._buf) >= 4 + n

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
                body, raw=False, strict_map_key=True, max_array_len=self._max_array, max_map_len=4096,
            )
        except ValueError as e:
            if "exceeds max_array_len" not in str(e):
                raise ProtocolError(f"frame is not valid msgpack ({type(e).__name__})") from None
            raise ProtocolError(f"frame holds an array longer than {self._max_array} items (protocol v1 rows "
                                "are not spoken: upgrade the client)") from None
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


def ok(req_id: int, **body: Any) -> dict[str, Any]:
    return {"id": req_id, "ok": True, **body}


def error(req_id: int | None, err: Any) -> dict[str, Any]:
    return {"id": req_id, "ok": False, "error": err.to_wire()}
