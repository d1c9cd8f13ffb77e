"""Loader-level timing of the vLLM plugin's attach path on a GPU, without vLLM.

vLLM does not run on the GPU machine here, so this measures the plugin's own code path around it:
a synthetic transformer-shaped model is snapshotted and published with `wcd.integrations.snapshot`'s
`snapshot`/`encode_meta` (as the plugin publishes), then a fresh process builds the same model on
the meta device, acquires the entry and `bind`s every parameter to the arena views, as the
plugin's attach does before vLLM's post-load step.

    python bench/bind_gpu.py --dir /tmp/wcd-bind [--layers 128] [--hidden 2048]   (1027 tensors, 8.9 GB)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402


class Layer(torch.nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.k_proj = torch.nn.Linear(hidden, hidden // 8, bias=False)
        self.v_proj = torch.nn.Linear(hidden, hidden // 8, bias=False)
        self.o_proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.gate_up_proj = torch.nn.Linear(hidden, 2 * inter, bias=False)
        self.down_proj = torch.nn.Linear(inter, hidden, bias=False)
        self.input_layernorm = torch.nn.LayerNorm(hidden, bias=False)
        self.post_attention_layernorm = torch.nn.LayerNorm(hidden, bias=False)


class Model(torch.nn.Module):
    def __init__(self, layers: int, hidden: int, vocab: int = 32000) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(vocab, hidden)
        self.layers = torch.nn.ModuleList(Layer(hidden, hidden * 2) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(hidden, bias=False)
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)


def publish(args: argparse.Namespace, sock: Path) -> dict:
    from wcd.arenas.cuda import find_gpu
    from wcd.client import Client
    from wcd.integrations.snapshot import META_TENSOR, encode_meta, snapshot
    from wcd.key import WeightCacheKey

    with torch.device("cuda:0"):
        model = Model(args.layers, args.hidden).to(torch.bfloat16)
    tensors, meta = snapshot(model)
    tensors[META_TENSOR] = encode_meta(meta)
    key = WeightCacheKey(model="bind-bench", transform="vllm-snapshot", device=find_gpu("cuda:0").uuid)
    with Client(sock) as c:
        t = time.perf_counter()
        name = c.publish(key, tensors)
        seconds = time.perf_counter() - t
    nbytes = sum(v.numel() * v.element_size() for v in tensors.values())
    return {"entry": name, "tensors": len(tensors), "bytes": nbytes, "publish_s": seconds, "key": key.model_dump_json()}


def attach(args: argparse.Namespace) -> dict:
    torch.zeros(1, device="cuda")  # CUDA context outside the timing, as in an engine
    from wcd.client import Client
    from wcd.integrations.snapshot import META_TENSOR, bind, decode_meta, meta_leftovers
    from wcd.key import WeightCacheKey

    key = WeightCacheKey.model_validate_json(args.key)
    c = Client(args.socket)
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = Model(args.layers, args.hidden).to(torch.bfloat16)
    t1 = time.perf_counter()
    lease = c.acquire(key)
    tensors = lease.tensors
    t2 = time.perf_counter()
    meta = decode_meta(tensors[META_TENSOR])
    nbytes = bind(model, tensors, meta, copy=False)
    t3 = time.perf_counter()
    left = meta_leftovers(model)
    zero_copy = model.layers[0].q_proj.weight.data_ptr() == tensors["layers.0.q_proj.weight"].data_ptr()
    return {"create_meta_model_s": t1 - t0, "acquire_s": t2 - t1, "bind_s": t3 - t2, "attach_total_s": t3 - t1,
            "bound_bytes": nbytes, "leftovers": len(left), "zero_copy": zero_copy,
            "params": sum(1 for _ in model.parameters())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", type=Path, default=Path("/tmp/wcd-bind"))
    ap.add_argument("--layers", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--role", default="main")
    ap.add_argument("--socket")
    ap.add_argument("--key")
    args = ap.parse_args()
    if args.role == "attach":
        print(json.dumps(attach(args)))
        return
    from wcd.client import connect

    args.dir.mkdir(parents=True, exist_ok=True)
    sock, cfg = args.dir / "wcd.sock", args.dir / "wcd.toml"
    cfg.write_text(f'[daemon]\nsocket = "{sock}"\nbudget = {{ "cuda:0" = "90%" }}\n')
    daemon = subprocess.Popen([sys.executable, "-m", "wcd", "serve", "--config", str(cfg), "--log-level", "warning"],
                              cwd=str(REPO))
    try:
        connect(sock, wait_s=60, while_alive=lambda: daemon.poll() is None).close()
        res = {"publish": publish(args, sock)}
        runs = []
        for _ in range(3):
            out = subprocess.run([sys.executable, __file__, "--role", "attach", "--socket", str(sock), "--key",
                                  res["publish"]["key"], "--layers", str(args.layers), "--hidden", str(args.hidden)],
                                 capture_output=True, text=True, check=True, cwd=str(REPO))
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        res["attach_runs"] = runs
    finally:
        daemon.terminate()
        daemon.wait(timeout=60)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
