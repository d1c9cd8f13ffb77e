"""vLLM model loader plugin: `load_format="wcd"`, weights from a wcd daemon.

Registered through the `vllm.general_plugins` entry point (`wcd = "wcd.integrations.vllm:register"`),
so every vLLM process (engine core, workers) knows the format. Options come through
`--model-loader-extra-config` / `model_loader_extra_config`:

| key | default | meaning |
|---|---|---|
| `socket` | `$WCD_SOCKET` | the daemon's socket (`socket_path` is accepted too) |
| `mode` | `zero_copy` | `zero_copy`: parameters are views of the daemon's arena (the lease lives as long as the engine); `copy`: clone them into engine memory and end the lease |
| `fallback` | `true` | load from disk when the daemon is absent or holds neither processed nor raw weights; `false` makes that an error |
| `publish` | `true` | after a raw or disk load, publish the processed weights so the next start attaches |
| `entry` | auto | name of the daemon entry holding the raw checkpoint (default: any ready raw entry whose checkpoint fingerprint matches) |
| `retention` | `cached` | retention of published entries (`cached`, `ephemeral`, `pinned`) |
| `timeout_s` | `600` | how long to wait for an entry the daemon is still loading or filling |

Three paths, chosen automatically, logged on the `vllm.wcd` logger and recorded in `last_load`:

1. **attach** — the daemon holds processed weights under this engine's exact key: build the model
   on the meta device, bind every parameter and buffer to the arena's views (no copy, no disk
   read), then run vLLM's post-load step under `weights_already_processed()`.
2. **raw** — the daemon holds the raw checkpoint (same fingerprint): feed its tensors to
   `model.load_weights` (vLLM shards and converts them), post-process, publish.
3. **disk** — neither (or no daemon): vLLM's default loader reads the checkpoint, then publish.

The key covers what changes the weights: checkpoint fingerprint (names, sizes, headers and sampled
bytes), dtype, quantization method and a hash of its config, a hash of the HF config, TP/PP ranks
and sizes, vLLM and torch versions, the device (GPU UUID or `cpu`) and the runner. A near miss is
a miss (the daemon names the differing fields, logged at INFO), never a wrong weight.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import logging
import os
import re
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from wcd.client import Client, Lease
from wcd.errors import KeyMismatch, NotFound, WcdError
from wcd.key import WeightCacheKey, fingerprint_checkpoint

if TYPE_CHECKING:
    from vllm.config import ModelConfig, VllmConfig

# vLLM only shows records of loggers under "vllm."; the rest are dropped.
log = logging.getLogger("vllm.wcd")

LOAD_FORMAT = "wcd"
META_TENSOR = "__wcd_meta__"  # a uint8 tensor in published entries: JSON describing the snapshot
SNAPSHOT_FORMAT = "1"
_OPTIONS = {"socket", "socket_path", "mode", "fallback", "publish", "entry", "retention", "timeout_s"}
_GENERIC_DIRS = {"model", "models", "weights", "checkpoint", "checkpoints", "hf", "main"}

# What the last load in this process did: {"path": "attach"|"raw"|"disk", "entry", "published",
# "reason", "load_s", "tensors", "bytes", "key", ...}. Tests and users can read it in-process.
last_load: dict[str, Any] = {}


class WcdLoadError(RuntimeError):
    """The wcd loader cannot load this model as configured (and falling back is off or pointless)."""


class UnsupportedPreprocessed(WcdLoadError):
    """A quant method cannot take already-processed weights: a permanent misconfiguration, never a fallback."""


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


# -- registration ---------------------------------------------------------------------------------


def register() -> None:
    """Entry point for `vllm.general_plugins`: make `load_format="wcd"` known. Idempotent."""
    from vllm.model_executor import model_loader

    cls = _loader_class()
    registered = getattr(model_loader, "_LOAD_FORMAT_TO_MODEL_LOADER", {})
    if registered.get(LOAD_FORMAT) is not cls:  # vLLM may call plugins more than once per process
        model_loader.register_model_loader(LOAD_FORMAT)(cls)


_LOADER_CLASS: type | None = None


def _loader_class() -> type:
    """The loader class, defined on first use so that importing this module needs no vLLM."""
    global _LOADER_CLASS
    if _LOADER_CLASS is None:
        _LOADER_CLASS = _define_loader()
    return _LOADER_CLASS


# -- the cache key --------------------------------------------------------------------------------


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


def _short_hash(obj: Any) -> str:
    data = json.dumps(obj, sort_keys=True, default=str).encode()
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def _device_id(device: torch.device) -> str:
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        try:
            from vllm.platforms import current_platform

            return str(current_platform.get_device_uuid(index))
        except Exception:  # noqa: BLE001 - NVML unavailable: torch knows the UUID too
            return f"GPU-{torch.cuda.get_device_properties(index).uuid}"
    return str(device)


def processed_key(vllm_config: VllmConfig, model_config: ModelConfig, device: torch.device,
                  ckpt: Path, fingerprint: str) -> WeightCacheKey:
    """The key of this engine's post-processed weights. Compute it before loading: processing may
    mutate hf_config.quantization_config."""
    import vllm
    from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    hf_config = model_config.hf_config
    quant_cfg = getattr(hf_config, "quantization_config", None)
    if hasattr(quant_cfg, "to_dict"):
        quant_cfg = quant_cfg.to_dict()
    try:
        hf_json = hf_config.to_json_string(use_diff=False)
    except Exception:  # noqa: BLE001
        hf_json = repr(hf_config)
    pp = get_pp_group()
    shard = {"tp_rank": get_tensor_model_parallel_rank(), "tp_size": get_tensor_model_parallel_world_size(),
             "pp_rank": pp.rank_in_group, "pp_size": pp.world_size}
    parallel = vllm_config.parallel_config
    if getattr(parallel, "enable_expert_parallel", False):  # experts are split across DP ranks too
        from vllm.distributed import get_dp_group

        shard.update(dp_rank=get_dp_group().rank_in_group, dp_size=get_dp_group().world_size)
    quant = model_config.quantization or "none"
    extra = {
        "engine": f"vllm {vllm.__version__}",
        "torch": torch.__version__,
        "arch": ",".join(getattr(hf_config, "architectures", None) or []),
        "hf_config": _short_hash([hf_json, getattr(model_config, "hf_overrides", None)]),
        "quantization": quant,
        "quant_config": _short_hash([quant_cfg, getattr(model_config, "quantization_config", None)]),
        "kv_cache_dtype": str(getattr(vllm_config.cache_config, "cache_dtype", "auto")),
        "runner": f"{getattr(model_config, 'runner_type', '')}/{getattr(model_config, 'convert_type', '')}",
        "lora": str(vllm_config.lora_config is not None),
        "revision": str(model_config.revision or ""),
        "snapshot": SNAPSHOT_FORMAT,
    }
    return WeightCacheKey(
        model=model_name(model_config, ckpt), path=str(ckpt), fingerprint=fingerprint,
        dtype=str(model_config.dtype).removeprefix("torch."),
        transform=f"vllm-{vllm.__version__}/{quant}", shard=shard, device=_device_id(device), extra=extra)


# -- snapshots: the processed model as named tensors + a small JSON description ---------------------


def snapshot(model: torch.nn.Module, before: dict[str, torch.Tensor] | None = None
             ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every parameter and buffer of a processed model, tied names as aliases, plus the meta JSON.

    `before` (name -> tensor before post-processing) restores weights that post-processing moved
    into an opaque kernel object and replaced by an empty placeholder (vLLM's CPU GEMM dispatch
    packs linear weights for oneDNN and drops `layer.weight`): the attach path re-runs that step,
    which needs the real weight.
    """
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, Any] = {"format": SNAPSHOT_FORMAT, "kinds": {}, "aliases": {}, "attrs": {},
                            "restored": [], "permuted": {}, "model_attrs": _model_attrs(model)}
    by_id: dict[int, str] = {}

    def add(name: str, t: torch.Tensor, kind: str) -> None:
        canonical = by_id.get(id(t))
        if canonical is not None:
            meta["aliases"][name] = canonical
            return
        by_id[id(t)] = name
        data = t.detach()
        if before is not None and data.numel() == 0 and name in before and before[name].numel() > 0:
            data = before[name].detach()
            meta["restored"].append(name)
        if data.device.type == "meta":
            raise WcdLoadError(f"cannot publish {name}: it is still on the meta device")
        if not data.is_contiguous():
            perm = sorted(range(data.dim()), key=lambda d: (-data.stride(d), -data.size(d)))
            if data.permute(perm).is_contiguous():
                meta["permuted"][name] = perm
                data = data.permute(perm)
            else:
                data = data.contiguous()
        tensors[name] = data
        meta["kinds"][name] = kind
        attrs = {k: v for k, v in getattr(t, "__dict__", {}).items()
                 if isinstance(v, (bool, int, float, str)) and not k.startswith("__")}
        if attrs:
            meta["attrs"][name] = attrs

    for name, p in model.named_parameters(remove_duplicate=False):
        add(name, p, "param")
    for name, b in model.named_buffers(remove_duplicate=False):
        if name not in meta["kinds"] and name not in meta["aliases"]:
            add(name, b, "buffer")
    return tensors, meta


