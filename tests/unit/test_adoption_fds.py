"""Who owns the arena fd of an entry re-adopted from systemd's fd store, on every path of the check
after READY (`Residency._check_adopted`): no leak, no close under the worker still opening it."""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from wcd import adoption, devices, residency, systemd
from wcd.arenas.base import Arena
from wcd.cache import Cache, Entry
from wcd.config import Config
from wcd.errors import BadRequest, DeviceUnavailable, Internal, NotFound, OutOfMemory
from wcd.key import WeightCacheKey
from wcd.life import life
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
    asked_by: int | None = None
    gate: threading.Event | None = None
    manifest_wire: dict[str, Any] = field(default_factory=lambda: Manifest.build([("w", "F32", [4])]).to_wire())

    def manifest(self) -> Manifest:
        if self.gate is not None:
            self.gate.wait(5)
        return Manifest.build([("w", "F32", [4])])


def make() -> Residency:
    state = ServerState(Config(), "t", Cache({"cpu": 1 << 30}, 30.0), {"cpu": "cpu"}, 0.0)
    return Residency(state, Metrics(state), lambda c: asyncio.ensure_future(c))


def adopted(gate: threading.Event | None = None) -> tuple[Residency, Rec, Entry]:
    """A residency with "m" admitted from a record, as before READY (`_adopt`): loading, unchecked."""
    res = make()
    rec = Rec("m", WeightCacheKey(model="m"), gate=gate)
    return res, rec, res._adopt(rec, arena_fd())


def patch_backend(monkeypatch: pytest.MonkeyPatch, backend_for: Any) -> None:
    monkeypatch.setattr(residency, "backend_for", backend_for)
    monkeypatch.setattr(devices, "backend_for", backend_for)


def check(res: Residency, entry: Entry, fd: int) -> Any:
    """`_check_adopted` of an entry whose record came with the arena fd `fd` (for the placeholder)."""
    rec, placeholder = life(entry).adopted  # type: ignore[misc]
    os.close(placeholder)
    life(entry).adopted = (rec, fd)
    return res._check_adopted(entry)


def gated(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, FakeBackend]:
    """A fake backend whose open waits for the gate, and no fd store: (the gate, the backend)."""
    gate = threading.Event()
    backend = FakeBackend()
    patch_backend(monkeypatch, lambda device: backend)
    monkeypatch.setattr(systemd, "remove_fds", lambda name: None)
    return gate, backend


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

    patch_backend(monkeypatch, no_backend)
    monkeypatch.setattr(systemd, "remove_fds", lambda name: None)

    async def main() -> int:
        res, rec, entry = adopted()
        fd = arena_fd()
        await check(res, entry, fd)
        assert "m" not in res.cache.entries
        return fd

    fd = asyncio.run(main())
    assert not is_open(fd), "the arena fd leaked"


