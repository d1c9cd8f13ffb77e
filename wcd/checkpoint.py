"""safetensors checkpoints: finding and opening shards (guarded against planted links), their
headers together (`Shards`, `wcd.headers` parses each), what must not change while a load reads
them, and planning reads (`CopyOp`, `Run`).

A checkpoint is one `.safetensors` file or a directory of them. Nothing here knows about arenas.
"""

from __future__ import annotations

import errno
import os
import stat
from array import array
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain, compress, islice, pairwise, repeat
from operator import ge, ne, sub
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wcd.errors import LoadFailed
from wcd.headers import Columns, Header, NameCheck, header_from, read_raw_header
from wcd.manifest import (
    ALIGN,
    Manifest,
    _le_bytes,
    names_valid,
)
from wcd.peers import user_gids
from wcd.tuning import DEFAULT

if TYPE_CHECKING:
    from wcd.header_helpers import HeaderHelpers

SAMPLE_BYTES = 4096
SAMPLES_PER_FILE = 64
BATCH_BYTES = 4 << 20  # one staging buffer
MAX_PIECES = 1024  # IOV_MAX: one preadv scatters a run


# A run of pieces in a `CopyOp`: (arena offset relative to the op's, width, stride, count): `count`
# tensors of `width` bytes each, back to back in the file, the k-th at `offset + k * stride` in the
# arena (stride: the width rounded up to the layout's alignment, so never 0).
Run = tuple[int, int, int, int]


@dataclass(frozen=True, slots=True)
class CopyOp:
    """Fill `nbytes` of the arena at `arena_offset` from shard number `shard` at `file_offset`.

    Without `runs`, the file range has the same length. With them, the file range is contiguous
    and `file_nbytes` long, and lands in the pieces of the runs, in order; the arena bytes between
    pieces (alignment padding) are left undefined. A run of equal tensors at one stride (experts of
    one shape, say) is one item however many tensors it holds, so writers can move it in one step.
    """

    shard: int
    file_offset: int
    arena_offset: int
    nbytes: int
    runs: tuple[Run, ...] = ()

    @property
    def pieces(self) -> tuple[tuple[int, int], ...]:
        """The runs' pieces, one (arena offset relative to `arena_offset`, length) per tensor."""
        return tuple(piece for run in self.runs for piece in run_pieces(run))

    @property
    def file_nbytes(self) -> int:
        return sum(width * count for _, width, _, count in self.runs) if self.runs else self.nbytes


def run_pieces(run: Run) -> zip[tuple[int, int]]:
    """(relative arena offset, length) of each piece of `run`."""
    rel, width, stride, count = run
    return zip(range(rel, rel + stride * count, stride), repeat(width, count))


def _runs(sizes: list[int], ats: Sequence[int], s: int, j: int, one_size: bool = False) -> tuple[Run, ...]:
    """The tensors `s:j` (back to back in the file, at increasing aligned offsets `ats` that do not
    overlap) as maximal runs. Where equal sizes run from `a` to `b`, every step between offsets is
    a multiple of 256 at least the size, that is at least the stride: so they are all the stride
    when the ends are that many strides apart, and the run is checked in O(1). `one_size`: the
    caller knows that every size is the same."""
    base, size = ats[s], sizes[s]
    if one_size or sizes[s:j].count(size) == j - s:  # the common case: all one size (experts of one shape)
        firsts = [s, j]
    else:
        firsts = [s, *compress(range(s + 1, j), map(ne, sizes[s + 1 : j], sizes[s : j - 1])), j]
    runs: list[Run] = []
    for a, b in zip(firsts, firsts[1:]):
        size = sizes[a]
        stride = (size + ALIGN - 1) & -ALIGN
        if ats[b - 1] - ats[a] != stride * (b - 1 - a):  # padding between some (not `manifest`'s layout)
            steps = compress(range(a + 1, b), map(ne, map(sub, ats[a + 1 : b], ats[a : b - 1]), repeat(stride)))
            for c, d in pairwise([a, *steps, b]):
                runs.append((ats[c] - base, size, stride, d - c))
            continue
        runs.append((ats[a] - base, size, stride, b - a))
    return tuple(runs)