def _model_attrs(model: torch.nn.Module) -> dict[str, bool]:
    try:  # Python-side flags that load_weights sets on EAGLE-style models
        from vllm.model_executor.model_loader.weight_cache.utils import export_model_attrs

        return dict(export_model_attrs(model))
    except Exception:  # noqa: BLE001
        return {}


def encode_meta(meta: dict[str, Any]) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(meta, sort_keys=True).encode()), dtype=torch.uint8)


def decode_meta(t: torch.Tensor) -> dict[str, Any]:
    return json.loads(bytes(t.cpu().numpy().tobytes()).decode())  # type: ignore[no-any-return]


def bind(model: torch.nn.Module, tensors: dict[str, torch.Tensor], meta: dict[str, Any], *, copy: bool) -> int:
    """Register every snapshot tensor into `model` (built on the meta device) by name.

    Parameters keep their vLLM class and attributes where the meta model has them; tied names
    share one object. Returns the number of bytes bound.
    """
    modules = dict(model.named_modules(remove_duplicate=False))
    bound: dict[str, torch.Tensor] = {}
    nbytes = 0

    def register(name: str, value: torch.Tensor, kind: str) -> torch.Tensor:
        module_name, _, leaf = name.rpartition(".")
        module = modules.get(module_name)
        if module is None:
            raise WcdLoadError(f"the cached weights do not fit this model: no module {module_name!r} for {name!r}")
        old = module._parameters.get(leaf) if leaf in module._parameters else module._buffers.get(leaf)
        module._parameters.pop(leaf, None)
        module._buffers.pop(leaf, None)
        module.__dict__.pop(leaf, None)
        if kind == "param":
            if isinstance(value, torch.nn.Parameter):
                obj: torch.Tensor = value
            else:
                obj = torch.nn.Parameter(value, requires_grad=False)
                if isinstance(old, torch.nn.Parameter):
                    if type(old) is not torch.nn.Parameter:
                        try:
                            obj.__class__ = type(old)  # keep vLLM's parameter class (weight_loader, dims)
                        except TypeError:
                            pass
                    obj.__dict__.update(old.__dict__)
                for k, v in meta.get("attrs", {}).get(name, {}).items():
                    try:
                        setattr(obj, k, v)
                    except (AttributeError, TypeError):
                        obj.__dict__[k] = v
            module._parameters[leaf] = obj  # type: ignore[assignment]
        else:
            obj = value
            module._buffers[leaf] = obj
        return obj

    for name, kind in meta["kinds"].items():
        t = tensors[name]
        perm = meta.get("permuted", {}).get(name)
        if perm is not None:
            inverse = [0] * len(perm)
            for i, d in enumerate(perm):
                inverse[d] = i
            t = t.permute(inverse)
        if copy:
            t = t.clone(memory_format=torch.preserve_format)  # keeps a permuted dense layout
        nbytes += t.numel() * t.element_size()
        bound[name] = register(name, t, kind)
    for alias, canonical in meta.get("aliases", {}).items():
        obj = bound.get(canonical)
        if obj is None:
            raise WcdLoadError(f"cached alias {alias!r} points at missing tensor {canonical!r}")
        register(alias, obj, "param" if isinstance(obj, torch.nn.Parameter) else "buffer")
    for name, value in meta.get("model_attrs", {}).items():
        setattr(model, name, value)
    return nbytes


