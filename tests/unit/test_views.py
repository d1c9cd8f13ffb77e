"""Tensor views over an arena: the batched builder gives exactly the views one `as_strided` per
tensor would, whatever the layout (runs, interleaved shapes, gaps, scalars, zero-size tensors)."""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import struct
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from wcd import views
from wcd.arenas.base import SEALS, SIZE_SEALS
from wcd.errors import WcdError
from wcd.manifest import ALIGN, DTYPES, Manifest
from wcd.views import _UNMAPPER, TORCH_DTYPES, HostMapping, build_views, map_arena

SETTINGS = settings(max_examples=80, deadline=None)


def reference_views(base: torch.Tensor, m: Manifest) -> dict[str, torch.Tensor]:
    out = {}
    for t in m.tensors:
        typed = base.view(TORCH_DTYPES[t.dtype])
        out[t.name] = typed.as_strided(t.shape, t.strides, t.offset // typed.element_size())
    return out


def check(base: torch.Tensor, m: Manifest) -> None:
    got, want = build_views(base, m), reference_views(base, m)
    assert list(got) == list(want) == list(m.names)  # manifest order
    for name, w in want.items():
        g = got[name]
        assert (g.dtype, g.shape, g.stride(), g.data_ptr()) == (w.dtype, w.shape, w.stride(), w.data_ptr()), name
        assert g.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


_dtypes = st.sampled_from(["BF16", "F32", "U8", "I64", "F8_E4M3"])
_shapes = st.sampled_from([(), (0,), (3,), (2, 5), (4, 0, 2), (7, 3)])


@SETTINGS
@given(layout=st.lists(st.tuples(_dtypes, _shapes), max_size=40))
def test_batched_views_equal_per_tensor_views(layout: list[tuple[str, tuple[int, ...]]]) -> None:
    m = Manifest.build((f"t{i}", d, s) for i, (d, s) in enumerate(layout))
    base = torch.arange(m.size, dtype=torch.int64).to(torch.uint8)
    check(base, m)
    g = Manifest.from_wire(m.wire())  # in runs, as the daemon sends it
    check(base, g)
    check(base, g)  # the second build reuses the cached plan


@SETTINGS
@given(rows=st.lists(st.tuples(_dtypes, _shapes, st.integers(0, 60)), max_size=30, unique_by=lambda r: r[2]))
def test_batched_views_in_any_offset_order(rows: list[tuple[str, tuple[int, ...], int]]) -> None:
    """Offsets out of order and with gaps (a v2 manifest from the wire may have any order)."""
    size = 64 * ALIGN * 8
    wire: dict[str, Any] = {
        "size": size, "names": "\0".join(f"t{i}" for i in range(len(rows))),
        "dtypes": bytes(DTYPES.index(d) for d, _, _ in rows), "shape_ndims": bytes(len(s) for _, s, _ in rows),
        "shape_dims": struct.pack(f"<{sum(len(s) for _, s, _ in rows)}Q", *(x for _, s, _ in rows for x in s)),
        "shape_ids": struct.pack(f"<{len(rows)}I", *range(len(rows))),
        "offsets": struct.pack(f"<{len(rows)}Q", *(k * 8 * ALIGN for _, _, k in rows)),
        "runs": struct.pack(f"<{len(rows)}I", *[1] * len(rows)),
    }
    m = Manifest.from_wire(wire)
    check(torch.zeros(size, dtype=torch.uint8), m)


def test_long_runs_come_from_few_calls() -> None:
    """100 layers x (a, b, c) with two shapes interleaved: the plan has a handful of runs."""
    layout = []
    for i in range(100):
        layout += [(f"l{i}.a", "BF16", (16, 8)), (f"l{i}.b", "BF16", (8, 16)), (f"l{i}.c", "F32", (4,))]
    m = Manifest.from_wire(Manifest.build(layout).wire())
    base = torch.zeros(m.size, dtype=torch.uint8)
    check(base, m)
    assert m.view_plan is not None and len(m.view_plan) == 3


def test_views_are_writable_through_to_the_base() -> None:
    m = Manifest.build([("a", "F32", (2, 2)), ("b", "F32", (2, 2)), ("c", "I64", ())])
    base = torch.zeros(m.size, dtype=torch.uint8)
    views = build_views(base, m)
    views["b"].fill_(1.5)
    views["c"].fill_(-7)
    assert torch.equal(base.view(torch.float32)[64:68], torch.full((4,), 1.5))
    assert reference_views(base, m)["c"].item() == -7 and views["a"].sum().item() == 0


def _memfd(size: int, seals: int) -> int:
    fd = os.memfd_create("test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


@pytest.mark.parametrize(("seals", "size", "writable", "refused"), [
    (0, 4096, False, "F_SEAL_WRITE, F_SEAL_GROW, F_SEAL_SHRINK, F_SEAL_SEAL"),
    (SIZE_SEALS, 4096, False, "F_SEAL_WRITE, F_SEAL_SEAL"),  # a fill arena handed out as a read lease
    (0, 4096, True, "F_SEAL_GROW, F_SEAL_SHRINK"),  # a fill arena whose holder could shrink it under us
    (SEALS, 8192, False, "holds 8192 bytes, the arena 4096"),
    (SEALS, 4096, False, None),
    (SIZE_SEALS, 4096, True, None),
])
def test_host_arenas_are_mapped_only_when_sealed_as_they_must_be(seals: int, size: int, writable: bool,
                                                                 refused: str | None) -> None:
    """A host arena whose memfd could shrink under the mapping (SIGBUS), or a read lease's whose
    bytes could still change, is refused before it is mapped; the fd is closed either way."""
    m = Manifest.build([("w", "U8", (16,))])
    fd = _memfd(size, seals)
    probe = os.dup(fd)
    try:
        if refused is None:
            mapped = map_arena({"kind": "host", "size": 4096}, fd, m, writable)
            assert mapped.tensors["w"].numel() == 16
            mapped.close()
        else:
            with pytest.raises(WcdError, match="refusing to map the host arena") as e:
                map_arena({"kind": "host", "size": 4096}, fd, m, writable)
            assert refused in e.value.message
        with pytest.raises(OSError):
            os.fstat(fd)  # map_arena took ownership
    finally:
        os.close(probe)


def _generation(name: str, value: int, size: int) -> int:
    """A sealed memfd of `size` bytes, every byte `value`, named so /proc/self/maps shows it."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    os.pwrite(fd, bytes([value]) * size, 0)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    return fd


def _mapped(name: str) -> int:
    """How many ranges of this process map the memfd called `name`."""
    with open("/proc/self/maps") as maps:
        return sum(f"/memfd:{name} " in line for line in maps)


SWAP_SIZE = 8 << 20  # four page tables' worth: the move takes whole tables


def test_a_host_swap_moves_the_old_page_tables_out_and_unmaps_them_in_the_background() -> None:
    """The swap maps the new generation over the same range without tearing down the old one's
    page tables there (they move out, to be unmapped by the background thread): the views read
    the new bytes at once, and the old generation is mapped nowhere once the thread is done."""
    old, new = f"gen1-{os.getpid()}", f"gen2-{os.getpid()}"
    fds = [_generation(old, 1, SWAP_SIZE), _generation(new, 2, SWAP_SIZE)]
    try:
        host = HostMapping(fds[0], SWAP_SIZE)
        base = host.take_base()
        assert host.addr % (2 << 20) == 0  # whole page tables can move
        assert int(base[::4096].sum()) == SWAP_SIZE // 4096  # every page read: its tables are full
        assert _UNMAPPER.wait_idle(10)
        host.remap(fds[1], SWAP_SIZE)
        assert host.moved == 1 and base.data_ptr() == host.addr
        assert int(base[::4096].sum()) == 2 * (SWAP_SIZE // 4096) and int(base[-1]) == 2
        assert _UNMAPPER.wait_idle(10)
        assert _mapped(old) == 0 and _mapped(new) == 1
        host.remap(fds[0], SWAP_SIZE)  # and back: a rollback is the same step
        assert host.moved == 2 and int(base[::4096].sum()) == SWAP_SIZE // 4096
        assert _UNMAPPER.wait_idle(10) and _mapped(new) == 0
    finally:
        for fd in fds:
            os.close(fd)


def test_a_host_range_the_kernel_cannot_move_is_swapped_in_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the kernel refuses the move (before 5.13 MREMAP_DONTUNMAP takes anonymous memory
    only; before 6.17 no range the engine split with mprotect), MAP_FIXED alone replaces all of
    the range, split or not."""
    fds = [_generation(f"split1-{os.getpid()}", 1, SWAP_SIZE), _generation(f"split2-{os.getpid()}", 2, SWAP_SIZE)]
    real = views._libc()

    class Refusing:
        mmap, munmap = real.mmap, real.munmap

        @staticmethod
        def mremap(*args: Any) -> Any:
            ctypes.set_errno(22)
            return views._MAP_FAILED

    try:
        host = HostMapping(fds[0], SWAP_SIZE)
        base = host.take_base()
        assert real.mprotect(ctypes.c_void_p(host.addr), 4096, mmap.PROT_READ) == 0
        monkeypatch.setattr(views, "_libc", lambda: Refusing)
        host.remap(fds[1], SWAP_SIZE)
        assert host.moved == 0
        assert int(base[::4096].sum()) == 2 * (SWAP_SIZE // 4096)
        base[0] = 7  # writable again, as the whole new range is (MAP_PRIVATE: the arena is untouched)
        assert os.pread(fds[1], 1, 0) == b"\x02"
    finally:
        for fd in fds:
            os.close(fd)


def test_a_host_swap_that_fails_after_the_move_leaves_the_old_generation_whole(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The move leaves the range mapped to the old generation: if mapping the new one then fails,
    the views still read every old byte (refaulted from its memfd) and nothing is left mapped."""
    name = f"keep1-{os.getpid()}"
    fds = [_generation(name, 1, SWAP_SIZE), _generation(f"keep2-{os.getpid()}", 2, SWAP_SIZE)]
    try:
        host = HostMapping(fds[0], SWAP_SIZE)
        base = host.take_base()
        assert int(base[::4096].sum()) == SWAP_SIZE // 4096
        real = views._libc()

        class Failing:
            mremap, munmap = real.mremap, real.munmap

            @staticmethod
            def mmap(*args: Any) -> Any:
                if args[0] is not None and args[3] & views._MAP_FIXED:
                    ctypes.set_errno(12)
                    return views._MAP_FAILED
                return real.mmap(*args)

        monkeypatch.setattr(views, "_libc", lambda: Failing)
        with pytest.raises(WcdError, match="cannot map the new arena in place"):
            host.remap(fds[1], SWAP_SIZE)
        assert int(base[::4096].sum()) == SWAP_SIZE // 4096 and int(base[-1]) == 1
        assert _UNMAPPER.wait_idle(10) and _mapped(name) == 1  # the range itself; the moved tables are gone
    finally:
        for fd in fds:
            os.close(fd)
