"""The systemd protocol: socket activation, sd_notify, the watchdog and the fd store.

Every function is a no-op without systemd (no LISTEN_PID, NOTIFY_SOCKET or WATCHDOG_USEC), so
the daemon runs the same from a shell. Failures to talk to a systemd that is there raise
`SystemdError` with one clear line. This module must not import the server or torch.
"""

from __future__ import annotations

import os
import socket
import time
import warnings

import sdnotify

SOCKET_NAME = "wcd"  # FileDescriptorName= of wcd@.socket; the listener is found by what it is, not by this
LISTEN_FDS_START = 3  # SD_LISTEN_FDS_START: passed fds are 3, 4, ... in LISTEN_FDNAMES order
FDNAME_MAX = 255  # systemd's fdname_is_valid(); longer or invalid names are silently ignored
SCM_MAX_FD = 253  # the kernel refuses (EINVAL) more fds than this in one message
NOTIFY_BUFFER_MAX = 4096  # systemd drops, with only a journal warning, datagrams this long


class SystemdError(Exception):
    """systemd is there but talking to it failed, or it handed us a malformed environment."""


def listen_fds() -> list[tuple[int, str]]:
    """(fd, name) for each fd systemd passed us: the activation socket(s) and fd-store entries.

    The fds get FD_CLOEXEC, and LISTEN_PID/LISTEN_FDS/LISTEN_FDNAMES are unset whatever they
    held (as sd_listen_fds(unset_environment=1) does), so no child process takes them for its own.
    """
    try:
        if _env_int("LISTEN_PID") != os.getpid():
            return []  # not set, or meant for another process (e.g. the shell that started us)
        count = _env_int("LISTEN_FDS") or 0
        if count < 0:
            raise SystemdError(f"LISTEN_FDS={count} is negative")
        names_var = os.environ.get("LISTEN_FDNAMES")
        names = names_var.split(":") if names_var is not None else ["unknown"] * count
        if len(names) != count:
            raise SystemdError(f"LISTEN_FDNAMES has {len(names)} names for LISTEN_FDS={count} fds")
        fds = list(range(LISTEN_FDS_START, LISTEN_FDS_START + count))
        for fd in fds:
            try:
                os.set_inheritable(fd, False)
            except OSError as e:
                raise SystemdError(f"LISTEN_FDS passes fd {fd} but it is not open ({e.strerror})") from None
        return list(zip(fds, names))
    finally:
        for var in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
            os.environ.pop(var, None)


def split_listener(passed: list[tuple[int, str]]) -> tuple[int | None, list[tuple[int, str]]]:
    """(listening socket, fd-store entries) among what listen_fds() returned.

    The listener is recognised by what it is, an AF_UNIX stream socket in the listening state
    (SO_ACCEPTCONN), whatever its name: a socket unit without FileDescriptorName= passes it under
    the unit's name ("wcd@x.socket"), or "unknown". Names matter only for fd-store entries.
    """
    listeners = [fd for fd, _ in passed if is_unix_listener(fd)]
    if len(listeners) > 1:
        raise SystemdError(f"LISTEN_FDS passes {len(listeners)} listening sockets (fds "
                           f"{', '.join(map(str, listeners))}); wcd serves one: give its socket unit one ListenStream=")
    listener = listeners[0] if listeners else None
    return listener, [(fd, name) for fd, name in passed if fd != listener]


def is_unix_listener(fd: int) -> bool:
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:  # not a socket (a parked memfd), or not open
        return False
    with sock:
        return (sock.family == socket.AF_UNIX and sock.type == socket.SOCK_STREAM
                and bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)))


def watchdog_interval() -> float | None:
    """Seconds between WATCHDOG=1 pings (half of WatchdogSec=, as sd_watchdog_enabled advises),
    or None when systemd runs no watchdog for this process."""
    usec = _env_int("WATCHDOG_USEC")
    pid = _env_int("WATCHDOG_PID")
    if not usec or (pid is not None and pid != os.getpid()):
        return None
    return usec / 2 / 1_000_000


