"""Who owns the arena fd of an entry re-adopted from systemd's fd store, on every path of the check
after READY (`Residency._check_adopted`): no leak, no close under the worker still opening it."""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import pytest

from wcd import residency
from wcd.arenas.base import Arena
from wcd.cache import Cache
from wcd.config import Config
from wcd.errors import DeviceUnavailable
from wcd.key import WeightCacheKey
from wcd.manifest import Manifest
from wcd.metrics import Metrics
from wcd.residency import Residency
from wcd.state import ServerState


class FakeArena(Arena):
    kind = "host"

    def __init__(self, fd: int, size: int) -> None:
        self._fd, self.size, self.device = fd, size, "cpu"
        self.released = False

    def fd(self) -> int:
        return self._fd

    def writer(self) -> Any:
        raise NotImplementedError

    def seal(self) -> None:
        pass

    def _read(self, offset: int, nbytes: int) -> bytes:
        return b""

    def _release(self) -> None:
        self.released = True
        os.close(self._fd)


class FakeBackend:
    def __init__(self, gate: threading.Event | None = None) -> None:
        self.gate, self.entered, self.seen = gate, threading.Event(), []

    def configure(self, *a: Any, **k: Any) -> None:
        pass

    def adopt(self, fd: int, device: str, size: int, label: str) -> FakeArena:
        self.entered.set()
        if self.gate is not None:
            self.gate.wait(5)
        self.seen.append(os.fstat(fd).st_ino)  # what the worker really reads through `fd`
        self.arena = FakeArena(fd, size)
        return self.arena


@dataclass
class Rec:
    name: str
    key: WeightCacheKey
    arena_size: int = 4096
    retention: str = "cached"
    origin: str = "publish"
    publisher: int = 0
    gate: threading.Event | None = None

    def manifest(self) -> Manifest:
        if self.gate is not None:
            self.gate.wait(5)
        return Manifest.build([("w", "F32", [4])])


def make() -> Residency:
    state = ServerState(Config(), "t", Cache({"cpu": 1 << 30}, 30.0), {"cpu": "cpu"}, 0.0)
    return Residency(state, Metrics(state), lambda c: asyncio.ensure_future(c))


def arena_fd() -> int:
    return os.memfd_create("arena")


def is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def test_a_backend_that_fails_to_load_closes_the_arena_fd(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU arena's fd kept open would keep its memory allocated while the budget counts it free."""
    def no_backend(device: str) -> Any:
        raise DeviceUnavailable("device 'cuda:0' needs cuda-bindings, which is not installed: ...")

    monkeypatch.setattr(residency, "backend_for", no_backend)
    monkeypatch.setattr(residency, "_unstore", lambda name: None)

    async def main() -> int:
        res = make()
        rec = Rec("m", WeightCacheKey(model="m"))
        entry = res._adopt(rec)
        fd = arena_fd()
        await res._check_adopted(entry, rec, fd)
        assert "m" not in res.cache.entries
        return fd

    fd = asyncio.run(main())
    assert not is_open(fd), "the arena fd leaked"


def test_a_check_cancelled_while_its_worker_opens_the_arena_closes_it_once_the_worker_is_done(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Shutdown cancels the check: the fd stays the worker's until it returns, then its arena goes."""
    gate = threading.Event()
    backend = FakeBackend(gate)
    monkeypatch.setattr(residency, "backend_for", lambda device: backend)

    async def main() -> int:
        res = make()
        rec = Rec("m", WeightCacheKey(model="m"))
        entry = res._adopt(rec)
        fd = arena_fd()
        task = asyncio.ensure_future(res._check_adopted(entry, rec, fd))
        await asyncio.to_thread(backend.entered.wait, 5)
        task.cancel()  # Server.shutdown
        with pytest.raises(asyncio.CancelledError):
            await task
        assert is_open(fd), "closed under the worker"
        inode = os.fstat(fd).st_ino
        gate.set()
        for _ in range(100):
            await asyncio.sleep(0.02)
            if getattr(backend, "arena", None) is not None and backend.arena.released:
                break
        assert backend.seen == [inode] and backend.arena.released
        return fd

    fd = asyncio.run(main())
    assert not is_open(fd)


def test_a_second_evict_during_the_check_drops_the_entry_quietly(monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    gate = threading.Event()
    backend = FakeBackend()
    monkeypatch.setattr(residency, "backend_for", lambda device: backend)
    monkeypatch.setattr(residency, "_unstore", lambda name: None)
    caplog.set_level(logging.INFO, logger="wcd")

    async def main() -> None:
        res = make()
        rec = Rec("m", WeightCacheKey(model="m"), gate=gate)
        entry = res._adopt(rec)
        task = asyncio.ensure_future(res._check_adopted(entry, rec, arena_fd()))
        await asyncio.to_thread(backend.entered.wait, 5)
        await asyncio.sleep(0.1)
        res.evict(entry)  # wcdctl evict m: marked evicting (it is loading)
        res.evict(entry)  # again (or a second SIGHUP's supersede): dropped now, its arena closed
        gate.set()
        await task
        assert "m" not in res.cache.entries and backend.arena.released

    asyncio.run(main())
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == [], warnings


def test_an_acquire_after_a_reload_changed_an_entry_still_being_checked_waits_for_the_check(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A reload that changes (here: removes) a model whose entry is still being checked evicts it
    once the check ends. An acquire with wait=True arriving in between waits for that end rather
    than being refused at once as `evicting`; the model is gone from the config, so it then hears
    the entry went away."""
    from types import SimpleNamespace

    from wcd import ops, protocol
    from wcd.errors import NotFound

    gate = threading.Event()
    backend = FakeBackend()
    monkeypatch.setattr(residency, "backend_for", lambda device: backend)
    monkeypatch.setattr(residency, "_unstore", lambda name: None)

    async def main() -> float:
        res = make()
        rec = Rec("m", WeightCacheKey(model="m"), gate=gate)
        entry = res._adopt(rec)
        task = asyncio.ensure_future(res._check_adopted(entry, rec, arena_fd()))
        await asyncio.to_thread(backend.entered.wait, 5)
        res.supersede(entry)  # SIGHUP: m is no longer configured
        assert entry.state == "evicting" and res.still_loading(entry)
        ctx = ops.Context(res.state, res, res._metrics)
        conn = SimpleNamespace(version=2, pid=1, uid=0, quotas=SimpleNamespace(fd_room=lambda c: None))
        req = protocol.Acquire(op="acquire", id=1, name="m", wait=True, timeout_s=5)
        asyncio.get_running_loop().call_later(0.3, gate.set)  # the check ends
        started = time.monotonic()
        with pytest.raises(NotFound, match="went away"):
            await ops.acquire(ctx, conn, req)  # type: ignore[arg-type]
        await task
        assert "m" not in res.cache.entries
        return time.monotonic() - started

    assert asyncio.run(main()) >= 0.25  # it waited for the check
