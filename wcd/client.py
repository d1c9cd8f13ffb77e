"""Synchronous client for engine processes and wcdctl: connect, ops, leases, heartbeats.

One Unix socket per `Client`, safe to share between threads: requests carry ids and whichever
thread is waiting reads the socket and hands other threads their replies, so a long `acquire`
never delays a heartbeat. A background thread renews every live lease every TTL/3. Error
replies become the `wcd.errors` classes. Publishing and series (watch, follow, rollback) are in
`wcd.publishing`, the engine's side of a lease in `wcd.lease`; `Client` has them all.

An engine imports this on its start-up clock, so it imports only the framing (`wcd.wire`), the
manifest and the errors: no pydantic, no request schemas (validating requests is the daemon's
job), no torch until tensors are touched, and `WeightCacheKey` only where a caller uses one.
"""

from __future__ import annotations

import builtins
import itertools
import logging
import os
import select as _select
import socket
import stat
import struct
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

from wcd import __version__, wire
from wcd.errors import BadReply, DaemonUnavailable, PermissionDenied, ProtocolError, WcdError, from_wire
from wcd.lease import FillLease, Lease
from wcd.publishing import Publishing
from wcd.replies import field, one_fd

if TYPE_CHECKING:
    from wcd.key import WeightCacheKey

__all__ = ["Client", "FillLease", "Lease", "connect", "default_socket"]

log = logging.getLogger("wcd.client")

_ANC = socket.CMSG_SPACE(wire.MAX_FDS_PER_FRAME * 4)
_PEERCRED = struct.Struct("3i")


def default_socket() -> str:
    path = os.environ.get("WCD_SOCKET")
    if not path:
        raise DaemonUnavailable("no daemon socket given: pass one or set WCD_SOCKET (e.g. /run/wcd/NAME.sock)")
    return path


