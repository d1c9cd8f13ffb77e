"""Restart: `wcd serve` from exec to READY=1 with entries re-adopted
from the fd store, under the test suite's stand-in for systemd (socket activation, NOTIFY_SOCKET,
FDSTORE). Loads the checkpoints once, restarts `--restarts` times and reports each exec -> READY,
and exec -> every entry ready to serve (re-adopted entries are checked after READY). `--reserve GB`
adds a published entry of that size (reserved and committed, its bytes left as allocated). The
daemon runs as the Debian launcher starts it, `python3 -SsP` with its modules on PYTHONPATH (here
this interpreter's sys.path), unless `--python-flags ""`.

Checkpoints are bench_load's synthetic ones (`--ckpt GB:TENSORS`, written once under `--dir`).
A `--variant` adds its config lines; variants that set load tuning are refused (the daemon is
exec'd as systemd would, with nothing set beforehand). `--device cuda:0,cpu` runs each device in
turn. One JSON line per device and variant.

    python bench/bench_restart.py --ckpt 0.1:200 [--ckpt 1.6:100000 ...] [--device cuda:0] [--reserve 64]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import common
from common import Variant, write_checkpoint

from tests.integration.test_systemd_harness import FakeSystemd
from wcd.client import Client
from wcd.key import WeightCacheKey

GiB = 1 << 30


def main() -> int:
    ap = common.parser(__doc__)
    ap.add_argument("--ckpt", action="append", metavar="GB:TENSORS", help="default: 0.1:200")
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "wcd-bench-load")
    ap.add_argument("--restarts", type=int, default=3)
    ap.add_argument("--reserve", type=float, action="append", default=[], help="GB: a published entry")
    ap.add_argument("--python-flags", default="-SsP", help="the daemon's interpreter flags (launcher: -SsP)")
    args = ap.parse_args()
    for v in args.variant:
        if v.tuning:
            raise SystemExit(f"variant {v.name} sets load tuning, which a daemon started as systemd starts it "
                             "does not take; pick one that sets config only (`python bench/common.py`)")
    ckpts = []
    for gb, tensors in common.ckpt_specs(args.ckpt, default=("0.1:200",)):
        d = args.dir / f"{gb:g}gb-{tensors}"
        write_checkpoint(d, int(gb * 1e9), tensors, 4)
        ckpts.append(d)
    result: dict[str, Any] = {**common.run_info(args.device, args.variant), "rows": []}
    try:
        for device in args.device.split(","):
            for v in args.variant:
                result["rows"].append(restarts(v, device, ckpts, args))
                print(json.dumps(result["rows"][-1]), flush=True)
    finally:
        common.write_json(args.json, result)
    return 0


def restarts(v: Variant, device: str, ckpts: list[Path], args: Any) -> dict[str, Any]:
    flags = tuple(args.python_flags.split())
    # With -S the daemon finds its modules only on PYTHONPATH, as the launcher's vendored directory.
    env = {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)} if "-S" in "".join(flags) else {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        cfg = root / "wcd.toml"
        text = f'[daemon]\nsocket = "{root / "unused.sock"}"\n{v.config_lines()}'
        for i, path in enumerate(ckpts):
            text += f'\n[[models]]\nname = "m{i}"\npath = "{path}"\ndevice = "{device}"\n'
        cfg.write_text(text)
        systemd = FakeSystemd(root)
        try:
            systemd.start(cfg, env=env, python_flags=flags)
            with open(systemd.log) as log:
                deadline = time.monotonic() + 600
                while log.read().count("loaded ") < len(ckpts) and time.monotonic() < deadline:
                    time.sleep(0.1)
                    log.seek(0)
            with Client(systemd.sock_path) as c:
                for i, gb in enumerate(args.reserve):
                    on = c.list()[0]["device"] if ckpts else device
                    key = WeightCacheKey(model=f"r{i}", transform="bench/reserved", device=on)
                    n = int(gb * GiB) // GiB
                    c.reserve(key, {f"t{j}": ("BF16", (GiB // 2,)) for j in range(n)}).commit()
            time.sleep(0.5)  # parked
            systemd.stop()
            times, served = [], []
            for _ in range(args.restarts):
                start = time.perf_counter()
                systemd.start(cfg, env=env, python_flags=flags)  # returns at READY=1
                times.append(time.perf_counter() - start)
                with Client(systemd.sock_path) as c:
                    while [e["state"] for e in c.list()] != ["ready"] * (len(ckpts) + len(args.reserve)):
                        time.sleep(0.002)
                served.append(time.perf_counter() - start)
                systemd.stop()
            text = systemd.log.read_text()
            adopted = text.count("adopted ")
            phases = [line.split(" ", 1)[1] for line in text.splitlines() if "after exec:" in line]
        except BaseException:
            print("".join(systemd.log.read_text().splitlines(keepends=True)[-40:]), file=sys.stderr)
            raise
        finally:
            systemd.close()
    return {"variant": v.name, "daemon_says": phases[-args.restarts:], "exec_to_ready_s": times,
            "exec_to_served_s": served, "adopted": adopted, "checkpoints": [str(p) for p in ckpts],
            "reserved_gb": args.reserve, "python_flags": args.python_flags, "device": device}


if __name__ == "__main__":
    sys.exit(main())
