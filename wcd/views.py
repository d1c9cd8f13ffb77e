"""Torch tensor views over a mapped arena: the client side of attach and publish.

One mapping per arena, one base tensor per dtype, then views built in batches by C++ calls
(`as_strided` + `unbind` per run of same-shaped tensors at a constant stride): attach cost grows
with the number of runs in the layout, and per tensor only by what torch itself pays for a view. Host arenas are
mapped MAP_PRIVATE for read leases (stray writes stay private) and MAP_SHARED for fill leases.
This module imports torch; the daemon never imports it.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import mmap
import os
import threading
import weakref
from collections.abc import Mapping, Sequence
from itertools import chain
from typing import Any

import torch

from wcd.arenas.base import SEALS, SIZE_SEALS, memfd_problem
from wcd.errors import BadRequest
from wcd.gcpause import gc_paused
from wcd.manifest import DTYPES, ITEMSIZES, Manifest, contiguous_strides

TORCH_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2": torch.float8_e5m2, "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "I16": torch.int16, "U16": torch.uint16, "F16": torch.float16, "BF16": torch.bfloat16,
    "I32": torch.int32, "U32": torch.uint32, "F32": torch.float32,
    "I64": torch.int64, "U64": torch.uint64, "F64": torch.float64, "C64": torch.complex64,
}
if hasattr(torch, "float8_e8m0fnu"):
    TORCH_DTYPES["F8_E8M0"] = torch.float8_e8m0fnu
WIRE_DTYPES: dict[torch.dtype, str] = {v: k for k, v in TORCH_DTYPES.items()}


def wire_dtype(dtype: torch.dtype) -> str:
    try:
        return WIRE_DTYPES[dtype]
    except KeyError:
        raise BadRequest(f"torch dtype {dtype} has no safetensors equivalent") from None


def build_views(base: torch.Tensor, manifest: Manifest) -> dict[str, torch.Tensor]:
    """Tensor views of a uint8 `base` covering the arena, one per manifest entry, no copies.

    Each of the manifest's runs (tensors of one dtype and shape at a constant stride: the daemon
    groups a model's repeated layers into runs) comes out of one `as_strided` + `unbind` call, so
    the per-tensor work happens in C++; a Python step is taken per run, not per tensor. The plan
    is kept on the manifest (`Manifest.view_plan`) for later acquires.
    """
    plan = manifest.view_plan
    if plan is None:
        plan = manifest.view_plan = _plan(manifest)
    typed: dict[int, torch.Tensor] = {}
    views: list[Sequence[torch.Tensor]] = []  # per run, in the manifest's column order
    # Creating 10^5 tensor objects would trigger full collections of every object the process
    # (torch included) holds, for nothing: views form no reference cycles.
    with gc_paused():
        for code, shape, strides, offset, step, count in plan:
            tb = typed.get(code)
            if tb is None:
                # Arena sizes are multiples of 256, so every itemsize divides them.
                tb = typed[code] = base.view(_torch_dtype(DTYPES[code]))
            if count == 1:
                views.append((tb.as_strided(shape, strides, offset),))
            else:
                views.append(tb.as_strided((count, *shape), (step, *strides), offset).unbind(0))
        return dict(zip(manifest.names, chain.from_iterable(views)))


def write_views(views: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy `tensors` into the arena's views of the same names (device to device on a GPU), each
    of the view's dtype and shape: a `copy_` would otherwise broadcast or convert without a word."""
    for name, t in tensors.items():
        view = _reserved(views, name)
        if t.dtype != view.dtype or t.shape != view.shape:
            raise BadRequest(f"tensor {name!r} is {t.dtype} {tuple(t.shape)}, reserved as {view.dtype} "
                             f"{tuple(view.shape)}")
        view.copy_(t, non_blocking=True)
    first = next(iter(views.values()), None)
    if tensors and first is not None and first.is_cuda:
        torch.cuda.synchronize(first.device)


