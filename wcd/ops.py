"""The request handlers, one small function per op, and `OPS`, the table that maps op names to schema + handler.

`dispatch` validates a decoded message (`protocol.parse_request`), enforces hello-first and the
per-connection limit on requests in flight, runs the handler and turns its failure into an error
reply. Handlers take cache decisions from `wcd.cache` and leave every arena operation to
`wcd.residency`: they must not do arena I/O themselves, nor touch sockets beyond `Connection.send`.
Roles (DESIGN §10) are checked here: readers read, publishers publish entries that carry their
uid (never as a raw checkpoint), admins (`DaemonConfig.is_admin`) load, evict others' entries, pin.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import os
import re
import time
import weakref
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from wcd import __version__, protocol
from wcd.arenas import backend_for
from wcd.cache import Cache, Entry, LeaseRecord
from wcd.connection import Connection
from wcd.errors import (
    BadRequest,
    Busy,
    Internal,
    KeyMismatch,
    NotFound,
    PermissionDenied,
    UnsupportedVersion,
    WcdError,
)
from wcd.key import HOST_DEVICE, WeightCacheKey
from wcd.manifest import Manifest
from wcd.metrics import Metrics
from wcd.peers import peer_gids
from wcd.residency import Residency, ended
from wcd.state import ServerState
from wcd.units import format_size

log = logging.getLogger("wcd")

MAX_INFLIGHT = 64  # concurrent slow requests (acquire, load, ...) per connection
RAW = "raw"  # the transform of checkpoints as the daemon loads them; never published
_CONTROL_CHAR = re.compile(r"[\x00-\x1f\x7f]")


@dataclass(frozen=True)
class Context:
    """What a handler works with."""

    state: ServerState
    residency: Residency
    metrics: Metrics
    # A peer's groups, looked up (NSS) once per connection and only when admin_groups asks.
    peer_groups: weakref.WeakKeyDictionary[Connection, set[int]] = field(default_factory=weakref.WeakKeyDictionary)
    verifying: Counter[int] = field(default_factory=Counter)  # verify requests in flight per uid

    def is_admin(self, conn: Connection) -> bool:
        daemon = self.state.config.daemon
        if daemon.is_admin(conn.uid, (), os.getuid()):
            return True
        if not daemon.admin_groups:
            return False
        gids = self.peer_groups.get(conn)
        if gids is None:
            gids = self.peer_groups[conn] = peer_gids(conn.uid, conn.gid)
        return daemon.is_admin(conn.uid, gids, os.getuid())

    def publishers(self, conn: Connection) -> tuple[int, ...]:
        """Whose entries a lookup by key from `conn` takes, in order: its own uid's, the daemon's
        (its loads), then the `trusted_publishers`' (DESIGN §10)."""
        return (conn.uid, os.getuid(), *self.state.config.daemon.trusted_publishers)

    def require_admin(self, conn: Connection, what: str) -> None:
        if not self.is_admin(conn):
            raise PermissionDenied(
                f"{what} needs an admin: uid {conn.uid} is not root, the daemon's user, in admin_uids or in a "
                "group of admin_groups (the daemon's config)", {"uid": conn.uid})


# -- answered at once, on the loop ----------------------------------------------------------


def hello(ctx: Context, conn: Connection, req: protocol.Hello) -> None:
    common = sorted(set(req.versions) & set(protocol.SUPPORTED_VERSIONS))
    if not common:
        raise UnsupportedVersion(
            f"client speaks protocol {req.versions}, daemon speaks {list(protocol.SUPPORTED_VERSIONS)}: "
            "upgrade the older side")
    conn.hello, conn.client, conn.version = True, req.client, common[-1]
    gpus = any(d != HOST_DEVICE for d in ctx.state.cache.budgets)
    conn.send(protocol.ok(
        req.id, version=common[-1], server=f"wcd {__version__}", instance=ctx.state.instance,
        features=["host-arenas", "publish", "verify", "metrics", "generations"] + (["cuda-arenas"] if gpus else []),
        lease_ttl_s=ctx.state.config.daemon.lease_ttl_s, pid=os.getpid(), uid=os.getuid(),
        trusted_publishers=ctx.state.config.daemon.trusted_publishers,
        peer={"pid": conn.pid, "uid": conn.uid, "gid": conn.gid, "admin": ctx.is_admin(conn)}))


