"""`LogWriter`: the daemon's log lines are written at once where the stream takes them without
waiting, and otherwise never make the caller (the loop) wait: they queue, in order, behind a
bound, a thread writes them, and what the bound drops is counted and said. Against real kernel
streams: a file, a one-page pipe and a socket pair nobody reads (a journal that stopped reading)."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pytest

import wcd.logsink
from wcd.logsink import LogWriter


def logger_to(handler: logging.Handler, name: str) -> logging.Logger:
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    log = logging.getLogger(name)
    log.propagate = False
    log.setLevel(logging.DEBUG)
    log.handlers = [handler]
    return log


def read_all(fd: int, into: list[bytes]) -> threading.Thread:
    """A reader that comes back: drains `fd` in a thread until EOF."""
    def run() -> None:
        while chunk := os.read(fd, 1 << 16):
            into.append(chunk)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def timed_calls(calls: list[Callable[[str, int], None]], msg: str) -> float:
    """Make the calls (`call(msg, i)`) in a thread; the slowest one's seconds. One that blocks on
    the full stream fails the test (and is left behind) instead of hanging it."""
    slowest = [0.0]

    def run() -> None:
        for i, call in enumerate(calls):
            t = time.perf_counter()
            call(msg, i)
            slowest[0] = max(slowest[0], time.perf_counter() - t)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "a log call is blocked on the full stream"
    return slowest[0]


@contextmanager
def both_closed(r: int, w: int) -> Iterator[tuple[int, int]]:
    """(r, w), both closed at the end (whichever a test has not closed itself)."""
    try:
        yield r, w
    finally:
        for fd in (r, w):
            with contextlib.suppress(OSError):
                os.close(fd)


def stuck_pipe() -> AbstractContextManager[tuple[int, int]]:
    """(read, write) of a one-page pipe: full after ~4 KiB until someone reads it."""
    r, w = os.pipe()
    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 4096)
    return both_closed(r, w)


def stuck_socket() -> AbstractContextManager[tuple[int, int]]:
    """(read, write) ends of a stream socket pair with small buffers (the journal's socket)."""
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    return both_closed(b.detach(), a.detach())


def test_a_file_gets_each_line_before_the_log_call_returns(tmp_path: Path) -> None:
    """What the tests (and an operator's `tail -f`) rely on: written in place, in order."""
    path = tmp_path / "log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    handler = LogWriter(fd)
    log = logger_to(handler, "wcd.test.file")
    try:
        for i in range(300):
            log.info("line %d", i)
            assert path.read_text().endswith(f"INFO line {i}\n")
    finally:
        handler.close()
        os.close(fd)
    assert path.read_text().splitlines() == [f"INFO line {i}" for i in range(300)]


@pytest.mark.parametrize("kind", ["pipe", "socket", "non-blocking pipe"])
def test_a_stream_that_stops_reading_costs_the_caller_nothing_and_loses_nothing(kind: str) -> None:
    """"non-blocking pipe": a description someone else made non-blocking (the writer waits anyway)."""
    with stuck_socket() if kind == "socket" else stuck_pipe() as (r, w):
        if kind == "non-blocking pipe":
            os.set_blocking(w, False)
        handler = LogWriter(w)
        log = logger_to(handler, f"wcd.test.{kind.replace(' ', '-')}")
        calls = [log.warning] * 2000  # ~30 KB: many times what the stream holds
        slowest = timed_calls(calls, "line %d of a journal that stopped reading")
        got: list[bytes] = []
        reader = read_all(r, got)  # the journal is back
        handler.close()
        os.close(w)  # the last writer gone: the reader sees the end
        reader.join(10)
    assert slowest < 0.05, f"a log call waited {slowest * 1000:.0f} ms for a full {kind}"
    lines = b"".join(got).decode().splitlines()
    assert lines == [f"WARNING line {i} of a journal that stopped reading" for i in range(2000)]


def test_past_the_bound_lines_are_dropped_counted_and_said() -> None:
    with stuck_pipe() as (r, w):
        handler = LogWriter(w, capacity=10)
        log = logger_to(handler, "wcd.test.bound")
        timed_calls([log.info] * 1000, "line %d")
        got: list[bytes] = []
        reader = read_all(r, got)
        handler.close()
        os.close(w)
        reader.join(10)
    lines = b"".join(got).decode().splitlines()
    written = [int(line.split()[-1]) for line in lines if " line " in line]
    said = [int(line.split()[1]) for line in lines if "log lines dropped" in line]
    assert said and len(written) + sum(said) == 1000, lines[-5:]  # every line written or counted
    assert written == sorted(written) and written[0] == 0  # in order; the first went straight in


def test_closing_waits_a_bounded_time_for_a_stream_that_never_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wcd.logsink, "CLOSE_WAIT_S", 0.2)
    with stuck_pipe() as (r, w):
        handler = LogWriter(w)
        log = logger_to(handler, "wcd.test.close")
        for i in range(1000):
            log.error("line %d", i)
        t = time.monotonic()
        handler.close()
        assert time.monotonic() - t < 1.0
        os.read(r, 1 << 20)  # lets the writer thread finish its write and exit


def test_a_record_is_one_line_whatever_its_message_holds(tmp_path):
    """Peers' strings reach messages: a newline, a carriage return, a terminal escape or a Unicode
    line separator in one forges nothing; a traceback's lines stay lines, indented."""
    path = tmp_path / "log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    handler = LogWriter(fd)
    log = logger_to(handler, "wcd.test.escape")
    log.warning("%s: bad frame", "<conn client=x\nERROR forged\r\x1b[2K\u2028\x85>")
    try:
        raise ValueError("bad\nERROR forged too")
    except ValueError:
        log.exception("failed")
    handler.close()
    os.close(fd)
    lines = path.read_text().splitlines()
    assert lines[0] == r"WARNING <conn client=x\nERROR forged\r\x1b[2K\u2028\x85>: bad frame"
    assert lines[1] == "ERROR failed" and lines[2] == "  Traceback (most recent call last):"
    assert lines[-2:] == ["  ValueError: bad", "  ERROR forged too"]  # inside the record it continues
    assert all(line.startswith("  ") for line in lines[2:]) and not any("\x1b" in line for line in lines)
