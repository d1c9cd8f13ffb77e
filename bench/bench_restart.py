"""Restart benchmark (issue 14 item 3): `wcd serve` from exec to READY=1 with entries re-adopted
from the fd store, under the test suite's stand-in for systemd (socket activation, NOTIFY_SOCKET,
FDSTORE). Loads the checkpoints once, restarts `--restarts` times and reports each exec -> READY,
and exec -> every entry ready to serve (re-adopted entries are checked after READY). `--reserve GB`
adds a published entry of that size (reserved and committed, its bytes left as allocated). The
daemon runs as the Debian launcher starts it, `python3 -SsP` with its modules on PYTHONPATH (here
this interpreter's sys.path), unless `--python-flags ""`.

    python bench/bench_restart.py --ckpt /tmp/wcd-bench-load/1.6gb-1000 [--ckpt DIR ...] [--device cpu]
        [--reserve 64]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.integration.test_systemd_harness import FakeSystemd  # noqa: E402
from wcd.client import Client  # noqa: E402
from wcd.key import WeightCacheKey  # noqa: E402

GiB = 1 << 30


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", action="append", type=Path, required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--restarts", type=int, default=3)
    ap.add_argument("--reserve", type=float, action="append", default=[], help="GB: a published entry")
    ap.add_argument("--python-flags", default="-SsP", help="the daemon's interpreter flags (launcher: -SsP)")
    args = ap.parse_args()
    flags = tuple(args.python_flags.split())
    # With -S the daemon finds its modules only on PYTHONPATH, as the launcher's vendored directory.
    env = {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)} if "-S" in "".join(flags) else {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        cfg = root / "wcd.toml"
        text = f'[daemon]\nsocket = "{root / "unused.sock"}"\n'
        for i, path in enumerate(args.ckpt):
            text += f'\n[[models]]\nname = "m{i}"\npath = "{path}"\ndevice = "{args.device}"\n'
        cfg.write_text(text)
        systemd = FakeSystemd(root)
        try:
            systemd.start(cfg, env=env, python_flags=flags)
            with open(systemd.log) as log:
                deadline = time.monotonic() + 600
                while log.read().count("loaded ") < len(args.ckpt) and time.monotonic() < deadline:
                    time.sleep(0.1)
                    log.seek(0)
            with Client(systemd.sock_path) as c:
                for i, gb in enumerate(args.reserve):
                    device = c.list()[0]["device"] if args.ckpt else args.device
                    key = WeightCacheKey(model=f"r{i}", transform="bench/reserved", device=device)
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
                    while [e["state"] for e in c.list()] != ["ready"] * (len(args.ckpt) + len(args.reserve)):
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
    print(json.dumps({"daemon_says": phases[-args.restarts:], "exec_to_ready_s": times, "exec_to_served_s": served,
                      "adopted": adopted, "checkpoints": [str(p) for p in args.ckpt], "reserved_gb": args.reserve,
                      "python_flags": args.python_flags, "device": args.device}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
