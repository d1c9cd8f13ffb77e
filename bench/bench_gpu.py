"""GPU benchmark: how engines get weights onto a GPU, side by side, in one run.

(a) safetensors `load_file(device="cuda:0")`; (b) per-tensor legacy CUDA IPC (`reduce_tensor`, as
vLLM's / SGLang's weight daemons do), timed in the consumer; (c) wcd attach (one VMM fd + manifest,
map, views), timed in the client from request to usable tensors; (d) a cold load into a wcd arena
(`fill_arena` + CudaWriter) against (a) and the pinned host-to-device bandwidth of this machine.
Every role runs in its own process; the checkpoint is synthetic bf16 and read once first (page
cache warm). Usage: bench_gpu.py --dir /path/on/local/disk --out results.json [--size-gb 32]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout without installing

GB = 1e9
GiB = 1 << 30
MiB = 1 << 20
HIDDEN = 4096  # columns of every large tensor


# -- orchestration ---------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, type=Path, help="where the synthetic checkpoint lives (local disk)")
    ap.add_argument("--out", required=True, type=Path, help="JSON results")
    ap.add_argument("--size-gb", type=float, default=32.0, help="checkpoint size in GB (default 32)")
    ap.add_argument("--tensors", type=int, default=1000, help="tensor count (default 1000)")
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--fill", default="default,16x4,8x8",
                    help="fill configurations: WORKERSxSTAGING_MiB, 'default' = the daemon's (default: %(default)s)")
    ap.add_argument("--parts", default="h2d,load_file,ipc,wcd,daemon", help="which measurements (default: all)")
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("--arg", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role:
        print(json.dumps(ROLES[args.role](args)), flush=True)
        return

    ckpt = ensure_checkpoint(args.dir, args.size_gb, args.tensors, args.shards)
    results: dict[str, Any] = {"checkpoint": ckpt, "machine": machine()}
    results["page_cache_warm_s"] = warm_page_cache(args.dir)
    parts = set(args.parts.split(","))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for part in ("h2d", "load_file", "ipc", "wcd", "daemon"):
        if part in parts:
            results[part] = run_daemon(args) if part == "daemon" else role(args, part)
            print(f"[bench] {part}: {json.dumps(results[part])}", file=sys.stderr, flush=True)
            args.out.write_text(json.dumps(results, indent=2))  # partial results survive a timeout
    print_table(results)


def role(args: argparse.Namespace, name: str, arg: str = "") -> dict[str, Any]:
    """Run `name` in a fresh process of this script and return its JSON result."""
    cmd = [sys.executable, __file__, "--dir", str(args.dir), "--out", str(args.out), "--fill", args.fill,
           "--role", name, "--arg", arg]
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=3600)
    if out.returncode != 0:
        return {"error": f"role {name} exited with {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def machine() -> dict[str, Any]:
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,uuid,driver_version,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True)
    return {"gpu": smi.stdout.strip(), "cpus": os.cpu_count(), "python": sys.version.split()[0]}


def shard_files(d: Path) -> list[Path]:
    return sorted(d.glob("*.safetensors"))


def ensure_checkpoint(d: Path, size_gb: float, tensors: int, shards: int) -> dict[str, Any]:
    """Write (once) a bf16 checkpoint: 3 of 4 tensors are large [rows, 4096] matrices, 1 of 4 small."""
    spec = {"size_gb": size_gb, "tensors": tensors, "shards": shards, "dtype": "BF16"}
    marker = d / "bench-checkpoint.json"
    if marker.exists() and json.loads(marker.read_text()).get("spec") == spec:
        return json.loads(marker.read_text())
    d.mkdir(parents=True, exist_ok=True)
    for f in shard_files(d):
        f.unlink()
    t0 = time.perf_counter()
    gen = subprocess.run([sys.executable, __file__, "--dir", str(d), "--out", "-", "--role", "gen",
                          "--arg", json.dumps(spec)], stdout=subprocess.PIPE, text=True, check=True)
    info = {"spec": spec, **json.loads(gen.stdout.strip().splitlines()[-1]), "write_s": time.perf_counter() - t0}
    marker.write_text(json.dumps(info))
    return info


def warm_page_cache(d: Path) -> float:
    """Read every shard once with a few threads so all timed reads come from the page cache."""
    t0 = time.perf_counter()

    def read(f: Path) -> None:
        buf = bytearray(64 * MiB)
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass

    threads = [threading.Thread(target=read, args=(f,)) for f in shard_files(d)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def run_daemon(args: argparse.Namespace) -> dict[str, Any]:
    """The real path: `wcd serve` loads the checkpoint onto cuda:0, a client process acquires it."""
    from wcd.client import connect
    from wcd.errors import DaemonUnavailable

    with tempfile.TemporaryDirectory() as tmp:
        sock, cfg = Path(tmp) / "wcd.sock", Path(tmp) / "wcd.toml"
        cfg.write_text(f'[daemon]\nsocket = "{sock}"\n[daemon.budget]\n"cuda:0" = "90%"\n')
        log = open(Path(tmp) / "daemon.log", "w+")
        daemon = subprocess.Popen([sys.executable, "-m", "wcd", "serve", "--config", str(cfg)], stdout=log,
                                  stderr=subprocess.STDOUT, cwd=HERE.parent)
        try:
            try:
                c = connect(sock, wait_s=60, while_alive=lambda: daemon.poll() is None, heartbeats=False)
            except DaemonUnavailable:
                log.seek(0)
                return {"error": f"daemon did not start: {log.read()[-2000:]}"}
            with c:
                t0 = time.perf_counter()
                c.load("bench", args.dir, device="cuda:0", wait=True)
                load_s = time.perf_counter() - t0
                out: dict[str, Any] = {"load_s": load_s, "client": role(args, "daemon_client", str(sock))}
                t0 = time.perf_counter()
                out["verify_match"] = c.verify("bench").get("match")
                out["verify_s"] = time.perf_counter() - t0
            return out
        finally:
            daemon.terminate()
            daemon.wait(60)
            log.close()


# -- roles (each in its own process) ---------------------------------------------------------


def role_gen(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from safetensors.torch import save_file

    spec = json.loads(args.arg)
    n, shards = spec["tensors"], spec["shards"]
    small = HIDDEN  # a norm-like vector
    n_small = n // 4
    rows = max(1, int((spec["size_gb"] * GB - n_small * small * 2) / (n - n_small) / (HIDDEN * 2)))
    shapes = [(small,) if i % 4 == 3 else (rows, HIDDEN) for i in range(n)]
    per_shard = -(-n // shards)
    gen = torch.Generator(device="cuda").manual_seed(1234)
    nbytes = 0
    for s in range(shards):
        chunk = {f"model.layers.{i // 4}.w{i % 4}": torch.randn(shapes[i], generator=gen, device="cuda",
                                                                dtype=torch.bfloat16).cpu()
                 for i in range(s * per_shard, min(n, (s + 1) * per_shard))}
        if chunk:
            save_file(chunk, args.dir / f"model-{s + 1:05d}-of-{shards:05d}.safetensors")
            nbytes += sum(t.numel() * 2 for t in chunk.values())
    return {"bytes": nbytes, "tensors": n, "files": len(shard_files(args.dir))}


def _cuda_client_start() -> tuple[Any, dict[str, float]]:
    """import torch and create the CUDA context, timed: what an engine pays before any weights."""
    t0 = time.perf_counter()
    import torch

    t1 = time.perf_counter()
    torch.cuda.init()
    torch.empty(1, device="cuda:0")
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return torch, {"import_torch_s": t1 - t0, "cuda_context_s": t2 - t1}


def role_h2d(args: argparse.Namespace) -> dict[str, Any]:
    torch, _ = _cuda_client_start()
    src = torch.empty(4 * GiB, dtype=torch.uint8, pin_memory=True).fill_(0x5A)
    dst = torch.empty(4 * GiB, dtype=torch.uint8, device="cuda:0")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    s = statistics.median(times)
    pageable = torch.empty(GiB, dtype=torch.uint8).fill_(0x5A)
    dst[:GiB].copy_(pageable)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    dst[:GiB].copy_(pageable)
    torch.cuda.synchronize()
    pageable_s = time.perf_counter() - t0
    return {"bytes": 4 * GiB, "median_s": s, "gb_s": 4 * GiB / s / GB, "pageable_1gib_gb_s": GiB / pageable_s / GB}


def role_load_file(args: argparse.Namespace) -> dict[str, Any]:
    torch, start = _cuda_client_start()
    from safetensors.torch import load_file

    t0 = time.perf_counter()
    tensors: dict[str, Any] = {}
    for f in shard_files(args.dir):
        tensors.update(load_file(f, device="cuda:0"))
    torch.cuda.synchronize()
    s = time.perf_counter() - t0
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return {**start, "seconds": s, "bytes": nbytes, "tensors": len(tensors), "gb_s": nbytes / s / GB}


def role_ipc(args: argparse.Namespace) -> dict[str, Any]:
    """Producer: load to the GPU, export every tensor with reduce_tensor, start the consumer."""
    torch, _ = _cuda_client_start()
    from safetensors.torch import load_file
    from torch.multiprocessing.reductions import reduce_tensor

    tensors: dict[str, Any] = {}
    for f in shard_files(args.dir):
        tensors.update(load_file(f, device="cuda:0"))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    handles = [(name, reduce_tensor(t)) for name, t in tensors.items()]
    export_s = time.perf_counter() - t0
    names = sorted(tensors)
    sample = [names[0], names[len(names) // 2], names[-1]]
    checks = {n: tensors[n].float().sum().item() for n in sample}
    with tempfile.NamedTemporaryFile(suffix=".pkl", delete=False) as fh:
        pickle.dump({"handles": handles, "checks": checks}, fh)
    try:
        consumer = role(args, "ipc_consumer", fh.name)
    finally:
        os.unlink(fh.name)
    return {**consumer, "producer_export_s": export_s, "tensors": len(tensors)}


def role_ipc_consumer(args: argparse.Namespace) -> dict[str, Any]:
    torch, start = _cuda_client_start()
    t0 = time.perf_counter()
    with open(args.arg, "rb") as fh:
        msg = pickle.load(fh)  # what vLLM's / SGLang's daemons send: pickled rebuild calls
    tensors = {name: fn(*fargs) for name, (fn, fargs) in msg["handles"]}
    torch.cuda.synchronize()
    s = time.perf_counter() - t0
    ok = all(abs(tensors[n].float().sum().item() - v) <= 1e-3 * max(1.0, abs(v)) for n, v in msg["checks"].items())
    return {**start, "attach_s": s, "tensors": len(tensors), "data_ok": ok}


def role_wcd(args: argparse.Namespace) -> dict[str, Any]:
    """The daemon side, without the daemon (no torch in this process): fill arenas with each
    configuration, then with the daemon's split into phases, and hand that arena to a client
    process over SCM_RIGHTS as the daemon would."""
    from wcd.arenas.cuda import STAGING_BYTES, CudaBackend, find_gpu, release_context, retain_context
    from wcd.checkpoint import Checkpoint
    from wcd.loader import Progress, default_workers, fill_arena

    ckpt = Checkpoint.open(args.dir)
    manifest = ckpt.manifest()
    ops = ckpt.copy_plan(manifest)
    gpu = find_gpu("cuda:0")
    t0 = time.perf_counter()
    retain_context(gpu)
    ctx_s = time.perf_counter() - t0
    release_context(gpu)
    out: dict[str, Any] = {"bytes": ckpt.nbytes, "tensors": len(manifest.tensors), "context_create_s": ctx_s,
                           "page_cache_read": read_throughput(ckpt, default_workers()), "fills": []}
    arena = None
    for cfg in args.fill.split(","):
        workers, staging = (default_workers(), STAGING_BYTES // MiB) if cfg == "default" else map(int, cfg.split("x"))
        if arena is not None:
            arena.close()
        backend = CudaBackend(staging_bytes=staging * MiB)
        t0 = time.perf_counter()
        arena = backend.create(gpu.uuid, backend.arena_size(manifest.size, gpu.uuid), "bench")
        t1 = time.perf_counter()
        fill_arena(arena, ckpt, ops, Progress(ckpt.nbytes), workers=workers)
        t2 = time.perf_counter()
        out["fills"].append({"config": cfg, "workers": workers, "staging_mib": staging, "create_s": t1 - t0,
                             "fill_s": t2 - t1, "gb_s": ckpt.nbytes / (t2 - t0) / GB})
        print(f"[bench] fill {out['fills'][-1]}", file=sys.stderr, flush=True)
    if arena is not None:
        arena.close()
    # The daemon's configuration once more, split into phases; this arena is then verified and attached.
    backend = CudaBackend()
    arena = backend.create(gpu.uuid, backend.arena_size(manifest.size, gpu.uuid), "bench")
    out["fill_phases"] = {**fill_phases(arena, ckpt, ops, default_workers()), "staging_mib": STAGING_BYTES // MiB}
    out["fill_data_ok"] = check_arena(arena, ckpt, manifest)
    out["arena_read"] = read_arena(arena, default_workers())

    ours, theirs = socket.socketpair()
    client = subprocess.Popen([sys.executable, __file__, "--dir", str(args.dir), "--out", "-", "--role",
                               "wcd_client", "--arg", str(theirs.fileno())], pass_fds=(theirs.fileno(),),
                              stdout=subprocess.PIPE, text=True)
    theirs.close()
    ours.recv(1)  # the client is ready and starts its clock
    body = json.dumps({"arena": {"kind": arena.kind, "size": arena.size, "device": arena.device},
                       "manifest": manifest.to_wire()}).encode()
    socket.send_fds(ours, [len(body).to_bytes(8, "big") + body], [arena.fd()])
    stdout, _ = client.communicate(timeout=600)
    arena.close()
    out["client"] = json.loads(stdout.strip().splitlines()[-1])
    out["path"] = "direct: export -> SCM_RIGHTS -> map (no daemon, no wcd.client)"
    return out


def read_throughput(ckpt: Any, workers: int) -> dict[str, Any]:
    """Page cache -> user memory with the loader's thread count: the ceiling of the staging reads."""
    from concurrent.futures import ThreadPoolExecutor

    ops = ckpt.copy_plan(ckpt.manifest())
    fds = {h.file: os.open(h.file, os.O_RDONLY) for h in ckpt.headers}
    local = threading.local()

    def read(op: Any) -> None:
        if not hasattr(local, "buf"):
            local.buf = memoryview(bytearray(64 * MiB))  # a copy-plan chunk
        os.preadv(fds[op.file], [local.buf[: op.nbytes]], op.file_offset)

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(read, ops))  # first pass: this VM's first touch of fresh memory is slow
        t0 = time.perf_counter()
        list(pool.map(read, ops))
        s = time.perf_counter() - t0
    for fd in fds.values():
        os.close(fd)
    return {"workers": workers, "seconds": s, "gb_s": ckpt.nbytes / s / GB}


