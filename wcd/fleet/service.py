"""The fleet in the daemon (DESIGN §12): serve offered entries to peers, and fill new entries from
them before the disk. Made by the server only when the config has `[fleet]`.

Serving: a peer proves the shared secret (`wcd.fleet.channel`) and asks `want` for a key, every
field but the device (a fingerprint, or none when it has no checkpoint of its own). Only a ready
entry of an offered device is served, published ones only with `offer_published`; while a peer
reads it the daemon holds a lease on it (so it is not reclaimed under the transfer) and counts its
bytes against the device's `offer` size. The arena is registered with NIXL once, in the export
helper, and stays registered until the entry goes (`forget`). The reply carries the helper's
agent metadata, the region, and the arena's content digest (`verify`'s), over the channel.

Filling: `fill` asks each peer in turn; the fetch helper reads the region into the new arena, the
daemon hashes what arrived and compares it with the digest the peer sent; only then is the arena
sealed. Any failure (no answer, a refusal, a dead or hung helper, a deadline, other bytes) closes
that arena and allocates a fresh one for the next peer or the disk: nothing partial is kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from wcd.arenas import Arena
from wcd.config import FleetConfig, parse_host_port
from wcd.entry import Entry
from wcd.errors import BadRequest, LoadFailed, WcdError
from wcd.fleet.channel import Channel, ChannelError, accept, connect
from wcd.fleet.helpers import Helper, HelperFailed
from wcd.key import WeightCacheKey
from wcd.loader import content_digest, digest_arena
from wcd.manifest import Manifest
from wcd.offloop import close_later, using
from wcd.units import format_size

if TYPE_CHECKING:
    from wcd.residency import Residency

log = logging.getLogger("wcd")
IDLE_S = 600.0  # a peer's control connection with nothing asked is closed after this
KEY_FIELDS = ("model", "path", "fingerprint", "dtype", "transform", "shard", "extra")
REFUSAL_LOG_EVERY_S = 60.0


class PeerRefused(WcdError):
    code = "peer_failed"


@dataclass
class _Export:
    xid: int
    generation: int  # the export helper's: a new helper has none of the old one's registrations
    addr: int
    metadata: bytes  # the helper's agent metadata once this was registered


def _want_fields(key: WeightCacheKey, with_fingerprint: bool = True) -> dict[str, Any]:
    fields = key.model_dump()
    out = {k: fields[k] for k in KEY_FIELDS if k in fields}
    if not with_fingerprint:
        out.pop("fingerprint", None)
    return out


def _ensure(helper: Helper) -> Callable[[dict[str, Any]], Any]:
    return lambda _: helper.ensure()


class Fleet:
    def __init__(self, config: FleetConfig, residency: Residency) -> None:
        self.config = config
        self.secret = config.read_secret(os.getuid())
        self.residency = residency
        self.cache = residency.cache
        env = dict(config.ucx)
        self.exporter, self.fetcher = Helper("export", env), Helper("fetch", env)
        self._fetching = asyncio.Lock()  # one fetch at a time: the helper answers one request at a time
        self._exports: dict[Entry, _Export] = {}
        self._ids = itertools.count(1)
        self._sending: dict[str, int] = {}  # device -> bytes peers are reading now
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[asyncio.StreamWriter] = set()
        self._peers: dict[str, Channel] = {}
        self._refused_logged: dict[str, float] = {}
        self._tasks: set[asyncio.Future[Any]] = set()
        self.stats = {"served": 0, "served_bytes": 0, "refused_peers": 0, "fills": 0, "fill_failures": 0,
                      "wrong_bytes": 0}

    async def start(self) -> None:
        host, port = parse_host_port(self.config.listen)
        self._server = await asyncio.start_server(self._serve, host, port, reuse_address=True)
        for helper in (self.exporter, self.fetcher):  # started now (importing NIXL), not on a first request
            self._background(_ensure(helper), {})
        log.info("fleet: listening on %s for peers; %d peer%s to fill from", self.config.listen,
                 len(self.config.peers), "" if len(self.config.peers) == 1 else "s")

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._connections):
            writer.close()
        for channel in self._peers.values():
            channel.close()
        await asyncio.gather(asyncio.to_thread(self.exporter.close), asyncio.to_thread(self.fetcher.close))

    def describe(self) -> dict[str, Any]:
        """For status: what this daemon offers and whom it asks."""
        return {"listen": self.config.listen, "peers": list(self.config.peers), "offer": dict(self.config.offer),
                "exported": len(self._exports), **self.stats}

    # -- serving peers ----------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peername = writer.get_extra_info("peername")
        peer = f"{peername[0]}:{peername[1]}" if isinstance(peername, tuple) else str(peername)
        if len(self._connections) >= self.config.max_connections:
            writer.close()
            return
        self._connections.add(writer)
        holds: dict[int, tuple[Entry, object, int]] = {}
        try:
            try:
                channel = await accept(reader, writer, self.secret, self.config.connect_timeout_s, peer)
            except (ChannelError, ConnectionError, OSError) as e:
                self.stats["refused_peers"] += 1
                self._log_refusal(peer, getattr(e, "message", str(e)))
                return
            while True:
                try:
                    msg = await channel.recv(IDLE_S)
                except ChannelError:
                    return
                op = msg.get("op")
                if op == "want":
                    reply = await self._want(msg, holds)
                elif op == "done":
                    self._release(holds, msg.get("xfer"))
                    continue
                else:
                    reply = {"ok": False, "error": f"unknown op {op!r}"}
                await channel.send(reply)
        except (ConnectionError, OSError):
            return
        finally:
            for xfer in list(holds):
                self._release(holds, xfer)
            self._connections.discard(writer)
            writer.close()

    def _log_refusal(self, peer: str, why: str) -> None:
        host = peer.rpartition(":")[0]
        now = time.monotonic()
        if now - self._refused_logged.get(host, -math.inf) >= REFUSAL_LOG_EVERY_S:
            self._refused_logged[host] = now
            log.warning("fleet: %s (more from %s are not logged for %g s)", why, host, REFUSAL_LOG_EVERY_S)

    def _offered(self, msg: dict[str, Any]) -> Entry | None:
        want = {k: msg[k] for k in KEY_FIELDS if k in msg}  # all of them, or model and path (no checkpoint here)
        if not {"model", "path"} <= want.keys():
            return None
        for entry in self.cache.entries.values():
            if entry.state != "ready" or entry.arena is None or getattr(entry.arena, "kind", "") != "host":
                continue
            if not self.config.offered_bytes(entry.device):
                continue
            if entry.origin == "publish" and not self.config.offer_published:
                continue
            have = _want_fields(entry.key)
            if all(have.get(k) == v for k, v in want.items()):
                return entry
        return None

    async def _want(self, msg: dict[str, Any], holds: dict[int, tuple[Entry, object, int]]) -> dict[str, Any]:
        entry = self._offered(msg)
        if entry is None:
            return {"ok": False, "error": "not_found"}
        arena: Arena = entry.arena
        size = arena.size
        device = entry.device
        if self._sending.get(device, 0) + size > self.config.offered_bytes(device):
            return {"ok": False, "error": f"busy: {format_size(self._sending.get(device, 0))} of {device} is being "
                                          f"sent already (offer {self.config.offer[device]})"}
        holder = object()
        lease = self.cache.acquire(entry, holder, os.getpid(), os.getuid(), ttl_s=math.inf)
        self._sending[device] = self._sending.get(device, 0) + size
        xfer = next(self._ids)
        holds[xfer] = (entry, holder, lease.id)
        try:
            digest = await self.residency.content_digest(entry)
            export = await self._export(entry)
            wire = await asyncio.to_thread(entry.manifest.wire) if msg.get("manifest") else None
        except (WcdError, OSError) as e:
            self._release(holds, xfer)
            return {"ok": False, "error": getattr(e, "message", str(e))}
        try:
            await asyncio.to_thread(self.exporter.call, {"op": "serve", "id": xfer,
                                                         "deadline_s": self.config.fetch_timeout_s})
        except WcdError as e:
            self._release(holds, xfer)
            return {"ok": False, "error": e.message}
        self.stats["served"] += 1
        self.stats["served_bytes"] += size
        return {"ok": True, "xfer": xfer, "md": export.metadata, "addr": export.addr, "size": size,
                "digest": digest, "key": _want_fields(entry.key), "retention": entry.retention,
                **({"manifest": wire} if wire is not None else {})}

    async def _export(self, entry: Entry) -> _Export:
        """The entry's registration in the export helper: made once, kept while the entry lives."""
        generation = await asyncio.to_thread(self.exporter.ensure)
        known = self._exports.get(entry)
        if known is not None and known.generation == generation:
            return known
        xid = next(self._ids)

        def export(arena: Arena) -> dict[str, Any]:
            return self.exporter.call({"op": "export", "id": xid, "size": arena.size}, [arena.fd()])

        reply = await using(None, entry.arena, export)
        if "error" in reply:
            raise PeerRefused(f"exporting {entry.name}: {reply['error']}")
        got = self._exports[entry] = _Export(xid, self.exporter.generation, int(reply["addr"]), bytes(reply["md"]))
        return got

    def _release(self, holds: dict[int, tuple[Entry, object, int]], xfer: object) -> None:
        held = holds.pop(xfer, None) if isinstance(xfer, int) else None
        if held is None:
            return
        entry, holder, lease_id = held
        self._background(self.exporter.call, {"op": "end", "id": xfer})
        self._sending[entry.device] -= entry.arena.size if entry.arena is not None else entry.nbytes
        dropped = self.cache.release(holder, lease_id)
        self.residency.reclaim(dropped, "its last lease ended (a peer's read of it)")

    def forget(self, entry: Entry) -> None:
        """The entry is gone: its registration too (its memory returns once the helper unmaps it)."""
        export = self._exports.pop(entry, None)
        if export is not None and export.generation == self.exporter.generation:
            self._background(self.exporter.call, {"op": "unexport", "id": export.xid})

    def _background(self, call: Callable[[dict[str, Any]], Any], request: dict[str, Any]) -> None:
        """A helper call nobody waits for (its failure: the helper is killed and restarted anyway)."""
        task = asyncio.ensure_future(asyncio.to_thread(call, request))
        self._tasks.add(task)

        def done(t: asyncio.Future[Any]) -> None:
            self._tasks.discard(t)
            if not t.cancelled():
                t.exception()  # retrieved: a failed call was the helper's, said where it failed

        task.add_done_callback(done)

    # -- filling from peers -----------------------------------------------------------------

    async def _channel(self, peer: str) -> Channel:
        channel = self._peers.get(peer)
        if channel is None or channel.closed:
            host, port = parse_host_port(peer)
            channel = self._peers[peer] = await connect(host, port, self.secret, self.config.connect_timeout_s)
        return channel

    async def _ask(self, peer: str, request: dict[str, Any]) -> tuple[Channel, dict[str, Any]]:
        channel = await self._channel(peer)
        try:
            reply = await channel.request(request, self.config.fetch_timeout_s)
        except ChannelError:
            channel.close()
            raise
        return channel, reply

    async def describe_remote(self, name: str, path: str) -> tuple[dict[str, Any], Manifest, str]:
        """For an entry whose checkpoint is not on this host: a peer's key fields and layout for
        `name` at `path` (checked in bulk like any untrusted layout), and which peer said so."""
        for peer in self.config.peers:
            try:
                channel, reply = await self._ask(peer, {"op": "want", "model": name, "path": path, "manifest": True})
                if reply.get("ok"):
                    await channel.send({"op": "done", "xfer": reply.get("xfer")})
                    key, wire = reply.get("key"), reply.get("manifest")
                    if not isinstance(key, dict) or key.get("model") != name or key.get("path") != path:
                        raise PeerRefused(f"peer {peer} answered for another key")
                    return key, await asyncio.to_thread(Manifest.from_wire, wire), peer
                log.info("fleet: peer %s does not serve %s (%s)", peer, name, reply.get("error"))
            except (WcdError, BadRequest) as e:
                log.warning("fleet: asking peer %s for %s: %s", peer, name, e.message)
        raise LoadFailed(f"{path}: not on this host, and no peer ({', '.join(self.config.peers) or 'none configured'}) "
                         f"holds {name} ready; put the checkpoint there or load it on a peer")

    async def fill(self, entry: Entry, create: Callable[[], Awaitable[Arena]]) -> bool:
        """Fill `entry.arena` from the first peer that serves exactly its key, checked and sealed;
        False if none did (then `entry.arena` is a fresh, empty one for the disk)."""
        want = {"op": "want", **_want_fields(entry.key)}
        for peer in self.config.peers:
            try:
                channel, reply = await self._ask(peer, want)
            except WcdError as e:
                log.warning("fleet: peer %s cannot be asked for %s: %s", peer, entry.name, e.message)
                continue
            if not reply.get("ok"):
                log.info("fleet: peer %s does not serve %s (%s)", peer, entry.name, reply.get("error"))
                continue
            try:
                await self._read(entry, peer, reply)
                return True
            except WcdError as e:
                self.stats["fill_failures"] += 1
                log.warning("fleet: filling %s from peer %s failed: %s; %s", entry.name, peer, e.message,
                            "trying the next peer" if peer != self.config.peers[-1] else "reading the disk")
                old, entry.arena = entry.arena, None
                close_later(old)
                entry.done_bytes = 0
                entry.arena = await create()
            finally:
                with contextlib.suppress(WcdError, ConnectionError, OSError):
                    await channel.send({"op": "done", "xfer": reply.get("xfer")})
        return False

    async def _read(self, entry: Entry, peer: str, reply: dict[str, Any]) -> None:
        arena: Arena = entry.arena
        key, digest = reply.get("key"), reply.get("digest")
        if key != _want_fields(entry.key):
            raise PeerRefused(f"it answered for another key ({key!r:.200})")
        if reply.get("size") != arena.size or not isinstance(digest, str):
            raise PeerRefused(f"its arena is {reply.get('size')} bytes, this one {arena.size}")
        md, addr = reply.get("md"), reply.get("addr")
        if not isinstance(md, bytes) or not isinstance(addr, int) or not 0 < addr < 1 << 64:
            raise PeerRefused("its answer lacks the region to read")
        entry.load_phase = f"reading from peer {peer}"
        request = {"op": "fetch", "size": arena.size, "md": md, "addr": addr,
                   "deadline_s": self.config.fetch_timeout_s}
        started = time.monotonic()
        async with self._fetching:
            got = await using(None, arena, lambda a: self.fetcher.call(request, [a.fd()],
                                                                        self.config.fetch_timeout_s + 10))
        if "error" in got:
            raise HelperFailed(str(got["error"]))
        seconds = time.monotonic() - started
        entry.done_bytes = entry.manifest.nbytes
        entry.load_phase = "checking the bytes from the peer"
        manifest = entry.manifest
        resident = await using(None, arena, lambda a: content_digest(digest_arena(a, manifest)))
        if resident != digest:
            self.stats["wrong_bytes"] += 1
            raise PeerRefused(f"its bytes do not match the digest it sent ({resident[:16]}... arrived, "
                              f"{digest[:16]}... announced): refused")
        await using(None, arena, lambda a: a.seal())
        self.stats["fills"] += 1
        entry.source, entry.fill_rate = f"peer {peer}", arena.size / max(seconds, 1e-9)
        log.info("fleet: %s read from peer %s: %s in %.2f s (%.2f GB/s), digest checked", entry.name, peer,
                 format_size(arena.size), seconds, arena.size / max(seconds, 1e-9) / 1e9)
