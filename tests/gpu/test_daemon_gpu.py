"""A real daemon serving CUDA arenas: configured load, acquire, verify, publish, and an engine that
keeps computing after the daemon is SIGKILLed."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.integration.conftest import (  # noqa: F401  (fixtures)
    checkpoint,
    flip_stored_byte,
    make_daemon,
    mixed_tensors,
    same,
)
from wcd.key import WeightCacheKey

pytestmark = pytest.mark.gpu

GPU_BUDGET = '[daemon.budget]\n"cuda:0" = "8GiB"\n'


def gpu_model(path: Path, name: str = "m") -> str:
    return f'\n[[models]]\nname = "{name}"\npath = "{path}"\ndevice = "cuda:0"\nretention = "pinned"\n'


def expected_tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_configured_gpu_model_acquire_verify_status(make_daemon: Any, checkpoint: Any) -> None:  # noqa: F811
    from wcd.arenas.cuda import find_gpu

    path, _ = checkpoint
    d = make_daemon(GPU_BUDGET + gpu_model(path))
    uuid = find_gpu("cuda:0").uuid
    expected = expected_tensors(path)
    with d.client() as c:
        with c.acquire("m") as lease:
            assert lease.key.device == uuid and lease.arena["kind"] == "cuda"
            assert set(lease.tensors) == set(expected)
            for name, t in expected.items():
                got = lease.tensors[name]
                assert got.is_cuda and same(got.cpu(), t), name
            del got
        assert c.verify("m")["match"] is True
        devices = {dev["device"]: dev for dev in c.status()["devices"]}
        assert devices[uuid]["name"].endswith("(cuda:0)") and devices[uuid]["used"] > 0
    assert d.stop() == 0


def test_verify_of_a_gpu_entry_names_a_changed_file_byte_and_digests_as_on_the_host(
        make_daemon: Any, checkpoint: Any) -> None:  # noqa: F811
    path, _ = checkpoint
    host_model = f'\n[[models]]\nname = "h"\npath = "{path}"\nretention = "pinned"\n'
    d = make_daemon(GPU_BUDGET + gpu_model(path) + host_model)
    with d.client() as c:
        on_gpu, on_host = c.verify("m"), c.verify("h")
        assert on_gpu["match"] and on_host["match"] and on_gpu["digest"] == on_host["digest"]
        flip_stored_byte(sorted(path.glob("*.safetensors"))[0], "w.bf16")
        r = c.verify("m")
        assert (r["match"], r["mismatched"], r["digest"]) == (False, ["w.bf16"], on_gpu["digest"])
    assert d.stop() == 0


def test_publish_on_gpu_and_acquire_by_key(make_daemon: Any) -> None:  # noqa: F811
    from wcd.arenas.cuda import find_gpu

    d = make_daemon(GPU_BUDGET)
    key = WeightCacheKey(model="q", transform="test/fp8", device=find_gpu("cuda:0").uuid)
    tensors = {n: t.cuda() for n, t in mixed_tensors(1).items()}
    with d.client() as pub:
        name = pub.publish(key, tensors)
    with d.client() as c, c.acquire(key) as lease:
        assert lease.entry == name
        assert all(same(lease.tensors[n], t) for n, t in tensors.items())
        assert c.verify(name)["match"] is True


def test_engine_keeps_computing_after_the_daemon_is_sigkilled(make_daemon: Any, checkpoint: Any) -> None:  # noqa: F811
    path, _ = checkpoint
    d = make_daemon(GPU_BUDGET + gpu_model(path))
    expected = {n: t.cuda() for n, t in expected_tensors(path).items()}
    c = d.client(heartbeats=False)
    lease = c.acquire("m")
    w = lease.tensors["w.bf16"]
    before = (w.float() @ w.float().T).sum().item()
    d.proc.send_signal(signal.SIGKILL)
    assert d.proc.wait(30) == -signal.SIGKILL
    for _ in range(3):
        assert (w.float() @ w.float().T).sum().item() == before
        assert all(same(lease.tensors[n], t) for n, t in expected.items())
    torch.cuda.synchronize()
    c.close()


def test_publish_module_from_gpu_rebinds_to_the_read_only_arena(make_daemon: Any) -> None:  # noqa: F811
    from tests.integration.test_torch_attach import Tiny
    from wcd.arenas.cuda import find_gpu
    from wcd.integrations.torch import publish_module

    torch.manual_seed(2)
    m = Tiny().cuda().eval()
    ids = torch.arange(10, device="cuda")
    with torch.no_grad():
        before = [t.clone() for t in m(ids)]
    own = m.proj.weight.data_ptr()
    d = make_daemon(GPU_BUDGET)
    key = WeightCacheKey(model="tiny", transform="gpu-publish", device=find_gpu("cuda:0").uuid)
    with d.client() as c:
        lease = publish_module(c, key, m)  # device-to-device copies into the arena, then rebind
        assert lease.arena["kind"] == "cuda"
        view = lease.tensors["proj.weight"]
        assert m.proj.weight.data_ptr() == view.data_ptr() != own and m.proj.weight.is_cuda
        assert m.head.weight is m.embed.weight
        with torch.no_grad():
            for a, b in zip(before, m(ids)):
                assert torch.equal(a, b)
        del view
        lease.release()


# Loaded by the daemon under test (through PYTHONPATH): records at READY=1 whether cuda-bindings
# has been imported, and whether the ctypes driver has been loaded.
READY_PROBE_SITE = """
import os, sys
from wcd import server

