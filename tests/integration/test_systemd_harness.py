"""The daemon under a stand-in for systemd that follows the documented protocols.

The harness owns the listening socket (socket activation: LISTEN_FDS/LISTEN_FDNAMES/LISTEN_PID)
and a NOTIFY_SOCKET datagram socket that records READY/STATUS/WATCHDOG/STOPPING/RELOADING and
keeps FDSTORE fds, handing them back on the next start like `systemctl restart` does.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from safetensors.torch import save_file

from tests.integration.conftest import same
from wcd.adoption import ADOPTING_NOTE
from wcd.client import Client
from wcd.errors import Busy, NotFound
from wcd.key import WeightCacheKey

REPO = Path(__file__).resolve().parents[2]


class FakeSystemd:
    def __init__(self, root: Path, socket_name: str = "wcd") -> None:
        self.root = root
        self.socket_name = socket_name  # systemd names it after the unit without FileDescriptorName=
        self.sock_path = root / "wcd.sock"
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(self.sock_path))
        self.listener.listen(64)
        self.notify_path = root / "notify"
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(str(self.notify_path))
        self.notify.setblocking(False)
        self.messages: list[dict[str, str]] = []
        self.store: dict[str, list[int]] = {}
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = root / "daemon.log"

    def start(self, config: Path, watchdog_usec: int | None = None, env: dict[str, str] | None = None,
              python_flags: tuple[str, ...] = ()) -> None:
        """Start the daemon as systemd would and return at READY=1. `python_flags`: the interpreter's
        (the Debian launcher runs `python3 -SsP`)."""
        # After a restart systemd passes the socket's fds, then the fd store's.
        passed = [(self.listener.fileno(), self.socket_name)] + [(fd, n) for n, fds in self.store.items() for fd in fds]
        env = dict(env or {})
        if "PYTHONPATH" in env and os.environ.get("PYTHONPATH"):  # a test's site dir, then the caller's path
            env["PYTHONPATH"] += os.pathsep + os.environ["PYTHONPATH"]
        env = {**os.environ, **env, "LISTEN_FDS": str(len(passed)),
               "LISTEN_FDNAMES": ":".join(n for _, n in passed), "NOTIFY_SOCKET": str(self.notify_path)}
        if watchdog_usec:
            env["WATCHDOG_USEC"] = str(watchdog_usec)
        sources = [fd for fd, _ in passed]

        def place_fds() -> None:  # in the child: passed fds become 3, 4, ... in LISTEN_FDNAMES order
            high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 1000) for fd in sources]
            for i, fd in enumerate(high):
                os.dup2(fd, 3 + i)

        with open(self.log, "ab") as log:
            # sh's $$ survives exec, so LISTEN_PID names the daemon itself, as systemd does.
            self.proc = subprocess.Popen(
                ["sh", "-c", 'LISTEN_PID=$$ exec "$@"', "sh", sys.executable, *python_flags, "-m", "wcd", "serve",
                 "--config", str(config), "--log-level", "debug"],
                env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=place_fds,
                pass_fds=range(3, 3 + len(passed)), cwd=str(REPO))
        self.wait_for("READY", "1", after=len(self.messages))

    def pump(self) -> None:
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(self.notify, 4096, 16)
            except BlockingIOError:
                return
            msg = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            self.messages.append(msg)
            if msg.get("FDSTORE") == "1":
                self.store.setdefault(msg["FDNAME"], []).extend(fds)
            else:
                for fd in fds:
                    os.close(fd)
            if msg.get("FDSTOREREMOVE") == "1":
                for fd in self.store.pop(msg["FDNAME"], []):
                    os.close(fd)

    def wait_for(self, key: str, value: str | None = None, after: int = 0, timeout: float = 30) -> int:
        """Index of the first message from `after` on that sets `key` (to `value`), waiting for it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.pump()
            for i, msg in enumerate(self.messages[after:], after):
                if key in msg and (value is None or msg[key] == value):
                    return i
            assert self.proc is None or self.proc.poll() is None, self.log.read_text()
            time.sleep(0.01)
        raise AssertionError(f"no {key}={value} from the daemon; got {self.messages[-5:]}\n{self.log.read_text()}")

    def stop(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=30)
        self.pump()
        return code

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for fds in self.store.values():
            for fd in fds:
                os.close(fd)
        self.listener.close()
        self.notify.close()


