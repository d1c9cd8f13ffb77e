"""The attacker's side of the hardening tests: one connection speaking the wire protocol by hand
(frames and fds out, frames in), as a hostile peer would, not through `wcd.client`; and a daemon
doing the same (`Impostor`), for what a client must refuse."""

from __future__ import annotations

import fcntl
import os
import socket
import struct
import threading
from pathlib import Path
from typing import Any

from wcd import wire
from wcd.arenas.base import SEALS
from wcd.manifest import DTYPES


def columns(rows: list[list[Any]]) -> dict[str, Any]:
    """A reserve's `columns` for [name, dtype, shape] rows, one shape per row, unchecked (an attack
    may send what `Manifest.build` refuses)."""
    dims = [d for _, _, shape in rows for d in shape]
    return {"names": "\0".join(name for name, _, _ in rows), "dtypes": bytes(DTYPES.index(t) for _, t, _ in rows),
            "shape_ndims": bytes(len(shape) for _, _, shape in rows),
            "shape_dims": struct.pack(f"<{len(dims)}Q", *dims),
            "shape_ids": struct.pack(f"<{len(rows)}I", *range(len(rows)))}


class Raw:
    """One connection speaking the wire protocol by hand: frames (and fds) out, frames in."""

    opened: list[Raw] = []  # closed after each test (`close_raw`)

    def __init__(self, path: Path, hello: bool = True) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        Raw.opened.append(self)
        self.sock.connect(str(path))
        self.sock.settimeout(30)
        self.dec = wire.FrameDecoder(max_array=wire.MAX_REPLY_ARRAY)  # it reads replies
        self.ids = iter(range(1, 1 << 62))
        if hello:
            reply = self.call({"op": "hello", "versions": [2]})
            assert reply["ok"], reply

    def frame(self, msg: dict[str, Any]) -> bytes:
        return wire.encode({"id": next(self.ids), **msg})

    def request(self, op: str, **fields: Any) -> int:
        """Send one request without waiting (pipelining); its id."""
        req_id = next(self.ids)
        self.send(wire.encode({"op": op, "id": req_id, **fields}))
        return req_id

    def send(self, data: bytes, fds: list[int] | None = None) -> None:
        if fds:
            data = data[socket.send_fds(self.sock, [data], fds):]
        if data:
            self.sock.sendall(data)

    def recv(self, timeout: float | None = None) -> dict[str, Any]:
        """The next frame; any fds it carries are closed."""
        if timeout is not None:
            self.sock.settimeout(timeout)
        while (item := self.dec.next_message()) is None:
            data, anc, _, _ = self.sock.recvmsg(1 << 20, socket.CMSG_SPACE(16 * 4))
            if not data:
                raise EOFError("the daemon closed the connection")
            self.dec.feed(data, wire.fds_from_ancillary(anc))
        msg, fds = item
        for fd in fds:
            os.close(fd)
        return msg

    def call(self, msg: dict[str, Any]) -> dict[str, Any]:
        self.send(self.frame(msg))
        return self.recv()

    def last_words(self, timeout: float = 10.0) -> dict[str, Any] | None:
        """The stream-level error (id None) the daemon sent before closing, if it closed (None
        also if it keeps the connection open past `timeout`)."""
        self.sock.settimeout(timeout)
        try:
            while True:
                msg = self.recv()
                if msg.get("id") is None:
                    return msg
        except (EOFError, ConnectionResetError, TimeoutError):
            return None

    def close(self) -> None:
        self.sock.close()


class Impostor:
    """A daemon speaking the wire protocol by hand, to hand clients what no wcd daemon sends today
    (an older daemon, or an entry another uid crafted before the daemon checked it): it says hello,
    answers `acquire` with `lease_reply` and a sealed 4 KiB memfd, `list` with
    no entries and everything else with ok. One thread per connection; `close` stops it."""

    def __init__(self, path: Path, lease_reply: dict[str, Any]) -> None:
        self.lease_reply = lease_reply
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._talk, args=(conn,), daemon=True).start()

    def _talk(self, conn: socket.socket) -> None:
        dec = wire.FrameDecoder()
        with conn:
            while True:
                while (item := dec.next_message()) is None:
                    data = conn.recv(1 << 16)
                    if not data:
                        return
                    dec.feed(data)
                msg, _ = item
                op, req_id = msg.get("op"), msg.get("id")
                if op == "hello":
                    conn.sendall(wire.encode(wire.ok(req_id, version=2, server="impostor", features=["host-arenas"],
                                                     lease_ttl_s=30.0, pid=os.getpid(), uid=os.getuid())))
                elif op == "acquire":
                    fd = _sealed_memfd(4096)
                    try:
                        socket.send_fds(conn, [wire.encode(wire.ok(req_id, **self.lease_reply), nfds=1)], [fd])
                    finally:
                        os.close(fd)
                elif op == "list":
                    conn.sendall(wire.encode(wire.ok(req_id, entries=[])))
                else:
                    conn.sendall(wire.encode(wire.ok(req_id)))

    def close(self) -> None:
        self.listener.close()


def _sealed_memfd(size: int) -> int:
    fd = os.memfd_create("impostor", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    return fd
