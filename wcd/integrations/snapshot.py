"""Snapshots: an engine's processed model as named tensors plus a small JSON description.

What an engine loader plugin needs besides the engine's own API: `snapshot` a processed model,
`publish_snapshot` it, and on the next start `bind` the attached tensors back into a model built
on the meta device. Engine-agnostic (torch only); engine specifics (which layers, which post-load
step) stay in the engine's integration, e.g. `wcd/integrations/vllm.py`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch

from wcd.client import Client
from wcd.errors import WcdError
from wcd.key import WeightCacheKey

META_TENSOR = "__wcd_meta__"  # a uint8 tensor in published entries: JSON describing the snapshot
SNAPSHOT_FORMAT = "1"


class SnapshotMismatch(WcdError):
    """Snapshot tensors do not fit the model they are bound into (or are not a snapshot at all)."""

    code = "snapshot_mismatch"


def snapshot(model: torch.nn.Module, before: Mapping[str, torch.Tensor] | None = None,
             model_attrs: Mapping[str, Any] | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every parameter and buffer of a processed model, tied names as aliases, plus the meta JSON.

    `before` (name -> tensor before post-processing) restores weights that post-processing moved
    into an opaque kernel object and replaced by an empty placeholder (vLLM's CPU GEMM dispatch
    packs linear weights for oneDNN and drops `layer.weight`): the attach path re-runs that step,
    which needs the real weight. `model_attrs` are plain attributes `bind` sets on the model.
    """
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, Any] = {"format": SNAPSHOT_FORMAT, "kinds": {}, "aliases": {}, "attrs": {},
                            "restored": [], "permuted": {}, "model_attrs": dict(model_attrs or {})}
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
            raise SnapshotMismatch(f"cannot publish {name}: it is still on the meta device")
        if not data.is_contiguous():
            perm = sorted(range(data.dim()), key=lambda d: (-data.stride()[d], -data.shape[d]))
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


def state_before_processing(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Name -> tensor of every parameter and buffer: `snapshot`'s `before`, taken before post-processing."""
    state: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    state.update((n, t) for n, t in model.named_buffers(remove_duplicate=False) if n not in state)
    return state


def encode_meta(meta: Mapping[str, Any]) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(meta, sort_keys=True).encode()), dtype=torch.uint8)


def decode_meta(t: torch.Tensor) -> dict[str, Any]:
    return json.loads(bytes(t.cpu().numpy().tobytes()).decode())


def publish_snapshot(client: Client, key: WeightCacheKey, model: torch.nn.Module, *,
                     before: Mapping[str, torch.Tensor] | None = None, model_attrs: Mapping[str, Any] | None = None,
                     retention: str = "cached") -> tuple[str, int]:
    """Snapshot `model` and publish it under `key`; returns (entry name, tensor count)."""
    tensors, meta = snapshot(model, before, model_attrs)
    tensors[META_TENSOR] = encode_meta(meta)
    return client.publish(key, tensors, retention=retention), len(meta["kinds"])


def read_meta(entry: str, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The snapshot description of an attached entry's tensors; refuses entries that are not snapshots."""
    if META_TENSOR not in tensors:
        raise SnapshotMismatch(f"entry {entry!r} is not a published snapshot (no {META_TENSOR} tensor)")
    meta = decode_meta(tensors[META_TENSOR])
    if meta.get("format") != SNAPSHOT_FORMAT:
        raise SnapshotMismatch(f"entry {entry!r} has snapshot format {meta.get('format')!r}, "
                               f"this wcd reads {SNAPSHOT_FORMAT!r}")
    return meta


def bind(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any], *,
         copy: bool) -> int:
    """Register every snapshot tensor into `model` (built on the meta device) by name.

    Parameters keep their class and attributes where the meta model has them (vLLM's parameter
    classes carry weight loaders and shard dims); tied names share one object. Returns the number
    of bytes bound.
    """
    modules = dict(model.named_modules(remove_duplicate=False))
    bound: dict[str, torch.Tensor] = {}
    nbytes = 0
    attrs_of = meta.get("attrs", {})

    def register(name: str, value: torch.Tensor, kind: str) -> torch.Tensor:
        module_name, _, leaf = name.rpartition(".")
        module = modules.get(module_name)
        if module is None:
            raise SnapshotMismatch(f"the cached weights do not fit this model: no module {module_name!r} for {name!r}")
        old = module._parameters.get(leaf) if leaf in module._parameters else module._buffers.get(leaf)
        module._parameters.pop(leaf, None)
        module._buffers.pop(leaf, None)
        module.__dict__.pop(leaf, None)
        if kind != "param":
            module._buffers[leaf] = value
            return value
        obj = value if isinstance(value, torch.nn.Parameter) else _parameter_like(old, value, attrs_of.get(name, {}))
        module._parameters[leaf] = obj
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
            raise SnapshotMismatch(f"cached alias {alias!r} points at missing tensor {canonical!r}")
        register(alias, obj, "param" if isinstance(obj, torch.nn.Parameter) else "buffer")
    for name, value in meta.get("model_attrs", {}).items():
        setattr(model, name, value)
    return nbytes


def _parameter_like(old: torch.Tensor | None, value: torch.Tensor, attrs: Mapping[str, Any]) -> torch.nn.Parameter:
    """A parameter over `value` with the class and attributes of the meta model's `old` one."""
    obj = torch.nn.Parameter(value, requires_grad=False)
    if isinstance(old, torch.nn.Parameter):
        if type(old) is not torch.nn.Parameter:
            try:
                obj.__class__ = type(old)
            except TypeError:
                pass
        obj.__dict__.update(old.__dict__)
    for k, v in attrs.items():
        try:
            setattr(obj, k, v)
        except (AttributeError, TypeError):
            obj.__dict__[k] = v
    return obj


def meta_leftovers(model: torch.nn.Module) -> list[str]:
    """Parameters and buffers still on the meta device (what `bind` did not cover)."""
    left = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    left += [n for n, b in model.named_buffers() if b.device.type == "meta"]
    return left


__all__ = ["META_TENSOR", "SNAPSHOT_FORMAT", "SnapshotMismatch", "bind", "decode_meta", "encode_meta",
           "meta_leftovers", "publish_snapshot", "read_meta", "snapshot", "state_before_processing"]
