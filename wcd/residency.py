"""An entry's life in memory: admit -> fill -> ready -> park -> reclaim, and re-adoption after a restart.

The one place that turns the cache's decisions (`wcd.cache`) into arena I/O: it allocates,
fills, seals, digests and closes arenas (in worker threads, never on the loop), parks ready
arenas in systemd's fd store and re-adopts them at start-up. Must not parse requests or touch
client sockets; its background work runs in tasks the server owns (`spawn`).

Worker threads come from pools per kind of work, so a flood of long jobs never delays a short
one: digests (verify, the digest after a commit) and fills each have their own pool; short jobs
(allocations, seals, headers, closes) use the loop's default executor. Every job that touches
an arena holds it (`Arena.in_use`), so no arena is closed under a worker; an allocation whose
waiter was cancelled is closed when the worker finishes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Coroutine, Iterable
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from wcd import parking, systemd
from wcd.arenas import Arena, ArenaBackend, backend_for, device_memory, is_gpu_device, loaded_backends
from wcd.cache import Entry, Lease, Origin, Retention
from wcd.checkpoint import Checkpoint, Shards, open_files
from wcd.config import Config, ModelConfig, format_size, parse_size
from wcd.errors import BadRequest, Busy, DeviceUnavailable, LoadFailed, NotFound, WcdError
from wcd.header_helpers import HeaderHelpers
from wcd.header_helpers import default_count as default_helpers
from wcd.key import HOST_DEVICE, WeightCacheKey, fingerprint_unparsed, first_fingerprint
from wcd.loader import Cancelled, content_digest, default_workers, digest_arena, fill_arena, verify_arena
from wcd.manifest import Manifest
from wcd.metrics import Metrics
from wcd.state import ServerState
from wcd.workers import Pool

log = logging.getLogger("wcd")

DEFAULT_BUDGET = {"cpu": "50%", "cuda": "90%"}
# A check of a re-adopted arena that fails for want of memory or in the driver, not because the
# arena or its checkpoint differ from the record, is tried again after each of these waits before
# the entry is dropped (and its copy taken out of the fd store): an engine may be freeing memory.
CHECK_RETRY_S = (1.0, 2.0, 4.0, 8.0, 16.0)
FILL_WORKERS = 4  # loads filling at once; each runs `load_workers` reader threads of its own
Spawn = Callable[[Coroutine[Any, Any, Any]], "asyncio.Task[Any]"]
T = TypeVar("T")
U = TypeVar("U")
Digests = dict[str, str]
ADOPTING_NOTE = "re-adopted from systemd's fd store: checking it before serving"
# How long shutdown waits for the driver to let go of arenas and lingering GPU staging: a hung
# driver must not hold it until systemd's stop timeout; what is left goes with the process.
RELEASE_WAIT_S = 5.0


@dataclass(frozen=True, slots=True)
class Verification:
    """What `verify` found."""

    digest: str  # the content digest of what is resident (`loader.content_digest`)
    tensors: int
    mismatched: list[str]  # sorted
    against: str


def _verification(actual: Digests, mismatched: list[str], against: str) -> Verification:
    """(in a worker: for 10^5 tensors this takes a while)"""
    return Verification(content_digest(actual), len(actual), mismatched, against)


def device_budgets(config: Config) -> tuple[dict[str, int], dict[str, str]]:
    """(budget per canonical device, configured name -> canonical id): configured budgets, every
    model's device, and host memory."""
    wanted: dict[str, int | str] = {HOST_DEVICE: DEFAULT_BUDGET["cpu"]}
    for model in config.models:
        wanted.setdefault(model.device, DEFAULT_BUDGET["cuda" if model.device != HOST_DEVICE else "cpu"])
    wanted.update(config.daemon.budget)
    budgets: dict[str, int] = {}
    devices: dict[str, str] = {}
    for device, size in wanted.items():
        canonical, total = device_memory(device)
        devices[device] = canonical
        budgets[canonical] = parse_size(size, total)
    return budgets, devices


