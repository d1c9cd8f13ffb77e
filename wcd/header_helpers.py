"""Safetensors headers parsed in helper processes, beside each other and beside the daemon.

Parsing a header builds a Python object per tensor and holds the GIL while it does, so threads
cannot share the work: the four headers of a 100,000-tensor checkpoint took 0.19 s of the daemon's
admission on the H200 host, twice the copies' time. So a daemon on a host with cores to spare keeps
a few helper processes (`daemon.header_helpers`; started after READY, from the thread that starts
the workers) and hands each a large header's raw bytes: a helper opens no file and holds no
descriptor but its socket. It runs the daemon's own parse and checks (`header_columns`) and sends the
columns back as msgpack, which the daemon unpacks in a few ms per 25,000 tensors; meanwhile the
calling thread parses the headers that are left. What a helper cannot read (any header that is not
valid, or a helper that has gone) is parsed in the daemon, which then says why a bad one is bad:
the outcome is the daemon's own parse in every case, only faster.

Wire, on a socketpair, one request at a time: the daemon sends the 8-byte little-endian lengths
of the raw header and of the data section, then the raw header; the helper answers with an 8-byte
length and that many bytes of msgpack (0: parse it yourself). A helper sends one byte once it has
imported what it needs, and ends at EOF (the daemon's end closed: its exit, even by SIGKILL).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import sys
import threading
from array import array
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import subprocess

    from wcd.checkpoint import Columns

log = logging.getLogger("wcd")

# Headers smaller than this are parsed in the daemon: sending one costs more than parsing it
# (1,000 tensors: 90 KB, 0.7 ms). The pieces' threshold in `checkpoint` is the same size.
MIN_HELPER_BYTES = 256 << 10
READY_TIMEOUT_S = 10.0
# The systemd interface stays the daemon's: a helper must not notify, nor think it was activated.
_NOT_INHERITED = ("NOTIFY_SOCKET", "LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES", "WATCHDOG_USEC", "WATCHDOG_PID")


def default_count() -> int:
    """A helper per 4 cores, at most 4: none on a small host, where the loop needs the cores."""
    return min(4, (os.cpu_count() or 1) // 4)


class _Helper:
    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket) -> None:
        self.proc, self.sock = proc, sock

    def send(self, raw: bytes, data_size: int) -> None:
        self.sock.sendall(len(raw).to_bytes(8, "little") + data_size.to_bytes(8, "little"))
        self.sock.sendall(raw)

    def receive(self) -> Columns | None:
        n = int.from_bytes(_recv_exact(self.sock, 8), "little")
        return _decode(_recv_exact(self.sock, n)) if n else None

    def wait_ready(self) -> None:
        self.sock.settimeout(READY_TIMEOUT_S)
        if self.sock.recv(1) != b"R":
            raise OSError(f"it exited before it was ready (status {self.proc.poll()})")
        self.sock.settimeout(None)

    def close(self) -> None:
        self.sock.close()  # the helper reads EOF and ends; kill it in case it is stuck or stopped
        with contextlib.suppress(OSError):
            self.proc.kill()
        with contextlib.suppress(Exception):
            self.proc.wait(5)


class HeaderHelpers:
    """A few helper processes and the scheduling of a checkpoint's headers onto them."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._lock = threading.Lock()
        self._idle: list[_Helper] = []
        self._all: set[_Helper] = set()
        self._closed = False
        self._replacing = False

    def start(self) -> None:
        """Start the helpers not running yet, all at once, and wait until each is ready (blocking:
        not from the loop). Raises if one cannot start."""
        with self._lock:
            missing = 0 if self._closed else self.count - len(self._all)
        started: list[_Helper] = []
        try:
            for _ in range(missing):
                started.append(_spawn())
            for helper in started:
                helper.wait_ready()
        except BaseException:
            for helper in started:
                helper.close()
            raise
        with self._lock:
            if not self._closed:
                self._all.update(started)
                self._idle.extend(started)
                return
        for helper in started:
            helper.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            helpers, self._all, self._idle = list(self._all), set(), []
        for helper in helpers:
            helper.close()

    def columns(self, jobs: Sequence[tuple[bytes, int]]) -> list[Columns | None]:
        """Each job's (raw header, data section size) columns, or None where the header is not
        valid (`header_columns`). Large headers go to idle helpers; the calling thread parses the
        rest, and any whose helper went, while the helpers work."""
        from wcd.checkpoint import header_columns
        from wcd.gcpause import gc_paused

        results: list[Columns | None] = [None] * len(jobs)
        far = deque(i for i, (raw, _) in enumerate(jobs) if len(raw) >= MIN_HELPER_BYTES)
        near = [i for i, (raw, _) in enumerate(jobs) if len(raw) < MIN_HELPER_BYTES][::-1]
        busy: dict[int, tuple[_Helper, int]] = {}  # by socket fd
        poll = select.poll()  # not select(): the daemon's descriptors go past FD_SETSIZE
        here = 0
        try:
            while True:
                while far and (helper := self._take()) is not None:
                    i = far.popleft()
                    try:
                        helper.send(*jobs[i])
                    except OSError:
                        self._lose(helper)
                        far.appendleft(i)
                        continue
                    busy[helper.sock.fileno()] = helper, i
                    poll.register(helper.sock, select.POLLIN)
                if not (near or far or busy):
                    log.debug("headers parsed: %d by helpers, %d in the daemon", len(jobs) - here, here)
                    return results
                # Collect what helpers have finished; wait for them only when nothing is left to parse here.
                ready = poll.poll(None if not (near or far) else 0) if busy else []
                for fd, _ in ready:
                    poll.unregister(fd)
                    helper, i = busy.pop(fd)
                    try:
                        results[i] = helper.receive()
                    except (OSError, ValueError, TypeError, EOFError):
                        self._lose(helper)
                        near.append(i)  # parsed here, whatever went wrong there
                        continue
                    self._give(helper)
                if not ready and (near or far):
                    i = near.pop() if near else far.pop()  # the helpers take from the front
                    with gc_paused():
                        results[i] = header_columns(*jobs[i])
                    here += 1
        finally:
            for helper, _ in busy.values():  # interrupted (never by design): their answers are not read
                self._lose(helper)

    def _take(self) -> _Helper | None:
        with self._lock:
            return self._idle.pop() if self._idle else None

    def _give(self, helper: _Helper) -> None:
        with self._lock:
            if helper in self._all:
                self._idle.append(helper)
                return
        helper.close()

    def _lose(self, helper: _Helper) -> None:
        """Drop a helper that failed and start another in the background (one at a time)."""
        with self._lock:
            self._all.discard(helper)
            replace = not self._closed and not self._replacing
            self._replacing = self._replacing or replace
        helper.close()
        log.warning("a header helper (pid %d) failed; its header is parsed in the daemon", helper.proc.pid)
        if replace:
            threading.Thread(target=self._replace, name="wcd-helpers", daemon=True).start()

    def _replace(self) -> None:
        try:
            self.start()
        except Exception as e:  # noqa: BLE001 - one line, and the daemon parses headers itself
            log.warning("cannot start a header helper (%s): headers are parsed in the daemon", e)
        finally:
            with self._lock:
                self._replacing = False


