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
import socket
import sys
import time
from typing import Any

import msgpack

MAX_MESSAGE = 1 << 20
POLL_S = 0.0005  # between checks of a transfer's state; the progress thread moves the bytes
PROGRESS_DELAY_US = 100  # NIXL's progress thread sleeps this long when idle (0 spins a core)


def _nixl() -> Any:
    """The NIXL package of the installed wheel (`nixl-cu12` installs `nixl_cu12`)."""
    try:
        import nixl_cu12 as nixl  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        import nixl  # type: ignore[import-not-found,no-redef,unused-ignore]
    return nixl


def make_agent(name: str) -> Any:
    """A NIXL agent with the UCX backend, its progress thread idling at PROGRESS_DELAY_US rather
    than spinning (the Python wrapper sets 0: its config's field is clamped here)."""
    nixl = _nixl()
    api = sys.modules[nixl.__name__ + "._api"]
    base = api.nixlBind.nixlAgentConfig

    class Config(base):  # type: ignore[misc, valid-type]
        @property
        def pthrDelay(self) -> int:  # noqa: N802 - NIXL's field
            return int(base.pthrDelay.__get__(self))

        @pthrDelay.setter
        def pthrDelay(self, value: int) -> None:  # noqa: N802
            base.pthrDelay.__set__(self, max(int(value), PROGRESS_DELAY_US))

    api.nixlBind.nixlAgentConfig = Config
    try:
        return nixl.nixl_agent(name, nixl.nixl_agent_config(enable_prog_thread=True, backends=["UCX"]))
    finally:
        api.nixlBind.nixlAgentConfig = base


def _address(region: mmap.mmap) -> tuple[Any, int]:
    import numpy as np

    view = np.frombuffer(region, dtype=np.uint8)
    return view, int(view.ctypes.data)


class Exporter:
    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self.regions: dict[int, tuple[mmap.mmap, Any, Any, int]] = {}

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

    def unexport(self, req: dict[str, Any]) -> dict[str, Any]:
        got = self.regions.pop(int(req["id"]), None)
        if got is not None:
            region, view, reg, _ = got
            self.agent.deregister_memory(reg)
            del view
            region.close()
        return {}


def fetch(agent: Any, req: dict[str, Any], fds: list[int]) -> dict[str, Any]:
    """READ a peer's region into the arena (fds[0]) before `deadline_s`; always unmapped after."""
    size, deadline = int(req["size"]), time.monotonic() + float(req["deadline_s"])
    region = mmap.mmap(fds[0], size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    view, addr = _address(region)
    reg = remote = handle = None
    try:
        reg = agent.register_memory([(addr, size, 0, "")], "DRAM")
        remote = agent.add_remote_agent(bytes(req["md"]))
        local = agent.get_xfer_descs([(addr, size, 0)], "DRAM")
        theirs = agent.get_xfer_descs([(int(req["addr"]), size, 0)], "DRAM")
        started = time.perf_counter()
        handle = agent.initialize_xfer("READ", local, theirs, remote)
        state = agent.transfer(handle)
        while state == "PROC":
            if os.getppid() != PARENT:  # the daemon is gone: so is whoever wanted these bytes
                return {"error": "the daemon went away"}
            if time.monotonic() > deadline:
                return {"error": f"the transfer did not end within {float(req['deadline_s']):g} s"}
            time.sleep(POLL_S)
            state = agent.check_xfer_state(handle)
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