# Loaded by the daemon under test (through PYTHONPATH): holds the check of every re-adopted entry,
# which runs after READY, until the test creates the gate file.
GATE_SITE = """
import os, time
from wcd import parking

_manifest = parking.ParkedEntry.manifest

def _gated(self):
    while not os.path.exists(os.environ["WCD_TEST_GATE"]):
        time.sleep(0.01)
    return _manifest(self)

parking.ParkedEntry.manifest = _gated
"""


# The same for every fill of an arena from a checkpoint (`Residency._fill`'s loader call).
GATE_FILLS_SITE = """
import os, time
from wcd import loader

_fill_arena = loader.fill_arena

def _gated(*args, **kwargs):
    open(os.environ["WCD_TEST_GATE"] + ".entered", "w").close()  # a fill's worker is held here now
    while not os.path.exists(os.environ["WCD_TEST_GATE"]):
        time.sleep(0.01)
    return _fill_arena(*args, **kwargs)

loader.fill_arena = _gated
"""


def gated_checks(root: Path, site_text: str = GATE_SITE) -> tuple[dict[str, str], Path]:
    """(env for `FakeSystemd.start`, gate file): the daemon's checks of re-adopted entries (or
    with GATE_FILLS_SITE, its fills) wait until the gate file exists."""
    site = root / "gate-site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(site_text)
    return {"PYTHONPATH": str(site), "WCD_TEST_GATE": str(root / "gate")}, root / "gate"


def in_thread(job: Any) -> tuple[threading.Thread, dict[str, Any]]:
    """Run `job()` in a thread; the dict gets its "result" or "error"."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = job()
        except Exception as e:  # noqa: BLE001 - handed to the test to assert on
            out["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def waiting_acquire(harness: FakeSystemd, want: dict[str, torch.Tensor]) -> tuple[threading.Thread, dict[str, Any]]:
    """A client acquiring "m" in a thread, asserted to be still waiting after 0.5 s; its "result" is
    whether it got `want`'s values."""

    def acquire() -> bool:
        with Client(harness.sock_path) as c, c.acquire("m") as lease:
            return same(lease.tensors["w"], want["w"]) and same(lease.tensors["b"], want["b"])

    waiter, out = in_thread(acquire)
    waiter.join(0.5)
    assert waiter.is_alive(), out  # not served yet
    return waiter, out


def rewrite_record(harness: FakeSystemd, change: Any) -> None:
    """Replace the one parked record in the harness's fd store by `change(record)`."""
    [name] = [n for n in harness.store if n.endswith(".record")]
    [fd] = harness.store[name]
    rec = msgpack.unpackb(os.pread(fd, os.fstat(fd).st_size, 0), raw=False)
    change(rec)
    new = os.memfd_create("record")
    os.write(new, msgpack.packb(rec, use_bin_type=True))
    os.close(fd)
    harness.store[name] = [new]


def misalign_first_tensor(rec: dict[str, Any]) -> None:
    """A layout `parse_record` accepts and `Manifest.from_wire` refuses."""
    offsets = bytearray(rec["manifest"]["offsets"])
    offsets[0] = 8
    rec["manifest"]["offsets"] = bytes(offsets)


def park(harness: FakeSystemd, cfg: Path, name: str = "m") -> None:
    """Start the daemon, acquire `name` once (so it is loaded), wait until it is parked, stop."""
    harness.start(cfg)
    with Client(harness.sock_path) as c, c.acquire(name):
        pass
    harness.wait_for("FDSTORE", "1")
    assert harness.stop() == 0 and len(harness.store) == 2


@pytest.fixture
def fake_systemd(tmp_path):
    h = FakeSystemd(tmp_path)
    yield h
    h.close()


