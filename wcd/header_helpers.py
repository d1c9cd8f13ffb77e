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
import time
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
RETRY_S = 60.0
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
        self._starting = False
        self._retry_at = 0.0  # after a start failed: not before then

    def start(self) -> bool:
        """Bring the helpers up to `count` (blocking: not from the loop), each in use as soon as it
        is ready, so a parse under way takes it. False (and one line) if one could not start."""
        with self._lock:
            if self._closed or self._starting:
                return True
            self._starting, missing = True, self.count - len(self._all)
        pending: list[_Helper] = []
        try:
            for _ in range(missing):
                pending.append(_spawn())
            while pending:
                helper = pending[0]
                helper.wait_ready()
                pending.pop(0)
                with self._lock:
                    closed = self._closed
                    if not closed:
                        self._all.add(helper)
                        self._idle.append(helper)
                if closed:
                    helper.close()
            return True
        except Exception as e:  # noqa: BLE001 - one line; the daemon parses headers itself
            self._retry_at = time.monotonic() + RETRY_S
            log.warning("cannot start a header helper (%s: %s): large headers are parsed in the daemon "
                        "(tried again in %g s, when one is needed)", type(e).__name__, e, RETRY_S)
            return False
        finally:
            for helper in pending:
                helper.close()
            with self._lock:
                self._starting = False

    def start_soon(self) -> None:
        """`start` in a thread of its own, unless one runs, all are up, or a start failed lately."""
        with self._lock:
            if self._closed or self._starting or len(self._all) >= self.count or time.monotonic() < self._retry_at:
                return
        threading.Thread(target=self.start, name="wcd-helpers", daemon=True).start()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            helpers, self._all, self._idle = list(self._all), set(), []
        for helper in helpers:
            helper.close()

    def columns(self, jobs: Sequence[tuple[bytes, int]]) -> tuple[list[Columns | None], int]:
        """Each job's (raw header, data section size) columns, or None where the header is not
        valid (`header_columns`), and how many the helpers parsed. Large headers go to idle
        helpers; the calling thread parses the rest, and any whose helper went, meanwhile."""
        from wcd.checkpoint import header_columns
        from wcd.gcpause import gc_paused

        results: list[Columns | None] = [None] * len(jobs)
        far = deque(i for i, (raw, _) in enumerate(jobs) if len(raw) >= MIN_HELPER_BYTES)
        near = [i for i, (raw, _) in enumerate(jobs) if len(raw) < MIN_HELPER_BYTES][::-1]
        if far and len(self._all) < self.count:  # none started yet (a parse before READY), or one lost
            self.start_soon()
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
                    return results, len(jobs) - here
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
        """Drop a helper that failed; another is started in the background."""
        with self._lock:
            self._all.discard(helper)
        helper.close()
        log.warning("a header helper (pid %d) failed; its header is parsed in the daemon", helper.proc.pid)
        self.start_soon()


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
