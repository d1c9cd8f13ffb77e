"""Profile one cold attach (fresh client process) of a 1000-tensor GPU entry through the daemon.

Answers "where do the attach milliseconds go": the time of the first acquire -> usable tensors
in a fresh process (after connect), later attaches on the same connection, and a cProfile of one.

    python bench/profile_attach.py --dir /tmp/wcd-prof [--device cuda:0] [--tensors 1000]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

_CLIENT = r"""
import cProfile, pstats, sys, time, io
import torch
torch.zeros(1, device=sys.argv[2] if sys.argv[2] != "cpu" else "cpu")  # CUDA context outside the profile
from wcd.client import Client
c = Client(sys.argv[1])
t = time.perf_counter()
lease = c.acquire("prof")
tensors = lease.tensors
first = time.perf_counter() - t
lease.release(); del tensors
prof = cProfile.Profile()
prof.enable()
lease = c.acquire("prof"); tensors = lease.tensors
prof.disable()
lease.release(); del tensors
again = []
for _ in range(5):
    t = time.perf_counter()
    lease = c.acquire("prof"); tensors = lease.tensors
    again.append(time.perf_counter() - t)
    lease.release(); del tensors
print(f"first attach {first * 1e3:.2f} ms; again: " + ", ".join(f"{x * 1e3:.2f}" for x in again) + " ms")
s = io.StringIO()
pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
print(s.getvalue())
"""


def main() -> None:
    from wcd.client import connect
    from wcd.demo import write_checkpoint

    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", type=Path, default=Path("/tmp/wcd-prof"))
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--tensors", type=int, default=1000)
    ap.add_argument("--size-mb", type=int, default=2048)
    args = ap.parse_args()
    ckpt = args.dir / "ckpt"
    if not ckpt.exists():
        write_checkpoint(ckpt, args.size_mb << 20, args.tensors)
    sock, cfg = args.dir / "wcd.sock", args.dir / "wcd.toml"
    budget = f'budget = {{ "{args.device}" = "50%" }}\n' if args.device != "cpu" else ""
    cfg.write_text(f'[daemon]\nsocket = "{sock}"\n{budget}[[models]]\nname = "prof"\npath = "{ckpt}"\n'
                   f'device = "{args.device}"\n')
    daemon = subprocess.Popen([sys.executable, "-m", "wcd", "serve", "--config", str(cfg), "--log-level", "warning"],
                              cwd=str(REPO))
    try:
        with connect(sock, wait_s=60, while_alive=lambda: daemon.poll() is None) as c, c.acquire("prof"):
            pass  # waits for the load
        subprocess.run([sys.executable, "-c", _CLIENT, str(sock), args.device], check=True, cwd=str(REPO))
    finally:
        daemon.terminate()
        daemon.wait()


if __name__ == "__main__":
    main()
