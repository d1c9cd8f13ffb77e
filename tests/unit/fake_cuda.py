"""A fake of the part of cuda-bindings' driver API that a `CudaWriter` uses, without torch: device
memory is a bytearray, and copies are queued per stream and run only when an event or the stream
is synchronised (as a GPU would run them later), so a staging buffer reused too early shows up as
wrong bytes. Used by test_cuda_scatter.py, test_staging.py and test_backend_for.py."""

from __future__ import annotations

import ctypes
import importlib
import sys
import types
from collections.abc import Callable
from typing import Any
from unittest import mock

DEVICE_BASE = 1 << 44
PAD = 0xEE  # what device memory holds before the fill


# The daemon's CUDA arena modules that import cuda-bindings, lowest first.
CUDA_MODULES = ("wcd.arenas.cuda_driver", "wcd.arenas.staging", "wcd.arenas.cuda")


class ArenaModules:
    """`wcd.arenas.cuda` and the modules it is built from (`CUDA_MODULES`, `direct_io`, `pagecache`)
    as one namespace: a name is read from the first that has it, and set in every one that has it,
    so that a test (monkeypatch) replaces what the code calls wherever it is called from. Names no
    module has (a test's own state) are kept here. No `__dict__`: monkeypatch restores through
    getattr/setattr then."""

    __slots__ = ("_modules", "_own")

    def __init__(self) -> None:
        names = ("wcd.arenas.cuda", "wcd.arenas.staging", "wcd.arenas.cuda_driver", "wcd.arenas.direct_io",
                 "wcd.pagecache")
        object.__setattr__(self, "_modules", [importlib.import_module(name) for name in names])
        object.__setattr__(self, "_own", {})

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name in self._own:
            return self._own[name]
        for module in self._modules:
            if name in vars(module):
                return vars(module)[name]
        raise AttributeError(name)

    def __setattr__(self, name: str, value: Any) -> None:
        holders = [module for module in self._modules if name in vars(module)]
        if not holders:
            self._own[name] = value
        for module in holders:
            setattr(module, name, value)


def forget_cuda_modules() -> None:
    """Drop `CUDA_MODULES` from sys.modules, so the next import binds them to the cuda-bindings there now."""
    for name in CUDA_MODULES:
        sys.modules.pop(name, None)


def held_calls(module: Any) -> types.SimpleNamespace:
    """What `wcd.arenas.cuda_driver.held` gives (the copy loop's GIL-keeping driver calls), through
    `module.cuda`'s functions as they are when called: a fake's, or a test's stand-ins."""
    return types.SimpleNamespace(
        memcpy_htod_async=lambda dst, src, nbytes, stream: module.cuda.cuMemcpyHtoDAsync(dst, src, nbytes, stream)[0],
        event_record=lambda event, stream: module.cuda.cuEventRecord(event, stream)[0],
        event_query=lambda event: module.cuda.cuEventQuery(event)[0])


class FakeStream:
    def __init__(self) -> None:
        self.queue: list[Callable[[], None] | FakeEvent] = []

    def run(self, until: FakeEvent | None = None) -> None:
        while self.queue:
            item = self.queue.pop(0)
            if isinstance(item, FakeEvent):
                item.pending = False
                if item is until:
                    return
            else:
                item()


class FakeEvent:
    def __init__(self) -> None:
        self.stream: FakeStream | None = None
        self.pending = False


