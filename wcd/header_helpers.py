"""Safetensors headers parsed in helper processes, beside each other and beside the daemon.

Parsing a header builds a Python object per tensor and holds the GIL while it does, so threads
cannot share the work: the four headers of a 100,000-tensor checkpoint took 0.19 s of the daemon's
admission on the H200 host, twice the copies' time. So a daemon on a host with cores to spare keeps
a few helper processes (`daemon.header_helpers`; started after READY, from the thread that starts
the workers, or by the first parse that needs them) and hands them raw header bytes in batches: a
helper opens no file and holds no descriptor but its socket and its buffer (a memfd). A header
larger than a batch is cut into pieces of whole members (`split`), so that one shard of 25,000
tensors keeps several helpers busy, and the pieces' columns are merged (`headers.merge_columns`).
A helper runs the daemon's own parse and checks (`header_columns`) and sends the columns back as
msgpack, which the daemon unpacks in a few ms per 25,000 tensors; meanwhile the calling thread
parses what no busy helper is to take. What a helper
cannot read (a header that is not valid, one only `json.loads` reads, a helper that has gone,
stalled or answered garbage) is parsed in the daemon, which then says why a bad one is bad: the
outcome is the daemon's own parse in every case, only faster. A helper runs the code the daemon
started with or refuses to (`code_stamp`), and is replaced after a header that grew its heap.

Wire, on a socketpair, one batch of headers at a time (`batches`), integers 8-byte little-endian:
the daemon writes the raw headers one after another into the helper's buffer (a memfd both hold)
and sends the number of headers, then for each the lengths of the raw header and of the data
section; the helper answers each with a length and that many bytes of msgpack (0: parse it
yourself). A helper sends one byte once it has imported
what it needs, and ends at EOF (the daemon's end closed: its exit, even by SIGKILL).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import select
import socket
import sys
import threading
import time
from array import array
from collections import deque
from collections.abc import Callable, Container, Sequence
from itertools import chain
from operator import mul
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import subprocess

    from wcd.headers import Columns, NameCheck

log = logging.getLogger("wcd")

# Batches smaller than this are parsed in the daemon: sending costs more than parsing them
# (1,000 tensors: 90 KB, 0.7 ms). The pieces' threshold in `headers` is the same size.
MIN_HELPER_BYTES = 256 << 10
READY_TIMEOUT_S = 10.0
RETRY_S = 60.0
MAX_BATCH = 1 << 16  # headers in one batch (a checkpoint has far fewer shards)
# A helper that parsed a header this large keeps the heap it grew (a 10.8 MiB header: 20 -> 73 MB,
# malloc_trim or not): it is replaced by a fresh one.
RETIRE_BYTES = 8 << 20
STALL_S = 5.0  # a send or read that makes no progress for this long fails (and see `answer_within`)
# Batches of about 1/PIECES_PER_HELPER of an even share each (`target_bytes`): two keep every helper
# busy to the end, more leave the calling thread more, smaller answers to unpack (bench/RESULTS.md).
PIECES_PER_HELPER = 2
KEEP_BUFFER_BYTES = 4 << 20  # a helper's buffer keeps the pages of batches up to this size
# The systemd interface stays the daemon's: a helper must not notify, nor think it was activated.
_NOT_INHERITED = ("NOTIFY_SOCKET", "LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES", "WATCHDOG_USEC", "WATCHDOG_PID")


def default_count() -> int:
    """A helper per 2 cores, at most 8; none on a host of fewer than 4, where the loop needs them.
    They are busy only while large headers are parsed, and hold ~12 MB of memory each."""
    cores = os.cpu_count() or 1
    return min(8, cores // 2) if cores >= 4 else 0


class _Helper:
    """A helper process, the daemon's end of its socket, and the buffer (a memfd both hold) that
    its batches' raw headers are written to: a write there never waits for the helper to read, as
    a socket's small buffer made each 600 KB send wait (10 ms per 100,000 tensors of headers)."""

    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket, buf: int) -> None:
        self.proc, self.sock, self.buf = proc, sock, buf
        self._lock = threading.Lock()  # the buffer's number is written to and closed under it, once

    def send(self, jobs: list[tuple[bytes, int]]) -> None:
        with self._lock:
            if self.buf < 0:
                raise OSError(errno.EBADF, "the helper was closed")
            offset = 0
            for raw, _ in jobs:
                view = memoryview(raw)
                while view:
                    n = os.pwrite(self.buf, view, offset)
                    view, offset = view[n:], offset + n
        self.sock.settimeout(STALL_S)  # a stopped helper reads nothing: the send fails, not hangs
        self.sock.sendall(len(jobs).to_bytes(8, "little") + b"".join(
            len(raw).to_bytes(8, "little") + data_size.to_bytes(8, "little") for raw, data_size in jobs))

    def sent(self, nbytes: int) -> None:
        """The batch of `nbytes` is answered: a large one's buffer pages are given back."""
        if nbytes > KEEP_BUFFER_BYTES:
            with self._lock:
                if self.buf >= 0:
                    os.ftruncate(self.buf, 0)

    def receive(self, jobs: list[tuple[bytes, int]]) -> list[bytes]:
        """The answers' bytes (b"": parse it yourself), bounded, not decoded yet (`answer`)."""
        answers = []
        for raw, _ in jobs:
            n = int.from_bytes(_recv_exact(self.sock, 8), "little")
            if n > 2 * len(raw) + (1 << 20):  # columns take less room than their JSON
                raise ValueError(f"an answer of {n} bytes for a header of {len(raw)}")
            answers.append(_recv_exact(self.sock, n) if n else b"")
        return answers

    def wait_ready(self) -> None:
        self.sock.settimeout(READY_TIMEOUT_S)
        if self.sock.recv(1) != b"R":
            raise OSError(f"it exited before it was ready (status {self.proc.poll()})")

    def close(self) -> None:
        """Idempotent: a second close must not close a number another descriptor has taken since."""
        with self._lock:
            buf, self.buf = self.buf, -1
        self.sock.close()  # the helper reads EOF and ends; kill it in case it is stuck or stopped
        if buf >= 0:
            os.close(buf)
        with contextlib.suppress(OSError):
            self.proc.kill()
        with contextlib.suppress(Exception):
            self.proc.wait(5)


