"""`cached_fraction`: how much of a file the page cache holds, the loader's warm/cold decision."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from wcd.loader import cached_fraction


def test_a_file_just_read_is_cached_and_one_dropped_is_not(tmp_path: Path) -> None:
    path = tmp_path / "blob"
    path.write_bytes(os.urandom(8 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.pread(fd, 8 << 20, 0)
        assert cached_fraction(fd) == 1.0
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        dropped = cached_fraction(fd)
        if _fs_type(path) not in ("tmpfs", "ramfs"):  # those keep every page: nothing to drop
            assert dropped < 0.1
        os.pread(fd, 4 << 20, 0)  # the first half back (and whatever readahead adds)
        partly = cached_fraction(fd)
        assert 0.0 <= dropped <= partly <= 1.0
        assert partly >= 0.4  # sampled windows: about, not exactly, a half
    finally:
        os.close(fd)


def _fs_type(path: Path) -> str:
    """The file system type of the mount holding `path` (longest matching mount point)."""
    best, kind = "", ""
    with open("/proc/self/mounts") as mounts:
        for line in mounts:
            _, point, fstype, *_ = line.split()
            if (str(path).startswith(point.rstrip("/") + "/") or str(path) == point) and len(point) > len(best):
                best, kind = point, fstype
    return kind


def test_empty_and_tiny_files(tmp_path: Path) -> None:
    empty, tiny = tmp_path / "empty", tmp_path / "tiny"
    empty.write_bytes(b"")
    tiny.write_bytes(b"x" * 100)
    for p in (empty, tiny):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.pread(fd, 100, 0)
            assert cached_fraction(fd) == 1.0
        finally:
            os.close(fd)


def _two_shards(tmp_path: Path) -> Path:
    import torch
    from safetensors.torch import save_file

    d = tmp_path / "ckpt"
    d.mkdir()
    for i in range(2):
        save_file({f"t{i}.{j}": torch.full((1 << 18,), float(j)) for j in range(4)}, str(d / f"s{i}.safetensors"))
    return d


def test_read_ahead_asks_for_the_cold_shards_data_in_shard_order_up_to_its_budget(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from wcd.checkpoint import Checkpoint
    from wcd.loader import read_ahead

    asked: list[tuple[int, int, int, int]] = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, at, n, advice: asked.append((fd, at, n, advice)))
    with Checkpoint.open(_two_shards(tmp_path)) as ckpt:
        h0, h1 = ckpt.headers
        data0, data1 = h0.file_size - h0.data_start, h1.file_size - h1.data_start
        read_ahead(ckpt, [0.0, 0.0], data0 + 1000)  # all of the first, the start of the second
        assert asked == [(ckpt.fds[0], h0.data_start, data0, os.POSIX_FADV_WILLNEED),
                         (ckpt.fds[1], h1.data_start, 1000, os.POSIX_FADV_WILLNEED)]
        asked.clear()
        read_ahead(ckpt, [0.95, 0.3], data0)  # the first is warm: the budget goes to the second
        assert asked == [(ckpt.fds[1], h1.data_start, min(data0, data1), os.POSIX_FADV_WILLNEED)]
        asked.clear()
        read_ahead(ckpt, [0.0, 0.0], 0)  # a writer ready at once: nothing asked
        assert asked == []


def test_a_fill_reads_ahead_before_its_writer_starts_and_a_host_arena_never_does(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer of a GPU arena without lingering staging first creates a context and pins its
    buffers (~0.1 s): the read-ahead is asked for before, so the disk works meanwhile."""
    from wcd import loader
    from wcd.arenas.host import HostBackend
    from wcd.checkpoint import Checkpoint

    events: list[str] = []
    monkeypatch.setattr(os, "posix_fadvise", lambda *a: events.append("read-ahead") if a[3] == os.POSIX_FADV_WILLNEED
                        else None)
    monkeypatch.setattr(loader, "cached_fraction", lambda fd: 0.0)
    with Checkpoint.open(_two_shards(tmp_path)) as ckpt:
        manifest = ckpt.manifest()
        for budget in (0, 64 << 20):
            arena = HostBackend().create("cpu", manifest.size, "t")
            writer = arena.writer

            def starting(writer: Any = writer) -> Any:
                events.append("writer")
                return writer()

            monkeypatch.setattr(arena, "writer", starting)
            monkeypatch.setattr(arena, "read_ahead_bytes", lambda budget=budget: budget)
            events.clear()
            loader.fill_arena(arena, ckpt, manifest, mock.Mock())
            assert events == (["writer"] if budget == 0 else ["read-ahead", "read-ahead", "writer"]), budget
            arena.close()
        assert HostBackend().create("cpu", 4096, "u").read_ahead_bytes() == 0