class Residency:
    def __init__(self, state: ServerState, metrics: Metrics, spawn: Spawn) -> None:
        self.state = state
        self.cache = state.cache
        self._metrics = metrics
        self._spawn = spawn
        # Per entry (not per name: a name may come back as another entry while an old task still
        # runs), set when it leaves loading/filling:
        self._ready: dict[Entry, asyncio.Event] = {}
        # Published entries: the digest verify compares against, and what it was taken at.
        self._digests: dict[str, tuple[asyncio.Future[Digests], str]] = {}
        self._verifying: dict[Entry, asyncio.Future[Verification]] = {}  # shared by requests
        self._committing: set[int] = set()  # fill leases whose commit is sealing
        self._checkpoints: dict[str, Checkpoint] = {}  # admitted, not yet filling
        self._parked: set[str] = set()  # entries whose fds sit in the fd store
        # Adopted before READY, with their arena fds: `start_checks` opens and checks them after.
        self._unchecked: list[tuple[Entry, parking.ParkedEntry, int]] = []
        self._admitting: dict[str, asyncio.Event] = {}  # configured models being admitted, set when that ends
        self._superseded: set[Entry] = set()  # entries a reload evicted that had to finish first (`supersede`)
        self.hung = False  # `close` gave up waiting for the driver: the process must not wait for it either
        self._digest_pool = Pool(state.config.daemon.digest_workers, "wcd-digest")
        self._fill_pool = Pool(FILL_WORKERS, "wcd-fill")
        self.pools = (self._digest_pool, self._fill_pool)
        helpers = state.config.daemon.header_helpers
        self.helpers = HeaderHelpers(default_helpers() if helpers is None else helpers)
        self._parse_with = self.helpers if self.helpers.count else None  # Checkpoint.open's `helpers`

    # -- devices ----------------------------------------------------------------------------

    def canonical_device(self, device: str, *, from_peer: bool = False) -> str:
        """The canonical id of a managed device. `from_peer`: a GPU on a daemon that manages none is
        refused before any backend is touched, so a peer never makes a host-only daemon import
        cuda-bindings (nor run cuInit) on its loop."""
        if device in self.state.devices:
            return self.state.devices[device]
        if device in self.cache.budgets:
            return device
        if from_peer and is_gpu_device(device) and not any(map(is_gpu_device, self.cache.budgets)):
            raise DeviceUnavailable(f"device {device!r}: this daemon manages no GPU "
                             f"(devices: {', '.join(self.cache.budgets)})")
        canonical = backend_for(device).canonical(device)
        if canonical not in self.cache.budgets:
            raise BadRequest(f"device {device!r} is not managed by this daemon (add a budget for it in the config)")
        return canonical

    def resolve(self, target: str | WeightCacheKey) -> str | WeightCacheKey:
        """A request's target with a configured device name ("cuda:0") replaced by its canonical id."""
        if isinstance(target, WeightCacheKey) and target.device in self.state.devices:
            target = target.model_copy(update={"device": self.state.devices[target.device]})
        return target

    # -- loading ----------------------------------------------------------------------------

    async def admit_configured(self, model: ModelConfig, replacing: Entry | None = None) -> None:
        """Admit a configured model and start filling it in the background; failures are logged.
        `replacing`: the entry of that name, which goes when this one is admitted (`admit_load`)."""
        if self.cache.entries.get(model.name) not in (None, replacing) or model.name in self._admitting:
            return  # adopted from the fd store, still leased after a reload changed it, or on its way
        await self._admit_configured(model, replacing, self._admitting.setdefault(model.name, asyncio.Event()))

    def admit_later(self, model: ModelConfig) -> None:
        """`admit_configured` in the background, counted as under way from now: an acquire of the
        name that comes before the task runs waits for it (`admission`) instead of not finding it."""
        if model.name in self._admitting or model.name in self.cache.entries:
            return
        self._spawn(self._admit_configured(model, None, self._admitting.setdefault(model.name, asyncio.Event())))

    async def _admit_configured(self, model: ModelConfig, replacing: Entry | None, done: asyncio.Event) -> None:
        try:
            entry = await self.admit_load(model.name, model.path, model.device, model.retention, "config",
                                          model.follow_symlinks, replacing)
        except WcdError as e:
            log.error("cannot load %s: %s", model.name, e.message)
            return
        finally:
            self._admitting.pop(model.name, None)
            done.set()
        if next((m for m in self.state.config.models if m.name == model.name), None) != model:
            self.supersede(entry)  # a reload changed or removed it meanwhile: its fill stops, then per that config
        self.start_fill(entry)

    async def admission(self, name: str, timeout: float) -> bool:
        """Wait until a configured model of that name being admitted (its headers read) is in the
        cache or failed; whether one was under way. `Busy` after `timeout` s, as `wait_ready`."""
        done = self._admitting.get(name)
        if done is None:
            return False
        try:
            await asyncio.wait_for(done.wait(), timeout)
        except asyncio.TimeoutError:
            raise Busy(f"entry {name!r} is still being admitted (its headers read) after {timeout:g} s") from None
        return True

    async def admit_load(self, name: str, path: Path, device: str, retention: Retention, origin: Origin,
                         follow_links: bool = False, replacing: Entry | None = None) -> Entry:
        """Open the checkpoint's shards (kept open until the fill ends), read their headers,
        fingerprint them through the same descriptors, and admit an entry (state loading).
        `replacing` (an entry of the same name) is dropped in the same step as this one is admitted,
        so that nothing looking the name up in between finds neither."""
        canonical = self.canonical_device(device)
        self._prepare(canonical)
        started = time.monotonic()
        shards = await _opened(lambda: Shards.open(path, follow_links))
        try:
            # The fingerprint hashes and reads with the GIL released (10 MB of headers at 100,000
            # tensors): beside the parse, which holds it, or waits for the helpers. A header's
            # error goes before a read error of the samples, as when they ran one after the other.
            ckpt, fingerprinted = await _both(lambda: shards.parse(self._parse_with), lambda: first_fingerprint(shards))
        except BaseException:
            shards.close()  # once both have ended: they read through these descriptors
            raise
        ckpt.fingerprinted = fingerprinted
        opened = time.monotonic()
        try:
            # 100,000 tensors take tens of ms to lay out: off the loop, like the reads.
            manifest = await asyncio.to_thread(ckpt.manifest)
            log.info("admitting %s: %d shards, headers read and fingerprinted in %.3f s%s, layout %.3f s", name,
                     len(ckpt.fds), opened - started, f" ({ckpt.helped} by helpers)" if ckpt.helped else "",
                     time.monotonic() - opened)
            key = WeightCacheKey(model=name, path=str(ckpt.path), fingerprint=fingerprinted[0], device=canonical)
            nbytes = backend_for(canonical).arena_size(manifest.size, canonical)
            if replacing is not None:
                self.reclaim(self.cache.load_failed(replacing))
            entry, victims = self.cache.admit(name, key, manifest, nbytes, retention, origin, publisher=os.getuid())
        except BaseException:
            ckpt.close()
            raise
        self.reclaim(victims)
        self._ready[entry] = asyncio.Event()
        self._checkpoints[name] = ckpt
        return entry

    def _backend(self, device: str) -> ArenaBackend:
        """The backend of `device`, told the configured staging linger (which a reload may change)."""
        backend = backend_for(device)
        daemon = self.state.config.daemon
        backend.configure(daemon.staging_linger_s, direct_reads=daemon.cold_reads == "direct")
        return backend

    def sized_at_start(self) -> dict[str, int]:
        """The config fields fixed when the daemon started, and their values in force."""
        return {"digest_workers": self._digest_pool.workers, "header_helpers": self.helpers.count}

    def warm_backends(self) -> None:
        """Import the GPU backend (cuda-bindings: 18-25 ms holding the GIL on the H200 hosts) now,
        blocking, from the thread that starts the workers after READY: the first GPU request does
        not wait for it, and an install that is present but broken says so in one line at start-up
        (before READY the daemon only checks that cuda-bindings is installed)."""
        device = next((d for d in self.cache.budgets if is_gpu_device(d)), None)
        if device is None:
            return
        try:
            self._backend(device)
        except Exception as e:  # noqa: BLE001 - said once here; each GPU request says it again
            why = e.message if isinstance(e, WcdError) else f"cannot import cuda-bindings ({type(e).__name__}: {e})"
            log.error("GPU arenas are unavailable: %s; every GPU request fails until that is fixed", why)

    def _prepare(self, device: str) -> None:
        """Start getting `device` ready (a GPU's context and pinned staging) while the checkpoint's
        headers are read: most of a GPU load's fixed cost, overlapped. Failures show at the fill."""
        backend = self._backend(device)
        workers = self.state.config.daemon.load_workers or default_workers()
        future = asyncio.get_running_loop().run_in_executor(None, backend.prepare, device, workers)
        future.add_done_callback(_quiet)

    def start_fill(self, entry: Entry) -> asyncio.Task[Entry]:
        """Fill an admitted entry in the background; the task ends when it is ready (or failed)."""
        return self._spawn(self._fill(entry))

    async def _fill(self, entry: Entry) -> Entry:
        """Allocate the entry's arena and copy the checkpoint in from worker threads, then make it ready."""
        ckpt = self._checkpoints.pop(entry.name)
        manifest = entry.manifest
        log.info("loading %s: %s in %d tensors from %s to %s", entry.name, format_size(manifest.nbytes),
                 len(manifest), ckpt.path, entry.device)
        started = time.monotonic()
        workers = self.state.config.daemon.load_workers or default_workers()

        def fill(arena: Arena) -> None:
            # The plan walks every tensor (a while for 10^5): in the worker, not on the loop. Cold
            # files are read ahead while the writer is made, O_DIRECT ones too (the writer reads
            # those ops from the page cache): on the H200, with a context made per load, 1.6 GB /
            # 1k loaded in 0.958 s against 0.964 without (medians of four). Small tensors' ops are
            # read buffered even then, as all ops were when it gave buffered loads 1.339 s against
            # 1.467 (1.6 GB / 1k, tenth round); not measured for small tensors since.
            fill_arena(arena, ckpt, manifest, _EntryProgress(entry),
                       lambda: entry.state == "evicting", workers, entry.key.fingerprint, reads_ahead=True)
            arena.seal()

        try:
            entry.arena = await self._create(backend_for(entry.device), entry.device, entry.nbytes, entry.name)
            allocated = time.monotonic()
            await self._using(self._fill_pool, entry.arena, fill)
        except BaseException as e:
            ckpt.close()
            if not isinstance(e, Exception):  # cancelled (shutdown)
                self.reclaim(self.cache.load_failed(entry))
                raise
            replaced = await self._drop_loading(entry)
            if isinstance(e, Cancelled):
                if replaced:  # no failure: what the reload asked for
                    log.info("loading %s stopped: a reload changed it; it loads again per the new config",
                             entry.name)
                    return entry
                raise NotFound(f"loading {entry.name} was cancelled: the entry was evicted") from None
            if isinstance(e, WcdError):
                raise
            raise LoadFailed(f"loading {entry.name} failed: {e}") from e
        ckpt.close()
        _drop_later(ckpt)
        seconds = time.monotonic() - started
        self._metrics.loaded(entry.device, manifest.nbytes, seconds)
        log.info("loaded %s in %.2f s (%.2f GB/s; allocating %.3f s, copying %.3f s)", entry.name, seconds,
                 manifest.nbytes / max(seconds, 1e-9) / 1e9, allocated - started, seconds - (allocated - started))
        if entry.state == "evicting":  # evicted as its last copies ran
            await self._drop_loading(entry)
            return entry
        self.cache.loaded(entry)
        self._set_ready(entry)
        return entry

    async def wait_ready(self, entry: Entry, timeout: float) -> Entry:
        """Wait until `entry` leaves loading/filling; `Busy` after `timeout`, `NotFound` if it went away."""
        event = self._ready.get(entry)
        if event is not None:
            try:
                await asyncio.wait_for(event.wait(), timeout)
            except asyncio.TimeoutError:
                raise Busy(f"entry {entry.name!r} is still {entry.state} after {timeout:g} s") from None
        if self.cache.entries.get(entry.name) is not entry:
            raise NotFound(f"entry {entry.name!r} went away while loading (evicted or failed; see the daemon log)")
        return entry

    def still_loading(self, entry: Entry) -> bool:
        """Whether `entry`'s fill, or its check after a restart, has not ended yet (it may be
        evicting meanwhile: `supersede`)."""
        return entry in self._ready and self.cache.entries.get(entry.name) is entry

    def _set_ready(self, entry: Entry) -> None:
        event = self._ready.pop(entry, None)
        if event is not None:
            event.set()
        self._park(entry)

    # -- publishing -------------------------------------------------------------------------

    async def reserve(self, name: str, key: WeightCacheKey, manifest: Manifest, retention: Retention,
                      owner: Any, pid: int, uid: int) -> Lease:
        """Admit a published entry (carrying `uid`) and allocate its empty arena: the fill lease,
        whose TTL starts when the caller hands it out (`Cache.handed_out`)."""
        backend = backend_for(key.device)
        entry, lease, victims = self.cache.reserve(
            name, key, manifest, backend.arena_size(manifest.size, key.device), retention, owner, pid, uid)
        self.reclaim(victims)
        self._ready[entry] = asyncio.Event()
        try:
            arena = await self._create(backend, key.device, entry.nbytes, name)
        except BaseException:
            self.reclaim(self.cache.load_failed(entry))
            raise
        if self.cache.entries.get(name) is not entry:
            _close_later(arena)
            raise NotFound(f"{name} went away while its arena was being allocated; nothing was reserved")
        entry.arena = arena
        return lease

    async def commit(self, owner: Any, lease_id: int) -> Entry:
        """Seal a filled arena and make its entry ready; `NotFound` if it was evicted while filling."""
        lease = self.cache.leases.get(lease_id)
        if lease is None or lease.owner is not owner or lease.kind != "fill":
            self.cache.commit(owner, lease_id)  # raises the precise error
        assert lease is not None
        if lease_id in self._committing:
            raise BadRequest(f"lease {lease_id} is already being committed", {"lease": lease_id})
        if lease.entry.state != "evicting":
            # Sealing scans the arena's pages (~25 ms per GB): off the loop. Busy if the publisher
            # still maps it writable; the lease stays, so it can drop its views and commit again.
            self._committing.add(lease_id)
            try:
                await self._using(None, lease.entry.arena, lambda arena: arena.seal())
            except BadRequest:  # the arena is not what the daemon handed out: it is never published
                if self.cache.leases.get(lease_id) is lease:
                    self.reclaim(self.cache.abort(owner, lease_id))
                raise
            finally:
                self._committing.discard(lease_id)
        entry, dropped = self.cache.commit(owner, lease_id)
        if dropped:
            self.reclaim(dropped)
            raise NotFound(f"{entry.name} was evicted while it was being filled; nothing was published")
        self._set_ready(entry)
        self._keep_digest(entry, "digest at commit")
        return entry

    def _keep_digest(self, entry: Entry, source: str) -> None:
        """Digest a published entry in the background: what verify compares it against later."""
        future = asyncio.ensure_future(self._digest_arena(entry))
        future.add_done_callback(_quiet)  # an eviction stops it: nothing to report then
        self._digests[entry.name] = (future, source)

    # -- verifying --------------------------------------------------------------------------

    async def verify(self, entry: Entry) -> Verification:
        """The content digest of what is resident and the tensors that differ: from the digest taken
        at commit (or re-adoption) for published entries, from the checkpoint on disk for the
        others. Requests that arrive while one runs share its result: the resident bytes are sealed."""
        entry = await self.wait_ready(entry, 24 * 3600)
        running = self._verifying.get(entry)
        if running is None:
            running = self._verifying[entry] = asyncio.ensure_future(self._verify(entry))

            def done(future: asyncio.Future[Any]) -> None:
                del self._verifying[entry]
                _quiet(future)

            running.add_done_callback(done)
        return await asyncio.shield(running)

    async def _verify(self, entry: Entry) -> Verification:
        # The daemon's own hold on the arena while hashing: no heartbeats, so no expiry, and its
        # own owner, so it ends here whatever happens to the connections waiting for it.
        holder = object()
        lease = self.cache.acquire(entry, holder, os.getpid(), os.getuid(), ttl_s=math.inf)
        try:
            if entry.origin == "publish":
                actual = await self._digest_arena(entry)
                future, source = self._digests[entry.name]
                expected = await asyncio.shield(future)

                def compare() -> Verification:
                    differ = sorted(n for n in actual.keys() | expected.keys() if actual.get(n) != expected.get(n))
                    return _verification(actual, differ, source)

                return await asyncio.to_thread(compare)
            if not Path(entry.key.path).exists():
                raise NotFound(f"{entry.key.path} is gone: nothing to verify {entry.name!r} against")
            ckpt = await _opened(lambda: Checkpoint.open(entry.key.path, self._follow_links(entry.name),
                                                         helpers=self._parse_with))
            try:
                # One pass: each worker reads a range of the arena and the same tensors' bytes from
                # the files, compares them and hashes the arena's side only.
                manifest, against = entry.manifest, str(ckpt.path)
                return await self._using(self._digest_pool, entry.arena,
                                         lambda arena: _verification(*verify_arena(arena, manifest, ckpt), against))
            finally:
                ckpt.close()
        finally:
            self.reclaim(self.cache.release(holder, lease.id))

    # -- worker threads ---------------------------------------------------------------------

    async def _using(self, pool: Executor | None, arena: Arena, job: Callable[[Arena], T]) -> T:
        """Run `job(arena)` in `pool` (None: the loop's default executor for short work), holding the arena."""
        def held() -> T:
            with arena.in_use():
                return job(arena)

        return await asyncio.get_running_loop().run_in_executor(pool, held)

    async def _digest_arena(self, entry: Entry) -> Digests:
        manifest = entry.manifest
        return await self._using(self._digest_pool, entry.arena, lambda arena: digest_arena(arena, manifest))

    async def _create(self, backend: ArenaBackend, device: str, size: int, label: str) -> Arena:
        """Allocate an arena in a worker (posix_fallocate of GBs takes seconds). If the waiter is
        cancelled (its client disconnected, shutdown), the arena the worker still produces is closed."""
        future = asyncio.get_running_loop().run_in_executor(None, backend.create, device, size, label)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            future.add_done_callback(lambda f: None if f.cancelled() or f.exception() else _close_later(f.result()))
            raise

    # -- reclaiming -------------------------------------------------------------------------

    def reclaim(self, entries: Iterable[Entry]) -> None:
        """Entries the cache dropped: close their arenas (memory returns once clients unmap)."""
        for entry in entries:
            if entry in self._superseded:  # a reload changed its model while it was leased: load that now
                self._superseded.discard(entry)
                model = next((m for m in self.state.config.models if m.name == entry.name), None)
                if model is not None:
                    self.admit_later(model)
            if entry.name in self._parked:
                self._parked.discard(entry.name)
                for name in parking.fd_names(entry.key, entry.publisher):
                    _unstore(name)
            if entry.arena is not None:
                _close_later(entry.arena)
                entry.arena = None
            self._digests.pop(entry.name, None)
            ckpt = self._checkpoints.pop(entry.name, None)
            if ckpt is not None:
                ckpt.close()
            event = self._ready.pop(entry, None)
            if event is not None:
                event.set()
            log.info("reclaimed %s (%s on %s)", entry.name, format_size(entry.nbytes), entry.device)

    def evict(self, entry: Entry) -> list[Entry]:
        """Evict now, or once its leases end; returns what was dropped now."""
        dropped = self.cache.evict(entry)
        self.reclaim(dropped)
        return dropped

    def supersede(self, entry: Entry) -> None:
        """A reload removed or changed `entry`'s configured model: evict it, now or once its leases
        end. One still loading (a fill, or the check of an entry re-adopted after a restart) or
        still leased keeps its name until that ends, so nothing loads the model beside it; then the
        config of that time has its model admitted as the entry goes (`_drop_loading`, `reclaim`),
        with no other reload."""
        if not self.evict(entry):
            self._superseded.add(entry)

    def cancel_loads(self) -> None:
        """Shutdown: stop every load at its next chunk, and load nothing in place of what goes."""
        self._superseded.clear()
        self.cache.cancel_loads()

    async def expire_leases(self) -> None:
        """Forever: end leases that missed their heartbeats and reclaim what they held."""
        tick = min(1.0, self.state.config.daemon.lease_ttl_s / 10)
        while True:
            await asyncio.sleep(tick)
            expired, dropped = self.cache.expire()
            for lease in expired:
                log.info("lease %d on %s (pid %d) expired: no heartbeat", lease.id, lease.entry.name, lease.pid)
            self.reclaim(dropped)

    # -- systemd's fd store: park and re-adopt ----------------------------------------------

    def _park(self, entry: Entry) -> None:
        """Put a ready entry's arena fd and its record into systemd's fd store (if there is one)."""
        if not systemd.store_enabled() or entry.name in self._parked or entry.arena is None:
            return
        arena_name, record_name = parking.fd_names(entry.key, entry.publisher)
        try:
            record = parking.record_memfd(entry)
            try:
                systemd.store_fds([entry.arena.fd()], arena_name)
                systemd.store_fds([record], record_name)
            finally:
                os.close(record)
        except (systemd.SystemdError, OSError, ValueError) as e:
            log.warning("cannot park %s in systemd's fd store (%s): it will be reloaded after a restart",
                        entry.name, e)
            return
        self._parked.add(entry.name)

    def adopt_parked(self, fds: list[tuple[int, str]]) -> None:
        """Re-adopt arenas systemd kept for us; drop (and unstore) anything unknown or corrupt.

        Before READY only what takes microseconds per entry whatever its size and needs nothing
        imported: the record less its manifest's layout. Each entry is then `loading`, without an
        arena, charged to its budget under its name, so an engine that connects at once waits for it
        and the configured model is not loaded again from disk; `start_checks` starts the rest
        (opening the arena fd: a CUDA one needs cuda-bindings, an 18-25 ms import), once READY is out."""
        groups: dict[str, dict[str, int]] = {}
        for fd, name in fds:
            stem, dot, suffix = name.rpartition(".")
            if dot and "." + suffix in (parking.ARENA_SUFFIX, parking.RECORD_SUFFIX):
                groups.setdefault(stem, {})["." + suffix] = fd
            else:
                log.warning("fd store: dropping unknown fd %r", name)
                os.close(fd)
                _unstore(name)
        for stem, parts in groups.items():
            arena_fd = parts.pop(parking.ARENA_SUFFIX, None)
            record_fd = parts.pop(parking.RECORD_SUFFIX, None)
            try:
                if arena_fd is None or record_fd is None:
                    raise BadRequest("its arena or record is missing")
                rec = parking.parse_record(record_fd)
                self._unchecked.append((self._adopt(rec), rec, arena_fd))
                arena_fd = None  # its check owns it now
            except (WcdError, OSError) as e:
                log.warning("fd store: dropping %s: %s", stem, getattr(e, "message", e))
                for suffix in (parking.ARENA_SUFFIX, parking.RECORD_SUFFIX):
                    _unstore(stem + suffix)
            finally:
                for leftover in (arena_fd, record_fd):
                    if leftover is not None:
                        os.close(leftover)

    def _adopt(self, rec: parking.ParkedEntry) -> Entry:
        """Admit a parked entry (state `loading`, its arena opened by `_check_adopted`)."""
        device = rec.key.device
        if device not in self.cache.budgets:
            raise BadRequest(f"device {device} is no longer configured")
        # An empty manifest stands in until `_check_adopted` validates the record's; status shows
        # the record's counts meanwhile, unvalidated (its dtype column has a byte per tensor).
        entry, victims = self.cache.admit(rec.name, rec.key, Manifest.build(()), rec.arena_size, rec.retention,
                                          rec.origin, rec.publisher if rec.origin == "publish" else os.getuid(),
                                          adopted=True)
        self.reclaim(victims)
        entry.notes = [ADOPTING_NOTE]
        codes = rec.manifest_wire.get("dtypes")
        entry.recorded_tensors = len(codes) if isinstance(codes, bytes) else None
        self._ready[entry] = asyncio.Event()
        self._parked.add(entry.name)  # systemd still holds the fds: never store them twice
        return entry

    def start_checks(self) -> None:
        """Start checking the entries `adopt_parked` admitted, in the background. Called after READY:
        started before, their worker threads' Python would compete with start-up's for the GIL."""
        for entry, rec, fd in self._unchecked:
            self._spawn(self._check_adopted(entry, rec, fd))
        self._unchecked = []

    async def _check_adopted(self, entry: Entry, rec: parking.ParkedEntry, fd: int) -> None:
        """After READY: open the arena fd (host: its seals and size; CUDA: import, no context),
        validate the manifest's layout, re-fingerprint the checkpoint (a changed one is never
        served), and let the backend finish checking the arena; then the entry is ready. These
        grow with the entry (tensors, header bytes, a CUDA context), need the backend's imports,
        and the fingerprint reads the checkpoint's filesystem, so none of them delays READY. A
        failure drops the entry and its fds with one line; a configured model is then loaded from
        disk, and acquires waiting for the entry wait for that load instead."""
        def gone() -> bool:  # dropped meanwhile (evicted twice, say): `reclaim` closed what it held
            return self.cache.entries.get(entry.name) is not entry

        try:
            arena = await self._open_adopted(entry, rec, fd)
            if gone():
                _close_later(arena)
                return
            entry.arena = arena
            manifest = await asyncio.to_thread(rec.manifest)
            notes = await asyncio.to_thread(self._refingerprint, rec) if rec.origin != "publish" else []
            if gone() or not await self._check_arena(entry, arena, gone):
                return
        except Exception as e:  # noqa: BLE001 - whatever went wrong, the entry must not stay unchecked
            if gone():
                return
            log.warning("fd store: dropping %s: %s", entry.name,
                        e.message if isinstance(e, WcdError) else f"{type(e).__name__}: {e}")
            await self._drop_loading(entry, failed_check=True)
            return
        if gone():
            return
        entry.manifest, entry.notes, entry.done_bytes = manifest, notes, manifest.nbytes
        entry.recorded_tensors = None
        if entry.state == "evicting":  # evicted while it was checked
            await self._drop_loading(entry)
            return
        self.cache.loaded(entry)
        if entry.origin == "publish":
            self._keep_digest(entry, "digest at re-adoption after a restart")
        self._set_ready(entry)
        log.info("adopted %s from systemd's fd store (%s on %s, no disk read)%s", entry.name,
                 format_size(entry.nbytes), entry.device, f"; {entry.notes[0]}" if entry.notes else "")

    async def _check_arena(self, entry: Entry, arena: Arena, gone: Callable[[], bool]) -> bool:
        """The backend's check of a re-adopted arena (`Arena.check_adopted`), tried again after each
        CHECK_RETRY_S wait while it fails with a `WcdError` other than `BadRequest` (which says the
        arena is not what its record says): no GPU memory for a context, or a driver error, is the
        GPU's state of the moment. False if the entry was dropped meanwhile; an entry evicted
        meanwhile is not checked again (its caller drops it)."""
        for wait_s in (*CHECK_RETRY_S, None):
            try:
                await self._using(None, arena, lambda arena: arena.check_adopted())
                return True
            except BadRequest:
                raise
            except WcdError as e:
                if wait_s is None or gone():
                    raise
                log.warning("fd store: cannot check %s yet (%s): it stays kept, and is checked again in %g s",
                            entry.name, e.message, wait_s)
                entry.notes = [f"{ADOPTING_NOTE}; checked again in {wait_s:g} s ({e.message})"]
            await asyncio.sleep(wait_s)
            if gone():
                return False
            if entry.state == "evicting":
                return True
        return True  # not reached: the last attempt returns or raises

    async def _open_adopted(self, entry: Entry, rec: parking.ParkedEntry, fd: int) -> Arena:
        """The arena of a re-adopted entry, opened by its backend in a worker; `fd` is the arena's
        from then on, and closed here if that fails. Cancelled meanwhile (shutdown), the worker's
        arena is closed once it is done, or the fd if the open failed: never under the worker."""
        def open_it() -> Arena:
            try:
                return self._backend(entry.device).adopt(fd, entry.device, rec.arena_size, rec.name)
            except BaseException:
                os.close(fd)
                raise

        future = asyncio.get_running_loop().run_in_executor(None, open_it)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            future.add_done_callback(lambda f: None if f.cancelled() or f.exception() else _close_later(f.result()))
            raise

    async def _drop_loading(self, entry: Entry, failed_check: bool = False) -> bool:
        """Drop an entry whose load, or whose check after re-adoption, ended without making it
        ready. Its configured model is loaded from disk per the config now in force, admitted as
        the entry goes, so acquires waiting for the entry wake to find the new one
        (`wcd.ops.acquire`): if a reload changed the model meanwhile (`supersede`), or if
        `failed_check` (a re-adopted entry of a configured model, not evicted meanwhile).
        Returns whether the model was loaded again."""
        superseded = entry in self._superseded
        self._superseded.discard(entry)
        model = next((m for m in self.state.config.models if m.name == entry.name), None)
        try:
            if model is not None and (superseded or (failed_check and entry.origin == "config"
                                                     and entry.state != "evicting")):
                await self.admit_configured(model, replacing=entry)
        finally:
            self.reclaim(self.cache.load_failed(entry))  # if it was not replaced
        return self.cache.entries.get(entry.name) not in (None, entry)

    def _refingerprint(self, rec: parking.ParkedEntry) -> list[str]:
        """The notes of a checkpoint's parked entry; `BadRequest` if the checkpoint changed since it was
        loaded. A checkpoint that is gone does not stop the kept copy being served (it is noted)."""
        if not Path(rec.key.path).exists():
            return [f"checkpoint {rec.key.path} is missing: serving the copy kept across the restart"]
        files = open_files(Path(rec.key.path).resolve(), self._follow_links(rec.name))
        try:
            if fingerprint_unparsed(files) != rec.key.fingerprint:
                raise BadRequest(f"stale: {rec.key.path} changed since it was loaded")
        finally:
            for _, fd in files:
                os.close(fd)
        return []

    def _follow_links(self, name: str) -> bool:
        return any(m.follow_symlinks for m in self.state.config.models if m.name == name)

    # -- shutdown ---------------------------------------------------------------------------

    async def close(self) -> int:
        """Close our descriptors without evicting: parked arenas stay in systemd's fd store for
        the next start; the others' memory returns once clients unmap. Returns how many stay parked.
        The closes and the release of lingering GPU contexts and staging call the driver: they run
        in a thread of their own, waited for at most RELEASE_WAIT_S, then one line says what is left."""
        for _, _, fd in self._unchecked:  # adopted, never checked (start-up failed before READY)
            os.close(fd)
        self._unchecked = []
        for pool in self.pools:
            pool.shutdown(wait=False, cancel_futures=True)
        arenas = [(e.name, e.arena) for e in self.cache.entries.values() if e.arena is not None]
        backends = loaded_backends()
        arenas_left, staging_left = len(arenas), [what for b in backends for what in b.lingering()]
        loop, released = asyncio.get_running_loop(), asyncio.Event()

        def release() -> None:
            nonlocal arenas_left, staging_left
            try:
                try:
                    self.helpers.close()  # kills and reaps them: not on the loop
                except Exception as e:  # noqa: BLE001 - shutting down: say it and go on
                    log.warning("stopping the header helpers: %s", e)
                for name, arena in arenas:
                    try:
                        arena.close()  # deferred while a worker holds it; its next read stops it
                    except Exception as e:  # noqa: BLE001 - shutting down: say it and go on
                        log.warning("closing the arena of %s: %s", name, getattr(e, "message", e))
                    arenas_left -= 1
                for backend in backends:
                    try:
                        backend.release()  # lingering GPU contexts and staging; a fill still running keeps its own
                    except Exception as e:  # noqa: BLE001 - shutting down: say it and go on
                        log.warning("releasing load staging: %s", getattr(e, "message", e))
                staging_left = []
            finally:
                with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
                    loop.call_soon_threadsafe(released.set)

        # A daemon thread, not an executor's: the interpreter joins those at exit, hung or not.
        threading.Thread(target=release, name="wcd-release", daemon=True).start()
        try:
            await asyncio.wait_for(released.wait(), RELEASE_WAIT_S)
        except asyncio.TimeoutError:
            n = arenas_left
            what = ([f"{n} arena{'s' if n != 1 else ''}"] if n else []) + staging_left or ["the GPU load staging"]
            log.warning("shutdown: the driver has not let go of %s after %g s (a hung GPU driver?); stopping "
                        "without waiting: it goes when this process exits", " and ".join(what), RELEASE_WAIT_S)
            self.hung = True
        return sum(1 for name in self._parked if name in self.cache.entries)


