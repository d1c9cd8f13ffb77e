"""wcd.integrations.torch: a module's weights bound to a resident entry, zero-copy."""

from __future__ import annotations

import pytest
import torch

from wcd.integrations.torch import AttachMismatch, attach, publish_module
from wcd.key import WeightCacheKey


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.proj = torch.nn.Linear(16, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(16, 32, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("scale", torch.tensor([0.5]))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        return self.norm(self.proj(h)) * self.scale, self.head(h)


def test_attach_binds_module_zero_copy_and_outputs_match(make_daemon):
    torch.manual_seed(0)
    src = Tiny().eval()
    state = {k: v.clone() for k, v in src.state_dict().items() if k != "head.weight"}
    d = make_daemon()
    with d.client() as c:
        name = c.publish(WeightCacheKey(model="tiny", transform="test"), state)
        with c.acquire(name) as lease:
            dst = Tiny().eval()
            report = attach(dst, lease)
            assert report.ok and "head.weight" in report.bound
            assert dst.head.weight is dst.embed.weight  # still tied
            base = lease.tensors["embed.weight"].untyped_storage().data_ptr()
            for t in list(dst.parameters()) + [dst.scale]:
                assert t.untyped_storage().data_ptr() == base  # views of the one arena mapping
            ids = torch.arange(10)
            with torch.no_grad():
                for a, b in zip(src(ids), dst(ids)):
                    assert torch.equal(a, b)


def test_attach_reports_missing_unexpected_and_mismatched():
    m = Tiny()
    tensors = {k: v.clone() for k, v in m.state_dict().items() if k not in ("proj.bias", "head.weight")}
    tensors["norm.weight"] = torch.ones(8, dtype=torch.float16)
    tensors["stray"] = torch.zeros(1)
    with pytest.raises(AttachMismatch) as e:
        attach(m, tensors)
    assert e.value.details["missing"] == ["proj.bias"]
    assert e.value.details["unexpected"] == ["stray"]
    assert e.value.details["mismatched"][0].startswith("norm.weight: module has torch.float32[8]")
    report = attach(Tiny(), tensors, strict=False)
    assert not report.ok and "proj.weight" in report.bound


def test_publish_module_rebinds_to_the_shared_copy(make_daemon):
    torch.manual_seed(1)
    m = Tiny().eval()
    ids = torch.arange(10)
    with torch.no_grad():
        before = m(ids)
    own = m.proj.weight.untyped_storage().data_ptr()
    d = make_daemon()
    with d.client() as c:
        lease = publish_module(c, WeightCacheKey(model="tiny", transform="publish-test"), m)
        assert m.proj.weight.untyped_storage().data_ptr() != own  # the module's own copy is gone
        assert m.proj.weight.untyped_storage().data_ptr() == lease.tensors["proj.weight"].untyped_storage().data_ptr()
        assert m.head.weight is m.embed.weight
        with torch.no_grad():
            for a, b in zip(before, m(ids)):
                assert torch.equal(a, b)
        with d.client() as other, other.acquire(WeightCacheKey(model="tiny", transform="publish-test")) as l2:
            assert torch.equal(l2.tensors["proj.weight"], m.proj.weight)
        lease.release()