def meta_leftovers(model: torch.nn.Module) -> list[str]:
    left = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    left += [n for n, b in model.named_buffers() if b.device.type == "meta"]
    return left


def check_preprocessed_support(model: torch.nn.Module) -> None:
    """Refuse clearly unless every quant method can take already-processed weights."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    for name, module in model.named_modules():
        qm = getattr(module, "quant_method", None)
        if isinstance(qm, QuantizeMethodBase) and not qm.supports_pre_processed_weights:
            raise UnsupportedPreprocessed(
                f"layer {name or '<root>'}: {type(qm).__name__} does not declare supports_pre_processed_weights, "
                "so vLLM cannot take its processed weights from the wcd cache. Evict the entry or load this "
                "model with publish=false (raw or disk path)")


def _preprocessed_supported(model: torch.nn.Module) -> str | None:
    try:
        check_preprocessed_support(model)
        return None
    except WcdLoadError as e:
        return str(e)


# -- the loader -----------------------------------------------------------------------------------


class _Session:
    """A daemon connection plus the lease the engine's weights live in (attach path)."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.lease: Lease | None = None

    def close(self) -> None:
        self.client.close()


def _define_loader() -> type:
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
    from vllm.model_executor.utils import weights_already_processed
    from vllm.utils.torch_utils import set_default_torch_dtype

    def empty_cache() -> None:
        gc.collect()
        if hasattr(torch, "accelerator") and hasattr(torch.accelerator, "empty_cache"):
            torch.accelerator.empty_cache()

    class WcdModelLoader(BaseModelLoader):
        """load_format="wcd": attach processed weights, else copy raw resident ones, else disk; then publish."""

        def __init__(self, load_config: LoadConfig) -> None:
            super().__init__(load_config)
            self.options = Options.parse(load_config.model_loader_extra_config)

        # -- vLLM API ----------------------------------------------------------------------

        def download_model(self, model_config: ModelConfig) -> None:
            self._disk_loader().download_model(model_config)

        def get_external_weight_memory(self, vllm_config: VllmConfig) -> int:
            """Bytes of the processed entry this engine will attach zero-copy (0 if it will not)."""
            if self.options.mode != "zero_copy" or not self.options.socket:
                return 0
            try:
                model_config = vllm_config.model_config
                ckpt = checkpoint_dir(model_config)
                if ckpt is None:
                    return 0
                key = processed_key(vllm_config, model_config, self._target_device(vllm_config), ckpt,
                                    fingerprint_checkpoint(ckpt))
                with Client(self.options.socket, name=f"vllm-wcd pid {os.getpid()} (probe)", heartbeats=False) as c:
                    for e in c.list():
                        if e.get("state") == "ready" and WeightCacheKey.model_validate(e["key"]) == key:
                            return int(e["bytes"])
            except Exception as e:  # noqa: BLE001 - a probe: no answer means nothing external
                log.debug("wcd: external weight memory probe failed: %s", e)
            return 0

        def load_weights(self, model: torch.nn.Module, model_config: ModelConfig) -> None:
            """In-place (re)load of raw weights: from a resident raw entry if any, else from disk."""
            if getattr(model, "_wcd_session", None) is not None and any(
                    p.is_cuda for p in model.parameters()):
                raise WcdLoadError("this model's weights are read-only views of the wcd daemon's GPU arena "
                                   "(mode=zero_copy): load it with model_loader_extra_config mode=copy to "
                                   "update weights in place")
            ckpt = checkpoint_dir(model_config)
            session = self._connect(required=False)
            try:
                lease = self._find_raw(session, fingerprint_checkpoint(ckpt)) if session and ckpt else None
                if lease is not None:
                    try:
                        self._feed_raw(model, model_config, lease)
                    finally:
                        lease.release()
                    return
            finally:
                if session is not None:
                    session.close()
            self._disk_loader().load_weights(model, model_config)

        def load_model(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = "") -> torch.nn.Module:
            started = time.perf_counter()
            opts = self.options
            device = self._target_device(vllm_config)
            last_load.clear()
            last_load.update(path=None, mode=opts.mode, socket=opts.socket, pid=os.getpid())
            ckpt = checkpoint_dir(model_config)
            key = None
            if ckpt is not None:
                fingerprint = fingerprint_checkpoint(ckpt)
                key = processed_key(vllm_config, model_config, device, ckpt, fingerprint)
                last_load["key"] = key.model_dump()
            last_load["key_s"] = time.perf_counter() - started
            session = self._connect(required=not opts.fallback) if key is not None else None
            if key is None and not opts.fallback:
                raise WcdLoadError(f"wcd loader: {model_config.model} has no local safetensors checkpoint to "
                                   "fingerprint, and fallback=false")
            reasons: list[str] = []
            if key is None:
                reasons.append("no local safetensors checkpoint")
            elif session is None:
                reasons.append(f"no daemon ({last_load.get('daemon_error', 'no socket configured')})")
            keep_session = False
            try:
                if session is not None and key is not None:
                    t0 = time.perf_counter()
                    lease = self._find_processed(session, key, reasons)
                    last_load["lookup_s"] = time.perf_counter() - t0
                    if lease is not None:
                        try:
                            model = self._attach(vllm_config, model_config, prefix, device, session, lease,
                                                 started)
                            keep_session = opts.mode == "zero_copy"
                            return model
                        except UnsupportedPreprocessed:
                            raise
                        except Exception as e:
                            if not opts.fallback:
                                raise
                            log.exception("wcd: attaching entry %s failed; loading another way", lease.entry)
                            reasons.append(f"attaching {lease.entry} failed ({type(e).__name__}: {e})")
                            empty_cache()
                    raw = self._find_raw(session, key.fingerprint, reasons)
                    if raw is not None:
                        try:
                            return self._load_and_publish(vllm_config, model_config, prefix, device, session, key,
                                                          started, raw=raw)
                        except Exception as e:
                            if not opts.fallback:
                                raise
                            log.exception("wcd: loading from raw entry %s failed; loading from disk", raw.entry)
                            reasons.append(f"raw entry {raw.entry} failed ({type(e).__name__}: {e})")
                            empty_cache()
                if not opts.fallback:
                    raise WcdLoadError("wcd loader: the daemon holds neither processed nor raw weights for "
                                       f"{model_config.model} ({'; '.join(reasons)}), and fallback=false")
                last_load["reason"] = "; ".join(reasons)
                return self._load_and_publish(vllm_config, model_config, prefix, device, session, key, started)
            finally:
                if session is not None and not keep_session:
                    session.close()

        # -- paths ---------------------------------------------------------------------------

        def _attach(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str, device: torch.device,
                    session: _Session, lease: Lease, started: float) -> torch.nn.Module:
            opts = self.options
            try:
                t0 = time.perf_counter()
                tensors = lease.tensors
                if META_TENSOR not in tensors:
                    raise WcdLoadError(f"entry {lease.entry!r} was not published by the wcd vLLM loader "
                                       f"(no {META_TENSOR} tensor)")
                meta = decode_meta(tensors[META_TENSOR])
                with set_default_torch_dtype(model_config.dtype):
                    with torch.device("meta"):
                        model = initialize_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
                    last_load["create_s"] = time.perf_counter() - t0
                    check_preprocessed_support(model)
                    t0 = time.perf_counter()
                    nbytes = bind(model, tensors, meta, copy=opts.mode == "copy")
                    del tensors
                    last_load["weights_s"] = time.perf_counter() - t0
                    # The daemon's tensors went through process_weights_after_loading already; re-run it
                    # in pre-processed mode so quant methods rebuild only their Python-side state.
                    t0 = time.perf_counter()
                    with weights_already_processed():
                        process_weights_after_loading(model, model_config, device)
                    last_load["process_s"] = time.perf_counter() - t0
                left = meta_leftovers(model)
                if left:
                    raise WcdLoadError(f"entry {lease.entry!r} lacks {len(left)} tensors this model needs "
                                       f"({', '.join(left[:3])}{', ...' if len(left) > 3 else ''})")
            except BaseException:
                lease.release()
                raise
            if opts.mode == "copy":
                lease.release()
            else:
                # The engine's weights are views of the lease's mapping: keep the lease (and the client
                # whose thread heartbeats it) alive exactly as long as the model.
                session.lease = lease
                model._wcd_session = session  # type: ignore[assignment]
                weakref.finalize(model, session.close)
            seconds = time.perf_counter() - started
            last_load.update(path="attach", entry=lease.entry, tensors=len(meta["kinds"]), bytes=nbytes,
                             load_s=seconds, lease=lease.id, restored=len(meta.get("restored", [])))
            log.info("wcd: attached processed weights from entry %s (%d tensors, %.1f MiB, %s, lease %d) "
                     "in %.3f s; no disk read", lease.entry, len(meta["kinds"]), nbytes / 2**20, opts.mode,
                     lease.id, seconds)
            return model.eval()

        def _load_and_publish(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str,
                              device: torch.device, session: _Session | None, key: WeightCacheKey | None,
                              started: float, raw: Lease | None = None) -> torch.nn.Module:
            """vLLM's BaseModelLoader.load_model, with raw resident weights or disk as the source and
            the processed weights published at the end."""
            from vllm.model_executor.model_loader import base_loader

            publish = self.options.publish and session is not None and key is not None
            disk = self._disk_loader()
            with set_default_torch_dtype(model_config.dtype):
                t0 = time.perf_counter()
                with device:
                    model = self.create_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
                last_load["create_s"] = time.perf_counter() - t0
                t0 = time.perf_counter()
                if raw is not None:
                    try:
                        self._feed_raw(model, model_config, raw)
                    finally:
                        raw.release()
                else:
                    disk.load_weights(model, model_config)
                last_load["weights_s"] = time.perf_counter() - t0
                empty_cache()
                has_online = getattr(base_loader, "_has_online_quant", None)
                if has_online is not None and has_online(model):
                    from vllm.model_executor.model_loader.reload import finalize_layerwise_processing

                    finalize_layerwise_processing(model, model_config)
                before = None
                if publish:
                    before = {n: t for n, t in model.named_parameters(remove_duplicate=False)}
                    before.update((n, t) for n, t in model.named_buffers(remove_duplicate=False) if n not in before)
                t0 = time.perf_counter()
                process_weights_after_loading(model, model_config, device)
                last_load["process_s"] = time.perf_counter() - t0
                empty_cache()
            path = "raw" if raw is not None else "disk"
            load_s = time.perf_counter() - started
            last_load.update(path=path, load_s=load_s, entry=raw.entry if raw is not None else None)
            published = None
            if publish:
                assert session is not None and key is not None
                published = self._publish(session, model, key, before)
            before = None
            source = f"resident raw entry {raw.entry}" if raw is not None else f"disk ({model_config.model})"
            log.info("wcd: loaded weights from %s in %.3f s%s%s", source, load_s,
                     f" ({last_load['reason']})" if last_load.get("reason") else "",
                     f"; published processed weights as entry {published}" if published else "")
            return model.eval()

        def _publish(self, session: _Session, model: torch.nn.Module, key: WeightCacheKey,
                     before: dict[str, torch.Tensor] | None) -> str | None:
            refused = _preprocessed_supported(model)
            if refused:
                log.warning("wcd: not publishing: %s", refused)
                last_load["publish_error"] = refused
                return None
            t0 = time.perf_counter()
            try:
                tensors, meta = snapshot(model, before)
                tensors[META_TENSOR] = encode_meta(meta)
                name = session.client.publish(key, tensors, retention=self.options.retention)
            except WcdError as e:
                # Another engine may have published the same key meanwhile (busy), or it does not fit.
                log.warning("wcd: could not publish processed weights (%s: %s); the engine runs from its own copy",
                            e.code, e.message)
                last_load["publish_error"] = f"{e.code}: {e.message}"
                return None
            last_load.update(published=name, publish_s=time.perf_counter() - t0, tensors=len(meta["kinds"]))
            return name

        def _feed_raw(self, model: torch.nn.Module, model_config: ModelConfig, lease: Lease) -> None:
            if getattr(model, "secondary_weights", ()) or getattr(model, "allow_patterns_overrides", None):
                raise WcdLoadError("this model reads extra weight sources; the raw path only has the checkpoint")
            tensors = lease.tensors
            unused = getattr(model, "is_unused_checkpoint_weight", None)
            items = ((n, t) for n, t in tensors.items() if unused is None or not unused(n))
            t0 = time.perf_counter()
            loaded = model.load_weights(items)
            del tensors
            log.debug("wcd: fed %s to load_weights in %.3f s", lease.entry, time.perf_counter() - t0)
            if model_config.quantization is None and loaded is not None:
                self._disk_loader().track_weights_loading(model, loaded, quantized=False)

        # -- daemon lookups ------------------------------------------------------------------

        def _connect(self, required: bool) -> _Session | None:
            if not self.options.socket:
                last_load["daemon_error"] = "no socket: set model_loader_extra_config socket or WCD_SOCKET"
                if required:
                    raise WcdLoadError("wcd loader: no daemon socket given (model_loader_extra_config "
                                       "{'socket': PATH} or WCD_SOCKET), and fallback=false")
                return None
            try:
                return _Session(Client(self.options.socket, name=f"vllm-wcd pid {os.getpid()}"))
            except WcdError as e:
                last_load["daemon_error"] = e.message
                if required:
                    raise WcdLoadError(f"wcd loader: {e.message}, and fallback=false") from e
                log.warning("wcd: daemon unavailable (%s); loading from disk", e.message)
                return None

        def _find_processed(self, session: _Session, key: WeightCacheKey, reasons: list[str]) -> Lease | None:
            try:
                return session.client.acquire(key, timeout_s=self.options.timeout_s)
            except KeyMismatch as e:
                fields = e.details.get("fields", [])
                reasons.append(f"processed entry {e.details.get('entry')} differs in {', '.join(fields)}")
                log.info("wcd: not attaching %s: %s", e.details.get("entry"), e.message)
                last_load["mismatch"] = {"entry": e.details.get("entry"), "fields": fields}
            except NotFound:
                reasons.append("no processed entry")
            except WcdError as e:  # busy (still filling past timeout_s), connection lost, ...
                reasons.append(f"processed lookup failed ({e.code}: {e.message})")
                log.warning("wcd: looking up processed weights failed: %s", e.message)
            return None

        def _find_raw(self, session: _Session, fingerprint: str, reasons: list[str] | None = None) -> Lease | None:
            """A read lease on a raw entry holding this exact checkpoint (by fingerprint), or None."""
            client = session.client
            names: list[str]
            if self.options.entry:
                names = [self.options.entry]
            else:
                names = [e["name"] for e in client.list()
                         if e["key"].get("transform") == "raw" and e["key"].get("fingerprint") == fingerprint
                         and e.get("state") in ("ready", "loading")]
            for name in names:
                try:
                    lease = client.acquire(name, timeout_s=self.options.timeout_s)
                except WcdError as e:
                    if reasons is not None:
                        reasons.append(f"raw entry {name!r}: {e.message}" if not isinstance(e, NotFound)
                                       else f"no entry {name!r}")
                    continue
                if lease.key.transform == "raw" and lease.key.fingerprint == fingerprint:
                    return lease
                why = (f"entry {name!r} holds a different checkpoint (fingerprint {lease.key.fingerprint[:12]}, "
                       f"this model {fingerprint[:12]})" if lease.key.fingerprint != fingerprint
                       else f"entry {name!r} is not a raw checkpoint ({lease.key.transform})")
                log.warning("wcd: not using %s", why)
                if reasons is not None:
                    reasons.append(why)
                lease.release()
            if reasons is not None and not names:
                reasons.append("no raw entry")
            return None

        # -- helpers ---------------------------------------------------------------------------

        def _target_device(self, vllm_config: VllmConfig) -> torch.device:
            return torch.device(self.load_config.device or vllm_config.device_config.device)

        def _disk_loader(self) -> DefaultModelLoader:
            # DefaultModelLoader must see neither load_format="wcd" nor our extra config keys.
            return DefaultModelLoader(dataclasses.replace(self.load_config, load_format="auto",
                                                          model_loader_extra_config={}))

    return WcdModelLoader


__all__ = ["LOAD_FORMAT", "Options", "UnsupportedPreprocessed", "WcdLoadError", "last_load", "processed_key", "register", "snapshot", "bind"]
