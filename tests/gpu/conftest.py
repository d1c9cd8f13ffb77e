"""GPU tests: marked `gpu`, and skipped with one reason unless this machine has an NVIDIA GPU,
its driver, cuda-bindings and a CUDA build of torch. CI (no GPU) skips them cleanly."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@functools.cache
def gpu_skip_reason() -> str | None:
    """Why the GPU tests cannot run here, or None when they can."""
    try:
        from cuda.bindings import driver as cuda
    except ImportError:
        return "cuda-bindings is not installed (pip install '.[cuda]')"
    try:
        err, = cuda.cuInit(0)
    except Exception as e:  # noqa: BLE001 - cuda-bindings raises its own loader errors without a driver
        return f"no NVIDIA driver ({type(e).__name__})"
    if err != cuda.CUresult.CUDA_SUCCESS or cuda.cuDeviceGetCount()[1] == 0:
        return "no NVIDIA GPU visible"
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} is a build without CUDA"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            reason = gpu_skip_reason()
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))
