"""The `load_format="wcd"` model loader: attach processed weights, else feed raw resident ones, else disk.

Imported by `wcd.integrations.vllm.register()` (vLLM's own `BaseModelLoader` is the only vLLM name
this module imports at import time); every other vLLM name comes from `vllm_api()` when an engine
actually uses the format. The paths are described in `wcd/integrations/vllm.py`.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import time
import weakref
from typing import TYPE_CHECKING, Any

import torch
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from wcd.client import Client, Lease
from wcd.errors import KeyMismatch, NotFound, WcdError
from wcd.integrations import trust
from wcd.integrations.snapshot import bind, meta_leftovers, publish_snapshot, read_meta, state_before_processing
from wcd.integrations.vllm_shared import (
    IncompatibleVllm,
    Options,
    UnsupportedPreprocessed,
    WcdLoadError,
    checkpoint_dir,
    last_load,
    log,
    processed_key,
    shard,
    vllm_api,
    vllm_version,
)
from wcd.key import WeightCacheKey, fingerprint_checkpoint

if TYPE_CHECKING:
    from vllm.config import ModelConfig, VllmConfig
    from vllm.config.load import LoadConfig


@dataclasses.dataclass(frozen=True)
class _Target:
    """What one `load_model` call builds: vLLM's configs, the module prefix and the target device."""

    vllm_config: VllmConfig
    model_config: ModelConfig
    prefix: str
    device: torch.device


