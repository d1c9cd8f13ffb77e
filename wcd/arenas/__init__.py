"""Arenas: one contiguous allocation per entry per device, exported as one file descriptor.

`backend_for(device)` picks the implementation: `cpu` is host memory (sealed memfd, always
available); `cuda:N` and GPU UUIDs are CUDA VMM allocations (`wcd.arenas.cuda`, needs the
`cuda` extra, imported only when a GPU device is used). Arenas know nothing about leases.
"""

from __future__ import annotations

from wcd.arenas.base import Arena, ArenaBackend, ArenaWriter, DeviceInfo
from wcd.errors import BadRequest
from wcd.key import HOST_DEVICE

__all__ = ["Arena", "ArenaBackend", "ArenaWriter", "DeviceInfo", "backend_for", "is_gpu_device"]

_backends: dict[str, ArenaBackend] = {}


def is_gpu_device(device: str) -> bool:
    return device.startswith(("cuda", "GPU-"))


def backend_for(device: str) -> ArenaBackend:
    """The backend serving `device` ("cpu", "cuda:N" or a GPU UUID "GPU-...")."""
    kind = "cuda" if is_gpu_device(device) else device
    backend = _backends.get(kind)
    if backend is None:
        if kind == HOST_DEVICE:
            from wcd.arenas.host import HostBackend

            backend = HostBackend()
        elif kind == "cuda":
            from wcd.arenas.cuda import CudaBackend

            backend = CudaBackend()
        else:
            raise BadRequest(f"unknown device {device!r}: use \"cpu\", \"cuda:N\" or a GPU UUID (GPU-...)")
        _backends[kind] = backend
    return backend
