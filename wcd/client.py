"""Synchronous client for engine processes and wcdctl: connect, ops, leases, heartbeats, publish.

One Unix socket per `Client`, safe to share between threads: requests carry ids and whichever
thread is waiting reads the socket and hands other threads their replies, so a long `acquire`
never delays a heartbeat. A background thread renews every live lease every TTL/3. Error
replies become the `wcd.errors` classes.

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
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any

from wcd import __version__, wire
from wcd.errors import BadReply, DaemonUnavailable, PermissionDenied, ProtocolError, WcdError, from_wire
from wcd.manifest import TENSOR_COLUMNS, Manifest
from wcd.replies import decoding, entry_name, field, one_fd, validated_manifest

if TYPE_CHECKING:
    import torch

    from wcd.follower import Follower
    from wcd.key import WeightCacheKey
    from wcd.views import MappedArena

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


class Lease:
    """A read lease: zero-copy tensor views of a resident entry, kept alive by heartbeats.

    Views stay valid after `release()` (and if the daemon dies), for host and CUDA arenas alike:
    the mapping lives as long as any view and is unmapped when the last one is freed.
    """

    kind = "read"

    def __init__(self, client: Client, reply: dict[str, Any], fd: int, mapping: str = "map") -> None:
        """`mapping`: "map" the arena, map it "remappable" (`Follower`), or keep its "fd" unmapped
        (to be mapped in place of another generation: `Follower`)."""
        self.client = client
        self.lost = False  # set when a heartbeat finds the daemon no longer holds this lease
        self.released = False
        self._mapped: MappedArena | None = None
        self._arena_fd: int | None = None
        try:
            with decoding(f"{self.kind} lease reply"):
                self.id: int = field(reply, "lease", int)
            self.entry: str = entry_name(reply)
            self._key_wire = reply.get("key")
            # Whose bytes these are: the daemon's own loads ("config"/"load") or a publisher's uid.
            self.origin: str | None = reply.get("origin")
            self.publisher_uid: int | None = reply.get("publisher_uid")
            self.asked_by: int | None = reply.get("asked_by")  # whose `load` made it (origin "load")
            with decoding(f"the manifest of {self.entry!r}"):
                self.manifest = validated_manifest(reply.get("manifest"))
                self.arena: dict[str, Any] = field(reply, "arena", dict)
        except BaseException:
            os.close(fd)
            if hasattr(self, "id"):
                self.client._end_lease(self, "abort" if self.kind == "fill" else "release")
            raise
        if mapping == "fd":
            self._arena_fd = fd
            return
        try:
            from wcd.views import map_arena

            with decoding(f"the arena of {self.entry!r}"):
                self._mapped = map_arena(self.arena, fd, self.manifest, writable=self.kind == "fill",
                                         remappable=mapping == "remappable")
        except BaseException:
            self.client._end_lease(self, "abort" if self.kind == "fill" else "release")
            raise

    @property
    def key(self) -> WeightCacheKey:
        """The entry's full key (validated on first use: it needs pydantic, an attach does not)."""
        from wcd.key import WeightCacheKey

        if not isinstance(self._key_wire, WeightCacheKey):
            with decoding(f"the key of {self.entry!r}"):
                self._key_wire = WeightCacheKey.model_validate(self._key_wire)
        return self._key_wire

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        if self._mapped is None:
            raise WcdError(f"lease {self.id} on {self.entry} is released: its views are gone")
        return self._mapped.tensors

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        if self._mapped is not None:
            self._mapped.close()
            self._mapped = None
        self._close_fd()
        self.client._end_lease(self, "release")

    def _close_fd(self) -> None:
        if self._arena_fd is not None:
            os.close(self._arena_fd)
            self._arena_fd = None

    def _adopt_mapping(self, mapped: MappedArena) -> None:
        """This lease's arena is now what `mapped` maps (`Follower`): its fd is no longer needed."""
        self._mapped = mapped
        self._close_fd()

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"<wcd.Lease {self.id} {self.kind} {self.entry} {len(self.manifest)} tensors>"


class FillLease(Lease):
    """A fill lease from `reserve`: writable views of a fresh arena; `commit()` or `abort()`."""

    kind = "fill"

    def commit(self) -> str:
        """Make the entry ready for everyone. Every reference to `tensors` must be dropped first."""
        if self._mapped is not None:
            self._mapped.unmap_writable()
            self._mapped = None
        reply = self.client.request("commit", lease=self.id)
        self.released = True
        self.client._forget(self)
        return entry_name(reply)

    def abort(self) -> None:
        if self._mapped is not None:
            self._mapped.close()
            self._mapped = None
        if not self.released:
            self.released = True
            self.client._end_lease(self, "abort")

    def release(self) -> None:
        self.abort()

    def __exit__(self, *exc: object) -> None:
        if not self.released:
            self.abort()


