"""Load probe (issue 14): the GPU machine's ceilings and the loader's knobs, measured in one run.

What `bench_load.py` cannot tell apart, measured piece by piece so that the loader's design
rests on numbers:
  - fixed costs of a load: `cuInit`, creating the primary context (and the device memory it
    holds), allocating pinned staging, in a fresh process;
  - warm fills through the daemon's own `CudaWriter`, swept over loader threads and staging
    sizes: first pass (staging allocated on the clock) and second pass (staging reused);
  - registering page-cache pages (`cuMemHostRegister` of a file mmap) as an alternative to staging;
  - cold reads (page cache dropped) swept over threads, read size, O_DIRECT and fadvise;
  - hash and compare rates, per thread and all threads (what `verify` can reach);
  - device -> pinned host copies from many threads;
  - verify's read path alone: a CUDA arena's digest pass and its reads, per read window.

    python bench/probe_load.py --dir /tmp/wcd-bench-load --out probe.json    # root, one GPU
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import mmap
import os
import subprocess
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_load import drop_caches, warm, write_checkpoint  # noqa: E402
from wcd.loader import _libc  # noqa: E402

_FIXED = r"""
import json, time
t0 = time.perf_counter()
from cuda.bindings import driver as cu
t1 = time.perf_counter(); cu.cuInit(0); t2 = time.perf_counter()
import os, subprocess
def used():  # this process's device memory, MiB, as nvidia-smi reports it
    q = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                       capture_output=True, text=True).stdout
    return sum(int(m) for p, m in (line.split(",") for line in q.splitlines() if line.strip()) if int(p) == os.getpid())
used0 = used()
t3 = time.perf_counter(); err, ctx = cu.cuDevicePrimaryCtxRetain(0); t4 = time.perf_counter()
cu.cuCtxSetCurrent(ctx)
used1 = used()
out = {"import_bindings_s": t1 - t0, "cuInit_s": t2 - t1, "ctx_create_s": t4 - t3, "ctx_device_MiB": used1 - used0}
for mb in (64, 256, 1024):
    t = time.perf_counter(); err, p = cu.cuMemHostAlloc(mb << 20, 0); a = time.perf_counter() - t
    t = time.perf_counter(); cu.cuMemFreeHost(p); f = time.perf_counter() - t
    out[f"pinned_alloc_{mb}MiB_s"] = a; out[f"pinned_free_{mb}MiB_s"] = f
err, s = cu.cuStreamCreate(1); t = time.perf_counter()
for _ in range(16):
    cu.cuStreamCreate(1)
out["stream_create_s"] = (time.perf_counter() - t) / 16
t = time.perf_counter(); cu.cuDevicePrimaryCtxRelease(0); out["ctx_release_s"] = time.perf_counter() - t
print(json.dumps(out))
"""


def fixed_costs() -> dict[str, object]:
    r = subprocess.run([sys.executable, "-c", _FIXED], capture_output=True, text=True, timeout=120)
    if r.returncode:
        return {"error": r.stderr.strip().splitlines()[-1:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def warm_sweep(ckpt_dir: Path, configs: list[tuple[int, int, int]]) -> list[dict[str, object]]:
    """Fill one arena through the daemon's CudaWriter per (threads, staging MiB, buffers)."""
    from wcd.arenas import cuda
    from wcd.checkpoint import Checkpoint

    gpu = cuda.find_gpu("cuda:0")
    hold = cuda.retain_context(gpu)  # held across the sweep: context creation is measured apart
    out = []
    with Checkpoint.open(ckpt_dir) as ckpt:
        manifest = ckpt.manifest()
        ops = ckpt.copy_plan(manifest)
        nbytes = ckpt.nbytes
        for threads, mib, buffers in configs:
            backend = cuda.CudaBackend(mib << 20, buffers)
            arena = backend.create("cuda:0", manifest.size, "probe")
            try:
                t0 = time.perf_counter()
                writer = arena.writer()
                t1 = time.perf_counter()
                with ThreadPoolExecutor(threads) as pool:
                    passes = []
                    for _ in range(2):  # first: staging allocated on the clock; second: reused
                        t = time.perf_counter()
                        list(pool.map(functools.partial(_run_op, writer, ckpt.fds), ops))
                        cuda.check(cuda.cuda.cuCtxSetCurrent(hold), "set")
                        cuda.check(cuda.cuda.cuCtxSynchronize(), "sync")
                        passes.append(time.perf_counter() - t)
                t2 = time.perf_counter()
                writer.close()
                t3 = time.perf_counter()
            finally:
                arena.close()
            # Third: lanes reused, into an arena never written (as a load's is): what fresh memory costs.
            arena = backend.create("cuda:0", manifest.size, "probe")
            try:
                writer = arena.writer()
                with ThreadPoolExecutor(threads) as pool:
                    t = time.perf_counter()
                    list(pool.map(functools.partial(_run_op, writer, ckpt.fds), ops))
                    cuda.check(cuda.cuda.cuCtxSetCurrent(hold), "set")
                    cuda.check(cuda.cuda.cuCtxSynchronize(), "sync")
                    passes.append(time.perf_counter() - t)
                writer.close()
            finally:
                arena.close()
            backend.release()
            row = {"threads": threads, "staging_MiB": mib, "buffers": buffers, "writer_open_s": t1 - t0,
                   "fill_first_s": passes[0], "fill_reused_s": passes[1], "fill_fresh_s": passes[2],
                   "close_s": t3 - t2, "GBps_first": nbytes / passes[0] / 1e9, "GBps_reused": nbytes / passes[1] / 1e9,
                   "GBps_fresh_arena": nbytes / passes[2] / 1e9}
            print(json.dumps(row), flush=True)
            out.append(row)
    cuda.release_context(gpu)
    return out


