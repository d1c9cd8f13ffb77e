"""The daemon: asyncio lifecycle (startup / serve / shutdown), connections and dispatch.

Cache rules live in `wcd.cache`; this module does the I/O around them. Connections are raw
non-blocking Unix sockets driven by `add_reader`/`add_writer`, because asyncio transports
cannot carry SCM_RIGHTS. Nothing blocks the loop: checkpoint reads, arena allocation and
digests run in worker threads; per-connection work is bounded so one client cannot stall others.
"""

from __future__ import annotations

import array
import asyncio
import errno
import grp
import hashlib
import logging
import math
import os
import pwd
import signal
import socket
import struct
import time
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from wcd import __version__, parking, protocol, systemd
from wcd.arenas import Arena, backend_for
from wcd.cache import Cache, Entry, Lease
from wcd.checkpoint import Checkpoint
from wcd.config import Config, ModelConfig, format_progress, format_size, load_config, parse_size
from wcd.errors import (
    BadRequest, Busy, ConfigError, Internal, LoadFailed, NotFound, PermissionDenied, ProtocolError, UnsupportedVersion,
    WcdError,
)
from wcd.key import HOST_DEVICE, WeightCacheKey, fingerprint_checkpoint
from wcd.loader import Cancelled, default_workers, digest_arena, digest_checkpoint, fill_arena
from wcd.manifest import Manifest
from wcd.metrics import Metrics
from wcd.metrics_http import MetricsHttp
from wcd.protocol import FrameDecoder, encode

log = logging.getLogger("wcd")

RECV_BYTES = 256 * 1024
MAX_OUTPUT_BYTES = 256 * 1024 * 1024  # a client that stops reading is cut off past this
MAX_INFLIGHT = 64  # concurrent slow requests (acquire, load, ...) per connection
_ANC = socket.CMSG_SPACE(protocol.MAX_FDS_PER_FRAME * 4)
_PEERCRED = struct.Struct("3i")
DEFAULT_BUDGET = {"cpu": "50%", "cuda": "90%"}


class Connection:
    """One client: frames in through `FrameDecoder`, replies (with fds) out through sendmsg."""

    def __init__(self, server: Server, sock: socket.socket, pid: int, uid: int, gid: int) -> None:
        self.server, self.sock = server, sock
        self.fd = sock.fileno()
        self.pid, self.uid, self.gid = pid, uid, gid
        self.loop = server.loop
        self.decoder = FrameDecoder()
        self.hello = False
        self.client = ""
        self.closed = False
        self.tasks: set[asyncio.Task[None]] = set()
        self._out: deque[tuple[memoryview, list[int]]] = deque()
        self._out_bytes = 0
        self._writing = False
        self._corked = False
        self._close_when_flushed = False
        self.loop.add_reader(self.fd, self._on_readable)

    def __repr__(self) -> str:
        return f"<conn pid={self.pid} uid={self.uid} {self.client}>"

    # -- input ------------------------------------------------------------------------------

    def _on_readable(self) -> None:
        self._corked = True  # coalesce the replies of one read into one write
        try:
            for _ in range(16):  # bounded work per wakeup keeps the loop fair
                try:
                    data, anc, flags, _ = self.sock.recvmsg(RECV_BYTES, _ANC, socket.MSG_CMSG_CLOEXEC)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    self.close()
                    return
                fds = protocol.fds_from_ancillary(anc)
                if flags & socket.MSG_CTRUNC:
                    _close_all(fds)
                    self.fail(ProtocolError("too many file descriptors in one message"))
                    return
                if not data:
                    _close_all(fds)
                    self.close()
                    return
                try:
                    self.decoder.feed(data, fds)
                    while not self._close_when_flushed and (item := self.decoder.next_message()) is not None:
                        self.server.dispatch(self, *item)
                except ProtocolError as e:
                    self.fail(e)
                    return
                if len(data) < RECV_BYTES:
                    break
        finally:
            self._corked = False
            if not self.closed:
                self._flush()

    def fail(self, err: WcdError) -> None:
        """Report a stream-level error, then close once it is written."""
        log.warning("%r: %s", self, err.message)
        _close_all(self.decoder.take_fds())
        self.loop.remove_reader(self.fd)
        self._close_when_flushed = True
        self.send(protocol.error(None, err))

    # -- output -----------------------------------------------------------------------------

    def send(self, message: dict[str, Any], fds: Iterable[int] = ()) -> None:
        if self.closed:
            return
        dups = [os.dup(fd) for fd in fds]  # the arena may close its fd before this frame is written
        data = memoryview(encode(message, len(dups)))
        self._out.append((data, dups))
        self._out_bytes += len(data)
        if self._out_bytes > MAX_OUTPUT_BYTES:
            log.warning("%r: not reading its replies; disconnecting", self)
            self.close()
        elif not self._corked and not self._writing:
            self._flush()

    def _flush(self) -> None:
        while self._out:
            data, fds = self._out[0]
            try:
                if fds:
                    n = self.sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
                    _close_all(fds)
                    fds = []
                else:
                    n = self.sock.send(data)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError:
                self.close()
                return
            self._out_bytes -= n
            if n < len(data):
                self._out[0] = (data[n:], fds)
                if not self._writing:
                    self._writing = True
                    self.loop.add_writer(self.fd, self._flush)
                return
            self._out.popleft()
        if self._writing:
            self._writing = False
            self.loop.remove_writer(self.fd)
        if self._close_when_flushed:
            self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.loop.remove_reader(self.fd)
        if self._writing:
            self.loop.remove_writer(self.fd)
        for _, fds in self._out:
            _close_all(fds)
        self._out.clear()
        _close_all(self.decoder.take_fds())
        for task in self.tasks:
            task.cancel()
        self.sock.close()
        self.server.connection_lost(self)


