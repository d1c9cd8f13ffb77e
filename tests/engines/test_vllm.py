"""vLLM (PyPI's CPU build) with load_format="wcd" against a real daemon: the three paths, bit-identical outputs.

Baselines are the default loader's outputs. Each engine start is a fresh process; the plugin's
record of what it did (`wcd.integrations.vllm.last_load`) comes back in the result, its log lines
(logger "vllm.wcd") in the engine's log, and the daemon's lease list shows attached engines.
"""

from __future__ import annotations

import re
import time
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs the engines venv: tests/engines/setup-venv.sh (make test-engines)")

MINILM_PROMPTS = ["hello world", "wcd keeps model weights resident", "The quick brown fox jumps over the lazy dog"]
SMOL_PROMPTS = ["The capital of France is", "def fibonacci(n):"]


def minilm_spec(model: Path, **kw: Any) -> dict[str, Any]:
    return {"model": str(model), "runner": "pooling", "prompts": MINILM_PROMPTS, **kw}


def smol_spec(model: Path, **kw: Any) -> dict[str, Any]:
    return {"model": str(model), "prompts": SMOL_PROMPTS, "max_tokens": 12, **kw}


def wcd(spec: dict[str, Any], probe_external: bool = False, **extra: Any) -> dict[str, Any]:
    """The spec with load_format="wcd" and `extra` as model_loader_extra_config."""
    return dict(spec, load_format="wcd", probe_external=probe_external,
                extra={k: str(v) if isinstance(v, Path) else v for k, v in extra.items()})


def ok(result: dict[str, Any]) -> dict[str, Any]:
    assert result["ok"], f"{result.get('error')}: {result.get('message')}\n{result.get('traceback', '')}"
    return result


def same_outputs(a: dict[str, Any], b: dict[str, Any]) -> None:
    for field in ("embeddings", "tokens", "chosen_logprobs", "logprobs"):
        if field in a or field in b:
            assert a.get(field) == b.get(field), f"{field} differ"


@pytest.fixture(scope="session")
def minilm_default(run_engine: Any, minilm: Path) -> dict[str, Any]:
    return ok(run_engine(minilm_spec(minilm)))


@pytest.fixture(scope="session")
def smol_default(run_engine: Any, smollm2: Path) -> dict[str, Any]:
    r = ok(run_engine(smol_spec(smollm2)))
    assert r["text"][0].startswith(" Paris")
    return r


def test_minilm_first_start_publishes_second_attaches_bit_identical(make_daemon, run_engine, minilm, minilm_default):
    d = make_daemon()
    first = ok(run_engine(wcd(minilm_spec(minilm), socket=d.socket)))
    assert first["wcd"]["path"] == "disk" and first["wcd"]["published"], first["wcd"]
    assert "wcd: loaded weights from disk" in first["log"] and "published processed weights as entry" in first["log"]
    published = {e["name"]: e for e in d.entries()}
    entry = published[first["wcd"]["published"]]
    assert entry["state"] == "ready" and entry["origin"] == "publish" and entry["key"]["dtype"] == "float32"
    assert entry["key"]["fingerprint"] and entry["key"]["transform"].startswith("vllm-0.32")

    engine = run_engine(wcd(minilm_spec(minilm), socket=d.socket), hold=True)
    try:
        second = ok(engine.wait_holding())
        assert second["wcd"]["path"] == "attach" and second["wcd"]["entry"] == entry["name"], second["wcd"]
        assert "wcd: attached processed weights from entry" in second["log"]
        assert [(x["pid"], x["entry"]) for x in d.leases()] == [(second["pid"], entry["name"])]
    finally:
        engine.stop()
    same_outputs(first, minilm_default)
    same_outputs(second, minilm_default)
    assert [e["name"] for e in d.entries()] == [entry["name"]]  # nothing published twice
    deadline = time.monotonic() + 10
    while d.leases():  # the engine is gone: its connection closed, the daemon ended its lease
        assert time.monotonic() < deadline, "the engine's lease outlived it"
        time.sleep(0.1)

    # mode=copy: the same entry, cloned into engine memory; the lease ends at once.
    copy = run_engine(wcd(minilm_spec(minilm), socket=d.socket, mode="copy", probe_external=True), hold=True)
    try:
        r = ok(copy.wait_holding())
        assert r["wcd"]["path"] == "attach" and r["wcd"]["mode"] == "copy"
        assert r["external_weight_memory"] == 0  # the engine owns its copy
        assert not [lease for lease in d.leases() if lease["pid"] == r["pid"]]
        same_outputs(r, minilm_default)
    finally:
        copy.stop()