class WcdModelLoader(BaseModelLoader):
    """load_format="wcd": attach processed weights, else copy raw resident ones, else disk; then publish."""

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        self.options = Options.parse(load_config.model_loader_extra_config)
        self.vllm = vllm_api()  # IncompatibleVllm (one line) before anything is loaded

    # -- vLLM's loader API ------------------------------------------------------------------------

    def download_model(self, model_config: ModelConfig) -> None:
        self._disk_loader().download_model(model_config)

    def get_external_weight_memory(self, vllm_config: VllmConfig) -> int:
        """Bytes of the processed entry this engine will attach zero-copy (0 if it will not)."""
        if self.options.mode != "zero_copy" or not self.options.socket:
            return 0
        try:
            key = self._key(vllm_config, vllm_config.model_config, self._device(vllm_config))
            if key is None:
                return 0
            with Client(self.options.socket, name=f"vllm-wcd pid {os.getpid()} (probe)", heartbeats=False,
                        server_uid=trust.server_uids()) as c:
                for e in c.list():
                    if e.get("state") == "ready" and WeightCacheKey.model_validate(e["key"]) == key:
                        return int(e["bytes"])
        except Exception as e:  # noqa: BLE001 - a probe: no answer means nothing external
            log.debug("wcd: external weight memory probe failed: %s", e)
        return 0

    def load_weights(self, model: torch.nn.Module, model_config: ModelConfig) -> None:
        """In-place (re)load of raw weights: from a resident raw entry if any, else from disk."""
        if getattr(model, "_wcd_lease", None) is not None and any(p.is_cuda for p in model.parameters()):
            raise WcdLoadError("this model's weights are read-only views of the wcd daemon's GPU arena "
                               "(mode=zero_copy): load it with model_loader_extra_config mode=copy to "
                               "update weights in place")
        ckpt = checkpoint_dir(model_config)
        client = self._connect(required=False) if ckpt is not None else None
        if client is not None and ckpt is not None:
            with client:
                lease = self._find_raw(client, fingerprint_checkpoint(ckpt), [])
                if lease is not None:
                    with lease:
                        self._feed_raw(model, model_config, lease)
                    return
        self._disk_loader().load_weights(model, model_config)

    def load_model(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = "") -> torch.nn.Module:
        started = time.perf_counter()
        opts = self.options
        target = _Target(vllm_config, model_config, prefix, self._device(vllm_config))
        last_load.clear()
        last_load.update(path=None, mode=opts.mode, socket=opts.socket, pid=os.getpid())
        key = self._key(vllm_config, model_config, target.device)
        last_load["key_s"] = time.perf_counter() - started
        if key is None:
            if not opts.fallback:
                raise WcdLoadError(f"wcd loader: {model_config.model} has no local safetensors checkpoint to "
                                   "fingerprint, and fallback=false")
            return self._load(target, started, None, None, ["no local safetensors checkpoint"])
        last_load["key"] = key.model_dump()
        client = self._connect(required=not opts.fallback)
        if client is None:
            return self._load(target, started, None, None, [f"no daemon ({last_load['daemon_error']})"])
        keep_client = False
        try:
            reasons: list[str] = []
            model = self._try_attach(target, started, client, key, reasons)
            if model is not None:
                keep_client = opts.mode == "zero_copy"  # the lease (and its heartbeats) live with the model
                return model
            raw = self._find_raw(client, key.fingerprint, reasons)
            if raw is not None:
                try:
                    return self._load(target, started, client, key, reasons, raw=raw)
                except Exception as e:
                    if not opts.fallback:
                        raise
                    log.exception("wcd: loading from raw entry %s failed; loading from disk", raw.entry)
                    reasons.append(f"raw entry {raw.entry} failed ({type(e).__name__}: {e})")
                    _empty_cache()
            if not opts.fallback:
                raise WcdLoadError("wcd loader: the daemon holds neither processed nor raw weights for "
                                   f"{model_config.model} ({'; '.join(reasons)}), and fallback=false")
            return self._load(target, started, client, key, reasons)
        finally:
            if not keep_client:
                client.close()

    # -- the attach path --------------------------------------------------------------------------

    def _try_attach(self, target: _Target, started: float, client: Client, key: WeightCacheKey,
                    reasons: list[str]) -> torch.nn.Module | None:
        """The model on the processed entry under `key`, or None (reason appended) to load another way."""
        t0 = time.perf_counter()
        lease = self._find_processed(client, key, reasons)
        last_load["lookup_s"] = time.perf_counter() - t0
        if lease is None:
            return None
        try:
            return self._attach(target, started, lease)
        except UnsupportedPreprocessed:
            raise
        except Exception as e:
            if not self.options.fallback:
                raise
            log.exception("wcd: attaching entry %s failed; loading another way", lease.entry)
            reasons.append(f"attaching {lease.entry} failed ({type(e).__name__}: {e})")
            _empty_cache()
            return None

    def _attach(self, target: _Target, started: float, lease: Lease) -> torch.nn.Module:
        api, copy = self.vllm, self.options.mode == "copy"
        try:
            t0 = time.perf_counter()
            tensors = lease.tensors
            meta = read_meta(lease.entry, tensors)
            with api.set_default_torch_dtype(target.model_config.dtype):
                with torch.device("meta"):
                    model = api.initialize_model(vllm_config=target.vllm_config, model_config=target.model_config,
                                                 prefix=target.prefix)
                last_load["create_s"] = time.perf_counter() - t0
                refused = self._preprocessed_refusal(model)
                if refused:
                    raise UnsupportedPreprocessed(refused)
                t0 = time.perf_counter()
                nbytes = bind(model, tensors, meta, copy=copy)
                del tensors
                last_load["weights_s"] = time.perf_counter() - t0
                # The daemon's tensors went through process_weights_after_loading already; re-run it in
                # pre-processed mode so quant methods rebuild only their Python-side state.
                t0 = time.perf_counter()
                with api.weights_already_processed():
                    api.process_weights_after_loading(model, target.model_config, target.device)
                last_load["process_s"] = time.perf_counter() - t0
            left = meta_leftovers(model)
            if left:
                raise WcdLoadError(f"entry {lease.entry!r} lacks {len(left)} tensors this model needs "
                                   f"({', '.join(left[:3])}{', ...' if len(left) > 3 else ''})")
        except BaseException:
            lease.release()
            raise
        if copy:
            lease.release()
        else:
            # The engine's weights are views of the lease's mapping: keep the lease (and the client
            # whose thread heartbeats it) alive exactly as long as the model.
            model._wcd_lease = lease
            weakref.finalize(model, lease.client.close)  # the client heartbeats the lease
        seconds = time.perf_counter() - started
        last_load.update(path="attach", entry=lease.entry, tensors=len(meta["kinds"]), bytes=nbytes, load_s=seconds,
                         lease=lease.id, restored=len(meta["restored"]))
        log.info("wcd: attached processed weights from entry %s (%d tensors, %.1f MiB, %s, lease %d) in %.3f s; "
                 "no disk read", lease.entry, len(meta["kinds"]), nbytes / 2**20, self.options.mode, lease.id,
                 seconds)
        return model.eval()

    def _preprocessed_refusal(self, model: torch.nn.Module) -> str | None:
        """Why this model's processed weights cannot be taken from the cache (a quant method that does
        not declare supports_pre_processed_weights), or None."""
        for name, module in model.named_modules():
            qm = getattr(module, "quant_method", None)
            if isinstance(qm, self.vllm.QuantizeMethodBase) and not qm.supports_pre_processed_weights:
                return (f"layer {name or '<root>'}: {type(qm).__name__} does not declare "
                        "supports_pre_processed_weights, so vLLM cannot take its processed weights from the wcd "
                        "cache. Evict the entry or load this model with publish=false (raw or disk path)")
        return None

    # -- the raw and disk paths -------------------------------------------------------------------

    def _load(self, target: _Target, started: float, client: Client | None, key: WeightCacheKey | None,
              reasons: list[str], raw: Lease | None = None) -> torch.nn.Module:
        """vLLM's BaseModelLoader.load_model with raw resident weights or disk as the source, then publish."""
        api = self.vllm
        model_config = target.model_config
        if reasons:
            last_load["reason"] = "; ".join(reasons)
        publish = self.options.publish and client is not None and key is not None
        with api.set_default_torch_dtype(model_config.dtype):
            t0 = time.perf_counter()
            with target.device:
                model = self.create_model(vllm_config=target.vllm_config, model_config=model_config,
                                          prefix=target.prefix)
            last_load["create_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            if raw is not None:
                with raw:
                    self._feed_raw(model, model_config, raw)
            else:
                self._disk_loader().load_weights(model, model_config)
            last_load["weights_s"] = time.perf_counter() - t0
            _empty_cache()
            if api._has_online_quant(model):
                api.finalize_layerwise_processing(model, model_config)
            before = state_before_processing(model) if publish else None
            t0 = time.perf_counter()
            api.process_weights_after_loading(model, model_config, target.device)
            last_load["process_s"] = time.perf_counter() - t0
            _empty_cache()
        load_s = time.perf_counter() - started
        last_load.update(path="raw" if raw is not None else "disk", load_s=load_s,
                         entry=raw.entry if raw is not None else None)
        published = None
        if publish:
            assert client is not None and key is not None
            published = self._publish(client, model, key, before)
        del before
        source = f"resident raw entry {raw.entry}" if raw is not None else f"disk ({model_config.model})"
        log.info("wcd: loaded weights from %s in %.3f s%s%s", source, load_s,
                 f" ({last_load['reason']})" if last_load.get("reason") else "",
                 f"; published processed weights as entry {published}" if published else "")
        return model.eval()

    def _feed_raw(self, model: torch.nn.Module, model_config: ModelConfig, lease: Lease) -> None:
        if getattr(model, "secondary_weights", ()) or getattr(model, "allow_patterns_overrides", None):
            raise WcdLoadError("this model reads extra weight sources; the raw path only has the checkpoint")
        tensors = lease.tensors
        unused = getattr(model, "is_unused_checkpoint_weight", None)
        items = ((n, t) for n, t in tensors.items() if unused is None or not unused(n))
        t0 = time.perf_counter()
        loaded = model.load_weights(items)  # type: ignore[operator]  # vLLM models define it; nn.Module does not
        del tensors
        log.debug("wcd: fed %s to load_weights in %.3f s", lease.entry, time.perf_counter() - t0)
        if model_config.quantization is None and loaded is not None:
            self._disk_loader().track_weights_loading(model, loaded, quantized=False)

    def _publish(self, client: Client, model: torch.nn.Module, key: WeightCacheKey,
                 before: dict[str, torch.Tensor] | None) -> str | None:
        refused = self._preprocessed_refusal(model)
        if refused:
            log.warning("wcd: not publishing: %s", refused)
            last_load["publish_error"] = refused
            return None
        t0 = time.perf_counter()
        try:
            name, count = publish_snapshot(client, key, model, before=before,
                                           model_attrs=self.vllm.export_model_attrs(model),
                                           retention=self.options.retention)
        except WcdError as e:
            # Another engine may have published the same key meanwhile (busy), or it does not fit.
            log.warning("wcd: could not publish processed weights (%s: %s); the engine runs from its own copy",
                        e.code, e.message)
            last_load["publish_error"] = f"{e.code}: {e.message}"
            return None
        last_load.update(published=name, publish_s=time.perf_counter() - t0, tensors=count)
        return name

    # -- daemon lookups ---------------------------------------------------------------------------

    def _connect(self, required: bool) -> Client | None:
        if not self.options.socket:
            last_load["daemon_error"] = "no socket: set model_loader_extra_config socket or WCD_SOCKET"
            if required:
                raise WcdLoadError("wcd loader: no daemon socket given (model_loader_extra_config "
                                   "{'socket': PATH} or WCD_SOCKET), and fallback=false")
            return None
        try:
            return Client(self.options.socket, name=f"vllm-wcd pid {os.getpid()}", server_uid=trust.server_uids())
        except WcdError as e:
            last_load["daemon_error"] = e.message
            if required:
                raise WcdLoadError(f"wcd loader: {e.message}, and fallback=false") from e
            log.warning("wcd: daemon unavailable (%s); loading from disk", e.message)
            return None

    def _find_processed(self, client: Client, key: WeightCacheKey, reasons: list[str]) -> Lease | None:
        try:
            return _trusted(client, client.acquire(key, timeout_s=self.options.timeout_s), reasons)
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

    def _find_raw(self, client: Client, fingerprint: str, reasons: list[str]) -> Lease | None:
        """A read lease on a raw entry holding this exact checkpoint (by fingerprint), or None."""
        if self.options.entry:
            names = [self.options.entry]
        else:
            names = [e["name"] for e in client.list()
                     if e["key"].get("transform") == "raw" and e["key"].get("fingerprint") == fingerprint
                     and e.get("state") in ("ready", "loading")]
        for name in names:
            try:
                lease = client.acquire(name, timeout_s=self.options.timeout_s)
            except NotFound:
                reasons.append(f"no entry {name!r}")
                continue
            except WcdError as e:
                reasons.append(f"raw entry {name!r}: {e.message}")
                continue
            if lease.key.transform == "raw" and lease.key.fingerprint == fingerprint:
                if _trusted(client, lease, reasons) is None:
                    continue
                return lease
            why = (f"entry {name!r} holds a different checkpoint (fingerprint {lease.key.fingerprint[:12]}, "
                   f"this model {fingerprint[:12]})" if lease.key.fingerprint != fingerprint
                   else f"entry {name!r} is not a raw checkpoint ({lease.key.transform})")
            log.warning("wcd: not using %s", why)
            reasons.append(why)
            lease.release()
        if not names:
            reasons.append("no raw entry")
        return None

    # -- helpers ----------------------------------------------------------------------------------

    def _key(self, vllm_config: VllmConfig, model_config: ModelConfig, device: torch.device) -> WeightCacheKey | None:
        """This rank's processed key, or None without a local checkpoint to fingerprint."""
        ckpt = checkpoint_dir(model_config)
        if ckpt is None:
            return None
        try:
            return processed_key(vllm_config, model_config, device, ckpt, fingerprint_checkpoint(ckpt),
                                 shard(vllm_config))
        except AttributeError as e:  # a config field the key reads was renamed: never key without it
            raise IncompatibleVllm(f"wcd loader: vLLM {vllm_version()} has no {e.name!r} on "
                                   f"{type(e.obj).__name__} (needed for the cache key); use a wcd release "
                                   "made for this vLLM, or another load format") from e

    def _device(self, vllm_config: VllmConfig) -> torch.device:
        return torch.device(self.load_config.device or vllm_config.device_config.device)

    def _disk_loader(self) -> Any:
        # DefaultModelLoader must see neither load_format="wcd" nor our extra config keys.
        return self.vllm.DefaultModelLoader(dataclasses.replace(self.load_config, load_format="auto",
                                                                model_loader_extra_config={}))


def _empty_cache() -> None:
    gc.collect()
    torch.accelerator.empty_cache()


def _trusted(client: Client, lease: Lease, reasons: list[str]) -> Lease | None:
    """`lease` if its entry comes from a publisher this engine trusts (`trust.accepted_publisher`);
    else the lease is released, the reason recorded, and None returned."""
    why = trust.accepted_publisher(client, lease)
    if why is not None:
        log.info("wcd: using %s, published by %s", lease.entry, why)
        return lease
    reasons.append(f"entry {lease.entry!r} was {trust.whose(lease)}, which this engine does not trust "
                   "(its own uid, the daemon's, or the daemon's trusted_publishers)")
    log.warning("wcd: not using %s", reasons[-1])
    lease.release()
    return None