def ping(ctx: Context, conn: Connection, req: protocol.Ping) -> None:
    conn.send(protocol.ok(req.id))


def status(ctx: Context, conn: Connection, req: protocol.Status) -> None:
    state, cache = ctx.state, ctx.state.cache
    devices = []
    for device, budget in cache.budgets.items():
        info = backend_for(device).info(device)
        devices.append({"device": device, "name": info.name, "total": info.total, "free": info.free,
                        "budget": budget, "used": cache.used(device),
                        "mapped_after_release": cache.outside(device)})
    entries = _described(cache)
    conn.send(protocol.ok(
        req.id, version=__version__, instance=state.instance, pid=os.getpid(),
        uptime_s=time.time() - state.started_at, socket=state.where, lease_ttl_s=cache.lease_book.ttl_s,
        devices=devices, entries=entries, leases=len(cache.leases), connections=len(state.connections),
        loading=[e["name"] for e in entries if e["state"] == "loading"],
        failed=[e["name"] for e in entries if e["state"] == "failed"], counters=dict(cache.stats),
        series=_series(ctx),
        **({"fleet": ctx.residency.fleet.describe()} if ctx.residency.fleet is not None else {})))


def list_entries(ctx: Context, conn: Connection, req: protocol.ListEntries) -> None:
    conn.send(protocol.ok(req.id, entries=_described(ctx.state.cache), series=_series(ctx)))


def _described(cache: Cache) -> list[dict[str, Any]]:
    """Entries, then the loads that failed (state `failed`, with their reason)."""
    return [e.describe() for e in cache.entries.values()] + [f.describe() for f in cache.failures.values()]


def _series(ctx: Context) -> list[dict[str, Any]]:
    watchers = ctx.state.watchers
    return [{**s.describe(), "watchers": watchers.count(s.name)} for s in ctx.state.cache.series.values()]


def watch(ctx: Context, conn: Connection, req: protocol.Watch) -> None:
    """Watch a series (it need not exist yet: a trainer may publish its first generation later)."""
    if req.stop:
        ctx.state.watchers.remove(conn, req.series)
        conn.send(protocol.ok(req.id))
        return
    ctx.state.watchers.add(conn, req.series, ctx.state.config.daemon.max_watches_per_connection)
    series = ctx.state.cache.series.get(req.series)
    conn.send(protocol.ok(req.id, series=req.series, generation=series.current if series is not None else 0))


def rollback(ctx: Context, conn: Connection, req: protocol.Rollback) -> None:
    entry = ctx.residency.rollback(req.series, conn.uid, ctx.is_admin(conn), req.generation)
    log.info("rolled %s back to generation %d (uid %d)", req.series, entry.generation, conn.uid)
    told = _announce(ctx, entry, "rollback")
    conn.send(protocol.ok(req.id, series=req.series, generation=entry.generation, entry=entry.name, told=told))


def _announce(ctx: Context, entry: Entry, why: str) -> int:
    assert entry.series is not None
    return ctx.state.watchers.announce(entry.series.name, {"generation": entry.generation, "entry": entry.name,
                                                           "why": why})


def leases(ctx: Context, conn: Connection, req: protocol.Leases) -> None:
    """A page of leases (ids above `after`): every lease for admins; a peer's own (by uid) for the
    others, from the cache's index of them: pids and uids are not theirs to see. `next` is the
    cursor of the next page, None after the last."""
    cache = ctx.state.cache
    now = cache.clock()
    page, cursor = cache.lease_book.page(None if ctx.is_admin(conn) else conn.uid, req.after, req.limit)
    conn.send(protocol.ok(req.id, next=cursor, leases=[
        {"id": lease.id, "entry": lease.entry.name, "kind": lease.kind, "pid": lease.pid, "uid": lease.uid,
         "expires_in_s": round(lease.expires_at - now, 3) if math.isfinite(lease.expires_at) else None}
        for lease in page]))


