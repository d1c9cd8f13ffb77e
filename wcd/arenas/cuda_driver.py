"""The daemon's CUDA driver calls, through cuda-bindings: results checked into one-line errors,
GPUs found by name, primary contexts, VMM address mappings, allocation properties, NVML memory.

Clients map arenas through the ctypes binding in `cudrv` instead (no cuda-bindings import on an
engine's clock); `Gpu` and `resolve_gpu` come from there. Needs the `cuda` extra.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any

from cuda.bindings import driver as cuda

from wcd.arenas.cudrv import Gpu, HeldCalls, format_uuid, resolve_gpu
from wcd.errors import BadRequest, DeviceUnavailable, Internal, OutOfMemory

POSIX_FD = cuda.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
SUCCESS = cuda.CUresult.CUDA_SUCCESS
NOT_READY = cuda.CUresult.CUDA_ERROR_NOT_READY
_BAD_DEVICE = (cuda.CUresult.CUDA_ERROR_INVALID_DEVICE, cuda.CUresult.CUDA_ERROR_NO_DEVICE)
# cuda-bindings 12.9 (the cuda extra's range) runs on R525 and later drivers.
_DRIVER_HINT = "install the NVIDIA driver (R525 or later), or use device \"cpu\""


def check(result: tuple[Any, ...], what: str) -> Any:
    """Unwrap a cuda-bindings result `(CUresult, *values)`; a failure becomes a one-line WcdError."""
    err, values = result[0], result[1:]
    if err != SUCCESS:
        _, desc = cuda.cuGetErrorString(err)
        message = f"CUDA {what} failed: {getattr(err, 'name', err)} ({desc.decode() if desc else 'unknown error'})"
        if err == cuda.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
            raise OutOfMemory(message)
        raise (BadRequest if err in _BAD_DEVICE else Internal)(message)
    if not values:
        return None
    return values[0] if len(values) == 1 else values


@cache
def held() -> HeldCalls:
    """The copy loop's GIL-keeping driver calls (the unit tests' fakes replace this)."""
    return HeldCalls()


def check_held(err: Any, what: str) -> None:
    """`check` for a `HeldCalls` result (a bare CUresult, an int from the driver)."""
    if err != SUCCESS:
        try:
            code = cuda.CUresult(err) if type(err) is int else err
        except ValueError:  # a code newer than these bindings
            raise Internal(f"CUDA {what} failed: error {err}") from None
        check((code,), what)


def cleanup(*steps: Callable[[], object]) -> None:
    """Run every release step even when one fails, then raise the first failure."""
    first: BaseException | None = None
    for step in steps:
        try:
            step()
        except Exception as e:  # noqa: BLE001 - the remaining steps must still run
            first = first or e
    if first is not None:
        raise first


@cache
def gpus() -> tuple[Gpu, ...]:
    """The GPUs this process sees, after `cuInit`. Enumeration is fixed for a process's lifetime."""
    try:
        err, = cuda.cuInit(0)
    except Exception as e:  # noqa: BLE001 - cuda-bindings raises its own loader errors without a driver
        raise DeviceUnavailable(f"CUDA driver not available ({e}); {_DRIVER_HINT}") from None
    if err == cuda.CUresult.CUDA_ERROR_NO_DEVICE:  # e.g. CUDA_VISIBLE_DEVICES=""
        return ()
    if err != SUCCESS:  # no driver, one too old for these bindings, no /dev/nvidia* access, ...
        raise DeviceUnavailable(f"CUDA driver not usable (cuInit: {getattr(err, 'name', err)}); {_DRIVER_HINT}")
    out = []
    for i in range(check(cuda.cuDeviceGetCount(), "cuDeviceGetCount")):
        dev = check(cuda.cuDeviceGet(i), "cuDeviceGet")
        uuid = format_uuid(bytes(check(cuda.cuDeviceGetUuid(dev), "cuDeviceGetUuid").bytes))
        name = check(cuda.cuDeviceGetName(256, dev), "cuDeviceGetName").split(b"\0", 1)[0].decode()
        out.append(Gpu(i, uuid, name))
    return tuple(out)