def write_model(path: Path, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tensors = {"w": torch.randn(256, 256, generator=g).to(torch.bfloat16), "b": torch.randn(256, generator=g)}
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    return tensors


def config(root: Path, models: dict[str, Path], extra: str = "") -> Path:
    text = f'[daemon]\nsocket = "{root / "unused.sock"}"\n{extra}'
    for name, path in models.items():
        text += f'\n[[models]]\nname = "{name}"\npath = "{path}"\n'
    cfg = root / "wcd.toml"
    cfg.write_text(text)
    return cfg


def test_restart_keeps_weights_through_the_fd_store(fake_systemd, tmp_path):
    ckpt = tmp_path / "llama"
    tensors = write_model(ckpt, seed=1)
    cfg = config(tmp_path, {"llama": ckpt})
    fake_systemd.start(cfg)
    with Client(fake_systemd.sock_path) as before:
        lease = before.acquire("llama")
        fake_systemd.wait_for("FDSTORE", "1")
        fake_systemd.wait_for("STATUS", "serving 1 entry, 1 lease, 132.0 KiB")
        shutil.move(ckpt, tmp_path / "moved-away")  # the restart must not need the checkpoint
        assert fake_systemd.stop() == 0
        assert any(m.get("STOPPING") == "1" for m in fake_systemd.messages)
        assert len(fake_systemd.store) == 2  # arena + record, still held by "systemd"
        # The engine attached before the restart keeps its data.
        assert same(lease.tensors["w"], tensors["w"])

    fake_systemd.start(cfg)
    assert fake_systemd.sock_path.exists()  # an activated socket is never unlinked
    with Client(fake_systemd.sock_path) as after:
        with after.acquire("llama") as lease2:  # waits for the check that follows READY
            assert same(lease2.tensors["w"], tensors["w"]) and same(lease2.tensors["b"], tensors["b"])
        [entry] = after.list()
        assert entry["name"] == "llama" and entry["state"] == "ready"
        assert "is missing" in entry["notes"][0]
        after.evict("llama")
    fake_systemd.wait_for("FDSTOREREMOVE", "1")
    fake_systemd.wait_for("FDSTOREREMOVE", "1", after=fake_systemd.wait_for("FDSTOREREMOVE", "1") + 1)
    assert fake_systemd.store == {}
    assert fake_systemd.stop() == 0


@pytest.mark.slow
@pytest.mark.parametrize("socket_name", ["wcd@x.socket", "unknown"])
def test_a_listener_under_any_name_is_the_listener_after_a_restart(tmp_path, socket_name):
    """A socket unit without FileDescriptorName= passes its fd under the unit's name: the daemon
    must still serve on it, and adopt the fd-store entries that follow it."""
    harness = FakeSystemd(tmp_path, socket_name)
    try:
        ckpt = tmp_path / "m"
        tensors = write_model(ckpt, seed=1)
        cfg = config(tmp_path, {"m": ckpt})
        harness.start(cfg)
        with Client(harness.sock_path) as c, c.acquire("m"):
            pass
        harness.wait_for("FDSTORE", "1")
        assert harness.stop() == 0 and len(harness.store) == 2
        harness.start(cfg)
        with Client(harness.sock_path) as c:
            with c.acquire("m") as lease:  # waits for the check that follows READY
                assert same(lease.tensors["w"], tensors["w"])
            [entry] = c.list()
            assert entry["state"] == "ready"
        log = harness.log.read_text()
        assert "adopted" in log and "dropping unknown fd" not in log and "another daemon" not in log
        assert not (tmp_path / "unused.sock").exists()  # served on the passed socket, not its own
        assert harness.stop() == 0
    finally:
        harness.close()


@pytest.mark.slow
def test_stale_and_corrupt_parked_entries_are_dropped(fake_systemd, tmp_path):
    ckpt = tmp_path / "m"
    write_model(ckpt, seed=1)
    cfg = config(tmp_path, {"m": ckpt})
    fake_systemd.start(cfg)
    with Client(fake_systemd.sock_path) as c, c.acquire("m"):
        pass
    fake_systemd.wait_for("FDSTORE", "1")
    assert fake_systemd.stop() == 0
    new = write_model(ckpt, seed=2)  # same names and shapes, new values: the parked copy is stale
    junk = os.memfd_create("junk")
    os.write(junk, b"not a record")
    fake_systemd.store["wcd-0000.record"] = [junk]
    fake_systemd.store["stray"] = [os.memfd_create("stray")]
    fake_systemd.start(cfg)
    with Client(fake_systemd.sock_path) as c, c.acquire("m") as lease:
        # Reloaded from disk, not served from the stale parked arena.
        assert same(lease.tensors["w"], new["w"])
    fake_systemd.pump()
    removed = {m["FDNAME"] for m in fake_systemd.messages if m.get("FDSTOREREMOVE") == "1"}
    assert {"stray", "wcd-0000.record", "wcd-0000.arena"} <= removed
    log = fake_systemd.log.read_text()
    assert "stale" in log and "dropping unknown fd 'stray'" in log
    assert fake_systemd.stop() == 0


def test_watchdog_pings_and_reload_on_sighup(fake_systemd, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    write_model(a, seed=1)
    tensors_b = write_model(b, seed=3)
    cfg = config(tmp_path, {"a": a})
    fake_systemd.start(cfg, watchdog_usec=200_000)
    t, at = time.monotonic(), 0
    for _ in range(3):
        at = fake_systemd.wait_for("WATCHDOG", "1", after=at) + 1
    assert time.monotonic() - t < 2
    config(tmp_path, {"b": b})  # a removed, b added
    fake_systemd.proc.send_signal(signal.SIGHUP)
    at = fake_systemd.wait_for("RELOADING", "1")
    assert int(fake_systemd.messages[at]["MONOTONIC_USEC"]) > 0
    fake_systemd.wait_for("READY", "1", after=at)
    with Client(fake_systemd.sock_path) as c:
        with c.acquire("b") as lease:
            assert same(lease.tensors["w"], tensors_b["w"])
        assert [e["name"] for e in c.list()] == ["b"]
    # A broken config on reload keeps the running one.
    cfg.write_text("[daemon\n")
    fake_systemd.proc.send_signal(signal.SIGHUP)
    at = fake_systemd.wait_for("RELOADING", "1", after=at + 1)
    at = fake_systemd.wait_for("READY", "1", after=at)
    assert fake_systemd.messages[at]["STATUS"].startswith("reload failed: config")
    with Client(fake_systemd.sock_path) as c:
        assert [e["name"] for e in c.list()] == ["b"]
    assert fake_systemd.stop() == 0


@pytest.mark.skipif(shutil.which("systemd-socket-activate") is None, reason="systemd-socket-activate not installed")
def test_real_socket_activation(tmp_path):
    ckpt = tmp_path / "m"
    tensors = write_model(ckpt, seed=5)
    cfg = config(tmp_path, {"m": ckpt})
    sock = tmp_path / "act.sock"
    log = tmp_path / "activate.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(["systemd-socket-activate", "-l", str(sock), "--fdname=wcd", sys.executable, "-m",
                                 "wcd", "serve", "--config", str(cfg)], cwd=str(REPO), stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + 30
        while not sock.exists():
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.02)
        # The first connection starts the daemon (systemd-socket-activate execs it on accept).
        try:
            with Client(sock, timeout=60) as c, c.acquire("m") as lease:
                assert same(lease.tensors["w"], tensors["w"])
                assert c.status()["socket"].startswith("socket-activated fd 3")
        except Exception as e:
            raise AssertionError(f"{e!r}\n{log.read_text()}") from e
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def publish_parked_and_stop(fake_systemd, cfg: Path) -> str:
    """Start a daemon, publish one small entry, wait until it is parked in the fd store, stop."""
    fake_systemd.start(cfg)
    with Client(fake_systemd.sock_path) as c:
        name = c.publish(WeightCacheKey(model="p", transform="test"), {"w": torch.arange(1024, dtype=torch.float32)})
        fake_systemd.wait_for("FDSTORE", "1")
    assert fake_systemd.stop() == 0
    return name


