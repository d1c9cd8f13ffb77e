"""What the vLLM plugin (`wcd.integrations.vllm`) and its loader (`vllm_loader`) share: the vLLM
names relied on and their resolution (`vllm_api`), the options, the errors, the record of the last
load, and the cache key of processed weights. Importing it needs no vLLM.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import json
import logging
import os
import re
import types
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wcd.integrations.snapshot import SNAPSHOT_FORMAT
from wcd.key import WeightCacheKey

if TYPE_CHECKING:
    import torch
    from vllm.config import ModelConfig, VllmConfig

# vLLM only shows records of loggers under "vllm."; the rest are dropped.
log = logging.getLogger("vllm.wcd")

LOAD_FORMAT = "wcd"
TESTED_VLLM = "0.32.0"  # the vLLM the engine tests run (tests/engines/setup-venv.sh)

# Every vLLM name the plugin relies on, "module:attribute[.attribute]". The engine tests assert each
# exists in the tested vLLM (so a vLLM bump that moves one fails in CI); `vllm_api()` resolves them
# when load_format="wcd" is used. Underscored ones are private: checked as loudly as the rest.
REGISTRATION_NAMES = (
    "vllm.model_executor.model_loader:register_model_loader",
    "vllm.model_executor.model_loader.base_loader:BaseModelLoader",
)
VLLM_NAMES = REGISTRATION_NAMES + (
    "vllm.model_executor.model_loader.default_loader:DefaultModelLoader",
    "vllm.model_executor.model_loader.default_loader:DefaultModelLoader.track_weights_loading",
    "vllm.model_executor.model_loader.utils:initialize_model",
    "vllm.model_executor.model_loader.utils:process_weights_after_loading",
    # BaseModelLoader.load_model's own online-quantization step, which the raw and disk paths repeat.
    "vllm.model_executor.model_loader.base_loader:_has_online_quant",
    "vllm.model_executor.model_loader.reload:finalize_layerwise_processing",
    "vllm.model_executor.utils:weights_already_processed",
    "vllm.model_executor.layers.quantization.base_config:QuantizeMethodBase",
    "vllm.model_executor.layers.quantization.base_config:QuantizeMethodBase.supports_pre_processed_weights",
    # Python-side flags load_weights sets on EAGLE-style models; attach never runs load_weights.
    "vllm.model_executor.model_loader.weight_cache.utils:export_model_attrs",
    "vllm.utils.torch_utils:set_default_torch_dtype",
    "vllm.distributed:get_tensor_model_parallel_rank",
    "vllm.distributed:get_tensor_model_parallel_world_size",
    "vllm.distributed:get_pp_group",
    "vllm.distributed:get_dp_group",
    "vllm.platforms:current_platform",
)

_OPTIONS = {"socket", "socket_path", "mode", "fallback", "publish", "entry", "retention", "timeout_s"}
_GENERIC_DIRS = {"model", "models", "weights", "checkpoint", "checkpoints", "hf", "main"}

# What the last load in this process did: {"path": "attach"|"raw"|"disk", "entry", "published",
# "reason", "load_s", "tensors", "bytes", "key", ...}. Tests and users can read it in-process.
last_load: dict[str, Any] = {}


class WcdLoadError(RuntimeError):
    """The wcd loader cannot load this model as configured (and falling back is off or pointless)."""


class UnsupportedPreprocessed(WcdLoadError):
    """A quant method cannot take already-processed weights: a permanent misconfiguration, never a fallback."""


class IncompatibleVllm(WcdLoadError):
    """The installed vLLM lacks names the loader relies on (`VLLM_NAMES`)."""


@functools.cache
def vllm_api() -> types.SimpleNamespace:
    """The vLLM names in `VLLM_NAMES`, as attributes (`vllm_api().initialize_model`).

    Raises `IncompatibleVllm` naming the vLLM version and every missing name, in one line.
    """
    found: dict[str, Any] = {}
    missing: list[str] = []
    for spec in VLLM_NAMES:
        module_name, _, path = spec.partition(":")
        head, *attrs = path.split(".")
        try:
            obj = getattr(importlib.import_module(module_name), head)
            functools.reduce(getattr, attrs, obj)
        except (ImportError, AttributeError):
            missing.append(f"{module_name}.{path}")
            continue
        found[head] = obj
    if missing:
        raise IncompatibleVllm(
            f"wcd loader: vLLM {vllm_version()} lacks {', '.join(missing)} (this wcd is tested with vLLM "
            f"{TESTED_VLLM}); use a wcd release made for this vLLM, or another load format")
    return types.SimpleNamespace(**found)


def vllm_version() -> str:
    try:
        import vllm

        return str(vllm.__version__)
    except Exception:  # noqa: BLE001 - only for messages
        return "(unknown version)"


# -- options ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Options:
    socket: str | None = None
    mode: str = "zero_copy"
    fallback: bool = True
    publish: bool = True
    entry: str | None = None
    retention: str = "cached"
    timeout_s: float = 600.0

    @classmethod
    def parse(cls, extra: Any) -> Options:
        extra = dict(extra or {})
        unknown = set(extra) - _OPTIONS
        if unknown:
            raise ValueError(f"unknown model_loader_extra_config keys for load format {LOAD_FORMAT!r}: "
                             f"{sorted(unknown)} (known: {sorted(_OPTIONS - {'socket_path'})})")
        socket = extra.get("socket", extra.get("socket_path")) or os.environ.get("WCD_SOCKET") or None
        mode = str(extra.get("mode", "zero_copy")).replace("-", "_")
        if mode not in ("zero_copy", "copy"):
            raise ValueError(f"wcd loader: mode must be 'zero_copy' or 'copy', not {mode!r}")
        retention = str(extra.get("retention", "cached"))
        if retention not in ("cached", "ephemeral", "pinned"):
            raise ValueError(f"wcd loader: retention must be cached, ephemeral or pinned, not {retention!r}")
        return cls(socket=socket, mode=mode, fallback=_bool(extra.get("fallback", True), "fallback"),
                   publish=_bool(extra.get("publish", True), "publish"), entry=extra.get("entry") or None,
                   retention=retention, timeout_s=float(extra.get("timeout_s", 600.0)))


def _bool(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return value.lower() in ("1", "true", "yes", "on")
    raise ValueError(f"wcd loader: {name} must be a boolean, not {value!r}")


# -- the cache key ----------------------------------------------------------------------------------


def checkpoint_dir(model_config: ModelConfig) -> Path | None:
    """The local folder holding the model's safetensors, or None (e.g. a hub id not downloaded)."""
    path = Path(model_config.model)
    if path.is_dir():
        return path.resolve()
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(model_config.model, revision=model_config.revision, local_files_only=True,
                                  allow_patterns=["*.safetensors", "*.json"])
        return Path(local).resolve()
    except Exception:  # noqa: BLE001 - not available locally: no wcd path for it
        return None


