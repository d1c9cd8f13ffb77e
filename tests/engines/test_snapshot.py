"""The engine-independent core of the vLLM plugin (wcd.integrations.snapshot): snapshot -> publish -> attach
-> bind, through a real daemon.

Needs torch only (no vLLM), so it also runs in the dev venv (`make test`).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from wcd.integrations.snapshot import (  # noqa: E402
    META_TENSOR,
    SnapshotMismatch,
    bind,
    decode_meta,
    encode_meta,
    meta_leftovers,
    publish_snapshot,
    read_meta,
    snapshot,
)
from wcd.integrations.vllm import Options  # noqa: E402
from wcd.key import WeightCacheKey  # noqa: E402


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.proj = torch.nn.Linear(16, 24)
        self.head = torch.nn.Linear(16, 32, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("scale", torch.full((24,), 0.5))
        self.register_buffer("cache", torch.arange(8.0), persistent=False)  # e.g. rotary cos/sin

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.embed(ids)
        return self.proj(h) * self.scale + self.cache.sum(), self.head(h)


def processed() -> tuple[Tiny, dict[str, torch.Tensor]]:
    """A Tiny as a post-load step leaves it: proj.weight stored transposed (a permuted layout), a new
    per-layer tensor, and one weight moved into an 'opaque kernel' with an empty placeholder left."""
    torch.manual_seed(0)
    m = Tiny().eval()
    before = dict(m.named_parameters(remove_duplicate=False))
    m.proj.weight = torch.nn.Parameter(m.proj.weight.detach().t().contiguous().t(), requires_grad=False)
    m.proj.weight.output_dim = 0  # a simple attribute set by processing
    m.proj.register_buffer("packed_scale", torch.tensor([2.0]))
    m.head.register_parameter("extra", torch.nn.Parameter(torch.randn(4), requires_grad=False))
    return m, before


def test_snapshot_round_trip_through_the_daemon_is_exact(make_daemon):
    src, before = processed()
    ids = torch.tensor([[1, 2, 3, 31]])
    tensors, meta = snapshot(src, before)
    assert meta["aliases"] == {"head.weight": "embed.weight"}
    assert meta["permuted"] == {"proj.weight": [1, 0]} and tensors["proj.weight"].is_contiguous()
    assert meta["attrs"]["proj.weight"] == {"output_dim": 0}
    assert set(meta["kinds"]) == {"embed.weight", "proj.weight", "proj.bias", "proj.packed_scale", "head.extra",
                                  "scale", "cache"}

    tensors[META_TENSOR] = encode_meta(meta)
    d = make_daemon()
    with d.client() as c:
        name = c.publish(WeightCacheKey(model="tiny", transform="vllm-test"), tensors)
        with c.acquire(name) as lease:
            views = lease.tensors
            assert decode_meta(views[META_TENSOR]) == meta
            with torch.device("meta"):
                dst = Tiny().eval()
            nbytes = bind(dst, views, meta, copy=False)
            assert not meta_leftovers(dst) and nbytes > 0
            assert dst.head.weight is dst.embed.weight  # still tied, one tensor
            assert dst.proj.weight.stride() == src.proj.weight.stride()  # layout kept
            assert dst.proj.weight.output_dim == 0
            base = views[META_TENSOR].untyped_storage().data_ptr()
            assert all(p.untyped_storage().data_ptr() == base for p in dst.parameters())  # zero-copy
            with torch.no_grad():
                for a, b in zip(src(ids), dst(ids)):
                    assert torch.equal(a, b)


def test_snapshot_restores_weights_that_processing_replaced_by_a_placeholder():
    m, before = processed()
    original = m.proj.weight.detach().clone()
    m.proj.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)  # e.g. vLLM's CPU GEMM dispatch
    tensors, meta = snapshot(m, before)
    assert meta["restored"] == ["proj.weight"]
    assert torch.equal(tensors["proj.weight"], original)


def test_bind_copy_mode_owns_its_memory(make_daemon):
    src, before = processed()
    tensors, meta = snapshot(src, before)
    tensors[META_TENSOR] = encode_meta(meta)
    d = make_daemon()
    with d.client() as c:
        name = c.publish(WeightCacheKey(model="tiny", transform="test"), tensors)
        with c.acquire(name) as lease:
            with torch.device("meta"):
                dst = Tiny()
            bind(dst, lease.tensors, meta, copy=True)
            base = lease.tensors[META_TENSOR].untyped_storage().data_ptr()
            assert all(p.untyped_storage().data_ptr() != base for p in dst.parameters())
    assert torch.equal(dst.embed.weight, src.embed.weight)  # still valid after the lease ended


def test_options_are_validated(monkeypatch):
    monkeypatch.setenv("WCD_SOCKET", "/run/wcd/x.sock")
    o = Options.parse({})
    assert (o.socket, o.mode, o.fallback, o.publish, o.entry) == ("/run/wcd/x.sock", "zero_copy", True, True, None)
    o = Options.parse({"socket_path": "/s", "mode": "copy", "fallback": "false", "publish": False, "entry": "m"})
    assert (o.socket, o.mode, o.fallback, o.publish, o.entry) == ("/s", "copy", False, False, "m")
    with pytest.raises(ValueError, match="unknown model_loader_extra_config keys"):
        Options.parse({"sockets": "/s"})
    with pytest.raises(ValueError, match="mode"):
        Options.parse({"mode": "mmap"})
    with pytest.raises(ValueError, match="fallback"):
        Options.parse({"fallback": "maybe"})


def test_publish_snapshot_then_read_meta_refuses_what_is_not_a_snapshot(make_daemon):
    src, before = processed()
    d = make_daemon()
    with d.client() as c:
        name, count = publish_snapshot(c, WeightCacheKey(model="tiny", transform="test/snapshot"), src,
                                       before=before, model_attrs={"flag": True})
        assert count == 7
        with c.acquire(name) as lease:
            meta = read_meta(lease.entry, lease.tensors)
            assert meta["model_attrs"] == {"flag": True}
            with torch.device("meta"):
                dst = Tiny()
            bind(dst, lease.tensors, meta, copy=True)
            assert dst.flag is True
        raw = c.publish(WeightCacheKey(model="plain", transform="test/plain"), {"w": torch.zeros(4)})
        with c.acquire(raw) as lease, pytest.raises(SnapshotMismatch, match="not a published snapshot"):
            read_meta(lease.entry, lease.tensors)