class Server:
    def __init__(self, config: Config, instance: str = "wcd", listen_fd: int | None = None,
                 parked_fds: list[tuple[int, str]] | None = None, config_path: Path | None = None) -> None:
        self.config = config
        self.instance = instance
        self.config_path = config_path  # re-read on SIGHUP
        self.listen_fd = listen_fd  # socket-activated: never unlink or shut it down
        self.notifier = systemd.Notifier()
        self._parked_fds = parked_fds or []  # from systemd's fd store, adopted at startup
        self._parked: set[str] = set()  # entries whose fds sit in the fd store
        self.started_at = time.time()
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]
        self.cache: Cache = None  # type: ignore[assignment]
        self.connections: set[Connection] = set()
        self.devices: dict[str, str] = {}  # configured name ("cuda:0") -> canonical id (UUID)
        self.stopping = asyncio.Event()
        self.metrics = Metrics(self)
        address = config.daemon.metrics_address()
        self.metrics_http = MetricsHttp(*address, self.metrics.render) if address else None
        self._listener: socket.socket | None = None
        self._bound_path: Path | None = None
        self._ready: dict[str, asyncio.Event] = {}  # entry name -> set when it leaves loading/filling
        self._digests: dict[str, asyncio.Future[dict[str, str]]] = {}  # published entries
        self._checkpoints: dict[str, Checkpoint] = {}  # admitted, not yet filling
        self._tasks: set[asyncio.Task[Any]] = set()
        self._allowed_gids = config.daemon.allowed_gids()
        self._sync: dict[str, Callable[[Connection, Any], None]] = {
            "hello": self.op_hello, "ping": self.op_ping, "status": self.op_status, "list": self.op_list,
            "leases": self.op_leases, "heartbeat": self.op_heartbeat, "release": self.op_release,
            "abort": self.op_abort, "evict": self.op_evict, "metrics": self.op_metrics,
        }
        self._async: dict[str, Callable[[Connection, Any], Any]] = {
            "acquire": self.op_acquire, "reserve": self.op_reserve, "commit": self.op_commit, "load": self.op_load,
            "verify": self.op_verify,
        }

    # -- lifecycle --------------------------------------------------------------------------

    async def startup(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.cache = Cache(self._budgets(), self.config.daemon.lease_ttl_s)
        for sig, handler in ((signal.SIGTERM, self.stop), (signal.SIGINT, self.stop),
                             (signal.SIGHUP, lambda: self._spawn(self.reload()))):
            self.loop.add_signal_handler(sig, handler)
        self._spawn(self._expire_leases())
        await self._adopt_parked(self._parked_fds)
        self._parked_fds = []
        # Admit configured models before serving, so an engine that connects at once waits for
        # its model instead of getting not_found; the copies themselves run in the background.
        await asyncio.gather(*(self._admit_configured(m) for m in self.config.models))
        if self.metrics_http is not None:
            await self.metrics_http.start()
        self._listen()
        log.info("wcd %s serving %s (devices: %s)", __version__, self._where(), ", ".join(self.cache.budgets))
        self._notify("ready", self.status_line())
        self._spawn(self._report_status())
        interval = systemd.watchdog_interval()
        if interval is not None:
            self._spawn(self._watchdog(interval))

    async def serve(self) -> None:
        await self.stopping.wait()

    def stop(self) -> None:
        if not self.stopping.is_set():
            log.info("stopping")
            self._notify("stopping", "stopping")
            self.stopping.set()

    async def shutdown(self) -> None:
        if self.metrics_http is not None:
            await self.metrics_http.stop()
        if self._listener is not None:
            self.loop.remove_reader(self._listener.fileno())
            if self.listen_fd is None:
                self._listener.close()
                if self._bound_path is not None:
                    self._bound_path.unlink(missing_ok=True)
        for conn in list(self.connections):
            conn.close()
        for entry in self.cache.entries.values():
            if entry.state == "loading":
                entry.state = "evicting"  # the loader stops at its next chunk
        tasks = [t for t in self._tasks if not t.done()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # Close our descriptors without evicting: parked arenas stay in systemd's fd store for
        # the next start; the others' memory returns once clients unmap.
        for entry in self.cache.entries.values():
            if entry.arena is not None:
                entry.arena.close()
        kept = sum(1 for name in self._parked if name in self.cache.entries)
        log.info("stopped%s", f"; {kept} entries stay parked in systemd's fd store" if kept else "")
        self.notifier.close()

    def _where(self) -> str:
        return f"socket-activated fd {self.listen_fd}" if self.listen_fd is not None else str(self._bound_path)

    def _budgets(self) -> dict[str, int]:
        """Budget per canonical device: configured ones, every model's device, and host memory."""
        wanted: dict[str, int | str] = {HOST_DEVICE: DEFAULT_BUDGET["cpu"]}
        for model in self.config.models:
            wanted.setdefault(model.device, DEFAULT_BUDGET["cuda" if model.device != HOST_DEVICE else "cpu"])
        wanted.update(self.config.daemon.budget)
        budgets: dict[str, int] = {}
        for device, size in wanted.items():
            backend = backend_for(device)
            canonical = backend.canonical(device)
            self.devices[device] = canonical
            budgets[canonical] = parse_size(size, backend.info(canonical).total)
        return budgets

    def canonical_device(self, device: str) -> str:
        if device in self.devices:
            return self.devices[device]
        canonical = backend_for(device).canonical(device)
        if canonical not in self.cache.budgets:
            raise BadRequest(f"device {device!r} is not managed by this daemon (add a budget for it in the config)")
        return canonical

    def _listen(self) -> None:
        if self.listen_fd is not None:
            sock = socket.socket(fileno=self.listen_fd)
        else:
            sock = _bind(self.config.daemon.socket, self.config.daemon.allowed_groups)  # type: ignore[arg-type]
            self._bound_path = self.config.daemon.socket
        sock.setblocking(False)
        self._listener = sock
        self.loop.add_reader(sock.fileno(), self._accept)

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_log_failure)
        return task

    # -- connections ------------------------------------------------------------------------

    def _accept(self) -> None:
        assert self._listener is not None
        for _ in range(64):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE):
                    log.error("out of file descriptors; raise LimitNOFILE")
                return
            sock.setblocking(False)
            pid, uid, gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
            conn = Connection(self, sock, pid, uid, gid)
            if not self._allowed(uid, gid):
                conn.fail(PermissionDenied(
                    f"uid {uid} is not allowed to use this daemon: add it to allowed_uids, or the user to a "
                    f"group in allowed_groups, in the daemon's config", {"uid": uid}))
                continue
            if len(self.connections) >= self.config.daemon.max_connections:
                conn.fail(Busy(f"too many connections ({len(self.connections)}); try again later"))
                continue
            self.connections.add(conn)

    def _allowed(self, uid: int, gid: int) -> bool:
        if uid == os.getuid() or uid in self.config.daemon.allowed_uids:
            return True
        if not self._allowed_gids:
            return False
        if gid in self._allowed_gids:
            return True
        try:
            user = pwd.getpwuid(uid)
        except KeyError:
            return False
        return bool(self._allowed_gids.intersection(os.getgrouplist(user.pw_name, user.pw_gid)))

    def connection_lost(self, conn: Connection) -> None:
        self.connections.discard(conn)
        self._reclaim(self.cache.drop_owner(conn))

    def dispatch(self, conn: Connection, message: dict[str, Any], fds: list[int]) -> None:
        started = time.perf_counter()
        req_id = message.get("id") if type(message.get("id")) is int else None
        op = message.get("op")
        try:
            if fds:
                _close_all(fds)
                raise BadRequest("clients do not send file descriptors in protocol v1")
            req = protocol.parse_request(message)
            if not conn.hello and req.op != "hello":
                raise BadRequest("the first request on a connection must be hello")
            handler = self._sync.get(req.op)
            if handler is not None:
                handler(conn, req)
            elif len(conn.tasks) >= MAX_INFLIGHT:
                raise Busy(f"more than {MAX_INFLIGHT} requests in flight on this connection")
            else:
                task = self.loop.create_task(self._run(conn, req, started))
                conn.tasks.add(task)
                task.add_done_callback(conn.tasks.discard)
                return
        except WcdError as e:
            conn.send(protocol.error(req_id, e))
        except Exception:
            log.exception("%r: %s failed", conn, op)
            conn.send(protocol.error(req_id, Internal("internal error; the daemon log has the traceback")))
        self.metrics.observe(op, time.perf_counter() - started)

    async def _run(self, conn: Connection, req: Any, started: float) -> None:
        try:
            await self._async[req.op](conn, req)
        except asyncio.CancelledError:
            raise
        except WcdError as e:
            conn.send(protocol.error(req.id, e))
        except Exception:
            log.exception("%r: %s failed", conn, req.op)
            conn.send(protocol.error(req.id, Internal("internal error; the daemon log has the traceback")))
        self.metrics.observe(req.op, time.perf_counter() - started)

    # -- reclaiming -------------------------------------------------------------------------

    def _reclaim(self, entries: Iterable[Entry]) -> None:
        """Entries the cache dropped: close their arenas (memory returns once clients unmap)."""
        for entry in entries:
            if entry.name in self._parked:
                self._parked.discard(entry.name)
                for name in parking.fd_names(entry.key):
                    self._notify("remove_fds", name)
            if entry.arena is not None:
                # Closing the last reference frees the memory, ~0.3 s per GB: off the loop.
                self.loop.run_in_executor(None, entry.arena.close)
                entry.arena = None
            self._digests.pop(entry.name, None)
            self._checkpoints.pop(entry.name, None)
            event = self._ready.pop(entry.name, None)
            if event is not None:
                event.set()
            log.info("reclaimed %s (%s on %s)", entry.name, format_size(entry.nbytes), entry.device)

    async def _expire_leases(self) -> None:
        tick = min(1.0, self.config.daemon.lease_ttl_s / 10)
        while True:
            await asyncio.sleep(tick)
            expired, dropped = self.cache.expire()
            for lease in expired:
                log.info("lease %d on %s (pid %d) expired: no heartbeat", lease.id, lease.entry.name, lease.pid)
            self._reclaim(dropped)

    # -- loading ----------------------------------------------------------------------------

    async def _admit_configured(self, model: ModelConfig) -> None:
        if model.name in self.cache.entries:
            return  # adopted from the fd store, or still leased after a reload changed it
        try:
            entry = await self._admit_load(model.name, model.path, model.device, model.retention, "config")
        except WcdError as e:
            log.error("cannot load %s: %s", model.name, e.message)
            return
        self._spawn(self._fill(entry))

    async def _admit_load(self, name: str, path: Path, device: str, retention: Any, origin: Any) -> Entry:
        """Read the checkpoint's headers, fingerprint it, and admit an entry (state loading)."""
        canonical = self.canonical_device(device)
        ckpt = await asyncio.to_thread(Checkpoint.open, path)
        fingerprint = await asyncio.to_thread(fingerprint_checkpoint, ckpt.path)
        manifest = ckpt.manifest()
        key = WeightCacheKey(model=name, path=str(ckpt.path), fingerprint=fingerprint, device=canonical)
        entry, victims = self.cache.admit(name, key, manifest, backend_for(canonical).arena_size(manifest.size, canonical),
                                          retention, origin)
        self._reclaim(victims)
        self._ready[name] = asyncio.Event()
        self._checkpoints[name] = ckpt
        return entry

    async def _fill(self, entry: Entry) -> Entry:
        """Allocate the entry's arena and copy the checkpoint in from worker threads, then make it ready."""
        ckpt = self._checkpoints.pop(entry.name)
        manifest = entry.manifest
        log.info("loading %s: %s in %d tensors from %s to %s", entry.name, format_size(manifest.nbytes),
                 len(manifest.tensors), ckpt.path, entry.device)
        started = time.monotonic()
        try:
            entry.arena = await asyncio.to_thread(backend_for(entry.device).create, entry.device, entry.nbytes,
                                                  entry.name)
            await asyncio.to_thread(fill_arena, entry.arena, ckpt, ckpt.copy_plan(manifest), _EntryProgress(entry),
                                    lambda: entry.state == "evicting",
                                    self.config.daemon.load_workers or default_workers())
            await asyncio.to_thread(entry.arena.seal)
        except BaseException as e:
            self._reclaim(self.cache.load_failed(entry))
            if isinstance(e, Cancelled):
                raise NotFound(f"loading {entry.name} was cancelled: the entry was evicted") from None
            if isinstance(e, (WcdError, asyncio.CancelledError)):
                raise
            raise LoadFailed(f"loading {entry.name} failed: {e}") from e
        seconds = time.monotonic() - started
        self.metrics.loaded(entry.device, manifest.nbytes, seconds)
        log.info("loaded %s in %.2f s (%.2f GB/s)", entry.name, seconds, manifest.nbytes / max(seconds, 1e-9) / 1e9)
        self._reclaim(self.cache.loaded(entry))
        self._set_ready(entry)
        return entry

    def _set_ready(self, entry: Entry) -> None:
        event = self._ready.pop(entry.name, None)
        if event is not None:
            event.set()
        self._park(entry)

    # -- systemd: notifications, fd store ---------------------------------------------------

    def _notify(self, what: str, arg: Any = None) -> None:
        """One systemd call; a failure is logged, never fatal (the daemon serves without systemd)."""
        try:
            if what == "remove_fds":
                systemd.remove_fds(arg)
            elif arg is None:
                getattr(self.notifier, what)()
            else:
                getattr(self.notifier, what)(arg)
        except (systemd.SystemdError, ValueError) as e:
            log.warning("systemd: %s", e)

    def status_line(self) -> str:
        loading = [e for e in self.cache.entries.values() if e.state == "loading"]
        if loading:
            e = loading[0]
            more = f" (+{len(loading) - 1} more)" if len(loading) > 1 else ""
            return f"loading {e.name} {format_progress(e.done_bytes, e.manifest.nbytes)}{more}"
        held = sum(e.nbytes for e in self.cache.entries.values())
        return f"serving {len(self.cache.entries)} entries, {len(self.cache.leases)} leases, {format_size(held)}"

    async def _report_status(self) -> None:
        last = ""
        while True:
            await asyncio.sleep(1.0)
            line = self.status_line()
            if line != last:
                self._notify("status", line)
                last = line

    async def _watchdog(self, interval: float) -> None:
        # From the event loop on purpose: a wedged loop stops the pings and systemd restarts us.
        while True:
            self._notify("watchdog")
            await asyncio.sleep(interval)

    def _park(self, entry: Entry) -> None:
        """Put a ready entry's arena fd and its record into systemd's fd store (if there is one)."""
        if not systemd.store_enabled() or entry.name in self._parked or entry.arena is None:
            return
        arena_name, record_name = parking.fd_names(entry.key)
        try:
            record = parking.record_memfd(entry)
            try:
                systemd.store_fds([entry.arena.fd()], arena_name)
                systemd.store_fds([record], record_name)
            finally:
                os.close(record)
        except (systemd.SystemdError, OSError, ValueError) as e:
            log.warning("cannot park %s in systemd's fd store (%s): it will be reloaded after a restart",
                        entry.name, e)
            return
        self._parked.add(entry.name)

    async def _adopt_parked(self, fds: list[tuple[int, str]]) -> None:
        """Re-adopt arenas systemd kept for us; drop (and unstore) anything unknown, corrupt or stale."""
        groups: dict[str, dict[str, int]] = {}
        for fd, name in fds:
            stem, dot, suffix = name.rpartition(".")
            if dot and "." + suffix in (parking.ARENA_SUFFIX, parking.RECORD_SUFFIX):
                groups.setdefault(stem, {})["." + suffix] = fd
            else:
                log.warning("fd store: dropping unknown fd %r", name)
                os.close(fd)
                self._notify("remove_fds", name)
        for stem, parts in groups.items():
            arena_fd = parts.pop(parking.ARENA_SUFFIX, None)
            record_fd = parts.pop(parking.RECORD_SUFFIX, None)
            try:
                if arena_fd is None or record_fd is None:
                    raise BadRequest("its arena or record is missing")
                entry = await self._adopt(parking.parse_record(record_fd), arena_fd)
                arena_fd = None  # the arena owns it now
                log.info("adopted %s from systemd's fd store (%s on %s, no disk read)%s", entry.name,
                         format_size(entry.nbytes), entry.device, f"; {entry.notes[0]}" if entry.notes else "")
            except (WcdError, OSError) as e:
                log.warning("fd store: dropping %s: %s", stem, getattr(e, "message", e))
                for suffix in (parking.ARENA_SUFFIX, parking.RECORD_SUFFIX):
                    self._notify("remove_fds", stem + suffix)
            finally:
                for fd in (arena_fd, record_fd):
                    if fd is not None:
                        os.close(fd)

    async def _adopt(self, rec: parking.ParkedEntry, arena_fd: int) -> Entry:
        device = rec.key.device
        if device not in self.cache.budgets:
            raise BadRequest(f"device {device} is no longer configured")
        notes = []
        if rec.origin != "publish":
            if Path(rec.key.path).exists():
                fingerprint = await asyncio.to_thread(fingerprint_checkpoint, rec.key.path)
                if fingerprint != rec.key.fingerprint:
                    raise BadRequest(f"stale: {rec.key.path} changed since it was loaded")
            else:
                notes.append(f"checkpoint {rec.key.path} is missing: serving the copy kept across the restart")
        backend = backend_for(device)
        arena = backend.adopt(os.dup(arena_fd), device, rec.arena_size, rec.name)
        try:
            entry, victims = self.cache.admit(rec.name, rec.key, rec.manifest, arena.size, rec.retention,
                                              rec.origin)  # type: ignore[arg-type]
        except BaseException:
            arena.close()
            raise
        os.close(arena_fd)
        self._reclaim(victims)
        entry.arena, entry.notes, entry.done_bytes = arena, notes, rec.manifest.nbytes
        self.cache.loaded(entry)
        self._parked.add(entry.name)  # systemd still holds the fds: never store them twice
        return entry

    async def reload(self) -> None:
        """SIGHUP: re-read the config; load new models, evict removed or changed ones once unleased."""
        self._notify("reloading", "reloading configuration")
        try:
            if self.config_path is None:
                raise BadRequest("no config file to re-read")
            # Paths are checked here, not by load_config: a resident model may have lost its
            # checkpoint on purpose (kept across a restart in the fd store, as at startup); only a
            # model this reload would (re)load needs one.
            new = await asyncio.to_thread(load_config, self.config_path, self.instance, False)
            old = {m.name: m for m in self.config.models}
            for i, model in enumerate(new.models):
                kept = old.get(model.name) == model and model.name in self.cache.entries
                if not kept and not await asyncio.to_thread(model.path.exists):
                    raise ConfigError(f"config {self.config_path}: models.{i}.path: {model.path} does not exist")
        except WcdError as e:
            log.error("reload failed, keeping the running configuration: %s", e.message)
            self._notify("ready", f"reload failed: {e.message}"[:200])
            return
        fresh = {m.name: m for m in new.models}
        for name, model in old.items():
            if fresh.get(name) != model and name in self.cache.entries:
                log.info("reload: %s was removed or changed; evicting it once its leases end", name)
                self._reclaim(self.cache.evict(self.cache.entries[name]))
        if new.daemon.socket != self.config.daemon.socket and self.listen_fd is None:
            log.warning("reload: a new socket path takes effect on restart")
        new.daemon.socket = self.config.daemon.socket
        self.config = new
        self._allowed_gids = new.daemon.allowed_gids()
        self.cache.lease_ttl_s = new.daemon.lease_ttl_s
        for name, model in fresh.items():
            if name not in self.cache.entries:
                await self._admit_configured(model)
        log.info("reloaded %s", self.config_path)
        self._notify("ready", self.status_line())

    async def _wait_ready(self, entry: Entry, timeout: float) -> Entry:
        event = self._ready.get(entry.name)
        if event is not None:
            try:
                await asyncio.wait_for(event.wait(), timeout)
            except asyncio.TimeoutError:
                raise Busy(f"entry {entry.name!r} is still {entry.state} after {timeout:g} s") from None
        if self.cache.entries.get(entry.name) is not entry:
            raise NotFound(f"entry {entry.name!r} went away while loading (evicted or failed; see the daemon log)")
        return entry

    # -- ops --------------------------------------------------------------------------------

    def op_hello(self, conn: Connection, req: protocol.Hello) -> None:
        common = sorted(set(req.versions) & set(protocol.SUPPORTED_VERSIONS))
        if not common:
            raise UnsupportedVersion(
                f"client speaks protocol {req.versions}, daemon speaks {list(protocol.SUPPORTED_VERSIONS)}: "
                "upgrade the older side")
        conn.hello, conn.client = True, req.client
        conn.send(protocol.ok(
            req.id, version=common[-1], server=f"wcd {__version__}", instance=self.instance,
            features=["host-arenas", "publish", "verify", "metrics"] + (["cuda-arenas"] if any(
                d != HOST_DEVICE for d in self.cache.budgets) else []),
            lease_ttl_s=self.config.daemon.lease_ttl_s, pid=os.getpid(),
            peer={"pid": conn.pid, "uid": conn.uid, "gid": conn.gid}))

    def op_ping(self, conn: Connection, req: protocol.Ping) -> None:
        conn.send(protocol.ok(req.id))

    def op_status(self, conn: Connection, req: protocol.Status) -> None:
        conn.send(protocol.ok(req.id, **self.status()))

    def status(self) -> dict[str, Any]:
        devices = []
        for device, budget in self.cache.budgets.items():
            info = backend_for(device).info(device)
            devices.append({"device": device, "name": info.name, "total": info.total, "free": info.free,
                            "budget": budget, "used": self.cache.used(device)})
        entries = [e.describe() for e in self.cache.entries.values()]
        return {
            "version": __version__, "instance": self.instance, "pid": os.getpid(),
            "uptime_s": time.time() - self.started_at, "socket": self._where(),
            "lease_ttl_s": self.cache.lease_ttl_s, "devices": devices, "entries": entries,
            "leases": len(self.cache.leases), "connections": len(self.connections),
            "loading": [e["name"] for e in entries if e["state"] == "loading"],
            "counters": dict(self.cache.stats),
        }

    def op_list(self, conn: Connection, req: protocol.ListEntries) -> None:
        conn.send(protocol.ok(req.id, entries=[e.describe() for e in self.cache.entries.values()]))

    def op_leases(self, conn: Connection, req: protocol.Leases) -> None:
        now = self.cache.clock()
        conn.send(protocol.ok(req.id, leases=[
            {"id": lease.id, "entry": lease.entry.name, "kind": lease.kind, "pid": lease.pid, "uid": lease.uid,
             "expires_in_s": round(lease.expires_at - now, 3) if math.isfinite(lease.expires_at) else None}
            for lease in self.cache.leases.values()]))

    def op_heartbeat(self, conn: Connection, req: protocol.Heartbeat) -> None:
        conn.send(protocol.ok(req.id, lost=self.cache.heartbeat(conn, req.leases)))

    def op_release(self, conn: Connection, req: protocol.Release) -> None:
        self._reclaim(self.cache.release(conn, req.lease))
        conn.send(protocol.ok(req.id))

    async def op_commit(self, conn: Connection, req: protocol.Commit) -> None:
        lease = self.cache.leases.get(req.lease)
        if lease is None or lease.owner is not conn or lease.kind != "fill":
            self.cache.commit(conn, req.lease)  # raises the precise error
        assert lease is not None
        if lease.entry.state != "evicting":
            # Sealing scans the arena's pages (~25 ms per GB): off the loop. Busy if the publisher
            # still maps it writable; the lease stays, so it can drop its views and commit again.
            await asyncio.to_thread(lease.entry.arena.seal)
        entry, dropped = self.cache.commit(conn, req.lease)
        if dropped:
            self._reclaim(dropped)
            raise NotFound(f"{entry.name} was evicted while it was being filled; nothing was published")
        self._set_ready(entry)
        self._digests[entry.name] = asyncio.ensure_future(
            asyncio.to_thread(digest_arena, entry.arena, entry.manifest))
        log.info("published %s (%s, %d tensors, pid %d)", entry.name, format_size(entry.manifest.nbytes),
                 len(entry.manifest.tensors), conn.pid)
        conn.send(protocol.ok(req.id, entry=entry.name))

    def op_abort(self, conn: Connection, req: protocol.Abort) -> None:
        self._reclaim(self.cache.abort(conn, req.lease))
        conn.send(protocol.ok(req.id))

    def op_evict(self, conn: Connection, req: protocol.Evict) -> None:
        entry = self.cache.find(self._target(req))
        dropped = self.cache.evict(entry)
        self._reclaim(dropped)
        conn.send(protocol.ok(req.id, entry=entry.name, state="evicted" if dropped else entry.state,
                              leases=len(entry.leases)))

    def op_metrics(self, conn: Connection, req: protocol.Metrics) -> None:
        conn.send(protocol.ok(req.id, text=self.metrics.render()))

    def _target(self, req: Any) -> str | WeightCacheKey:
        target = req.target()
        if isinstance(target, WeightCacheKey) and target.device in self.devices:
            target = target.model_copy(update={"device": self.devices[target.device]})
        return target

    async def op_acquire(self, conn: Connection, req: protocol.Acquire) -> None:
        entry = self.cache.find(self._target(req))
        if entry.state in ("loading", "filling"):
            if not req.wait:
                raise Busy(f"entry {entry.name!r} is {entry.state}", {"state": entry.state})
            entry = await self._wait_ready(entry, req.timeout_s)
        lease = self.cache.acquire(entry, conn, conn.pid, conn.uid)
        self._send_lease(conn, req.id, lease)

    def _send_lease(self, conn: Connection, req_id: int, lease: Lease) -> None:
        entry, arena = lease.entry, lease.entry.arena
        conn.send(protocol.ok(
            req_id, lease=lease.id, kind=lease.kind, entry=entry.name, key=entry.key.model_dump(),
            manifest=entry.manifest.wire, ttl_s=self.cache.lease_ttl_s,
            arena={"kind": arena.kind, "size": arena.size, "device": arena.device}), [arena.fd()])

    async def op_reserve(self, conn: Connection, req: protocol.Reserve) -> None:
        key = req.key.model_copy(update={"device": self.canonical_device(req.key.device)})
        manifest = Manifest.build((name, dtype, shape) for name, dtype, shape in req.tensors)
        backend = backend_for(key.device)
        name = f"{key.model}#{key.digest()[:8]}"
        entry, lease, victims = self.cache.reserve(
            name, key, manifest, backend.arena_size(manifest.size, key.device), req.retention, conn,
            conn.pid, conn.uid)
        self._reclaim(victims)
        self._ready[name] = asyncio.Event()
        try:
            arena: Arena = await asyncio.to_thread(backend.create, key.device, entry.nbytes, name)
        except BaseException:
            self._reclaim(self.cache.load_failed(entry))
            raise
        if self.cache.entries.get(name) is not entry:  # the publisher vanished meanwhile
            arena.close()
            return
        entry.arena = arena
        self._send_lease(conn, req.id, lease)

    async def op_load(self, conn: Connection, req: protocol.Load) -> None:
        configured = {m.name: m for m in self.config.models}
        if req.path is None:
            model = configured.get(req.name)
            if model is None:
                raise NotFound(f"no configured model named {req.name!r}; give a path to load an unconfigured one")
            path, device, retention = model.path, req.device or model.device, req.retention or model.retention
        else:
            if conn.uid not in (0, os.getuid()):
                raise PermissionDenied("loading an arbitrary path needs root or the daemon's own user; "
                                       "configure the model instead")
            path, device, retention = Path(req.path), req.device or HOST_DEVICE, req.retention or "cached"
        entry = self.cache.entries.get(req.name)
        if entry is None:
            entry = await self._admit_load(req.name, path, device, retention, "load")
            task = self._spawn(self._fill(entry))
            if req.wait:
                await asyncio.shield(task)
        elif req.wait:
            await self._wait_ready(entry, 24 * 3600)
        conn.send(protocol.ok(req.id, entry=entry.describe()))

    async def op_verify(self, conn: Connection, req: protocol.Verify) -> None:
        entry = await self._wait_ready(self.cache.find(self._target(req)), 24 * 3600)
        # The daemon's own hold on the arena while hashing: no heartbeats, so no expiry, and its
        # own owner, so it ends here whatever happens to the connection.
        holder = object()
        lease = self.cache.acquire(entry, holder, os.getpid(), os.getuid(), ttl_s=math.inf)
        try:
            actual = await asyncio.to_thread(digest_arena, entry.arena, entry.manifest)
            if entry.origin == "publish":
                expected, source = await asyncio.shield(self._digests[entry.name]), "digest at commit"
            else:
                if not Path(entry.key.path).exists():
                    raise NotFound(f"{entry.key.path} is gone: nothing to verify {entry.name!r} against")
                ckpt = await asyncio.to_thread(Checkpoint.open, entry.key.path)
                expected, source = await asyncio.to_thread(digest_checkpoint, ckpt), str(ckpt.path)
        finally:
            self._reclaim(self.cache.release(holder, lease.id))
        mismatched = sorted(n for n in set(actual) | set(expected) if actual.get(n) != expected.get(n))
        total = hashlib.blake2b(digest_size=16)
        for name in sorted(actual):
            total.update(name.encode() + b"\0" + bytes.fromhex(actual[name]))
        conn.send(protocol.ok(req.id, entry=entry.name, match=not mismatched, against=source,
                              digest=total.hexdigest(), tensors=len(actual), mismatched=mismatched[:50]))


