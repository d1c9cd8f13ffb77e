"""The CUDA driver calls an engine needs to map an arena, bound with ctypes; and naming GPUs.

The client maps an arena on the engine's start-up clock, where importing cuda-bindings cost
25-31 ms on the H200 (its enum and struct tables), more than the whole attach budget. Mapping
needs sixteen driver functions; they are bound here, by hand, against `libcuda.so.1`, which the
engine's torch has already loaded. The daemon's start-up uses the same binding for what it needs
before READY (`cuInit`, the GPUs and their memory, `wcd.arenas.device_memory`), so that READY does
not wait for cuda-bindings either; the daemon uses cuda-bindings (`wcd.arenas.cuda`) for everything
else, after READY. `Gpu` and `resolve_gpu` (UUIDs and "cuda:N" against the visible GPUs) are shared
by both. Nothing here loads the driver until a call needs it.
"""

from __future__ import annotations

import ctypes
import os
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from wcd.errors import BadRequest, DeviceUnavailable, Internal, OutOfMemory

_CUDA_N = re.compile(r"cuda(?::(\d+))?")
# From cuda.h; stable across driver versions.
SUCCESS, ERROR_OUT_OF_MEMORY, ERROR_NO_DEVICE, ERROR_INVALID_DEVICE = 0, 2, 100, 101
HANDLE_TYPE_POSIX_FD = 1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
LOCATION_TYPE_DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE
PROT_READ, PROT_READWRITE = 1, 3  # CU_MEM_ACCESS_FLAGS_PROT_*


@dataclass(frozen=True)
class Gpu:
    ordinal: int  # CUdevice in this process's enumeration (after CUDA_VISIBLE_DEVICES)
    uuid: str  # "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as nvidia-smi -L prints it
    name: str

    @property
    def label(self) -> str:
        return f"{self.name} (cuda:{self.ordinal})"


def format_uuid(raw: bytes) -> str:
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def resolve_gpu(device: str, visible: tuple[Gpu, ...]) -> Gpu:
    """Resolve "cuda", "cuda:N" or a GPU UUID (any case) against the GPUs this process sees."""
    m = _CUDA_N.fullmatch(device)
    if m:
        n = int(m.group(1) or 0)
        if n < len(visible):
            return visible[n]
    else:
        for gpu in visible:
            if gpu.uuid.lower() == device.lower():
                return gpu
    seen = ", ".join(f"cuda:{g.ordinal}={g.uuid}" for g in visible) or "none"
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    where = f" (CUDA_VISIBLE_DEVICES={env!r})" if env is not None else ""
    raise BadRequest(f"GPU {device!r} is not visible to this process{where}; visible GPUs: {seen}")


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]



_u64, _size, _ptr, _int, _uint = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint
_P = ctypes.POINTER
# name -> argument types. Versioned names (_v2) are what cuda.h's macros resolve to today.
_SIGNATURES: dict[str, list[Any]] = {
    "cuInit": [_uint],
    "cuDeviceGetCount": [_P(_int)],
    "cuDeviceGet": [_P(_int), _int],
    "cuDeviceGetUuid_v2": [ctypes.c_char_p, _int],
    "cuDeviceGetName": [ctypes.c_char_p, _int, _int],
    "cuDeviceTotalMem_v2": [_P(_size), _int],
    "cuDevicePrimaryCtxRetain": [_P(_ptr), _int],
    "cuDevicePrimaryCtxRelease_v2": [_int],
    "cuCtxPushCurrent_v2": [_ptr],
    "cuCtxPopCurrent_v2": [_P(_ptr)],
    "cuCtxSynchronize": [],
    "cuMemImportFromShareableHandle": [_P(_u64), _ptr, _int],
    "cuMemAddressReserve": [_P(_u64), _size, _size, _u64, ctypes.c_ulonglong],
    "cuMemMap": [_u64, _size, _size, _u64, ctypes.c_ulonglong],
    "cuMemSetAccess": [_u64, _size, _P(_AccessDesc), _size],
    "cuMemUnmap": [_u64, _size],
    "cuMemAddressFree": [_u64, _size],
    "cuMemRelease": [_u64],
    "cuGetErrorName": [_int, _P(ctypes.c_char_p)],
    "cuGetErrorString": [_int, _P(ctypes.c_char_p)],
}


def load_library(name: str) -> ctypes.CDLL:
    """`ctypes.CDLL(name)`, but loaded first through libc's `dlopen` called as a foreign function,
    which runs without the GIL: CDLL's own dlopen holds it, and loading libcuda (tens of MB to map
    and relocate) from the daemon's start-up thread would stop its main thread for as long. Then
    CDLL finds the library loaded. Where there is no `dlopen` to call, CDLL does it all."""
    dlopen = getattr(ctypes.CDLL(None), "dlopen", None)
    if dlopen is not None:
        dlopen.restype, dlopen.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_int]
        dlopen(os.fsencode(name), os.RTLD_NOW | os.RTLD_LOCAL)  # NULL on failure: CDLL says why
    return ctypes.CDLL(name)


