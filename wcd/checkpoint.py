"""safetensors checkpoints: finding shards, parsing and validating headers, planning reads.

A checkpoint is one `.safetensors` file or a directory of them. The safetensors package does
not expose data offsets, and the daemon must not import torch, so the (tiny, documented)
header format is parsed here with strict bounds. Nothing here knows about arenas.
"""

from __future__ import annotations

import errno
import json
import os
import pwd
import stat
from dataclasses import dataclass
from pathlib import Path

from wcd.errors import LoadFailed, WcdError
from wcd.manifest import Manifest, tensor_nbytes

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit
SAMPLE_BYTES = 4096
SAMPLES_PER_FILE = 64
BATCH_BYTES = 4 << 20  # one staging buffer
MAX_PIECES = 1024  # IOV_MAX: one preadv scatters a run


@dataclass(frozen=True, slots=True)
class StoredTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute file offset
    end: int


@dataclass(frozen=True)
class Header:
    file: Path
    raw: bytes
    data_start: int
    file_size: int
    tensors: tuple[StoredTensor, ...]


@dataclass(frozen=True, slots=True)
class CopyOp:
    """Fill `nbytes` of the arena at `arena_offset` from shard number `shard` at `file_offset`.

    Without `pieces`, the file range has the same length. With them, the file range is contiguous
    and `file_nbytes` long, and lands in (arena offset relative to `arena_offset`, length) pieces,
    in order; the arena bytes between pieces (alignment padding) are left undefined.
    """

    shard: int
    file_offset: int
    arena_offset: int
    nbytes: int
    pieces: tuple[tuple[int, int], ...] = ()

    @property
    def file_nbytes(self) -> int:
        return sum(n for _, n in self.pieces) if self.pieces else self.nbytes


def read_header(file: Path) -> Header:
    """Open `file`, parse its header, close it (for tools and tests; loads use `Checkpoint.open`)."""
    try:
        fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise LoadFailed(f"{file}: cannot read: {e.strerror}") from None
    try:
        return parse_header(fd, file)
    finally:
        os.close(fd)


def parse_header(fd: int, file: Path) -> Header:
    """Parse and validate the safetensors header of the open file `fd`; every tensor must lie inside it."""
    try:
        file_size = os.fstat(fd).st_size
        prefix = os.pread(fd, 8, 0)
        if len(prefix) < 8:
            raise LoadFailed(f"{file}: not a safetensors file (shorter than 8 bytes)")
        n = int.from_bytes(prefix, "little")
        if n > MAX_HEADER_BYTES or 8 + n > file_size:
            raise LoadFailed(f"{file}: not a safetensors file (header length {n} is implausible)")
        raw = _pread_all(fd, n, 8)
    except OSError as e:
        raise LoadFailed(f"{file}: cannot read: {e.strerror}") from None
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:  # bad JSON, bad UTF-8, absurd integers, deep nesting
        raise LoadFailed(f"{file}: safetensors header is not valid JSON ({str(e)[:200]})") from None
    if not isinstance(doc, dict):
        raise LoadFailed(f"{file}: safetensors header is not a JSON object")
    data_start = 8 + n
    tensors = []
    for name, info in doc.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            nbytes = tensor_nbytes(name, dtype, shape)
        except WcdError as bad:
            raise LoadFailed(f"{file}: {bad.message}") from None
        except (KeyError, TypeError, ValueError):
            raise LoadFailed(f"{file}: tensor {name!r} has a malformed header entry") from None
        if type(begin) is not int or type(end) is not int or not 0 <= begin <= end or end - begin != nbytes:
            raise LoadFailed(f"{file}: tensor {name!r}: data_offsets {[begin, end]} do not match dtype and shape")
        if data_start + end > file_size:
            raise LoadFailed(f"{file}: tensor {name!r} extends past the end of the file (truncated?)")
        tensors.append(StoredTensor(name, dtype, shape, data_start + begin, data_start + end))
    tensors.sort(key=lambda t: t.begin)
    reach: StoredTensor | None = None  # the tensor with data reaching furthest so far
    for t in tensors:  # no two tensors with data may share a byte (safetensors refuses that too)
        if t.end > t.begin:
            if reach is not None and t.begin < reach.end:
                raise LoadFailed(f"{file}: tensors {reach.name!r} and {t.name!r} overlap (data_offsets)")
            if reach is None or t.end > reach.end:
                reach = t
    return Header(file, raw, data_start, file_size, tuple(tensors))