@dataclass(frozen=True, slots=True)
class FileState:
    """What must not change while a load reads a file: which file it is, its size and its times."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, fd: int) -> FileState:
        st = os.fstat(fd)
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


_OPEN = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK  # O_NONBLOCK: a planted FIFO must not hang the open
_RESOLVE_BENEATH, _RESOLVE_NO_MAGICLINKS = 0x08, 0x02
_SYS_OPENAT2 = 437  # x86_64 and aarch64 alike


def _openat2_beneath(dir_fd: int, name: str) -> int:
    """openat2(2) with RESOLVE_BENEATH: follow links only while they stay inside `dir_fd`, atomically.
    Raises OSError (EXDEV: a link leads out; ENOSYS: a kernel older than 5.6)."""
    import ctypes  # only when a shard is a link

    class OpenHow(ctypes.Structure):
        _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]

    libc = ctypes.CDLL(None, use_errno=True)
    how = OpenHow(_OPEN, 0, _RESOLVE_BENEATH | _RESOLVE_NO_MAGICLINKS)
    fd = libc.syscall(_SYS_OPENAT2, dir_fd, os.fsencode(name), ctypes.byref(how), ctypes.sizeof(how))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(fd)


def _open_shard(dir_fd: int, name: str, where: Path, follow_links: bool) -> int:
    """Open one shard of the directory `dir_fd` without following links out of it (unless allowed)."""
    try:
        return os.open(name, _OPEN | os.O_NOFOLLOW, dir_fd=dir_fd)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
    if follow_links:
        return os.open(name, _OPEN, dir_fd=dir_fd)
    try:
        return _openat2_beneath(dir_fd, name)
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.EACCES):
            raise
    raise LoadFailed(f"{where / name}: a symbolic link out of the model directory: refusing to follow it "
                     "(set follow_symlinks = true for this model if the link is meant)")


def _owner_may_read(file: Path, st: os.stat_result, owner: os.stat_result) -> None:
    """Refuse a file that the owner of its directory could not read: the daemon may have more rights
    than whoever put the file there (a hard link to a root-only file, say)."""
    uid = owner.st_uid
    if uid in (0, os.geteuid()):
        return
    if st.st_uid == uid:
        ok = st.st_mode & stat.S_IRUSR
    elif st.st_gid in (user_gids(uid) or {owner.st_gid}):
        ok = st.st_mode & stat.S_IRGRP
    else:
        ok = st.st_mode & stat.S_IROTH
    if not ok:
        raise LoadFailed(f"{file}: the owner of its directory (uid {uid}) may not read it, so neither will the "
                         "daemon (give the file to that user, or make it readable)")


def open_files(path: Path, follow_links: bool = False, owner_check: bool = True) -> list[tuple[Path, int]]:
    """(file, open fd) of every shard of `path`, sorted by name; links are not followed out of the
    directory unless `follow_links`. The caller owns the fds."""
    try:
        top = os.open(path, _OPEN | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise LoadFailed(f"{path}: no such file or directory") from None
    except OSError as e:
        raise LoadFailed(f"{path}: cannot read: {e.strerror}") from None
    opened: list[tuple[Path, int]] = []
    try:
        st = os.fstat(top)
        if stat.S_ISREG(st.st_mode):
            if owner_check:
                _owner_may_read(path, st, os.stat(path.parent))
            opened.append((path, os.dup(top)))
            return opened
        if not stat.S_ISDIR(st.st_mode):
            raise LoadFailed(f"{path}: not a file or a directory")
        for name in sorted(n for n in os.listdir(top) if n.endswith(".safetensors")):
            fd = _open_shard(top, name, path, follow_links)
            opened.append((path / name, fd))
            fst = os.fstat(fd)
            if not stat.S_ISREG(fst.st_mode):
                os.close(opened.pop()[1])  # a directory or device named *.safetensors: not a shard
                continue
            if owner_check:
                _owner_may_read(path / name, fst, st)
        if not opened:
            raise LoadFailed(f"{path}: no .safetensors files in this directory")
        return opened
    except BaseException as e:
        for _, fd in opened:
            os.close(fd)
        if isinstance(e, OSError):
            raise LoadFailed(f"{path}: cannot read: {e.strerror}") from None
        raise
    finally:
        os.close(top)


class Shards:
    """A checkpoint's shards, open, and their raw headers read but not parsed (`Checkpoint.open`
    in two steps): what the fingerprint reads (`key.first_fingerprint`) while `parse` runs. Until a
    parse succeeds, `close` is the caller's (another thread may still read the descriptors)."""

    def __init__(self, path: Path, files: list[tuple[Path, int]], raws: list[tuple[bytes, int, int]]) -> None:
        self.path, self.files, self.raws = path, files, raws  # raws: (raw header, data start, file size)

    @classmethod
    def open(cls, path: str | os.PathLike[str], follow_links: bool = False, owner_check: bool = True) -> Shards:
        """Open every shard of `path` and read its raw header (see `Checkpoint.open`). A shard that
        cannot be read raises its error after those of the shards before it that are not valid, as
        a parse shard by shard would (they are parsed then, to find out)."""
        p = Path(path).resolve()
        files = open_files(p, follow_links, owner_check)
        try:
            raws = []
            for file, fd in files:
                try:
                    raws.append(read_raw_header(fd, file))
                except LoadFailed:  # the first bad shard's error
                    for (before, _), raw in zip(files, raws):
                        header_from(before, *raw)
                    raise
            return cls(p, files, raws)
        except BaseException:
            for _, fd in files:
                os.close(fd)
            raise

    def parse(self, helpers: HeaderHelpers | None = None) -> Checkpoint:
        """The checkpoint of these shards, their headers parsed (by `helpers` too, if given), and
        owning their descriptors; a shard that is not valid raises its LoadFailed (nothing closed).
        With helpers, each header that comes back is made a `Header`, and each piece's names are
        added to the check that no name is in two places, while the helpers still parse the rest."""
        files, raws = self.files, self.raws
        helped = 0
        parsed: list[Header | None] = [None] * len(files)
        names = NameCheck() if len(files) > 1 or helpers is not None else None

        def landed(k: int, columns: Columns | None = None) -> None:
            h = parsed[k] = header_from(files[k][0], *raws[k], columns)
            if columns is None and names is not None:  # the helpers' are added as they come
                names.add(h.names)

        if helpers is not None:
            helped = helpers.columns([(raw, size - start) for raw, start, size in raws], landed, names)[1]
        for k, h in enumerate(parsed):
            if h is None:  # not parsed by the helpers (or none): here, in order
                landed(k)
        headers = tuple(h for h in parsed if h is not None)
        if names is not None and not names.distinct:
            # A header merged from pieces (`merge_columns`) may hold a name twice, which one parse
            # reads as one tensor (the last value at the first place): those are parsed whole here.
            again = [len(set(h.names)) != len(h.names) for h in headers]
            headers = tuple(header_from(file, *raw) if redo else h
                            for (file, _), raw, h, redo in zip(files, raws, headers, again))
            helped -= min(helped, sum(again))
            if not _distinct(headers):
                seen: set[str] = set()
                for name in chain.from_iterable(h.names for h in headers):  # the first duplicate, in load order
                    if name in seen:
                        raise LoadFailed(f"{self.path}: tensor {name!r} appears in more than one shard")
                    seen.add(name)
        ckpt = Checkpoint(self.path, headers, tuple(fd for _, fd in files), unique=True)
        ckpt.helped = helped
        return ckpt

    def close(self) -> None:
        files, self.files = self.files, []
        for _, fd in files:
            os.close(fd)


