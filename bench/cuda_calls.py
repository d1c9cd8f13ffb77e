"""Driver calls of a CUDA fill, counted without a GPU: the daemon's `fill_arena` and `CudaWriter`
over the unit tests' fake driver (copies counted, not run), page cache taken as warm.

Prints, per checkpoint: the copy plan's ops, the device copies (1D and 2D) and the rows the 2D
ones move, the staging reads (a pread into one pinned buffer, or a preadv gathering an op's pieces)
and every driver call of the fill. A driver call costs 0.6-2.8 us on the H200 machine. The fill is
given the admission's fingerprint, as the daemon gives it, so its debug line (printed) times the
CPU parts of a load's copy phase for real: the plan and the checks after the copies.

    python bench/cuda_calls.py --dir /var/tmp/wcd-admit --ckpt 1.6:1000 --ckpt 1.6:100000
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import sys
import types
from pathlib import Path
from typing import Any
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

try:  # the fake driver stands in for cuda-bindings; wcd.arenas.cuda only needs the module to exist
    import cuda.bindings.driver  # noqa: F401
except ImportError:
    pkg, bindings = types.ModuleType("cuda"), types.ModuleType("cuda.bindings")
    bindings.driver = mock.MagicMock()  # type: ignore[attr-defined]
    pkg.bindings = bindings  # type: ignore[attr-defined]
    sys.modules.update({"cuda": pkg, "cuda.bindings": bindings, "cuda.bindings.driver": bindings.driver})

import pytest  # noqa: E402
from bench_load import write_checkpoint  # noqa: E402

import wcd.loader  # noqa: E402
from tests.unit.fake_cuda import DEVICE_BASE, ArenaModules, FakeDriver, held_calls  # noqa: E402
from wcd import key  # noqa: E402
from wcd.checkpoint import Checkpoint  # noqa: E402

wcuda = ArenaModules()  # wcd.arenas.cuda and the modules under it, patched as one
_COPIES = ("cuMemcpyHtoDAsync", "cuMemcpy2DAsync")
_FLAGS = ("CU_STREAM_NON_BLOCKING", "CU_MEM_LOCATION_TYPE_DEVICE", "CU_MEM_ACCESS_FLAGS_PROT_READ",
          "CU_MEM_ACCESS_FLAGS_PROT_READWRITE")


class CountingDriver(FakeDriver):
    """The fake driver, counting every call; copies are checked and counted but not run (no device bytes)."""

    def __init__(self, ok: Any, not_ready: Any) -> None:
        super().__init__(ok, not_ready)
        self.counts: collections.Counter[str] = collections.Counter()
        for name in ("CUstream_flags", "CUmemLocationType", "CUmemAccess_flags"):  # not MagicMocks: slow to touch
            setattr(self, name, types.SimpleNamespace(**{k: 0 for k in _FLAGS}))

    def cuMemAddressReserve(self, size: int, *_: Any) -> tuple[Any, int]:
        return self.ok, DEVICE_BASE

    def cuMemcpyHtoDAsync(self, dst: int, src: int, nbytes: int, stream: Any) -> tuple[Any]:
        self._host_range(src, nbytes)
        return (self.ok,)

    def cuMemcpy2DAsync(self, p: Any, stream: Any) -> tuple[Any]:
        self.rows.append(p.Height)
        return (self.ok,)

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("cu"):
            object.__getattribute__(self, "counts")[name] += 1
        return object.__getattribute__(self, name)


def count(path: Path, workers: int) -> dict[str, Any]:
    fake = CountingDriver(wcuda.SUCCESS, wcuda.NOT_READY)
    reads: collections.Counter[str] = collections.Counter()
    pread_into, gather = wcuda.pread_into, wcuda.Lane.gather

    def counted_pread(fd: int, view: memoryview, offset: int) -> None:
        reads["pread"] += 1
        pread_into(fd, view, offset)

    def counted_gather(lane: Any, fd: int, file_offset: int, dst: int, nbytes: int, runs: Any) -> bool:
        done = gather(lane, fd, file_offset, dst, nbytes, runs)
        if done:
            reads["preadv_gathers"] += 1
            reads["gathered_pieces"] += sum(c for _, _, _, c in runs)
        return done

    with pytest.MonkeyPatch.context() as patch, Checkpoint.open(path) as ckpt:
        for target, name, value in ((wcuda, "cuda", fake), (wcuda, "held", lambda: held_calls(wcuda)),
                                    (wcuda, "pread_into", counted_pread), (wcuda.Lane, "gather", counted_gather),
                                    (wcd.loader, "cached_fraction", lambda fd: 1.0)):
            patch.setattr(target, name, value)
        manifest = ckpt.manifest()
        gpu = wcuda.Gpu(0, "GPU-fake", "fake")
        staging = wcuda.Staging(gpu, wcuda.STAGING_BYTES, wcuda.STAGING_BUFFERS, 0)
        arena = wcuda.CudaArena(gpu, manifest.size, object(), os.open(os.devnull, os.O_RDONLY), staging, "count")
        setup = sum(fake.counts.values())
        wcd.loader.fill_arena(arena, ckpt, manifest, wcd.loader.Progress(ckpt.nbytes), workers=workers,
                              fingerprint=key.fingerprint(ckpt))
        arena.close()
        ops = ckpt.copy_plan(manifest)
    return {"tensors": len(manifest), "ops": len(ops), "scattered_ops": sum(1 for op in ops if op.runs),
            "copies": {k: fake.counts[k] for k in _COPIES if fake.counts[k]}, "rows_2d": sum(fake.rows),
            "reads": dict(reads), "driver_calls": sum(fake.counts.values()) - setup,
            "per_call": dict(sorted(fake.counts.items()))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=Path(os.environ.get("TMPDIR", "/var/tmp")) / "wcd-admit")
    p.add_argument("--ckpt", action="append", metavar="GB:TENSORS", help="default: 1.6:1000 and 1.6:100000")
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--workers", type=int, default=16, help="loader threads (16 on the H200 machine)")
    args = p.parse_args()
    logging.basicConfig(level=logging.DEBUG, format="  %(message)s")
    logging.getLogger("wcd").setLevel(logging.DEBUG)
    for spec in args.ckpt or ["1.6:1000", "1.6:100000"]:
        gb, tensors = spec.split(":")
        d = args.dir / f"{gb}gb-{tensors}"
        write_checkpoint(d, int(float(gb) * 1e9), int(tensors), args.shards)
        print(f"{tensors:>7} tensors: {count(d, args.workers)}")


if __name__ == "__main__":
    main()