def _not_listening(path: str) -> str:
    """Why nothing answers at `path`: no daemon there, or not a socket at all (a config file, say)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        mode = stat.S_IFSOCK
    if stat.S_ISSOCK(mode):
        return f"daemon not running at {path} (is wcd@NAME.socket started?)"
    what = "a directory" if stat.S_ISDIR(mode) else "a regular file" if stat.S_ISREG(mode) else "a special file"
    return f"{path} is not a socket but {what}: pass the daemon's socket (/run/wcd/NAME.sock)"


class Client(Publishing):
    """A connection to one daemon. `Client()` uses $WCD_SOCKET.

    `server_uid` (a uid or several) is who must serve the socket, checked with SO_PEERCRED before
    anything is sent: a socket in a directory others can write to may have been swapped for
    theirs. A socket-activated daemon's listener belongs to root (systemd), so include 0 there.
    None (default) checks nothing; `wcd.integrations.trust.server_uids()` is what integrations use.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *, name: str = "",
                 timeout: float | None = None, heartbeats: bool = True,
                 server_uid: int | Collection[int] | None = None) -> None:
        self.path = os.fspath(path) if path is not None else default_socket()
        self.name = name or f"wcd-client {__version__} pid {os.getpid()}"
        self._server_uids = None if server_uid is None else (
            frozenset([server_uid]) if isinstance(server_uid, int) else frozenset(server_uid))
        self._timeout = timeout
        self._ids = itertools.count(1)
        self._send_lock = threading.RLock()  # reentrant: a reconnect sends hello while holding it
        self._cond = threading.Condition()
        self._replies: dict[int | None, tuple[dict[str, Any], list[int]]] = {}
        self._unawaited: set[int] = set()  # requests whose replies are dropped as they are read
        self._reading = False
        self._broken: WcdError | None = None
        self._decoder = wire.FrameDecoder(max_array=wire.MAX_REPLY_ARRAY)
        self._leases: dict[int, Lease] = {}
        self._events: deque[dict[str, Any]] = deque(maxlen=1024)  # announcements of watched series
        self._watching: set[str] = set()
        self._latest: dict[str, int] = {}  # series -> its current generation as last told
        self._stop = threading.Event()
        self._heartbeat_thread: threading.Thread | None = None
        self._heartbeats = heartbeats
        self._connect()
        self._preload_mapping()

    def _connect(self) -> None:
        """Open the socket and say hello (again, after the daemon restarted)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.settimeout(self._timeout)
        try:
            sock.connect(self.path)
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            raise DaemonUnavailable(_not_listening(self.path)) from None
        except PermissionError:
            sock.close()
            raise PermissionDenied(f"{self.path}: permission denied (join the socket's group, usually 'wcd')",
                                   {"stage": "connect"}) from None
        except OSError as e:
            sock.close()
            raise DaemonUnavailable(f"cannot connect to {self.path}: {e.strerror}") from None
        pid, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        if self._server_uids is not None and uid not in self._server_uids:
            sock.close()
            expected = " or ".join(map(str, sorted(self._server_uids)))
            raise PermissionDenied(
                f"{self.path} is served by uid {uid} (pid {pid}), not by uid {expected}: refusing to talk to it "
                "(if that is your daemon, pass server_uid= or set WCD_SERVER_UID)",
                {"stage": "server", "uid": uid, "expected": sorted(self._server_uids)})
        self.server_pid, self.server_uid = pid, uid  # of the listening socket's owner (systemd when socket-activated)
        self.sock = sock
        try:
            self.server = self.request("hello", versions=list(wire.SUPPORTED_VERSIONS), client=self.name)
        except BaseException:
            self.sock.close()
            raise
        self.lease_ttl_s: float = self.server["lease_ttl_s"]

    def _reconnect(self) -> None:
        """The connection broke (daemon restarted): leases held on it are gone; connect anew."""
        with self._cond:
            lost, self._leases = list(self._leases.values()), {}
            for _, fds in self._replies.values():
                for fd in fds:
                    os.close(fd)
            self._replies.clear()
            self._unawaited.clear()
        for lease in lost:
            lease.lost = True
        self.sock.close()
        for fd in self._decoder.take_fds():
            os.close(fd)
        self._decoder = wire.FrameDecoder(max_array=wire.MAX_REPLY_ARRAY)
        self._broken = None  # _connect's hello goes through request_fds
        try:
            self._connect()
        except WcdError as e:
            self._broken = e if isinstance(e, DaemonUnavailable) else DaemonUnavailable(e.message)
            raise
        log.info("wcd: reconnected to %s (%d lease(s) from the old connection are lost)", self.path, len(lost))
        for series in list(self._watching):  # watches belong to a connection: ask again on the new one
            try:
                self.watch(series)  # its reply says which generation is current now
            except WcdError as e:
                self._watching.discard(series)
                log.warning("wcd: no longer told of %s's generations: %s", series, e.message)

    def _preload_mapping(self) -> None:
        """Import the mapping code at connect time, not inside the first attach (an engine connects
        early): cuda-bindings alone takes ~20 ms to import. Only in processes that already use
        torch, so wcdctl stays light; a failure here resurfaces, with its message, at acquire."""
        if "torch" not in sys.modules:
            return
        try:
            import wcd.views  # noqa: F401

            if "cuda-arenas" in self.server.get("features", ()):
                import wcd.arenas.cuda_map  # noqa: F401
        except ImportError:
            pass

    # -- plumbing ---------------------------------------------------------------------------

    def request(self, op: str, **fields: Any) -> dict[str, Any]:
        reply, fds = self.request_fds(op, **fields)
        for fd in fds:
            os.close(fd)
        return reply

    def request_fds(self, op: str, **fields: Any) -> tuple[dict[str, Any], list[int]]:
        """Send one request and wait for its reply; returns the reply and the fds it carried."""
        reply, fds = self._wait(self._send(op, fields))
        if not reply.get("ok"):
            for fd in fds:
                os.close(fd)
            raise from_wire(reply.get("error"))
        return reply, fds

    def send_unawaited(self, op: str, **fields: Any) -> None:
        """Send one request without waiting for its reply, which is dropped when it is read (an
        error logged): for what nothing after it depends on, like ending a lease left behind."""
        with self._cond:
            req_id = next(self._ids)
            self._unawaited.add(req_id)
        self._send(op, fields, req_id)

    def _send(self, op: str, fields: dict[str, Any], req_id: int | None = None) -> int:
        if req_id is None:
            req_id = next(self._ids)
        data = wire.encode({"op": op, "id": req_id, **fields})
        with self._send_lock:
            if isinstance(self._broken, DaemonUnavailable) and not self._stop.is_set():
                self._reconnect()  # raises DaemonUnavailable while the daemon is still down
            elif self._broken is not None:
                raise self._broken
            try:
                self.sock.sendall(data)
            except OSError as e:
                # The daemon may have said why before closing (e.g. permission_denied at accept).
                parting = self._parting_error()
                if parting is None and not self._leases and op != "hello":
                    # Closed quietly while this client held nothing (the daemon's idle_timeout_s):
                    # nothing is lost by connecting again, once.
                    self._reconnect()
                    self._send_again(data)
                else:
                    self._fail(parting or DaemonUnavailable(f"connection to {self.path} lost ({e.strerror or e})"))
        return req_id

    def _send_again(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except OSError as e:
            self._fail(DaemonUnavailable(f"connection to {self.path} lost ({e.strerror or e})"))

    def _wait(self, req_id: int) -> tuple[dict[str, Any], list[int]]:
        with self._cond:
            while True:
                if req_id in self._replies:
                    return self._replies.pop(req_id)
                if None in self._replies:  # a stream-level error from the daemon is everyone's
                    raise from_wire(self._replies[None][0].get("error"))
                if self._broken is not None:
                    raise self._broken
                if not self._reading:
                    break
                self._cond.wait()
            self._reading = True
        try:
            self._read_some()
        finally:
            with self._cond:
                self._reading = False
                self._cond.notify_all()
        return self._wait(req_id)

    def _read_some(self) -> None:
        """Read from the socket until at least one complete frame has arrived (leader only)."""
        while True:
            try:
                item = self._decoder.next_message()
            except ProtocolError as e:
                self._fail(e)
            if item is not None:
                msg, fds = item
                with self._cond:
                    if "event" in msg and msg.get("id") is None:  # unasked: a watched series changed
                        for fd in fds:
                            os.close(fd)
                        if isinstance(msg.get("series"), str) and isinstance(msg.get("generation"), int):
                            self._latest[msg["series"]] = msg["generation"]
                        self._events.append(msg)
                        self._cond.notify_all()
                    elif msg.get("id") in self._unawaited:
                        self._unawaited.discard(msg["id"])
                        for fd in fds:
                            os.close(fd)
                        if not msg.get("ok"):
                            log.debug("wcd: a request not waited for failed: %s", msg.get("error"))
                    else:
                        self._replies[msg.get("id")] = (msg, fds)
                return
            try:
                data, anc, flags, _ = self.sock.recvmsg(256 * 1024, _ANC, socket.MSG_CMSG_CLOEXEC)
            except TimeoutError:
                self._fail(DaemonUnavailable(f"no reply from the daemon at {self.path} within the timeout"))
            except OSError as e:
                self._fail(DaemonUnavailable(f"connection to {self.path} lost ({e.strerror or e})"))
            fds = wire.fds_from_ancillary(anc)
            if not data:
                for fd in fds:
                    os.close(fd)
                self._fail(DaemonUnavailable(f"the daemon at {self.path} closed the connection"))
            self._decoder.feed(data, fds)

    def _parting_error(self) -> WcdError | None:
        """A stream-level error frame the daemon sent before closing, if one is waiting to be read."""
        with self._cond:
            if self._reading:
                return None
            self._reading = True
        try:
            self._read_some()
        except WcdError:
            pass
        finally:
            with self._cond:
                self._reading = False
        reply = self._replies.pop(None, None)
        return from_wire(reply[0].get("error")) if reply else None

    def _fail(self, err: WcdError) -> Any:
        with self._cond:
            if self._broken is None:
                self._broken = err
            self._cond.notify_all()
        raise err

    # -- leases and heartbeats --------------------------------------------------------------

    def _track(self, lease: Lease) -> Lease:
        with self._cond:
            self._leases[lease.id] = lease
        if self._heartbeats and self._heartbeat_thread is None:
            self._heartbeat_thread = threading.Thread(target=self._heartbeat_loop, name="wcd-heartbeat", daemon=True)
            self._heartbeat_thread.start()
        return lease

    def _forget(self, lease: Lease) -> None:
        with self._cond:
            self._leases.pop(lease.id, None)

    def _end_lease(self, lease: Lease, op: str, wait: bool = True) -> None:
        self._forget(lease)
        if lease.lost or self._broken is not None:
            return  # nothing left to end on the daemon's side
        if wait:
            self.request(op, lease=lease.id)
        else:
            self.send_unawaited(op, lease=lease.id)

    def _heartbeat_loop(self) -> None:
        interval = self.lease_ttl_s / 3
        while not self._stop.wait(interval):
            with self._cond:
                ids = list(self._leases)
            if not ids:
                continue
            try:
                lost = self.request("heartbeat", leases=ids)["lost"]
            except WcdError as e:
                log.warning("wcd: heartbeat failed (%s); leases are lost, attached views stay usable", e.message)
                lost = ids
            for lease_id in lost:
                with self._cond:
                    lease = self._leases.pop(lease_id, None)
                if lease is not None:
                    lease.lost = True
                    log.warning("wcd: lease %d on %s was lost (expired or daemon restarted)", lease_id, lease.entry)

    def _read_for(self, timeout: float | None) -> None:
        """`_read_some` once a frame has begun to arrive, waiting for that up to `timeout` s (None:
        for ever): an idle wait is not the socket's timeout, which would end the connection."""
        if not self._decoder.has_frame() and not _select.select([self.sock], [], [], timeout)[0]:
            return
        self._read_some()

    @property
    def leases(self) -> list[Lease]:
        with self._cond:
            return list(self._leases.values())

    # -- ops --------------------------------------------------------------------------------

    def ping(self) -> None:
        self.request("ping")

    def status(self) -> dict[str, Any]:
        return self.request("status")

    def list(self) -> builtins.list[dict[str, Any]]:
        return self.request("list")["entries"]

    def list_leases(self) -> builtins.list[dict[str, Any]]:
        """Every lease the daemon shows this peer (admins: all), asked a page at a time."""
        leases, after = [], 0
        while True:
            page = self.request("leases", after=after)
            leases += field(page, "leases", list)
            cursor = page.get("next")
            if cursor is None:
                return leases
            if type(cursor) is not int or cursor <= after:  # a cursor that does not move on would loop
                raise BadReply(f"leases reply: cursor {cursor!r:.40} does not follow {after}")
            after = cursor

    def metrics(self) -> str:
        return str(self.request("metrics")["text"])

    def load(self, name: str, path: str | os.PathLike[str] | None = None, *, device: str | None = None,
             retention: str | None = None, wait: bool = False) -> dict[str, Any]:
        fields: dict[str, Any] = {"name": name, "wait": wait}
        if path is not None:
            fields["path"] = os.path.abspath(os.fspath(path))
        if device is not None:
            fields["device"] = device
        if retention is not None:
            fields["retention"] = retention
        return self.request("load", **fields)["entry"]

    def evict(self, target: str | WeightCacheKey) -> dict[str, Any]:
        return self.request("evict", **_target(target))

    def verify(self, target: str | WeightCacheKey) -> dict[str, Any]:
        return self.request("verify", **_target(target))

    def acquire(self, target: str | WeightCacheKey, *, wait: bool = True, timeout_s: float = 3600.0,
                digest: str | None = None) -> Lease:
        """A read lease on an entry (by entry name or exact key), waiting while it loads. With
        `digest` (the full content digest `verify` reports) the daemon attaches only an entry
        holding exactly those bytes (it hashes an entry once, at commit or at the first such ask)."""
        checked = {} if digest is None else {"digest": digest}
        reply, fds = self.request_fds("acquire", wait=wait, timeout_s=timeout_s, **_target(target), **checked)
        return self._track(Lease(self, reply, one_fd(fds)))

    # -- lifetime ---------------------------------------------------------------------------

    def close(self) -> None:
        """Close the connection. The daemon ends this connection's leases; mapped views stay usable."""
        self._stop.set()
        if self._heartbeat_thread is not None and self._heartbeat_thread is not threading.current_thread():
            self._heartbeat_thread.join(timeout=5)
        with self._cond:
            self._leases.clear()
        try:
            self.sock.close()
        finally:
            for fd in self._decoder.take_fds():
                os.close(fd)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(path: str | os.PathLike[str] | None = None, *, wait_s: float = 0.0,
            while_alive: Callable[[], bool] | None = None, **kwargs: Any) -> Client:
    """A `Client`, retrying for up to `wait_s` seconds while the daemon starts (an engine started
    alongside it). `while_alive` ends the wait early when it returns False (the daemon exited)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return Client(path, **kwargs)
        except DaemonUnavailable:
            if time.monotonic() >= deadline or (while_alive is not None and not while_alive()):
                raise
            time.sleep(0.02)


def _target(target: str | WeightCacheKey) -> dict[str, Any]:
    if isinstance(target, str):
        return {"name": target}
    return {"key": target.model_dump()}