def _spawn() -> _Helper:
    import subprocess

    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    env = {k: v for k, v in os.environ.items() if k not in _NOT_INHERITED}
    try:
        proc = subprocess.Popen([sys.executable, "-m", "wcd.header_helpers"], stdin=theirs.fileno(),
                                stdout=subprocess.DEVNULL, env=env, close_fds=True)
    except BaseException:
        mine.close()
        raise
    finally:
        theirs.close()
    return _Helper(proc, mine)


def _encode(columns: Columns) -> bytes:
    import msgpack

    names, codes, shapes, ids, begins, ends, sizes, contiguous = columns
    return msgpack.packb([names, codes, shapes, ids.tobytes(), begins, ends, sizes, contiguous])


def _decode(payload: bytes) -> Columns:
    import msgpack

    from wcd.gcpause import gc_paused

    with gc_paused():
        names, codes, shapes, ids, begins, ends, sizes, contiguous = msgpack.unpackb(payload, use_list=False)
        shape_ids = array("I")
        shape_ids.frombytes(ids)
        return names, codes, shapes, shape_ids, list(begins), list(ends), list(sizes), contiguous


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise EOFError("the other end closed")
        got += k
    return bytes(buf)


def _serve(sock: socket.socket) -> None:
    import gc

    from wcd.checkpoint import header_columns

    gc.disable()  # the parse makes no cycles; everything goes by reference counting
    sock.sendall(b"R")
    while True:
        try:
            head = _recv_exact(sock, 16)
        except EOFError:
            return
        n, data_size = int.from_bytes(head[:8], "little"), int.from_bytes(head[8:], "little")
        raw, columns = _recv_exact(sock, n), None
        try:
            columns = header_columns(raw, data_size)
            payload = b"" if columns is None else _encode(columns)
        except Exception:  # noqa: BLE001 - whatever fails here, the daemon parses it and says why
            payload = b""
        del raw, columns
        sock.sendall(len(payload).to_bytes(8, "little") + payload)


if __name__ == "__main__":
    with contextlib.suppress(EOFError, ConnectionError, KeyboardInterrupt):
        _serve(socket.socket(fileno=0))
