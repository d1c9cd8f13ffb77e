"""`wcd demo`: the embedded default. Needs no model download.

Writes a realistic checkpoint (transformer-like names, mixed dtypes), starts a daemon on a
temporary socket, loads it, then simulates two engine starts in fresh processes: from disk with
safetensors `load_file`, and attached from the daemon. Prints both times, proves the tensors
bit-identical across the two processes (per-tensor digests), and cleans up.
"""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from wcd.errors import WcdError


def checkpoint_layout(size_bytes: int, n_tensors: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """A transformer-like tensor list of about `size_bytes` and exactly `n_tensors` tensors.

    Mostly bf16 matrices, fp32 norms, fp8 weights with fp32 scales, an int64 buffer, a scalar
    and a zero-size tensor, so every arena code path is exercised.
    """
    fixed = [("model.embed_tokens.weight", "BF16", (0, 0)), ("model.norm.weight", "F32", (1024,)),
             ("model.rotary.inv_freq_step", "F32", ()), ("model.unused_empty", "BF16", (0, 64)),
             ("model.position_ids", "I64", (1, 2048))]
    per_layer = [("self_attn.q_proj.weight", "BF16", 4), ("self_attn.k_proj.weight", "BF16", 1),
                 ("self_attn.v_proj.weight", "BF16", 1), ("self_attn.o_proj.weight", "BF16", 4),
                 ("mlp.gate_proj.weight", "F8_E4M3", 8), ("mlp.gate_proj.weight_scale", "F32", 0),
                 ("mlp.up_proj.weight", "BF16", 8), ("mlp.down_proj.weight", "BF16", 8),
                 ("input_layernorm.weight", "F32", 0), ("post_attention_layernorm.weight", "F32", 0)]
    layers = max(1, (n_tensors - len(fixed)) // len(per_layer))
    # Pick the hidden size so the matrices add up to about size_bytes (each unit = hidden^2 / 4 elements).
    units = sum(u for _, _, u in per_layer) * layers
    hidden = max(64, int(math.sqrt(size_bytes * 0.9 / (units / 4 * 1.9))) // 64 * 64)
    out: list[tuple[str, str, tuple[int, ...]]] = []
    for i in range(layers):
        for name, dtype, unit in per_layer:
            shape = (hidden * unit // 4, hidden) if unit else ((1,) if name.endswith("scale") else (hidden,))
            out.append((f"model.layers.{i}.{name}", dtype, shape))
    vocab = max(16, int(size_bytes * 0.1 / (hidden * 2)))
    fixed[0] = ("model.embed_tokens.weight", "BF16", (vocab, hidden))
    out = fixed + out
    extra = n_tensors - len(out)
    out += [(f"model.extra.{i}.bias", "F16", (hidden,)) for i in range(max(0, extra))]
    return out[:n_tensors]


def write_checkpoint(directory: Path, size_bytes: int, n_tensors: int, shards: int = 2, seed: int = 0) -> Path:
    """Write a synthetic checkpoint (safetensors shards) into `directory`; returns it."""
    import torch
    from safetensors.torch import save_file

    from wcd.views import TORCH_DTYPES

    directory.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    layout = checkpoint_layout(size_bytes, n_tensors)
    per_shard = math.ceil(len(layout) / shards)
    for s in range(shards):
        tensors = {}
        for name, dtype, shape in layout[s * per_shard : (s + 1) * per_shard]:
            dt = TORCH_DTYPES[dtype]
            if dt.is_floating_point:
                t = torch.randn(shape, generator=gen, dtype=torch.float32).to(dt)
            else:
                t = torch.randint(0, 1 << 20, shape, generator=gen, dtype=torch.int64).to(dt)
            tensors[name] = t
        save_file(tensors, str(directory / f"model-{s + 1:05d}-of-{shards:05d}.safetensors"))
    return directory


def tensor_digests(tensors: dict[str, Any]) -> dict[str, str]:
    """Per-tensor blake2b of the raw bytes (dtype and shape included)."""
    out = {}
    for name, t in tensors.items():
        h = hashlib.blake2b(f"{t.dtype}{tuple(t.shape)}".encode(), digest_size=16)
        h.update(t.contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes() if t.numel() else b"")
        out[name] = h.hexdigest()
    return out


_ENGINE = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
from wcd.demo import tensor_digests
mode, where = sys.argv[1], sys.argv[2]
if mode == "disk":
    from safetensors.torch import load_file
    import pathlib
    start = time.perf_counter()
    tensors = {}
    for f in sorted(pathlib.Path(where).glob("*.safetensors")):
        tensors.update(load_file(f))
    lazy_s = time.perf_counter() - start
    # load_file maps the file lazily; an engine then copies every tensor into its own parameters.
    tensors = {name: t.clone() for name, t in tensors.items()}
    seconds = time.perf_counter() - start
else:
    from wcd.client import Client
    start = time.perf_counter()
    client = Client(where)
    lease = client.acquire("demo")
    tensors = lease.tensors
    seconds = lazy_s = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "lazy_s": lazy_s, "import_torch_s": t1 - t0, "digests": tensor_digests(tensors)}))
"""


def _engine(mode: str, where: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", _ENGINE, mode, where], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise WcdError(f"simulated engine ({mode}) failed: {out.stderr.strip().splitlines()[-1:]}")
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def run_demo(size_mb: int = 384, n_tensors: int = 300) -> int:

    with tempfile.TemporaryDirectory(prefix="wcd-demo-") as tmp:
        root = Path(tmp)
        t = time.perf_counter()
        ckpt = write_checkpoint(root / "checkpoint", size_mb << 20, n_tensors)
        nbytes = sum(f.stat().st_size for f in ckpt.iterdir())
        print(f"wrote a {n_tensors}-tensor checkpoint, {nbytes / 2**20:.0f} MiB (bf16, fp32, fp8, fp16, int64) "
              f"in {time.perf_counter() - t:.1f} s")
        sock = root / "wcd.sock"
        (root / "wcd.toml").write_text(
            f'[daemon]\nsocket = "{sock}"\n\n[[models]]\nname = "demo"\npath = "{ckpt}"\nretention = "pinned"\n')
        log = open(root / "daemon.log", "w+")
        daemon = subprocess.Popen([sys.executable, "-m", "wcd", "serve", "--config", str(root / "wcd.toml")],
                                  stdout=log, stderr=subprocess.STDOUT)
        try:
            t = time.perf_counter()
            client = _connect(sock, daemon, log)
            with client, client.acquire("demo"):
                pass
            load_s = time.perf_counter() - t
            print(f"daemon started and loaded it in {load_s:.2f} s (pid {daemon.pid}, socket {sock})")
            disk = _engine("disk", str(ckpt))
            attached = _engine("wcd", str(sock))
        finally:
            daemon.terminate()
            daemon.wait(timeout=30)
            log.close()
    same = disk["digests"] == attached["digests"]
    n = len(disk["digests"])
    print(f"engine start from disk: safetensors load_file + copy into parameters: {disk['seconds'] * 1e3:8.1f} ms"
          f"   (load_file alone maps lazily: {disk['lazy_s'] * 1e3:.1f} ms, nothing read yet)")
    print(f"engine start attached from wcd (zero-copy views, ready to use):      {attached['seconds'] * 1e3:8.1f} ms"
          f"   ({disk['seconds'] / attached['seconds']:.0f}x faster)")
    print(f"(import torch, not counted above: {attached['import_torch_s']:.1f} s)")
    if same:
        print(f"bit-identical: yes, all {n} tensors (per-tensor blake2b in both engine processes)")
        return 0
    bad = [k for k in disk["digests"] if disk["digests"][k] != attached["digests"].get(k)]
    print(f"bit-identical: NO, {len(bad)} tensors differ: {', '.join(bad[:5])}")
    return 1


def _connect(sock: Path, daemon: subprocess.Popen[bytes], log: Any) -> Any:
    from wcd.client import connect
    from wcd.errors import DaemonUnavailable

    try:
        return connect(sock, wait_s=30, while_alive=lambda: daemon.poll() is None)
    except DaemonUnavailable:
        log.seek(0)
        raise WcdError(f"the demo daemon did not start: {log.read().strip()[-500:]}") from None
