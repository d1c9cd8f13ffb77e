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

vLLM runs each call on every worker. On each, `update_weights` takes one lease on the generation
(one descriptor: no per-tensor handles, no pickles) and feeds its tensors, in checkpoint format, to
`model.load_weights` inside vLLM's layerwise reload, as vLLM's own `ipc` backend does: vLLM shards,
fuses and converts them, so each tensor-parallel rank keeps its own part. Before any rank loads,
the model's ranks agree (an all-reduce) that each holds the same generation; if one cannot have
it, every rank refuses and the model stays as it was. The lease ends when the update does. The
trainer publishes with `Client.publish_generation(series, state_dict)`.

Trust: the generation's publisher must be one the engine trusts (`wcd.integrations.trust`: the
engine's own uid, the daemon's, or the daemon's `trusted_publishers`), as for every attach.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from wcd.client import Client, Lease

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
            self._reloading = False

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
            # vLLM's layerwise reload puts the parameters on the meta device until it is finalised;
            # it starts in receive_weights once every rank holds the generation, so an update the
            # ranks refuse leaves the model as it was (vLLM runs no finish after a failed update).
            self._reloading = False

        def receive_weights(self, update_info: WcdUpdateInfo) -> None:
            from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            lease = self._agreed_lease(update_info)
            try:
                weights = _on(self.device, lease.tensors)
                if not self._reloading:
                    initialize_layerwise_reload(self.model)
                    self._reloading = True
                try:
                    with disable_mtp_completeness_check():
                        self.model.load_weights(weights)
                except BaseException:
                    self._finalize()  # layers not loaded go back to their old tensors, not left on meta
                    raise
                self.generation = _number(lease.entry)
            finally:
                lease.release()
            log.info("wcd: took generation %d of %r", self.generation, self.series)

        def _agreed_lease(self, update_info: WcdUpdateInfo) -> Any:
            groups = _model_groups(self.parallel_config)
            return agreed_lease(lambda series, generation: take(self._client, self.series, series, generation),
                                lambda generation: _agree(groups, generation),
                                update_info.series, update_info.generation)

        def finish_weight_update(self) -> None:
            self._finalize()

        def _finalize(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            if self._reloading:
                self._reloading = False
                finalize_layerwise_reload(self.model, self.model_config)

        def shutdown(self) -> None:
            if self._client is not None:
                self._client.close()
                self._client = None

    return WcdWeightTransferEngine


Take = Callable[[str, "int | None"], "tuple[Lease | None, str | None]"]


def agreed_lease(take: Take, agree: Callable[[int], tuple[int, int]], series: str, generation: int | None) -> Lease:
    """This rank's lease on the generation of `series` that every rank of the model holds one on
    (`agree(n)`: the highest and lowest n over the ranks, 0 for a rank without one): the same
    generation everywhere (a commit between two ranks' asks for the current one is met by the
    older ranks taking the newer), or, if any rank cannot have it, ValueError on every rank, no
    lease kept, before any rank loads a tensor. Every rank makes the same `agree` calls in the same
    order: each is a collective."""
    lease, error = take(series, generation)
    high, low = agree(_number(lease.entry) if lease is not None else 0)
    if low and high != low:
        if lease is not None and _number(lease.entry) != high:
            lease.release()
            lease, error = take(series, high)  # a rank holds it: still there
        high, low = agree(_number(lease.entry) if lease is not None else 0)
    if lease is not None and low and high == low:
        return lease
    if lease is not None:
        lease.release()
    if error is None:
        which = f"generation {generation}" if generation else "the current generation"
        error = (f"wcd: another rank of this engine could not take {which} of {series!r}, so no rank loaded it "
                 "(that rank's reason is in the server's log)")
    log.warning("%s", error)
    raise ValueError(error)


def take(client: Client | None, initialised: str | None, series: str,
         generation: int | None) -> tuple[Lease | None, str | None]:
    """(a lease on `generation` of `series`, None: the current one), or (None, the one-line reason
    this rank cannot have it). Never raises: every rank must reach the agreement."""
    from wcd.errors import WcdError
    from wcd.integrations import trust

    if client is None or series != initialised:
        return None, (f"wcd: update of series {series!r}, but the transfer engine was initialised for "
                      f"{initialised!r} (POST /init_weight_transfer_engine first)")
    try:
        lease = client._acquire_generation(series, generation, "map")
    except WcdError as e:
        return None, f"wcd: {e.message}"
    except Exception as e:  # noqa: BLE001 - one line, on this rank, in the server's log and reply
        return None, f"wcd: could not take {series!r}: {type(e).__name__}: {e}"
    if trust.accepted_publisher(client, lease) is None:
        lease.release()
        return None, (f"wcd: {lease.entry} was published by uid {lease.publisher_uid}, whom this engine does not "
                      "trust (add it to the daemon's trusted_publishers)")
    return lease, None


def _number(entry: str) -> int:
    """The generation number in an entry name `series@N`."""
    return int(entry.rpartition("@")[2])


def _model_groups(parallel_config: Any) -> list[Any]:
    """vLLM's process groups that together span this model's ranks (pipeline stages, then tensor
    ranks): one replica, never its data-parallel peers, which take their updates on their own."""
    if parallel_config.tensor_parallel_size * parallel_config.pipeline_parallel_size == 1:
        return []
    from vllm.distributed import get_pp_group, get_tp_group

    return [g for g in (get_pp_group(), get_tp_group()) if g.world_size > 1]


def _agree(groups: list[Any], generation: int) -> tuple[int, int]:
    """The highest and lowest `generation` over the ranks of `groups` (0: a rank has none): a max
    all-reduce over each group in turn, which spans their grid."""
    if not groups:
        return generation, generation
    import torch
    import torch.distributed as dist

    both = torch.tensor([generation, -generation], dtype=torch.int64)
    for group in groups:
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group.cpu_group)
    return int(both[0]), -int(both[1])


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
