"""CUDA arenas on a real GPU: export without a context, fill from safetensors, read-only leases,
survival of the exporter's death, memory return, and device identity across CUDA_VISIBLE_DEVICES.

Children run in subprocesses where a property needs a fresh process (no CUDA context yet, a fault
that poisons the context, a SIGKILLed exporter, another device enumeration).
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def child_env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **extra}


def run_child(code: str, *, pass_fds: tuple[int, ...] = (), timeout: float = 180,
              **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], pass_fds=pass_fds, env=child_env(**env),
                          capture_output=True, text=True, timeout=timeout)


def as_bytes(t: Any) -> Any:
    """The raw bytes of a tensor as a flat uint8 tensor (bit-exact comparison for any dtype)."""
    return t.contiguous().reshape(-1).view(__import__("torch").uint8)


@pytest.fixture(scope="module")
def backend() -> Any:
    from wcd.arenas.cuda import CudaBackend

    # Staging buffers smaller than the copy chunks, so the writer's splitting and buffer rotation run.
    from wcd.tuning import LoadTuning

    return CudaBackend(LoadTuning(staging_bytes=1 * MiB, staging_buffers=2))


@pytest.fixture(scope="module")
def uuid(backend: Any) -> str:
    return backend.canonical("cuda:0")


def filled_arena(backend: Any, tmp_path: Path, nbytes: int) -> tuple[Any, bytes, Path]:
    """An arena whose first `nbytes` were written through CudaWriter from a file of random bytes."""
    data = os.urandom(nbytes)
    path = tmp_path / f"blob-{nbytes}"
    path.write_bytes(data)
    arena = backend.create("cuda:0", backend.arena_size(nbytes, "cuda:0"), path.name)
    writer = arena.writer()
    fd = os.open(path, os.O_RDONLY)
    try:
        writer.copy_from_file(fd, 0, 0, nbytes)
    finally:
        os.close(fd)
        writer.close()
    return arena, data, path


def arena_desc(arena: Any) -> dict[str, Any]:
    return {"kind": arena.kind, "size": arena.size, "device": arena.device}


def test_canonical_names_and_uuid(backend: Any, uuid: str) -> None:
    import torch

    from wcd.arenas.cuda import gpus
    from wcd.errors import BadRequest

    assert re.fullmatch(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", uuid)
    assert backend.canonical(uuid) == backend.canonical(uuid.upper().replace("GPU-", "gpu-")) == uuid
    assert backend.canonical("cuda") == uuid
    assert uuid.endswith(str(torch.cuda.get_device_properties(0).uuid))
    if shutil.which("nvidia-smi"):  # the format must be exactly nvidia-smi's
        assert f"(UUID: {uuid})" in subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    with pytest.raises(BadRequest, match="not visible"):
        backend.canonical(f"cuda:{len(gpus())}")
    with pytest.raises(BadRequest, match="not visible"):
        backend.canonical("GPU-00000000-0000-0000-0000-000000000000")
    info = backend.info("cuda:0")
    assert info.device == uuid and info.name.endswith("(cuda:0)") and 0 < info.free <= info.total
    total = backend.total_memory("cuda:0")  # cuDeviceTotalMem, what start-up uses: the same memory as NVML's
    assert abs(total - info.total) <= 0.02 * info.total, (total, info.total)
    from wcd.arenas import device_memory

    assert device_memory("cuda:0") == (uuid, total)  # start-up's ctypes driver: the same GPU, the same memory
    print(f"[gpu-info] {info}")


def test_the_compute_mode_is_read_as_nvidia_smi_reports_it() -> None:
    """A GPU in exclusive-process mode must not be held through the staging linger: the mode as
    the bindings give it (an int against their enum) has to match what nvidia-smi says."""
    import subprocess

    from wcd.arenas.cuda import exclusive_process, find_gpu

    said = subprocess.run(["nvidia-smi", "--query-gpu=compute_mode", "--format=csv,noheader", "-i", "0"],
                          check=True, capture_output=True, text=True).stdout.strip()
    assert said in ("Default", "Exclusive_Process", "Prohibited"), said
    assert exclusive_process(find_gpu("cuda:0")) is (said == "Exclusive_Process")


def test_create_and_export_without_a_cuda_context() -> None:
    out = run_child("""
        import json, time
        from cuda.bindings import driver as cuda
        from wcd.arenas.cuda import CudaBackend
        from wcd.arenas.cuda_driver import _nvml
        b = CudaBackend()
        t0 = time.perf_counter()
        a = b.create("cuda:0", b.arena_size(3 << 30, "cuda:0"), "noctx")
        t1 = time.perf_counter()
        ctx = int(cuda.cuCtxGetCurrent()[1])
        active = cuda.cuDevicePrimaryCtxGetState(0)[2]
        info = b.info("cuda:0")
        active_after_info = cuda.cuDevicePrimaryCtxGetState(0)[2]
        t2 = time.perf_counter()
        w = a.writer()  # retains (creates) the primary context
        t3 = time.perf_counter()
        w.close()
        res = dict(ctx=ctx, active=bool(active), active_after_info=bool(active_after_info), fd=a.fd(),
                   size=a.size, create_ms=(t1 - t0) * 1e3, writer_ms=(t3 - t2) * 1e3, nvml=_nvml() is not None)
        a.close()
        print(json.dumps(res))
    """)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.splitlines()[-1])
    print(f"[gpu-info] create/export without context: {res}")
    assert res["ctx"] == 0 and not res["active"] and res["fd"] >= 0
    assert res["size"] >= 3 << 30 and res["size"] % (2 * MiB) == 0
    if res["nvml"]:
        assert not res["active_after_info"], "info() created a CUDA context although NVML is available"


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    d = tmp_path_factory.mktemp("ckpt")
    save_file({
        "a.bf16": torch.randn(1024, 1280, generator=g).to(torch.bfloat16),
        "a.f16": torch.randn(333, 7, generator=g).to(torch.float16),
        "a.f32": torch.randn(1000, generator=g),
        "a.scalar": torch.tensor(3.5),
        "a.empty": torch.empty(0, 4),
        "a.i64": torch.randint(-(2**62), 2**62, (17,), generator=g),
        "a.bool": torch.rand(13, generator=g) > 0.5,
    }, d / "model-00001-of-00002.safetensors")
    save_file({
        "b.fp8": torch.randn(2048, 1024, generator=g).to(torch.float8_e4m3fn),
        "b.fp8e5": torch.randn(100, generator=g).to(torch.float8_e5m2),
        "b.i8": torch.randint(-128, 127, (77,), dtype=torch.int8, generator=g),
        "b.u8": torch.randint(0, 255, (5, 3), dtype=torch.uint8, generator=g),
        "b.big": torch.randn(3 * 1024 * 1024 + 5, generator=g).to(torch.bfloat16),
        "b.odd": torch.randn(3, 5, 7, generator=g).to(torch.bfloat16),
    }, d / "model-00002-of-00002.safetensors")
    return d


def test_fill_from_safetensors_is_bit_identical(backend: Any, uuid: str, checkpoint_dir: Path) -> None:
    import torch
    from safetensors.torch import load_file

    from wcd.checkpoint import Checkpoint
    from wcd.loader import Progress, fill_arena
    from wcd.views import map_arena

    ckpt = Checkpoint.open(checkpoint_dir)
    manifest = ckpt.manifest()
    arena = backend.create(uuid, backend.arena_size(manifest.size, uuid), "fill-test")
    try:
        assert arena.kind == "cuda" and arena.device == uuid
        progress = Progress(ckpt.nbytes)
        # 3 MiB chunks over 1 MiB staging buffers: chunks are split, buffers rotate, 4 threads at once.
        fill_arena(arena, ckpt, ckpt.copy_plan(manifest, chunk=3 * MiB), progress, workers=4)
        assert progress.done == ckpt.nbytes
        ref: dict[str, torch.Tensor] = {}
        for f in sorted(checkpoint_dir.glob("*.safetensors")):
            ref.update(load_file(f))
        mapped = map_arena(arena_desc(arena), os.dup(arena.fd()), manifest, writable=False)
        assert set(mapped.tensors) == set(ref)
        for name, want in ref.items():
            got = mapped.tensors[name]
            assert got.is_cuda and got.dtype == want.dtype and got.shape == want.shape, name
            assert torch.equal(as_bytes(got.cpu()), as_bytes(want)), name
        big = mapped.tensors["b.big"].float().sum().item()
        assert big == pytest.approx(ref["b.big"].float().sum().item(), rel=1e-3)
        spec = {t.name: t for t in manifest.tensors}["b.big"]
        assert arena.read(spec.offset, spec.nbytes) == as_bytes(ref["b.big"]).numpy().tobytes()
        assert arena.read(spec.offset + 12345, 7) == as_bytes(ref["b.big"])[12345:12352].numpy().tobytes()
        del got
        mapped.close()
    finally:
        arena.close()


@pytest.mark.parametrize("window", [None, 300_000])
def test_verify_reads_back_and_compares_in_one_pass(backend: Any, uuid: str, checkpoint_dir: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch, window: int | None) -> None:
    """verify's pass over a CUDA arena (readers on the staging's lanes, copying the next window while
    one is compared with the files and hashed): the digests are those of the same bytes in a host
    arena, and one changed file byte names exactly that tensor. With 300,000-byte windows, each
    piece is copied in several, cut at odd places."""
    from wcd import loader
    from wcd.arenas import cuda
    from wcd.arenas.host import HostArena
    from wcd.checkpoint import Checkpoint
    from wcd.headers import read_header
    from wcd.loader import Progress, digest_arena, fill_arena, verify_arena

    # 1 MiB pieces: b.big (6 MiB) spans several, the small tensors share tasks.
    monkeypatch.setattr(loader, "DIGEST_CHUNK", 1 * MiB)
    if window:
        staging = backend.staging(cuda.find_gpu(uuid))
        monkeypatch.setattr(staging, "tuning", dataclasses.replace(staging.tuning, read_window=window))
    d = tmp_path / "ckpt"
    shutil.copytree(checkpoint_dir, d)
    with Checkpoint.open(d) as ckpt:
        manifest = ckpt.manifest()
        arena = backend.create(uuid, backend.arena_size(manifest.size, uuid), "verify-test")
        host = HostArena(manifest.size, "verify-test")
        try:
            for a in (arena, host):
                fill_arena(a, ckpt, ckpt.copy_plan(manifest), Progress(ckpt.nbytes), workers=4)
            want = digest_arena(host, manifest)
            assert digest_arena(arena, manifest) == want
            assert verify_arena(arena, manifest, ckpt) == (want, [])
            shard = d / "model-00002-of-00002.safetensors"
            [big] = [t for t in read_header(shard).tensors if t.name == "b.big"]
            with open(shard, "r+b") as f:
                f.seek(big.begin + 3 * MiB + 1)
                byte = f.read(1)[0]
                f.seek(big.begin + 3 * MiB + 1)
                f.write(bytes([byte ^ 1]))
            with Checkpoint.open(d) as changed:
                assert verify_arena(arena, manifest, changed) == (want, ["b.big"])
        finally:
            arena.close()
            host.close()


def test_staging_lingers_between_loads_and_cold_files_leave_the_page_cache(tmp_path: Path) -> None:
    n = 40 * MiB + 12345  # several cold reads, the last one short
    data = os.urandom(n)
    path = tmp_path / "blob"
    path.write_bytes(data)
    out = run_child(f"""
        import json, os, time
        from cuda.bindings import driver as cuda
        from wcd.arenas.cuda import CudaBackend, find_gpu
        from wcd.loader import cached_fraction

        def active():
            return bool(cuda.cuDevicePrimaryCtxGetState(0)[2])

        def load(b, fd, fraction):
            a = b.create("cuda:0", b.arena_size({n}, "cuda:0"), "linger")
            w = a.writer()
            w.hint(fd, fraction)
            w.copy_from_file(fd, 0, 0, {n})
            w.close()
            return a

        fd = os.open({str(path)!r}, os.O_RDONLY)
        os.fsync(fd)
        res = {{}}
        a = load(CudaBackend(linger_s=0), fd, 1.0)
        deadline = time.monotonic() + 5  # released on a thread of its own, after the load
        while active() and time.monotonic() < deadline:
            time.sleep(0.02)
        res["active_after_unlingering_load"] = active()
        a.close()
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        res["cached_before"] = cached_fraction(fd)
        b = CudaBackend(linger_s=1.5)
        a = load(b, fd, res["cached_before"])
        deadline = time.monotonic() + 10  # dropped in the background, after the load
        while cached_fraction(fd) >= 0.1 and time.monotonic() < deadline:
            time.sleep(0.05)
        res["cached_after_cold_load"] = cached_fraction(fd)
        res["active_while_lingering"] = active()
        staging = b.staging(find_gpu("cuda:0"))
        res["pooled"] = len(staging._free)
        res["lane_bytes"] = staging._free[0].nbytes
        res["cold_bytes_ok"] = a.read(0, {n}) == open({str(path)!r}, "rb").read()
        a.close()
        a = load(b, fd, 1.0)  # warm, from the pooled lane
        res["pooled_reused"] = len(staging._free)
        res["warm_bytes_ok"] = a.read(0, {n}) == open({str(path)!r}, "rb").read()
        a.close()
        time.sleep(3)
        res["active_after_linger"] = active()
        print(json.dumps(res))
    """)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.splitlines()[-1])
    print(f"[gpu-info] staging: {res}")
    assert not res["active_after_unlingering_load"], "linger 0 kept the context"
    assert res["cold_bytes_ok"] and res["warm_bytes_ok"]
    assert res["active_while_lingering"] and res["pooled"] == 1 and res["pooled_reused"] == 1
    assert res["lane_bytes"] == 16 * MiB, "a cold read did not grow the lane to large reads"
    assert not res["active_after_linger"], "the context outlived staging_linger_s"
    if res["cached_before"] < 0.02:  # the file system honours DONTNEED: the cold load must too
        assert res["cached_after_cold_load"] < 0.1, "a cold load left the file in the page cache"


def test_cold_files_are_read_with_o_direct_exactly_and_stay_out_of_the_page_cache(tmp_path: Path) -> None:
    """The default `cold_reads = "direct"`: 512 KiB O_DIRECT reads (`LoadTuning.direct_read_bytes`) from an
    unaligned offset to an unaligned end, their copies queued keeping the GIL (`HeldCalls`), land
    byte for byte; the lanes keep their 4 MiB buffers (nothing larger pinned) and the file's pages
    never enter the page cache."""
    n = 40 * MiB + 12345
    data = os.urandom(n)
    path = tmp_path / "blob"
    path.write_bytes(data)
    out = run_child(f"""
        import json, os
        from wcd.arenas import cuda
        from wcd.loader import cached_fraction

        fd = os.open({str(path)!r}, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        res = {{"cached_before": cached_fraction(fd)}}
        b = cuda.CudaBackend(linger_s=30)
        b.configure(30, direct_reads=True)
        a = b.create("cuda:0", b.arena_size({n}, "cuda:0"), "direct")
        w = a.writer()
        w.hint(fd, 0.05)  # cold, but not dropped after the load: the check below is O_DIRECT's alone
        w.copy_from_file(fd, 4095, 0, {n} - 4095)
        res["direct"] = bool(w._direct)
        w.close()
        res["cached_after"] = cached_fraction(fd)
        staging = b.staging(cuda.find_gpu("cuda:0"))
        res["lane_bytes"] = max(lane.nbytes for lane in staging._free)
        res["read_bytes"] = b.tuning.direct_read_bytes
        res["bytes_ok"] = a.read(0, {n} - 4095) == open({str(path)!r}, "rb").read()[4095:]
        a.close()
        b.release()
        print(json.dumps(res))
    """)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.splitlines()[-1])
    print(f"[gpu-info] direct: {res}")
    if res["cached_before"] >= 0.02:
        pytest.skip(f"{tmp_path}'s file system keeps the file in the page cache: no cold read to test")
    if not res["direct"]:
        pytest.skip(f"{tmp_path}'s file system refuses O_DIRECT")
    assert res["bytes_ok"], "an O_DIRECT cold load put wrong bytes in the arena"
    assert res["read_bytes"] == 512 << 10 and res["lane_bytes"] == 4 * MiB, "a direct load grew its lanes"
    assert res["cached_after"] < 0.02, "an O_DIRECT load left the file in the page cache"


def test_write_through_a_read_lease_faults_in_the_client_only(backend: Any, tmp_path: Path) -> None:
    n = 4 * MiB
    arena, data, _ = filled_arena(backend, tmp_path, n)
    fd = os.dup(arena.fd())
    try:
        out = run_child(f"""
            import sys, torch
            from wcd.manifest import Manifest
            from wcd.views import map_arena
            m = Manifest.build([("w", "U8", [{n}])])
            t = map_arena({arena_desc(arena)!r}, {fd}, m, writable=False).tensors["w"]
            print("MAPPED", int(t[:4096].sum()))
            try:
                t.fill_(7)
                torch.cuda.synchronize()
            except Exception as e:
                print("FAULT", type(e).__name__, str(e).splitlines()[0])
                sys.exit(3)
            print("WROTE")
        """, pass_fds=(fd,))
    finally:
        os.close(fd)
    print(f"[gpu-info] read-lease write: rc={out.returncode} {out.stdout.strip()!r}")
    assert "MAPPED" in out.stdout, out.stderr
    assert "WROTE" not in out.stdout and out.returncode != 0
    assert arena.read(0, n) == data
    arena.close()


def test_fill_lease_maps_writable_and_unmaps_only_without_views(backend: Any) -> None:
    import torch

    from wcd.errors import BadRequest
    from wcd.manifest import Manifest
    from wcd.views import map_arena

    n = 1 << 20
    arena = backend.create("cuda:0", backend.arena_size(4 * n, "cuda:0"), "publish")
    try:
        fill = map_arena(arena_desc(arena), os.dup(arena.fd()), Manifest.build([("w", "F32", [n])]), writable=True)
        src = torch.randn(n, device="cuda:0")
        t = fill.tensors["w"]
        t.copy_(src)
        torch.cuda.synchronize()
        with pytest.raises(BadRequest, match="still referenced"):
            fill.unmap_writable()
        del t
        fill.unmap_writable()
        assert arena.read(0, 4 * n) == src.cpu().numpy().tobytes()
    finally:
        arena.close()


def test_closing_every_fd_and_mapping_returns_the_memory(backend: Any) -> None:
    import torch

    from wcd.manifest import Manifest
    from wcd.views import map_arena

    def free() -> int:
        torch.cuda.synchronize()
        return torch.cuda.mem_get_info(0)[0]

    size = 2 << 30
    torch.zeros(1, device="cuda:0")  # context exists before the first measurement
    free0 = free()
    arena = backend.create("cuda:0", backend.arena_size(size, "cuda:0"), "mem")
    assert free0 - free() >= size
    spare = os.dup(arena.fd())  # e.g. parked in systemd's fd store
    mapped = map_arena(arena_desc(arena), os.dup(arena.fd()), Manifest.build([("w", "U8", [size])]), writable=False)
    t = mapped.tensors["w"]
    arena.close()  # the daemon lets go: handle released, its fd closed
    mapped.close()  # the client forgets its views, but `t` is still referenced
    assert int(t[-1].item()) >= 0 and free0 - free() >= size
    del t
    gc.collect()
    assert free0 - free() >= size, "memory returned while an exported fd was still open"
    os.close(spare)
    assert free() >= free0 - 64 * MiB, "memory not returned after the last fd and mapping closed"


def test_client_keeps_computing_after_the_exporter_is_sigkilled(tmp_path: Path) -> None:
    n = 8 * MiB
    path = tmp_path / "blob"
    path.write_bytes(os.urandom(n))
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    exporter = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, socket, time
        from wcd.arenas.cuda import CudaBackend
        b = CudaBackend()
        a = b.create("cuda:0", b.arena_size({n}, "cuda:0"), "exporter")
        w = a.writer()
        fd = os.open({str(path)!r}, os.O_RDONLY)
        w.copy_from_file(fd, 0, 0, {n})
        w.close()
        socket.send_fds(socket.socket(fileno={theirs.fileno()}), [f"{{a.size}} {{a.device}}".encode()], [a.fd()])
        time.sleep(600)
    """)], pass_fds=(theirs.fileno(),), env=child_env())
    theirs.close()
    client = None
    try:
        msg, fds, _, _ = socket.recv_fds(ours, 1024, 1)
        assert fds, "the exporter sent no fd"
        size, device = msg.decode().split()
        client = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
            import sys, torch
            from wcd.manifest import Manifest
            from wcd.views import map_arena
            t = map_arena({{"kind": "cuda", "size": {size}, "device": {device!r}}}, {fds[0]},
                          Manifest.build([("w", "U8", [{n}])]), writable=False).tensors["w"]
            want = torch.frombuffer(bytearray(open({str(path)!r}, "rb").read()), dtype=torch.uint8).cuda()
            assert torch.equal(t, want)
            print("READY", flush=True)
            sys.stdin.readline()  # the exporter is dead now
            for _ in range(5):
                assert torch.equal(t, want)
                assert torch.equal((t.to(torch.int32) * 3 - 1).sum(), (want.to(torch.int32) * 3 - 1).sum())
            torch.cuda.synchronize()
            print("OK", flush=True)
        """)], pass_fds=(fds[0],), env=child_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
        os.close(fds[0])
        assert client.stdout is not None and client.stdin is not None
        ready, _, _ = select.select([client.stdout], [], [], 180)
        line = client.stdout.readline().strip() if ready else ""
        if line != "READY":
            client.kill()
            pytest.fail(f"client not ready ({line!r}): {client.communicate()[1][-3000:]}")
        exporter.send_signal(signal.SIGKILL)
        assert exporter.wait(30) == -signal.SIGKILL
        client.stdin.write("go\n")
        client.stdin.flush()
        out, err = client.communicate(timeout=120)
        assert client.returncode == 0 and "OK" in out, err
    finally:
        ours.close()
        for p in (exporter, client):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


def test_client_finds_the_gpu_by_uuid_under_another_visible_devices_order(backend: Any, tmp_path: Path) -> None:
    from wcd.arenas.cuda import gpus

    n = 2 * MiB
    arena, _, path = filled_arena(backend, tmp_path, n)
    uuids = [g.uuid for g in gpus()]
    # Reversed enumeration: the daemon's cuda:0 is the client's cuda:{len-1}. On one GPU this still
    # exercises the lookup by UUID through a UUID-valued CUDA_VISIBLE_DEVICES.
    order = ",".join(reversed(uuids))
    code = f"""
        import torch
        from wcd.arenas.cuda import find_gpu
        from wcd.errors import BadRequest
        from wcd.manifest import Manifest
        from wcd.views import map_arena
        try:
            t = map_arena({arena_desc(arena)!r}, FD, Manifest.build([("w", "U8", [{n}])]), writable=False).tensors["w"]
        except BadRequest as e:
            print("BADREQUEST", e)
            raise SystemExit(0)
        assert t.device.index == find_gpu({arena.device!r}).ordinal == {len(uuids) - 1}
        assert bytes(t.cpu().numpy()) == open({str(path)!r}, "rb").read()
        print("OK", t.device)
    """
    try:
        for visible, expect in ((order, "OK"), ("", "BADREQUEST")):
            fd = os.dup(arena.fd())
            try:
                out = run_child(code.replace("FD", str(fd)), pass_fds=(fd,), CUDA_VISIBLE_DEVICES=visible)
            finally:
                os.close(fd)
            print(f"[gpu-info] CUDA_VISIBLE_DEVICES={visible!r}: {out.stdout.strip()!r}")
            assert out.returncode == 0 and out.stdout.startswith(expect), out.stderr
        assert "not visible to this process" in out.stdout
    finally:
        arena.close()


def test_adopt_a_parked_arena_fd_after_a_restart(backend: Any, tmp_path: Path) -> None:
    from wcd.errors import BadRequest

    n = 3 * MiB
    arena, data, _ = filled_arena(backend, tmp_path, n)
    parked = os.dup(arena.fd())  # what systemd's fd store hands back to the next daemon
    device, size = arena.device, arena.size
    arena.close()  # the old daemon is gone
    adopted = backend.adopt(parked, device, size, "adopted")
    try:
        adopted.check_adopted()
        assert adopted.fd() == parked and adopted.size == size and adopted.read(0, n) == data
        # adopt() cannot tell a short allocation without a context; the check after READY does.
        too_big = backend.adopt(os.dup(parked), device, size + 2 * MiB, "too-big")
        try:
            with pytest.raises(BadRequest, match="too-big: the arena is smaller than"):
                too_big.check_adopted()
        finally:
            too_big.close()
    finally:
        adopted.close()
    out = run_child("""
        import os
        from wcd.arenas.cuda import CudaBackend
        from wcd.errors import BadRequest
        fd = os.memfd_create("not-cuda")
        os.ftruncate(fd, 2 << 20)
        try:
            CudaBackend().adopt(fd, "cuda:0", 2 << 20, "memfd")
        except BadRequest as e:
            print("BADREQUEST", e)
    """)
    print(f"[gpu-info] adopt a memfd: {out.stdout.strip()!r}")
    assert out.stdout.startswith("BADREQUEST") and "not an exported CUDA arena" in out.stdout, out.stderr


def test_adopting_an_arena_creates_no_cuda_context(backend: Any, tmp_path: Path) -> None:
    """What the daemon does before READY after a restart (`adopt`) leaves the primary context
    alone: creating it takes ~0.25 s on an H200. Only `check_adopted`, after READY, retains it,
    and it releases it again (at once with staging_linger_s = 0)."""
    n = MiB
    arena, data, _ = filled_arena(backend, tmp_path, n)
    fd, sha = os.dup(arena.fd()), hashlib.sha256(data).hexdigest()
    code = f"""
        import hashlib, time
        from cuda.bindings import driver as cuda
        from wcd.arenas.cuda import CudaBackend, find_gpu

        def active():
            err, flags, on = cuda.cuDevicePrimaryCtxGetState(find_gpu("{arena.device}").ordinal)
            assert err == cuda.CUresult.CUDA_SUCCESS, err
            return int(on)

        adopted = CudaBackend(linger_s=0).adopt({fd}, "{arena.device}", {arena.size}, "adopted")
        after_adopt = active()
        adopted.check_adopted()
        deadline = time.monotonic() + 5  # released on a thread of its own once the check ends
        while active() and time.monotonic() < deadline:
            time.sleep(0.02)
        print("CTX", after_adopt, active(), hashlib.sha256(adopted.read(0, {n})).hexdigest() == "{sha}")
    """
    try:
        out = run_child(code, pass_fds=(fd,))
    finally:
        os.close(fd)
        arena.close()
    print(f"[gpu-info] primary context active after adopt, after check_adopted, data: {out.stdout.strip()!r}")
    assert out.returncode == 0 and out.stdout.strip() == "CTX 0 0 True", out.stderr


def test_out_of_memory_is_one_clear_line(backend: Any, uuid: str) -> None:
    from wcd.errors import OutOfMemory

    too_big = backend.arena_size(2 * backend.info(uuid).total, uuid)
    with pytest.raises(OutOfMemory) as e:
        backend.create(uuid, too_big, "huge")
    print(f"[gpu-info] OOM: {e.value}")
    assert "\n" not in str(e.value) and uuid in str(e.value)
