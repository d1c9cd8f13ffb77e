"""A real daemon process on a real Unix socket, for integration tests."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from wcd.client import Client, connect
from wcd.errors import DaemonUnavailable


class Daemon:
    def __init__(self, root: Path, config: str, socket: Path | None = None) -> None:
        self.root = root
        self.socket = socket or root / "wcd.sock"
        self.config = root / "wcd.toml"
        self.config.write_text(f'[daemon]\nsocket = "{self.socket}"\n' + config)
        self.log = root / "daemon.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Daemon:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "wcd", "serve", "--config", str(self.config),
                                          "--log-level", "debug"], stdout=log, stderr=subprocess.STDOUT)
        try:
            connect(self.socket, wait_s=30, while_alive=lambda: self.proc.poll() is None, heartbeats=False).close()
        except DaemonUnavailable:
            raise RuntimeError(f"daemon did not start:\n{self.log.read_text()}") from None
        return self

    def client(self, **kw: Any) -> Client:
        return Client(self.socket, **kw)

    def stop(self) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.terminate()
        return self.proc.wait(timeout=30)


@pytest.fixture
def make_daemon(tmp_path: Path) -> Iterator[Any]:
    daemons: list[Daemon] = []

    def make(config: str = "", start: bool = True, socket: Path | None = None) -> Daemon:
        d = Daemon(tmp_path, config, socket)
        daemons.append(d)
        return d.start() if start else d

    yield make
    for d in daemons:
        if d.proc is not None and d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()


@pytest.fixture
def shared_socket() -> Iterator[Path]:
    """A socket path another uid can reach (pytest's tmp dirs are root's alone)."""
    if os.getuid() != 0:
        pytest.skip("needs root, to connect as another uid")
    where = Path(tempfile.mkdtemp(prefix="wcd-harden-"))
    where.chmod(0o755)
    yield where / "wcd.sock"
    for p in where.iterdir():
        p.unlink()
    where.rmdir()


def mixed_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """Every dtype family the arena must carry, plus a scalar and a zero-size tensor."""
    g = torch.Generator().manual_seed(seed)
    return {
        "w.bf16": torch.randn(64, 96, generator=g).to(torch.bfloat16),
        "w.f32": torch.randn(33, 7, generator=g),
        "w.f16": torch.randn(5, 3, 2, generator=g).to(torch.float16),
        "w.fp8": torch.randn(128, 16, generator=g).to(torch.float8_e4m3fn),
        "w.fp8e5": torch.randn(17, generator=g).to(torch.float8_e5m2),
        "ids.i64": torch.randint(-(1 << 40), 1 << 40, (11,), generator=g),
        "ids.i32": torch.randint(-1000, 1000, (4, 4), generator=g, dtype=torch.int32),
        "mask": torch.rand(9, generator=g) > 0.5,
        "bytes.u8": torch.randint(0, 255, (13,), generator=g, dtype=torch.uint8),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.zeros(0, 8, dtype=torch.bfloat16),
    }


@pytest.fixture
def checkpoint(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    tensors = mixed_tensors()
    d = tmp_path / "ckpt"
    d.mkdir()
    names = list(tensors)
    save_file({n: tensors[n] for n in names[:6]}, str(d / "model-00001-of-00002.safetensors"))
    save_file({n: tensors[n] for n in names[6:]}, str(d / "model-00002-of-00002.safetensors"))
    return d, tensors


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical: dtype, shape and every byte."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return a.numel() == 0 or torch.equal(a.contiguous().view(-1).view(torch.uint8),
                                         b.contiguous().view(-1).view(torch.uint8))


def flip_stored_byte(shard: Path, name: str, at: int = 100) -> None:
    """Flip one bit of tensor `name`'s bytes in the safetensors file `shard`, in place."""
    from wcd.headers import read_header

    [t] = [t for t in read_header(shard).tensors if t.name == name]
    with open(shard, "r+b") as f:
        f.seek(t.begin + at)
        byte = f.read(1)[0]
        f.seek(t.begin + at)
        f.write(bytes([byte ^ 0x40]))


def sparse_checkpoint(path: Path, nbytes: int) -> Path:
    """A valid safetensors file holding one large U8 tensor whose data is a hole (no disk I/O)."""
    import json

    header = json.dumps({"big": {"dtype": "U8", "shape": [nbytes], "data_offsets": [0, nbytes]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        f.truncate(8 + len(header) + nbytes)
    return path


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory other uids can write to, like /tmp (pytest's tmp_path is root's alone)."""
    d = Path(tempfile.mkdtemp(prefix="wcd-trust-", dir="/tmp"))
    d.chmod(0o1777)
    yield d
    for p in sorted(d.rglob("*"), reverse=True):
        p.unlink() if not p.is_dir() or p.is_symlink() else p.rmdir()
    d.rmdir()


@pytest.fixture(autouse=True)
def close_raw() -> Iterator[None]:
    """Hand-written peers (`tests.integration.peers.Raw`) a test opened are closed after it."""
    from tests.integration.peers import Raw

    yield
    while Raw.opened:
        Raw.opened.pop().close()
