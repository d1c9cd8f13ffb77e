"""`cached_fraction`: how much of a file the page cache holds, the loader's warm/cold decision; and
`read_ahead`, which asks for a cold checkpoint's first bytes while the writer is being made."""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import wcd.loader
import wcd.pagecache
from wcd.arenas.host import HostArena
from wcd.checkpoint import Checkpoint
from wcd.loader import ADVICE_BYTES, Progress, fill_arena, read_ahead
from wcd.pagecache import cached_fraction, resident
from wcd.tuning import LoadTuning


@pytest.fixture
def blob(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """An 8 MiB file, written, synced and read whole (all of it in the page cache), and its fd."""
    path = tmp_path / "blob"
    path.write_bytes(os.urandom(8 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.pread(fd, 8 << 20, 0)
        yield path, fd
    finally:
        os.close(fd)


def test_a_file_just_read_is_cached_and_one_dropped_is_not(blob: tuple[Path, int]) -> None:
    path, fd = blob
    assert cached_fraction(fd) == 1.0
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    if _fs_type(path) not in ("tmpfs", "ramfs"):  # those keep every page: nothing to drop
        assert _dropped(fd, below=0.0) == 0.0
        assert cached_fraction(fd) == 0.0
    dropped = cached_fraction(fd)
    os.pread(fd, 4 << 20, 0)  # the first half back (and whatever readahead adds)
    partly = cached_fraction(fd)
    assert 0.0 <= dropped <= partly <= 1.0
    assert partly >= 0.4  # sampled windows: about, not exactly, a half


def test_resident_says_whether_every_page_of_a_range_is_cached(blob: tuple[Path, int]) -> None:
    path, fd = blob
    assert resident(fd, 0, 8 << 20) and resident(fd, 12345, 100_000) and resident(fd, 5, 0)
    if _fs_type(path) in ("tmpfs", "ramfs"):  # those keep every page: nothing to drop
        return
    assert _dropped(fd, below=0.0) == 0.0
    assert not resident(fd, 0, 8 << 20) and not resident(fd, 12345, 100_000)
    os.pread(fd, 1 << 20, 0)
    assert _dropped(fd, below=0.0, offset=4 << 20) == 0.0  # whatever readahead brought in beyond
    assert resident(fd, 4096 - 1, 1 << 19)  # unaligned ends, inside what was read
    assert not resident(fd, (1 << 20) - 10, 6 << 20)  # partly: not all of it
    assert not resident(fd, (4 << 20) + 4096, 4096)


def test_where_mincore_would_not_tell_pages_are_probed(blob: tuple[Path, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe agrees with mincore (which tells the file's owner the truth) on a file at rest:
    each state is first brought about and seen by mincore, then probed. The probe's own refused
    reads start page reads, so it is never what waits for a drop."""
    path, fd = blob

    def probed() -> float:
        with monkeypatch.context() as m:
            m.setattr(wcd.pagecache, "mincore_tells", lambda fd: False)
            return cached_fraction(fd)

    assert probed() == cached_fraction(fd) == 1.0
    with monkeypatch.context() as m:
        m.setattr(wcd.pagecache, "mincore_tells", lambda fd: False)
        assert not resident(fd, 0, 4096)  # cannot tell: O_DIRECT reads are right either way
    if _fs_type(path) in ("tmpfs", "ramfs"):
        return
    assert _dropped(fd, below=0.0) == 0.0
    assert probed() == 0.0
    half = 4 << 20
    os.pread(fd, half, 0)  # the first half back, then whatever readahead (or the probe) brought in past it dropped
    assert _dropped(fd, below=0.0, offset=half) == 0.0 and resident(fd, 0, half)
    truth = cached_fraction(fd)
    assert 0.4 <= truth <= 0.6 and probed() == pytest.approx(truth, abs=2 / 64)  # 64 pages probed, 64 windows seen


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to read a file as a user who may only read it")
def test_a_daemon_that_may_only_read_a_file_sees_it_cold(blob: tuple[Path, int]) -> None:
    """What the packaged daemon (User=wcd) sees of a model file it may only read: mincore says
    every page is cached (Linux 5.0+), so the loader probes instead and finds the file cold."""
    path, fd = blob
    if _fs_type(path) in ("tmpfs", "ramfs"):
        pytest.skip(f"{path}'s file system keeps every page: nothing to drop")
    assert _dropped(fd, below=0.02) <= 0.02  # the owner sees it cold
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: nobody, with the owner's fd
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            seen = (wcd.pagecache.mincore_tells(fd), cached_fraction(fd), resident(fd, 0, 4096))
            os.write(w, repr(seen).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as out:
        tells, fraction, cached = eval(out.read())  # noqa: S307 - our own child's repr of a tuple
    os.waitpid(pid, 0)
    assert not tells and fraction < 0.25 and not cached  # mincore would say 1.0


def _dropped(fd: int, below: float = 0.1, offset: int = 0) -> float:
    """Drop the file's pages from `offset` on from the page cache and say how much of the file's
    pages past `offset` is left there (mincore over them: the truth for the owner), once no more
    than `below` is. DONTNEED skips pages still queued for the LRU on other CPUs and pages being
    read, so it is tried again until the drop has happened (10 s at most: the test then fails)."""
    size = os.fstat(fd).st_size
    deadline = time.monotonic() + 10
    while True:
        os.posix_fadvise(fd, offset, 0, os.POSIX_FADV_DONTNEED)
        left = _mincore_fraction(fd, offset, size - offset)
        if left <= below or time.monotonic() > deadline:
            return left
        time.sleep(0.01)


def _mincore_fraction(fd: int, offset: int, nbytes: int) -> float:
    """The share of the pages of [offset, offset + nbytes) that mincore says are cached, page by page."""
    size = mmap.PAGESIZE
    pages = range(offset // size, -(-(offset + nbytes) // size))
    return sum(resident(fd, page * size, size) for page in pages) / len(pages)


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


def _shards(tmp_path: Path, sizes: list[int]) -> Path:
    """A checkpoint of one uint8 tensor per shard, `sizes` bytes each."""
    import torch
    from safetensors.torch import save_file

    d = tmp_path / "ckpt"
    d.mkdir()
    for i, n in enumerate(sizes):
        save_file({f"t{i}": torch.randint(0, 255, (n,), dtype=torch.uint8)}, str(d / f"m-{i}.safetensors"))
    return d


def test_read_ahead_asks_for_the_first_bytes_in_plan_order_and_skips_cached_shards(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[tuple[int, int, int]] = []  # (shard, offset, bytes)
    with Checkpoint.open(_shards(tmp_path, [3000, 5000, 7000])) as ckpt:
        shard = {fd: i for i, fd in enumerate(ckpt.fds)}
        monkeypatch.setattr(os, "posix_fadvise", lambda fd, at, n, advice: asked.append((shard[fd], at, n))
                            if advice == os.POSIX_FADV_WILLNEED else None)
        starts = [h.data_start for h in ckpt.headers]
        ranges: dict[int, tuple[int, int]] = {}
        read_ahead(ckpt, [0.0, 1.0, 0.3], 3000 + 5000 + 1234, asked=ranges)  # the second shard is all cached
        assert asked == [(0, starts[0], 3000), (2, starts[2], 1234)]
        fds = ckpt.fds  # what it says it asked for, per fd: what the writer may read from the page cache
        assert ranges == {fds[0]: (starts[0], starts[0] + 3000), fds[2]: (starts[2], starts[2] + 1234)}
        asked.clear()
        read_ahead(ckpt, [0.0, 0.0, 0.0], 2000)  # less than the first shard holds
        assert asked == [(0, starts[0], 2000)]
        asked.clear()
        read_ahead(ckpt, [1.0, 1.0, 1.0], 1 << 30)  # all cached: nothing to ask for
        assert asked == []


def test_read_ahead_asks_in_pieces_the_kernel_reads_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One WILLNEED reads at most one read-ahead window of what it asks for: 3 MiB are asked
    for in ADVICE_BYTES pieces, back to back."""
    asked: list[tuple[int, int]] = []
    with Checkpoint.open(_shards(tmp_path, [5 << 20])) as ckpt:
        monkeypatch.setattr(os, "posix_fadvise", lambda fd, at, n, advice: asked.append((at, n)))
        read_ahead(ckpt, [0.0], (3 << 20) + 1000)
        start = ckpt.headers[0].data_start
    assert all(0 < n <= ADVICE_BYTES for _, n in asked)
    assert [at for at, _ in asked] == [start + sum(n for _, n in asked[:i]) for i in range(len(asked))]
    assert sum(n for _, n in asked) == (3 << 20) + 1000


def test_read_ahead_brings_a_dropped_shard_back_into_the_page_cache(tmp_path: Path) -> None:
    """64 MiB, more than the kernel reads for one WILLNEED (8 MiB on the CI VM): read whole."""
    d = _shards(tmp_path, [64 << 20])
    if _fs_type(d) in ("tmpfs", "ramfs"):
        pytest.skip("tmpfs keeps every page: nothing is dropped to read back")
    with Checkpoint.open(d) as ckpt:
        fd = ckpt.fds[0]
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        dropped = cached_fraction(fd)
        assert dropped < 0.1
        read_ahead(ckpt, [dropped], 64 << 20)
        deadline = time.monotonic() + 5
        while cached_fraction(fd) < 0.9 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cached_fraction(fd) >= 0.9


def test_read_ahead_stops_when_told(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stop = threading.Event()
    asked: list[int] = []

    def advise(fd: int, at: int, n: int, advice: int) -> None:
        asked.append(at)
        if len(asked) == 3:
            stop.set()  # the writer is ready

    with Checkpoint.open(_shards(tmp_path, [5 << 20])) as ckpt:
        monkeypatch.setattr(os, "posix_fadvise", advise)
        read_ahead(ckpt, [0.0], 5 << 20, stop)
    assert len(asked) == 3


def test_fill_arena_reads_ahead_while_the_writer_is_made_and_stops_then_even_when_it_fails(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import wcd.loader

    events: list[str] = []

    def slow_read_ahead(ckpt: Checkpoint, cached: list[float], nbytes: int, stop: threading.Event,
                        asked: dict[int, tuple[int, int]]) -> None:
        events.append(f"ahead {nbytes} {cached}")
        events.append("ahead stopped" if stop.wait(5) else "ahead ran on")

    class NoWriter:
        tuning = LoadTuning(read_ahead_bytes=1 << 20)

        def writer(self) -> None:
            time.sleep(0.1)
            events.append("writer")
            raise RuntimeError("no writer")

    monkeypatch.setattr(wcd.loader, "read_ahead", slow_read_ahead)
    monkeypatch.setattr(wcd.loader, "cached_fraction", lambda fd: 0.0)
    with Checkpoint.open(_shards(tmp_path, [4096])) as ckpt:
        manifest = ckpt.manifest()
        with pytest.raises(RuntimeError, match="no writer"):
            fill_arena(NoWriter(), ckpt, manifest, Progress(ckpt.nbytes), reads_ahead=True)  # type: ignore[arg-type]
        # stopped and joined before fill_arena returned: the fds are the caller's to close
        assert events == ["ahead 1048576 [0.0]", "writer", "ahead stopped"]

        events.clear()  # all of it in the page cache, or no read-ahead asked for: no thread at all
        monkeypatch.setattr(wcd.loader, "cached_fraction", lambda fd: 1.0)
        with pytest.raises(RuntimeError, match="no writer"):
            fill_arena(NoWriter(), ckpt, manifest, Progress(ckpt.nbytes), reads_ahead=True)  # type: ignore[arg-type]
        monkeypatch.setattr(wcd.loader, "cached_fraction", lambda fd: 0.0)
        with pytest.raises(RuntimeError, match="no writer"):
            fill_arena(NoWriter(), ckpt, manifest, Progress(ckpt.nbytes))  # type: ignore[arg-type]
        assert events == ["writer", "writer"]


def test_fill_arena_tells_the_writer_what_it_read_ahead(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The range read ahead reaches the writer's `hint` once the read-ahead has stopped (an
    O_DIRECT writer reads those ops from the page cache)."""
    import wcd.loader

    hints: list[tuple[int, float, tuple[int, int] | None]] = []

    def quick_read_ahead(ckpt: Checkpoint, cached: list[float], nbytes: int, stop: threading.Event,
                         asked: dict[int, tuple[int, int]]) -> None:
        asked[ckpt.fds[0]] = (ckpt.headers[0].data_start, ckpt.headers[0].data_start + 512)

    class Recording:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def hint(self, fd: int, fraction: float, read_ahead: tuple[int, int] | None = None) -> None:
            hints.append((fd, fraction, read_ahead))
            self.inner.hint(fd, fraction, read_ahead)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    class Recorded(HostArena):
        def writer(self) -> Any:
            return Recording(super().writer())

    monkeypatch.setattr(wcd.loader, "read_ahead", quick_read_ahead)
    monkeypatch.setattr(wcd.loader, "cached_fraction", lambda fd: 0.0)
    with Checkpoint.open(_shards(tmp_path, [4096, 4096])) as ckpt:
        manifest = ckpt.manifest()
        arena = Recorded(manifest.size, "hints")
        try:
            fill_arena(arena, ckpt, manifest, Progress(ckpt.nbytes), reads_ahead=True)
        finally:
            arena.close()
        start = ckpt.headers[0].data_start
        assert hints == [(ckpt.fds[0], 0.0, (start, start + 512)), (ckpt.fds[1], 0.0, None)]


def test_a_host_fill_with_read_ahead_lands_every_byte(tmp_path: Path) -> None:
    with Checkpoint.open(_shards(tmp_path, [3 << 20, 1 << 20, 5000])) as ckpt:
        for fd in ckpt.fds:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        manifest = ckpt.manifest()
        arena = HostArena(manifest.size, "read-ahead-test")
        try:
            fill_arena(arena, ckpt, manifest, Progress(ckpt.nbytes), reads_ahead=True)
            arena.seal()
            for h, fd in zip(ckpt.headers, ckpt.fds):
                for name, begin, size in zip(h.names, h.begins, h.sizes):
                    at = manifest.offsets[manifest.names.index(name)]
                    assert arena.read(at, size) == os.pread(fd, size, h.data_start + begin)
        finally:
            arena.close()