def heartbeat(ctx: Context, conn: Connection, req: protocol.Heartbeat) -> None:
    conn.send(protocol.ok(req.id, lost=ctx.state.cache.lease_book.heartbeat(conn, req.leases)))


def release(ctx: Context, conn: Connection, req: protocol.Release) -> None:
    for entry in ctx.state.cache.release(conn, req.lease):
        ctx.residency.reclaim([entry], ended(entry, f"its last lease was released (pid {conn.pid}, uid {conn.uid})"))
    conn.send(protocol.ok(req.id))


def abort(ctx: Context, conn: Connection, req: protocol.Abort) -> None:
    ctx.residency.reclaim(ctx.state.cache.abort(conn, req.lease), f"its publish was aborted by uid {conn.uid}")
    conn.send(protocol.ok(req.id))


def evict(ctx: Context, conn: Connection, req: protocol.Evict) -> None:
    target = req.target()
    if isinstance(target, str) and target not in ctx.state.cache.entries and target in ctx.state.cache.failures:
        if not ctx.is_admin(conn):
            raise PermissionDenied(f"uid {conn.uid} may not evict {target!r}: only admins forget a failed load",
                                   {"entry": target, "uid": conn.uid})
        ctx.state.cache.forget_failure(target)
        log.info("%s: its failed load forgotten (evicted by uid %d)", target, conn.uid)
        conn.send(protocol.ok(req.id, entry=target, state="evicted", leases=0))
        return
    entry = ctx.state.cache.find(ctx.residency.resolve(target), ctx.publishers(conn))
    ctx.state.cache.check_evict(entry, conn.uid, ctx.is_admin(conn))
    dropped = ctx.residency.evict(entry, f"evicted by uid {conn.uid} (pid {conn.pid})")
    conn.send(protocol.ok(req.id, entry=entry.name, state="evicted" if dropped else entry.state,
                          leases=len(entry.leases)))


def metrics(ctx: Context, conn: Connection, req: protocol.MetricsRequest) -> Coroutine[Any, Any, None] | None:
    """At once, once prometheus-client is imported; before (the first second after READY, when
    `Server._warm_metrics` imports it) as a task that waits for the one import, in a thread, and
    gets the rendering it shares with every request that waited with it (`Metrics.text`)."""
    if ctx.metrics.warmed:
        conn.send(protocol.ok(req.id, text=ctx.metrics.render()))
        return None
    return _metrics_later(ctx, conn, req)


async def _metrics_later(ctx: Context, conn: Connection, req: protocol.MetricsRequest) -> None:
    conn.send(protocol.ok(req.id, text=await ctx.metrics.text()))


# -- may wait (for a load, a thread, a digest): each runs as a task of its connection ---------


async def _find(ctx: Context, conn: Connection, target: str | WeightCacheKey, wait: bool, deadline: float) -> Entry:
    """`cache.find`; a name whose configured model is being admitted (after a reload, or once the
    leases of the entry a reload changed end) is waited for when the client waits."""
    try:
        return ctx.state.cache.find(target, ctx.publishers(conn))
    except NotFound:
        if not (wait and isinstance(target, str)
                and await ctx.residency.admission(target, max(0.0, deadline - time.monotonic()))):
            raise
    return ctx.state.cache.find(target, ctx.publishers(conn))


