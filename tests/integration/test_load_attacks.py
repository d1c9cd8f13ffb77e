"""Issue 11 items 12 and 13 against a real daemon: a peer who can write a model directory plants
links or rewrites shards around a load. The daemon must neither read what the directory's owner
could not nor serve bytes other than those it fingerprinted, and keep answering others meanwhile."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.integration.conftest import Daemon, same
from wcd.errors import LoadFailed, NotFound, WcdError

NOBODY = 65534
MiB = 1 << 20


@contextmanager
def pinging(d: Daemon) -> Iterator[list[float]]:
    """A second client pinging the daemon all along: the worst round trips, in seconds."""
    worst: list[float] = [0.0]
    stop = threading.Event()

    def run() -> None:
        with d.client() as c:
            while not stop.is_set():
                t = time.perf_counter()
                c.ping()
                worst[0] = max(worst[0], time.perf_counter() - t)
                time.sleep(0.002)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        yield worst
    finally:
        stop.set()
        thread.join()


def weights(seed: int, n: int = 4, numel: int = 1024) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(numel, generator=g) for i in range(n)}


def peer_owned_model(root: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A model directory that an allowed peer (uid nobody) owns and may write."""
    d = root / "peer-model"
    d.mkdir()
    tensors = weights(1)
    save_file(tensors, str(d / "model-00001-of-00001.safetensors"))
    for p in (d, *d.iterdir()):
        os.chown(p, NOBODY, NOBODY)
    return d, tensors


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the attack needs the daemon to run as root")


@needs_root
def test_a_shard_linked_to_a_root_only_file_is_not_served(make_daemon, tmp_path: Path) -> None:
    d, _ = peer_owned_model(tmp_path)
    secret = tmp_path / "secret.safetensors"
    save_file({"secret": torch.arange(64, dtype=torch.int64)}, str(secret))
    secret.chmod(0o600)
    (d / "model-00002-of-00002.safetensors").symlink_to(secret)  # planted by the peer
    os.lchown(d / "model-00002-of-00002.safetensors", NOBODY, NOBODY)
    daemon = make_daemon()
    with pinging(daemon) as worst, daemon.client() as c:
        with pytest.raises(LoadFailed, match="a symbolic link out of the model directory"):
            c.load("m", d, wait=True)
        # the same file hard-linked (or copied by root) into the directory: its owner could not read it
        (d / "model-00002-of-00002.safetensors").unlink()
        os.link(secret, d / "model-00002-of-00002.safetensors")
        with pytest.raises(LoadFailed, match=f"the owner of its directory \\(uid {NOBODY}\\) may not read it"):
            c.load("m", d, wait=True)
        assert [(e["name"], e["state"], e["bytes"]) for e in c.list()] == [("m", "failed", 0)]  # nothing served
    assert worst[0] < 0.05


@pytest.mark.slow
def test_a_shard_swapped_for_a_link_after_load_returned_is_not_read(make_daemon, tmp_path: Path) -> None:
    d = tmp_path / "model"
    d.mkdir()
    tensors = {**weights(1, n=8, numel=2 * MiB)}  # 64 MiB: the fill outlasts the swap below
    save_file(tensors, str(d / "model.safetensors"))
    planted = tmp_path / "planted.safetensors"
    save_file(weights(2, n=8, numel=2 * MiB), str(planted))  # same layout, other values
    daemon = make_daemon()
    with pinging(daemon) as worst, daemon.client() as c:
        c.load("m", d)  # returns once admitted (fingerprinted); the fill runs on
        os.rename(d / "model.safetensors", tmp_path / "moved.safetensors")
        (d / "model.safetensors").symlink_to(planted)
        try:
            with c.acquire("m") as lease:
                for name, want in tensors.items():  # the bytes it fingerprinted, or nothing
                    assert same(lease.tensors[name], want), name
        except NotFound:
            assert "changed while it was being loaded" in daemon.log.read_text()
    assert worst[0] < 0.05


@pytest.mark.slow
def test_a_checkpoint_overwritten_during_a_load_fails_it(make_daemon, tmp_path: Path) -> None:
    d = tmp_path / "model"
    d.mkdir()
    file = d / "model.safetensors"
    save_file(weights(1, n=16, numel=4 * MiB), str(file))  # 256 MiB
    daemon = make_daemon("load_workers = 1\n")
    with pinging(daemon) as worst, daemon.client() as c:
        c.load("m", d)
        with open(file, "r+b") as f:  # in place, same inode: the head and the tail of the data
            f.seek(4096)
            f.write(os.urandom(4096))
            f.seek(-4096, os.SEEK_END)
            f.write(os.urandom(4096))
        with pytest.raises(WcdError) as info:
            c.acquire("m").release()
        assert info.value.code == "not_found"
        [failed] = c.list()  # nothing served; the failure is listed with its reason
        assert failed["state"] == "failed" and "changed while it was being loaded" in failed["reason"]
    assert "model.safetensors changed while it was being loaded" in daemon.log.read_text()
    assert worst[0] < 0.05
    with daemon.client() as c:  # complete again: it loads
        c.load("m", d, wait=True)
        assert [e["state"] for e in c.list()] == ["ready"]
