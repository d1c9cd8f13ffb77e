"""Client side of CUDA arenas: import an exported arena fd, map it, view it as one uint8 tensor.

The GPU is found by UUID in this process's own enumeration, so CUDA_VISIBLE_DEVICES remapping
works. Read leases map with PROT_READ: a stray write faults in this engine and never reaches the
shared copy. Fill leases map read-write. The mapping lives as long as any tensor over it (like
host arenas); `close` never unmaps under a live view. Driver calls go through `wcd.arenas.cudrv`
(ctypes), not cuda-bindings: this runs on the engine's start-up clock. Imports torch; the daemon
never does.
"""

from __future__ import annotations

import weakref

import torch

from wcd.arenas.cudrv import Driver, Gpu, driver, resolve_gpu
from wcd.errors import Internal


class _Memory:
    """What a tensor built through `__cuda_array_interface__` holds on to: when torch frees the last
    storage over it, this object dies and its finalizer unmaps."""

    def __init__(self, ptr: int, size: int) -> None:
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (ptr, False), "version": 3}


class CudaMapping:
    """One imported and mapped arena (the `mapping` half of `map_cuda_arena`'s result)."""

    def __init__(self, fd: int, size: int, drv: Driver, gpu: Gpu, writable: bool) -> None:
        self.gpu, self.size, self.writable = gpu, size, writable
        torch.cuda.init()
        # The primary context is the one torch's runtime uses: retaining it here makes the mapping
        # visible to torch's kernels, and keeps the context alive until we unmap.
        ctx = drv.retain_primary_context(gpu)
        try:
            with drv.current(ctx):
                handle = drv.import_fd(fd)
                try:
                    ptr = drv.map(handle, gpu, size, writable)
                except BaseException:
                    drv.release(handle)
                    raise
        except BaseException:
            drv.release_primary_context(gpu)
            raise
        memory = _Memory(ptr, size)
        self._drv, self._ctx, self.ptr = drv, ctx, ptr
        self._handle = [handle]  # the allocation mapped now: `remap` changes it, the finalizer reads it
        self._finalizer = weakref.finalize(memory, _unmap, drv, gpu, ctx, self._handle, ptr, size)
        self._finalizer.atexit = False  # at exit the driver reclaims everything; don't call into it
        try:
            with torch.cuda.device(gpu.ordinal):
                self._base: torch.Tensor | None = torch.as_tensor(memory, device=f"cuda:{gpu.ordinal}")
        except RuntimeError as e:
            raise Internal(f"cannot view mapped GPU memory as a torch tensor ({e}); torch needs numpy here") from None
        if self._base.data_ptr() != ptr:
            raise Internal("torch copied the mapped arena instead of viewing it")

    def take_base(self) -> torch.Tensor:
        """The uint8 tensor over the whole arena; the mapping keeps no reference to it."""
        base, self._base = self._base, None
        if base is None:
            raise Internal("the base tensor of a CUDA mapping was already taken")
        return base

    def remap(self, fd: int, size: int) -> None:
        """Map another arena of the same size (the next generation of a series; the caller keeps
        and closes `fd`) behind the same addresses, waiting first for work that reads the old one.
        On failure the old arena stays mapped."""
        if size != self.size:
            raise Internal(f"arena of {size} bytes cannot replace one of {self.size} in place")
        if not self._finalizer.alive:
            raise Internal("this CUDA mapping is already unmapped")
        drv = self._drv
        with drv.current(self._ctx):
            new = drv.import_fd(fd)
            try:
                drv.synchronize()
                drv.remap(self.ptr, size, self._handle[0], new, self.gpu, self.writable)
            except BaseException:
                drv.release(new)
                raise
            old, self._handle[0] = self._handle[0], new
            drv.release(old)

    def close(self) -> None:
        """Unmap now if no tensor refers to the arena any more; else raise BufferError (as `mmap.close`
        does), and the memory is unmapped when the last tensor over it is freed."""
        self._base = None
        if self._finalizer.alive:
            raise BufferError("tensors over this CUDA arena are still referenced; it unmaps when the last one dies")


def _unmap(drv: Driver, gpu: Gpu, ctx: int, handle: list[int], ptr: int, size: int) -> None:
    # Synchronize first: a kernel still reading the arena must finish before its pages go away.
    try:
        with drv.current(ctx):
            try:
                drv.synchronize()
            finally:
                try:
                    drv.unmap(ptr, size)
                finally:
                    drv.release(handle[0])
    finally:
        drv.release_primary_context(gpu)


def map_cuda_arena(fd: int, size: int, device: str, writable: bool) -> tuple[torch.Tensor, CudaMapping]:
    """Map an exported arena fd (the caller keeps and closes `fd`) on the GPU with UUID `device`.

    Raises `BadRequest` when that GPU is not visible to this process.
    """
    drv = driver()
    mapping = CudaMapping(fd, size, drv, resolve_gpu(device, drv.gpus()), writable)
    return mapping.take_base(), mapping