class HeldCalls:
    """Three driver calls of the loader's copy loop, bound through `ctypes.PyDLL`: they keep the GIL.
    cuda-bindings releases it around every call, and a thread that gives it up for a call of a few
    microseconds then waits its turn to take it back behind the other loader threads, per read.
    Only calls that never block belong here: a copy from pinned memory onto a stream with at most a
    lane's buffers queued, an event record, and an event query (it answers CUDA_ERROR_NOT_READY
    rather than wait). Streams and events are cuda-bindings' objects (their handles are `int()` of
    them); each call returns the CUresult as an int. Measured: bench/RESULTS.md (load)."""

    def __init__(self, library: str = "libcuda.so.1") -> None:
        lib = ctypes.PyDLL(library)  # the handle `load_library` or cuda-bindings already opened
        self._memcpy = lib.cuMemcpyHtoDAsync_v2
        self._memcpy.argtypes, self._memcpy.restype = [_u64, _ptr, _size, _ptr], _int
        self._record = lib.cuEventRecord
        self._record.argtypes, self._record.restype = [_ptr, _ptr], _int
        self._query = lib.cuEventQuery
        self._query.argtypes, self._query.restype = [_ptr], _int

    def memcpy_htod_async(self, dst: int, src: int, nbytes: int, stream: Any) -> int:
        return int(self._memcpy(dst, src, nbytes, int(stream)))

    def event_record(self, event: Any, stream: Any) -> int:
        return int(self._record(int(event), int(stream)))

    def event_query(self, event: Any) -> int:
        return int(self._query(int(event)))