def find_gpu(device: str) -> Gpu:
    """Resolve "cuda", "cuda:N" or a GPU UUID (any case) against this process's GPUs."""
    return resolve_gpu(device, gpus())


def retain_context(gpu: Gpu) -> Any:
    """Retain the device's primary context (the one torch's runtime uses); pair with `release_context`."""
    return check(cuda.cuDevicePrimaryCtxRetain(gpu.ordinal), "cuDevicePrimaryCtxRetain")


def release_context(gpu: Gpu) -> None:
    check(cuda.cuDevicePrimaryCtxRelease(gpu.ordinal), "cuDevicePrimaryCtxRelease")


def exclusive_process(gpu: Gpu) -> bool:
    """Whether the device is in EXCLUSIVE_PROCESS compute mode: one process's context at a time
    (`nvidia-smi -c`). Needs no context."""
    mode = check(cuda.cuDeviceGetAttribute(cuda.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_MODE, gpu.ordinal),
                  "cuDeviceGetAttribute")
    return int(mode) == int(cuda.CUcomputemode.CU_COMPUTEMODE_EXCLUSIVE_PROCESS)


@contextmanager
def current(ctx: Any) -> Iterator[None]:
    """Make `ctx` current for a block and restore the caller's context after (push/pop)."""
    check(cuda.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")
    try:
        yield
    finally:
        cuda.cuCtxPopCurrent()


class VaMapping:
    """`size` bytes of an allocation handle (from `offset`) mapped at a fresh virtual address,
    accessible from `gpu` read-only or read-write. `close` unmaps and frees the address range."""

    def __init__(self, handle: Any, gpu: Gpu, size: int, writable: bool, offset: int = 0) -> None:
        self.size = size
        self.ptr = int(check(cuda.cuMemAddressReserve(size, 0, 0, 0), "cuMemAddressReserve"))
        try:
            check(cuda.cuMemMap(self.ptr, size, offset, handle, 0), "cuMemMap")
            try:
                access = cuda.CUmemAccessDesc()
                access.location.type = cuda.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                access.location.id = gpu.ordinal
                access.flags = (cuda.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE if writable
                                else cuda.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ)
                check(cuda.cuMemSetAccess(self.ptr, size, [access], 1), "cuMemSetAccess")
            except BaseException:
                cuda.cuMemUnmap(self.ptr, size)
                raise
        except BaseException:
            cuda.cuMemAddressFree(self.ptr, size)
            raise

    def close(self) -> None:
        if self.ptr:
            ptr, self.ptr = self.ptr, 0
            cleanup(lambda: check(cuda.cuMemUnmap(ptr, self.size), "cuMemUnmap"),
                     lambda: check(cuda.cuMemAddressFree(ptr, self.size), "cuMemAddressFree"))


def alloc_prop(gpu: Gpu) -> Any:
    prop = cuda.CUmemAllocationProp()
    prop.type = cuda.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cuda.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = gpu.ordinal
    prop.requestedHandleTypes = POSIX_FD
    return prop


@cache
def granularity(gpu: Gpu) -> int:
    flag = cuda.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    return int(check(cuda.cuMemGetAllocationGranularity(alloc_prop(gpu), flag), "cuMemGetAllocationGranularity"))


@cache
def _nvml() -> Any:
    try:
        from cuda.bindings import nvml

        nvml.init_v2()
        return nvml
    except Exception:  # noqa: BLE001 - older cuda-bindings (no nvml module) or no libnvidia-ml
        return None


def nvml_memory(uuid: str) -> tuple[int, int] | None:
    nvml = _nvml()
    if nvml is None:
        return None
    try:
        mem = nvml.device_get_memory_info_v2(nvml.device_get_handle_by_uuid(uuid))
    except nvml.NvmlError:
        return None
    return int(mem.total), int(mem.free)
