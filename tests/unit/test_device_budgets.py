"""`device_budgets`: a GPU the host does not have is a config error naming the field (exit 2 from
`wcd serve`, so systemd does not restart it in a loop); the rest of the config is unaffected."""

from __future__ import annotations

from pathlib import Path

import pytest

from wcd import devices
from wcd.config import Config
from wcd.errors import BadRequest, ConfigError


def fake_memory(device: str) -> tuple[str, int]:
    if device == "cpu":
        return "cpu", 64 << 30
    if device == "cuda:0":
        return "GPU-0000", 80 << 30
    raise BadRequest(f"GPU {device!r} is not visible to this process; visible GPUs: cuda:0=GPU-0000")


@pytest.mark.parametrize(("data", "field"), [
    ({"models": [{"name": "a", "path": "/", "device": "cuda:0"}, {"name": "b", "path": "/", "device": "cuda:7"}]},
     "models.1.device"),
    ({"daemon": {"budget": {"cuda:0": "50%", "cuda:3": "10GiB"}}}, "daemon.budget.cuda:3"),
])
def test_a_gpu_the_host_lacks_names_its_field(monkeypatch, data, field) -> None:
    monkeypatch.setattr(devices, "device_memory", fake_memory)
    config = Config.model_validate(data)
    with pytest.raises(ConfigError) as info:
        devices.device_budgets(config, Path("/etc/wcd/x.toml"))
    assert info.value.message.startswith(f"config /etc/wcd/x.toml: {field}: GPU ")
    assert "is not visible" in info.value.message and info.value.code == "config_error"


def test_visible_devices_get_their_budgets(monkeypatch) -> None:
    monkeypatch.setattr(devices, "device_memory", fake_memory)
    config = Config.model_validate({"daemon": {"budget": {"cuda:0": "50%"}}})
    assert devices.device_budgets(config) == ({"cpu": 32 << 30, "GPU-0000": 40 << 30},
                                              {"cpu": "cpu", "cuda:0": "GPU-0000"})