def fill_phases(arena: Any, ckpt: Any, ops: list[Any], workers: int) -> dict[str, float]:
    """One fill split into its fixed costs (context + mapping, pinned staging per thread) and the
    data path, by driving the writer the way `fill_arena` does."""
    from concurrent.futures import ThreadPoolExecutor

    fds = {h.file: os.open(h.file, os.O_RDONLY) for h in ckpt.headers}
    first = ops[0]
    barrier = threading.Barrier(workers)

    def warm(_: int) -> None:  # every thread sets up its lane; the bytes are the right ones
        writer.copy_from_file(fds[first.file], first.file_offset, first.arena_offset, min(256, first.nbytes))
        barrier.wait()

    t0 = time.perf_counter()
    writer = arena.writer()
    t1 = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(warm, range(workers)))
        t2 = time.perf_counter()
        list(pool.map(lambda op: writer.copy_from_file(fds[op.file], op.file_offset, op.arena_offset, op.nbytes),
                      ops))
    t3 = time.perf_counter()
    writer.close()
    t4 = time.perf_counter()
    for fd in fds.values():
        os.close(fd)
    return {"workers": workers, "writer_open_s": t1 - t0, "staging_setup_s": t2 - t1, "data_s": t3 - t2,
            "close_s": t4 - t3, "data_gb_s": ckpt.nbytes / (t3 - t2) / GB}