@pytest.mark.slow
def test_verify_of_a_readopted_published_entry(fake_systemd, tmp_path):
    """Issue 11, item 15: the digest taken at commit is gone after a restart; verify compares
    against one taken at re-adoption instead of failing with `internal`."""
    cfg = config(tmp_path, {})
    name = publish_parked_and_stop(fake_systemd, cfg)
    fake_systemd.start(cfg)
    with Client(fake_systemd.sock_path) as c:
        [entry] = c.list()
        assert entry["name"] == name and entry["publisher_uid"] == os.getuid()
        reply = c.verify(name)
        assert reply["match"] and reply["against"] == "digest at re-adoption after a restart"
    assert fake_systemd.stop() == 0


def test_an_acquire_before_the_check_after_ready_waits_for_it(fake_systemd, tmp_path):
    """READY comes before the re-adopted entry is checked; until then the entry is loading (status
    says why) and a client that acquires it waits, then gets it from the kept arena."""
    ckpt = tmp_path / "m"
    tensors = write_model(ckpt, seed=1)
    cfg = config(tmp_path, {"m": ckpt})
    park(fake_systemd, cfg)
    env, gate = gated_checks(tmp_path)
    fake_systemd.start(cfg, env=env)
    with Client(fake_systemd.sock_path) as c:
        [entry] = c.list()
        assert entry["state"] == "loading" and entry["notes"] == [ADOPTING_NOTE]
        assert entry["bytes"] > 0  # charged to the budget already
        with pytest.raises(Busy, match="is loading"):
            c.acquire("m", wait=False)

        waiter, out = waiting_acquire(fake_systemd, tensors)
        gate.touch()
        waiter.join(30)
        assert out == {"result": True}
        [entry] = c.list()
        assert entry["state"] == "ready" and entry["notes"] == [] and entry["tensors"] == 2
    log = fake_systemd.log.read_text()
    assert log.count("loading m:") == 1 and "adopted m from systemd's fd store" in log  # no disk read
    assert fake_systemd.stop() == 0


