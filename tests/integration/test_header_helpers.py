"""Header helper processes (wcd.header_helpers): real helpers, the daemon's own parse as the reference.

What a checkpoint opened with helpers gives (headers, or the error of a bad one) must be what
it gives without them, whatever the header and whatever happens to a helper; a helper holds no
descriptor but its socket and none of systemd's environment; it ends with the daemon.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit.test_checkpoint_bulk import any_headers, outcome, write
from wcd import header_helpers
from wcd.checkpoint import Checkpoint
from wcd.header_helpers import HeaderHelpers


@pytest.fixture(scope="module")
def helpers() -> Iterator[HeaderHelpers]:
    pool = HeaderHelpers(2)
    pool.start()
    yield pool
    pool.close()


@pytest.fixture
def every_header_to_helpers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(header_helpers, "MIN_HELPER_BYTES", 0)


def opened(path: Path, helpers: HeaderHelpers | None = None) -> list[tuple[Any, ...]]:
    with Checkpoint.open(path, helpers=helpers) as ckpt:
        return [(h.file, h.raw, h.data_start, h.file_size, h.names, h.dtype_codes, h.shapes, list(h.shape_ids),
                 h.begins, h.ends, h.sizes, h.contiguous) for h in ckpt.headers]


def laid_out(path: Path, helpers: HeaderHelpers | None = None) -> tuple[list[tuple[Any, ...]], tuple[str, Any]]:
    """The headers, and the layout (or its error: a name the layout refuses) of the checkpoint."""
    def layout() -> tuple[Any, ...]:
        m = ckpt.manifest()
        return m.names, m.dtype_codes, m.shapes, list(m.shape_ids), list(m.offsets), m.size

    with Checkpoint.open(path, helpers=helpers) as ckpt:
        return [(h.file, h.raw, h.data_start, h.file_size, h.names, h.dtype_codes, h.shapes, list(h.shape_ids),
                 h.begins, h.ends, h.sizes, h.contiguous) for h in ckpt.headers], outcome(layout)


def experts(d: Path, shards: int, per_shard: int, shuffled: bool = False, uniform: bool = False) -> Path:
    """MoE-like shards, large enough to go to the helpers at the real threshold (`uniform`: every
    expert of one dtype and shape, back to back, as real expert shards are: a fast fill)."""
    d.mkdir(parents=True, exist_ok=True)
    for s in range(shards):
        doc: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        order = list(range(per_shard))
        if shuffled:
            order.reverse()
        for k in order:
            if uniform:
                doc[f"layers.{s}.experts.{k}.w"] = {"dtype": "BF16", "shape": [128], "data_offsets": [k * 256,
                                                                                                      k * 256 + 256]}
                continue
            shape = [4, 2] if k % 3 else [8]
            doc[f"layers.{s}.experts.{k}.w"] = {"dtype": "BF16" if k % 5 else "F32", "shape": shape,
                                                 "data_offsets": [k * 32, k * 32 + (16 if k % 5 else 32)]}
        write(d / f"model-{s:05d}.safetensors", doc, per_shard * (256 if uniform else 32))
    return d


def helper_pids(pool: HeaderHelpers) -> list[int]:
    return sorted(h.proc.pid for h in pool._all)


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shards=st.lists(any_headers, min_size=1, max_size=4))
def test_helpers_give_what_the_daemon_parses_valid_or_not(helpers: HeaderHelpers, every_header_to_helpers: None,
                                                          shards: list[tuple[dict[str, Any], int]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for i, (doc, data_len) in enumerate(shards):
            write(Path(tmp) / f"m{i}.safetensors", doc, data_len)
        assert outcome(partial(laid_out, Path(tmp), helpers)) == outcome(partial(laid_out, Path(tmp)))


@pytest.mark.slow
@pytest.mark.parametrize("bad", ["", "x\x01y", "z" * 1025, "tab\tname"])
def test_a_bad_name_in_a_piece_is_refused_by_the_layout_as_without_helpers(helpers: HeaderHelpers, bad: str,
                                                                          tmp_path: Path) -> None:
    """The helpers check the names (`header_columns`), so the layout need not: a header with a name
    it refuses is parsed here whole, and the layout says what it says without helpers."""
    ckpt = experts(tmp_path / "m", 2, 12_000)
    f = ckpt / "model-00001.safetensors"
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    doc = json.loads(raw[8 : 8 + n])
    last = list(doc)[-1]
    doc[bad] = doc.pop(last)  # in the last piece
    write(f, doc, len(raw) - 8 - n)
    want = laid_out(ckpt)
    assert want[1][0] == "BadRequest" and "bad tensor name" in want[1][1]
    assert laid_out(ckpt, helpers) == want
    with Checkpoint.open(ckpt, helpers=helpers) as opened_ckpt:
        assert [h.names_checked for h in opened_ckpt.headers] == [True, False]  # that one parsed here


@pytest.mark.slow
def test_names_the_helpers_checked_are_not_checked_again_by_the_layout(helpers: HeaderHelpers, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from wcd import checkpoint, headers, manifest

    ckpt = experts(tmp_path / "m", 3, 12_000)
    want = laid_out(ckpt)
    checked: list[int] = []
    names_valid = manifest.names_valid

    def counting(names: Any) -> bool:
        checked.append(len(names))
        return names_valid(names)

    monkeypatch.setattr(checkpoint, "names_valid", counting)
    monkeypatch.setattr(headers, "names_valid", counting)
    monkeypatch.setattr(manifest, "names_valid", counting)
    with Checkpoint.open(ckpt, helpers=helpers) as opened_ckpt:
        assert opened_ckpt.helped and all(h.names_checked for h in opened_ckpt.headers)
        in_the_parse = len(checked)  # the pieces the calling thread parsed beside the helpers (if any)
        opened_ckpt.manifest()
    assert len(checked) == in_the_parse  # the layout did not check them again
    assert laid_out(ckpt, helpers) == want


def test_a_name_repeated_in_two_pieces_reads_as_one_parse_reads_it(helpers: HeaderHelpers, tmp_path: Path) -> None:
    """A header cut into pieces (`header_helpers.split`) whose pieces hold a name twice is parsed
    whole: one parse keeps the last value at the first place; a name in two shards is still refused."""
    def entry(k: int) -> str:
        return json.dumps({"dtype": "U8", "shape": [256], "data_offsets": [256 * k, 256 * k + 256]})

    n = 12000  # ~1 MB of header: cut into pieces for two helpers
    members = [f'"w.{k}":{entry(k)}' for k in range(n)]
    members.append(f'"w.7":{entry(n)}')  # again, in the last piece: the whole reads w.7 at its first place, last value
    raw = ("{" + ",".join(members) + "}").encode()
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "m.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(256 * (n + 1)))
    assert len(header_helpers.split([(raw, 256 * (n + 1))], helpers.count)[1][0]) > 1
    want = opened(tmp_path / "one")
    assert len(want[0][4]) == n  # w.7 once
    with Checkpoint.open(tmp_path / "one", helpers=helpers) as ckpt:
        assert ckpt.helped == 0  # parsed whole here
    assert opened(tmp_path / "one", helpers) == want
    (tmp_path / "one" / "n.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(256 * (n + 1)))
    refused = outcome(partial(opened, tmp_path / "one"))
    assert refused[0] == "LoadFailed" and "appears in more than one shard" in refused[1]
    assert outcome(partial(opened, tmp_path / "one", helpers)) == refused


@pytest.mark.slow
def test_large_headers_go_to_the_helpers_and_come_back_equal(helpers: HeaderHelpers, tmp_path: Path) -> None:
    ckpt = experts(tmp_path / "m", 5, 12_000)
    raw_len = int.from_bytes((ckpt / "model-00000.safetensors").read_bytes()[:8], "little")
    assert raw_len >= header_helpers.MIN_HELPER_BYTES  # so the helpers take them
    sent = []
    send = header_helpers._Helper.send

    def counting(self: header_helpers._Helper, jobs: list[tuple[bytes, int]]) -> None:
        sent.extend(len(raw) for raw, _ in jobs)
        send(self, jobs)

    header_helpers._Helper.send = counting  # type: ignore[method-assign]
    try:
        assert opened(ckpt, helpers) == opened(ckpt)
    finally:
        header_helpers._Helper.send = send  # type: ignore[method-assign]
    assert sent, "no header went to a helper"
    assert opened(experts(tmp_path / "r", 2, 12_000, shuffled=True), helpers) == opened(tmp_path / "r")


@pytest.mark.slow
def test_a_helper_killed_mid_parse_is_replaced_and_its_header_parsed_here(tmp_path: Path) -> None:
    ckpt = experts(tmp_path / "m", 4, 12_000)
    want = opened(ckpt)
    pool = HeaderHelpers(2)
    pool.start()
    try:
        victim = next(iter(pool._all))
        receive = header_helpers._Helper.receive

        killed = []

        def killed_first(self: header_helpers._Helper, *args: int) -> Any:
            if self is victim and not killed:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
                killed.append(self)
            return receive(self, *args)

        header_helpers._Helper.receive = killed_first  # type: ignore[method-assign]
        try:
            assert opened(ckpt, pool) == want
        finally:
            header_helpers._Helper.receive = receive  # type: ignore[method-assign]
        assert killed  # the victim had a header to answer for
        deadline = time.monotonic() + 20
        while (len(pool._all) < 2 or victim.proc.pid in helper_pids(pool)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(pool._all) == 2 and victim.proc.pid not in helper_pids(pool)
        assert opened(ckpt, pool) == want
    finally:
        pool.close()


@pytest.mark.slow
def test_loads_at_once_share_the_helpers(helpers: HeaderHelpers, tmp_path: Path) -> None:
    ckpt = experts(tmp_path / "m", 4, 12_000)
    want = opened(ckpt)
    got: list[Any] = []
    threads = [threading.Thread(target=lambda: got.append(opened(ckpt, helpers))) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 6 and all(g == want for g in got)
    assert len(helpers._idle) == 2  # every helper given back


def test_a_helper_holds_only_its_socket_its_buffer_and_none_of_systemds_environment(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify"))
    monkeypatch.setenv("LISTEN_FDS", "1")
    stray = os.open(tmp_path, os.O_RDONLY)  # inheritable or not, a helper must not get it
    os.set_inheritable(stray, True)
    pool = HeaderHelpers(1)
    try:
        pool.start()
        (helper,) = pool._all
        where = f"/proc/{helper.proc.pid}/fd"
        fds = {int(n): os.readlink(f"{where}/{n}") for n in os.listdir(where)}
        assert set(fds) == {0, 1, 2, helper.buf}, fds
        assert fds[0].startswith("socket:") and fds[1] == "/dev/null"
        assert fds[helper.buf].startswith("/memfd:wcd-header-helper"), fds
        env = Path(f"/proc/{helper.proc.pid}/environ").read_bytes().split(b"\0")
        assert not [v for v in env if v.startswith((b"NOTIFY_SOCKET=", b"LISTEN_FDS="))]
    finally:
        os.close(stray)
        pool.close()


def test_closing_ends_the_helpers(tmp_path: Path) -> None:
    pool = HeaderHelpers(2)
    pool.start()
    procs = [h.proc for h in pool._all]
    pool.close()
    assert all(p.returncode is not None for p in procs)
    results, helped = pool.columns([(b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}' + b" " * (300 << 10), 1)])
    assert results[0] and helped == 0  # parsed here: no helper is started once closed
    assert not pool._all


@pytest.mark.slow
def test_a_parse_before_the_helpers_are_up_starts_them_and_takes_each_when_ready(tmp_path: Path) -> None:
    ckpt = experts(tmp_path / "m", 8, 12_000)
    want = opened(ckpt)
    pool = HeaderHelpers(2)  # not started: as for a configured model admitted before READY
    try:
        with Checkpoint.open(ckpt, helpers=pool) as got:
            assert [h.names for h in got.headers] == [w[4] for w in want]
        deadline = time.monotonic() + 20
        while len(pool._idle) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(pool._idle) == 2  # started in the background by that parse
        with Checkpoint.open(ckpt, helpers=pool) as again:
            assert again.helped >= 2
        assert opened(ckpt, pool) == want
    finally:
        pool.close()


@pytest.mark.slow
@pytest.mark.parametrize("python", ["/nonexistent/python3", "/bin/false"])
def test_helpers_that_cannot_start_say_so_in_one_line_and_the_daemon_parses(
        python: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    ckpt = experts(tmp_path / "m", 2, 12_000)
    want = opened(ckpt)
    monkeypatch.setattr(sys, "executable", python)
    pool = HeaderHelpers(2)
    try:
        with caplog.at_level("WARNING", logger="wcd"):
            assert pool.start() is False
            assert opened(ckpt, pool) == want  # no retry before RETRY_S: nothing more is logged
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and lines[0].startswith("cannot start a header helper (") and \
            "large headers are parsed in the daemon" in lines[0], lines
        assert not pool._all
    finally:
        pool.close()


def test_default_count_is_a_helper_per_two_cores_from_four(monkeypatch: pytest.MonkeyPatch) -> None:
    for cores, want in [(1, 0), (2, 0), (3, 0), (4, 2), (5, 2), (8, 4), (16, 8), (128, 8)]:
        monkeypatch.setattr(os, "cpu_count", lambda cores=cores: cores)
        assert header_helpers.default_count() == want


def daemon_children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"wcd.header_helpers" in cmdline:
                found.append(int(entry))
    return found


@pytest.mark.slow
def test_daemon_parses_a_large_checkpoint_with_its_helpers_and_they_end_with_it(make_daemon: Any,
                                                                                tmp_path: Path) -> None:
    ckpt = experts(tmp_path / "m", 4, 12_000)
    d = make_daemon("header_helpers = 2\n")
    deadline = time.monotonic() + 20  # the helpers are the last thing started after READY
    while "worker threads started" not in d.log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    children = daemon_children(d.proc.pid)
    assert len(children) == 2
    with d.client() as c:
        entry = c.load("moe", ckpt, device="cpu", wait=True)
        assert entry["tensors"] == 48_000, entry
    log = d.log.read_text()
    parsed = re.search(r"admitting moe: 4 shards, headers read and fingerprinted in [0-9.]+ s \((\d) by helpers\)", log)
    assert parsed and int(parsed[1]) >= 2, log  # both helpers took one
    assert "header helper" not in log  # none failed
    d.proc.kill()
    d.proc.wait()
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{c}").exists() and "Z" not in Path(f"/proc/{c}/stat").read_text().rsplit(")", 1)[1][:3]
              for c in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = [c for c in children if Path(f"/proc/{c}").exists()
             and "Z" not in Path(f"/proc/{c}/stat").read_text().rsplit(")", 1)[1][:3]]
    assert not alive, f"helpers outlived a SIGKILLed daemon: {alive}"


@pytest.mark.slow
def test_a_bad_header_is_refused_with_the_same_line_with_helpers(make_daemon: Any, tmp_path: Path) -> None:
    ckpt = experts(tmp_path / "m", 2, 12_000)
    shard = ckpt / "model-00001.safetensors"
    data = bytearray(shard.read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    header["layers.1.experts.7.w"]["data_offsets"] = [0, 1 << 40]
    raw = json.dumps(header).encode()
    shard.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])
    with_helpers, without = make_daemon("header_helpers = 2\n"), None
    with with_helpers.client() as c:
        first = outcome(lambda: c.load("moe", ckpt, device="cpu", wait=True))
    with_helpers.stop()
    without = make_daemon("header_helpers = 0\n", socket=tmp_path / "other.sock")
    with without.client() as c:
        second = outcome(lambda: c.load("moe", ckpt, device="cpu", wait=True))
    assert first == second and first[0] == "LoadFailed" and "layers.1.experts.7.w" in first[1], (first, second)


@pytest.mark.slow
def test_a_stopped_helper_does_not_hold_a_load(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """SIGSTOPped (or swapped out, or wedged): past its deadline its header is parsed here, and it goes."""
    monkeypatch.setattr(header_helpers, "STALL_S", 0.5)
    ckpt = experts(tmp_path / "m", 2, 12_000)
    want = opened(ckpt)
    pool = HeaderHelpers(1)
    pool.start()
    try:
        (stopped,) = pool._all
        os.kill(stopped.proc.pid, signal.SIGSTOP)
        began = time.monotonic()
        assert opened(ckpt, pool) == want
        assert time.monotonic() - began < 5, "the load waited on a stopped helper"
        assert stopped not in pool._all and stopped.proc.returncode is not None  # killed and reaped
    finally:
        pool.close()


def test_a_helper_ignores_the_stop_signals_and_ends_at_eof() -> None:
    pool = HeaderHelpers(1)
    pool.start()
    try:
        (helper,) = pool._all
        os.kill(helper.proc.pid, signal.SIGTERM)  # systemd signals the whole unit at a stop
        os.kill(helper.proc.pid, signal.SIGINT)  # a terminal's ^C the whole process group
        time.sleep(0.3)
        assert helper.proc.poll() is None
        helper.sock.shutdown(socket.SHUT_WR)  # the daemon's end closing: EOF
        assert helper.proc.wait(10) == 0
    finally:
        pool.close()


def fake_helper(pool: HeaderHelpers, answer: Callable[[bytes, int], bytes]) -> header_helpers._Helper:
    """A helper whose answers `answer(raw, data_size)` makes up, for what a broken one could send."""
    mine, theirs = socket.socketpair()
    proc = subprocess.Popen(["sleep", "60"])
    buf = os.memfd_create("fake-helper")

    def serve() -> None:
        with theirs:
            while count := theirs.recv(8, socket.MSG_WAITALL):
                offset = 0
                for _ in range(int.from_bytes(count, "little")):
                    head = theirs.recv(16, socket.MSG_WAITALL)
                    n, data_size = int.from_bytes(head[:8], "little"), int.from_bytes(head[8:], "little")
                    theirs.sendall(answer(os.pread(buf, n, offset), data_size))
                    offset += n

    threading.Thread(target=serve, daemon=True).start()
    fake = header_helpers._Helper(proc, mine, buf)
    pool._all.add(fake)
    pool._idle.append(fake)
    return fake


def sized(payload: bytes) -> bytes:
    return len(payload).to_bytes(8, "little") + payload


def wrong_columns(raw: bytes, data_size: int, change: Callable[[list[Any]], None]) -> bytes:
    from wcd.headers import header_columns

    columns = list(header_columns(raw, data_size))
    change(columns)
    return sized(header_helpers._encode(tuple(columns)))


GARBAGE: dict[str, Callable[[bytes, int], bytes]] = {
    "a huge length": lambda raw, size: (2**64 - 1).to_bytes(8, "little"),
    "not msgpack": lambda raw, size: sized(b"\xc1" * 64),
    "too few columns": lambda raw, size: sized(msgpack.packb([1, 2, 3])),
    "a name short": lambda raw, size: wrong_columns(raw, size, lambda c: c.__setitem__(0, c[0][:-1])),
    "past the data": lambda raw, size: wrong_columns(raw, size, lambda c: c[5].__setitem__(-1, size + 1)),
    "a bad dtype code": lambda raw, size: wrong_columns(raw, size, lambda c: c.__setitem__(1, b"\xff" * len(c[1]))),
    "a negative size": lambda raw, size: wrong_columns(raw, size, lambda c: c[6].__setitem__(0, -1)),
    "a name not a string": lambda raw, size: wrong_columns(raw, size, lambda c: c.__setitem__(0, (1, *c[0][1:]))),
    # The layout takes a helper's names as checked, and the plan its sizes as its shapes' (a review's finds):
    "a name that forges a log line": lambda raw, size: wrong_columns(
        raw, size, lambda c: c.__setitem__(0, ("a\nINFO forged", *c[0][1:]))),
    "an empty name": lambda raw, size: wrong_columns(raw, size, lambda c: c.__setitem__(0, ("", *c[0][1:]))),
    "a name too long": lambda raw, size: wrong_columns(raw, size, lambda c: c.__setitem__(0, ("z" * 1025, *c[0][1:]))),
    "shapes not their sizes": lambda raw, size: wrong_columns(
        raw, size, lambda c: c.__setitem__(2, tuple((s[0] + 1, *s[1:]) for s in c[2]))),
    "offsets short": lambda raw, size: sized(msgpack.packb([("a",), b"\0", ((1,),), b"\0" * 4, b"\0" * 8, True])),
}


@pytest.mark.slow
@pytest.mark.parametrize("garbage", list(GARBAGE))
def test_a_helper_that_answers_garbage_is_dropped_and_its_header_parsed_here(garbage: str, tmp_path: Path) -> None:
    ckpt = experts(tmp_path / "m", 1, 12_000)
    want = opened(ckpt)
    pool = HeaderHelpers(0)  # none of its own: only the fake
    try:
        fake = fake_helper(pool, GARBAGE[garbage])
        with Checkpoint.open(ckpt, helpers=pool) as got:
            assert got.helped == 0
        assert fake not in pool._all and fake not in pool._idle  # not handed back before its answer was read
        assert opened(ckpt, pool) == want
        assert fake not in pool._all and not pool._idle
    finally:
        pool.close()


def test_a_helper_closed_twice_closes_its_buffer_once(tmp_path: Path) -> None:
    """Its buffer's number may be another descriptor's by the second close (a lost helper retired
    again, the pool closed under a parse): that one must stay open."""
    pool = HeaderHelpers(1)
    try:
        pool.start()
        (helper,) = pool._all
        helper.close()
        reused = [os.open(tmp_path, os.O_RDONLY) for _ in range(3)]  # the lowest free numbers: its own
        helper.close()
        for fd in reused:
            os.fstat(fd)  # still open
            os.close(fd)
        with pytest.raises(OSError):
            helper.send([(b"{}", 0)])  # nothing is written through a closed helper
    finally:
        pool.close()


def test_closing_the_pool_leaves_a_helper_a_parse_holds_to_that_parse(tmp_path: Path) -> None:
    ckpt = experts(tmp_path / "m", 1, 12_000)
    want = opened(ckpt)
    pool = HeaderHelpers(0)
    answering = threading.Event()

    def slow_garbage(raw: bytes, data_size: int) -> bytes:
        answering.set()
        time.sleep(0.3)
        return (0).to_bytes(8, "little")  # "parse it yourself"

    fake = fake_helper(pool, slow_garbage)
    got: list[Any] = []
    parse = threading.Thread(target=lambda: got.append(opened(ckpt, pool)))
    parse.start()
    assert answering.wait(5)
    pool.close()
    assert fake.buf >= 0  # held by the parse: not closed under it
    parse.join(10)
    assert got == [want] and fake.buf < 0  # closed by the parse once its answer was read


def test_the_first_bad_shard_is_named_whether_its_header_or_its_length_is_bad(helpers: HeaderHelpers,
                                                                              tmp_path: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    (d / "m-00000.safetensors").write_bytes(struct.pack("<Q", 3) + b"{x}")  # not JSON
    (d / "m-00001.safetensors").write_bytes(struct.pack("<Q", 1 << 20) + b"{}")  # implausible length
    without = outcome(partial(opened, d))
    assert without[0] == "LoadFailed" and "m-00000" in without[1]
    assert outcome(partial(opened, d, helpers)) == without


@pytest.mark.parametrize("depth", [50, 600, 100_000])
def test_nesting_only_json_loads_reads_is_left_to_the_daemon(helpers: HeaderHelpers, depth: int,
                                                             tmp_path: Path) -> None:
    """pydantic_core refuses deep nesting; `json.loads` reads it or not by its caller's stack depth,
    so a helper (another stack) leaves such a header to the daemon."""
    meta = "[" * depth + "]" * depth
    entries = ",".join(f'"t{k}":{{"dtype":"U8","shape":[1],"data_offsets":[{k},{k + 1}]}}' for k in range(20_000))
    raw = f'{{"__metadata__":{meta},{entries}}}'.encode()
    file = tmp_path / "m.safetensors"
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 20_000)
    want = outcome(partial(opened, file))
    assert want[0] == ("LoadFailed" if depth == 100_000 else "ok")
    assert outcome(partial(opened, file, helpers)) == want
    if want[0] == "ok":
        with Checkpoint.open(file, helpers=helpers) as got:
            assert got.helped == (depth == 50)


def test_a_helper_imports_the_daemons_wcd_not_one_in_the_working_directory(monkeypatch: pytest.MonkeyPatch,
                                                                           tmp_path: Path) -> None:
    planted = tmp_path / "wcd"
    planted.mkdir()
    (planted / "__init__.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    monkeypatch.chdir(tmp_path)
    pool = HeaderHelpers(1)
    try:
        assert pool.start()
        assert len(pool._idle) == 1
    finally:
        pool.close()
    assert not (tmp_path / "ran").exists()


def test_a_helper_that_parsed_a_huge_header_is_replaced_by_a_fresh_one(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path) -> None:
    monkeypatch.setattr(header_helpers, "RETIRE_BYTES", 0)  # every header counts as huge
    ckpt = experts(tmp_path / "m", 1, 12_000)
    pool = HeaderHelpers(1)
    pool.start()
    try:
        before = helper_pids(pool)
        with Checkpoint.open(ckpt, helpers=pool) as got:
            assert got.helped == 1
        deadline = time.monotonic() + 20
        while (not pool._idle or helper_pids(pool) == before) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(pool._idle) == 1 and helper_pids(pool) != before
    finally:
        pool.close()


def test_batches_hold_enough_to_send_and_leave_the_rest_here(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(header_helpers, "MIN_HELPER_BYTES", 100)
    far, near = header_helpers.batches([], 4)
    assert not far and not near
    monkeypatch.setattr(header_helpers, "MIN_HELPER_BYTES", 0)  # never an empty batch (a helper answers none)
    assert list(header_helpers.batches([5, 5, 5], 2)[0]) == [[0], [1], [2]]
    monkeypatch.setattr(header_helpers, "MIN_HELPER_BYTES", 100)
    far, near = header_helpers.batches([30, 30, 30], 4)  # 90 in all: not worth sending
    assert not far and near == [[0, 1, 2]]
    far, near = header_helpers.batches([500, 10, 10, 500, 60, 60, 10], 1)  # target: 1150 / 4 = 287
    assert list(far) == [[0], [1, 2, 3], [4, 5, 6]] and not near
    sizes = [50] * 160  # 160 shards of small headers, 4 helpers: target 800
    far, near = header_helpers.batches(sizes, 4)
    assert [len(b) for b in far] == [16] * 10 and not near
    assert sorted(i for b in [*far, *near] for i in b) == list(range(160))  # each job once, in order
    # The pieces of a header `split` cut are a batch each, and what is between them is batched as before.
    far, near = header_helpers.batches([500, 300, 300, 10, 10, 300, 60], 1, alone={1, 2, 5})  # target 370
    assert list(far) == [[0], [1], [2], [5]] and near == [[3, 4], [6]]


def test_a_header_is_cut_into_pieces_of_at_least_a_batch(helpers: HeaderHelpers) -> None:
    entry = '"w.{k}":{{"dtype":"U8","shape":[16],"data_offsets":[{a},{b}]}}'
    raws = [("{" + ",".join(entry.format(k=k, a=16 * k, b=16 * k + 16) for k in range(n)) + "}").encode()
            for n in (30_000, 30_000, 1_000)]  # ~1.8 MB, ~1.8 MB and ~60 KB
    jobs = [(raw, 16 * 30_000) for raw in raws]
    target = header_helpers.target_bytes([len(r) for r in raws], helpers.count)
    work, owners = header_helpers.split(jobs, helpers.count)
    assert [len(r) for r in owners[:2]] == [len(raws[0]) // target] * 2 and len(owners[2]) == 1
    pieces = [len(text) for text, _ in work[: owners[1].stop]]
    assert min(pieces) >= 0.9 * target and max(pieces) < 2 * target


def test_many_shards_of_small_headers_go_to_the_helpers_in_batches(helpers: HeaderHelpers, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = experts(tmp_path / "m", 40, 1_000)  # 40 headers of ~70 KB: none worth sending alone
    monkeypatch.setattr(header_helpers, "RETIRE_BYTES", 200 << 10)  # more than a header, less than a batch
    raw_len = int.from_bytes((ckpt / "model-00000.safetensors").read_bytes()[:8], "little")
    assert raw_len < header_helpers.MIN_HELPER_BYTES
    before = helper_pids(helpers)
    assert opened(ckpt, helpers) == opened(ckpt)
    with Checkpoint.open(ckpt, helpers=helpers) as got:
        assert got.helped >= 8  # at least two batches, one per helper
    assert helper_pids(helpers) == before  # retired only after a header past RETIRE_BYTES, not a batch


def test_a_reload_that_changes_the_helper_count_says_it_takes_effect_on_restart(make_daemon: Any) -> None:
    d = make_daemon("header_helpers = 0\n")
    d.config.write_text(d.config.read_text().replace("header_helpers = 0", "header_helpers = 2"))
    d.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 20
    while "reloaded" not in d.log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    log = d.log.read_text()
    assert "WARNING reload: daemon.header_helpers = 2 takes effect on restart (0 now)" in log, log
    assert not daemon_children(d.proc.pid)  # still none


def test_a_helper_of_other_code_than_the_daemons_refuses_to_serve(monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture,
                                                                   capfd: pytest.CaptureFixture[str]) -> None:
    """After an upgrade on disk under a running daemon, a replacement helper would run the new code:
    it sees its files differ from what the daemon started with, says so in one line and exits."""
    monkeypatch.setattr(header_helpers, "_stamp", header_helpers.code_stamp() + " (before an upgrade)")
    pool = HeaderHelpers(1)
    try:
        with caplog.at_level("WARNING", logger="wcd"):
            assert pool.start() is False
        assert not pool._all
        assert [r.getMessage() for r in caplog.records][0].startswith("cannot start a header helper (")
    finally:
        pool.close()
    err = capfd.readouterr().err
    assert "wcd header helper: the daemon runs other wcd code than is installed now" in err, err
    assert "Traceback" not in err


@pytest.mark.slow
def test_a_second_clients_ping_stays_fast_while_loads_parse_with_helpers(make_daemon: Any, tmp_path: Path) -> None:
    """What the daemon's loop pays for the helpers: unpacking their answers (a few ms per 25,000
    tensors) in a worker thread. Two loads of 100,000 tensors, one after the other, beside pings
    (three at once came within 10 ms of the limit on the 2-core VM, and as close without helpers)."""
    from tests.integration.pings import assert_fast, pinging

    ckpt = experts(tmp_path / "m", 4, 25_000, uniform=True)
    d = make_daemon('header_helpers = 1\nbudget = { cpu = "1GiB" }\n')
    deadline = time.monotonic() + 20
    while "worker threads started" not in d.log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    errors: list[BaseException] = []

    def load(name: str) -> None:
        try:
            with d.client() as c:
                assert c.load(name, ckpt, device="cpu", wait=True)["tensors"] == 100_000
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    with pinging(d) as pings:
        for i in range(2):
            load(f"moe{i}")
    assert not errors, errors
    try:
        assert_fast(pings)
    except AssertionError as e:  # what the daemon did meanwhile, for whoever reads the failure
        raise AssertionError(f"{e}\n{d.log.read_text()[-3000:]}") from None
    assert re.search(r"admitting moe\d: 4 shards, headers read and fingerprinted in [0-9.]+ s \([1-4] by helpers\)",
                     d.log.read_text())