def model_name(model_config: ModelConfig, ckpt: Path | None) -> str:
    """A readable entry name prefix: the served name, else the checkpoint folder's name."""
    served = model_config.served_model_name
    if isinstance(served, (list, tuple)):
        served = served[0] if served else None
    name = str(served) if served and served != model_config.model else ""
    if not name:
        p = ckpt or Path(model_config.model)
        parts = [p.name]
        if p.name in _GENERIC_DIRS or re.fullmatch(r"[0-9a-f]{40}", p.name):
            parts.insert(0, p.parent.name)
        name = "-".join(x for x in parts if x)
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "model"
    return f"vllm-{name}"[:120]


def shard(vllm_config: VllmConfig) -> dict[str, int]:
    """This rank's part of the model: TP and PP rank/size (and DP when experts are split across DP ranks)."""
    api = vllm_api()
    pp = api.get_pp_group()
    part = {"tp_rank": api.get_tensor_model_parallel_rank(), "tp_size": api.get_tensor_model_parallel_world_size(),
            "pp_rank": pp.rank_in_group, "pp_size": pp.world_size}
    if vllm_config.parallel_config.enable_expert_parallel:
        dp = api.get_dp_group()
        part.update(dp_rank=dp.rank_in_group, dp_size=dp.world_size)
    return part


def processed_key(vllm_config: VllmConfig, model_config: ModelConfig, device: torch.device, ckpt: Path,
                  fingerprint: str, shard: dict[str, int]) -> WeightCacheKey:
    """The key of this rank's post-processed weights. Compute it before loading: processing may mutate
    hf_config.quantization_config. Config fields are read directly: a renamed one fails loudly
    rather than silently dropping out of the key."""
    import torch
    import vllm

    hf_config = model_config.hf_config
    quant_cfg = getattr(hf_config, "quantization_config", None)  # absent on unquantized checkpoints
    to_dict = getattr(quant_cfg, "to_dict", None)
    if to_dict is not None:
        quant_cfg = to_dict()
    quant = model_config.quantization or "none"
    extra = {
        "engine": f"vllm {vllm.__version__}",
        "torch": torch.__version__,
        "arch": ",".join(getattr(hf_config, "architectures", None) or []),
        "hf_config": _short_hash([_config_json(hf_config), model_config.hf_overrides]),
        "quantization": quant,
        "quant_config": _short_hash([quant_cfg, model_config.quantization_config]),
        "kv_cache_dtype": str(vllm_config.cache_config.cache_dtype),
        "runner": f"{model_config.runner_type}/{model_config.convert_type}",
        "lora": str(vllm_config.lora_config is not None),
        "revision": str(model_config.revision or ""),
        "snapshot": SNAPSHOT_FORMAT,
    }
    return WeightCacheKey(
        model=model_name(model_config, ckpt), path=str(ckpt), fingerprint=fingerprint,
        dtype=str(model_config.dtype).removeprefix("torch."),
        transform=f"vllm-{vllm.__version__}/{quant}", shard=shard, device=device_id(device), extra=extra)


def device_id(device: torch.device) -> str:
    """`cpu`, or the GPU's UUID (the key must not let one GPU's entry serve another)."""
    import torch

    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        try:
            return str(vllm_api().current_platform.get_device_uuid(index))
        except Exception:  # noqa: BLE001 - NVML unavailable: torch knows the same UUID
            return f"GPU-{torch.cuda.get_device_properties(index).uuid}"
    return str(device)


def _config_json(hf_config: Any) -> str:
    try:
        return str(hf_config.to_json_string(use_diff=False))
    except Exception:  # noqa: BLE001 - a config with values JSON cannot hold: its repr still tells them apart
        return repr(hf_config)


def _short_hash(obj: Any) -> str:
    data = json.dumps(obj, sort_keys=True, default=str).encode()
    return hashlib.blake2b(data, digest_size=8).hexdigest()
