"""Daemons in their own network namespaces, filling entries from each other (`make test-fleet`)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fleet.netns import Net, usable
from tests.integration.conftest import Daemon, checkpoint, same  # noqa: F401 - fixtures
from wcd.client import connect
from wcd.errors import DaemonUnavailable

PORT = 7450


def nixl_missing() -> str | None:
    if importlib.util.find_spec("nixl_cu12") is None and importlib.util.find_spec("nixl") is None:
        return "needs NIXL (pip install '.[fleet]'; make test-fleet installs it)"
    return None


class NsDaemon(Daemon):
    """A daemon started inside a network namespace (its Unix socket is reachable from anywhere)."""

    def __init__(self, root: Path, config: str, prefix: list[str]) -> None:
        root.mkdir(parents=True, exist_ok=True)
        super().__init__(root, config)
        self.prefix = prefix

    def start(self) -> NsDaemon:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([*self.prefix, sys.executable, "-m", "wcd", "serve", "--config",
                                          str(self.config), "--log-level", "debug"], stdout=log,
                                         stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": os.getcwd()})
        try:
            connect(self.socket, wait_s=60, while_alive=lambda: self.proc.poll() is None, heartbeats=False).close()
        except DaemonUnavailable:
            raise RuntimeError(f"daemon did not start:\n{self.log.read_text()}") from None
        return self


@pytest.fixture
def net() -> Iterator[Net]:
    why = usable() or nixl_missing()
    if why:
        pytest.skip(why)
    n = Net(f"wcdf{os.getpid() % 100000}", 3)
    try:
        yield n
    finally:
        n.remove()


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    path = tmp_path / "fleet.secret"
    path.write_bytes(os.urandom(48).hex().encode())
    path.chmod(0o600)
    return path


@pytest.fixture
def fleet(net: Net, secret: Path, tmp_path: Path) -> Iterator[Any]:
    """make(i, models=..., peers=[j, ...], offer=True, extra=""): a daemon in namespace i."""
    daemons: list[NsDaemon] = []

    def make(i: int, models: str = "", peers: tuple[int, ...] = (), offer: bool = True, extra: str = "",
             secret_file: Path | None = None, start: bool = True, timeout: float = 20) -> NsDaemon:
        listen = net.address(i, towards=peers[0] if (i == 0 and peers) else 1)
        addresses = ", ".join(f'"{net.address(j, towards=i)}:{PORT}"' for j in peers)
        devices = ",".join(sorted({net.device(i, towards=j) for j in peers} | ({net.device(i)} if i else set())))
        offered = 'offer = { cpu = "8G" }' if offer else ""
        config = (f'{models}\n[fleet]\nlisten = "{"0.0.0.0" if i == 0 else listen}:{PORT}"\n'
                  f'secret_file = "{secret_file or secret}"\npeers = [{addresses}]\n'
                  f'{offered}\nfetch_timeout_s = {timeout}\n'
                  f'ucx = {{ UCX_TLS = "tcp", UCX_NET_DEVICES = "{devices or "all"}", UCX_TCP_TX_SEG_SIZE = "256k", '
                  f'UCX_TCP_RX_SEG_SIZE = "256k" }}\n{extra}')
        d = NsDaemon(tmp_path / f"d{i}", config, net.prefix_cmd(i))
        daemons.append(d)
        return d.start() if start else d

    yield make
    for d in daemons:
        if d.proc is not None and d.proc.poll() is None:
            d.proc.terminate()
            try:
                d.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                d.proc.kill()
                d.proc.wait()