@pytest.mark.slow
def test_a_stale_checkpoint_is_never_served_to_a_client_waiting_for_the_check(fake_systemd, tmp_path):
    """The checkpoint changed while the daemon was down: the check after READY drops the kept copy
    and loads the model again from disk; a client already waiting gets the new values, not an error."""
    ckpt = tmp_path / "m"
    write_model(ckpt, seed=1)
    cfg = config(tmp_path, {"m": ckpt})
    park(fake_systemd, cfg)
    parked = set(fake_systemd.store)
    new = write_model(ckpt, seed=2)  # same names and shapes, new values: the parked copy is stale
    env, gate = gated_checks(tmp_path)
    fake_systemd.start(cfg, env=env)

    waiter, out = waiting_acquire(fake_systemd, new)
    at = len(fake_systemd.messages)
    gate.touch()
    waiter.join(30)
    assert out == {"result": True}
    fake_systemd.wait_for("FDSTORE", "1", after=at)  # the reloaded entry, parked under its new key
    removed = {m["FDNAME"] for m in fake_systemd.messages[at:] if m.get("FDSTOREREMOVE") == "1"}
    assert removed == parked and len(fake_systemd.store) == 2 and not parked & set(fake_systemd.store)
    log = fake_systemd.log.read_text()
    assert "fd store: dropping m: stale: " in log and log.count("loading m:") == 2
    assert fake_systemd.stop() == 0


def test_a_record_that_fails_the_check_after_ready_is_dropped(fake_systemd, tmp_path):
    """A record whose layout passes the quick parse before READY but not the full validation after:
    dropped with one line naming the problem, its fds unstored; the configured model is loaded
    from disk for the client waiting for it."""
    ckpt = tmp_path / "m"
    tensors = write_model(ckpt, seed=1)
    cfg = config(tmp_path, {"m": ckpt})
    park(fake_systemd, cfg)
    parked = set(fake_systemd.store)
    rewrite_record(fake_systemd, misalign_first_tensor)
    env, gate = gated_checks(tmp_path)
    fake_systemd.start(cfg, env=env)
    with Client(fake_systemd.sock_path) as c:
        assert c.list()[0]["state"] == "loading"
        waiter, out = in_thread(lambda: c.acquire("m"))
        waiter.join(0.5)
        assert waiter.is_alive(), out
        gate.touch()
        waiter.join(30)
        with out["result"] as lease:
            assert same(lease.tensors["w"], tensors["w"])
    log = fake_systemd.log.read_text()
    [line] = [line for line in log.splitlines() if "fd store: dropping m:" in line]
    assert "not aligned or outside the arena" in line
    assert log.count("loading m:") == 2
    fake_systemd.pump()
    assert parked <= {m["FDNAME"] for m in fake_systemd.messages if m.get("FDSTOREREMOVE") == "1"}
    assert fake_systemd.stop() == 0