class _EntryProgress:
    """Load progress written by loader threads, read by the loop (status)."""

    def __init__(self, entry: Entry) -> None:
        self.entry = entry

    def add(self, n: int) -> None:
        self.entry.done_bytes += n  # a racy += only undercounts progress transiently; fine for display


def _off_loop(call: Callable[[], object]) -> None:
    """Run `call` in the default executor, not waited for; inline if the loop is shutting down."""
    try:
        asyncio.get_running_loop().run_in_executor(None, call)
    except RuntimeError:  # the loop or its executor is shutting down
        call()


def _close_later(arena: Arena) -> None:
    """Close an arena off the loop: freeing the last reference takes ~0.3 s per GB."""
    _off_loop(arena.close)


def _drop_later(ckpt: Checkpoint) -> None:
    """Free a filled checkpoint's headers in a thread, beside the reply: their columns are ~300,000
    ints at 100,000 tensors (2.3 ms on the VM) that the loop would free before answering."""
    held = [ckpt.headers]
    ckpt.headers = ()
    _off_loop(held.clear)  # the last reference goes in the thread


def _quiet(future: asyncio.Future[Any]) -> None:
    """Retrieve a background future's failure so it is not logged as never retrieved."""
    if not future.cancelled():
        future.exception()


class _Closable(Protocol):
    def close(self) -> None: ...


