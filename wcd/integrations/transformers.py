"""Hugging Face transformers: build a model from its folder's config, weights attached from wcd.

    from transformers import AutoModelForCausalLM
    from wcd.integrations.transformers import from_pretrained

    model = from_pretrained(AutoModelForCausalLM, "/models/smollm2", socket="/run/wcd/llm.sock")

Like `AutoModel*.from_pretrained(folder)`, except that the weights are not read from disk: the
model is built from `config.json` with its parameters on the meta device (buffers computed at init,
such as rotary frequencies, stay real), then every parameter and persistent buffer is bound to the
daemon's resident copy of the folder's checkpoint, zero-copy, by name. Tied weights (e.g. an
`lm_head` tied to the input embeddings, absent from the checkpoint) stay tied to the one resident
tensor. The resident entry is found by checkpoint fingerprint (or named with `entry=`), so a
different checkpoint is never attached, and it must come from a trusted publisher
(`wcd.integrations.trust`: the daemon's own load, this uid, the daemon's `trusted_publishers` or
`trusted_publishers=`); the socket must be served by a trusted uid (`trust.server_uids()`).

If the daemon does not hold the folder, `load=True` asks it to load it (needs the daemon's own uid
or root), and otherwise `fallback=True` (default) loads from disk with `from_pretrained`. The
lease is kept alive (heartbeats) as long as the model object lives. `model._wcd` says what
happened: {"path": "attach"|"disk", "entry", "publisher", "tensors", "bytes", "converted", "seconds",
"reason"}.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from wcd.client import Client, Lease
from wcd.errors import BadReply, DaemonUnavailable, NotFound, PermissionDenied
from wcd.integrations import trust
from wcd.integrations.torch import AttachMismatch, attach
from wcd.key import fingerprint_checkpoint

log = logging.getLogger("wcd.transformers")


def from_pretrained(model_class: Any, path: str | Path, *, socket: str | None = None, client: Client | None = None,
                    entry: str | None = None, dtype: torch.dtype | str | None = None, load: bool = False,
                    fallback: bool = True, strict: bool = True, timeout_s: float = 600.0,
                    trusted_publishers: Iterable[int] = (), **config_kwargs: Any) -> Any:
    """Load `model_class` (an `AutoModel*` or a concrete model class) from `path` through wcd.

    `dtype=None` keeps the resident dtype (zero-copy); another dtype converts (a copy, logged).
    `socket` defaults to $WCD_SOCKET; pass `client` to share a connection. `trusted_publishers`
    adds uids whose entries may be attached. `config_kwargs` go to `AutoConfig.from_pretrained`.
    """
    started = time.perf_counter()
    folder = Path(path).resolve()
    torch_dtype: torch.dtype | None = (None if dtype is None or dtype == "auto" else
                                       getattr(torch, dtype) if isinstance(dtype, str) else dtype)
    fingerprint = fingerprint_checkpoint(folder)
    own_client = client is None
    reason = ""
    lease: Lease | None = None
    publisher = ""
    try:
        if client is None:
            try:
                client = Client(socket, name="wcd-transformers", server_uid=trust.server_uids())
            except PermissionDenied as e:  # the socket's, or who serves it: the disk is safe either way
                raise DaemonUnavailable(e.message) from None
        found = _find_entry(client, folder, fingerprint, entry, load, timeout_s, trusted_publishers)
        if found is None:
            reason = f"the daemon holds no entry for {folder} (fingerprint {fingerprint[:12]}) from a trusted publisher"
        else:
            lease, publisher = found
    except DaemonUnavailable as e:
        reason = e.message
        client = None
    except BaseException:
        if own_client and client is not None:
            client.close()
        raise
    if lease is None:
        if own_client and client is not None:
            client.close()
        if not fallback:
            raise NotFound(f"wcd: cannot attach {folder}: {reason}, and fallback=False")
        log.warning("wcd: loading %s from disk: %s", folder, reason)
        kwargs = {"dtype": torch_dtype} if torch_dtype is not None else {}
        model = model_class.from_pretrained(str(folder), **kwargs, **config_kwargs)
        model._wcd = {"path": "disk", "reason": reason, "seconds": time.perf_counter() - started}
        return model
    assert client is not None
    try:
        model, info = _build_and_attach(model_class, folder, lease, torch_dtype, strict, config_kwargs)
    except BaseException:
        lease.release()
        if own_client:
            client.close()
        raise
    # The parameters are views of the lease's mapping: keep it (and the heartbeating client) alive
    # exactly as long as the model.
    model._wcd_lease = lease
    if own_client:
        model._wcd_client = client
        weakref.finalize(model, client.close)
    info.update(path="attach", entry=lease.entry, lease=lease.id, publisher=publisher,
                seconds=time.perf_counter() - started)
    model._wcd = info
    log.info("wcd: attached %s from entry %s published by %s (%d tensors, %.1f MiB%s) in %.3f s", folder.name,
             lease.entry, publisher, info["tensors"], info["bytes"] / 2**20,
             f", {info['converted']} converted" if info["converted"] else "", info["seconds"])
    return model


def _find_entry(client: Client, folder: Path, fingerprint: str, entry: str | None, load: bool,
                timeout_s: float, trusted: Iterable[int] = ()) -> tuple[Lease, str] | None:
    """A read lease on a raw entry holding exactly this checkpoint from a trusted publisher, and
    who that is; or None."""
    names = [entry] if entry else [
        e["name"] for e in client.list()
        if e["key"].get("transform") == "raw" and e["key"].get("fingerprint") == fingerprint
        and e.get("state") in ("ready", "loading")]
    if load:
        names.append(entry or _entry_name(folder))
    for i, name in enumerate(names):
        if load and i == len(names) - 1:
            client.load(name, folder, wait=True)
        try:
            lease = client.acquire(name, timeout_s=timeout_s)
        except NotFound:
            continue
        except BadReply as e:  # an entry no client can map (another uid crafted it): the disk still serves
            log.warning("wcd: not using entry %s: %s", name, e.message)
            continue
        publisher = trust.accepted_publisher(client, lease, trusted)
        if publisher is None:
            log.warning("wcd: entry %s was %s, which this process does not trust: not using it "
                        "(trusted: the daemon, this uid, trusted_publishers)", name, trust.whose(lease))
        elif lease.key.fingerprint == fingerprint and lease.key.transform == "raw":
            return lease, publisher
        else:
            log.warning("wcd: entry %s holds a different checkpoint than %s (fingerprint %s, folder %s): not using "
                        "it", name, folder, lease.key.fingerprint[:12], fingerprint[:12])
        lease.release()
    return None


def _entry_name(folder: Path) -> str:
    import re

    name = folder.name if folder.name not in ("model", "models", "weights") else f"{folder.parent.name}-{folder.name}"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.")[:120] or "model"


@contextmanager
def params_on_meta() -> Iterator[None]:
    """Parameters registered inside go to the meta device; buffers stay real (computed at init).

    The same trick as accelerate's `init_empty_weights(include_buffers=False)`: no weight memory
    is allocated and weight initialisation runs on meta tensors (free).
    """
    original = torch.nn.Module.register_parameter

    def register_parameter(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            p = module._parameters[name]
            assert p is not None
            kwargs = dict(p.__dict__)
            kwargs["requires_grad"] = p.requires_grad
            module._parameters[name] = type(p)(p.to("meta"), **kwargs)

    torch.nn.Module.register_parameter = register_parameter  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original  # type: ignore[method-assign]


def _build_and_attach(model_class: Any, folder: Path, lease: Lease, dtype: torch.dtype | None, strict: bool,
                      config_kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(folder), **config_kwargs)
    tensors = lease.tensors
    floating = [t.dtype for t in tensors.values() if t.is_floating_point()]
    resident_dtype = max(set(floating), key=floating.count) if floating else torch.float32
    target = dtype or resident_dtype
    with params_on_meta():
        try:
            model = model_class.from_config(config, dtype=target)
        except TypeError:  # transformers < 4.56 calls it torch_dtype
            model = model_class.from_config(config, torch_dtype=target)
    wanted = _model_names(model)
    views = _rename(tensors, wanted, getattr(model, "base_model_prefix", ""))
    converted = 0
    if dtype is not None:
        for name, t in list(views.items()):
            if t.is_floating_point() and t.dtype != dtype:
                views[name] = t.to(dtype)
                converted += 1
    report = attach(model, views, strict=False)
    # Missing: parameters the checkpoint lacks (fatal unless not strict), persistent buffers the
    # checkpoint lacks (keep their init values, like from_pretrained), tied names (attach binds
    # them through the shared object already).
    missing = [n for n in report.missing if _is_meta(model, n)]
    if missing or report.mismatched:
        msg = []
        if missing:
            msg.append(f"{len(missing)} missing ({'; '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})")
        if report.mismatched:
            msg.append(f"{len(report.mismatched)} mismatched ({'; '.join(report.mismatched[:3])})")
        if strict or report.mismatched:
            raise AttachMismatch(f"entry {lease.entry} does not fit {type(model).__name__}: " + ", ".join(msg),
                                 {"missing": missing, "mismatched": report.mismatched})
        for name in missing:  # not strict: materialise like from_pretrained's "newly initialized"
            _materialize(model, name)
        log.warning("wcd: %s: newly initialised (not in the checkpoint): %s", type(model).__name__, ", ".join(missing))
    if report.unexpected:
        log.info("wcd: %s: checkpoint tensors not used by the model: %s", type(model).__name__,
                 ", ".join(report.unexpected[:10]))
    if getattr(model, "generation_config", None) is not None and (folder / "generation_config.json").exists():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(str(folder))
    model.eval()
    nbytes = sum(views[n].numel() * views[n].element_size() for n in set(views) - set(report.unexpected))
    return model, {"tensors": len(report.bound), "bytes": nbytes, "converted": converted,
                   "unexpected": report.unexpected}


def _model_names(model: torch.nn.Module) -> set[str]:
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for attr in mod._buffers:
            if attr not in mod._non_persistent_buffers_set:
                names.add(f"{mod_name}.{attr}" if mod_name else attr)
    return names


def _rename(tensors: dict[str, torch.Tensor], wanted: set[str], prefix: str) -> dict[str, torch.Tensor]:
    """Checkpoint names -> module names, adding or stripping the base model prefix as from_pretrained does."""
    if not prefix:
        return dict(tensors)
    dot = prefix + "."
    have_prefix = sum(n.startswith(dot) for n in tensors)
    want_prefix = sum(n.startswith(dot) for n in wanted)
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name in wanted:
            out[name] = t
        elif want_prefix > have_prefix and dot + name in wanted:
            out[dot + name] = t
        elif have_prefix > want_prefix and name.startswith(dot) and name[len(dot):] in wanted:
            out[name[len(dot):]] = t
        else:
            out[name] = t
    return out


def _is_meta(model: torch.nn.Module, name: str) -> bool:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    t = module._parameters.get(leaf) if leaf in module._parameters else module._buffers.get(leaf)
    return t is not None and t.device.type == "meta"


def _materialize(model: torch.nn.Module, name: str) -> None:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    if leaf in module._parameters:
        p = module._parameters[leaf]
        assert p is not None
        module._parameters[leaf] = torch.nn.Parameter(torch.zeros(p.shape, dtype=p.dtype), requires_grad=False)
    else:
        b = module._buffers[leaf]
        assert b is not None
        module._buffers[leaf] = torch.zeros(b.shape, dtype=b.dtype)


__all__ = ["from_pretrained", "params_on_meta"]