@pytest.mark.slow
def test_a_published_entry_that_fails_the_check_is_not_served(fake_systemd, tmp_path):
    """No checkpoint to fall back on: a client waiting for it is told it went away."""
    cfg = config(tmp_path, {})
    name = publish_parked_and_stop(fake_systemd, cfg)
    rewrite_record(fake_systemd, misalign_first_tensor)
    env, gate = gated_checks(tmp_path)
    fake_systemd.start(cfg, env=env)
    with Client(fake_systemd.sock_path) as c:
        waiter, out = in_thread(lambda: c.acquire(name))
        waiter.join(0.5)
        assert waiter.is_alive(), out
        gate.touch()
        waiter.join(30)
        assert isinstance(out.get("error"), NotFound) and "went away" in str(out["error"]), out
        assert c.list() == []
    assert f"fd store: dropping {name}: tensor 'w'" in fake_systemd.log.read_text()
    fake_systemd.pump()
    assert fake_systemd.store == {}
    assert fake_systemd.stop() == 0


def _sighup_and_wait(harness: FakeSystemd) -> None:
    at = len(harness.messages)
    harness.proc.send_signal(signal.SIGHUP)
    harness.wait_for("READY", "1", after=harness.wait_for("RELOADING", "1", after=at))


def _this_run(harness: FakeSystemd, since: int) -> str:
    return harness.log.read_text()[since:]


@pytest.mark.slow
def test_a_model_changed_by_sighup_while_its_readopted_entry_is_checked_loads_once_the_check_ends(
        fake_systemd, tmp_path):
    """The reload cannot drop the kept entry while its check runs: the entry goes when the check
    ends, and the model is loaded then per the new config, once, with no second SIGHUP; a client
    already waiting for the entry gets the new model's values, and the fd store ends up holding it."""
    a, b = tmp_path / "a", tmp_path / "b"
    write_model(a, seed=1)
    new = write_model(b, seed=2)
    cfg = config(tmp_path, {"m": a})
    park(fake_systemd, cfg)
    parked = set(fake_systemd.store)
    env, gate = gated_checks(tmp_path)
    since = len(fake_systemd.log.read_text())
    fake_systemd.start(cfg, env=env)

    waiter, out = waiting_acquire(fake_systemd, new)
    config(tmp_path, {"m": b})
    at = len(fake_systemd.messages)
    _sighup_and_wait(fake_systemd)
    with Client(fake_systemd.sock_path) as c:
        [entry] = c.list()
        assert entry["state"] == "evicting" and entry["key"]["path"] == str(a)  # still being checked
    gate.touch()
    waiter.join(30)
    assert out == {"result": True}
    with Client(fake_systemd.sock_path) as c:
        [entry] = c.list()
        assert entry["state"] == "ready" and entry["key"]["path"] == str(b)
    fake_systemd.wait_for("FDSTORE", "1", after=at)  # the new entry, parked under its own key
    removed = {m["FDNAME"] for m in fake_systemd.messages[at:] if m.get("FDSTOREREMOVE") == "1"}
    assert removed == parked and len(fake_systemd.store) == 2 and not parked & set(fake_systemd.store)
    log = _this_run(fake_systemd, since)
    assert log.count("admitting m:") == 1 and log.count("loading m:") == 1 and "adopted m" not in log
    assert "ERROR" not in log and sum("RELOADING" in m for m in fake_systemd.messages) == 1
    assert fake_systemd.stop() == 0


