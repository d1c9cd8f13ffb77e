"""What the benchmarks share: `--variant` (named daemon settings, side by side), `--json` output
with the machine and revision it ran on, a daemon started for a run, synthetic checkpoints.

A variant is daemon config lines plus load tuning: fields of `wcd.tuning.LoadTuning`, which the
daemon's arena backends are built with (`wcd.arenas.set_tuning`, before the daemon starts).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@dataclass(frozen=True)
class Variant:
    """Daemon settings under a name: `config` lines of `[daemon]`, `tuning` fields of `LoadTuning`."""

    name: str
    about: str
    config: dict[str, object] = field(default_factory=dict)
    tuning: dict[str, int] = field(default_factory=dict)

    def __add__(self, other: Variant) -> Variant:
        return Variant(f"{self.name}+{other.name}", f"{self.about}; {other.about}",
                       {**self.config, **other.config}, {**self.tuning, **other.tuning})

    def config_lines(self) -> str:
        return "".join(f"{k} = {json.dumps(v)}\n" for k, v in self.config.items())


VARIANTS = {v.name: v for v in (
    Variant("default", "the daemon as configured by default"),
    Variant("buffered", "cold files read through the page cache, not O_DIRECT", {"cold_reads": "buffered"}),
    Variant("linger0", "no CUDA context or staging lingers: each load makes its own", {"staging_linger_s": 0}),
    Variant("workers24", "24 loader threads", {"load_workers": 24}),
    Variant("nohelpers", "large headers parsed in the daemon, no header helper processes", {"header_helpers": 0}),
    Variant("noahead", "nothing read ahead while the writer is made", tuning={"read_ahead_bytes": 0}),
    Variant("ahead128", "128 MiB read ahead while the writer is made", tuning={"read_ahead_bytes": 128 << 20}),
    Variant("chunk16", "tensors over 16 MiB copied in 16 MiB ops, not 64", tuning={"chunk_bytes": 16 << 20}),
    Variant("direct1m", "O_DIRECT reads of 1 MiB, not 512 KiB", tuning={"direct_read_bytes": 1 << 20}),
)}


def variant(spec: str) -> Variant:
    """`NAME` or `NAME+NAME...` (later ones win where they set the same thing)."""
    parts = []
    for name in spec.split("+"):
        if name not in VARIANTS:
            raise SystemExit(f"unknown variant {name!r}; known: {', '.join(VARIANTS)} (combine with +)")
        parts.append(VARIANTS[name])
    out = parts[0]
    for p in parts[1:]:
        out += p
    return out


def parser(doc: str | None) -> argparse.ArgumentParser:
    """A benchmark's parser with the shared options: --variant (comma-separated, each run side by
    side), --json PATH (also written when a run is cut short), --device."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", default="default", type=lambda s: [variant(x) for x in s.split(",") if x],
                    help=f"daemon variants, comma-separated, side by side: {', '.join(VARIANTS)} "
                         "(NAME+NAME combines; `python bench/common.py` lists them)")
    ap.add_argument("--json", "--out", dest="json", type=Path, help="write the results here as JSON")
    ap.add_argument("--device", default="cpu", help="cpu (host arenas) or cuda:N")
    return ap


def run_info(device: str, variants: list[Variant] | None = None) -> dict[str, Any]:
    """Where and what a run measured: to be stored with its figures."""
    try:
        rev = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        rev = ""
    info: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "revision": rev or "unknown",
                            "host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
                            "device": device}
    if variants is not None:
        info["variants"] = {v.name: {"config": v.config, "tuning": v.tuning} for v in variants}
    return info


def write_json(path: Path | None, result: dict[str, Any]) -> None:
    if path is not None:
        path.write_text(json.dumps(result, indent=1) + "\n")


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def daemon_argv(v: Variant, config: Path, log_level: str = "warning") -> list[str]:
    """`wcd serve` with the variant's tuning set in the daemon's process before it starts."""
    serve = ["serve", "--config", str(config), "--log-level", log_level]
    if not v.tuning:
        return [sys.executable, "-m", "wcd", *serve]
    code = ("import json, sys\n"
            "from wcd import arenas, tuning\n"
            "arenas.set_tuning(tuning.LoadTuning(**json.loads(sys.argv[1])))\n"
            "from wcd.cli.wcd import main; sys.exit(main(sys.argv[2:]))")
    return [sys.executable, "-c", code, json.dumps(v.tuning), *serve]