async def acquire(ctx: Context, conn: Connection, req: protocol.Acquire) -> None:
    series = req.series_target()
    if series is not None:  # a current generation is committed: ready, nothing to wait for
        entry = ctx.state.cache.current(series)
        await _wire_ready(ctx, conn, entry)
        conn.quotas.fd_room(conn)
        _send_lease(ctx, conn, req.id, ctx.state.cache.acquire(entry, conn, conn.pid, conn.uid))
        return
    target = ctx.residency.resolve(req.target())
    deadline = time.monotonic() + req.timeout_s
    entry = await _find(ctx, conn, target, req.wait, deadline)
    # Evicting but still loading (a reload changed it during its fill or check): wait for that to
    # end, as for a load; the model of the new config is then admitted under its name.
    while entry.state in ("loading", "filling") or ctx.residency.still_loading(entry):
        if not req.wait:
            raise Busy(f"entry {entry.name!r} is {entry.state}", {"state": entry.state})
        try:
            entry = await ctx.residency.wait_ready(entry, max(0.0, deadline - time.monotonic()))
        except NotFound:
            # An entry re-adopted after a restart that failed its check is loaded again from disk
            # under its name before its waiters wake: wait for that load, if it is what was asked for.
            current = ctx.state.cache.entries.get(entry.name)
            if current is entry or (current is None and not await ctx.residency.admission(
                    entry.name, max(0.0, deadline - time.monotonic()))):
                raise
            entry = ctx.state.cache.find(target, ctx.publishers(conn))
    if req.digest is not None:
        resident = await ctx.residency.content_digest(entry)
        if resident != req.digest:
            raise KeyMismatch(
                f"entry {entry.name!r} holds other bytes than the content digest asked for ({resident[:16]}... "
                f"resident, {req.digest[:16]}... asked): not attached", {"fields": ["digest"], "entry": entry.name,
                                                                         "resident": resident})
    if not entry.manifest.wire_ready():  # once per entry: 10^5 tensors take a while
        await asyncio.to_thread(entry.manifest.wire)
    if ctx.state.cache.entries.get(entry.name) is not entry:
        raise NotFound(f"entry {entry.name!r} was evicted while it was being acquired")
    conn.quotas.fd_room(conn)
    _send_lease(ctx, conn, req.id, ctx.state.cache.acquire(entry, conn, conn.pid, conn.uid))


async def _wire_ready(ctx: Context, conn: Connection, entry: Entry) -> None:
    """Build the manifest's wire form once per entry (10^5 tensors take a while)."""
    if not entry.manifest.wire_ready():
        await asyncio.to_thread(entry.manifest.wire)
        if ctx.state.cache.entries.get(entry.name) is not entry:
            raise NotFound(f"entry {entry.name!r} was evicted while it was being acquired")


async def reserve(ctx: Context, conn: Connection, req: protocol.Reserve) -> None:
    _check_publishable(ctx, conn, req.key, req.retention)
    if req.series is None and {"series", "generation"} & req.key.extra.keys():
        raise BadRequest("key.extra 'series' and 'generation' mark the generations of a series: reserve with "
                         "'series' to publish one")
    key = req.key.model_copy(update={"device": ctx.residency.canonical_device(req.key.device, from_peer=True)})
    conn.quotas.fd_room(conn)
    manifest = await asyncio.to_thread(_reserved_manifest, req.columns, req.series is not None)
    name = f"{key.model}#{key.digest(conn.uid)[:8]}"  # one key, one entry per publisher
    _send_lease(ctx, conn, req.id, await ctx.residency.reserve(name, key, manifest, req.retention, conn,
                                                               conn.pid, conn.uid, req.series,
                                                               ctx.is_admin(conn) if req.series else False))


def _check_publishable(ctx: Context, conn: Connection, key: WeightCacheKey, retention: str) -> None:
    """A published entry is never a raw checkpoint (those come only from the daemon's own loads, so
    no peer can plant bytes under a checkpoint's fingerprint), and only admins pin."""
    if key.transform == RAW:
        raise PermissionDenied(
            f"transform {RAW!r} is reserved for checkpoints the daemon loads itself: publish under your own "
            "transform tag (e.g. 'vllm-0.9/fp8'), or ask an admin to load the checkpoint", {"transform": RAW})
    if _CONTROL_CHAR.search(key.model):
        raise BadRequest(f"key.model {key.model!r:.80} holds control characters")
    if retention == "pinned":
        ctx.require_admin(conn, "publishing a pinned entry")