class Client:
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
        reply, fds = self._wait(req_id)
        if not reply.get("ok"):
            for fd in fds:
                os.close(fd)
            raise from_wire(reply.get("error"))
        return reply, fds

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

    def _end_lease(self, lease: Lease, op: str) -> None:
        self._forget(lease)
        if lease.lost or self._broken is not None:
            return  # nothing left to end on the daemon's side
        self.request(op, lease=lease.id)

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

    def next_event(self, timeout: float | None = None) -> dict[str, Any] | None:
        """The next announcement of a watched series (`watch`), waiting up to `timeout` s (None:
        for ever); None if none came. Reads the socket itself when no other thread is reading,
        at least once even with a timeout of 0. A connection the daemon closed (it restarted) is
        opened again, watches included."""
        deadline = None if timeout is None else time.monotonic() + timeout
        tried = False
        while True:
            with self._cond:
                while True:
                    if self._events:
                        return self._events.popleft()
                    broken = self._broken
                    if broken is not None and not isinstance(broken, DaemonUnavailable):
                        raise broken
                    left = None if deadline is None else max(0.0, deadline - time.monotonic())
                    if broken is None and tried and left is not None and left <= 0:
                        return None
                    if broken is None and not self._reading:
                        self._reading = True
                        break
                    if broken is not None:
                        break
                    self._cond.wait(left)
            if broken is not None:
                self.ping()  # reconnects and watches again, or raises DaemonUnavailable
                continue
            try:
                tried = True
                self._read_for(left)
            finally:
                with self._cond:
                    self._reading = False
                    self._cond.notify_all()

    def _read_for(self, timeout: float | None) -> None:
        """`_read_some` once a frame has begun to arrive, waiting for that up to `timeout` s (None:
        for ever): an idle wait is not the socket's timeout, which would end the connection."""
        if not self._decoder.has_frame() and not _select.select([self.sock], [], [], timeout)[0]:
            return
        self._read_some()

    def announced(self, series: str) -> int | None:
        """The generation of `series` last announced or seen current on this connection."""
        with self._cond:
            return self._latest.get(series)

    def watch(self, series: str) -> int:
        """Be told (`next_event`) when a generation of `series` becomes current; its current one now (0: none)."""
        generation = int(self.request("watch", series=series)["generation"])
        self._watching.add(series)
        with self._cond:
            self._latest[series] = generation
        return generation

    def unwatch(self, series: str) -> None:
        self.request("watch", series=series, stop=True)
        self._watching.discard(series)

    def rollback(self, series: str, generation: int | None = None) -> dict[str, Any]:
        """Make a kept previous generation of `series` current again (its followers are told)."""
        fields: dict[str, Any] = {"series": series}
        if generation is not None:
            fields["generation"] = generation
        return self.request("rollback", **fields)

    def follow(self, series: str, *, copy_into: Mapping[str, torch.Tensor] | None = None) -> Follower:
        """Acquire the current generation of `series` and follow it (`wcd.follower.Follower`)."""
        from wcd.follower import Follower

        return Follower(self, series, copy_into)

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

    def _acquire_generation(self, series: str, generation: int | None, mapping: str) -> Lease:
        """A lease on the current generation of `series`, or on generation `generation` of it."""
        target = {"series": series} if generation is None else {"name": f"{series}@{generation}"}
        reply, fds = self.request_fds("acquire", wait=False, **target)
        return self._track(Lease(self, reply, one_fd(fds), mapping=mapping))

    def reserve(self, key: WeightCacheKey, tensors: Mapping[str, tuple[Any, tuple[int, ...]]], *,
                retention: str = "cached", series: str | None = None) -> FillLease:
        """A fill lease on a fresh arena laid out for `tensors` ({name: (dtype, shape)})."""
        from wcd.views import wire_dtype

        rows = [(name, dtype if isinstance(dtype, str) else wire_dtype(dtype), list(shape))
                for name, (dtype, shape) in tensors.items()]
        columns = Manifest.build(rows).to_wire()  # cheap for the daemon to check at 10^5 tensors
        listing: dict[str, Any] = {"columns": {k: columns[k] for k in TENSOR_COLUMNS}}
        if series is not None:
            listing["series"] = series
        reply, fds = self.request_fds("reserve", key=key.model_dump(), retention=retention, **listing)
        return self._track(FillLease(self, reply, one_fd(fds)))  # type: ignore[return-value]

    def publish(self, key: WeightCacheKey, tensors: Mapping[str, torch.Tensor], *, retention: str = "cached",
                series: str | None = None) -> str:
        """Reserve, copy `tensors` in, commit. Returns the new entry's name. With `series`, the entry
        is that series' next generation (`publish_generation`)."""
        fill = self.reserve(key, {n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()}, retention=retention,
                            series=series)
        try:
            views = fill.tensors
            for name, t in tensors.items():
                views[name].copy_(t, non_blocking=True)
            if views and next(iter(views.values())).is_cuda:
                import torch

                torch.cuda.synchronize(next(iter(views.values())).device)
            del views
            return fill.commit()
        except BaseException:
            fill.abort()
            raise

    def publish_generation(self, series: str, tensors: Mapping[str, torch.Tensor], *, device: str | None = None,
                           retention: str = "cached") -> int:
        """Publish `tensors` as the next generation of `series` and make it current; returns its
        number. The first generation fixes the series' layout (names, dtypes, shapes, order);
        each next one must match it. `device`: where the arena lives (default: the tensors' GPU,
        by UUID, or host memory for CPU tensors)."""
        from wcd.key import WeightCacheKey

        if device is None:
            from wcd.follower import device_of

            device = device_of(tensors)
        key = WeightCacheKey(model=series, transform="generations", device=device)
        name = self.publish(key, tensors, retention=retention, series=series)
        return int(name.rpartition("@")[2])

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
