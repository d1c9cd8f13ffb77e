"""The client's CUDA driver binding, as far as it goes without a GPU: naming GPUs, and one clear
line when there is no driver. The mapping calls themselves run in tests/gpu on a real GPU."""

from __future__ import annotations

import pytest

from wcd.arenas.cudrv import Driver, Gpu, format_uuid, resolve_gpu
from wcd.errors import BadRequest, DeviceUnavailable

GPUS = (Gpu(0, "GPU-00000000-1111-2222-3333-444444444444", "H200"),
        Gpu(1, "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee", "H200"))


def test_format_uuid() -> None:
    assert format_uuid(bytes(range(16))) == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"


@pytest.mark.parametrize(("device", "ordinal"), [("cuda", 0), ("cuda:0", 0), ("cuda:1", 1),
                                                 ("GPU-AAAAAAAA-bbbb-cccc-dddd-eeeeeeeeeeee", 1)])
def test_resolve_gpu(device: str, ordinal: int) -> None:
    assert resolve_gpu(device, GPUS).ordinal == ordinal


def test_resolve_gpu_names_what_is_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    with pytest.raises(BadRequest) as info:
        resolve_gpu("cuda:2", GPUS)
    assert "CUDA_VISIBLE_DEVICES='1'" in info.value.message
    assert "cuda:1=GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee" in info.value.message
    with pytest.raises(BadRequest):
        resolve_gpu("GPU-ffffffff-0000-0000-0000-000000000000", GPUS)


def test_no_driver_is_one_line() -> None:
    with pytest.raises(DeviceUnavailable) as info:
        Driver("libcuda-that-does-not-exist.so.1")
    assert "install the NVIDIA driver" in info.value.message and "\n" not in info.value.message


def test_a_library_without_the_driver_api_is_refused() -> None:
    with pytest.raises(DeviceUnavailable, match="has no cuInit"):
        Driver("libc.so.6")
