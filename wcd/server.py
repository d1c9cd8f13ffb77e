"""The daemon's lifecycle: `startup()`, `serve()`, `shutdown()`, `reload()`, signals, and the accept loop.

Owns the listening socket, peer credentials (`SO_PEERCRED`) and who may connect (allowed, within
the `Quotas`; a connection that says no hello, or sits idle holding nothing, is closed), the background
tasks, and systemd's notifications (READY, STATUS, WATCHDOG, STOPPING, RELOADING). Must not hold
cache rules (`wcd.cache`), entry I/O (`wcd.residency`), per-client framing (`wcd.connection`) or
request handling (`wcd.ops`): it builds those rooms at start-up and wires them together.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import os
import resource
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from wcd import __version__, ops, protocol, socketpath, systemd, workers
from wcd.cache import Cache
from wcd.config import Config, load_config
from wcd.connection import Connection, Limits, Quotas, start_closers
from wcd.devices import device_budgets
from wcd.errors import BadRequest, Busy, ConfigError, NotFound, PermissionDenied, ProtocolError, WcdError
from wcd.metrics import Metrics
from wcd.metrics_http import MetricsHttp
from wcd.peers import peer_gids
from wcd.refusals import Refusals
from wcd.residency import Residency, ended
from wcd.shutdown import RELEASE_WAIT_S
from wcd.state import ServerState
from wcd.units import counted, describe_progress, format_size

log = logging.getLogger("wcd")

_PEERCRED = struct.Struct("3i")
ACCEPT_PAUSE_S = 0.1  # out of descriptors: how long to leave new connections in the backlog


class Server:
    def __init__(self, config: Config, instance: str = "wcd", listen_fd: int | None = None,
                 parked_fds: list[tuple[int, str]] | None = None, config_path: Path | None = None) -> None:
        self.instance = instance
        self.config_path = config_path  # re-read on SIGHUP
        self.listen_fd = listen_fd  # socket-activated: never unlink or shut it down
        self.notifier = systemd.Notifier()
        self.stopping = asyncio.Event()
        self.started_at = time.time()
        self._config = config  # until startup; then state.config, replaced by reload()
        self._parked_fds = parked_fds or []  # from systemd's fd store, adopted at startup
        self.metrics_http: MetricsHttp | None = None
        self._listener: socket.socket | None = None
        self._claim: socketpath.Claim | None = None  # the path we bound ourselves (not socket-activated)
        self._where = ""  # what we listen on, for status
        self._tasks: set[asyncio.Task[Any]] = set()
        self._allowed_gids = config.daemon.allowed_gids()
        self.refusals = Refusals()
        self._fd_limit = _raise_fd_limit()
        # Built by startup(), which needs the running loop and the devices' memory sizes:
        self.state: ServerState
        self.residency: Residency
        self.executor: workers.Pool  # the loop's default executor
        self.quotas: Quotas
        self._ops: ops.Context

    # -- lifecycle --------------------------------------------------------------------------

    async def startup(self) -> None:
        # The socket first: a second daemon on the same path gives up before it admits (and
        # allocates) anything. Connections wait in the backlog until the configured models are admitted.
        self._listen()
        try:
            await self._start()
        except BaseException:
            self._unlisten()
            raise

    async def _start(self) -> None:
        loop = asyncio.get_running_loop()
        self.executor = executor = workers.loop_executor()
        loop.set_default_executor(executor)
        config = self._config
        began = time.monotonic()
        budgets, devices = device_budgets(config, self.config_path or "")
        counted = time.monotonic()
        cache = Cache(budgets, config.daemon.lease_ttl_s, max_entries=config.daemon.max_entries,
                      max_entries_per_uid=config.daemon.max_entries_per_uid,
                      max_leases_per_uid=config.daemon.max_leases_per_uid,
                      keep_generations=config.daemon.keep_generations)
        self.state = ServerState(config, self.instance, cache, devices, self.started_at)
        self.state.where = self._where
        self.quotas = Quotas(self._limits(config), held_elsewhere=lambda: len(cache.entries))
        metrics = Metrics(self.state)
        self.residency = Residency(self.state, metrics, self._spawn)
        self._ops = ops.Context(self.state, self.residency, metrics)
        if config.fleet is not None:  # only then: nothing of the fleet is imported otherwise
            from wcd.fleet.service import Fleet

            self.residency.fleet = Fleet(config.fleet, self.residency)
            await self.residency.fleet.start()
        for sig, handler in ((signal.SIGTERM, self.stop), (signal.SIGINT, self.stop),
                             (signal.SIGHUP, lambda: self._spawn(self.reload()))):
            loop.add_signal_handler(sig, handler)
        self._spawn(self.residency.expire_leases())
        self._spawn(self._close_idle())
        self.residency.adopt_parked(self._parked_fds)  # served once checked, after READY
        self._parked_fds = []
        # Admit configured models before serving, so an engine that connects at once waits for
        # its model instead of getting not_found; the copies themselves run in the background.
        await asyncio.gather(*(self.residency.admit_configured(m) for m in config.models))
        admitted = time.monotonic()
        address = config.daemon.metrics_address()
        if address is not None:
            self.metrics_http = MetricsHttp(*address, metrics.text)
            await self.metrics_http.start()
        assert self._listener is not None
        loop.add_reader(self._listener.fileno(), self._accept)
        log.info("wcd %s serving %s (devices: %s)", __version__, self.state.where, ", ".join(budgets))
        self._notify("ready", self.status_line())
        ready, since_exec = time.monotonic(), _since_exec()
        log.info("ready %s after exec: until start-up %s (interpreter, imports, config), devices %.3f s, "
                 "entries %.3f s, listening %.3f s",
                 "?" if since_exec is None else f"{since_exec:.3f} s",
                 "?" if since_exec is None else f"{since_exec - (ready - began):.3f} s",
                 counted - began, admitted - counted, ready - admitted)
        self.residency.start_checks()
        workers.start_all([executor.start_all, *(pool.start_all for pool in self.residency.pools),
                           start_closers, self.residency.warm_backends,
                           self.residency.helpers.start])
        self._spawn(self._report_status())
        self._spawn(self._warm_schemas())
        self._spawn(self._warm_metrics())
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
        self._unlisten()
        self.refusals.close()
        for conn in list(self.state.connections):
            conn.close()
        self.residency.cancel_loads()
        tasks = [t for t in self._tasks if not t.done()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.residency.fleet is not None:
            await self.residency.fleet.close()
        kept = await self.residency.close()
        log.info("stopped%s", f"; {kept} entries stay parked in systemd's fd store" if kept else "")
        self.notifier.close()

    async def reload(self) -> None:
        """SIGHUP: re-read the config; load new models, evict removed or changed ones once unleased.
        A changed one still leased, loading or being checked is loaded per the new config when that
        ends (`Residency.supersede`)."""
        self._notify("reloading", "reloading configuration")
        cache, current = self.state.cache, self.state.config
        try:
            if self.config_path is None:
                raise BadRequest("no config file to re-read")
            # Paths are checked here, not by load_config: a resident model may have lost its
            # checkpoint on purpose (kept across a restart in the fd store, as at startup); only a
            # model this reload would (re)load needs one.
            new = await asyncio.to_thread(load_config, self.config_path, self.instance, False)
            old = {m.name: m for m in current.models}
            for i, model in enumerate(new.models):
                kept = old.get(model.name) == model and model.name in cache.entries
                if not kept and not await asyncio.to_thread(model.path.exists):
                    raise ConfigError(f"config {self.config_path}: models.{i}.path: {model.path} does not exist")
        except WcdError as e:
            log.error("reload failed, keeping the running configuration: %s", e.message)
            self._notify("ready", f"reload failed: {e.message}"[:200])
            return
        fresh = {m.name: m for m in new.models}
        for name, failure in list(cache.failures.items()):
            if failure.origin == "config" and name not in fresh:
                cache.forget_failure(name)  # its model left the config; a failed one still there is tried again below
        for name, model in old.items():
            if fresh.get(name) != model and name in cache.entries:
                log.info("reload: %s was removed or changed; evicting it once its leases end, or its load "
                         "or check ends", name)
                self.residency.supersede(cache.entries[name])
        if new.daemon.socket != current.daemon.socket and self.listen_fd is None:
            log.warning("reload: a new socket path takes effect on restart")
        for field, running in self.residency.sized_at_start().items():
            wanted = getattr(new.daemon, field)
            if wanted is not None and wanted != running:
                log.warning("reload: daemon.%s = %d takes effect on restart (%d now)", field, wanted, running)
        new.daemon.socket = current.daemon.socket
        self.state.config = new
        self._allowed_gids = new.daemon.allowed_gids()
        self.refusals.forget()
        cache.lease_book.ttl_s = new.daemon.lease_ttl_s
        cache.max_entries = new.daemon.max_entries
        cache.keep_generations = new.daemon.keep_generations
        cache.max_entries_per_uid = new.daemon.max_entries_per_uid
        cache.lease_book.max_per_uid = new.daemon.max_leases_per_uid
        self.quotas.limits = self._limits(new)
        for model in fresh.values():
            if model.name not in cache.entries:
                await self.residency.admit_configured(model)
        log.info("reloaded %s", self.config_path)
        self._notify("ready", self.status_line())

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """A background task that shutdown() cancels; its failure is logged."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_log_failure)
        return task

    # -- accepting connections --------------------------------------------------------------

    @staticmethod
    async def _warm_schemas() -> None:
        """Build the request schemas no request has built yet, one per turn of the loop, once READY
        is sent: 0.4-2.5 ms each on the VM, so a request waits behind at most one, and the first
        request of an op does not pay for its schema (and no first `reserve` builds one while a
        peer's ping waits). A thread would hold the GIL against the loop for the whole build."""
        for schema in protocol.unbuilt():
            await asyncio.sleep(0)
            schema.model_rebuild()

    async def _warm_metrics(self) -> None:
        """Import prometheus-client in a thread once start-up's own work is done (the checks of
        re-adopted entries take ~0.2 s after READY), so that the first scrape does not pay for it."""
        await asyncio.sleep(1.0)
        await asyncio.to_thread(Metrics.warm)

    def _listen(self) -> None:
        """Take the listening socket (passed by systemd, or bound and locked here); not yet accepting."""
        daemon = self._config.daemon
        if self.listen_fd is not None:
            sock = socket.socket(fileno=self.listen_fd)
            self._where = f"socket-activated fd {self.listen_fd}"
        else:
            assert daemon.socket is not None
            self._claim = socketpath.claim(daemon.socket, daemon.allowed_groups)
            sock = self._claim.sock
            self._where = str(daemon.socket)
        sock.setblocking(False)
        self._listener = sock

    def _unlisten(self) -> None:
        """Stop accepting; give back the path we bound (systemd's socket stays open: it is systemd's)."""
        if self._listener is None:
            return
        asyncio.get_running_loop().remove_reader(self._listener.fileno())
        if self._claim is not None:
            self._claim.release()
        else:
            self._listener.detach()
        self._listener = None

    def _accept(self) -> None:
        assert self._listener is not None
        for _ in range(64):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE):
                    # The budgets keep a reserve below RLIMIT_NOFILE, so this is something else's
                    # doing; wait instead of spinning on a listener that stays readable.
                    log.error("out of file descriptors (%d in use by peers and entries); raise LimitNOFILE",
                              self.quotas.fds_in_use())
                    loop = asyncio.get_running_loop()
                    loop.remove_reader(self._listener.fileno())
                    loop.call_later(ACCEPT_PAUSE_S, loop.add_reader, self._listener.fileno(), self._accept)
                return
            pid, uid, gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
            # Refused before anything is set up for the connection: a flood of them costs the loop
            # an accept and a send each, and the log a line per uid and interval.
            if not self.refusals.denied(uid) and not self._allowed(uid, gid):
                self.refusals.deny(uid)  # for the interval: a flood costs no look-ups of users and groups
            if self.refusals.denied(uid):
                self.refusals.refuse(sock, uid, pid, PermissionDenied(
                    f"uid {uid} is not allowed to use this daemon: add it to allowed_uids, or the user to a "
                    f"group in allowed_groups, in the daemon's config", {"uid": uid}), "not allowed")
                continue
            refusal = self.quotas.refusal(uid)
            if refusal is not None:
                self.refusals.refuse(sock, uid, pid, refusal, str(refusal.details.get("limit", "busy")))
                continue
            sock.setblocking(False)
            conn = Connection(sock, pid, uid, gid, functools.partial(ops.dispatch, self._ops), self._connection_lost,
                              self.quotas)
            self.state.connections.add(conn)

    def _allowed(self, uid: int, gid: int) -> bool:
        if uid == os.getuid() or uid in self.state.config.daemon.allowed_uids:
            return True
        if not self._allowed_gids:
            return False
        return not self._allowed_gids.isdisjoint(peer_gids(uid, gid))

    def _connection_lost(self, conn: Connection) -> None:
        self.state.connections.discard(conn)
        self.state.watchers.drop(conn)
        for entry in self.state.cache.drop_owner(conn):
            how = "its publisher's connection closed before the commit" if entry.state == "filling" else \
                f"the connection holding its last lease closed (pid {conn.pid}, uid {conn.uid})"
            self.residency.reclaim([entry], ended(entry, how))

    async def _close_idle(self) -> None:
        """Forever: close connections that said no hello in time, take too long over a request, or sit
        silent holding nothing."""
        loop = asyncio.get_running_loop()
        while True:
            daemon = self.state.config.daemon
            await asyncio.sleep(min(1.0, daemon.hello_timeout_s / 4, daemon.idle_timeout_s / 4,
                                    daemon.frame_timeout_s / 4))
            now = loop.time()
            for conn in list(self.state.connections):
                if not conn.hello and now - conn.opened_at > daemon.hello_timeout_s:
                    conn.fail(Busy(f"no hello within {daemon.hello_timeout_s:g} s of connecting (hello_timeout_s)",
                                   {"limit": "hello_timeout_s"}))
                elif conn.frame_overdue(now, daemon.frame_timeout_s):
                    conn.fail(ProtocolError(f"a request still not whole {daemon.frame_timeout_s:g} s after its first "
                                            "byte (frame_timeout_s): send each request whole"))
                elif (now - conn.last_active > daemon.idle_timeout_s and not conn.tasks
                      and not self.state.cache.lease_book.count_of(conn)):
                    # Quietly: the client library reconnects on its next request.
                    log.info("%r: idle for %g s without leases (idle_timeout_s); closing it", conn,
                             daemon.idle_timeout_s)
                    conn.close()

    def _limits(self, config: Config) -> Limits:
        d = config.daemon
        return Limits(d.max_connections, d.max_connections_per_uid, d.max_buffer_bytes, d.max_buffer_bytes_per_uid,
                      d.max_fds_per_connection, d.max_fds_per_uid, self._fd_limit - _fd_reserve(self._fd_limit))

    # -- systemd: notifications and the watchdog --------------------------------------------

    def _notify(self, what: str, arg: str | None = None) -> None:
        """One sd_notify call; a failure is logged, never fatal (the daemon serves without systemd)."""
        try:
            if arg is None:
                getattr(self.notifier, what)()
            else:
                getattr(self.notifier, what)(arg)
        except (systemd.SystemdError, ValueError) as e:
            log.warning("systemd: %s", e)

    def status_line(self) -> str:
        cache = self.state.cache
        loading = [e for e in cache.entries.values() if e.state == "loading"]
        if loading:
            e = loading[0]
            more = f" (+{len(loading) - 1} more)" if len(loading) > 1 else ""
            return f"loading {e.name} {describe_progress(e.describe()['progress'])}{more}"
        held = sum(e.nbytes for e in cache.entries.values())
        failed = ""
        if cache.failures:
            name, failure = next(reversed(cache.failures.items()))
            more = f" (+{len(cache.failures) - 1} more)" if len(cache.failures) > 1 else ""
            failed = f"; {name} failed: {failure.reason}{more}"
        return (f"serving {counted(len(cache.entries), 'entry')}, {counted(len(cache.leases), 'lease')}, "
                f"{format_size(held)}{failed}")

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