class Notifier:
    """Plain sd_notify messages (READY, STATUS, WATCHDOG, RELOADING, STOPPING) over `sdnotify`.

    sdnotify swallows every error unless built with debug=True; it is, so that with NOTIFY_SOCKET
    set a lost READY=1 or WATCHDOG=1 surfaces as SystemdError instead of a later kill by systemd.
    Connects once, at construction; without NOTIFY_SOCKET every method does nothing.
    """

    def __init__(self) -> None:
        self.address = _notify_address()
        self._notifier: sdnotify.SystemdNotifier | None = None
        if self.address is not None:
            try:
                # On a failed connect sdnotify drops its socket unclosed; the GC closes it.
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", ResourceWarning)
                    self._notifier = sdnotify.SystemdNotifier(debug=True)
            except OSError as e:
                raise SystemdError(f"cannot connect to NOTIFY_SOCKET={self.address} ({e.strerror})") from None

    @property
    def enabled(self) -> bool:
        return self._notifier is not None

    def ready(self, status: str | None = None) -> None:
        """Start-up, or a reload, is complete."""
        self._send("READY=1", status)

    def status(self, text: str) -> None:
        """The one-line status `systemctl status` shows."""
        self._send(None, text)

    def watchdog(self) -> None:
        self._send("WATCHDOG=1", None)

    def reloading(self, status: str | None = None) -> None:
        """A reload began; send ready() when it is done. systemd requires MONOTONIC_USEC with
        RELOADING=1 to tell this reload from an earlier one (v252 ignores it; later versions use it)."""
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        self._send(f"RELOADING=1\nMONOTONIC_USEC={usec}", status)

    def stopping(self, status: str | None = None) -> None:
        self._send("STOPPING=1", status)

    def close(self) -> None:
        if self._notifier is not None:
            self._notifier.socket.close()
            self._notifier = None

    def _send(self, state: str | None, status: str | None) -> None:
        if self._notifier is None:
            return
        lines = [state] if state else []
        if status is not None:
            lines.append(_status_line(status, budget=NOTIFY_BUFFER_MAX - 2 - len(state or "")))
        message = "\n".join(lines)
        try:
            # sdnotify encodes latin-1; handing it UTF-8 bytes as latin-1 text sends UTF-8 as is.
            self._notifier.notify(message.encode().decode("latin-1"))
        except OSError as e:
            head = message.partition("\n")[0]
            raise SystemdError(f"sd_notify {head!r} to {self.address} failed ({e.strerror})") from None


def store_enabled() -> bool:
    """Whether there is a service manager to park fds with (NOTIFY_SOCKET set). Whether it keeps
    them is FileDescriptorStoreMax='s business: over the limit systemd drops them, logging why."""
    return _notify_address() is not None


def store_fds(fds: list[int], name: str) -> None:
    """Park `fds` in systemd's fd store under `name` (FDSTORE=1); the next start of the service
    gets them back from listen_fds(). Our copies stay open: close them when done."""
    _check_fdname(name)
    if not fds:
        raise ValueError(f"store_fds({name!r}): no fds to store")
    # Several messages under one name are combined by systemd, so split at the kernel's limit.
    for i in range(0, len(fds), SCM_MAX_FD):
        _send_with_fds(f"FDSTORE=1\nFDNAME={name}", fds[i : i + SCM_MAX_FD])


def remove_fds(name: str) -> None:
    """Drop every fd stored under `name` (FDSTOREREMOVE=1), e.g. when its entry is evicted:
    memory goes back to the driver only once systemd's copies are closed too."""
    _check_fdname(name)
    _send_with_fds(f"FDSTOREREMOVE=1\nFDNAME={name}", [])


def _send_with_fds(message: str, fds: list[int]) -> None:
    address = _notify_address()
    if address is None:
        return
    target = "\0" + address[1:] if address.startswith("@") else address
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.connect(target)  # socket.send_fds ignores its address argument (CPython 3.11)
            socket.send_fds(sock, [message.encode()], fds)
    except OSError as e:
        head = message.partition("\n")[0]
        raise SystemdError(f"sd_notify {head!r} with {len(fds)} fds to {address} failed ({e.strerror})") from None


def _notify_address() -> str | None:
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return None
    if address[0] not in "/@":
        raise SystemdError(f"NOTIFY_SOCKET={address} is not an AF_UNIX path or '@' abstract name")
    return address


def _status_line(text: str, budget: int) -> str:
    # A newline would start a new assignment (a model name could smuggle in "READY=1"); an
    # oversize datagram is dropped by systemd, so cut the text to fit, on a character boundary.
    line = "STATUS=" + " ".join(text.splitlines())
    return line.encode()[:budget].decode(errors="ignore")


def _check_fdname(name: str) -> None:
    if not 0 < len(name) <= FDNAME_MAX or not all(" " <= c <= "~" and c != ":" for c in name):
        raise ValueError(
            f"invalid fd store name {name!r}: use 1-{FDNAME_MAX} printable ASCII characters without ':'"
        )


def _env_int(var: str) -> int | None:
    value = os.environ.get(var)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise SystemdError(f"{var}={value!r} is not a number") from None