def read_arena(arena: Any, workers: int) -> dict[str, float]:
    """Device -> host through `Arena.read` in 64 MiB pieces (what `verify` does, without hashing),
    over the first 4 GiB at most."""
    from concurrent.futures import ThreadPoolExecutor

    end = min(arena.size, 4 * GiB)
    chunks = [(off, min(64 * MiB, end - off)) for off in range(0, end, 64 * MiB)]
    arena.read(0, 1)  # maps the arena read-only once
    t0 = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda c: arena.read(*c), chunks))
    s = time.perf_counter() - t0
    return {"bytes": end, "seconds": s, "gb_s": end / s / GB}


def check_arena(arena: Any, ckpt: Any, manifest: Any) -> bool:
    """Compare a few tensors read back from the arena with the file bytes."""
    where = {t.name: t for t in manifest.tensors}
    stored = [t for h in ckpt.headers for t in h.tensors]
    files = {t.name: h.file for h in ckpt.headers for t in h.tensors}
    for t in (stored[0], stored[len(stored) // 2], stored[-1]):
        with open(files[t.name], "rb") as fh:
            fh.seek(t.begin)
            if arena.read(where[t.name].offset, t.end - t.begin) != fh.read(t.end - t.begin):
                return False
    return True


def role_wcd_client(args: argparse.Namespace) -> dict[str, Any]:
    torch, start = _cuda_client_start()
    t_imp = time.perf_counter()
    from wcd.arenas.cuda_map import map_cuda_arena
    from wcd.manifest import Manifest
    from wcd.views import build_views, map_arena

    imports_s = time.perf_counter() - t_imp
    sock = socket.socket(fileno=int(args.arg))
    t0 = time.perf_counter()
    sock.send(b"?")  # "acquire"
    head, fds, _, _ = socket.recv_fds(sock, 8, 1)
    size = int.from_bytes(head, "big")
    body = bytearray()
    while len(body) < size:
        body += sock.recv(size - len(body))
    t1 = time.perf_counter()
    msg = json.loads(body)
    manifest = Manifest.from_wire(msg["manifest"])
    t2 = time.perf_counter()
    spare = os.dup(fds[0])
    mapped = map_arena(msg["arena"], fds[0], manifest, writable=False)
    t3 = time.perf_counter()
    ok = usable(torch, args.dir, mapped.tensors)
    # The same attach again, split: driver import + map + one base tensor, then the views.
    t4 = time.perf_counter()
    base, mapping = map_cuda_arena(spare, msg["arena"]["size"], msg["arena"]["device"], False)
    t5 = time.perf_counter()
    views = build_views(base, manifest)
    t6 = time.perf_counter()
    os.close(spare)
    del base, views
    mapping.close()
    return {**start, "wcd_imports_s": imports_s, "attach_s": t3 - t0, "recv_s": t1 - t0,
            "manifest_decode_s": t2 - t1, "map_and_views_s": t3 - t2, "tensors": len(mapped.tensors),
            "data_ok": ok, "again_map_s": t5 - t4, "again_views_s": t6 - t5}


def usable(torch: Any, d: Path, tensors: dict[str, Any]) -> bool:
    """A few tensors equal the files' bytes, and every tensor can be computed on."""
    from safetensors import safe_open

    names = sorted(tensors)
    sample = {names[0], names[len(names) // 2], names[-1]}
    ok = True
    for f in shard_files(d):
        with safe_open(f, "pt", device="cpu") as fh:
            for n in sample & set(fh.keys()):
                ok &= torch.equal(fh.get_tensor(n).cuda(), tensors[n])
    total = sum(t.float().sum() for t in tensors.values())
    return bool(ok) and bool(torch.isfinite(total))


def role_daemon_client(args: argparse.Namespace) -> dict[str, Any]:
    torch, start = _cuda_client_start()
    t_imp = time.perf_counter()
    import wcd.arenas.cuda_map  # noqa: F401  (what an engine has imported before it attaches)
    import wcd.views  # noqa: F401
    from wcd.client import Client

    imports_s = time.perf_counter() - t_imp
    t0 = time.perf_counter()
    c = Client(args.arg, heartbeats=False)
    t1 = time.perf_counter()
    lease = c.acquire("bench")
    tensors = lease.tensors
    t2 = time.perf_counter()
    ok = usable(torch, args.dir, tensors)
    lease.release()
    c.close()
    return {**start, "wcd_imports_s": imports_s, "attach_s": t2 - t0, "connect_s": t1 - t0, "acquire_s": t2 - t1,
            "tensors": len(tensors), "data_ok": ok}


ROLES = {"gen": role_gen, "h2d": role_h2d, "load_file": role_load_file, "ipc": role_ipc,
         "ipc_consumer": role_ipc_consumer, "wcd": role_wcd, "wcd_client": role_wcd_client,
         "daemon_client": role_daemon_client}


# -- report ----------------------------------------------------------------------------------


def print_table(r: dict[str, Any]) -> None:
    rows: list[tuple[str, str, str, str]] = []

    def row(what: str, seconds: float | None, gbs: float | None = None, note: str = "") -> None:
        rows.append((what, f"{seconds:.4f}" if seconds is not None else "-", f"{gbs:.1f}" if gbs else "", note))

    ck = r["checkpoint"]
    print(f"\ncheckpoint: {ck['bytes'] / GB:.2f} GB in {ck['tensors']} bf16 tensors, {ck['files']} shards; "
          f"GPU: {r['machine']['gpu']}; {r['machine']['cpus']} CPUs")
    h2d = r.get("h2d", {})
    lf = r.get("load_file", {})
    ipc = r.get("ipc", {})
    w = r.get("wcd", {})
    for name, part in (("h2d", h2d), ("load_file", lf), ("ipc", ipc), ("wcd", w)):
        if "error" in part:
            print(f"!! {name}: {part['error']}")
    if "gb_s" in h2d:
        row("pinned host->device copy, 4 GiB", h2d["median_s"], h2d["gb_s"],
            f"the copy-engine ceiling; pageable: {h2d['pageable_1gib_gb_s']:.1f} GB/s")
    if "seconds" in lf:
        row("(a) safetensors load_file -> cuda:0", lf["seconds"], lf["gb_s"], "page cache warm")
    fills = w.get("fills", [])
    if fills:
        rc = w["page_cache_read"]
        row(f"    page cache -> user memory, {rc['workers']} threads", rc["seconds"], rc["gb_s"], "read ceiling")
        for f in fills:
            total = f["create_s"] + f["fill_s"]
            vs = []
            if "seconds" in lf:
                vs.append(f"{lf['seconds'] / total:.1f}x faster than (a)")
            if "gb_s" in h2d:
                vs.append(f"{100 * f['gb_s'] / h2d['gb_s']:.0f}% of H2D")
            row(f"(d) wcd cold load, {f['workers']} threads x 2x{f['staging_mib']} MiB ({f['config']})", total,
                f["gb_s"], ", ".join(vs))
        row("    CUDA context creation in the loader", w["context_create_s"], None, "included above")
        ph = w["fill_phases"]
        row(f"    default fill, data path only ({ph['workers']} threads x 2x{ph['staging_mib']} MiB)", ph["data_s"],
            ph["data_gb_s"],
            f"+ writer open {ph['writer_open_s']:.3f} s, pinned staging {ph['staging_setup_s']:.3f} s, "
            f"close {ph['close_s']:.3f} s")
        row("    arena -> host via Arena.read (verify path)", w["arena_read"]["seconds"], w["arena_read"]["gb_s"],
            f"first {w['arena_read']['bytes'] / GB:.1f} GB")
    if "attach_s" in ipc:
        row(f"(b) legacy CUDA IPC rebuild, {ipc['tensors']} tensors", ipc["attach_s"], None,
            f"consumer side; data ok: {ipc['data_ok']}")
    c = w.get("client", {})
    if "attach_s" in c:
        note = f"{ipc['attach_s'] / c['attach_s']:.0f}x faster than (b); " if "attach_s" in ipc else ""
        row(f"(c) wcd attach, direct, {c['tensors']} tensors", c["attach_s"], None, note + f"data ok: {c['data_ok']}")
        row("    of which map + tensor views", c["map_and_views_s"], None, w.get("path", ""))
        row("    again: import + map + base tensor | views", c["again_map_s"], None,
            f"| {c['again_views_s']:.4f} s for {c['tensors']} views")
        row("client: import torch", c["import_torch_s"], None, "not in (b)/(c)")
        row("client: CUDA context creation", c["cuda_context_s"], None, "not in (b)/(c)")
    dm = r.get("daemon", {})
    if "error" in dm or "error" in dm.get("client", {}):
        print(f"!! daemon: {dm.get('error') or dm['client']['error']}")
    elif dm:
        dc, nbytes = dm["client"], ck["bytes"]
        load_vs = f"{lf['seconds'] / dm['load_s']:.1f}x faster than (a)" if "seconds" in lf else ""
        row("(d) wcd serve: load op (fingerprint + fill)", dm["load_s"], nbytes / dm["load_s"] / GB, load_vs)
        attach_vs = f"{ipc['attach_s'] / dc['attach_s']:.0f}x faster than (b); " if "attach_s" in ipc else ""
        row(f"(c) wcd serve: connect + acquire -> {dc['tensors']} tensors", dc["attach_s"], None,
            attach_vs + f"data ok: {dc['data_ok']}")
        row("    verify op (full digest, arena + files)", dm["verify_s"], None, f"match: {dm['verify_match']}")
    width = max(len(x[0]) for x in rows) if rows else 10
    print(f"{'what':<{width}}  {'seconds':>9}  {'GB/s':>6}  vs")
    for what, s, g, note in rows:
        print(f"{what:<{width}}  {s:>9}  {g:>6}  {note}")


if __name__ == "__main__":
    main()