_notify = server.Server._notify

def _probe(self, what, arg=None):
    if what == "ready" and not os.path.exists(os.environ["WCD_TEST_PROBE"]):
        from wcd.arenas import cudrv
        with open(os.environ["WCD_TEST_PROBE"], "w") as f:
            f.write(f"{'cuda.bindings' in sys.modules} {cudrv._driver is not None}")
    return _notify(self, what, arg)

server.Server._notify = _probe
"""


def test_a_gpu_entry_is_served_across_a_restart_and_ready_waits_for_no_cuda_bindings(
        checkpoint: Any, tmp_path: Path) -> None:  # noqa: F811
    """Restart through systemd's fd store (the test suite's stand-in): the CUDA entry is adopted,
    not read again from disk; before READY the daemon loads the driver through ctypes only (the
    budgets need `cuInit` and the GPU's memory), and imports cuda-bindings after it, to open the
    arena fd; the engine then gets the same bytes."""
    import os

    from tests.integration.test_systemd_harness import FakeSystemd
    from wcd.client import Client

    path, _ = checkpoint
    expected = expected_tensors(path)
    cfg = tmp_path / "wcd.toml"
    cfg.write_text(f'[daemon]\nsocket = "{tmp_path / "unused.sock"}"\n' + GPU_BUDGET + gpu_model(path))
    site = tmp_path / "probe-site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(READY_PROBE_SITE)
    probe = tmp_path / "probe"
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p),
           "WCD_TEST_PROBE": str(probe)}
    systemd = FakeSystemd(tmp_path)
    try:
        systemd.start(cfg)
        with Client(systemd.sock_path) as c:
            c.acquire("m").release()  # loaded from disk
        assert systemd.stop() == 0 and systemd.store  # parked
        systemd.start(cfg, env=env)
        assert probe.read_text() == "False True"  # at READY: no cuda-bindings, the ctypes driver loaded
        with Client(systemd.sock_path) as c, c.acquire("m") as lease:
            assert lease.arena["kind"] == "cuda"
            for name, t in expected.items():
                got = lease.tensors[name]
                assert got.is_cuda and same(got.cpu(), t), name
            del got
        log = systemd.log.read_text()
        assert log.count("loading m:") == 1 and "adopted m from systemd's fd store" in log  # no disk read
        assert systemd.stop() == 0
    finally:
        systemd.close()


def _compute_pids() -> set[int]:
    """The pids nvidia-smi lists as holding a CUDA context."""
    import subprocess

    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"], check=True,
                         capture_output=True, text=True).stdout
    return {int(line) for line in out.split() if line.strip().isdigit()}


def test_after_a_load_and_a_verify_the_daemon_holds_no_gpu_context(make_daemon: Any, checkpoint: Any) -> None:  # noqa: F811
    """With `staging_linger_s = 0` the daemon holds a context only while it loads or verifies; the
    verify's read mapping goes with its last reader, not with the entry. The test's own process,
    which maps the arena, is listed: the listing works here."""
    import os
    import time

    path, _ = checkpoint
    d = make_daemon("staging_linger_s = 0\n" + GPU_BUDGET + gpu_model(path))
    assert d.proc is not None
    with d.client() as c:
        with c.acquire("m") as lease:
            assert lease.tensors["w.bf16"].is_cuda
            assert c.verify("m")["match"] is True
            deadline = time.monotonic() + 10
            while d.proc.pid in (pids := _compute_pids()) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert os.getpid() in pids and d.proc.pid not in pids, pids
    assert d.stop() == 0