def write_through_fd(fd: int, manifest: Manifest, tensors: Mapping[str, torch.Tensor]) -> None:
    """Write CPU `tensors` into a host arena's memfd at their offsets (pwrite), checked as
    `write_views` checks them: the arena is never mapped, so the kernel fills its pages without
    a fault each and there are no page tables to tear down before the seal."""
    at = {name: i for i, name in enumerate(manifest.names)}
    for name, t in tensors.items():
        i = _reserved(at, name)
        dtype, shape = _torch_dtype(DTYPES[manifest.dtype_codes[i]]), manifest.shapes[manifest.shape_ids[i]]
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise BadRequest(f"tensor {name!r} is {t.dtype} {tuple(t.shape)}, reserved as {dtype} {shape}")
        nbytes = manifest.sizes[i]
        if not nbytes:
            continue
        src = t.detach().resolve_conj().resolve_neg().contiguous()
        data = memoryview((ctypes.c_char * nbytes).from_address(src.data_ptr())).cast("B")
        done, offset = 0, manifest.offsets[i]
        while done < nbytes:  # one pwrite moves at most 2 GiB
            done += os.pwrite(fd, data[done:], offset + done)
        del data, src


def read_through_fd(fd: int, manifest: Manifest, into: Mapping[str, torch.Tensor]) -> None:
    """Read a host arena's tensors from its memfd into `into`'s contiguous CPU tensors of the
    same names (pread: one kernel copy each, and no mapping of the arena whose pages would each
    fault in, then be torn down). The caller has checked names, dtypes and shapes."""
    at = {name: i for i, name in enumerate(manifest.names)}
    for name, t in into.items():
        i, nbytes = at[name], t.numel() * t.element_size()
        if nbytes != manifest.sizes[i]:
            raise BadRequest(f"tensor {name!r} holds {nbytes} bytes, the arena's {manifest.sizes[i]}")
        if not nbytes:
            continue
        data = memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")
        done, offset = 0, manifest.offsets[i]
        while done < nbytes:
            got = os.preadv(fd, [data[done:]], offset + done)
            if got <= 0:
                raise BadRequest(f"the arena ends inside tensor {name!r}")
            done += got
        del data


def copy_all(into: Mapping[str, torch.Tensor], source: Mapping[str, torch.Tensor]) -> None:
    """`into[name].copy_(source[name])` for every name, as few calls as torch allows (one
    `_foreach_copy_` per device rather than a Python call and a launch per tensor)."""
    names = list(into)
    dst, src = [into[n] for n in names], [source[n] for n in names]
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is not None and dst:
        foreach(dst, src, non_blocking=True)
    else:
        for d, s in zip(dst, src):
            d.copy_(s, non_blocking=True)


def _reserved(reserved: Mapping[str, Any], name: str) -> Any:
    found = reserved.get(name)
    if found is None:
        raise BadRequest(f"{name!r} is not one of the reserved tensors: reserve it with the others")
    return found


_Run = tuple[int, tuple[int, ...], tuple[int, ...], int, int, int]