def cold_fills(ckpt_dir: Path, threads: int) -> list[dict[str, object]]:
    """Fills through the daemon's CudaWriter after dropping the page cache, with each read policy
    forced by its hint: warm (4 MiB reads), cold (16 MiB reads) dropping what it read, and cold keeping it."""
    from wcd.arenas import cuda
    from wcd.checkpoint import Checkpoint
    from wcd.loader import cached_fraction

    gpu = cuda.find_gpu("cuda:0")
    cuda.retain_context(gpu)  # held across the fills: context creation is measured apart
    backend = cuda.CudaBackend()
    out = []
    try:
        for policy, fraction in (("warm reads", 1.0), ("cold, dropped", 0.0), ("cold, kept", 0.5)):
            drop_caches()
            with Checkpoint.open(ckpt_dir) as ckpt:
                manifest = ckpt.manifest()
                ops = ckpt.copy_plan(manifest)
                arena = backend.create("cuda:0", manifest.size, "probe")
                try:
                    t = time.perf_counter()
                    writer = arena.writer()
                    for fd in ckpt.fds:
                        writer.hint(fd, fraction)
                    with ThreadPoolExecutor(threads) as pool:
                        list(pool.map(functools.partial(_run_op, writer, ckpt.fds), ops))
                    writer.close()
                    seconds = time.perf_counter() - t
                    after = sum(cached_fraction(fd) for fd in ckpt.fds) / len(ckpt.fds)
                finally:
                    arena.close()
                row = {"policy": policy, "threads": threads, "seconds": seconds, "GBps": ckpt.nbytes / seconds / 1e9,
                       "cached_after": after}
            print(json.dumps(row), flush=True)
            out.append(row)
    finally:
        backend.release()
        cuda.release_context(gpu)
    return out


def _run_op(writer: Any, fds: tuple[int, ...], op: Any) -> None:
    if op.runs:
        writer.copy_scattered(fds[op.shard], op.file_offset, op.arena_offset, op.nbytes, op.runs)
    else:
        writer.copy_from_file(fds[op.shard], op.file_offset, op.arena_offset, op.nbytes)


