"""The daemon's log lines never make the loop wait for the log.

Under systemd the daemon's stderr is a stream socket to the journal. A journal that stops reading
(restarting, on a full or slow disk, hung) blocks a write once the socket's buffer is full; from
the loop, that write would stall every client until the journal came back, and a peer can have
lines written (a warning per connection it breaks).

So a line is written at once only if the stream takes it without waiting (a non-blocking send to
a socket, a write through a non-blocking descriptor of our own to a pipe or terminal; a regular
file is written in place, as any write). What the stream does not take waits in a queue of at
most QUEUE_LINES lines, which a thread writes, in order, blocking; while lines wait, new ones
queue behind them. When the queue is full, lines are dropped and counted, and the count is
written after the line that was being written.

A record is one line: control characters in its message (where peers' strings end up: a hello's
`client`, a key, a path) are escaped, so that no peer can forge a line or a terminal's escape
sequence; the lines of a traceback that follow are indented.
"""

from __future__ import annotations

import logging
import os
import queue
import re
import select
import socket
import stat
import threading
from collections.abc import Callable

QUEUE_LINES = 10_000
# How long closing (at exit) waits for a stream that does not take what is queued.
CLOSE_WAIT_S = 2.0
# C0 and C1 controls, DEL, and what some readers take for a line break (NEL is C1).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def escaped(text: str) -> str:
    """`text` with each control character written as its Python escape (`\\n`, `\\x1b`)."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


def nonblocking_write(fd: int) -> tuple[Callable[[bytes], int] | None, Callable[[], None]]:
    """A write to `fd` that returns at once with how much the stream took (0: it is full), or
    None where there is no such write; and what closes what it opened. The descriptor's own
    flags stay as they are: the journal's socket, a terminal or a pipe are shared with other
    processes."""
    mode = os.fstat(fd).st_mode
    if stat.S_ISREG(mode):
        return (lambda data: os.write(fd, data)), lambda: None  # a file takes what it is given
    if stat.S_ISSOCK(mode):
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            return None, lambda: None

        def send(data: bytes) -> int:
            try:
                return sock.send(data, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return 0
        return send, sock.close
    try:  # a pipe or a terminal: opened again, a description of our own that may be non-blocking
        own = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None, lambda: None

    def write(data: bytes) -> int:
        try:
            return os.write(own, data)
        except BlockingIOError:
            return 0
    return write, lambda: os.close(own)


class LogWriter(logging.Handler):
    """Writes formatted records to `fd` (stderr) without ever waiting for it (see the module)."""

    def __init__(self, fd: int, capacity: int = QUEUE_LINES) -> None:
        super().__init__()
        self._fd = fd
        self._try, self._close_try = nonblocking_write(fd)
        self._capacity = capacity
        self._lines: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._state = threading.Lock()
        self._waiting = 0  # lines queued or being written by the thread
        self._dropped = 0
        self._thread = threading.Thread(target=self._write_queued, name="wcd-log", daemon=True)
        self._thread.start()

    def format(self, record: logging.LogRecord) -> str:
        """The record as one line (see the module), then its traceback, if any, indented."""
        message = record.getMessage()
        if _CONTROL.search(message):
            record = logging.makeLogRecord({**record.__dict__, "msg": escaped(message), "args": None})
        head, *rest = super().format(record).split("\n")
        return "\n".join([head, *("  " + escaped(line) for line in rest)])

    def emit(self, record: logging.LogRecord) -> None:
        try:
            data = (self.format(record) + "\n").encode("utf-8", "backslashreplace")
        except Exception:
            self.handleError(record)
            return
        with self._state:
            if not self._waiting and self._try is not None:
                try:
                    data = data[self._try(data):]
                except OSError:
                    return  # the stream is gone: nowhere left to say it
                if not data:
                    return
            if self._waiting >= self._capacity:
                self._dropped += 1
                return
            self._waiting += 1
            self._lines.put(data)

    def close(self) -> None:
        """Write what is queued, waiting at most CLOSE_WAIT_S for a stream that does not take it."""
        if self._thread.is_alive():
            self._lines.put(None)
            self._thread.join(CLOSE_WAIT_S)
        with self._state:
            if self._try is not None:
                self._try = None  # what comes after is queued (and written if the thread still runs)
                self._close_try()
        super().close()

    def _write_queued(self) -> None:
        while (data := self._lines.get()) is not None:
            self._write(data)
            with self._state:
                dropped, self._dropped = self._dropped, 0
            if dropped:  # still counted as waiting: nothing is written directly meanwhile
                self._write(self.format(logging.makeLogRecord({
                    "name": "wcd", "levelno": logging.WARNING, "levelname": "WARNING",
                    "msg": f"{dropped} log lines dropped: the log (stderr: the journal) was not taking them",
                })).encode() + b"\n")
            with self._state:
                self._waiting -= 1

    def _write(self, data: bytes) -> None:
        """All of `data`, waiting as long as the stream takes (here, in this thread)."""
        view = memoryview(data)
        try:
            while view:
                try:
                    view = view[os.write(self._fd, view):]
                except BlockingIOError:  # someone made the shared description non-blocking
                    select.select([], [self._fd], [])
        except OSError:
            pass  # the stream is gone: nowhere left to say it