def test_a_model_changed_by_sighup_while_it_loads_is_loaded_per_the_new_config_once_that_load_ends(
        fake_systemd, tmp_path):
    """The same for a load in progress: the reload stops it, and the model is loaded per the new
    config as it ends, once; a client waiting for the first load gets the new model's values."""
    a, b = tmp_path / "a", tmp_path / "b"
    write_model(a, seed=1)
    new = write_model(b, seed=2)
    cfg = config(tmp_path, {"m": a})
    env, gate = gated_checks(tmp_path, GATE_FILLS_SITE)
    fake_systemd.start(cfg, env=env)
    with Client(fake_systemd.sock_path) as c:
        assert c.list()[0]["state"] == "loading"

        waiter, out = waiting_acquire(fake_systemd, new)
        config(tmp_path, {"m": b})
        _sighup_and_wait(fake_systemd)
        [entry] = c.list()
        assert entry["state"] == "evicting" and entry["key"]["path"] == str(a)  # its fill has not ended
        gate.touch()
        waiter.join(30)
        assert out == {"result": True}
        [entry] = c.list()
        assert entry["state"] == "ready" and entry["key"]["path"] == str(b)
    fake_systemd.wait_for("FDSTORE", "1")
    assert len(fake_systemd.store) == 2  # only the new entry was parked
    log = fake_systemd.log.read_text()
    assert log.count("admitting m:") == 2 and log.count("loading m:") == 2 and log.count("loaded m") == 1
    assert "ERROR" not in log and sum("RELOADING" in m for m in fake_systemd.messages) == 1
    assert fake_systemd.stop() == 0


def test_a_model_changed_by_sighup_while_it_is_leased_is_loaded_per_the_new_config_once_the_lease_ends(
        fake_systemd, tmp_path):
    """A leased entry cannot go while an engine maps it: it is evicted when its last lease ends, and
    the model is loaded then per the new config, with no second SIGHUP; an engine that acquires it
    again at once waits for that load instead of not finding the name."""
    a, b = tmp_path / "a", tmp_path / "b"
    write_model(a, seed=1)
    new = write_model(b, seed=2)
    cfg = config(tmp_path, {"m": a})
    fake_systemd.start(cfg)
    with Client(fake_systemd.sock_path) as c:
        lease = c.acquire("m")
        config(tmp_path, {"m": b})
        _sighup_and_wait(fake_systemd)
        [entry] = c.list()
        assert entry["state"] == "evicting" and entry["key"]["path"] == str(a)  # still leased
        lease.release()
        with c.acquire("m") as lease:  # in the same breath
            assert same(lease.tensors["w"], new["w"]) and same(lease.tensors["b"], new["b"])
        [entry] = c.list()
        assert entry["state"] == "ready" and entry["key"]["path"] == str(b)
    log = fake_systemd.log.read_text()
    assert log.count("admitting m:") == 2 and log.count("loaded m") == 2 and "ERROR" not in log
    assert fake_systemd.stop() == 0


# Loaded by the daemon under test (through PYTHONPATH): an arena whose release never returns, as
# under a hung GPU driver.
HUNG_RELEASE_SITE = """
import time
from wcd.arenas import host

host.HostArena._release = lambda self: time.sleep(3600)
"""


def stops_after_the_bounded_wait(harness: FakeSystemd, says: str) -> None:
    """SIGTERM: the daemon exits cleanly after RELEASE_WAIT_S (not systemd's stop timeout), saying
    `says` once and no traceback."""
    from wcd.shutdown import RELEASE_WAIT_S

    started = time.monotonic()
    assert harness.stop() == 0
    took = time.monotonic() - started
    log = harness.log.read_text()
    assert RELEASE_WAIT_S <= took < RELEASE_WAIT_S + 10, f"stopped in {took:.3f} s; the daemon's log:\n{log}"
    assert log.count(says) == 1 and "Traceback" not in log


@pytest.mark.slow
def test_a_driver_hung_at_shutdown_holds_the_exit_for_the_bounded_wait_only(fake_systemd, tmp_path):
    """systemd stops the daemon while releasing an arena hangs: it says so in one line and exits
    (status 0, the arena parked for the next start) after RELEASE_WAIT_S, not at the stop timeout."""
    ckpt = tmp_path / "m"
    write_model(ckpt, seed=1)
    cfg = config(tmp_path, {"m": ckpt})
    site = tmp_path / "hung-site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(HUNG_RELEASE_SITE)
    fake_systemd.start(cfg, env={"PYTHONPATH": str(site)})
    with Client(fake_systemd.sock_path) as c, c.acquire("m"):
        pass
    fake_systemd.wait_for("FDSTORE", "1")
    stops_after_the_bounded_wait(fake_systemd, "has not let go of 1 arena")


