"""One client connection: frames in through `protocol.FrameDecoder`, replies (with fds) out through sendmsg.

Owns the socket, SCM_RIGHTS in both directions, the output buffer and its limits. Raw
non-blocking sockets driven by `add_reader`/`add_writer`, because asyncio transports cannot
carry SCM_RIGHTS. Must not know ops: each decoded message goes to the `on_message` callback,
and the end of the connection to `on_close`.
"""

from __future__ import annotations

import array
import asyncio
import logging
import os
import socket
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from wcd import protocol
from wcd.errors import ProtocolError, WcdError

log = logging.getLogger("wcd")

RECV_BYTES = 256 * 1024
MAX_OUTPUT_BYTES = 256 * 1024 * 1024  # a client that stops reading is cut off past this
_ANC = socket.CMSG_SPACE(protocol.MAX_FDS_PER_FRAME * 4)


class Connection:
    """One client, identified by its peer credentials (from `SO_PEERCRED`, never from a message)."""

    def __init__(self, sock: socket.socket, pid: int, uid: int, gid: int,
                 on_message: Callable[[Connection, dict[str, Any], list[int]], None],
                 on_close: Callable[[Connection], None]) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.pid, self.uid, self.gid = pid, uid, gid
        self.loop = asyncio.get_running_loop()
        self.decoder = protocol.FrameDecoder()
        self.hello = False  # set by the hello op; every other op needs it first
        self.version = 1  # the protocol version hello agreed on
        self.client = ""
        self.closed = False
        self.tasks: set[asyncio.Task[None]] = set()  # its requests in flight, cancelled on close
        self._on_message, self._on_close = on_message, on_close
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
                    close_fds(fds)
                    self.fail(ProtocolError("too many file descriptors in one message"))
                    return
                if not data:
                    close_fds(fds)
                    self.close()
                    return
                try:
                    self.decoder.feed(data, fds)
                    while not self._close_when_flushed and (item := self.decoder.next_message()) is not None:
                        self._on_message(self, *item)
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
        close_fds(self.decoder.take_fds())
        self.loop.remove_reader(self.fd)
        self._close_when_flushed = True
        self.send(protocol.error(None, err))

    # -- output -----------------------------------------------------------------------------

    def send(self, message: dict[str, Any], fds: Iterable[int] = ()) -> None:
        if self.closed:
            return
        dups = [os.dup(fd) for fd in fds]  # the arena may close its fd before this frame is written
        data = memoryview(protocol.encode(message, len(dups)))
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
                    close_fds(fds)
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
            close_fds(fds)
        self._out.clear()
        close_fds(self.decoder.take_fds())
        for task in self.tasks:
            task.cancel()
        self.sock.close()
        self._on_close(self)


def close_fds(fds: Iterable[int]) -> None:
    """Close received or duplicated descriptors, ignoring ones already gone."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