def test_smollm2_attach_identical_tokens_and_logprobs_lease_lives_with_engine(make_daemon, run_engine, smollm2,
                                                                               smol_default):
    d = make_daemon()
    # No socket option: the plugin takes $WCD_SOCKET.
    first = ok(run_engine(wcd(smol_spec(smollm2)), socket=d.socket))
    assert first["wcd"]["path"] == "disk" and first["wcd"]["published"], first["wcd"]
    same_outputs(first, smol_default)

    engine = run_engine(wcd(smol_spec(smollm2), probe_external=True), socket=d.socket, hold=True)
    try:
        r = ok(engine.wait_holding())
        assert r["wcd"]["path"] == "attach" and r["wcd"]["entry"] == first["wcd"]["published"], r["wcd"]
        same_outputs(r, smol_default)
        entry = {e["name"]: e for e in d.entries()}[r["wcd"]["entry"]]
        assert r["external_weight_memory"] == entry["bytes"]  # what vLLM is told lives outside the engine
        mine = [lease for lease in d.leases() if lease["pid"] == r["pid"]]
        assert [(x["entry"], x["kind"]) for x in mine] == [(r["wcd"]["entry"], "read")]
        time.sleep(2 * 3.0)  # two lease TTLs: only heartbeats from the engine's client keep it
        again = [lease for lease in d.leases() if lease["pid"] == r["pid"]]
        assert [x["id"] for x in again] == [mine[0]["id"]] and again[0]["expires_in_s"] > 0
    except BaseException:
        engine.stop()
        raise
    # The daemon dies: the engine keeps serving from its mapping of the (host) arena.
    d.stop()
    try:
        same_outputs(ok(engine.again()), smol_default)
    finally:
        engine.stop()


def test_raw_resident_checkpoints_are_fed_to_load_weights(make_daemon, run_engine, smollm2, minilm, smol_default,
                                                          minilm_default):
    d = make_daemon(models={"smollm2": smollm2, "minilm": minilm})
    d.wait_loaded()
    smol = ok(run_engine(wcd(smol_spec(smollm2), socket=d.socket)))  # found by checkpoint fingerprint
    assert smol["wcd"]["path"] == "raw" and smol["wcd"]["entry"] == "smollm2", smol["wcd"]
    assert "wcd: loaded weights from resident raw entry smollm2" in smol["log"]
    same_outputs(smol, smol_default)
    mini = ok(run_engine(wcd(minilm_spec(minilm), socket=d.socket, entry="minilm")))  # named explicitly
    assert mini["wcd"]["path"] == "raw" and mini["wcd"]["entry"] == "minilm", mini["wcd"]
    same_outputs(mini, minilm_default)
    # Both published their processed weights next to the raw ones.
    origins = sorted((e["origin"], e["key"]["transform"].split("/")[0]) for e in d.entries())
    assert origins == [("config", "raw"), ("config", "raw"), ("publish", "vllm-0.32.0"), ("publish", "vllm-0.32.0")]


def test_daemon_down_falls_back_to_disk_or_fails_clearly(run_engine, minilm, minilm_default, tmp_path):
    missing = tmp_path / "no-daemon.sock"
    r = ok(run_engine(wcd(minilm_spec(minilm), socket=missing)))
    assert r["wcd"]["path"] == "disk" and not r["wcd"].get("published"), r["wcd"]
    assert "daemon not running" in r["wcd"]["reason"]
    same_outputs(r, minilm_default)

    r = run_engine(wcd(minilm_spec(minilm), socket=missing, fallback=False))
    assert not r["ok"]
    assert "fallback=false" in r["message"] and "daemon not running" in r["message"], r["message"]


def test_a_different_checkpoint_is_never_served(make_daemon, run_engine, smollm2, minilm):
    d = make_daemon(models={"minilm": minilm})
    d.wait_loaded()
    r = run_engine(wcd(smol_spec(smollm2), socket=d.socket, entry="minilm", fallback=False))
    assert not r["ok"]
    assert "holds a different checkpoint" in r["message"] and "fallback=false" in r["message"], r["message"]
    assert [e["name"] for e in d.entries()] == ["minilm"]


