"""An entry's life in memory: admit -> fill -> ready -> park -> reclaim, and re-adoption after a restart.

With its mixins, the one place that turns the cache's decisions (`wcd.cache`) into arena I/O:
it allocates, fills, seals and closes arenas (in worker threads, never on the loop), and keeps
each entry's life record (`wcd.life`), so that what an entry owns is closed in one step when the
cache drops it (`reclaim`). Parking and re-adoption are `wcd.adoption`'s, reserve and commit of
published entries `wcd.publishes`'s (`Adopting` and `Publishes` are the mixins), shutdown's
closes `wcd.shutdown`'s, verify `wcd.verifying`'s, device resolution `wcd.devices`'s, the
worker-thread helpers `wcd.offloop`'s. Must not parse requests or touch client sockets; its
background work runs in tasks the server owns (`spawn`).

Worker threads come from pools per kind of work, so a flood of long jobs never delays a short
one: digests (verify, the digest after a commit) and fills each have their own pool; short jobs
(allocations, seals, headers, closes) use the loop's default executor. Every job that touches
an arena holds it (`Arena.in_use`), so no arena is closed under a worker; an allocation whose
waiter was cancelled is closed when the worker finishes.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections.abc import Callable, Coroutine, Iterable
from pathlib import Path
from typing import Any

from wcd import adoption, shutdown
from wcd.adoption import Adopting
from wcd.arenas import Arena, ArenaBackend, backend_for, released_held
from wcd.cache import Entry, Origin
from wcd.checkpoint import Checkpoint, Shards
from wcd.config import ModelConfig
from wcd.devices import Devices
from wcd.errors import Busy, LoadFailed, NotFound, WcdError
from wcd.header_helpers import HeaderHelpers
from wcd.header_helpers import default_count as default_helpers
from wcd.key import WeightCacheKey, first_fingerprint
from wcd.leasebook import describe_expired
from wcd.life import Life, life
from wcd.loader import Cancelled, content_digest, default_workers, fill_arena
from wcd.manifest import Manifest
from wcd.metrics import Metrics
from wcd.offloop import both, free_later, produced, using
from wcd.publishes import Publishes
from wcd.state import ServerState
from wcd.units import describe_progress, format_duration, format_size
from wcd.verifying import Verification, Verifier
from wcd.wire import Retention
from wcd.workers import Pool

log = logging.getLogger("wcd")

LOAD_LOG_EVERY_S = 10.0  # a load that takes longer says how far it got this often
FILL_WORKERS = 4  # loads filling at once; each runs `load_workers` reader threads of its own
Spawn = Callable[[Coroutine[Any, Any, Any]], "asyncio.Task[Any]"]
EXPIRY_BATCH = 1024  # leases the expiry task ends before it lets the loop answer others


class Residency(Adopting, Publishes):
    def __init__(self, state: ServerState, metrics: Metrics, spawn: Spawn) -> None:
        self.state = state
        self.cache = state.cache
        self.cache.outside = released_held  # what reclaimed arenas still take: admission counts it
        self._metrics = metrics
        self._spawn = spawn
        self.devices = Devices(state)
        self.canonical_device = self.devices.canonical
        self.resolve = self.devices.resolve
        self.warm_backends = self.devices.warm
        # Configured models being admitted (before their entry exists), set when that ends.
        self._admitting: dict[str, asyncio.Event] = {}
        self.hung = False  # `close` gave up waiting for the driver: the process must not wait for it either
        self._digest_pool = Pool(state.config.daemon.digest_workers, "wcd-digest")
        self._fill_pool = Pool(FILL_WORKERS, "wcd-fill")
        self.pools = (self._digest_pool, self._fill_pool)
        helpers = state.config.daemon.header_helpers
        self.helpers = HeaderHelpers(default_helpers() if helpers is None else helpers)
        self._parse_with = self.helpers if self.helpers.count else None  # Checkpoint.open's `helpers`
        self._verifier = Verifier(self._digest_pool, self._parse_with)
        self.fleet: Any = None  # `wcd.fleet.service.Fleet` when the config has [fleet]: peers before the disk

    def sized_at_start(self) -> dict[str, int]:
        """The config fields fixed when the daemon started, and their values in force."""
        return {"digest_workers": self._digest_pool.workers, "header_helpers": self.helpers.count}

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
            self.failed(model.name, e.message, "config", model.device, model.path)
            return
        finally:
            self._admitting.pop(model.name, None)
            done.set()
        if self._model(model.name) != model:
            self.supersede(entry)  # a reload changed or removed it meanwhile: its fill stops, then per that config
        self.start_fill(entry)

    def failed(self, name: str, reason: str, origin: Origin, device: str, path: object, logged: bool = False) -> None:
        """A load of `name` ended without an entry: said in the log (unless `logged` elsewhere) and
        kept in the cache as a failure, which status, list, the status line and metrics show."""
        if not logged:
            log.error("cannot load %s: %s", name, reason)
        self.cache.fail(name, reason, origin, device, str(path))

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
        self.devices.prepare(canonical)
        started = time.monotonic()
        if self.fleet is not None and not path.exists():  # a peer may hold it: its key and layout, then its bytes
            fields, manifest, peer = await self.fleet.describe_remote(name, str(path))
            key = WeightCacheKey.model_validate({**fields, "device": canonical})
            log.info("admitting %s: not on this host; key and layout from peer %s", name, peer)
            return self._admitted(name, key, manifest, retention, origin, replacing, None)
        shards = await produced(lambda: Shards.open(path, follow_links))
        try:
            # The fingerprint hashes and reads with the GIL released (10 MB of headers at 100,000
            # tensors): beside the parse, which holds it, or waits for the helpers. A header's
            # error goes before a read error of the samples, as when they ran one after the other.
            ckpt, fingerprinted = await both(lambda: shards.parse(self._parse_with), lambda: first_fingerprint(shards))
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
            return self._admitted(name, key, manifest, retention, origin, replacing, ckpt)
        except BaseException:
            ckpt.close()
            raise

    def _admitted(self, name: str, key: WeightCacheKey, manifest: Manifest, retention: Retention, origin: Origin,
                  replacing: Entry | None, ckpt: Checkpoint | None) -> Entry:
        nbytes = backend_for(key.device).arena_size(manifest.size, key.device)
        if replacing is not None:
            self.reclaim(self.cache.load_failed(replacing), "replaced by its model as configured now")
        entry, victims = self.cache.admit(name, key, manifest, nbytes, retention, origin, publisher=os.getuid())
        self.reclaim(victims, f"least recently used, to make room for {name} ({format_size(nbytes)})")
        entry.life = Life(checkpoint=ckpt)
        return entry

    def start_fill(self, entry: Entry) -> asyncio.Task[Entry]:
        """Fill an admitted entry in the background; the task ends when it is ready (or failed)."""
        return self._spawn(self._fill(entry))

    async def _fill(self, entry: Entry) -> Entry:
        """Allocate the entry's arena and copy the checkpoint in from worker threads, then make it ready."""
        ckpt = life(entry).start_fill()
        manifest = entry.manifest
        log.info("loading %s: %s in %d tensors from %s to %s", entry.name, format_size(manifest.nbytes),
                 len(manifest), entry.key.path, entry.device)
        started = time.monotonic()
        workers = self.state.config.daemon.load_workers or default_workers()
        entry.load_phase = "allocating"
        reporter = asyncio.ensure_future(self._report_progress(entry, started))

        def fill(arena: Arena) -> None:
            # The plan walks every tensor (a while for 10^5): in the worker, not on the loop. Cold
            # files are read ahead while the writer is made.
            assert ckpt is not None
            fill_arena(arena, ckpt, manifest, _EntryProgress(entry),
                       lambda: entry.state == "evicting", workers, entry.key.fingerprint, reads_ahead=True)
            arena.seal()

        def create() -> Any:
            return self._create(backend_for(entry.device), entry.device, entry.nbytes, entry.name)

        try:
            entry.arena = await create()
            allocated = entry.reading_since = time.monotonic()
            entry.load_phase = "reading"
            # With a fleet, a peer that holds the same key fills it (checked, sealed) before the disk.
            if self.fleet is None or not await self.fleet.fill(entry, create):
                if ckpt is None:
                    raise LoadFailed(f"no peer could fill {entry.name} and its checkpoint is not on this host")
                entry.source = "disk"
                await using(self._fill_pool, entry.arena, fill)
        except BaseException as e:
            reporter.cancel()
            entry.load_phase = ""
            if ckpt is not None:
                ckpt.close()
            if not isinstance(e, Exception):  # cancelled (shutdown)
                self.reclaim(self.cache.load_failed(entry), "its load was cancelled (shutdown)")
                raise
            replaced = await self._drop_loading(entry)
            if isinstance(e, Cancelled):
                if replaced:  # no failure: what the reload asked for
                    log.info("loading %s stopped: a reload changed it; it loads again per the new config",
                             entry.name)
                    return entry
                raise NotFound(f"loading {entry.name} was cancelled: the entry was evicted") from None
            error = e if isinstance(e, WcdError) else LoadFailed(f"loading {entry.name} failed: {e}")
            if not replaced:  # logged as the task's failure (`wcd.server`), or answered to `wcdctl load --wait`
                self.failed(entry.name, error.message, entry.origin, entry.device, entry.key.path, logged=True)
            if error is e:
                raise
            raise error from e
        reporter.cancel()
        entry.load_phase = ""
        if ckpt is not None:
            ckpt.close()
            _free_headers(ckpt)
        seconds = time.monotonic() - started
        if entry.source == "disk":
            entry.fill_rate = manifest.nbytes / max(seconds, 1e-9)
        self._metrics.loaded(entry.device, manifest.nbytes, seconds)
        log.info("loaded %s in %.2f s (%.2f GB/s; allocating %.3f s, copying %.3f s)", entry.name, seconds,
                 manifest.nbytes / max(seconds, 1e-9) / 1e9, allocated - started, seconds - (allocated - started))
        if entry.state == "evicting":  # evicted as its last copies ran
            await self._drop_loading(entry)
            return entry
        self.cache.loaded(entry)
        self._set_ready(entry)
        return entry

    async def _report_progress(self, entry: Entry, started: float) -> None:
        """A log line every LOAD_LOG_EVERY_S while `entry` loads: phase, bytes, rate, time left."""
        while True:
            await asyncio.sleep(LOAD_LOG_EVERY_S)
            log.info("loading %s: %s (%s elapsed)", entry.name, describe_progress(entry.describe()["progress"]),
                     format_duration(time.monotonic() - started))

    async def wait_ready(self, entry: Entry, timeout: float) -> Entry:
        """Wait until `entry` leaves loading/filling; `Busy` after `timeout`, `NotFound` if it went away."""
        try:
            await asyncio.wait_for(life(entry).ready.wait(), timeout)
        except asyncio.TimeoutError:
            raise Busy(f"entry {entry.name!r} is still {entry.state} after {timeout:g} s") from None
        if self.cache.entries.get(entry.name) is not entry:
            raise NotFound(f"entry {entry.name!r} went away while loading (evicted or failed; see the daemon log)")
        return entry

    def still_loading(self, entry: Entry) -> bool:
        """Whether `entry`'s fill, or its check after a restart, has not ended yet (it may be
        evicting meanwhile: `supersede`)."""
        return life(entry).loading and self.cache.entries.get(entry.name) is entry

    def _set_ready(self, entry: Entry) -> None:
        life(entry).became_ready()
        adoption.park(entry)

    async def _create(self, backend: ArenaBackend, device: str, size: int, label: str) -> Arena:
        """Allocate an arena in a worker (posix_fallocate of GBs takes seconds); one whose waiter
        was cancelled (its client disconnected, shutdown) is closed when the worker is done."""
        return await produced(lambda: backend.create(device, size, label))

    # -- verifying --------------------------------------------------------------------------

    async def content_digest(self, entry: Entry) -> str:
        """The full content digest of what is resident (`loader.content_digest`, as `verify` gives
        it), hashed once per entry in the digest pool and kept: at commit for published entries,
        at the first request for the others (the bytes are sealed, so it cannot change)."""
        record = life(entry)
        if record.digest is None:
            self._verifier.keep_digest(entry, "digest at its first request")
        assert record.digest is not None
        try:
            digests = await asyncio.shield(record.digest[0])
        except Exception:
            if self.cache.entries.get(entry.name) is not entry:  # evicted while it was hashed
                raise NotFound(f"entry {entry.name!r} was evicted while its content digest was taken") from None
            raise
        return await asyncio.to_thread(content_digest, digests)

    async def verify(self, entry: Entry) -> Verification:
        """The content digest of what is resident and the tensors that differ (`wcd.verifying`).
        The daemon holds the arena meanwhile: no heartbeats, so no expiry, and its own owner, so
        the hold ends here whatever happens to the connections waiting for the result."""
        entry = await self.wait_ready(entry, 24 * 3600)
        holder = object()
        lease = self.cache.acquire(entry, holder, os.getpid(), os.getuid(), ttl_s=math.inf)
        try:
            return await self._verifier.shared(entry, self._follow_links(entry.name))
        finally:
            dropped = self.cache.release(holder, lease.id)
            self.reclaim(dropped, ended(entry, "the daemon's hold for its verify ended"))

    # -- reclaiming -------------------------------------------------------------------------

    def reclaim(self, entries: Iterable[Entry], why: str) -> None:
        """Entries the cache dropped, for `why` (said in the log, and shown with the entry of that
        name that comes next): end their lives (memory returns once clients unmap)."""
        for entry in entries:
            self.cache.note_reclaimed(entry.name, why)
            if self.fleet is not None:
                self.fleet.forget(entry)
            record = life(entry)
            if record.superseded:  # a reload changed its model while it was leased: load that now
                record.superseded = False
                model = self._model(entry.name)
                if model is not None:
                    self.admit_later(model)
            record.end(entry)
            log.info("reclaimed %s (%s on %s): %s", entry.name, format_size(entry.nbytes), entry.device, why)

    def evict(self, entry: Entry, why: str) -> list[Entry]:
        """Evict now, or once its leases end (then `why` is said when the last one goes, as it
        ends); returns what was dropped now."""
        dropped = self.cache.evict(entry)
        self.reclaim(dropped, why)
        if not dropped:
            entry.evicted_why = why
        return dropped

    def supersede(self, entry: Entry) -> None:
        """A reload removed or changed `entry`'s configured model: evict it, now or once its leases
        end. One still loading (a fill, or the check of an entry re-adopted after a restart) or
        still leased keeps its name until that ends, so nothing loads the model beside it; then the
        config of that time has its model admitted as the entry goes (`_drop_loading`, `reclaim`),
        with no other reload."""
        if not self.evict(entry, "superseded: a reload changed or removed its model"):
            life(entry).superseded = True

    def cancel_loads(self) -> None:
        """Shutdown: stop every load at its next chunk, and load nothing in place of what goes."""
        for entry in self.cache.entries.values():
            life(entry).superseded = False
        self.cache.cancel_loads()

    async def expire_leases(self) -> None:
        """Forever: end leases that missed their heartbeats and reclaim what they held."""
        tick = min(1.0, self.state.config.daemon.lease_ttl_s / 10)
        while True:
            await asyncio.sleep(tick)
            while True:  # in batches, letting the loop answer others in between; one log line each
                expired, dropped = self.cache.expire(EXPIRY_BATCH)
                if expired:
                    log.info("%s", describe_expired(expired))
                last = {lease.entry: lease for lease in expired}
                for entry in dropped:
                    lease = last.get(entry)
                    whose = f" (pid {lease.pid}, uid {lease.uid})" if lease is not None else ""
                    self.reclaim([entry], ended(entry, f"its last lease expired: no heartbeat{whose}"))
                if len(expired) < EXPIRY_BATCH:
                    break
                await asyncio.sleep(0)

    async def _drop_loading(self, entry: Entry, failed_check: bool = False) -> bool:
        """Drop an entry whose load, or whose check after re-adoption, ended without making it
        ready. Its configured model is loaded from disk per the config now in force, admitted as
        the entry goes, so acquires waiting for the entry wake to find the new one
        (`wcd.ops.acquire`): if a reload changed the model meanwhile (`supersede`), or if
        `failed_check` (a re-adopted entry of a configured model, not evicted meanwhile).
        Returns whether the model was loaded again."""
        record = life(entry)
        superseded, record.superseded = record.superseded, False
        model = self._model(entry.name)
        try:
            if model is not None and (superseded or (failed_check and entry.origin == "config"
                                                     and entry.state != "evicting")):
                await self.admit_configured(model, replacing=entry)
        finally:  # if it was not replaced
            self.reclaim(self.cache.load_failed(entry), ended(entry, "its load or check ended without it"))
        return self.cache.entries.get(entry.name) not in (None, entry)

    def _model(self, name: str) -> ModelConfig | None:
        return next((m for m in self.state.config.models if m.name == name), None)

    def _follow_links(self, name: str) -> bool:
        return any(m.follow_symlinks for m in self.state.config.models if m.name == name)

    # -- shutdown ---------------------------------------------------------------------------

    async def close(self) -> int:
        """Close our descriptors without evicting (`shutdown.release`): parked arenas stay in
        systemd's fd store for the next start. Returns how many stay parked."""
        self.hung = await shutdown.release(list(self.cache.entries.values()), self.pools, self.helpers)
        return sum(1 for e in self.cache.entries.values() if life(e).parked)


def ended(entry: Entry, how: str) -> str:
    """Why `entry` went when a lease of it (or its load) ended `how`: it had been evicted (by whom),
    or it was ephemeral."""
    if entry.evicted_why:
        return f"{entry.evicted_why}, and {how}"
    return f"ephemeral, and {how}" if entry.retention == "ephemeral" else how


class _EntryProgress:
    """Load progress written by loader threads, read by the loop (status)."""

    def __init__(self, entry: Entry) -> None:
        self.entry = entry

    def add(self, n: int) -> None:
        self.entry.done_bytes += n  # a racy += only undercounts progress transiently; fine for display


def _free_headers(ckpt: Checkpoint) -> None:
    """Free a filled checkpoint's headers in a thread, beside the reply: their columns are ~300,000
    ints at 100,000 tensors (2.3 ms on the VM) that the loop would free before answering."""
    held = [ckpt.headers]
    ckpt.headers = ()
    free_later(held)