def host_register(file: Path) -> dict[str, object]:
    """cuMemHostRegister (read-only) of a page-cached file's shared mmap, then one H2D copy from it."""
    from cuda.bindings import driver as cu

    from wcd.arenas import cuda

    libc = _libc()  # mmap and munmap declared, as the loader's page-cache probe uses them
    gpu = cuda.find_gpu("cuda:0")
    ctx = cuda.retain_context(gpu)
    cu.cuCtxSetCurrent(ctx)
    size = file.stat().st_size // (2 << 20) * (2 << 20)
    fd = os.open(file, os.O_RDONLY)
    addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    os.close(fd)
    out: dict[str, object] = {"bytes": size}
    try:
        t = time.perf_counter()
        err, = cu.cuMemHostRegister(addr, size, 0x08)  # CU_MEMHOSTREGISTER_READ_ONLY
        out["register_s"] = time.perf_counter() - t
        out["register_err"] = getattr(err, "name", str(err))
        if err == cu.CUresult.CUDA_SUCCESS:
            err, dst = cu.cuMemAlloc(size)
            t = time.perf_counter()
            cu.cuMemcpyHtoD(dst, addr, size)
            out["h2d_s"] = time.perf_counter() - t
            out["h2d_GBps"] = size / out["h2d_s"] / 1e9  # type: ignore[operator]
            t = time.perf_counter()
            cu.cuMemHostUnregister(addr)
            out["unregister_s"] = time.perf_counter() - t
            cu.cuMemFree(dst)
    finally:
        libc.munmap(addr, size)
        cuda.release_context(gpu)
    return out


