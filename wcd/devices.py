"""The devices a daemon manages: their budgets, canonical ids, and their backends made ready.

A configured device name ("cuda:0", "cpu") maps to a canonical id (a GPU's UUID, "cpu") once,
at start-up; requests name either. Backends are imported lazily: a host-only daemon never
imports cuda-bindings, and a peer's request for a GPU on such a daemon is refused before any
backend is touched.
"""

from __future__ import annotations

import asyncio
import logging

from wcd.arenas import ArenaBackend, backend_for, device_memory, is_gpu_device
from wcd.config import Config
from wcd.errors import BadRequest, ConfigError, DeviceUnavailable, WcdError
from wcd.key import HOST_DEVICE, WeightCacheKey
from wcd.loader import default_workers
from wcd.offloop import quiet
from wcd.state import ServerState
from wcd.units import format_size, parse_size

log = logging.getLogger("wcd")

DEFAULT_BUDGET = {"cpu": "50%", "cuda": "90%"}


def device_budgets(config: Config, source: object = "") -> tuple[dict[str, int], dict[str, str]]:
    """(budget per canonical device, configured name -> canonical id): configured budgets, every
    model's device, and host memory. A GPU the host does not have is a `ConfigError` naming the
    field (`source`: the config file, for the message); a budget above the device's memory is
    said at warning level (loads then fail when the memory runs out, not at the budget)."""
    wanted: dict[str, int | str] = {HOST_DEVICE: DEFAULT_BUDGET["cpu"]}
    fields: dict[str, str] = {}
    for i, model in enumerate(config.models):
        wanted.setdefault(model.device, DEFAULT_BUDGET["cuda" if model.device != HOST_DEVICE else "cpu"])
        fields.setdefault(model.device, f"models.{i}.device")
    wanted.update(config.daemon.budget)
    fields.update({device: f"daemon.budget.{device}" for device in config.daemon.budget})
    budgets: dict[str, int] = {}
    devices: dict[str, str] = {}
    for device, size in wanted.items():
        try:
            canonical, total = device_memory(device)
        except BadRequest as e:
            where = f"config {source}: " if source else ""
            raise ConfigError(f"{where}{fields.get(device, device)}: {e.message}") from None
        devices[device] = canonical
        budgets[canonical] = parse_size(size, total)
        if budgets[canonical] > total:
            log.warning("%s: budget %s is more than %s's %s of memory: loads past that fail when the memory "
                        "runs out; a fraction (\"90%%\") fits any machine", fields.get(device, device),
                        format_size(budgets[canonical]), device, format_size(total))
    return budgets, devices


class Devices:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    def canonical(self, device: str, *, from_peer: bool = False) -> str:
        """The canonical id of a managed device. `from_peer`: a GPU on a daemon that manages none is
        refused before any backend is touched, so a peer never makes a host-only daemon import
        cuda-bindings (nor run cuInit) on its loop."""
        budgets = self.state.cache.budgets
        if device in self.state.devices:
            return self.state.devices[device]
        if device in budgets:
            return device
        if from_peer and is_gpu_device(device) and not any(map(is_gpu_device, budgets)):
            raise DeviceUnavailable(f"device {device!r}: this daemon manages no GPU "
                                    f"(devices: {', '.join(budgets)})")
        canonical = backend_for(device).canonical(device)
        if canonical not in budgets:
            raise BadRequest(f"device {device!r} is not managed by this daemon (add a budget for it in the config)")
        return canonical

    def resolve(self, target: str | WeightCacheKey) -> str | WeightCacheKey:
        """A request's target with a configured device name ("cuda:0") replaced by its canonical id."""
        if isinstance(target, WeightCacheKey) and target.device in self.state.devices:
            target = target.model_copy(update={"device": self.state.devices[target.device]})
        return target

    def backend(self, device: str) -> ArenaBackend:
        """The backend of `device`, told the configured staging linger (which a reload may change)."""
        backend = backend_for(device)
        daemon = self.state.config.daemon
        backend.configure(daemon.staging_linger_s, direct_reads=daemon.cold_reads == "direct")
        return backend

    def prepare(self, device: str) -> None:
        """Start getting `device` ready (a GPU's context and pinned staging) while the checkpoint's
        headers are read: most of a GPU load's fixed cost, overlapped. Failures show at the fill."""
        backend = self.backend(device)
        workers = self.state.config.daemon.load_workers or default_workers()
        future = asyncio.get_running_loop().run_in_executor(None, backend.prepare, device, workers)
        future.add_done_callback(quiet)

    def warm(self) -> None:
        """Import the GPU backend (cuda-bindings: 18-25 ms holding the GIL) now, blocking, from the
        thread that starts the workers after READY: the first GPU request does not wait for it, and
        an install that is present but broken says so in one line at start-up (before READY the
        daemon only checks that cuda-bindings is installed)."""
        device = next((d for d in self.state.cache.budgets if is_gpu_device(d)), None)
        if device is None:
            return
        try:
            self.backend(device)
        except Exception as e:  # noqa: BLE001 - said once here; each GPU request says it again
            why = e.message if isinstance(e, WcdError) else f"cannot import cuda-bindings ({type(e).__name__}: {e})"
            log.error("GPU arenas are unavailable: %s; every GPU request fails until that is fixed", why)