class Daemon:
    """A `wcd serve` of its own for a benchmark: socket and config under `root`, the variant's
    settings applied, `extra` appended to the config (models, budgets). Its log is `root/daemon.log`."""

    def __init__(self, root: Path, v: Variant, extra: str = "", log_level: str = "warning",
                 wait_s: float = 120) -> None:
        from wcd.client import connect

        root.mkdir(parents=True, exist_ok=True)
        self.root, self.variant = root, v
        self.socket = root / "wcd.sock"
        self.log_path = root / "daemon.log"
        config = root / "wcd.toml"
        config.write_text(f'[daemon]\nsocket = "{self.socket}"\n{v.config_lines()}{extra}\n')
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(daemon_argv(v, config, log_level), stdout=self._log, stderr=subprocess.STDOUT,
                                     cwd=ROOT)
        try:
            connect(self.socket, wait_s=wait_s, while_alive=lambda: self.proc.poll() is None,
                    heartbeats=False).close()
        except Exception:
            self.stop()
            tail = self.log_path.read_text()[-3000:]
            raise SystemExit(f"the {v.name} daemon did not start; its log:\n{tail}") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(60)
        self._log.close()

    def __enter__(self) -> Daemon:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def ckpt_specs(specs: list[str] | None, default: tuple[str, ...] = ("1.6:1000", "1.6:100000")
               ) -> list[tuple[float, int]]:
    """`GB:TENSORS` options as pairs."""
    out = []
    for s in specs or default:
        gb, _, tensors = s.partition(":")
        try:
            out.append((float(gb), int(tensors)))
        except ValueError:
            raise SystemExit(f"--ckpt {s!r}: give GB:TENSORS, e.g. 1.6:1000") from None
    return out


def write_checkpoint(d: Path, nbytes: int, tensors: int, shards: int) -> list[Path]:
    """Synthetic BF16 shards of equal tensors (a repeated random block: a load does not care), written
    once per spec (a stamp file says which)."""
    per = max(2, nbytes // tensors // 2 * 2)
    stamp = d / f".spec-{nbytes}-{tensors}-{shards}"
    files = [d / f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    if stamp.exists() and all(f.exists() for f in files):
        return files
    d.mkdir(parents=True, exist_ok=True)
    for f in d.glob("*.safetensors"):
        f.unlink()
    for stale in d.glob(".spec-*"):
        stale.unlink()
    for i, f in enumerate(files):
        names = range(i * tensors // shards, (i + 1) * tensors // shards)
        header = {f"layers.{j}.weight": {"dtype": "BF16", "shape": [per // 2], "data_offsets": [k * per, (k + 1) * per]}
                  for k, j in enumerate(names)}
        _write_shard(f, json.dumps(header).encode(), per * len(names))
    stamp.touch()
    return files


def write_shaped_checkpoint(d: Path, nbytes: int, tensors: int, shards: int = 4) -> Path:
    """The demo's transformer-shaped layout (`wcd.demo.checkpoint_layout`), random bytes."""
    from wcd.demo import checkpoint_layout
    from wcd.manifest import DTYPE_SIZES

    d.mkdir(parents=True, exist_ok=True)
    layout = checkpoint_layout(nbytes, tensors)
    per = -(-len(layout) // shards)
    for s in range(shards):
        header: dict[str, Any] = {}
        at = 0
        for name, dtype, shape in layout[s * per : (s + 1) * per]:
            n = DTYPE_SIZES[dtype]
            for dim in shape:
                n *= dim
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + n]}
            at += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        _write_shard(d / f"model-{s + 1:05d}-of-{shards:05d}.safetensors", raw, at)
    return d


def _write_shard(path: Path, raw: bytes, nbytes: int) -> None:
    block = os.urandom(64 << 20)
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as out:
        out.write(len(raw).to_bytes(8, "little") + raw)
        left = nbytes
        while left:
            left -= out.write(memoryview(block)[: min(left, len(block))])


if __name__ == "__main__":
    for v in VARIANTS.values():
        print(f"{v.name:10} {v.about}" + (f"  [daemon] {v.config}" if v.config else "")
              + (f"  tuning {v.tuning}" if v.tuning else ""))
