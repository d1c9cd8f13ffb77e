"""Attach resident weights to a plain `torch.nn.Module`, zero-copy, by parameter/buffer name.

Each parameter becomes an `nn.Parameter` (requires_grad=False) over the arena view and each buffer
the view itself; nothing is copied. Strict by default: missing, unexpected, shape and dtype
mismatches are all reported in one error. Tied parameters stay tied.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from wcd.errors import WcdError


class AttachMismatch(WcdError):
    code = "attach_mismatch"


@dataclass
class AttachReport:
    bound: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # in the module, not in the entry
    unexpected: list[str] = field(default_factory=list)  # in the entry, not in the module
    mismatched: list[str] = field(default_factory=list)  # "name: expected ..., resident ..."

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)


def attach(module: torch.nn.Module, source: Any, *, strict: bool = True, prefix: str = "") -> AttachReport:
    """Bind `module`'s parameters and buffers to `source` (a `Lease` or a dict of tensors).

    `prefix` is prepended to module names when looking them up (e.g. "model.").
    """
    tensors: Mapping[str, torch.Tensor] = getattr(source, "tensors", source)
    report = AttachReport()
    slots: list[tuple[str, torch.nn.Module, str, torch.Tensor, bool]] = []
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for attr, param in mod._parameters.items():
            if param is not None:
                slots.append((_join(mod_name, attr), mod, attr, param, True))
        for attr, buf in mod._buffers.items():
            if buf is not None and attr not in mod._non_persistent_buffers_set:
                slots.append((_join(mod_name, attr), mod, attr, buf, False))
    # Tied parameters: one resident tensor serves every name that shares the module's object.
    by_object: dict[int, str] = {id(t): prefix + n for n, _, _, t, _ in slots if prefix + n in tensors}
    seen: set[str] = set()
    plan = []
    for name, mod, attr, current, is_param in slots:
        key = prefix + name if prefix + name in tensors else by_object.get(id(current))
        if key is None:
            report.missing.append(name)
            continue
        seen.add(key)
        view = tensors[key]
        if view.shape != current.shape or view.dtype != current.dtype:
            report.mismatched.append(f"{name}: module has {current.dtype}{list(current.shape)}, "
                                     f"resident is {view.dtype}{list(view.shape)}")
            continue
        plan.append((name, mod, attr, view, is_param))
    report.unexpected = sorted(k for k in tensors if k not in seen and k.startswith(prefix))
    if strict and not report.ok:
        raise AttachMismatch(_describe(report), {"missing": report.missing, "unexpected": report.unexpected,
                                                 "mismatched": report.mismatched})
    params: dict[int, torch.nn.Parameter] = {}
    for name, mod, attr, view, is_param in plan:
        if is_param:
            p = params.get(id(view))
            if p is None:
                p = params[id(view)] = torch.nn.Parameter(view, requires_grad=False)
            mod._parameters[attr] = p
        else:
            mod._buffers[attr] = view
        report.bound.append(name)
    return report


def _join(module: str, attr: str) -> str:
    return f"{module}.{attr}" if module else attr


def _describe(r: AttachReport) -> str:
    parts = []
    for label, names in (("missing", r.missing), ("unexpected", r.unexpected), ("mismatched", r.mismatched)):
        if names:
            parts.append(f"{len(names)} {label} ({'; '.join(names[:3])}{', ...' if len(names) > 3 else ''})")
    return "weights do not match the module: " + ", ".join(parts)


def publish_module(client: Any, key: Any, module: torch.nn.Module, *, retention: str = "cached") -> Any:
    """Publish `module`'s weights under `key`, then run the module on the shared copy.

    Reserve -> copy every parameter and persistent buffer in (device to device on a GPU) ->
    commit -> attach a read lease and rebind the module to its views, so the module's own copies
    are freed once nothing else refers to them. Returns the read lease: keep it as long as the
    module runs. Peak memory during the copy is the module plus one arena: an arena is one
    allocation (one fd), so it cannot grow as the module's tensors are released.
    """
    state: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in module.state_dict(keep_vars=True).items():
        if id(t) not in seen:  # tied parameters are stored once; attach re-ties them
            seen.add(id(t))
            state[name] = t.detach()
    name = client.publish(key, state, retention=retention)
    del state
    lease = client.acquire(name)
    attach(module, lease)
    return lease
