"""Restart benchmark (issue 14 item 3): `wcd serve` from exec to READY=1 with entries re-adopted
from the fd store, under the test suite's stand-in for systemd (socket activation, NOTIFY_SOCKET,
FDSTORE). Loads the checkpoints once, restarts `--restarts` times and reports each exec -> READY,
and exec -> every entry ready to serve (re-adopted entries are checked after READY).

    python bench/bench_restart.py --ckpt /tmp/wcd-bench-load/1.6gb-1000 [--ckpt DIR ...] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.integration.test_systemd_harness import FakeSystemd  # noqa: E402
from wcd.client import Client  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", action="append", type=Path, required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--restarts", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        cfg = root / "wcd.toml"
        text = f'[daemon]\nsocket = "{root / "unused.sock"}"\n'
        for i, path in enumerate(args.ckpt):
            text += f'\n[[models]]\nname = "m{i}"\npath = "{path}"\ndevice = "{args.device}"\n'
        cfg.write_text(text)
        systemd = FakeSystemd(root)
        try:
            systemd.start(cfg)
            with open(systemd.log) as log:
                deadline = time.monotonic() + 600
                while log.read().count("loaded ") < len(args.ckpt) and time.monotonic() < deadline:
                    time.sleep(0.1)
                    log.seek(0)
            time.sleep(0.5)  # parked
            systemd.stop()
            times, served = [], []
            for _ in range(args.restarts):
                start = time.perf_counter()
                systemd.start(cfg)  # returns at READY=1
                times.append(time.perf_counter() - start)
                with Client(systemd.sock_path) as c:
                    while [e["state"] for e in c.list()] != ["ready"] * len(args.ckpt):
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
                      "adopted": adopted, "checkpoints": [str(p) for p in args.ckpt]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