async def commit(ctx: Context, conn: Connection, req: protocol.Commit) -> None:
    entry = await ctx.residency.commit(conn, req.lease)
    log.info("published %s (%s, %d tensors, pid %d, uid %d)", entry.name, format_size(entry.manifest.nbytes),
             len(entry.manifest), conn.pid, conn.uid)
    if entry.series is not None:
        conn.send(protocol.ok(req.id, entry=entry.name, series=entry.series.name, generation=entry.generation,
                              told=_announce(ctx, entry, "commit")))
        return
    conn.send(protocol.ok(req.id, entry=entry.name))


async def load(ctx: Context, conn: Connection, req: protocol.Load) -> None:
    ctx.require_admin(conn, "load")
    if req.path is None:
        model = next((m for m in ctx.state.config.models if m.name == req.name), None)
        if model is None:
            raise NotFound(f"no configured model named {req.name!r}; give a path to load an unconfigured one")
        path, device, retention = model.path, req.device or model.device, req.retention or model.retention
        follow = model.follow_symlinks
    else:
        path, device, retention = Path(req.path), req.device or HOST_DEVICE, req.retention or "cached"
        follow = False
    entry = ctx.state.cache.entries.get(req.name)
    if entry is None:
        started = time.monotonic()
        try:
            entry = await ctx.residency.admit_load(req.name, path, device, retention, "load", follow)
        except (Busy, PermissionDenied):
            raise  # the name or key is taken, or the path is not the peer's to load: nothing failed to load
        except WcdError as e:
            ctx.residency.failed(req.name, f"{e.message} (wcdctl load by uid {conn.uid})",
                                 "config" if req.path is None else "load", device, path)
            raise
        if req.path is not None:  # bytes the asker chose, not the daemon's config
            entry.asked_by = conn.uid
        admitted = time.monotonic()
        task = ctx.residency.start_fill(entry)
        if req.wait:
            await asyncio.shield(task)
            log.debug("load %s answered %.3f s after it was asked (admission %.3f s, then the fill)", req.name,
                      time.monotonic() - started, admitted - started)
    elif req.wait:
        await ctx.residency.wait_ready(entry, 24 * 3600)
    conn.send(protocol.ok(req.id, entry=entry.describe()))


MISMATCHES_LISTED = 50  # a verify reply names at most these; `mismatched_count` counts them all


async def verify(ctx: Context, conn: Connection, req: protocol.Verify) -> None:
    entry = ctx.state.cache.find(ctx.residency.resolve(req.target()), ctx.publishers(conn))
    limit = ctx.state.config.daemon.max_verifies_per_uid
    if ctx.verifying[conn.uid] >= limit:
        raise Busy(f"uid {conn.uid} has {limit} verify requests in flight (max_verifies_per_uid); "
                   "wait for one to finish", {"limit": limit})
    ctx.verifying[conn.uid] += 1
    try:
        found = await ctx.residency.verify(entry)
    finally:
        ctx.verifying[conn.uid] -= 1
        if not ctx.verifying[conn.uid]:
            del ctx.verifying[conn.uid]
    conn.send(protocol.ok(req.id, entry=entry.name, match=not found.mismatched, against=found.against,
                          publisher_uid=entry.publisher, digest=found.digest, tensors=found.tensors,
                          mismatched=found.mismatched[:MISMATCHES_LISTED], mismatched_count=len(found.mismatched)))


def _reserved_manifest(tensors: protocol.TensorColumns, generation: bool = False) -> Manifest:
    """The layout of a reserve, the wire form its publisher gets and, for a generation, its layout
    digest: a while for 10^5 tensors, so in a worker thread."""
    manifest = Manifest.layout_columns(tensors.model_dump())
    manifest.wire()
    if generation:
        manifest.layout()
    return manifest