class Driver:
    """`libcuda.so.1`, initialised; each method wraps one driver call and raises a one-line
    `WcdError` (OutOfMemory, BadRequest for a bad device, Internal otherwise) on failure."""

    def __init__(self, library: str = "libcuda.so.1") -> None:
        try:
            lib = load_library(library)
        except OSError as e:
            raise DeviceUnavailable(f"CUDA driver not available ({e}); install the NVIDIA driver or use device "
                                    "\"cpu\"") from None
        self._fn: dict[str, Any] = {}
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name, None)
            if fn is None:
                raise DeviceUnavailable(f"the CUDA driver ({library}) has no {name}: it is too old for wcd "
                                        "(needs CUDA 12)")
            fn.argtypes, fn.restype = argtypes, _int
            self._fn[name.removesuffix("_v2")] = fn
        err = self._fn["cuInit"](0)
        self._gpus: tuple[Gpu, ...] | None = None
        if err == ERROR_NO_DEVICE:  # e.g. CUDA_VISIBLE_DEVICES="": a driver, but no GPU visible
            self._gpus = ()
        elif err != SUCCESS:  # no driver, one too old, no /dev/nvidia* access, ...
            label = ctypes.c_char_p()
            self._fn["cuGetErrorName"](err, ctypes.byref(label))
            name = (label.value or f"error {err}".encode()).decode()
            raise DeviceUnavailable(f"CUDA driver not usable (cuInit: {name}); install the NVIDIA driver (R525 or "
                                    "later), or use device \"cpu\"")

    def _call(self, name: str, what: str, *args: Any) -> None:
        err = self._fn[name](*args)
        if err != SUCCESS:
            self._raise(err, what)

    def _raise(self, err: int, what: str) -> None:
        label, desc = ctypes.c_char_p(), ctypes.c_char_p()
        self._fn["cuGetErrorName"](err, ctypes.byref(label))
        self._fn["cuGetErrorString"](err, ctypes.byref(desc))
        text = (f"CUDA {what} failed: {(label.value or b'CUDA_ERROR_' + str(err).encode()).decode()} "
                f"({(desc.value or b'unknown error').decode()})")
        if err == ERROR_OUT_OF_MEMORY:
            raise OutOfMemory(text)
        raise (BadRequest if err in (ERROR_NO_DEVICE, ERROR_INVALID_DEVICE) else Internal)(text)

    def gpus(self) -> tuple[Gpu, ...]:
        """The GPUs this process sees. Enumeration is fixed for a process's lifetime."""
        if self._gpus is None:
            count, dev = _int(), _int()
            self._call("cuDeviceGetCount", "cuDeviceGetCount", ctypes.byref(count))
            out = []
            for i in range(count.value):
                self._call("cuDeviceGet", "cuDeviceGet", ctypes.byref(dev), i)
                uuid, name = ctypes.create_string_buffer(16), ctypes.create_string_buffer(256)
                self._call("cuDeviceGetUuid", "cuDeviceGetUuid", uuid, dev)
                self._call("cuDeviceGetName", "cuDeviceGetName", name, 256, dev)
                out.append(Gpu(i, format_uuid(uuid.raw), name.value.decode(errors="replace")))
            self._gpus = tuple(out)
        return self._gpus

    def total_memory(self, gpu: Gpu) -> int:
        """`cuDeviceTotalMem`: needs no context."""
        total = _size()
        self._call("cuDeviceTotalMem", "cuDeviceTotalMem", ctypes.byref(total), gpu.ordinal)
        return int(total.value)

    def retain_primary_context(self, gpu: Gpu) -> int:
        ctx = _ptr()
        self._call("cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRetain", ctypes.byref(ctx), gpu.ordinal)
        return int(ctx.value or 0)

    def release_primary_context(self, gpu: Gpu) -> None:
        self._call("cuDevicePrimaryCtxRelease", "cuDevicePrimaryCtxRelease", gpu.ordinal)

    @contextmanager
    def current(self, ctx: int) -> Iterator[None]:
        """Make `ctx` current for a block and restore the caller's context after (push/pop)."""
        self._call("cuCtxPushCurrent", "cuCtxPushCurrent", ctx)
        try:
            yield
        finally:
            self._fn["cuCtxPopCurrent"](ctypes.byref(_ptr()))

    def synchronize(self) -> None:
        self._call("cuCtxSynchronize", "cuCtxSynchronize")

    def import_fd(self, fd: int) -> int:
        """An allocation handle for an exported arena fd (the fd stays the caller's)."""
        handle = _u64()
        self._call("cuMemImportFromShareableHandle", "cuMemImportFromShareableHandle", ctypes.byref(handle),
                   fd, HANDLE_TYPE_POSIX_FD)
        return handle.value

    def release(self, handle: int) -> None:
        self._call("cuMemRelease", "cuMemRelease", handle)

    def map(self, handle: int, gpu: Gpu, size: int, writable: bool) -> int:
        """Map all `size` bytes of `handle` at a fresh virtual address, read-only unless `writable`."""
        ptr = _u64()
        self._call("cuMemAddressReserve", "cuMemAddressReserve", ctypes.byref(ptr), size, 0, 0, 0)
        try:
            self._call("cuMemMap", "cuMemMap", ptr.value, size, 0, handle, 0)
            try:
                access = _AccessDesc(_Location(LOCATION_TYPE_DEVICE, gpu.ordinal),
                                     PROT_READWRITE if writable else PROT_READ)
                self._call("cuMemSetAccess", "cuMemSetAccess", ptr.value, size, ctypes.byref(access), 1)
            except BaseException:
                self._fn["cuMemUnmap"](ptr.value, size)
                raise
        except BaseException:
            self._fn["cuMemAddressFree"](ptr.value, size)
            raise
        return ptr.value

    def remap(self, ptr: int, size: int, old: int, new: int, gpu: Gpu, writable: bool) -> None:
        """Put allocation `new` behind the range at `ptr` in place of `old` (same addresses: kernels
        and captured graphs read the new bytes). The caller has synchronized. If `new` cannot be
        mapped, `old` is mapped back and the error raised; should that fail too (a driver in trouble),
        its error is raised and the range is left unmapped."""
        access = _AccessDesc(_Location(LOCATION_TYPE_DEVICE, gpu.ordinal), PROT_READWRITE if writable else PROT_READ)
        self._call("cuMemUnmap", "cuMemUnmap", ptr, size)
        try:
            self._call("cuMemMap", "cuMemMap", ptr, size, 0, new, 0)
            try:
                self._call("cuMemSetAccess", "cuMemSetAccess", ptr, size, ctypes.byref(access), 1)
            except BaseException:
                self._fn["cuMemUnmap"](ptr, size)
                raise
        except BaseException:
            self._call("cuMemMap", "cuMemMap", ptr, size, 0, old, 0)
            self._call("cuMemSetAccess", "cuMemSetAccess", ptr, size, ctypes.byref(access), 1)
            raise

    def unmap(self, ptr: int, size: int) -> None:
        """Unmap and free the address range; both steps run even if the first fails."""
        try:
            self._call("cuMemUnmap", "cuMemUnmap", ptr, size)
        finally:
            self._call("cuMemAddressFree", "cuMemAddressFree", ptr, size)


_driver: Driver | None = None
_driver_lock = threading.Lock()


def driver() -> Driver:
    """The process's `Driver`, loaded on first use."""
    global _driver
    with _driver_lock:
        if _driver is None:
            _driver = Driver()
        return _driver