def _distinct(headers: Sequence[Header]) -> bool:
    """No tensor name in two places."""
    return len(set(chain.from_iterable(h.names for h in headers))) == sum(len(h.names) for h in headers)


class Checkpoint:
    """All shards of one checkpoint, open: their headers, and how they map onto an arena.

    Each shard is opened once (`open`) and everything after (fingerprint, fill, digest) reads
    through these descriptors, so a file swapped or re-linked by path after the open is never
    read. `changed` tells whether an open file was written since. Close it (or use `with`).
    `fingerprinted` is `key.fingerprint`'s memo: the fingerprint and, per shard, the hash's state
    before its samples and its digest after them.
    """

    def __init__(self, path: Path, headers: tuple[Header, ...], fds: tuple[int, ...], unique: bool = False) -> None:
        """`unique`: the caller checked that no name is in two shards (`open` does)."""
        self.path = path
        self.headers = headers
        self.fds = fds
        self.opened = tuple(FileState.of(fd) for fd in fds)
        self._unique = unique or len(headers) < 2  # one header's names are a dict's keys
        self.helped = 0  # headers parsed by header helpers (`open`)
        self.fingerprinted: tuple[str, tuple[tuple[Any, bytes], ...]] | None = None

    @classmethod
    def open(cls, path: str | os.PathLike[str], follow_links: bool = False, owner_check: bool = True,
             helpers: HeaderHelpers | None = None) -> Checkpoint:
        """Open every shard of `path` (a file or a directory of shards) and parse its header.

        Symbolic links to shards are followed only while they stay inside the directory, unless
        `follow_links`; with `owner_check`, a file the directory's owner could not read is refused.
        `helpers` parse large headers in other processes, beside each other (the same outcome).
        """
        shards = Shards.open(path, follow_links, owner_check)
        try:
            return shards.parse(helpers)
        except BaseException:
            shards.close()
            raise

    def close(self) -> None:
        fds, self.fds = self.fds, ()
        for fd in fds:
            os.close(fd)

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def changed(self) -> list[Path]:
        """Shards whose size, times or identity differ from when they were opened."""
        return [h.file for h, fd, was in zip(self.headers, self.fds, self.opened) if FileState.of(fd) != was]

    def manifest(self) -> Manifest:
        """Arena layout: shards in name order, tensors in file order (sequential reads)."""
        headers = self.headers
        index: dict[tuple[int, ...], int] = {}  # the checkpoint's distinct shapes
        ids = array("I")
        for h in headers:
            local = [index.setdefault(s, len(index)) for s in h.shapes]
            ids.extend(h.shape_ids if local == list(range(len(local))) else map(local.__getitem__, h.shape_ids))
        checked = all(names_valid(h.names) for h in headers if not h.names_checked)
        return Manifest.from_columns(tuple(chain.from_iterable(h.names for h in headers)),
                                     b"".join(h.dtype_codes for h in headers), tuple(index), ids,
                                     list(chain.from_iterable(h.sizes for h in headers)), unique=self._unique,
                                     checked=checked)

    def copy_plan(self, manifest: Manifest, chunk: int | None = None,
                  batch: int | Sequence[int] = BATCH_BYTES) -> list[CopyOp]:
        """Reads that fill an arena of `manifest`, in file order.

        `batch` is one for all shards or one per shard (the writer reads cold files in larger pieces).
        Tensors of at least `batch` bytes become direct copies, split into `chunk`-byte pieces
        (`LoadTuning.chunk_bytes` unless given): the loader threads take ops in file order, so a
        large tensor's pieces are read by several threads at once, each piece front to back.
        Runs of smaller tensors that lie back to back in the file become one op each, of at most
        `batch` arena bytes and `MAX_PIECES` tensors: one read of the whole file range, scattered
        into the arena layout (which pads each tensor to 256 bytes), and few writes. An op's tensors
        are described as runs of equal tensors at one stride (`Run`): 100,000 16,000-byte tensors
        make ~400 ops of one run each. The plan is found with C-level passes over the columns and
        a Python step per op and per run.
        """
        chunk = chunk or DEFAULT.chunk_bytes
        offsets = manifest.offsets  # the manifest lists tensors in this very order (`manifest`)
        if len(offsets) != sum(len(h.names) for h in self.headers):
            raise ValueError("copy_plan needs the manifest of this checkpoint")
        if any(_le_bytes(offsets)[0::8]):  # 256 = 2**8: aligned offsets have a zero low byte
            raise ValueError("copy_plan needs a manifest of aligned offsets")
        ops: list[CopyOp] = []
        batches = [batch] * len(self.headers) if isinstance(batch, int) else list(batch)
        if len(batches) != len(self.headers):
            raise ValueError("copy_plan needs one batch size per shard")
        i = 0
        for shard, h in enumerate(self.headers):
            batch = batches[shard]
            n = len(h.names)
            begins, ends, sizes = h.begins, h.ends, h.sizes
            ats: Sequence[int] = offsets[i : i + n]
            i += n
            if 0 in sizes:  # zero-size tensors need no read and break no run
                begins, ends, ats, sizes = (list(compress(c, h.sizes)) for c in (begins, ends, ats, sizes))
            m, start = len(sizes), h.data_start
            one_size = bool(sizes) and sizes.count(sizes[0]) == m  # experts of one shape: one C-level pass
            # Runs break where the file has a gap and around tensors of `batch` bytes or more.
            big = list(compress(range(m), map(ge, sizes, repeat(batch)))) if m and max(sizes) >= batch else []
            gaps = () if h.contiguous or begins[1:] == ends[:-1] else \
                compress(range(1, m), map(ne, islice(begins, 1, None), ends))
            cuts = sorted({0, m, *gaps, *big, *(k + 1 for k in big)})
            for s, e in zip(cuts, cuts[1:]):
                if sizes[s] >= batch:
                    at, size, first = ats[s], sizes[s], start + begins[s]
                    ops.extend(CopyOp(shard, first + pos, at + pos, min(chunk, size - pos))
                               for pos in range(0, size, chunk))
                    continue
                while s < e:  # greedy: as many tensors as `batch` arena bytes and MAX_PIECES allow
                    # Offsets increase with the file's (the layout follows it), so the tensors that
                    # end within `batch` are those that start within it, but perhaps the last.
                    base = ats[s]
                    j = min(bisect_right(ats, base + batch, s, e), s + MAX_PIECES)
                    if ats[j - 1] + sizes[j - 1] - base > batch:
                        j -= 1
                    span = ats[j - 1] + sizes[j - 1] - base
                    runs = () if span == ends[j - 1] - begins[s] else _runs(sizes, ats, s, j, one_size)
                    ops.append(CopyOp(shard, start + begins[s], base, span, runs))
                    s = j
        return ops

    @property
    def nbytes(self) -> int:
        return sum(sum(h.sizes) for h in self.headers)