def _pread_all(fd: int, n: int, offset: int) -> bytes:
    parts = []
    while n:
        chunk = os.pread(fd, n, offset)
        if not chunk:
            raise OSError(errno.EIO, "unexpected end of file")
        parts.append(chunk)
        n, offset = n - len(chunk), offset + len(chunk)
    return b"".join(parts)


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
    elif st.st_gid in _groups(uid, owner.st_gid):
        ok = st.st_mode & stat.S_IRGRP
    else:
        ok = st.st_mode & stat.S_IROTH
    if not ok:
        raise LoadFailed(f"{file}: the owner of its directory (uid {uid}) may not read it, so neither will the "
                         "daemon (give the file to that user, or make it readable)")


def _groups(uid: int, gid: int) -> set[int]:
    try:
        user = pwd.getpwuid(uid)
    except KeyError:
        return {gid}
    return set(os.getgrouplist(user.pw_name, user.pw_gid))


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


class Checkpoint:
    """All shards of one checkpoint, open: their headers, and how they map onto an arena.

    Each shard is opened once (`open`) and everything after (fingerprint, fill, digest) reads
    through these descriptors, so a file swapped or re-linked by path after the open is never
    read. `changed` tells whether an open file was written since. Close it (or use `with`).
    """

    def __init__(self, path: Path, headers: tuple[Header, ...], fds: tuple[int, ...]) -> None:
        self.path = path
        self.headers = headers
        self.fds = fds
        self.opened = tuple(FileState.of(fd) for fd in fds)

    @classmethod
    def open(cls, path: str | os.PathLike[str], follow_links: bool = False, owner_check: bool = True) -> Checkpoint:
        """Open every shard of `path` (a file or a directory of shards) and parse its header.

        Symbolic links to shards are followed only while they stay inside the directory, unless
        `follow_links`; with `owner_check`, a file the directory's owner could not read is refused.
        """
        p = Path(path).resolve()
        files = open_files(p, follow_links, owner_check)
        try:
            headers = tuple(parse_header(fd, file) for file, fd in files)
            names: set[str] = set()
            for h in headers:
                for t in h.tensors:
                    if t.name in names:
                        raise LoadFailed(f"{p}: tensor {t.name!r} appears in more than one shard")
                    names.add(t.name)
            return cls(p, headers, tuple(fd for _, fd in files))
        except BaseException:
            for _, fd in files:
                os.close(fd)
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
        return Manifest.build((t.name, t.dtype, t.shape) for h in self.headers for t in h.tensors)

    def copy_plan(self, manifest: Manifest, chunk: int = 64 << 20, batch: int = BATCH_BYTES) -> list[CopyOp]:
        """Reads that fill an arena of `manifest`, in file order.

        Tensors of at least `batch` bytes become direct copies, split into `chunk`-byte pieces.
        Runs of smaller tensors that lie back to back in the file become one op each, of at most
        `batch` arena bytes and `MAX_PIECES` tensors: one read of the whole file range, scattered
        into the arena layout (which pads each tensor to 256 bytes), and one write. Per-tensor work
        is then a slice, not a syscall or a queued task: 100,000 16 KiB tensors make ~400 ops.
        """
        offsets = manifest.offsets  # the manifest lists tensors in this very order (`manifest`)
        if len(offsets) != sum(len(h.tensors) for h in self.headers):
            raise ValueError("copy_plan needs the manifest of this checkpoint")
        ops: list[CopyOp] = []
        i = 0
        for shard, h in enumerate(self.headers):
            run: list[tuple[StoredTensor, int]] = []
            for t in h.tensors:
                at, n = offsets[i], t.end - t.begin
                i += 1
                if n == 0:
                    continue
                if run and (n >= batch or t.begin != run[-1][0].end or len(run) == MAX_PIECES
                            or at + n - run[0][1] > batch):
                    ops.append(_run_op(shard, run))
                    run = []
                if n >= batch:
                    ops.extend(CopyOp(shard, t.begin + pos, at + pos, min(chunk, n - pos))
                               for pos in range(0, n, chunk))
                else:
                    run.append((t, at))
            if run:
                ops.append(_run_op(shard, run))
        return ops

    @property
    def nbytes(self) -> int:
        return sum(t.end - t.begin for h in self.headers for t in h.tensors)


def _run_op(shard: int, run: list[tuple[StoredTensor, int]]) -> CopyOp:
    """One op for tensors back to back in a file: direct if the arena has no padding between them."""
    base = run[0][1]
    pieces = tuple((at - base, t.end - t.begin) for t, at in run)
    span = pieces[-1][0] + pieces[-1][1]
    return CopyOp(shard, run[0][0].begin, base, span, () if span == run[-1][0].end - run[0][0].begin else pieces)
