"""vLLM weight-transfer backend `wcd`: a running engine takes a generation of a wcd series.

Registered by the plugin (`wcd.integrations.vllm.register`) with vLLM's
`WeightTransferEngineFactory`, so a server started with `--weight-transfer-config
'{"backend": "wcd"}'` updates through vLLM's own RL endpoints:

    POST /init_weight_transfer_engine  {"init_info": {"series": "policy"}}      (once; "socket" optional)
    POST /pause
    POST /start_weight_update
    POST /update_weights               {"update_info": {"series": "policy", "generation": 2}}
    POST /finish_weight_update
    POST /resume

`update_weights` takes one lease on the generation (one descriptor: no per-tensor handles, no
pickles) and feeds its tensors, in checkpoint format, to `model.load_weights` between vLLM's
layerwise reload steps (`start`/`finish`), as vLLM's own `ipc` backend does: vLLM shards, fuses
and converts them, so each tensor-parallel rank takes its own part. The lease ends when the
update does. The trainer publishes with `Client.publish_generation(series, state_dict)`.

Trust: the generation's publisher must be one the engine trusts (`wcd.integrations.trust`: the
engine's own uid, the daemon's, or the daemon's `trusted_publishers`), as for every attach.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

log = logging.getLogger("vllm.wcd")  # vLLM shows only records of loggers under "vllm."

BACKEND = "wcd"


def engine_class() -> type:
    """The backend class, built on first use: importing this module needs no vLLM."""
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )

    @dataclass
    class WcdInitInfo(WeightTransferInitInfo):
        series: str
        socket: str | None = None

    @dataclass
    class WcdUpdateInfo(WeightTransferUpdateInfo):
        series: str
        generation: int | None = None  # None: the current one

    class WcdWeightTransferEngine(WeightTransferEngine):
        init_info_cls = WcdInitInfo
        update_info_cls = WcdUpdateInfo
        supports_draft_weight_update = False

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._client: Any = None
            self.series: str | None = None
            self.generation = 0

        def init_transfer_engine(self, init_info: WcdInitInfo) -> None:
            from wcd.client import Client
            from wcd.integrations import trust

            path = init_info.socket or os.environ.get("WCD_SOCKET")
            if self._client is not None:
                self._client.close()
            self._client = Client(path, name=f"vllm weight transfer pid {os.getpid()}",
                                  server_uid=trust.server_uids())
            self.series = init_info.series
            log.info("wcd: weight transfer from series %r on %s", self.series, self._client.path)

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

        def receive_weights(self, update_info: WcdUpdateInfo) -> None:
            from wcd.errors import WcdError
            from wcd.integrations import trust

            if self._client is None or update_info.series != self.series:
                raise ValueError(f"wcd: update of series {update_info.series!r}, but the transfer engine was "
                                 f"initialised for {self.series!r} (POST /init_weight_transfer_engine first)")
            try:
                lease = self._client._acquire_generation(update_info.series, update_info.generation, "map")
            except WcdError as e:
                raise ValueError(f"wcd: {e.message}") from None
            try:
                if trust.accepted_publisher(self._client, lease) is None:
                    raise ValueError(f"wcd: {lease.entry} was published by uid {lease.publisher_uid}, whom this "
                                     "engine does not trust (add it to the daemon's trusted_publishers)")
                weights = _on(self.device, lease.tensors)
                from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

                with disable_mtp_completeness_check():
                    self.model.load_weights(weights)
                self.generation = int(lease.entry.rpartition("@")[2])
            finally:
                lease.release()
            log.info("wcd: took generation %d of %r", self.generation, self.series)

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)

        def shutdown(self) -> None:
            if self._client is not None:
                self._client.close()
                self._client = None

    return WcdWeightTransferEngine


def _on(device: torch.device, tensors: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The generation's tensors as (name, tensor) on the engine's device: a host arena's views
    are handed as they are to a CPU engine; a GPU engine reading a host arena copies each."""
    if device.type == "cpu":
        return list(tensors.items())
    return [(name, t.to(device, non_blocking=True)) for name, t in tensors.items()]


_registered = False


def register() -> None:
    """Register the backend with vLLM's factory (lazily: by module path). Idempotent."""
    global _registered
    if _registered:
        return
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "WcdWeightTransferEngine")
    _registered = True


def __getattr__(name: str) -> Any:  # the factory's lazy loader does getattr(module, class name)
    if name == "WcdWeightTransferEngine":
        return engine_class()
    raise AttributeError(name)