class FakeDriver:
    """The part of cuda-bindings' driver API that a CudaWriter uses; device memory is `device`."""

    def __init__(self, ok: Any, not_ready: Any) -> None:
        self.ok, self.not_ready = ok, not_ready
        self._queries = 0
        self.device = bytearray()
        self.host: dict[int, Any] = {}  # address -> ctypes buffer (pinned staging)
        self.calls: dict[str, int] = {}
        self.rows: list[int] = []  # the Height of every 2D copy
        for name in ("CUstream_flags", "CUevent_flags", "CUmemLocationType", "CUmemAccess_flags"):
            setattr(self, name, mock.MagicMock())
        self.CUevent_flags.CU_EVENT_DISABLE_TIMING, self.CUevent_flags.CU_EVENT_BLOCKING_SYNC = 2, 1
        self.CUmemorytype = types.SimpleNamespace(CU_MEMORYTYPE_HOST="host", CU_MEMORYTYPE_DEVICE="device")
        self.CUdevice_attribute = types.SimpleNamespace(CU_DEVICE_ATTRIBUTE_COMPUTE_MODE=20)
        self.CUcomputemode = types.SimpleNamespace(CU_COMPUTEMODE_DEFAULT=0, CU_COMPUTEMODE_EXCLUSIVE_PROCESS=3)

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    # devices, contexts, mappings
    def cuDeviceGetAttribute(self, attribute: int, ordinal: int) -> tuple[Any, int]:
        assert attribute == self.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_MODE
        return self.ok, self.CUcomputemode.CU_COMPUTEMODE_DEFAULT

    def cuDevicePrimaryCtxRetain(self, ordinal: int) -> tuple[Any, object]:
        return self.ok, object()

    def cuDevicePrimaryCtxRelease(self, ordinal: int) -> tuple[Any]:
        return (self.ok,)

    def cuCtxPushCurrent(self, ctx: Any) -> tuple[Any]:
        return (self.ok,)

    def cuCtxPopCurrent(self) -> tuple[Any, None]:
        return self.ok, None

    def cuCtxSetCurrent(self, ctx: Any) -> tuple[Any]:
        return (self.ok,)

    def cuMemAddressReserve(self, size: int, *_: Any) -> tuple[Any, int]:
        self.device = bytearray([PAD]) * size
        return self.ok, DEVICE_BASE

    def CUmemAccessDesc(self) -> Any:
        return types.SimpleNamespace(location=types.SimpleNamespace(), flags=None)

    def cuMemMap(self, *_: Any) -> tuple[Any]:
        return (self.ok,)

    cuMemSetAccess = cuMemUnmap = cuMemAddressFree = cuMemRelease = cuMemMap

    # lanes: streams, events, pinned memory
    def cuStreamCreate(self, flags: Any) -> tuple[Any, FakeStream]:
        return self.ok, FakeStream()

    def cuStreamSynchronize(self, stream: FakeStream) -> tuple[Any]:
        stream.run()
        return (self.ok,)

    def cuStreamDestroy(self, stream: FakeStream) -> tuple[Any]:
        assert not stream.queue, "a stream destroyed with copies pending"
        return (self.ok,)

    def cuEventCreate(self, flags: Any) -> tuple[Any, FakeEvent]:
        return self.ok, FakeEvent()

    def cuEventRecord(self, event: FakeEvent, stream: FakeStream) -> tuple[Any]:
        event.stream, event.pending = stream, True
        stream.queue.append(event)
        return (self.ok,)

    def cuEventSynchronize(self, event: FakeEvent) -> tuple[Any]:
        if event.pending and event.stream is not None:
            event.stream.run(until=event)
        return (self.ok,)

    def cuEventQuery(self, event: FakeEvent) -> tuple[Any]:
        """Every other query of a pending event finds its copies done (the GPU ran them meanwhile),
        so a copy loop goes both ways: on at once, and waiting."""
        if event.pending and event.stream is not None:
            self._queries += 1
            if self._queries % 2:
                return (self.not_ready,)
            event.stream.run(until=event)
        return (self.ok,)

    def cuEventDestroy(self, event: FakeEvent) -> tuple[Any]:
        return (self.ok,)

    def cuMemHostAlloc(self, nbytes: int, flags: int) -> tuple[Any, int]:
        buf = (ctypes.c_char * nbytes)()
        self.host[ctypes.addressof(buf)] = buf
        return self.ok, ctypes.addressof(buf)

    def cuMemFreeHost(self, ptr: int) -> tuple[Any]:
        del self.host[ptr]
        return (self.ok,)

    # copies
    def _host_range(self, src: int, nbytes: int) -> None:
        assert any(a <= src and src + nbytes <= a + ctypes.sizeof(b) for a, b in self.host.items()), \
            f"{nbytes} bytes at {src:#x} are not in one pinned buffer"

    def _device_range(self, dst: int, nbytes: int) -> int:
        at = dst - DEVICE_BASE
        assert 0 <= at and at + nbytes <= len(self.device), f"{nbytes} bytes at device offset {at} outside the arena"
        return at

    def cuMemcpyHtoDAsync(self, dst: int, src: int, nbytes: int, stream: FakeStream) -> tuple[Any]:
        self._count("1d")
        self._host_range(src, nbytes)
        at = self._device_range(dst, nbytes)

        def copy() -> None:
            self.device[at : at + nbytes] = ctypes.string_at(src, nbytes)
        stream.queue.append(copy)
        return (self.ok,)

    def CUDA_MEMCPY2D(self) -> Any:
        return types.SimpleNamespace()

    def cuMemcpy2DAsync(self, p: Any, stream: FakeStream) -> tuple[Any]:
        self._count("2d")
        assert (p.srcMemoryType, p.dstMemoryType) == ("host", "device")
        src, spitch, dst, dpitch = p.srcHost, p.srcPitch, p.dstDevice, p.dstPitch
        width, height = p.WidthInBytes, p.Height
        assert 0 < width <= min(spitch, dpitch) and height > 0
        self.rows.append(height)
        self._host_range(src, spitch * (height - 1) + width)
        at = self._device_range(dst, dpitch * (height - 1) + width)

        def copy() -> None:  # the driver read `p` during the call: the values are taken now
            for r in range(height):
                self.device[at + r * dpitch : at + r * dpitch + width] = ctypes.string_at(src + r * spitch, width)
        stream.queue.append(copy)
        return (self.ok,)