@pytest.mark.slow
def test_a_load_stuck_in_the_driver_at_shutdown_holds_the_exit_for_the_bounded_wait_only(fake_systemd, tmp_path):
    """A fill's worker that never comes back (here: held at a gate that never opens, as in a hung
    driver call) would be joined at the interpreter's exit until systemd's stop timeout: the daemon
    waits RELEASE_WAIT_S for its worker threads, says so in one line, and exits."""
    ckpt = tmp_path / "m"
    write_model(ckpt, seed=1)
    cfg = config(tmp_path, {"m": ckpt})
    env, gate = gated_checks(tmp_path, GATE_FILLS_SITE)
    fake_systemd.start(cfg, env=env)
    with Client(fake_systemd.sock_path) as c:
        [entry] = c.list()
        assert entry["state"] == "loading"
    entered = gate.with_name(gate.name + ".entered")
    deadline = time.monotonic() + 30
    while not entered.exists():  # stopped before its worker got there, the fill just stops
        assert time.monotonic() < deadline, "the fill never reached the loader"
        time.sleep(0.01)
    stops_after_the_bounded_wait(fake_systemd, "worker threads still busy after")


def _parked_arenas(harness: FakeSystemd) -> int:
    harness.pump()
    return sum(name.endswith(".arena") for name in harness.store)


def _wait_parked(harness: FakeSystemd, count: int) -> None:
    deadline = time.monotonic() + 30
    while _parked_arenas(harness) != count and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _parked_arenas(harness) == count, sorted(harness.store)


def _wait_checked(client: Client) -> None:
    """Until no entry is loading: the re-adopted ones are checked after READY."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(e["state"] == "loading" for e in client.list()):
        time.sleep(0.05)


def test_every_live_generation_survives_a_restart_and_a_rollback_stays_rolled_back(fake_systemd, tmp_path):
    """Issue 31: the fd store keeps every live generation; after a restart the newest is current
    and followers get its bytes, with no publish; a rollback before a restart is still in force
    after it (the generations after the rolled-back-to one left the fd store)."""
    cfg = config(tmp_path, {}, "keep_generations = 2\n")
    gen = {g: {"w": torch.full((1024,), float(g))} for g in (1, 2, 3)}
    fake_systemd.start(cfg)
    with Client(fake_systemd.sock_path) as c:
        for g in (1, 2, 3):
            assert c.publish_generation("s", gen[g]) == g
        _wait_parked(fake_systemd, 3)
    assert fake_systemd.stop() == 0

    fake_systemd.start(cfg)
    with Client(fake_systemd.sock_path) as c:
        _wait_checked(c)
        states = {e["name"]: (e["state"], e.get("current")) for e in c.list()}
        assert states == {"s@1": ("previous", False), "s@2": ("previous", False), "s@3": ("ready", True)}, states
        with c.follow("s") as f:
            assert f.generation == 3 and same(f.tensors["w"], gen[3]["w"])
        assert c.rollback("s")["generation"] == 2
        _wait_parked(fake_systemd, 2)  # generation 3 left the fd store
        assert c.rollback("s", 3)["generation"] == 3
        _wait_parked(fake_systemd, 3)  # forward again: back in the fd store
        assert c.rollback("s", 2)["generation"] == 2
        _wait_parked(fake_systemd, 2)
    assert fake_systemd.stop() == 0

    fake_systemd.start(cfg)
    with Client(fake_systemd.sock_path) as c:
        _wait_checked(c)
        with c.follow("s") as f:
            assert f.generation == 2 and same(f.tensors["w"], gen[2]["w"]), "still rolled back"
        assert c.publish_generation("s", gen[1]) == 3, "numbering goes on from the newest kept generation"
    assert fake_systemd.stop() == 0
