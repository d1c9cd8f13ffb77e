"""Arenas: one contiguous allocation per entry per device, exported as one file descriptor.

`backend_for(device)` picks the implementation: `cpu` is host memory (sealed memfd, always
available); `cuda:N` and GPU UUIDs are CUDA VMM allocations (`wcd.arenas.cuda`, needs the
`cuda` extra, imported only when a GPU device is used; without it a GPU device is a
`DeviceUnavailable` error that says what to install). Arenas know nothing about leases.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterable

from wcd import DISTRIBUTION, HOST_DEVICE
from wcd.arenas.base import Arena, ArenaBackend, ArenaWriter, DeviceInfo
from wcd.errors import BadRequest, DeviceUnavailable
from wcd.tuning import DEFAULT, LoadTuning

__all__ = ["Arena", "ArenaBackend", "ArenaWriter", "DeviceInfo", "backend_for", "device_memory", "is_gpu_device",
           "loaded_backends", "released_held", "set_tuning", "start_driver"]

_backends: dict[str, ArenaBackend] = {}
_backends_lock = threading.Lock()
_tuning = DEFAULT


def set_tuning(tuning: LoadTuning) -> None:
    """Build the backends made from now on with `tuning` (a benchmark's variant, set before the
    daemon starts); the daemon itself keeps the defaults."""
    global _tuning
    _tuning = tuning


def is_gpu_device(device: str) -> bool:
    return device.startswith(("cuda", "GPU-"))


def backend_for(device: str) -> ArenaBackend:
    """The backend serving `device` ("cpu", "cuda:N" or a GPU UUID "GPU-...")."""
    kind = "cuda" if is_gpu_device(device) else device
    backend = _backends.get(kind)
    if backend is None:
        with _backends_lock:  # the loop and a worker (an adoption check) may both come first
            return _backends.get(kind) or _new_backend(kind, device)
    return backend


def _new_backend(kind: str, device: str) -> ArenaBackend:
    """Make and keep the backend of `kind` (under `_backends_lock`)."""
    backend: ArenaBackend
    if kind == HOST_DEVICE:
        from wcd.arenas.host import HostBackend

        backend = HostBackend()
        backend.tuning = _tuning
    elif kind == "cuda":
        try:
            from wcd.arenas.cuda import CudaBackend
        except ModuleNotFoundError as e:
            if (e.name or "").partition(".")[0] != "cuda":
                raise
            raise DeviceUnavailable(_missing_bindings(device)) from None
        backend = CudaBackend(_tuning)
    else:
        raise BadRequest(f"unknown device {device!r}: use \"cpu\", \"cuda:N\" or a GPU UUID (GPU-...)")
    _backends[kind] = backend
    return backend


def start_driver(devices: Iterable[str]) -> None:
    """If any of `devices` is a GPU, start loading the CUDA driver in a thread: `cuInit` took
    0.1-0.24 s on the H200 machines and runs without the GIL, so it overlaps the daemon's own
    imports; `device_memory` later finds it done. Through the ctypes binding (`wcd.arenas.cudrv`),
    not cuda-bindings, whose import holds the GIL for 18-25 ms there and is not needed before
    READY. Errors are left for `device_memory` to report in its own words."""
    if not any(is_gpu_device(d) for d in devices):
        return

    def init() -> None:
        from wcd.arenas import cudrv

        try:
            cudrv.driver()
        except Exception:  # noqa: BLE001, S110 - reported by device_memory, which tries again
            pass

    threading.Thread(target=init, name="wcd-cuinit", daemon=True).start()


def device_memory(device: str) -> tuple[str, int]:
    """(canonical id, total memory) of a device: what start-up needs to set budgets, before READY.
    For a GPU through the ctypes driver, after checking that cuda-bindings (which everything else
    on a GPU needs) is installed, without importing it."""
    if not is_gpu_device(device):
        backend = backend_for(device)
        canonical = backend.canonical(device)
        return canonical, backend.total_memory(canonical)
    from wcd.arenas import cudrv

    if not _bindings_installed():
        raise DeviceUnavailable(_missing_bindings(device))
    drv = cudrv.driver()
    gpu = cudrv.resolve_gpu(device, drv.gpus())
    return gpu.uuid, drv.total_memory(gpu)


def _bindings_installed() -> bool:
    """Whether cuda-bindings can be imported, without importing it."""
    if sys.modules.get("cuda.bindings") is not None:
        return True
    from importlib.util import find_spec

    try:
        return find_spec("cuda.bindings") is not None
    except (ImportError, ValueError):  # no `cuda` package at all; one without a spec
        return False


def _missing_bindings(device: str) -> str:
    return (f"device {device!r} needs cuda-bindings, which is not installed: install the wcd-cuda "
            f"package, or wcd's cuda extra (pip install '{cuda_requirement()}') in its environment")


def released_held(device: str) -> int:
    """Bytes of `device`'s arenas the daemon closed that other processes still map (0 for a device
    whose backend was never used)."""
    backend = _backends.get("cuda" if is_gpu_device(device) else device)
    return backend.released_held() if backend is not None else 0


def loaded_backends() -> list[ArenaBackend]:
    """The backends this process has used so far (and so may hold staging)."""
    return list(_backends.values())


def cuda_requirement() -> str:
    """The `cuda` extra's cuda-bindings requirement as the installed metadata states it, so that
    pyproject.toml stays the one place that names the supported versions."""
    from importlib import metadata

    try:
        requires = metadata.requires(DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        requires = []
    for line in requires:
        spec, _, marker = line.partition(";")
        if spec.strip().startswith("cuda-bindings") and "cuda" in marker:
            return spec.strip()
    return "cuda-bindings"
