"""`loss = "liger"` (Liger-Kernel's fused linear cross-entropy, an optional CUDA extra), on CPU: the glue against an
emulation of `LigerFusedLinearCrossEntropyLoss` (its constructor's keywords and `forward(lin_weight, _input,
target)`, a sum over non-ignored rows), held to the pure-torch chunked loss; and the clear refusals where Liger
cannot run (not installed, CPU, a projection)."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from cpbench.cp.loss import liger as liger_loss
from cpbench.cp.loss.chunked import check_loss, chunked_cross_entropy_sum


class EmulatedLigerLoss(torch.nn.Module):
    calls = 0

    def __init__(self, ignore_index=-100, lse_square_scale=0.0, label_smoothing=0.0, reduction="mean", softcap=None):
        super().__init__()
        self.ignore_index, self.reduction, self.softcap = ignore_index, reduction, softcap

    def forward(self, lin_weight, _input, target, bias=None):
        EmulatedLigerLoss.calls += 1
        assert _input.dim() == 2 and target.dim() == 1 and _input.shape[0] == target.shape[0]
        assert lin_weight.shape[1] == _input.shape[1] and lin_weight.dtype == _input.dtype
        logits = F.linear(_input, lin_weight).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return F.cross_entropy(logits, target, ignore_index=self.ignore_index, reduction=self.reduction)


@pytest.fixture
def fake_liger(monkeypatch):
    package, sub = types.ModuleType("liger_kernel"), types.ModuleType("liger_kernel.transformers")
    sub.LigerFusedLinearCrossEntropyLoss = EmulatedLigerLoss
    package.transformers = sub
    monkeypatch.setitem(sys.modules, "liger_kernel", package)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", sub)
    EmulatedLigerLoss.calls = 0


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_the_liger_glue_equals_the_chunked_loss_and_its_gradients(fake_liger, softcap):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 9, 16, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(40, 16, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 40, (2, 9), generator=g)
    targets[0, :3] = -100  # ignored rows
    got = liger_loss.liger_cross_entropy_sum(hidden, weight, targets, softcap)
    grads = torch.autograd.grad(got, (hidden, weight))
    ref = chunked_cross_entropy_sum(hidden, weight, targets, softcap, chunk_bytes=4 * 40 * 5)
    ref_grads = torch.autograd.grad(ref, (hidden, weight))
    assert EmulatedLigerLoss.calls == 1
    torch.testing.assert_close(got, ref.float())  # fp64 inputs, one fp32 rounding of the result
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)


def test_without_liger_the_loss_is_refused_with_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # the import raises ImportError
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", None)
    with pytest.raises(ImportError, match=r"pip install 'cpbench\[liger\]'.*loss='chunked'"):
        check_loss("liger")


def test_the_sweep_skips_liger_points_it_cannot_run_and_says_why():
    from cpbench.harness.run.skips import SkipRules
    from cpbench.harness.suite.spec import load_suite

    text = 'name = "t"\nmodel = "tiny-qwen3"\nseq_lens = [64]\ncp_sizes = [1]\nloss = "liger"\n'
    cpu = load_suite("t.toml", text=text).points()[0]
    cuda = load_suite("t.toml", text=text + 'device = "cuda"\n').points()[0]
    assert "CUDA only" in SkipRules().why_skip(cpu)
    assert "fake tensors" in SkipRules().why_skip(cuda, projection=True)


def test_use_loss_liger_on_a_model_gives_its_own_loss_without_logits(fake_liger):
    from transformers import AutoModelForCausalLM

    import cpbench
    from tests.dist.models import make_batch, tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3"), dtype=torch.float64)
    batch = make_batch("packed")
    want = model(**batch, use_cache=False).loss
    out = cpbench.use_loss(model, "liger")(**batch, use_cache=False)
    assert out.logits is None and EmulatedLigerLoss.calls == 1
    torch.testing.assert_close(out.loss.double(), want.double(), rtol=1e-6, atol=0)  # both in fp32 at the end
