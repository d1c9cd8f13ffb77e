"""A transfer helper: the process that holds a NIXL agent, so that the daemon never loads NIXL or
UCX and a peer can never crash it (DESIGN §12). `python -m wcd.fleet.agent ROLE FD`.

Two roles, one process each. `export` maps offered arenas read-only and registers each once
(kept until the daemon says the entry went); a peer that writes into such a region faults this
process, not the daemon, which starts another. `fetch` reads a peer's arena into a local one it
maps writable for that transfer only, then unmaps it (the daemon seals the arena after, which
fails while any writable mapping is left). Its agent's metadata is never sent to a peer, so no
peer can address its memory.

It speaks msgpack over a SOCK_SEQPACKET socket inherited as FD: one request in, one reply out,
the arena's fd with the request. Requests come only from the daemon that started it; what a peer
sent reaches it as plain values the daemon checked (addresses, sizes, the agent metadata blob,
which NIXL parses). Nothing is unpickled.
"""

from __future__ import annotations

import mmap
import os
import select
import socket
import sys
import time
from typing import Any

import msgpack

MAX_MESSAGE = 1 << 20
PIECES = 32  # descriptors a read is cut into (one registration): UCX keeps several in flight
MIN_PIECE = 1 << 20
PASSES = 64  # progress passes between looks at the daemon's socket while serving


def _nixl() -> Any:
    """The NIXL package of the installed wheel (`nixl-cu12` installs `nixl_cu12`)."""
    try:
        import nixl_cu12 as nixl  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        import nixl  # type: ignore[import-not-found,no-redef,unused-ignore]
    return nixl