def test_dtype_mismatch_takes_no_cached_weights(make_daemon, run_engine, minilm):
    d = make_daemon()
    f32 = ok(run_engine(wcd(minilm_spec(minilm), socket=d.socket)))
    assert f32["wcd"]["published"]
    bf16 = ok(run_engine(wcd(minilm_spec(minilm, dtype="bfloat16"), socket=d.socket)))
    assert bf16["wcd"]["path"] == "disk", bf16["wcd"]
    assert "dtype" in bf16["wcd"]["mismatch"]["fields"], bf16["wcd"]
    assert bf16["wcd"]["published"] and bf16["wcd"]["published"] != f32["wcd"]["published"]
    baseline = ok(run_engine(minilm_spec(minilm, dtype="bfloat16"), label="default loader (bf16)"))
    same_outputs(bf16, baseline)
    assert bf16["embeddings"] != f32["embeddings"]
    assert sorted(e["key"]["dtype"] for e in d.entries()) == ["bfloat16", "float32"]
    again = ok(run_engine(wcd(minilm_spec(minilm, dtype="bfloat16"), socket=d.socket)))
    assert again["wcd"]["path"] == "attach" and again["wcd"]["entry"] == bf16["wcd"]["published"]
    same_outputs(again, baseline)


def _entry_point_installed() -> bool:
    return any(ep.name == "wcd" and ep.value == "wcd.integrations.vllm:register"
               for ep in entry_points(group="vllm.general_plugins"))


@pytest.mark.skipif(not _entry_point_installed(),
                    reason='pyproject.toml lacks [project.entry-points."vllm.general_plugins"] wcd = '
                           '"wcd.integrations.vllm:register" (reinstall with setup-venv.sh after adding it)')
def test_plugin_loads_through_the_entry_point_in_the_engine_core_process(make_daemon, run_engine, minilm,
                                                                         minilm_default):
    d = make_daemon()
    for expected in ("disk", "attach"):
        r = ok(run_engine(wcd(minilm_spec(minilm), socket=d.socket), multiprocess=True,
                          label=f"wcd {expected} (multiprocess)"))
        assert r.get("wcd") is None  # the loader ran in the EngineCore process, not this one
        assert not r.get("registered_by_hand")
        marker = "wcd: loaded weights from disk" if expected == "disk" else "wcd: attached processed weights"
        assert marker in r["log"], r["log"][-3000:]
        same_outputs(r, minilm_default)


# -- the plugin can never break vLLM ----------------------------------------------------------------


@pytest.fixture
def plugin(monkeypatch: pytest.MonkeyPatch) -> Any:
    from wcd.integrations import vllm as plugin

    plugin.vllm_api.cache_clear()
    yield plugin
    monkeypatch.undo()
    plugin.vllm_api.cache_clear()


def test_every_vllm_name_the_plugin_relies_on_exists_in_the_tested_vllm(plugin):
    import vllm

    assert vllm.__version__ == plugin.TESTED_VLLM
    api = plugin.vllm_api()  # raises IncompatibleVllm naming whatever is missing
    assert set(plugin.REGISTRATION_NAMES) <= set(plugin.VLLM_NAMES)
    for spec in plugin.VLLM_NAMES:
        assert hasattr(api, spec.partition(":")[2].split(".")[0]), spec


@pytest.mark.parametrize("name", ["vllm.model_executor.utils:weights_already_processed",
                                  "vllm.model_executor.model_loader.base_loader:_has_online_quant"])
def test_a_missing_vllm_name_is_one_line_naming_it_and_the_version(plugin, monkeypatch, name):
    import importlib

    module, _, attr = name.partition(":")
    monkeypatch.delattr(importlib.import_module(module), attr)
    with pytest.raises(plugin.IncompatibleVllm) as e:
        plugin.vllm_api()
    message = str(e.value)
    assert f"vLLM {plugin.TESTED_VLLM} lacks {module}.{attr}" in message and "\n" not in message, message