def target_bytes(sizes: list[int], helpers: int) -> int:
    """The bytes of raw header in a batch: at least MIN_HELPER_BYTES and about 1/PIECES_PER_HELPER
    of what each of the helpers and the calling thread would parse if the work were shared evenly
    (a few batches each, so that whoever is first done takes another, and the answers of the last
    ones, which the calling thread unpacks one after the other, are small)."""
    return max(MIN_HELPER_BYTES, sum(sizes) // (PIECES_PER_HELPER * (helpers + 1)))


def batches(sizes: list[int], helpers: int, alone: Container[int] = ()) -> tuple[deque[list[int]], list[list[int]]]:
    """The jobs of raw headers of `sizes` bytes in batches of consecutive ones: (those worth sending
    to a helper, those to parse here), each of about `target_bytes`; a header that large alone is
    a batch, and so is each job in `alone` (a piece of a header `split` cut: that large already).
    Many shards of small headers (a MoE checkpoint in 160 shards) go out together."""
    target = target_bytes(sizes, helpers)
    far: deque[list[int]] = deque()
    near: list[list[int]] = []
    batch: list[int] = []
    held = 0

    def close() -> None:
        nonlocal batch, held
        if batch:
            (far.append if held >= MIN_HELPER_BYTES else near.append)(batch)
        batch, held = [], 0

    for i, size in enumerate(sizes):
        if i in alone:
            close()
            far.append([i])
            continue
        batch.append(i)
        held += size
        if held >= target:
            close()
    close()
    return far, near


def split(jobs: Sequence[tuple[bytes, int]], helpers: int) -> tuple[list[tuple[bytes, int]], list[range]]:
    """The jobs with each header of several `target_bytes` cut into that many pieces of consecutive
    members (`headers.member_pieces`), each parsed as a header of its own: the four 2.5 MB
    headers of a 100,000-tensor checkpoint are 16 jobs for 8 helpers, not 4. Returns the jobs and,
    per header, the range of those that are its pieces (one: the header whole)."""
    from wcd.headers import member_pieces

    target = target_bytes([len(raw) for raw, _ in jobs], helpers)
    work: list[tuple[bytes, int]] = []
    owners: list[range] = []
    for raw, data_size in jobs:
        k = max(1, len(raw) // max(target, 1)) if helpers else 1  # pieces of at least `target`
        pieces = member_pieces(raw, len(raw) // k) if k > 1 else None
        texts = pieces if pieces is not None else [raw]
        owners.append(range(len(work), len(work) + len(texts)))
        work.extend((text, data_size) for text in texts)
    return work, owners


def answer_within(raw_len: int) -> float:
    """Seconds a helper has to answer for headers of `raw_len` bytes before the daemon parses them
    itself: 4 MiB/s, a tenth of what the 2-core VM parses and checks, past a few seconds (a stalled
    or stopped helper must not hold a load)."""
    return STALL_S + raw_len / (4 << 20)


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
        if count:
            code_stamp()  # now, at start-up: the code this daemon runs

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
        """Close the idle helpers; one a parse holds is closed by that parse when it is done with
        it (`_give`, `_lose`), not under it."""
        with self._lock:
            self._closed = True
            helpers, self._all, self._idle = self._idle, set(), []
        for helper in helpers:
            helper.close()

    def columns(self, jobs: Sequence[tuple[bytes, int]], landed: Callable[[int, Columns], None] | None = None,
                names: NameCheck | None = None) -> tuple[list[Columns | None], int]:
        """Each job's (raw header, data section size) columns, or None where the header is not
        valid (`header_columns`) or its pieces do not tell (`merge_columns`: it is parsed whole),
        and how many the helpers read. Large headers are cut into pieces (`split`). `landed(k,
        columns)` is called, in this thread, for each job's columns as soon as they are known, and
        the names of each piece are added to `names` as it comes, while the helpers parse the rest:
        what the caller does with each header is done by then too. The names of a header that
        comes back None are not in `names`."""
        from wcd.headers import merge_columns

        work, owners = split(jobs, self.count)
        pieces = {i for r in owners if len(r) > 1 for i in r}
        owner = [k for k, r in enumerate(owners) for _ in r]
        waiting = [len(r) for r in owners]
        columns: list[Columns | None] = [None] * len(owners)

        def done(i: int, results: list[Columns | None]) -> None:
            """Job `i`'s columns are in `results` (or None): its header's, once all its pieces are."""
            k = owner[i]
            waiting[k] -= 1
            if names is not None and results[i] is not None:
                names.add(results[i][0])  # type: ignore[index]
            if waiting[k]:
                return
            r = owners[k]
            parts = [part for part in results[r.start : r.stop] if part is not None]
            merged = results[r.start] if len(r) == 1 else merge_columns(parts) if len(parts) == len(r) else None
            if merged is None and names is not None:
                for part in parts:
                    names.take_back(part[0])
            columns[k] = merged
            if merged is not None and landed is not None:
                landed(k, merged)

        by_helpers = self._parse(work, pieces, done)
        helped = sum(c is not None and not by_helpers.isdisjoint(r) for c, r in zip(columns, owners))
        return columns, helped

    def _parse(self, jobs: list[tuple[bytes, int]], pieces: set[int],
               done: Callable[[int, list[Columns | None]], None]) -> set[int]:
        """Each job's columns (`header_columns`; only as pydantic_core reads them for the `pieces`),
        told to `done(i, results)` as soon as `results[i]` holds them (or None), with cyclic GC
        paused; returns the jobs the helpers read. Jobs go to idle helpers in batches (`batches`),
        a helper's next batch as soon as its answer is read; the calling thread unpacks the answers
        and parses what no helper is to take, from the back while the helpers take from the front."""
        from wcd.gcpause import gc_paused
        from wcd.headers import header_columns

        results: list[Columns | None] = [None] * len(jobs)
        far, near = batches([len(raw) for raw, _ in jobs], self.count, pieces)
        if far and len(self._all) < self.count:  # none started yet (a parse before READY), or one lost
            self.start_soon()
        busy: dict[int, tuple[_Helper, list[int], float]] = {}  # by socket fd: helper, batch, deadline
        poll = select.poll()  # not select(): the daemon's descriptors go past FD_SETSIZE
        helped: set[int] = set()

        def drop(fd: int) -> tuple[_Helper, list[int]]:
            poll.unregister(fd)
            helper, batch, _ = busy.pop(fd)
            return helper, batch

        def send(helper: _Helper, batch: list[int]) -> None:
            try:
                helper.send([jobs[i] for i in batch])
            except OSError:
                self._lose(helper)
                far.appendleft(batch)
                return
            deadline = time.monotonic() + answer_within(sum(len(jobs[i][0]) for i in batch))
            busy[helper.sock.fileno()] = helper, batch, deadline
            poll.register(helper.sock, select.POLLIN)

        def dispatch() -> None:
            while far and (helper := self._take()) is not None:
                send(helper, far.popleft())

        def lose(helper: _Helper) -> None:
            """Drop a helper that answered garbage, and take back the batch it has now, if any."""
            fd = helper.sock.fileno()
            if fd in busy and busy[fd][0] is helper:
                near.append(drop(fd)[1])
            self._lose(helper)

        kept: _Helper | None = None  # a helper whose answer is being unpacked, with no batch
        try:
            while True:
                dispatch()
                if not (near or far or busy):
                    return helped
                # Parse here only what no helper is to take: what is too small to send, the batches
                # of helpers that went, and batches past what the busy helpers come back for (none
                # started yet, or more batches than helpers). Collect what helpers have finished
                # first; wait for them only when nothing is left to parse here, and never past a
                # helper's deadline: then its headers are parsed here.
                mine = bool(near) or len(far) > len(busy)
                wait_ms = 0
                if busy and not mine:
                    wait_ms = max(0, math.ceil((min(d for _, _, d in busy.values()) - time.monotonic()) * 1e3))
                ready = poll.poll(wait_ms) if busy else []
                for fd, _ in ready:
                    helper, batch = drop(fd)
                    try:
                        answers = helper.receive([jobs[i] for i in batch])
                        helper.sent(sum(len(jobs[i][0]) for i in batch))
                    except Exception:  # noqa: BLE001 - whatever went wrong there, it is parsed here
                        self._lose(helper)
                        near.append(batch)
                        continue
                    # Its next batch goes out before this answer is unpacked; it stays this parse's
                    # (no other may take it) until the answer proves good.
                    if max(len(jobs[i][0]) for i in batch) >= RETIRE_BYTES:
                        self._retire(helper)  # its heap grew with that header: a fresh one instead
                    elif far:
                        send(helper, far.popleft())
                    else:
                        kept = helper
                    try:
                        with gc_paused():
                            columns = [_answer(a, jobs[i][1]) if a else None for i, a in zip(batch, answers)]
                    except Exception:  # noqa: BLE001 - garbage: that helper goes, its headers are parsed here
                        kept = None
                        lose(helper)
                        near.append(batch)
                        continue
                    if kept is not None:
                        self._give(kept)
                        kept = None
                    with gc_paused():
                        for i, answer in zip(batch, columns):
                            results[i] = answer
                            if answer is not None:  # None: left to the daemon (which says why)
                                helped.add(i)
                            done(i, results)
                if ready:
                    continue
                if not mine:
                    now = time.monotonic()
                    for fd in [fd for fd, (_, _, deadline) in busy.items() if deadline <= now]:
                        helper, batch = drop(fd)
                        self._lose(helper)
                        near.append(batch)
                    continue
                batch = near.pop() if near else far.pop()
                with gc_paused():
                    for i in batch:
                        results[i] = header_columns(*jobs[i], lenient=i not in pieces)
                        done(i, results)
        finally:
            for helper, _, _ in busy.values():  # interrupted: their answers are not read
                self._lose(helper)
            if kept is not None:
                self._retire(kept)

    def _take(self) -> _Helper | None:
        with self._lock:
            return self._idle.pop() if self._idle else None

    def _give(self, helper: _Helper) -> None:
        with self._lock:
            if helper in self._all:
                self._idle.append(helper)
                return
        helper.close()

    def _retire(self, helper: _Helper) -> None:
        """Drop a helper; another is started in the background (unless closed)."""
        with self._lock:
            self._all.discard(helper)
            if helper in self._idle:
                self._idle.remove(helper)
        helper.close()
        self.start_soon()

    def _lose(self, helper: _Helper) -> None:
        """`_retire` a helper that failed, in one line."""
        if not self._closed:
            log.warning("a header helper (pid %d) failed or stalled; its header is parsed in the daemon",
                        helper.proc.pid)
        self._retire(helper)


def _spawn() -> _Helper:
    import subprocess

    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    env = {k: v for k, v in os.environ.items() if k not in _NOT_INHERITED}
    buf = -1
    try:
        buf = os.memfd_create("wcd-header-helper", os.MFD_CLOEXEC)
        # The daemon's own import path, so a helper runs the daemon's wcd (`-m` would put the
        # working directory first: a `wcd/` there would be imported instead).
        path = [entry for entry in sys.path if isinstance(entry, str) and entry]  # "": a working directory
        code = (f"import sys; sys.path[:] = {path!r}; from wcd.header_helpers import main; "
                f"main({code_stamp()!r}, {buf})")
        flags = [flag for flag, on in (("-I", sys.flags.isolated), ("-S", sys.flags.no_site),
                                       ("-s", sys.flags.no_user_site), ("-E", sys.flags.ignore_environment)) if on]
        proc = subprocess.Popen([sys.executable, *flags, "-c", code], stdin=theirs.fileno(),
                                stdout=subprocess.DEVNULL, env=env, close_fds=True, pass_fds=(buf,))
    except BaseException:
        mine.close()
        if buf >= 0:
            os.close(buf)
        raise
    finally:
        theirs.close()
    return _Helper(proc, mine, buf)


def _encode(columns: Columns) -> bytes:
    """Columns as msgpack: the names and shapes as lists, the numeric columns as native arrays'
    bytes (copied, not converted, by the daemon: half the daemon's share of the time)."""
    import msgpack

    names, codes, shapes, ids, begins, ends, sizes, contiguous = columns
    offsets = array("q", begins)
    offsets.extend(ends)
    offsets.extend(sizes)  # each fits: `header_columns` bounds them by the data section's size
    return msgpack.packb([names, codes, shapes, ids.tobytes(), offsets.tobytes(), contiguous])


def _answer(payload: bytes, data_size: int) -> Columns:
    """The columns a helper sent, if they are of the shape `header_columns` makes: each column as
    long as the names, of its type, every tensor within the data section and of its shape's and
    dtype's size, and every name one the layout accepts (the layout does not check them again:
    `Header.names_checked`); else ValueError. What else they hold (the order, no overlaps) was
    checked by the helper's run of the daemon's code. C-level passes, most of them over the arrays'
    bytes before they become ints."""
    import msgpack

    from wcd.gcpause import gc_paused
    from wcd.manifest import DTYPES, ITEMSIZES, names_valid

    with gc_paused():
        names, codes, shapes, ids, offsets, contiguous = msgpack.unpackb(payload, use_list=False)
        n = len(names)
        if not (type(names) is tuple and type(codes) is bytes and type(shapes) is tuple and type(ids) is bytes
                and type(offsets) is bytes and type(contiguous) is bool and len(codes) == n
                and len(ids) == _ID_BYTES * n and len(offsets) == 24 * n and set(map(type, names)) <= {str}
                and set(map(type, shapes)) <= {tuple} and set(map(type, chain.from_iterable(shapes))) <= {int}):
            raise ValueError("columns that are not a header's")
        shape_ids, numbers = array("I"), array("q")
        shape_ids.frombytes(ids)
        numbers.frombytes(offsets)
        # Offsets and sizes are never negative: no int64 with its sign bit set; codes and shape
        # indexes within their tables (a single shape: every index 0).
        if (offsets[_SIGN_BYTE::8].translate(None, _BELOW_SIGN) or codes.translate(None, _CODES[: len(DTYPES)])
                or (ids.count(0) != len(ids) if len(shapes) == 1 else n and max(shape_ids) >= len(shapes))):
            raise ValueError("columns that are not a header's")
        begins, ends, sizes = numbers[:n].tolist(), numbers[n : 2 * n].tolist(), numbers[2 * n :].tolist()
        if not n:
            return names, codes, shapes, shape_ids, begins, ends, sizes, contiguous
        if any(d < 0 for shape in shapes for d in shape):  # a step per distinct shape's dimension
            raise ValueError("columns that are not a header's")
        numels = list(map(math.prod, shapes))
        if len(shapes) == 1 and codes.count(codes[:1]) == n:  # one shape and dtype: one size
            sized = sizes.count(numels[0] * ITEMSIZES[codes[0]]) == n
        else:
            sized = list(map(mul, map(numels.__getitem__, shape_ids), map(ITEMSIZES.__getitem__, codes))) == sizes
        if not sized or max(ends) > data_size or not names_valid(names):
            raise ValueError("columns that are not a header's")
        return names, codes, shapes, shape_ids, begins, ends, sizes, contiguous


_SIGN_BYTE = 7 if sys.byteorder == "little" else 0  # of an int64 in native order
_ID_BYTES = array("I").itemsize
_BELOW_SIGN = bytes(range(0x80))
_CODES = bytes(range(256))


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise EOFError("the other end closed")
        got += k
    return bytes(buf)


def _serve(sock: socket.socket, buf: int, header_columns: Callable[..., Columns | None]) -> None:
    import gc

    from wcd.headers import MAX_HEADER_BYTES

    gc.disable()  # the parse makes no cycles; everything goes by reference counting
    sock.sendall(b"R")
    while True:
        try:
            count = int.from_bytes(_recv_exact(sock, 8), "little")
        except EOFError:
            return
        if count > MAX_BATCH:
            raise ValueError(f"a batch of {count} headers")
        jobs = []
        offset = 0
        heads = _recv_exact(sock, 16 * count)
        for k in range(0, 16 * count, 16):
            n, data_size = (int.from_bytes(heads[j : j + 8], "little") for j in (k, k + 8))
            if n > MAX_HEADER_BYTES:
                raise ValueError(f"a header of {n} bytes")
            raw = os.pread(buf, n, offset)
            if len(raw) != n:
                raise ValueError(f"a header of {n} bytes past the end of the buffer")
            jobs.append((raw, data_size))
            offset += n
        replies = []
        for raw, data_size in jobs:
            try:
                # Only what pydantic_core reads: `json.loads`'s refusals depend on the caller's
                # stack depth (nesting), so headers only it would read are the daemon's to parse.
                columns = header_columns(raw, data_size, lenient=False, in_pieces=False)
                payload = b"" if columns is None else _encode(columns)
            except Exception:  # noqa: BLE001 - whatever fails here, the daemon parses it and says why
                payload = b""
            columns = None
            replies.append(len(payload).to_bytes(8, "little") + payload)
        del jobs
        sock.sendall(b"".join(replies))


_STAMPED = ("wcd", "wcd.header_helpers", "wcd.headers", "wcd.manifest")


def code_stamp() -> str:
    """What identifies the code a helper runs: the files of the modules it shares with the daemon,
    as the daemon first looked (their size and mtime), so that a helper started after an upgrade
    on disk (a retired or lost one, replaced) does not talk to a daemon of another version."""
    global _stamp
    if _stamp is None:
        import importlib

        files = [getattr(importlib.import_module(name), "__file__", None) or "" for name in _STAMPED]
        _stamp = repr([(f, os.stat(f).st_size, os.stat(f).st_mtime_ns) if f else None for f in files])
    return _stamp


_stamp: str | None = None


def main(stamp: str = "", buf: int = -1) -> None:
    import signal

    # A stop (systemd signals the whole unit; a terminal's ^C the whole group) is the daemon's to
    # handle: a helper ends when the daemon's end of its socket closes.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        from wcd.headers import header_columns

        mine = code_stamp()
    except Exception as e:  # noqa: BLE001 - a broken install: one line in the journal, not a traceback
        sys.exit(f"wcd header helper: cannot start: {type(e).__name__}: {e}")
    if stamp != mine:
        sys.exit("wcd header helper: the daemon runs other wcd code than is installed now (upgraded "
                 "under it?): large headers are parsed in the daemon until it is restarted")
    try:
        _serve(socket.socket(fileno=0), buf, header_columns)
    except (EOFError, ConnectionError):
        pass
    except Exception as e:  # noqa: BLE001 - one line; the daemon parses what this helper had
        sys.exit(f"wcd header helper: {type(e).__name__}: {e}")