def make_agent(name: str) -> Any:
    """A NIXL agent with the UCX backend and no progress thread: the helper moves the bytes itself
    while a transfer is on (`serve`, `fetch`) and sleeps in a read of its socket otherwise. NIXL's
    thread either spins a core while idle or, sleeping between passes, slows the transfer several
    times over on a busy host (bench/RESULTS.md)."""
    nixl = _nixl()
    return nixl.nixl_agent(name, nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


def _address(region: mmap.mmap) -> tuple[Any, int]:
    import numpy as np

    view = np.frombuffer(region, dtype=np.uint8)
    return view, int(view.ctypes.data)


class Exporter:
    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self.regions: dict[int, tuple[mmap.mmap, Any, Any, int]] = {}
        self.serving: dict[int, float] = {}  # transfers peers make now -> when to stop serving them anyway

    def export(self, req: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        xid, size = int(req["id"]), int(req["size"])
        if xid in self.regions:
            return {"addr": self.regions[xid][3], "md": self.agent.get_agent_metadata()}
        region = mmap.mmap(fds[0], size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        view, addr = _address(region)
        started = time.perf_counter()
        reg = self.agent.register_memory([(addr, size, 0, "")], "DRAM")
        self.regions[xid] = (region, view, reg, addr)
        registered = time.perf_counter() - started
        # The metadata a peer needs names the registrations made so far: sent with each export.
        return {"addr": addr, "register_s": registered, "md": self.agent.get_agent_metadata()}

    def serve(self, req: dict[str, Any]) -> dict[str, Any]:
        """A peer reads now: make progress until `end` (or `deadline_s`, should the daemon not say)."""
        self.serving[int(req["id"])] = time.monotonic() + float(req["deadline_s"])
        return {}

    def end(self, req: dict[str, Any]) -> dict[str, Any]:
        self.serving.pop(int(req["id"]), None)
        return {}

    def idle(self, sock: socket.socket) -> None:
        """Make progress for the peers reading now until a request comes; return at once if none reads."""
        while self.serving:
            now = time.monotonic()
            for xid in [x for x, deadline in self.serving.items() if deadline < now]:
                del self.serving[xid]
            ready, _, _ = select.select([sock], [], [], 0)
            if ready:
                return
            for _ in range(PASSES):  # progress passes of the UCX worker: they serve the reads
                self.agent.get_new_notifs()

    def unexport(self, req: dict[str, Any]) -> dict[str, Any]:
        got = self.regions.pop(int(req["id"]), None)
        if got is not None:
            region, view, reg, _ = got
            self.agent.deregister_memory(reg)
            del view
            region.close()
        return {}


def _pieces(size: int) -> list[tuple[int, int]]:
    per = max(MIN_PIECE, -(-size // PIECES))
    return [(at, min(per, size - at)) for at in range(0, size, per)]


def fetch(agent: Any, req: dict[str, Any], fds: list[int]) -> dict[str, Any]:
    """READ a peer's region into the arena (fds[0]) before `deadline_s`; always unmapped after."""
    size, deadline = int(req["size"]), time.monotonic() + float(req["deadline_s"])
    region = mmap.mmap(fds[0], size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    view, addr = _address(region)
    reg = remote = handle = None
    try:
        reg = agent.register_memory([(addr, size, 0, "")], "DRAM")
        remote = agent.add_remote_agent(bytes(req["md"]))
        pieces = _pieces(size)
        local = agent.get_xfer_descs([(addr + at, n, 0) for at, n in pieces], "DRAM")
        theirs = agent.get_xfer_descs([(int(req["addr"]) + at, n, 0) for at, n in pieces], "DRAM")
        started = time.perf_counter()
        handle = agent.initialize_xfer("READ", local, theirs, remote)
        state = agent.transfer(handle)
        while state == "PROC":
            if os.getppid() != PARENT:  # the daemon is gone: so is whoever wanted these bytes
                return {"error": "the daemon went away"}
            if time.monotonic() > deadline:
                return {"error": f"the transfer did not end within {float(req['deadline_s']):g} s"}
            state = agent.check_xfer_state(handle)  # also what moves the bytes: no progress thread
        if state != "DONE":
            return {"error": "the transfer failed (the peer went away, or refused the read)"}
        return {"seconds": time.perf_counter() - started}
    finally:
        for step in (lambda: handle is not None and agent.release_xfer_handle(handle),
                     lambda: remote is not None and agent.remove_remote_agent(remote),
                     lambda: reg is not None and agent.deregister_memory(reg)):
            try:
                step()
            except Exception:  # noqa: BLE001, S110 - the mapping goes below whatever NIXL says
                pass
        del view
        region.close()


PARENT = os.getppid()


def serve(role: str, sock: socket.socket) -> None:
    """Answer the daemon until it closes the socket (or dies: the same end of file), then exit;
    what this process registered and mapped goes with it."""
    agent = make_agent(f"wcd-{role}-{socket.gethostname()}-{os.getpid()}-{os.urandom(4).hex()}")
    exporter = Exporter(agent) if role == "export" else None
    sock.send(msgpack.packb({"pid": os.getpid()}))
    while True:
        if exporter is not None:
            exporter.idle(sock)
        data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 4)
        if not data:
            return
        try:
            req = msgpack.unpackb(data, raw=False)
            op = req["op"]
            if exporter is not None and op == "export":
                reply = exporter.export(req, fds)
            elif exporter is not None and op == "unexport":
                reply = exporter.unexport(req)
            elif exporter is not None and op in ("serve", "end"):
                reply = exporter.serve(req) if op == "serve" else exporter.end(req)
            elif exporter is None and op == "fetch":
                reply = fetch(agent, req, fds)
            else:
                reply = {"error": f"op {op!r} is not this helper's ({role})"}
        except Exception as e:  # noqa: BLE001 - one reply per request, whatever failed
            reply = {"error": f"{type(e).__name__}: {e}"}
        finally:
            for fd in fds:
                os.close(fd)
        sock.send(msgpack.packb(reply))


def main() -> None:
    role, fd = sys.argv[1], int(sys.argv[2])
    serve(role, socket.socket(fileno=fd))


if __name__ == "__main__":
    main()
