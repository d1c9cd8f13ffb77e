"""vLLM model loader plugin: `load_format="wcd"`, weights from a wcd daemon.

Registered through the `vllm.general_plugins` entry point (`wcd = "wcd.integrations.vllm:register"`),
which vLLM runs in every process (API server, engine core, workers) whatever the load format. So
`register()` only registers a name and never raises: importing this module needs no vLLM, and the
loader itself (`wcd/integrations/vllm_loader.py`) resolves the vLLM names it relies on
(`VLLM_NAMES`) only when `load_format="wcd"` is used. A vLLM that lacks one of them fails that
engine with one line naming the vLLM version and the missing names; every other engine is untouched.

Options come through `--model-loader-extra-config` / `model_loader_extra_config`:

- `socket` (default `$WCD_SOCKET`): the daemon's socket (`socket_path` is accepted too).
- `mode` (`zero_copy`): `zero_copy` makes parameters views of the daemon's arena (the lease lives as
  long as the engine); `copy` clones them into engine memory and ends the lease.
- `fallback` (`true`): load from disk when the daemon is absent or holds neither processed nor raw
  weights; `false` makes that an error.
- `publish` (`true`): after a raw or disk load, publish the processed weights so the next start attaches.
- `entry` (auto): name of the daemon entry holding the raw checkpoint (default: any ready raw entry
  whose checkpoint fingerprint matches).
- `retention` (`cached`): retention of published entries (`cached`, `ephemeral`, `pinned`).
- `timeout_s` (`600`): how long to wait for an entry the daemon is still loading or filling.

Three paths, chosen automatically, logged on the `vllm.wcd` logger and recorded in `last_load`:

1. **attach** — the daemon holds processed weights under this engine's exact key: build the model
   on the meta device, bind every parameter and buffer to the arena's views (no copy, no disk
   read), then run vLLM's post-load step under `weights_already_processed()`.
2. **raw** — the daemon holds the raw checkpoint (same fingerprint): feed its tensors to
   `model.load_weights` (vLLM shards and converts them), post-process, publish.
3. **disk** — neither (or no daemon): vLLM's default loader reads the checkpoint, then publish.

The key (`processed_key`) covers what changes the weights: checkpoint fingerprint (names, sizes,
headers and sampled bytes), dtype, quantization method and a hash of its config, a hash of the HF
config, the rank's shard (TP/PP ranks and sizes, DP with expert parallelism), vLLM and torch
versions, the device (GPU UUID or `cpu`) and the runner. Each tensor-parallel rank publishes and
attaches its own shard under its own key. A near miss is a miss (the daemon names the differing
fields, logged at INFO), never a wrong weight.
"""

from __future__ import annotations

from wcd.integrations.vllm_shared import (
    LOAD_FORMAT,
    REGISTRATION_NAMES,
    TESTED_VLLM,
    VLLM_NAMES,
    IncompatibleVllm,
    Options,
    UnsupportedPreprocessed,
    WcdLoadError,
    last_load,
    log,
    processed_key,
    shard,
    vllm_api,
    vllm_version,
)

_registered: type | None = None


def register() -> None:
    """Entry point for `vllm.general_plugins`: make `load_format="wcd"` known. Idempotent, never raises.

    It runs in every vLLM process whatever the load format, so a failure here would stop engines
    that never use wcd: it is logged (one warning) and `load_format="wcd"` stays unknown.
    """
    global _registered
    try:
        from vllm.model_executor.model_loader import register_model_loader

        from wcd.integrations.vllm_loader import WcdModelLoader

        if _registered is not WcdModelLoader:  # vLLM may run plugins more than once per process
            register_model_loader(LOAD_FORMAT)(WcdModelLoader)
            _registered = WcdModelLoader
    except Exception as e:  # noqa: BLE001 - never break an engine that does not use wcd
        log.warning("wcd: load_format=%r is unavailable in vLLM %s: %s: %s", LOAD_FORMAT, vllm_version(),
                    type(e).__name__, e)
    try:
        from wcd.integrations import vllm_transfer

        vllm_transfer.register()
    except Exception as e:  # noqa: BLE001 - a vLLM without weight transfer still loads through wcd
        log.debug("wcd: no weight-transfer backend in vLLM %s: %s: %s", vllm_version(), type(e).__name__, e)



__all__ = ["LOAD_FORMAT", "REGISTRATION_NAMES", "TESTED_VLLM", "VLLM_NAMES", "IncompatibleVllm", "Options",
           "UnsupportedPreprocessed", "WcdLoadError", "last_load", "processed_key", "register", "shard",
           "vllm_api", "vllm_version"]
