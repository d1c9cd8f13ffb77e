"""One client connection: frames in through `protocol.FrameDecoder`, replies (with fds) out through sendmsg.

Owns the socket, SCM_RIGHTS in both directions, the input and output buffers and what peers may
hold (`Quotas`: connections, buffered bytes and descriptors, per connection, per uid and in all),
and closing descriptors off the loop (`discard`). Raw non-blocking sockets driven by
`add_reader`/`add_writer`, because asyncio transports cannot carry SCM_RIGHTS. Must not know
ops: each decoded message goes to the `on_message` callback, and the end of the connection to
`on_close`.
"""

from __future__ import annotations

import array
import asyncio
import logging
import os
import queue
import socket
import stat
import struct
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from wcd import protocol
from wcd.errors import Busy, Internal, ProtocolError, WcdError

log = logging.getLogger("wcd")

RECV_BYTES = 256 * 1024
# A batch of one connection's requests ends after this many, or this long; then the other
# connections run, and the rest follows on the next loop pass.
MAX_MESSAGES_PER_WAKEUP = 64
MAX_BATCH_S = 0.001
OUTPUT_HIGH_WATER = 1 << 20  # replies not yet read past this: stop taking the connection's requests
FAIL_GRACE_S = 5.0  # a failed connection has this long to read its error line
# The kernel's limit of fds per message. With room for all of them it never truncates, because
# the fds it drops on truncation are closed in the receiving thread, which would be the loop.
SCM_MAX_FD = 253
_ANC = socket.CMSG_SPACE(SCM_MAX_FD * 4)


# -- closing descriptors off the loop -----------------------------------------------------------


class _Closer:
    """Closes descriptors in a few worker threads.

    A peer decides how long closing what it touched takes: a socket it passed with `SO_LINGER`
    and unsent data blocks close() for the linger, a file on a FUSE mount it serves blocks
    until it answers, and the last close of a connection still holding such fds unread runs
    their release too. The loop never closes anything a peer handed it.
    """

    THREADS = 4

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[int, int, bool]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending: Counter[int] = Counter()  # uid -> descriptors handed over, not yet closed
        self._threads: list[threading.Thread] = []

    def close(self, fds: Iterable[int], uid: int, foreign: bool) -> None:
        for fd in fds:
            with self._lock:
                self._pending[uid] += 1
            self._queue.put((fd, uid, foreign))
        if len(self._threads) < self.THREADS and not self._queue.empty():
            self._start(len(self._threads) + 1)  # before `start_all` (see wcd.workers)

    def start_all(self) -> None:
        """Start all THREADS threads now (blocking; not from the loop)."""
        self._start(self.THREADS)

    def _start(self, upto: int) -> None:
        with self._lock:  # not held across the starts: the loop takes it on every accept and discard
            threads = [threading.Thread(target=self._run, name="wcd-close", daemon=True)
                       for _ in range(upto - len(self._threads))]
            self._threads += threads
        for thread in threads:
            thread.start()

    def pending(self, uid: int | None = None) -> int:
        with self._lock:
            return self._pending[uid] if uid is not None else sum(self._pending.values())

    def _run(self) -> None:
        while True:
            fd, uid, foreign = self._queue.get()
            if foreign:
                _unlinger(fd)
            try:
                os.close(fd)
            except OSError:
                pass
            with self._lock:
                self._pending[uid] -= 1
                if not self._pending[uid]:
                    del self._pending[uid]


def _unlinger(fd: int) -> None:
    """Turn off a socket's SO_LINGER so its close does not wait (the kernel still sends what is queued)."""
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            return
        sock = socket.socket(fileno=fd)
    except OSError:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 0, 0))
    except OSError:
        pass
    finally:
        sock.detach()


_closer = _Closer()


def discard(fds: Iterable[int], uid: int, foreign: bool = False) -> None:
    """Close descriptors off the loop; until then they count against `uid`'s descriptors.

    `foreign`: they came from a peer, which may have set SO_LINGER on them (turned off first)."""
    _closer.close(fds, uid, foreign)


def start_closers() -> None:
    """Start the threads that `discard` closes in (blocking; see wcd.workers)."""
    _closer.start_all()


# -- what peers may hold --------------------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """The daemon's limits on peers (`DaemonConfig` has them with their defaults and meaning)."""

    max_connections: int
    max_connections_per_uid: int
    max_buffer_bytes: int
    max_buffer_bytes_per_uid: int
    max_fds_per_connection: int
    max_fds_per_uid: int
    max_fds: int  # descriptors the daemon spends on peers and entries: RLIMIT_NOFILE less a reserve


@dataclass
class _Usage:
    connections: int = 0
    bytes: int = 0
    fds: int = 0  # sockets and descriptors queued for sending


