"""Claiming the daemon's own socket path (`daemon.socket`, `--socket`) when systemd does not pass one.

Owns the checks on the path (no directory on the way that another uid controls, nothing but a
stale socket replaced), the lock that makes one daemon the path's owner, the bind itself and
giving the path back. Must not accept or serve: `wcd.server` does that with the socket it gets.
"""

from __future__ import annotations

import errno
import fcntl
import grp
import logging
import os
import socket
import stat
import tempfile
from pathlib import Path

from wcd.errors import Busy, ConfigError, Internal

log = logging.getLogger("wcd")

BACKLOG = 512
_LOCK_TRIES = 8  # each lost only to a daemon that gave the path back between our open and our lock


class Claim:
    """A listening socket bound at `path`, and the lock on `path` held for as long as it serves."""

    def __init__(self, path: Path, sock: socket.socket, lock_fd: int) -> None:
        self.path, self.sock, self._lock_fd = path, sock, lock_fd

    def release(self) -> None:
        """Close the socket and remove its path, then the lock (in that order: while the lock is
        held no other daemon binds here, so what is unlinked is ours)."""
        self.sock.close()
        self.path.unlink(missing_ok=True)
        _unlock(self.path, self._lock_fd)


def lock_path(path: Path) -> Path:
    return path.with_name(path.name + ".lock")


def claim(path: Path, groups: list[str]) -> Claim:
    """Bind the listening socket at `path` with mode 0660 (group: the first allowed group, if we
    may). Raises `ConfigError` for a path the daemon must not take (exit 2: restarting cannot fix
    it), `Busy` when another daemon serves it, `PermissionError` as is (the CLI names the file),
    `Internal` for any other failure (a full disk), each one line."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        check_directory(path.parent)
        lock_fd = _lock(path)
        try:
            _check_replaceable(path)
            sock = _bind_at(path, groups)
        except BaseException:
            _unlock(path, lock_fd)
            raise
    except PermissionError:
        raise
    except OSError as e:
        raise Internal(f"cannot create the socket {path}: {e.strerror or e} ({_bind_hint(e)})") from None
    return Claim(path, sock, lock_fd)


def _bind_hint(e: OSError) -> str:
    """What to do about a socket that cannot be made, by its errno."""
    if e.errno == errno.EROFS:
        return "pick a --socket on a writable file system, such as /run/wcd or /tmp"
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return "free space there, or pick another --socket"
    if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):
        return ("that file system does not hold sockets (some network or FUSE file systems): pick a --socket on "
                "a local one, such as /run/wcd or /tmp")
    return "pick another --socket"


def check_directory(where: Path) -> None:
    """Refuse a socket directory that a uid other than ours or root's could change: one that can
    rename or write a directory on the way, or owns a symlink followed, can unlink the socket or put
    its own in its place. A directory writable by everyone is fine when sticky (/tmp); one writable
    by its group is the operator's choice of who may."""
    me = os.getuid()
    absolute = Path(os.path.abspath(where))
    seen = [*reversed(absolute.parents), absolute]
    real = Path(os.path.realpath(absolute))
    seen += [p for p in (*reversed(real.parents), real) if p not in seen]
    for p in seen:
        st = os.lstat(p)
        if not (stat.S_ISLNK(st.st_mode) or stat.S_ISDIR(st.st_mode)):
            continue
        what = "a symlink" if stat.S_ISLNK(st.st_mode) else "a directory"
        if st.st_uid not in (0, me):
            raise ConfigError(f"socket directory {where}: {p} is {what} owned by uid {st.st_uid}, who could "
                              f"remove or replace the socket; put it in a directory owned by uid {me} or root "
                              "(daemon.socket, --socket)")
        if stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
            raise ConfigError(f"socket directory {where}: {p} is writable by every user and not sticky, so "
                              "anyone could remove or replace the socket; chmod o-w (or +t) it, or put the "
                              "socket elsewhere (daemon.socket, --socket)")


def _lock(path: Path) -> int:
    """An exclusive lock on `path`'s lock file, held until `Claim.release` (or exit). Two daemons
    that both found a stale socket would otherwise each rename their own over it, and one would
    serve a socket nobody can reach."""
    where = lock_path(path)
    for _ in range(_LOCK_TRIES):
        fd = os.open(where, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise Busy(f"another daemon already serves {path} (it holds {where})") from None
        except BaseException:
            os.close(fd)
            raise
        try:
            now = os.stat(where, follow_symlinks=False)
        except FileNotFoundError:
            now = None
        mine = os.fstat(fd)
        if now is not None and (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
            return fd
        os.close(fd)  # locked a file its owner removed on the way out: take the new one
    raise Busy(f"{where} keeps changing hands; is a daemon restarting in a loop?")


def _unlock(path: Path, fd: int) -> None:
    """Remove the lock file, then let go of it (a daemon that opened it meanwhile finds, once it
    has the lock, that the file is gone, and takes a new one)."""
    lock_path(path).unlink(missing_ok=True)
    os.close(fd)


def _check_replaceable(path: Path) -> None:
    """Only a socket nobody serves (left by a daemon that crashed) is replaced: anything else at
    `path`, a file (`--socket` and `--config` swapped), a directory or a symlink, is refused."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        what = ("a regular file" if stat.S_ISREG(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode)
                else "a symlink" if stat.S_ISLNK(st.st_mode) else "not a socket")
        raise ConfigError(f"{path} is {what}, not a socket: the daemon replaces only a stale socket there; "
                          "remove it, or pick another path (daemon.socket, --socket)")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
        raise Busy(f"another daemon already serves {path}")
    except (ConnectionRefusedError, FileNotFoundError):
        pass  # stale: the rename in _bind_at replaces it
    finally:
        probe.close()


def _bind_at(path: Path, groups: list[str]) -> socket.socket:
    """The socket is bound, given its group and mode in a private directory next to `path`, then
    renamed onto it: a peer who can write to the socket's directory can swap `path` for a symlink
    at any moment, and chmod/chown by path would follow it (fchmod on a socket fd does not reach
    the bound inode). rename replaces whatever `path` is then, without following it."""
    private = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))  # mode 0700, ours
    staged = private / "sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        old = os.umask(0o117)
        try:
            sock.bind(str(staged))
        finally:
            os.umask(old)
        os.chmod(staged, 0o660)  # what the umask gave; explicit, and safe here: nobody else can reach `private`
        if groups:
            try:
                os.chown(staged, -1, grp.getgrnam(groups[0]).gr_gid, follow_symlinks=False)
            except PermissionError:
                log.warning("cannot give %s to group %s (not root and not a member)", path, groups[0])
        os.rename(staged, path)
    except BaseException:
        sock.close()
        staged.unlink(missing_ok=True)
        raise
    finally:
        private.rmdir()
    sock.listen(BACKLOG)
    return sock
