"""wcd.integrations.transformers: Hugging Face models built from config, weights attached from the daemon.

Same two models as the vLLM tests; outputs must be bit-identical to `from_pretrained` from disk.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers", reason="needs the engines venv: tests/engines/setup-venv.sh")

import torch  # noqa: E402
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from tests.engines.conftest import TIMINGS  # noqa: E402
from wcd.errors import NotFound  # noqa: E402
from wcd.integrations.transformers import from_pretrained  # noqa: E402


@pytest.fixture
def daemon(make_daemon, minilm, smollm2):
    d = make_daemon(models={"minilm": minilm, "smollm2": smollm2})
    d.wait_loaded()
    return d


def _timed(label: str, model: str, fn: Any) -> Any:
    t = time.perf_counter()
    out = fn()
    TIMINGS.append({"model": model, "label": label, "import_s": 0.0, "ready_s": time.perf_counter() - t,
                    "load_model_s": time.perf_counter() - t})
    return out


def _arena_of(lease: Any) -> tuple[int, int]:
    base = min(t.data_ptr() for t in lease.tensors.values())
    return base, base + lease.manifest.size


def test_minilm_embeddings_identical_and_zero_copy(daemon, minilm):
    disk = _timed("transformers from disk", "minilm", lambda: AutoModel.from_pretrained(str(minilm)).eval())
    model = _timed("transformers via wcd", "minilm", lambda: from_pretrained(AutoModel, minilm, socket=daemon.socket))
    assert model._wcd["path"] == "attach" and model._wcd["entry"] == "minilm" and model._wcd["converted"] == 0
    lo, hi = _arena_of(model._wcd_lease)
    assert all(lo <= p.data_ptr() < hi for p in model.parameters())  # every weight is a view of the arena
    tok = AutoTokenizer.from_pretrained(str(minilm))
    batch = tok(["hello world", "wcd keeps model weights resident"], padding=True, return_tensors="pt")
    with torch.no_grad():
        a, b = disk(**batch).last_hidden_state, model(**batch).last_hidden_state
    assert torch.equal(a, b)
    leases = daemon.leases()
    assert [(x["entry"], x["kind"]) for x in leases] == [("minilm", "read")]


def test_smollm2_logits_and_greedy_tokens_identical_tied_embeddings(daemon, smollm2):
    disk = _timed("transformers from disk", "smollm2",
                  lambda: AutoModelForCausalLM.from_pretrained(str(smollm2)).eval())
    model = _timed("transformers via wcd", "smollm2",
                   lambda: from_pretrained(AutoModelForCausalLM, smollm2, socket=daemon.socket))
    assert model._wcd["path"] == "attach" and model._wcd["entry"] == "smollm2"
    # lm_head.weight is not in the checkpoint: it is the resident embedding, one tensor.
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.data_ptr() == model._wcd_lease.tensors["model.embed_tokens.weight"].data_ptr()
    tok = AutoTokenizer.from_pretrained(str(smollm2))
    batch = tok(["The capital of France is"], return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(disk(**batch).logits, model(**batch).logits)
        a = disk.generate(**batch, max_new_tokens=10, do_sample=False)
        b = model.generate(**batch, max_new_tokens=10, do_sample=False)
    assert torch.equal(a, b)
    assert tok.decode(b[0, batch["input_ids"].shape[1]:]).startswith(" Paris")


def test_dtype_conversion_is_a_logged_copy(daemon, minilm):
    model = from_pretrained(AutoModel, minilm, socket=daemon.socket, dtype=torch.bfloat16)
    assert model._wcd["path"] == "attach" and model._wcd["converted"] > 0
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_another_checkpoint_is_never_attached(daemon, smollm2, minilm):
    with pytest.raises(NotFound, match="fallback=False"):
        from_pretrained(AutoModel, minilm, socket=daemon.socket, entry="smollm2", fallback=False)
    model = from_pretrained(AutoModel, minilm, socket=daemon.socket, entry="smollm2")  # falls back to disk
    assert model._wcd["path"] == "disk"


def test_no_daemon_falls_back_to_disk(tmp_path: Path, minilm):
    model = from_pretrained(AutoModel, minilm, socket=str(tmp_path / "none.sock"))
    assert model._wcd["path"] == "disk" and "not running" in model._wcd["reason"]
    with pytest.raises(NotFound, match="not running"):
        from_pretrained(AutoModel, minilm, socket=str(tmp_path / "none.sock"), fallback=False)


def test_load_asks_the_daemon_to_load_the_folder(make_daemon, minilm):
    d = make_daemon(name="empty")
    model = from_pretrained(AutoModel, minilm, socket=d.socket, load=True)
    assert model._wcd["path"] == "attach"
    entry = {e["name"]: e for e in d.entries()}[model._wcd["entry"]]
    assert entry["origin"] == "load" and entry["key"]["transform"] == "raw"