def _plan(manifest: Manifest) -> list[_Run]:
    """(dtype code, shape, strides, first offset and stride in elements, count) for each of the
    manifest's runs (validated by `Manifest.from_wire`), in column order: one Python step per run."""
    runs: list[_Run] = []
    at = 0
    for count in manifest.runs:
        code = manifest.dtype_codes[at]
        size = ITEMSIZES[code]
        shape = manifest.shapes[manifest.shape_ids[at]]
        step = (manifest.offsets[at + 1] - manifest.offsets[at]) // size if count > 1 else 0
        runs.append((code, shape, contiguous_strides(shape), manifest.offsets[at] // size, step, count))
        at += count
    return runs


def _torch_dtype(dtype: str) -> torch.dtype:
    dt = TORCH_DTYPES.get(dtype)
    if dt is None:
        raise BadRequest(f"dtype {dtype} is not available in this torch ({torch.__version__})")
    return dt


class MappedArena:
    """A client's mapping of one arena. Views keep the mapping alive; `close` drops our references."""

    def __init__(self, base: torch.Tensor, manifest: Manifest, keepalive: Any, kind: str = "host") -> None:
        self._kind = kind
        self.base = base
        self.manifest = manifest
        self.tensors = build_views(base, manifest)
        self._keepalive = keepalive

    def close(self) -> None:
        """Forget the views. Host memory is unmapped when the last view held elsewhere dies."""
        self._unmap(strict=False)

    def remap(self, arena: dict[str, Any], fd: int) -> None:
        """Put another arena of this layout (the next generation of a series) behind the same
        addresses: every view reads its bytes from then on. The caller keeps and closes `fd`.
        On failure nothing changed."""
        remap = getattr(self._keepalive, "remap", None)
        if remap is None:
            raise BadRequest("this mapping cannot be changed in place (acquired without follow)")
        if arena.get("kind") != self._kind:
            raise BadRequest(f"a {arena.get('kind')} arena cannot replace a {self._kind} one in place")
        remap(fd, int(arena["size"]))

    def unmap_writable(self) -> None:
        """Unmap a fill mapping now (needed before commit). Raises if views are still referenced."""
        self._unmap(strict=True)

    def _unmap(self, strict: bool) -> None:
        self.tensors = {}
        self.base = None  # type: ignore[assignment]
        keepalive, self._keepalive = self._keepalive, None
        if keepalive is None:
            return
        try:
            keepalive.close()
        except BufferError:  # an mmap whose views are still referenced: it unmaps when they die
            if not strict:
                return
            gc.collect()  # views caught in reference cycles are not really in use
            try:
                keepalive.close()
            except BufferError:
                self._keepalive = keepalive
                raise BadRequest(
                    "fill tensors are still referenced: drop every reference to fill.tensors before commit()"
                ) from None


class HostMapping:
    """A host arena mapped so that another arena of the same size can replace it in place
    (`remap`), mapped MAP_PRIVATE like read leases, at a 2 MiB boundary. The range is unmapped
    when the last tensor over it is freed.

    `remap` first moves the range's page tables out to a scratch range (`mremap` with
    MREMAP_DONTUNMAP: the range stays mapped to the old arena, empty, refaulting from its file),
    then maps the new arena over it (MAP_FIXED: the range is never unmapped). Tearing down the
    page tables of an arena the engine has read is the costly part of a swap (one entry per 4 KiB
    page); here it happens in a background thread (`_UNMAPPER`), off the swap. Where the move is
    refused (a kernel before 5.13, a range split by the engine's own mprotect/madvise), the
    MAP_FIXED alone swaps, tearing down in line."""

    def __init__(self, fd: int, size: int) -> None:
        self.size = size
        self._span = _pages(size)
        _check_size(fd, size)
        self.addr = _reserve(self._span)
        addr = _libc().mmap(ctypes.c_void_p(self.addr), size, mmap.PROT_READ | mmap.PROT_WRITE,
                            mmap.MAP_PRIVATE | _MAP_FIXED, fd, 0)
        if addr != self.addr:
            error = ctypes.get_errno()
            _munmap(self.addr, self._span)
            raise BadRequest(f"cannot map a host arena of {size} bytes: {os.strerror(error)}")
        memory = (ctypes.c_uint8 * size).from_address(self.addr)
        self._finalizer = weakref.finalize(memory, _munmap, self.addr, size)
        self._finalizer.atexit = False
        self._base: torch.Tensor | None = torch.frombuffer(memory, dtype=torch.uint8)
        self.moved = 0  # swaps whose page tables went to the background (the rest tore down in line)

    def take_base(self) -> torch.Tensor:
        base, self._base = self._base, None
        assert base is not None
        return base

    def remap(self, fd: int, size: int) -> None:
        if size != self.size:
            raise BadRequest(f"arena of {size} bytes cannot replace one of {self.size} in place")
        if not self._finalizer.alive:
            raise BadRequest("this host mapping is already unmapped")
        _check_size(fd, size)
        scratch = self._move_out()
        addr = _libc().mmap(ctypes.c_void_p(self.addr), size, mmap.PROT_READ | mmap.PROT_WRITE,
                            mmap.MAP_PRIVATE | _MAP_FIXED, fd, 0)
        error = ctypes.get_errno()
        if scratch is not None:
            _UNMAPPER.unmap(scratch, self._span)
        if addr != self.addr:  # Linux checks the file and the range before it unmaps anything
            raise BadRequest(f"cannot map the new arena in place: {os.strerror(error)}")
        self.moved += scratch is not None

    def _move_out(self) -> int | None:
        """Move the range's page tables to a fresh scratch range, leaving the range mapped to the
        same arena with none; the scratch range's address, or None where the kernel refuses."""
        try:
            scratch = _reserve(self._span)
        except BadRequest:
            return None
        got = _libc().mremap(ctypes.c_void_p(self.addr), self._span, self._span,
                             _MREMAP_MAYMOVE | _MREMAP_FIXED | _MREMAP_DONTUNMAP, ctypes.c_void_p(scratch))
        if got != scratch:
            _munmap(scratch, self._span)
            return None
        return scratch

    def close(self) -> None:
        self._base = None
        if self._finalizer.alive:
            raise BufferError("tensors over this host arena are still referenced; it unmaps when the last one dies")


class _Unmapper:
    """Unmaps what swaps moved out, in one background thread at the lowest CPU priority: the
    engine's next step, not the teardown of a generation it left, gets the cores."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: list[tuple[int, int]] = []
        self._busy = False
        self._pid = 0  # the process whose thread serves the queue (a fork's child starts its own)

    def unmap(self, addr: int, size: int) -> None:
        with self._cond:
            self._queue.append((addr, size))
            if self._pid != os.getpid():
                self._pid = os.getpid()
                threading.Thread(target=self._run, name="wcd-unmap", daemon=True).start()
            self._cond.notify()

    def wait_idle(self, timeout: float) -> bool:
        """Whether everything queued was unmapped within `timeout` seconds."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)

    def _run(self) -> None:
        with contextlib.suppress(OSError):  # a priority that cannot be lowered leaves it as it was
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        while True:
            with self._cond:
                self._busy = False
                self._cond.notify_all()
                self._cond.wait_for(lambda: bool(self._queue))
                addr, size = self._queue.pop(0)
                self._busy = True
            _munmap(addr, size)


_UNMAPPER = _Unmapper()
_MAP_FIXED = 0x10
_MAP_ANONYMOUS = 0x20
_MAP_NORESERVE = 0x4000
_MREMAP_MAYMOVE, _MREMAP_FIXED, _MREMAP_DONTUNMAP = 1, 2, 4
_PMD = 2 << 20  # a range at this boundary moves whole page tables (one entry each), not pages
_MAP_FAILED = ctypes.c_void_p(-1).value
_LIBC: ctypes.CDLL | None = None


def _libc() -> ctypes.CDLL:
    global _LIBC
    if _LIBC is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.mremap.restype = ctypes.c_void_p
        libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _LIBC = libc
    return _LIBC


def _pages(size: int) -> int:
    return -(-size // mmap.PAGESIZE) * mmap.PAGESIZE


def _reserve(span: int) -> int:
    """`span` bytes of address space at a 2 MiB boundary, reserved (no access, no memory)."""
    libc = _libc()
    raw = libc.mmap(None, span + _PMD, 0, mmap.MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
    if raw in (None, _MAP_FAILED):
        raise BadRequest(f"cannot reserve {span} bytes of address space: {os.strerror(ctypes.get_errno())}")
    start = -(-raw // _PMD) * _PMD
    if start > raw:
        _munmap(raw, start - raw)
    if raw + _PMD > start:
        _munmap(start + span, raw + _PMD - start)
    return start


def _munmap(addr: int, size: int) -> None:
    _libc().munmap(ctypes.c_void_p(addr), size)


def _check_size(fd: int, size: int) -> None:
    """A read lease's host arena must be a memfd of `size` bytes sealed against any change."""
    problem = memfd_problem(fd, size, SEALS)
    if problem:
        raise BadRequest(f"refusing to map the host arena: {problem} (the daemon or its publisher did not hand "
                         "out a sealed arena)")


def map_arena(arena: dict[str, Any], fd: int, manifest: Manifest, writable: bool,
              remappable: bool = False) -> MappedArena:
    """Map an exported arena fd. Takes ownership of `fd` (closed once mapped). `remappable`: map it
    so that `MappedArena.remap` can later put another arena of the layout in its place."""
    try:
        kind = arena.get("kind")
        size = int(arena["size"])
        if size < manifest.size:
            raise BadRequest(f"arena of {size} bytes is smaller than its manifest ({manifest.size})")
        if kind == "host" and remappable and not writable:
            host = HostMapping(fd, size)  # checks the seals as below
            return MappedArena(host.take_base(), manifest, host)
        if kind == "host":
            # Fill leases may still write; what a reader maps must not change or shrink under it.
            seals = SIZE_SEALS if writable else SEALS
            problem = memfd_problem(fd, size, seals)
            if problem:
                raise BadRequest(f"refusing to map the host arena: {problem} (the daemon or its publisher "
                                 "did not hand out a sealed arena)")
            flags = mmap.MAP_SHARED if writable else mmap.MAP_PRIVATE
            mm = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            # Through a memoryview, the views hold a buffer export on the mmap, so mm.close() refuses
            # (BufferError) while any view is alive instead of unmapping memory under it.
            base = torch.frombuffer(memoryview(mm), dtype=torch.uint8)
            return MappedArena(base, manifest, mm)
        if kind == "cuda":
            from wcd.arenas.cuda_map import map_cuda_arena

            base, mapping = map_cuda_arena(fd, size, str(arena["device"]), writable)
            return MappedArena(base, manifest, mapping, "cuda")
        raise BadRequest(f"unknown arena kind {kind!r}")
    finally:
        os.close(fd)
