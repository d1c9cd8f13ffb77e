"""The fleet's control channel: msgpack frames over TCP, authenticated both ways by a shared secret.

Handshake (DESIGN §12): the acceptor sends a fresh nonce; the connector answers with its own and
HMAC-SHA256(secret, "client" | acceptor nonce | connector nonce); the acceptor checks it before it
parses anything else and proves itself the same way ("server" | connector nonce | acceptor nonce).
Every later frame carries HMAC(session key, direction | sequence number | body), the session key
derived from the secret and both nonces: a frame changed, replayed, reordered or injected on the
way is refused and the channel closed. Nothing is encrypted: weights and the agents' metadata
travel in the clear, so the network between peers must be one the operator trusts to read them.

A frame is a 4-byte big-endian length, the msgpack body and its 32-byte tag. Before the
handshake ends, frames are at most HANDSHAKE_BYTES long, so a peer without the secret costs a
read of a few hundred bytes and one HMAC, within `timeout` seconds; after it, at most MAX_FRAME.
Never pickle: bodies are msgpack maps of plain values (no extension types).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import struct
from typing import Any

import msgpack

from wcd.errors import WcdError

NONCE_BYTES = 32
TAG_BYTES = 32
HANDSHAKE_BYTES = 256
MAX_FRAME = 64 << 20  # a manifest of 10^5 tensors in columns is a few MB
_LEN = struct.Struct(">I")
_SEQ = struct.Struct(">Q")


class ChannelError(WcdError):
    """The peer failed the handshake, sent a frame that is not authentic, or went away."""

    code = "peer_failed"


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def _unpack(body: bytes) -> dict[str, Any]:
    try:
        message = msgpack.unpackb(body, raw=False, strict_map_key=True, max_ext_len=0)
    except Exception as e:  # noqa: BLE001 - any malformed body is the same refusal
        raise ChannelError(f"a frame that is not msgpack ({type(e).__name__})") from None
    if not isinstance(message, dict):
        raise ChannelError("a frame that is not a msgpack map")
    return message


class Channel:
    """One authenticated connection: `send` and `recv` whole messages (one sender and one
    receiver at a time each; a request/response user holds `lock` around the pair)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, key: bytes,
                 connector: bool, peer: str) -> None:
        self._reader, self._writer, self._key = reader, writer, key
        self._out, self._in = (b"C", b"S") if connector else (b"S", b"C")
        self._sent = self._received = 0
        self.peer = peer
        self.lock = asyncio.Lock()

    async def send(self, message: dict[str, Any]) -> None:
        body = msgpack.packb(message, use_bin_type=True)
        tag = _mac(self._key, self._out, _SEQ.pack(self._sent), body)
        self._sent += 1
        self._writer.write(_LEN.pack(len(body) + TAG_BYTES) + body + tag)
        await self._writer.drain()

    async def recv(self, timeout: float | None = None) -> dict[str, Any]:
        body = await _read_frame(self._reader, MAX_FRAME, timeout, self.peer)
        body, tag = body[:-TAG_BYTES], body[-TAG_BYTES:]
        if not hmac.compare_digest(tag, _mac(self._key, self._in, _SEQ.pack(self._received), body)):
            raise ChannelError(f"peer {self.peer}: a frame failed its authentication tag (changed on the way, "
                               "or not from the peer); channel closed")
        self._received += 1
        return _unpack(body)

    async def request(self, message: dict[str, Any], timeout: float) -> dict[str, Any]:
        async with self.lock:
            await self.send(message)
            return await self.recv(timeout)

    def close(self) -> None:
        self._writer.close()

    @property
    def closed(self) -> bool:
        return self._writer.is_closing()


async def _read_frame(reader: asyncio.StreamReader, limit: int, timeout: float | None, peer: str) -> bytes:
    try:
        head = await asyncio.wait_for(reader.readexactly(_LEN.size), timeout)
        (n,) = _LEN.unpack(head)
        if not TAG_BYTES <= n <= limit:
            raise ChannelError(f"peer {peer}: a frame of {n} bytes (at most {limit} allowed here)")
        return await asyncio.wait_for(reader.readexactly(n), timeout)
    except asyncio.TimeoutError:
        raise ChannelError(f"peer {peer}: no whole frame within {timeout:g} s") from None
    except (asyncio.IncompleteReadError, ConnectionError, OSError):
        raise ChannelError(f"peer {peer}: the connection closed") from None


def _plain(message: dict[str, Any]) -> bytes:
    body = msgpack.packb(message, use_bin_type=True)
    return _LEN.pack(len(body) + TAG_BYTES) + body + bytes(TAG_BYTES)


async def _read_plain(reader: asyncio.StreamReader, timeout: float, peer: str) -> dict[str, Any]:
    return _unpack((await _read_frame(reader, HANDSHAKE_BYTES, timeout, peer))[:-TAG_BYTES])


def _nonce(message: dict[str, Any], field: str, peer: str) -> bytes:
    value = message.get(field)
    if not isinstance(value, bytes) or len(value) != NONCE_BYTES:
        raise ChannelError(f"peer {peer}: a handshake without its {field}")
    return value


async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: bytes, timeout: float,
                 peer: str) -> Channel:
    """The acceptor's half of the handshake; `ChannelError` if the peer does not prove the secret."""
    mine = os.urandom(NONCE_BYTES)
    writer.write(_plain({"wcd_fleet": 1, "nonce": mine}))
    await writer.drain()
    hello = await _read_plain(reader, timeout, peer)
    theirs = _nonce(hello, "nonce", peer)
    proof = hello.get("mac")
    if not isinstance(proof, bytes) or not hmac.compare_digest(proof, _mac(secret, b"client", mine, theirs)):
        raise ChannelError(f"peer {peer} does not know the fleet's shared secret: refused")
    writer.write(_plain({"mac": _mac(secret, b"server", theirs, mine)}))
    await writer.drain()
    return Channel(reader, writer, _mac(secret, b"session", mine, theirs), connector=False, peer=peer)


async def connect(host: str, port: int, secret: bytes, timeout: float) -> Channel:
    """Connect to a peer and prove the secret both ways; `ChannelError` (one line) otherwise."""
    peer = f"{host}:{port}"
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except asyncio.TimeoutError:
        raise ChannelError(f"peer {peer}: no connection within {timeout:g} s") from None
    except OSError as e:
        raise ChannelError(f"peer {peer}: cannot connect ({e.strerror or e})") from None
    try:
        hello = await _read_plain(reader, timeout, peer)
        theirs = _nonce(hello, "nonce", peer)
        mine = os.urandom(NONCE_BYTES)
        writer.write(_plain({"nonce": mine, "mac": _mac(secret, b"client", theirs, mine)}))
        await writer.drain()
        answer = await _read_plain(reader, timeout, peer)
        proof = answer.get("mac")
        if not isinstance(proof, bytes) or not hmac.compare_digest(proof, _mac(secret, b"server", mine, theirs)):
            raise ChannelError(f"peer {peer} did not prove the fleet's shared secret: not trusted")
    except BaseException:
        writer.close()
        raise
    return Channel(reader, writer, _mac(secret, b"session", theirs, mine), connector=True, peer=peer)
