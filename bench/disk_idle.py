"""Does the disk read faster after an idle spell? (issue 14 item 2: the cold gap to fastsafetensors)

A VM's block device can be rate-limited by a token bucket (Firecracker's has a size, a refill time
and a one-time burst): after an idle spell the bucket is full and the first reads go faster. Until
2026-12-03 the peers' clocks in `bench_load --cold` started after seconds of torch import and CUDA
start, wcd's a few ms after the page cache was dropped, so such a bucket would have favoured the
peers (on the H200 VMs a spell helped on average, not every time: RESULTS, ninth round).

Per trial: drop the page cache, wait `idle` seconds, read the files whole (O_DIRECT, `readers`
threads x `block` bytes, as `bench_load.direct_read`), timing each read's completion. Prints GB/s
overall, over the first quarter of the bytes and over the last half, and the disk's counters.

With `--patterns`, the same for several read patterns (MODE:READERS:BLOCK[:streams][:4k|:huge], MODE
`direct` or `buffered`, BLOCK in K or M; `streams`: each reader its own contiguous slice, front to
back; `4k`/`huge`: the readers' buffers advised against/for transparent huge pages),
the order rotated each of `--rounds` rounds, after each idle:

    python bench/disk_idle.py --ckpt 1.6:1000 --idle 8,0,0,2,8,0 --out disk-idle.json
    python bench/disk_idle.py --ckpt 1.6:1000 --idle 0 --rounds 4 --patterns buffered:16:16M,direct:16:512K
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import queue
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_load import disk_delta, disk_stats, drop_caches, write_checkpoint  # noqa: E402


def anon_huge_kib() -> int:
    """Anonymous memory this process holds in transparent huge pages, KiB."""
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def timed_read(files: list[Path], readers: int, block: int, direct: bool,
               streams: bool = False, pages: str = "") -> tuple[list[tuple[float, int]], int]:
    """(seconds since the start, bytes) of each read as it completes, in completion order, and the
    KiB of huge pages the process held once the readers' buffers were faulted in. The
    readers take the next block in file order (a sweep `readers` blocks wide), or with `streams`
    each reads its own contiguous `1/readers` of the blocks front to back, one read at a time.
    `pages` "4k" or "huge" advises each reader's buffer against or for transparent huge pages (a
    "huge" buffer starts on a 2 MiB boundary; one under 2 MiB cannot get a huge page): an O_DIRECT
    read into scattered 4 KiB pages takes a segment per page, and the block layer splits requests
    at `max_segments` (on the H200, 16 MiB reads gave ~900 KiB requests either way)."""
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    fds = [os.open(f, flags) for f in files]
    jobs = [(fd, pos) for fd in fds for pos in range(0, os.fstat(fd).st_size // block * block, block)]
    if streams:  # reader i's slice, then reader i+1's: a pool of `readers` threads runs one each
        share = -(-len(jobs) // readers)
        slices = [jobs[i : i + share] for i in range(0, len(jobs), share)]
        jobs = []
        for k in range(share):
            jobs += [s[k] for s in slices if k < len(s)]
        readers = len(slices)
    local = threading.local()
    done: list[tuple[float, int]] = []
    lock = threading.Lock()
    bufs: queue.SimpleQueue[memoryview] = queue.SimpleQueue()
    maps = []
    for _ in range(readers):  # a buffer per reader, its pages faulted in before the clock starts
        huge = 2 << 20 if pages == "huge" else 0
        m = mmap.mmap(-1, block + huge)
        if pages:
            m.madvise(mmap.MADV_NOHUGEPAGE if pages == "4k" else mmap.MADV_HUGEPAGE)
        maps.append(m)
        at = -ctypes.addressof(ctypes.c_char.from_buffer(m)) % huge if huge else 0
        buf = memoryview(m)[at : at + block]
        buf[:] = b"\1" * block
        bufs.put(buf)
    held = anon_huge_kib()
    start = time.perf_counter()

    def one(job: tuple[int, int]) -> None:
        fd, pos = job
        if getattr(local, "buf", None) is None:
            local.buf = bufs.get()
        n = os.preadv(fd, [local.buf], pos)
        with lock:
            done.append((time.perf_counter() - start, n))

    try:
        with ThreadPoolExecutor(readers) as pool:
            list(pool.map(one, jobs))
    finally:
        for fd in fds:
            os.close(fd)
    return done, held


def queue_limits(path: Path) -> dict[str, str]:
    """The block queue's limits of the disk holding `path` (and transparent huge pages' mode)."""
    dev = os.stat(path).st_dev
    base = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    queue = base / "queue" if (base / "queue").exists() else base.resolve().parent / "queue"
    out = {"disk": base.resolve().name}
    for name in ("max_sectors_kb", "max_hw_sectors_kb", "max_segments", "max_segment_size", "nr_requests",
                 "scheduler", "read_ahead_kb", "rotational"):
        try:
            out[name] = (queue / name).read_text().strip()
        except OSError:
            pass
    try:
        out["thp"] = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    except OSError:
        pass
    return out


def rates(done: list[tuple[float, int]]) -> dict[str, float]:
    """GB/s overall, over the first quarter of the bytes, and over the last half."""
    total = sum(n for _, n in done)
    acc, quarter_t, half_t = 0, 0.0, 0.0
    for t, n in done:
        acc += n
        if not quarter_t and acc >= total / 4:
            quarter_t = t
        if not half_t and acc >= total / 2:
            half_t = t
    end = done[-1][0]
    return {"GBps": round(total / end / 1e9, 3), "first_quarter_GBps": round(total / 4 / quarter_t / 1e9, 3),
            "last_half_GBps": round(total / 2 / (end - half_t) / 1e9, 3), "seconds": round(end, 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "wcd-bench-load")
    ap.add_argument("--ckpt", default="1.6:1000", help="GB:TENSORS")
    ap.add_argument("--idle", default="8,0,0,2,8,0", help="seconds idle before each trial, comma-separated")
    ap.add_argument("--readers", type=int, default=16)
    ap.add_argument("--block-mib", type=int, default=16)
    ap.add_argument("--buffered", action="store_true", help="buffered reads instead of O_DIRECT")
    ap.add_argument("--patterns", help="MODE:READERS:BLOCK,... (e.g. buffered:16:16M,direct:16:512K)")
    ap.add_argument("--rounds", type=int, default=1, help="rounds over --patterns, order rotated")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if not drop_caches():
        sys.exit("disk_idle: cannot drop the page cache (run as root)")
    gb, tensors = args.ckpt.split(":")
    files = write_checkpoint(args.dir / f"{gb}gb-{tensors}", int(float(gb) * 1e9), int(tensors), 4)
    default = f"{'buffered' if args.buffered else 'direct'}:{args.readers}:{args.block_mib}M"
    patterns = (args.patterns or default).split(",")
    for pattern in patterns:  # all checked before the first trial, not when its turn comes
        mode, *rest = pattern.split(":")
        unknown = ([] if mode in ("direct", "buffered") else [mode]) + \
            [x for x in rest[2:] if x not in ("streams", "4k", "huge")]
        if len(rest) < 2 or unknown:
            sys.exit(f"disk_idle: {pattern}: not MODE:READERS:BLOCK[:streams][:4k|:huge] (MODE direct or "
                     f"buffered){': unknown ' + ', '.join(unknown) if unknown else ''}")
    idles = [float(x) for x in args.idle.split(",")]
    trials = []
    limits = queue_limits(files[0])
    print(json.dumps({"queue": limits}), flush=True)
    for r in range(args.rounds):
        for idle in idles:
            for pattern in patterns[r % len(patterns):] + patterns[: r % len(patterns)]:
                mode, readers, block, *layout = pattern.split(":")
                nbytes = int(block[:-1]) << {"K": 10, "M": 20}[block[-1]]
                drop_caches()
                time.sleep(idle)
                before = disk_stats(files[0])
                pages = next((x for x in layout if x in ("4k", "huge")), "")
                done, held = timed_read(files, int(readers), nbytes, mode == "direct", "streams" in layout, pages)
                row = {"round": r, "pattern": pattern, "idle_s": idle, **rates(done), "anon_huge_KiB": held,
                       "disk": disk_delta(before, disk_stats(files[0]), done[-1][0])}
                trials.append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"queue": limits, "trials": trials}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