class Quotas:
    """What peers hold, per uid and in all. Connections charge themselves as their buffers change;
    the server asks `refusal` before it takes a connection in, ops ask `fd_room` before they hand
    out a descriptor. Past a byte limit, the connection holding the most is cut off."""

    def __init__(self, limits: Limits, held_elsewhere: Callable[[], int] = lambda: 0) -> None:
        self.limits = limits
        self.total = _Usage()
        self._by_uid: dict[int, _Usage] = {}
        self._members: dict[int, set[Connection]] = {}
        self._held_elsewhere = held_elsewhere  # descriptors not charged to a connection (arenas)
        self._shedding = False

    def usage(self, uid: int) -> _Usage:
        return self._by_uid.get(uid) or _Usage()

    def fds_in_use(self) -> int:
        return self.total.fds + _closer.pending() + self._held_elsewhere()

    def _uid_fds(self, uid: int) -> int:
        return self.usage(uid).fds + _closer.pending(uid)

    def refusal(self, uid: int) -> Busy | None:
        """Why a new connection from `uid` must be turned away (with `busy`), or None."""
        lim, mine = self.limits, self.usage(uid)
        if self.total.connections >= lim.max_connections:
            return Busy(f"too many connections ({self.total.connections}, max_connections); try again later",
                        {"limit": "max_connections"})
        if mine.connections >= lim.max_connections_per_uid:
            return Busy(f"uid {uid} has {mine.connections} connections, its share (max_connections_per_uid): "
                        "close some, or raise max_connections_per_uid in the daemon's config",
                        {"limit": "max_connections_per_uid"})
        try:
            self._check_fds(uid, 1)
        except Busy as e:
            return e
        return None

    def fd_room(self, conn: Connection, n: int = 1) -> None:
        """Raise `Busy` unless `conn` may be sent `n` more descriptors now."""
        lim = self.limits
        if conn.unread_fds + n > lim.max_fds_per_connection:
            raise Busy(f"{conn.unread_fds} file descriptors sent on this connection are not read yet "
                       "(max_fds_per_connection): read the replies before asking for more",
                       {"limit": "max_fds_per_connection"})
        self._check_fds(conn.uid, n)

    def _check_fds(self, uid: int, n: int) -> None:
        lim = self.limits
        if self._uid_fds(uid) + n > lim.max_fds_per_uid:
            raise Busy(f"uid {uid} holds {self._uid_fds(uid)} of the daemon's file descriptors (max_fds_per_uid): "
                       "close connections or read their replies", {"limit": "max_fds_per_uid"})
        if self.fds_in_use() + n > lim.max_fds:
            raise Busy(f"the daemon is short of file descriptors ({self.fds_in_use()} in use by peers and "
                       "entries); try again later, or raise LimitNOFILE", {"limit": "max_fds"})

    def join(self, conn: Connection) -> None:
        self._members.setdefault(conn.uid, set()).add(conn)
        self._add(conn.uid, 1, 0, 0)

    def leave(self, conn: Connection) -> None:
        members = self._members[conn.uid]
        members.discard(conn)
        if not members:
            del self._members[conn.uid]
        self._add(conn.uid, -1, 0, 0)

    def charge(self, conn: Connection, nbytes: int, nfds: int) -> None:
        """`conn` now buffers `nbytes` more bytes and holds `nfds` more descriptors (either may be < 0)."""
        self._add(conn.uid, 0, nbytes, nfds)
        if nbytes > 0 and not self._shedding:
            self._shed(conn.uid)

    def _add(self, uid: int, connections: int, nbytes: int, nfds: int) -> None:
        mine = self._by_uid.setdefault(uid, _Usage())
        for usage in (mine, self.total):
            usage.connections += connections
            usage.bytes += nbytes
            usage.fds += nfds
        if mine == _Usage():
            del self._by_uid[uid]

    def _shed(self, uid: int) -> None:
        """Cut off the biggest holders until the uid's bytes and the total fit their limits."""
        lim = self.limits
        self._shedding = True
        try:
            while (self.usage(uid).bytes > lim.max_buffer_bytes_per_uid
                   and self._cut(self._members.get(uid, ()), "max_buffer_bytes_per_uid",
                                 f"uid {uid} buffers {self.usage(uid).bytes} bytes")):
                pass
            while (self.total.bytes > lim.max_buffer_bytes
                   and self._cut((c for members in self._members.values() for c in members), "max_buffer_bytes",
                                 f"peers buffer {self.total.bytes} bytes")):
                pass
        finally:
            self._shedding = False

    def _cut(self, candidates: Iterable[Connection], limit: str, what: str) -> bool:
        """Fail the connection holding the most bytes; False if none holds any it could drop."""
        biggest = max((c for c in candidates if not c.closed), key=lambda c: c.droppable, default=None)
        if biggest is None or biggest.droppable == 0:
            return False
        biggest.fail(Busy(f"{what}, past {limit}: this connection held the most ({biggest.buffered}) and is "
                          "closed; read replies promptly and send smaller requests", {"limit": limit}),
                     drop_output=True)
        return True