def test_auto_engines_start_whatever_the_plugin_misses(run_engine, minilm, minilm_default, tmp_path):
    # A vLLM that moved a name only the wcd loader uses: registration does not touch it, auto engines
    # start, and a wcd engine fails with one line naming it.
    missing = ["vllm.model_executor.utils:weights_already_processed"]
    auto = ok(run_engine(minilm_spec(minilm, remove_vllm_names=missing), label="default loader (name removed)"))
    same_outputs(auto, minilm_default)
    assert "wcd:" not in auto["log"]
    r = run_engine(wcd(minilm_spec(minilm, remove_vllm_names=missing), socket=tmp_path / "none.sock"))
    assert not r["ok"] and r["error"] == "IncompatibleVllm", r
    assert "vLLM 0.32.0 lacks vllm.model_executor.utils.weights_already_processed" in r["message"], r["message"]
    # A vLLM without the registration API itself: one warning, and auto engines still start.
    missing = ["vllm.model_executor.model_loader:register_model_loader"]
    auto = ok(run_engine(minilm_spec(minilm, remove_vllm_names=missing), label="default loader (no register API)"))
    same_outputs(auto, minilm_default)
    assert "wcd: load_format='wcd' is unavailable in vLLM 0.32.0" in auto["log"], auto["log"][-3000:]


# -- tensor parallelism -----------------------------------------------------------------------------


def worker_pids(log: str, marker: str) -> dict[int, int]:
    """tp_rank -> pid of the worker processes whose log lines contain `marker`."""
    return {int(rank): int(pid) for rank, pid in re.findall(r"\(Worker_TP(\d+) pid=(\d+)\)[^\n]*" + re.escape(marker),
                                                            log)}


def test_tensor_parallel_ranks_publish_and_attach_their_own_shards(make_daemon, run_engine, minilm):
    d = make_daemon()
    tp1 = ok(run_engine(wcd(minilm_spec(minilm), socket=d.socket)))
    assert tp1["wcd"]["published"]

    # TP=2: each rank computes its own key; the TP=1 entry differs in shard, so both read from disk.
    first = ok(run_engine(wcd(minilm_spec(minilm, tp=2), socket=d.socket), label="wcd disk (TP=2)"))
    assert sorted(worker_pids(first["log"], "wcd: loaded weights from disk")) == [0, 1], first["log"][-3000:]
    assert first["log"].count("differs in shard") >= 1, first["log"][-3000:]
    entries = {e["name"]: e for e in d.entries()}
    ranks = {e["key"]["shard"]["tp_rank"]: e for e in entries.values() if e["key"]["shard"]["tp_size"] == 2}
    assert sorted(ranks) == [0, 1] and len(entries) == 3
    assert ranks[0]["bytes"] < entries[tp1["wcd"]["published"]]["bytes"]  # a shard, not the whole model

    engine = run_engine(wcd(minilm_spec(minilm, tp=2), socket=d.socket), hold=True, label="wcd attach (TP=2)")
    try:
        second = ok(engine.wait_holding())
        attached = worker_pids(second["log"], "wcd: attached processed weights from entry")
        assert sorted(attached) == [0, 1], second["log"][-3000:]
        for rank in attached:
            assert f"attached processed weights from entry {ranks[rank]['name']} " in second["log"]
        leases = {x["entry"]: x["pid"] for x in d.leases()}
        assert leases == {ranks[0]["name"]: attached[0], ranks[1]["name"]: attached[1]}, (leases, attached)
        assert attached[0] != attached[1] and second["pid"] not in attached.values()
    finally:
        engine.stop()
    same_outputs(second, first)  # TP=2 attached == TP=2 loaded from disk
    assert len(d.entries()) == 3  # nothing published twice; the TP=1 entry was never attached by TP=2


def test_a_crafted_processed_entry_is_a_reason_to_load_another_way(plugin, tmp_path):
    """fallback = true holds for an entry whose reply no client can map (another uid crafted it,
    an older daemon took it): the loader's lookup gets one WcdError, never a TypeError, and says
    why it loads another way."""
    from vllm.config.load import LoadConfig

    from tests.integration.peers import Impostor
    from tests.integration.test_hardening_arena import CRAFTED, GOOD_REPLY
    from wcd.client import Client
    from wcd.integrations.vllm_loader import WcdModelLoader
    from wcd.key import WeightCacheKey

    socket = tmp_path / "impostor.sock"
    impostor = Impostor(socket, {**GOOD_REPLY, **CRAFTED["manifest: zero-size, strides of 2**96"]})
    try:
        loader = WcdModelLoader(LoadConfig(load_format="wcd", model_loader_extra_config={"socket": str(socket)}))
        assert loader.options.fallback
        reasons: list[str] = []
        with Client(socket, heartbeats=False) as c:
            assert loader._find_processed(c, WeightCacheKey(model="m", transform="test"), reasons) is None
        assert len(reasons) == 1 and reasons[0].startswith("processed lookup failed (bad_reply: "), reasons
    finally:
        impostor.close()