def mapped_fill(files: list[Path], configs: list[tuple[int, int, bool]]) -> list[dict[str, object]]:
    """Warm fills with no staging copy: each thread registers a page-aligned piece of a file's shared
    mmap (`cuMemHostRegister`, read-only), copies it to the device from there, and unregisters it
    (pipelined: the previous piece is waited for and unregistered after the next is issued).
    Per (threads, piece bytes, pipelined); the time each thread spent in register and unregister is
    summed to show whether the driver serialises them."""
    from cuda.bindings import driver as cu

    from wcd.arenas import cuda

    libc = _libc()  # mmap and munmap declared, as the loader's page-cache probe uses them
    gpu = cuda.find_gpu("cuda:0")
    ctx = cuda.retain_context(gpu)
    cu.cuCtxSetCurrent(ctx)
    sizes = [f.stat().st_size for f in files]
    maps = []
    for f, size in zip(files, sizes):
        fd = os.open(f, os.O_RDONLY)
        maps.append(libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0))
        os.close(fd)
    total = sum(sizes)
    err, dst = cu.cuMemAlloc(total)
    bases = [sum(sizes[:i]) for i in range(len(sizes))]
    out = []
    try:
        def run(mine: list[tuple[int, int, int]], pipelined: bool) -> tuple[float, float, str | None]:
            """One thread's pieces: seconds in register and unregister calls, and the first error."""
            cu.cuCtxSetCurrent(ctx)
            stream = cu.cuStreamCreate(1)[1]
            spent = [0.0, 0.0]
            pending: list[tuple[int, Any]] = []

            def finish(addr: int, event: Any) -> None:
                cu.cuEventSynchronize(event)
                cu.cuEventDestroy(event)
                t = time.perf_counter()
                cu.cuMemHostUnregister(addr)
                spent[1] += time.perf_counter() - t

            try:
                for i, pos, n in mine:
                    addr = maps[i] + pos
                    t = time.perf_counter()
                    e, = cu.cuMemHostRegister(addr, -(-n // 4096) * 4096, 0x08)
                    spent[0] += time.perf_counter() - t
                    if e != cu.CUresult.CUDA_SUCCESS:
                        return spent[0], spent[1], str(e)
                    cu.cuMemcpyHtoDAsync(int(dst) + bases[i] + pos, addr, n, stream)
                    event = cu.cuEventCreate(2 | 1)[1]  # disable timing, blocking sync
                    cu.cuEventRecord(event, stream)
                    pending.append((addr, event))
                    while len(pending) > (1 if pipelined else 0):
                        finish(*pending.pop(0))
                return spent[0], spent[1], None
            finally:
                while pending:
                    finish(*pending.pop(0))
                cu.cuStreamDestroy(stream)

        for threads, piece, pipelined in configs:
            jobs = [(i, pos, min(piece, size - pos)) for i, size in enumerate(sizes) for pos in range(0, size, piece)]
            t = time.perf_counter()
            with ThreadPoolExecutor(threads) as pool:
                got = list(pool.map(functools.partial(run, pipelined=pipelined),
                                    [jobs[k::threads] for k in range(threads)]))
            seconds = time.perf_counter() - t
            row = {"threads": threads, "piece_MiB": piece >> 20, "pipelined": pipelined, "seconds": seconds,
                   "GBps": total / seconds / 1e9, "register_s_sum": sum(g[0] for g in got),
                   "unregister_s_sum": sum(g[1] for g in got), "errors": [g[2] for g in got if g[2]][:2]}
            print(json.dumps(row), flush=True)
            out.append(row)
    finally:
        cu.cuMemFree(dst)
        for a, size in zip(maps, sizes):
            libc.munmap(a, size)
        cuda.release_context(gpu)
    return out


def will_need(fd: int, size: int, piece: int = 1 << 20) -> None:
    """POSIX_FADV_WILLNEED for a whole file, in `piece`-byte calls: one call queues at most
    max(io_pages, ra_pages) pages (a 64 MiB file asked for in one call came 12.5% into the page
    cache on the 2-core VM; in 1 MiB calls, whole). Before 2026-12-03 this probe asked in one call."""
    for at in range(0, size, piece):
        os.posix_fadvise(fd, at, min(piece, size - at), os.POSIX_FADV_WILLNEED)


def cold_read(files: list[Path], threads: int, chunk: int, direct: bool, fadvise: bool | str,
              interleave: bool) -> float:
    """GB/s of reading `files` whole after dropping the page cache."""
    drop_caches()
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    fds = [os.open(f, flags) for f in files]
    try:
        sizes = [os.fstat(fd).st_size for fd in fds]
        ahead: list[threading.Thread] = []
        if fadvise == "willneed":  # the kernel reads each whole file ahead, from a thread per file
            ahead = [threading.Thread(target=will_need, args=(fd, size)) for fd, size in zip(fds, sizes)]
        elif fadvise:
            for fd in fds:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        per_file = [[(i, pos) for pos in range(0, size, chunk)] for i, size in enumerate(sizes)]
        if interleave:
            jobs = [j for group in zip(*per_file) for j in group]
        else:
            jobs = [j for group in per_file for j in group]
        local = threading.local()

        def one(job: tuple[int, int]) -> int:
            i, pos = job
            buf = getattr(local, "buf", None)
            if buf is None:
                buf = local.buf = mmap.mmap(-1, chunk)
            n = min(chunk, sizes[i] - pos)
            if direct:
                n = -(-n // 4096) * 4096
            return os.preadv(fds[i], [memoryview(buf)[:n]], pos)

        start = time.perf_counter()
        for t in ahead:
            t.start()
        with ThreadPoolExecutor(threads) as pool:
            total = sum(pool.map(one, jobs))
        for t in ahead:
            t.join()
        return total / (time.perf_counter() - start) / 1e9
    finally:
        for fd in fds:
            os.close(fd)


def cold_streams(files: list[Path], per_file: int, chunk: int, direct: bool) -> float:
    """GB/s of reading `files` whole after dropping the page cache, as fastsafetensors' reader does:
    `per_file` threads per file, each reading its contiguous slice of the file front to back."""
    drop_caches()
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    fds = [os.open(f, flags) for f in files]
    try:
        sizes = [os.fstat(fd).st_size for fd in fds]

        def one(job: tuple[int, int, int]) -> int:
            i, start, end = job
            buf = mmap.mmap(-1, chunk)
            done = 0
            for pos in range(start, end, chunk):
                n = min(chunk, end - pos)
                if direct:
                    n = -(-n // 4096) * 4096
                done += os.preadv(fds[i], [memoryview(buf)[:n]], pos)
            return done

        jobs = []
        for i, size in enumerate(sizes):
            step = -(-size // per_file // chunk) * chunk
            jobs += [(i, a, min(size, a + step)) for a in range(0, size, step)]
        start = time.perf_counter()
        with ThreadPoolExecutor(len(jobs)) as pool:
            total = sum(pool.map(one, jobs))
        return total / (time.perf_counter() - start) / 1e9
    finally:
        for fd in fds:
            os.close(fd)


def hashes(threads: int) -> dict[str, float]:
    """GB/s per thread and with `threads` threads for the digests verify could use, and memcmp."""
    block = os.urandom(1 << 20) * 64
    other = bytes(bytearray(block))
    fns = {
        "blake2b": lambda b: hashlib.blake2b(b, digest_size=16).digest(),
        "sha256": lambda b: hashlib.sha256(b).digest(),
        "sha1": lambda b: hashlib.sha1(b).digest(),
        "crc32": lambda b: zlib.crc32(b),
        "memcmp": lambda b: b == other,
    }
    out: dict[str, float] = {}
    for name, fn in fns.items():
        t = time.perf_counter()
        fn(block)
        out[f"{name}_1thread_GBps"] = len(block) / (time.perf_counter() - t) / 1e9
        bufs = [bytes(bytearray(block)) for _ in range(threads)] if name != "memcmp" else [block] * threads
        t = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(fn, bufs * 2))
        out[f"{name}_{threads}threads_GBps"] = 2 * threads * len(block) / (time.perf_counter() - t) / 1e9
    return out


def d2h(threads: int, nbytes: int = 16 << 20, reps: int = 32) -> float:
    """GB/s of device -> pinned host copies of `nbytes` from `threads` threads at once."""
    from cuda.bindings import driver as cu

    from wcd.arenas import cuda

    gpu = cuda.find_gpu("cuda:0")
    ctx = cuda.retain_context(gpu)
    cu.cuCtxSetCurrent(ctx)
    err, src = cu.cuMemAlloc(nbytes * threads)

    def one(i: int) -> None:
        cu.cuCtxSetCurrent(ctx)
        err, host = cu.cuMemHostAlloc(nbytes, 0)
        for _ in range(reps):
            cu.cuMemcpyDtoH(host, int(src) + i * nbytes, nbytes)
        cu.cuMemFreeHost(host)

    one(0)
    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(threads)))
    seconds = time.perf_counter() - t
    cu.cuMemFree(src)
    cuda.release_context(gpu)
    return threads * reps * nbytes / seconds / 1e9


def warm_parts(files: list[Path], threads: int = 16, piece: int = 4 << 20,
               modes: tuple[str, ...] = ("both", "reads", "copies") * 2, calls: bool = True) -> dict[str, object]:
    """The staged warm fill taken apart, lanes as the writer's (`threads` x 2 pinned `piece` buffers):
    page cache -> pinned reads alone, pinned -> device copies alone (same bytes, no reads), both
    (the writer's loop, bare: no plan, no Python per op), and what one driver call costs."""
    from cuda.bindings import driver as cu

    from wcd.arenas import cuda
    from wcd.arenas.base import pread_into

    gpu = cuda.find_gpu("cuda:0")
    ctx = cuda.retain_context(gpu)
    cu.cuCtxSetCurrent(ctx)
    fds = [os.open(f, os.O_RDONLY) for f in files]
    sizes = [os.fstat(fd).st_size for fd in fds]
    total = sum(sizes)
    err, dst = cu.cuMemAlloc(total)
    bases = [sum(sizes[:i]) for i in range(len(sizes))]
    jobs = [(i, pos, min(piece, size - pos)) for i, size in enumerate(sizes) for pos in range(0, size, piece)]
    lanes = [cuda.Lane(piece, 2) for _ in range(threads)]
    out: dict[str, object] = {"threads": threads, "piece_MiB": piece >> 20, "GB": total / 1e9}

    def run(mode: str) -> float:
        def work(k: int) -> None:
            cu.cuCtxSetCurrent(ctx)
            lane = lanes[k]
            for n_job, (i, pos, n) in enumerate(jobs[k::threads]):
                b = n_job % 2
                cu.cuEventSynchronize(lane.events[b])
                if mode != "copies":
                    pread_into(fds[i], lane.views[b][:n], pos)
                if mode != "reads":
                    cu.cuMemcpyHtoDAsync(int(dst) + bases[i] + pos, lane.ptrs[b], n, lane.stream)
                    cu.cuEventRecord(lane.events[b], lane.stream)
            lane.synchronize()

        t = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(work, range(threads)))
        return total / (time.perf_counter() - t) / 1e9

    try:
        for mode in modes:
            out[f"{mode}_GBps"] = max(run(mode), float(out.get(f"{mode}_GBps", 0.0)))  # type: ignore[arg-type]
        lane = lanes[0]
        if not calls:
            return out
        calls = {"cuCtxSetCurrent": lambda: cu.cuCtxSetCurrent(ctx),
                 "cuEventSynchronize": lambda: cu.cuEventSynchronize(lane.events[0]),
                 "cuEventRecord": lambda: cu.cuEventRecord(lane.events[0], lane.stream),
                 "cuMemcpyHtoDAsync_4B": lambda: cu.cuMemcpyHtoDAsync(int(dst), lane.ptrs[0], 4, lane.stream)}
        for name, call in calls.items():
            t = time.perf_counter()
            for _ in range(20000):
                call()
            out[f"{name}_us"] = (time.perf_counter() - t) / 20000 * 1e6
            lane.synchronize()
    finally:
        for lane in lanes:
            lane.close()
        cu.cuMemFree(dst)
        for fd in fds:
            os.close(fd)
        cuda.release_context(gpu)
    return out


def staging_sweep(files: list[Path], configs: list[tuple[int, int]], rounds: int = 3) -> list[dict[str, object]]:
    """The bare staged loop (`warm_parts`' "both") per (threads, buffer bytes), `rounds` times in
    rotation so that a noisy neighbour's moment hits every config alike: best and median GB/s."""
    runs: dict[tuple[int, int], list[float]] = {c: [] for c in configs}
    for _ in range(rounds):
        for threads, piece in configs:
            runs[(threads, piece)].append(float(warm_parts(files, threads, piece, modes=("both",),
                                                           calls=False)["both_GBps"]))  # type: ignore[arg-type]
    out = []
    for (threads, piece), got in runs.items():
        row = {"threads": threads, "piece_MiB": piece / (1 << 20), "best_GBps": max(got),
               "median_GBps": sorted(got)[len(got) // 2], "all": got}
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def _reads_alone(arena: Any, tasks: list[Any]) -> float:
    """Seconds to read every task's span through one reader per thread, as verify does, unhashed."""
    from wcd import loader

    local, readers = threading.local(), []

    def one(task: Any) -> None:
        if not hasattr(local, "r"):
            local.r = arena.reader()
            readers.append(local.r)
        for _ in local.r.windows(*loader._span(task)):
            pass

    t = time.perf_counter()
    with ThreadPoolExecutor(loader.digest_workers()) as pool:
        list(pool.map(one, tasks))
    seconds = time.perf_counter() - t
    for r in readers:
        r.close()
    return seconds


def verify_read(gbytes: int = 16, tensors: int = 1000) -> list[dict[str, object]]:
    """verify's arena side alone on a CUDA arena (16 GB, 1,000 tensors, its bytes as allocated; no
    files): `digest_arena`'s pass first with the GPU's staging not held (context and lanes made on
    the clock), then held, per READ_WINDOW; and the reads alone (reader windows, nothing hashed)."""
    from wcd import loader
    from wcd.arenas import cuda

    backend = cuda.CudaBackend(linger_s=600)
    size = gbytes * 10**9 // tensors // 256 * 256
    arena = backend.create("cuda:0", size * tensors, "probe")
    ranges = [(f"t{i}", i * size, size, None) for i in range(tensors)]
    tasks = loader._tasks(ranges)
    out: list[dict[str, object]] = []
    try:
        t = time.perf_counter()
        loader._digest_ranges(arena, ranges)
        out.append({"staging": "not held", "window_MiB": cuda.READ_WINDOW >> 20,
                    "digest_GBps": size * tensors / (time.perf_counter() - t) / 1e9})
        for window in (1 << 20, 2 << 20, 4 << 20):
            cuda.READ_WINDOW = window
            t = time.perf_counter()
            loader._digest_ranges(arena, ranges)
            digest = size * tensors / (time.perf_counter() - t) / 1e9
            reads = size * tensors / _reads_alone(arena, tasks) / 1e9
            out.append({"staging": "held", "window_MiB": window >> 20, "digest_GBps": digest, "reads_GBps": reads})
            print(json.dumps(out[-1]), flush=True)
    finally:
        cuda.READ_WINDOW = 4 << 20
        arena.close()
        backend.release()
    return out


STEPS = ("fixed", "hashes", "d2h", "verify", "register", "warm", "cold", "coldfill", "mapped", "parts", "staging",
         "coldahead", "streams", "front")
SMALL = ("fixed", "hashes", "d2h", "verify", "front")  # steps that need no 16 GB checkpoint


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", type=Path, default=Path("/tmp/wcd-bench-load"))
    ap.add_argument("--out", type=Path)
    ap.add_argument("--steps", default=",".join(STEPS))
    args = ap.parse_args()
    steps = set(args.steps.split(","))
    result: dict[str, object] = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count()}

    def step(name: str, fn, *a):  # type: ignore[no-untyped-def]
        if name not in steps:
            return
        t = time.perf_counter()
        try:
            result[name] = fn(*a)
        except Exception as e:  # noqa: BLE001 - a probe reports and goes on
            result[name] = {"error": f"{type(e).__name__}: {e}"}
        print(name, round(time.perf_counter() - t, 1), "s:", json.dumps(result[name])[:2000], flush=True)

    d = args.dir / "16gb-1000"
    files = write_checkpoint(d, int(16e9), 1000, 4) if steps - set(SMALL) else []
    # fastsafetensors' reader (nogds): 16 workers take 512 KiB blocks (its 16 MiB bounce buffer over
    # 16 x 2 slots) of one file after the other, O_DIRECT: a sequential front 16 reads deep. Rotated
    # with the loader's own pattern (16 x 16 MiB buffered) and neighbours, on 1.6 GB in 4 files.
    step("front", lambda: [
        {"threads": t, "chunk_KiB": c >> 10, "direct": di, "round": r,
         "GBps": cold_read(write_checkpoint(args.dir / "1.6gb-1000", int(1.6e9), 1000, 4), t, c, di, False, False)}
        for r in range(2) for t, c, di in [(16, 16 << 20, False), (16, 512 << 10, True), (16, 1 << 20, True),
                                           (16, 4 << 20, True), (32, 512 << 10, True), (16, 512 << 10, False),
                                           (16, 16 << 20, True)]])
    step("fixed", fixed_costs)
    step("hashes", hashes, os.cpu_count() or 2)
    step("d2h", lambda: {n: d2h(n) for n in (1, 4, 16)})
    step("verify", verify_read)
    if files:
        warm(files)
    step("register", lambda: host_register(files[0]))
    step("parts", warm_parts, files)
    step("staging", staging_sweep, files, [(t, m << 20) for t in (8, 12, 16) for m in (1, 2, 4, 8)] + [(16, 3 << 19)])
    step("streams", lambda: [
        {"per_file": k, "chunk_MiB": c >> 20, "direct": di, "files": len(files),
         "GBps": cold_read(files, 16, c, False, False, False) if k == 0 else cold_streams(files, k, c, di)}
        for k, c, di in [(1, 16 << 20, True), (0, 16 << 20, False), (1, 16 << 20, False), (2, 16 << 20, True),
                         (4, 16 << 20, False), (1, 64 << 20, True)]])
    step("coldahead", lambda: [
        {"threads": 16, "chunk_MiB": 16, "fadvise": fa, "round": r,
         "GBps": cold_read(files[:2], 16, 16 << 20, False, fa, False)}
        for r in range(2) for fa in (False, "willneed")])
    step("warm", warm_sweep, d, [(8, 4, 2), (16, 4, 2), (16, 8, 2), (16, 16, 2), (16, 4, 3), (12, 8, 2),
                                       (24, 4, 2), (16, 32, 2)])
    step("cold", lambda: [
        {"threads": t, "chunk_MiB": c >> 20, "direct": di, "fadvise": fa, "interleave": il,
         "GBps": cold_read(files[:2], t, c, di, fa, il)}
        for t, c, di, fa, il in [(8, 4 << 20, False, False, False), (8, 4 << 20, False, True, False),
                                 (16, 16 << 20, False, False, False), (16, 16 << 20, False, False, True),
                                 (8, 16 << 20, True, False, False), (16, 16 << 20, True, False, False),
                                 (32, 16 << 20, True, False, False), (16, 64 << 20, True, False, True),
                                 (64, 4 << 20, True, False, True)]])
    step("coldfill", lambda: cold_fills(d, 16))
    step("mapped", mapped_fill, files, [(16, 64 << 20, True), (16, 16 << 20, True), (8, 64 << 20, True),
                                        (16, 64 << 20, False), (4, 64 << 20, True), (32, 32 << 20, True)])
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