def test_a_check_cancelled_while_its_worker_opens_the_arena_closes_it_once_the_worker_is_done(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Shutdown cancels the check: the fd stays the worker's until it returns, then its arena goes."""
    gate = threading.Event()
    backend = FakeBackend(gate)
    patch_backend(monkeypatch, lambda device: backend)

    async def main() -> int:
        res, rec, entry = adopted()
        fd = arena_fd()
        task = asyncio.ensure_future(check(res, entry, fd))
        await asyncio.to_thread(backend.entered.wait, 5)
        task.cancel()  # Server.shutdown
        with pytest.raises(asyncio.CancelledError):
            await task
        assert is_open(fd), "closed under the worker"
        inode = os.fstat(fd).st_ino
        gate.set()
        assert await released(backend)
        assert backend.seen == [inode]
        return fd

    fd = asyncio.run(main())
    assert not is_open(fd)


async def released(backend: Any, within_s: float = 5.0) -> bool:
    """Whether the backend's arena is released within `within_s`: arenas are closed in the loop's
    executor, and nothing waits for that."""
    for _ in range(int(within_s / 0.02)):
        if getattr(backend, "arena", None) is not None and backend.arena.released:
            return True
        await asyncio.sleep(0.02)
    return False


def test_a_second_evict_during_the_check_drops_the_entry_quietly(monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    gate, backend = gated(monkeypatch)
    caplog.set_level(logging.INFO, logger="wcd")

    async def main() -> None:
        res, rec, entry = adopted(gate)
        task = asyncio.ensure_future(check(res, entry, arena_fd()))
        await asyncio.to_thread(backend.entered.wait, 5)
        await asyncio.sleep(0.1)
        res.evict(entry, "evicted by a test")  # wcdctl evict m: marked evicting (it is loading)
        res.evict(entry, "evicted by a test")  # again (or a second SIGHUP's supersede): dropped now, its arena closed
        gate.set()
        await task
        assert "m" not in res.cache.entries
        assert await released(backend)  # closed off the loop (`offloop.close_later`), not awaited

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

    gate, backend = gated(monkeypatch)

    async def main() -> float:
        res, rec, entry = adopted(gate)
        task = asyncio.ensure_future(check(res, entry, arena_fd()))
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


class FlakyArena(FakeArena):
    """An arena whose check fails `failures` times with `error` first (no memory for a context, say)."""

    failures = 0
    error: Exception = OutOfMemory("cuda:0: out of memory for the staging context")
    checks = 0

    def check_adopted(self) -> None:
        type(self).checks += 1
        if type(self).checks <= self.failures:
            raise self.error


class FlakyBackend(FakeBackend):
    def adopt(self, fd: int, device: str, size: int, label: str) -> FakeArena:
        self.arena = FlakyArena(fd, size)
        return self.arena


@pytest.mark.parametrize(("failures", "error", "kept"), [
    (2, OutOfMemory("cuda:0: out of memory for the staging context"), True),  # then the GPU had room
    (len(adoption.CHECK_RETRY_S) + 1, Internal("cuMemMap: CUDA_ERROR_UNKNOWN"), False),  # it never did
    (1, BadRequest("m: the arena is smaller than the 4096 bytes its record says"), False),  # not the GPU's state
])
def test_a_check_that_fails_for_want_of_memory_is_tried_again_before_the_copy_is_dropped(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, failures: int, error: Exception,
        kept: bool) -> None:
    """Dropping the entry also takes its copy out of systemd's fd store for good: a check that failed
    because the GPU had no memory for a context at that moment is tried again, CHECK_RETRY_S apart."""
    monkeypatch.setattr(FlakyArena, "failures", failures)
    monkeypatch.setattr(FlakyArena, "error", error)
    monkeypatch.setattr(FlakyArena, "checks", 0)
    patch_backend(monkeypatch, lambda device: FlakyBackend())
    monkeypatch.setattr(adoption, "CHECK_RETRY_S", (0.01,) * len(adoption.CHECK_RETRY_S))
    unstored: list[str] = []
    monkeypatch.setattr(systemd, "remove_fds", unstored.append)
    caplog.set_level(logging.WARNING, logger="wcd")

    async def main() -> None:
        res, rec, entry = adopted()
        await check(res, entry, arena_fd())
        if kept:
            assert res.cache.entries["m"].state == "ready" and unstored == []
            assert FlakyArena.checks == failures + 1
        else:
            assert "m" not in res.cache.entries and unstored  # dropped, and out of the fd store
            assert FlakyArena.checks == (1 if isinstance(error, BadRequest) else len(adoption.CHECK_RETRY_S) + 1)

    asyncio.run(main())
    lines = [r.getMessage() for r in caplog.records]
    assert all("Traceback" not in line for line in lines)
    assert sum("checked again" in line for line in lines) == (0 if isinstance(error, BadRequest)
                                                                else min(failures, len(adoption.CHECK_RETRY_S)))


def test_a_broken_cuda_bindings_is_one_line_once_the_daemon_serves(monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Start-up only checks that cuda-bindings is installed; the thread that starts the workers after
    READY imports it, and an install that is there but broken says so then, in one line."""
    def broken(device: str) -> Any:
        raise ImportError("libnvrtc.so.12: cannot open shared object file")

    patch_backend(monkeypatch, broken)
    caplog.set_level(logging.INFO, logger="wcd")
    state = ServerState(Config(), "t", Cache({"cpu": 1 << 30, "GPU-1": 1 << 30}, 30.0), {"cpu": "cpu"}, 0.0)
    Residency(state, Metrics(state), lambda c: None).warm_backends()
    [line] = [r.getMessage() for r in caplog.records]
    assert "GPU arenas are unavailable: cannot import cuda-bindings (ImportError: libnvrtc.so.12" in line


def test_an_old_entrys_end_does_not_take_the_reload_flag_of_a_new_entry_of_its_name(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Entry 1 of "m" is dropped while its task still runs; entry 2 of "m" comes, and a reload
    supersedes it while it loads. When entry 1's task ends (`_drop_loading`), entry 2 must still be
    replaced per the new config when it ends, and still be waited for: both are kept per entry."""
    monkeypatch.setattr(systemd, "remove_fds", lambda name: None)

    async def main() -> None:
        res = make()
        first = res._adopt(Rec("m", WeightCacheKey(model="m")), arena_fd())
        res.evict(first, "evicted by a test")
        res.evict(first, "evicted by a test")  # dropped now; its check (say) still runs
        assert "m" not in res.cache.entries
        second = res._adopt(Rec("m", WeightCacheKey(model="m")), arena_fd())
        res.supersede(second)  # a reload changed "m" while the new entry loads
        await res._drop_loading(first)  # the old task ends
        assert life(second).superseded and res.still_loading(second)
        waiter = asyncio.ensure_future(res.wait_ready(second, 5))
        await asyncio.sleep(0.01)
        assert not waiter.done()  # woken by the new entry's end only
        await res._drop_loading(second)
        assert not life(second).superseded and "m" not in res.cache.entries
        with pytest.raises(NotFound):
            await waiter

    asyncio.run(main())


def test_status_shows_the_records_tensor_count_while_an_adopted_entry_is_checked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Before its check the entry's manifest is an empty stand-in: status shows the record's count
    (unvalidated), then the validated manifest's."""
    gate, backend = gated(monkeypatch)

    async def main() -> None:
        res, rec, entry = adopted(gate)
        assert entry.describe()["tensors"] == 1 and entry.describe()["state"] == "loading"
        task = asyncio.ensure_future(check(res, entry, arena_fd()))
        await asyncio.to_thread(backend.entered.wait, 5)
        assert entry.describe()["tensors"] == 1 and not entry.manifest.names  # still checking
        gate.set()
        await task
        assert res.cache.entries["m"] is entry and entry.state == "ready", entry.notes
        assert entry.recorded_tensors is None and entry.describe()["tensors"] == len(entry.manifest) == 1

    asyncio.run(main())
