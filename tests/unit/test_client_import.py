"""The client is imported on an engine's start-up clock, and wcdctl on an operator's: neither may
pull in what it does not use."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_client_import_is_lean() -> None:
    _check_lean("from wcd.client import Client, connect")


def test_wcdctl_import_is_as_lean_as_the_client() -> None:
    """`wcdctl status` runs on an operator's clock: sizes come from wcd.units, not the config's pydantic."""
    _check_lean("import wcd.cli.wcdctl")


@pytest.mark.slow
def test_what_an_engine_loads_to_attach_is_lean() -> None:
    """With torch, a client preloads the views and the CUDA mapping code at connect: still no pydantic."""
    _check_lean("import torch, wcd.client, wcd.views, wcd.arenas.cuda_map", allowed=("torch", "numpy"))


def _check_lean(imports: str, allowed: tuple[str, ...] = ()) -> None:
    code = (f"import sys; {imports}; "
            "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('pydantic', 'torch', 'cuda', 'numpy', 'safetensors', 'wcd'))))")
    loaded = set(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                text=True).stdout.split())
    assert "wcd.client" in loaded and "wcd.wire" in loaded
    heavy = {m for m in loaded if m.split(".")[0] in ("pydantic", "torch", "cuda", "numpy", "safetensors")
             and m.split(".")[0] not in allowed}
    assert not heavy
    daemon_side = {"wcd.protocol", "wcd.key", "wcd.config", "wcd.checkpoint", "wcd.arenas.cuda"}
    assert not loaded & (daemon_side if allowed else daemon_side | {"wcd.views"})