# -- one connection -------------------------------------------------------------------------------


class Connection:
    """One client, identified by its peer credentials (from `SO_PEERCRED`, never from a message)."""

    def __init__(self, sock: socket.socket, pid: int, uid: int, gid: int,
                 on_message: Callable[[Connection, dict[str, Any]], None],
                 on_close: Callable[[Connection], None], quotas: Quotas) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.pid, self.uid, self.gid = pid, uid, gid
        self.loop = asyncio.get_running_loop()
        self.decoder = protocol.FrameDecoder()
        self.hello = False  # set by the hello op; every other op needs it first
        self.version = 1  # the protocol version hello agreed on
        self.client = ""
        self.closed = False
        self.opened_at = self.last_active = self.loop.time()
        # When the first byte of the oldest request not yet whole arrived (None: none is arriving).
        self.frame_since: float | None = None
        self.tasks: set[asyncio.Task[None]] = set()  # its requests in flight, cancelled on close
        self.quotas = quotas
        self._on_message, self._on_close = on_message, on_close
        self._out: deque[tuple[memoryview, list[int]]] = deque()
        self._out_bytes = 0
        self.unread_fds = 0  # descriptors queued in _out
        self._charged = (0, 1)  # (bytes, fds) charged to the quotas: its socket to start with
        self._reading = False
        self._writing = False
        self._corked = False
        self._serve_soon = False
        self._failed = False
        quotas.join(self)
        quotas.charge(self, 0, 1)
        self._update_reader()

    def __repr__(self) -> str:
        return f"<conn pid={self.pid} uid={self.uid} {self.client}>"

    @property
    def buffered(self) -> int:
        """Bytes held for this connection: a request being received, replies not yet read."""
        return self.decoder.buffered + self._out_bytes

    @property
    def droppable(self) -> int:
        """What failing it would free (a failed connection keeps only its error line)."""
        return 0 if self._failed else self.buffered

    # -- input ------------------------------------------------------------------------------

    def _update_reader(self) -> None:
        """Read requests only while the last batch is answered and the client reads its replies."""
        want = (not self.closed and not self._failed and not self._serve_soon
                and self._out_bytes <= OUTPUT_HIGH_WATER)
        if want and not self._reading:
            self.loop.add_reader(self.fd, self._on_readable)
        elif not want and self._reading:
            self.loop.remove_reader(self.fd)
        self._reading = want

    def _on_readable(self) -> None:
        try:
            data, anc, flags, _ = self.sock.recvmsg(RECV_BYTES, _ANC, socket.MSG_CMSG_CLOEXEC)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.close()
            return
        fds = protocol.fds_from_ancillary(anc)
        if fds or flags & socket.MSG_CTRUNC:
            discard(fds, self.uid, foreign=True)
            self.fail(ProtocolError(f"clients send no file descriptors to the daemon (it closed the {len(fds)} "
                                    "this message carried)"))
            return
        if not data:
            self.close()
            return
        self.decoder.feed(data)
        self.last_active = self.loop.time()
        if self.frame_since is None:
            self.frame_since = self.last_active
        self._serve()

    def _serve(self) -> None:
        """Answer the complete requests buffered, at most a batch at a time, while replies are read."""
        self._serve_soon = False
        self._corked = True  # coalesce the replies of one batch into one write
        until = time.monotonic() + MAX_BATCH_S
        held = False  # stopped at the output limit with requests left
        try:
            for _ in range(MAX_MESSAGES_PER_WAKEUP):
                if self.closed or self._failed:
                    break
                if self._out_bytes > OUTPUT_HIGH_WATER:
                    held = True
                    break
                item = self.decoder.next_message()
                if item is None:
                    break
                # What is left began arriving by now (a request trickled in counts from its first byte).
                self.frame_since = self.loop.time() if self.decoder.buffered else None
                self._on_message(self, item[0])
                if time.monotonic() > until:
                    self._serve_later()
                    break
            else:
                self._serve_later()
        except ProtocolError as e:
            self.fail(e)
        except Exception as e:  # a bug in a handler: the client still gets one line, the loop goes on
            log.error("%r: request failed", self, exc_info=e)
            self.fail(Internal("internal error; the daemon log has the traceback"))
        finally:
            self._corked = False
            if not self.closed:
                self._flush()
                # Written at once (a client reading as fast as replies come): the reader was never
                # paused, so the flush did not go on; nothing more may arrive to wake this connection.
                if held and not self._failed and self._out_bytes <= OUTPUT_HIGH_WATER and self.decoder.has_frame():
                    self._serve_later()

    def frame_overdue(self, now: float, limit: float) -> bool:
        """Whether a request has been arriving for longer than `limit` s and is still not whole
        (whole ones waiting for their turn do not count, nor a wait while the daemon does not read:
        the client is not reading its replies)."""
        return (self.frame_since is not None and now - self.frame_since > limit and self._reading
                and not self.decoder.has_frame())

    def _serve_later(self) -> None:
        if not self._serve_soon and not self.closed:
            self._serve_soon = True
            self.loop.call_soon(self._serve)

    def fail(self, err: WcdError, drop_output: bool = False) -> None:
        """Report a stream-level error, then close once it is written (or after FAIL_GRACE_S).

        `drop_output` also drops the replies not yet written (keeping one already half written,
        so that the error line still arrives as a frame of its own).
        """
        if self.closed or self._failed:
            return
        log.warning("%r: %s", self, err.message)
        self._failed = True
        self.decoder = protocol.FrameDecoder()  # what it was sending is dropped, and its memory freed
        if drop_output:
            while len(self._out) > (1 if self._writing else 0):
                _, fds = self._out.pop()
                discard(fds, self.uid)
            self._out_bytes = sum(len(data) for data, _ in self._out)
            self.unread_fds = sum(len(fds) for _, fds in self._out)
        self._enqueue(protocol.encode(protocol.error(None, err)), [])
        self.loop.call_later(FAIL_GRACE_S, self.close)
        if not self._corked:
            self._flush()

    # -- output -----------------------------------------------------------------------------

    def send(self, message: dict[str, Any], fds: Iterable[int] = ()) -> None:
        if self.closed or self._failed:
            return
        fds = list(fds)
        try:
            data = protocol.encode(message, len(fds))
        except (WcdError, OverflowError, ValueError, TypeError) as e:
            data, fds = self._unencodable(message, e), []
        self._enqueue(data, [os.dup(fd) for fd in fds])  # the arena may close its fd before this is written
        if not self._corked and not self._writing:
            self._flush()

    def _unencodable(self, message: dict[str, Any], exc: Exception) -> bytes:
        """A reply msgpack cannot carry (an integer past 64 bits, a frame too big): still one reply."""
        req_id = message.get("id")
        error = message.get("error")
        if isinstance(error, dict):  # an error whose details do not encode: the line without them
            return protocol.encode({"id": req_id, "ok": False, "error": {**error, "details": {}}})
        log.error("%r: cannot encode the reply to request %r: %s", self, req_id, exc)
        err = exc if isinstance(exc, WcdError) else Internal("the daemon could not encode its reply; its log says why")
        return protocol.encode(protocol.error(req_id if type(req_id) is int else None, err))

    def _enqueue(self, data: bytes, fds: list[int]) -> None:
        self._out.append((memoryview(data), fds))
        self._out_bytes += len(data)
        self.unread_fds += len(fds)
        self._recharge()

    def _recharge(self) -> None:
        now = (0, 0) if self.closed else (self.buffered, 1 + self.unread_fds)
        before, self._charged = self._charged, now
        self.quotas.charge(self, now[0] - before[0], now[1] - before[1])

    def _flush(self) -> None:
        while self._out:
            data, fds = self._out[0]
            try:
                if fds:
                    n = self.sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
                    # On the loop: the copies in flight to the client hold the files, so this
                    # close is never the last (which could free an arena's memory here).
                    close_fds(fds)
                    self.unread_fds -= len(fds)
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
                break
            self._out.popleft()
        else:
            if self._writing:
                self._writing = False
                self.loop.remove_writer(self.fd)
            if self._failed:
                self.close()
                return
        self._recharge()
        if not self._reading and not self._failed and self._out_bytes <= OUTPUT_HIGH_WATER and self.decoder.has_frame():
            # Requests that arrived while its replies were piling up. Only whole ones: the rest of
            # a frame still arriving is for the reader (served now, it would find nothing, and
            # with the reader off for it, wait forever, spinning).
            self._serve_later()
        self._update_reader()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._update_reader()
        if self._writing:
            self.loop.remove_writer(self.fd)
        for _, fds in self._out:
            discard(fds, self.uid)
        self._out.clear()
        self._out_bytes = self.unread_fds = 0
        self.decoder = protocol.FrameDecoder()
        for task in self.tasks:
            task.cancel()
        # Its last close may release fds still queued unread in the socket: off the loop too.
        discard([self.sock.detach()], self.uid)
        self._recharge()
        self.quotas.leave(self)
        self._on_close(self)


def close_fds(fds: Iterable[int]) -> None:
    """Close the daemon's own descriptors, ignoring ones already gone."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
