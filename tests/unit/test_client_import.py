"""The client is imported on an engine's start-up clock: it must not pull in what it does not use."""

from __future__ import annotations

import subprocess
import sys


def test_client_import_is_lean() -> None:
    code = ("import sys; from wcd.client import Client, connect; "
            "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('pydantic', 'torch', 'cuda', 'numpy', 'safetensors', 'wcd'))))")
    loaded = set(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                text=True).stdout.split())
    assert "wcd.client" in loaded and "wcd.wire" in loaded
    heavy = {m for m in loaded if m.split(".")[0] in ("pydantic", "torch", "cuda", "numpy", "safetensors")}
    assert not heavy
    assert not loaded & {"wcd.protocol", "wcd.key", "wcd.config", "wcd.checkpoint", "wcd.views"}