class _EntryProgress:
    """Load progress written by loader threads, read by the loop (status)."""

    def __init__(self, entry: Entry) -> None:
        self.entry = entry

    def add(self, n: int) -> None:
        self.entry.done_bytes += n  # a racy += only undercounts progress transiently; fine for display


def _log_failure(task: asyncio.Task[Any]) -> None:
    if task.cancelled() or task.exception() is None:
        return
    exc = task.exception()
    if isinstance(exc, WcdError):
        log.error("%s", exc.message)
    else:
        log.error("background task failed", exc_info=exc)


def _bind(path: Path, groups: list[str]) -> socket.socket:
    """Bind the listening socket with mode 0660 (group: the first allowed group, if we may)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
            raise Busy(f"another daemon already serves {path}")
        except (ConnectionRefusedError, FileNotFoundError):
            path.unlink(missing_ok=True)  # stale socket from a crashed daemon
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o117)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    os.chmod(path, 0o660)
    if groups:
        try:
            os.chown(path, -1, grp.getgrnam(groups[0]).gr_gid)
        except PermissionError:
            log.warning("cannot give %s to group %s (not root and not a member)", path, groups[0])
    sock.listen(512)
    return sock


def _close_all(fds: Iterable[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def run(config: Config, instance: str = "wcd", config_path: Path | None = None,
        passed_fds: list[tuple[int, str]] | None = None) -> int:
    """Run the daemon until SIGTERM/SIGINT. Returns the process exit status.

    `passed_fds` (from `systemd.listen_fds()`) hold the activation socket and parked arenas.
    """
    import uvloop

    listen_fd, parked = systemd.split_listener(passed_fds or [])

    async def main() -> None:
        server = Server(config, instance, listen_fd, parked, config_path)
        await server.startup()
        try:
            await server.serve()
        finally:
            await server.shutdown()

    uvloop.run(main())
    return 0
