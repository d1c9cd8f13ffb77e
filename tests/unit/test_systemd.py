"""wcd.systemd against a stand-in for systemd: a real AF_UNIX datagram socket as NOTIFY_SOCKET,
real fds over SCM_RIGHTS, and LISTEN_* set up in a child process as systemd would."""

from __future__ import annotations

import json
import os
import select
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from wcd import systemd

ROOT = Path(__file__).resolve().parents[2]
SYSTEMD_VARS = ("NOTIFY_SOCKET", "LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES", "WATCHDOG_USEC", "WATCHDOG_PID")


@pytest.fixture(autouse=True)
def no_systemd(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in SYSTEMD_VARS:
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def manager(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """The service manager's end of NOTIFY_SOCKET."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(tmp_path / "notify"))
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify"))
        yield sock


@pytest.fixture
def notifier(manager: socket.socket) -> Iterator[systemd.Notifier]:
    n = systemd.Notifier()
    yield n
    n.close()


def receive(sock: socket.socket) -> tuple[str, list[int]]:
    data, fds, _, _ = socket.recv_fds(sock, 65536, 512)
    return data.decode(), fds


def nothing_pending(sock: socket.socket) -> bool:
    return not select.select([sock], [], [], 0)[0]


def memfd(content: bytes) -> int:
    fd = os.memfd_create("wcd-test")
    os.write(fd, content)
    return fd


def read_all(fd: int) -> bytes:
    return os.pread(fd, 1 << 16, 0)


# --- without systemd ----------------------------------------------------------------------


def test_without_systemd_everything_is_a_noop() -> None:
    n = systemd.Notifier()
    assert not n.enabled
    n.ready("up")
    n.status("s")
    n.watchdog()
    n.reloading()
    n.stopping()
    n.close()
    assert not systemd.store_enabled()
    fd = memfd(b"x")
    try:
        systemd.store_fds([fd], "entry")
        systemd.remove_fds("entry")
    finally:
        os.close(fd)
    assert systemd.listen_fds() == []
    assert systemd.watchdog_interval() is None


# --- sd_notify ----------------------------------------------------------------------------


def test_plain_notifications(manager: socket.socket, notifier: systemd.Notifier) -> None:
    assert notifier.enabled
    notifier.ready()
    assert receive(manager) == ("READY=1", [])
    notifier.ready("serving 2 entries")
    assert receive(manager) == ("READY=1\nSTATUS=serving 2 entries", [])
    notifier.status("loading llama70b: 41%")
    assert receive(manager) == ("STATUS=loading llama70b: 41%", [])
    notifier.watchdog()
    assert receive(manager) == ("WATCHDOG=1", [])
    notifier.stopping("parking 3 entries")
    assert receive(manager) == ("STOPPING=1\nSTATUS=parking 3 entries", [])


def test_reloading_carries_monotonic_usec(manager: socket.socket, notifier: systemd.Notifier) -> None:
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    notifier.reloading("reloading /etc/wcd/x.toml")
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    text, fds = receive(manager)
    reloading, usec, status = text.split("\n")
    assert (reloading, status, fds) == ("RELOADING=1", "STATUS=reloading /etc/wcd/x.toml", [])
    key, _, value = usec.partition("=")
    assert key == "MONOTONIC_USEC" and before <= int(value) <= after


def test_status_stays_one_line(manager: socket.socket, notifier: systemd.Notifier) -> None:
    notifier.status("model a\nREADY=1")
    assert receive(manager) == ("STATUS=model a READY=1", [])


def test_status_is_utf8_and_cut_to_fit_a_datagram(manager: socket.socket, notifier: systemd.Notifier) -> None:
    notifier.status("modèle " + "é" * 5000)
    data = manager.recv(65536)
    assert len(data) < systemd.NOTIFY_BUFFER_MAX
    text = data.decode()  # cut on a character boundary
    assert text.startswith("STATUS=modèle éé")


def test_abstract_notify_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"wcd-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        n = systemd.Notifier()
        n.ready()
        n.close()
        assert receive(sock) == ("READY=1", [])
        fd = memfd(b"abstract")
        try:
            systemd.store_fds([fd], "entry")
        finally:
            os.close(fd)
        text, fds = receive(sock)
        assert text == "FDSTORE=1\nFDNAME=entry" and read_all(fds[0]) == b"abstract"
        os.close(fds[0])


def test_unreachable_notify_socket_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "missing"))
    with pytest.raises(systemd.SystemdError, match="cannot connect to NOTIFY_SOCKET=.*missing"):
        systemd.Notifier()


def test_send_failure_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    n = systemd.Notifier()
    sock.close()  # the manager went away after we connected
    try:
        with pytest.raises(systemd.SystemdError, match=r"sd_notify 'WATCHDOG=1' to .*notify failed"):
            n.watchdog()
    finally:
        n.close()


def test_unsupported_notify_socket_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", "vsock:2:1234")
    with pytest.raises(systemd.SystemdError, match="not an AF_UNIX path"):
        systemd.Notifier()
    with pytest.raises(systemd.SystemdError, match="not an AF_UNIX path"):
        systemd.store_enabled()


# --- fd store -----------------------------------------------------------------------------


def test_store_fds_passes_the_fds(manager: socket.socket) -> None:
    assert systemd.store_enabled()
    arena, manifest = memfd(b"weights"), memfd(b"manifest")
    try:
        systemd.store_fds([arena, manifest], "entry-7.cpu")
        text, fds = receive(manager)
        assert text == "FDSTORE=1\nFDNAME=entry-7.cpu"
        assert [read_all(fd) for fd in fds] == [b"weights", b"manifest"]
        assert read_all(arena) == b"weights"  # ours stay open
    finally:
        for fd in (arena, manifest, *fds):
            os.close(fd)


def test_store_fds_splits_at_the_kernel_limit(manager: socket.socket) -> None:
    base = memfd(b"x")
    many = [os.dup(base) for _ in range(300)]
    try:
        systemd.store_fds(many, "big")
        first, second = receive(manager), receive(manager)
        assert (first[0], second[0]) == ("FDSTORE=1\nFDNAME=big", "FDSTORE=1\nFDNAME=big")
        assert (len(first[1]), len(second[1])) == (systemd.SCM_MAX_FD, 300 - systemd.SCM_MAX_FD)
        assert nothing_pending(manager)
    finally:
        for fd in [base, *many, *first[1], *second[1]]:
            os.close(fd)


def test_remove_fds(manager: socket.socket) -> None:
    systemd.remove_fds("entry-7.cpu")
    assert receive(manager) == ("FDSTOREREMOVE=1\nFDNAME=entry-7.cpu", [])


def test_store_failure_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "missing"))
    fd = memfd(b"x")
    try:
        with pytest.raises(systemd.SystemdError, match=r"'FDSTORE=1' with 1 fds to .*missing failed"):
            systemd.store_fds([fd], "entry")
    finally:
        os.close(fd)


@pytest.mark.parametrize("name", ["", "a:b", "x" * 256, "tab\there", "new\nline", "é", "del\x7f"])
def test_invalid_fd_names_are_refused(manager: socket.socket, name: str) -> None:
    with pytest.raises(ValueError, match="invalid fd store name"):
        systemd.store_fds([0], name)
    with pytest.raises(ValueError, match="invalid fd store name"):
        systemd.remove_fds(name)
    assert nothing_pending(manager)


@pytest.mark.parametrize("name", ["x" * 255, "entry 1=ok~!"])
def test_valid_fd_names_are_sent(manager: socket.socket, name: str) -> None:
    systemd.remove_fds(name)
    assert receive(manager) == (f"FDSTOREREMOVE=1\nFDNAME={name}", [])


def test_store_nothing_is_refused(manager: socket.socket) -> None:
    with pytest.raises(ValueError, match="no fds"):
        systemd.store_fds([], "entry")


# --- socket activation --------------------------------------------------------------------

# Runs in a fresh process: puts two sockets at fds 3 and 4 as systemd would, sets the LISTEN_*
# variables from argv ("self" stands for its own pid), calls listen_fds() and reports.
CHILD = textwrap.dedent(
    """
    import fcntl, json, os, socket, sys
    from wcd import systemd
    spec = json.loads(sys.argv[1])
    for target in (3, 4):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            high = fcntl.fcntl(s.fileno(), fcntl.F_DUPFD_CLOEXEC, 100)  # off 3 and 4 first
        os.dup2(high, target, inheritable=True)
        os.close(high)
    for var, value in spec.items():
        os.environ[var] = str(os.getpid()) if value == "self" else value
    try:
        result = systemd.listen_fds()
    except systemd.SystemdError as e:
        result = str(e)
    print(json.dumps({
        "result": result,
        "left": sorted(v for v in os.environ if v.startswith("LISTEN_")),
        "inheritable": [os.get_inheritable(3), os.get_inheritable(4)],
        "types": [socket.socket(fileno=os.dup(fd)).type == socket.SOCK_STREAM for fd in (3, 4)],
    }))
    """
)


def run_child(spec: dict[str, str]) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(spec)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, check=True,
    ).stdout
    report: dict[str, object] = json.loads(out)
    return report


def test_listen_fds_maps_names_and_unsets_the_variables() -> None:
    report = run_child({"LISTEN_PID": "self", "LISTEN_FDS": "2", "LISTEN_FDNAMES": "wcd:entry-1.cpu"})
    assert report == {
        "result": [[3, "wcd"], [4, "entry-1.cpu"]],
        "left": [],
        "inheritable": [False, False],
        "types": [True, True],
    }


def test_listen_fds_without_names_calls_them_unknown() -> None:
    report = run_child({"LISTEN_PID": "self", "LISTEN_FDS": "1"})
    assert report["result"] == [[3, "unknown"]]
    assert report["inheritable"] == [False, True]


def test_listen_fds_for_another_pid_are_ignored_and_unset() -> None:
    report = run_child({"LISTEN_PID": "1", "LISTEN_FDS": "2", "LISTEN_FDNAMES": "wcd:x"})
    assert report["result"] == [] and report["left"] == []
    assert report["inheritable"] == [True, True]  # not ours: left alone


def test_listen_fds_with_mismatched_names_raises_and_unsets() -> None:
    report = run_child({"LISTEN_PID": "self", "LISTEN_FDS": "2", "LISTEN_FDNAMES": "wcd"})
    assert report["result"] == "LISTEN_FDNAMES has 1 names for LISTEN_FDS=2 fds"
    assert report["left"] == []


def test_listen_fds_with_garbage_raises() -> None:
    report = run_child({"LISTEN_PID": "self", "LISTEN_FDS": "two"})
    assert report["result"] == "LISTEN_FDS='two' is not a number"


@pytest.mark.skipif(shutil.which("systemd-socket-activate") is None, reason="systemd-socket-activate not installed")
def test_listen_fds_from_real_socket_activation(tmp_path: Path) -> None:
    """systemd's own activation helper sets LISTEN_* for the exec'd child exactly as PID 1 would."""
    path = tmp_path / "wcd.sock"
    code = "import json; from wcd import systemd; print(json.dumps(systemd.listen_fds()))"
    proc = subprocess.Popen(
        ["systemd-socket-activate", "--listen", str(path), "--fdname=wcd", sys.executable, "-c", code],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    with proc:  # closes its pipes whatever happens
        try:
            deadline = time.monotonic() + 10
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
                while True:  # the socket's file exists from its bind, before the helper listens
                    try:
                        client.connect(str(path))  # the first connection spawns the child
                        break
                    except (FileNotFoundError, ConnectionRefusedError):
                        assert time.monotonic() < deadline, "systemd-socket-activate did not listen in 10 s"
                        time.sleep(0.01)
                out, err = proc.communicate(timeout=30)
        finally:
            proc.kill()
            proc.wait()
    assert json.loads(out) == [[3, "wcd"]], err


# --- watchdog -----------------------------------------------------------------------------


def test_watchdog_interval_is_half_of_watchdog_usec(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    assert systemd.watchdog_interval() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert systemd.watchdog_interval() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))
    assert systemd.watchdog_interval() is None
    monkeypatch.delenv("WATCHDOG_PID")
    monkeypatch.setenv("WATCHDOG_USEC", "0")
    assert systemd.watchdog_interval() is None
    monkeypatch.setenv("WATCHDOG_USEC", "30s")
    with pytest.raises(systemd.SystemdError, match="WATCHDOG_USEC='30s' is not a number"):
        systemd.watchdog_interval()


# --- boundaries ---------------------------------------------------------------------------


def test_imports_neither_torch_nor_the_server() -> None:
    code = "import sys, wcd.systemd; print(sorted(m for m in sys.modules if m == 'torch' or m == 'wcd.server'))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, check=True,
    ).stdout
    assert out.strip() == "[]"


def test_the_listener_is_found_by_what_it_is_not_its_name(tmp_path: Path) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "s"))
    listener.listen(1)
    unlistened = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(1)
    memfd = os.memfd_create("arena")
    try:
        passed = [(memfd, "wcd-0000.arena"), (listener.fileno(), "wcd@x.socket"), (unlistened.fileno(), "wcd"),
                  (tcp.fileno(), "metrics")]
        assert systemd.split_listener(passed) == (listener.fileno(), [passed[0], passed[2], passed[3]])
        assert systemd.split_listener([passed[0]]) == (None, [passed[0]])
        other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        other.bind(str(tmp_path / "t"))
        other.listen(1)
        with other, pytest.raises(systemd.SystemdError, match="2 listening sockets .* one ListenStream="):
            systemd.split_listener([(listener.fileno(), "a"), (other.fileno(), "b")])
    finally:
        for s in (listener, unlistened, tcp):
            s.close()
        os.close(memfd)