C = TypeVar("C", bound=_Closable)


async def _opened(call: Callable[[], C]) -> C:
    """`call()` in a thread: what it opens; cancelled meanwhile, that is closed once it is open."""
    future = asyncio.get_running_loop().run_in_executor(None, call)  # a future, not a task: never cancelled
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        future.add_done_callback(_close_result)
        raise


def _close_result(future: asyncio.Future[Any]) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result().close()


async def _both(first: Callable[[], T], second: Callable[[], U]) -> tuple[T, U]:
    """Run two calls in threads at once and return both results, or raise the first's error, then
    the second's, only once both have ended (they read through descriptors their caller closes on
    an error). Cancelled, even again and again, it still waits for both before the CancelledError
    goes on."""
    # Futures, not tasks: the loop's end cancels every task left, and these must stay until their
    # threads end.
    loop = asyncio.get_running_loop()
    calls = loop.run_in_executor(None, first), loop.run_in_executor(None, second)
    try:
        await asyncio.shield(asyncio.wait(calls))
    except asyncio.CancelledError:
        while not all(call.done() for call in calls):
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait(calls)
        for call in calls:
            if call.done() and not call.cancelled():
                call.exception()  # retrieved: the cancellation is what goes on
        raise
    for error in [call.exception() for call in calls]:  # both retrieved
        if error is not None:
            raise error
    return calls[0].result(), calls[1].result()


def _unstore(name: str) -> None:
    """Remove an fd from systemd's fd store; a failure is logged, never fatal."""
    try:
        systemd.remove_fds(name)
    except (systemd.SystemdError, ValueError) as e:
        log.warning("systemd: %s", e)