def _send_lease(ctx: Context, conn: Connection, req_id: int, lease: LeaseRecord) -> None:
    entry, arena = lease.entry, lease.entry.arena
    ctx.state.cache.lease_book.handed_out(lease)
    conn.send(protocol.ok(
        req_id, lease=lease.id, kind=lease.kind, entry=entry.name, key=entry.key.model_dump(),
        origin=entry.origin, publisher_uid=entry.publisher, asked_by=entry.asked_by,
        manifest=entry.manifest.wire(), ttl_s=ctx.state.cache.lease_book.ttl_s,
        arena={"kind": arena.kind, "size": arena.size, "device": arena.device}), [arena.fd()])


# -- the dispatch table -----------------------------------------------------------------------

R = TypeVar("R")


@dataclass(frozen=True)
class Op(Generic[R]):
    """An op's request schema and its handler; a coroutine handler runs as a task (`slow`), and so
    does the coroutine a quick handler returns when it cannot answer at once."""

    schema: type[R]
    handler: Callable[[Context, Connection, R], Any]

    @property
    def slow(self) -> bool:
        return inspect.iscoroutinefunction(self.handler)


OPS: dict[str, Op[Any]] = {
    "hello": Op(protocol.Hello, hello),
    "ping": Op(protocol.Ping, ping),
    "status": Op(protocol.Status, status),
    "list": Op(protocol.ListEntries, list_entries),
    "leases": Op(protocol.Leases, leases),
    "heartbeat": Op(protocol.Heartbeat, heartbeat),
    "release": Op(protocol.Release, release),
    "abort": Op(protocol.Abort, abort),
    "evict": Op(protocol.Evict, evict),
    "metrics": Op(protocol.MetricsRequest, metrics),
    "acquire": Op(protocol.Acquire, acquire),
    "reserve": Op(protocol.Reserve, reserve),
    "commit": Op(protocol.Commit, commit),
    "load": Op(protocol.Load, load),
    "verify": Op(protocol.Verify, verify),
    "watch": Op(protocol.Watch, watch),
    "rollback": Op(protocol.Rollback, rollback),
}


def dispatch(ctx: Context, conn: Connection, message: dict[str, Any]) -> None:
    """Answer one decoded message: at once, or from a task of the connection for slow ops."""
    started = time.perf_counter()
    req_id = message.get("id") if type(message.get("id")) is int else None
    op = message.get("op") if type(message.get("op")) is str else None  # a list or map is no op (nor hashable)
    try:
        req = protocol.parse_request(message)
        if not conn.hello and req.op != "hello":
            raise BadRequest("the first request on a connection must be hello")
        spec = OPS[req.op]
        later = None if spec.slow else spec.handler(ctx, conn, req)  # a quick op may hand back what waits
        if spec.slow or later is not None:
            if sum(not t.done() for t in conn.tasks) >= MAX_INFLIGHT:  # done ones leave at the next loop pass
                if later is not None:
                    later.close()
                raise Busy(f"more than {MAX_INFLIGHT} requests in flight on this connection")
            task = conn.loop.create_task(_run(ctx, conn, later or spec.handler(ctx, conn, req), req, started))
            conn.tasks.add(task)
            task.add_done_callback(conn.tasks.discard)
            return
    except Exception as e:
        _reply_failure(conn, req_id, op, e)
    ctx.metrics.observe(op, time.perf_counter() - started)


async def _run(ctx: Context, conn: Connection, work: Coroutine[Any, Any, None], req: Any, started: float) -> None:
    try:
        await work
    except Exception as e:
        _reply_failure(conn, req.id, req.op, e)
    ctx.metrics.observe(req.op, time.perf_counter() - started)


def _reply_failure(conn: Connection, req_id: int | None, op: object, exc: Exception) -> None:
    """A handler's `WcdError` goes to the client as is; anything else is a bug: logged, `internal`."""
    if isinstance(exc, WcdError):
        conn.send(protocol.error(req_id, exc))
    else:
        log.error("%r: %s failed", conn, op, exc_info=exc)
        conn.send(protocol.error(req_id, Internal("internal error; the daemon log has the traceback")))