async def _drained(executor: workers.Pool, timeout: float) -> bool:
    """Whether the loop's executor and every other worker thread (the load and digest pools) end
    within `timeout` s; asyncio would otherwise join them at exit without a limit. (Not through
    `loop.shutdown_default_executor`: cancelled at the limit, it joins the executor's thread on the loop.)"""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    executor.shutdown(wait=False)
    threads = [t for t in threading.enumerate() if t is not threading.current_thread() and not t.daemon]
    while any(t.is_alive() for t in threads) and loop.time() < deadline:
        await asyncio.sleep(0.02)
    return not any(t.is_alive() for t in threads)


def _log_failure(task: asyncio.Task[Any]) -> None:
    """A background task's failure, one line. `NotFound` is what a fill ends with when its entry was
    evicted meanwhile (an operator's evict, a reload): said, not an error of the daemon's."""
    if task.cancelled() or task.exception() is None:
        return
    exc = task.exception()
    if isinstance(exc, WcdError):
        log.log(logging.INFO if isinstance(exc, NotFound) else logging.ERROR, "%s", exc.message)
    else:
        log.error("background task failed", exc_info=exc)


def _raise_fd_limit() -> int:
    """Raise RLIMIT_NOFILE's soft limit to the hard one (peers and arenas take one each); the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def _fd_reserve(limit: int) -> int:
    """Descriptors kept out of every budget: for accepting a peer to tell it `busy`, loads' checkpoint
    files, the fd store's records, logging."""
    return max(64, limit // 8)


def _since_exec() -> float | None:
    """Seconds since this process started (its start time in /proc, 10 ms ticks); None if unknown."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        return time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def run(config: Config, instance: str = "wcd", config_path: Path | None = None,
        passed_fds: list[tuple[int, str]] | None = None) -> int:
    """Run the daemon until SIGTERM/SIGINT. Returns the process exit status.

    `passed_fds` (from `systemd.listen_fds()`) hold the activation socket and parked arenas.
    """
    import uvloop

    # Worker threads run Python too (layouts, digests of small tensors): with the default 5 ms
    # switch interval the loop can wait that long for the GIL several times per request.
    sys.setswitchinterval(0.001)
    listen_fd, parked = systemd.split_listener(passed_fds or [])

    async def main() -> None:
        server = Server(config, instance, listen_fd, parked, config_path)
        await server.startup()
        try:
            await server.serve()
        finally:
            await server.shutdown()
        # The loop's executor and the load pools would join hung threads at exit until systemd's stop
        # timeout kills us: everything is said and parked by now, so then go without them.
        hung = server.residency.hung  # said by Residency.close
        if not hung and not await _drained(server.executor, RELEASE_WAIT_S):
            log.warning("shutdown: worker threads still busy after %g s (in a hung GPU driver?): exiting "
                        "without them", RELEASE_WAIT_S)
            hung = True
        if hung:
            logging.shutdown()
            os._exit(0)

    uvloop.run(main())
    return 0
