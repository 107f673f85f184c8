"""The fused RMSNorm (cpbench/cp/fused/norm.py): the eager norm's values, one op each way, less memory kept for the
backward, and every model it cannot fuse refused with its classes named."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import cpbench
from cpbench.cp.fused.norm import fusion_problem, rms_norm
from tests.dist.models import make_batch, tiny_config


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


class _Holder(torch.nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.norm = norm


def _pair(width: int, dtype, eps: float = 1e-6):
    eager = LlamaRMSNorm(width, eps=eps).to(dtype)
    eager.weight.data = torch.randn(width).to(dtype)
    fused = copy.deepcopy(eager)
    cpbench.use_fused_norm(_Holder(fused))
    return eager, fused


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 7), width=st.sampled_from([8, 24, 64, 96]), dtype=st.sampled_from(["float32", "bfloat16"]),
       eps=st.sampled_from([1e-6, 1e-5]), scale=st.sampled_from([1e-3, 1.0, 30.0]), seed=st.integers(0, 2**16))
def test_the_fused_norm_gives_the_eager_norms_values_and_gradients(rows, width, dtype, eps, scale, seed):
    dtype = getattr(torch, dtype)
    torch.manual_seed(seed)
    eager, fused = _pair(width, dtype, eps)
    x = (torch.randn(2, rows, width) * scale).to(dtype).requires_grad_()
    y = x.detach().clone().requires_grad_()
    a, b = eager(x), fused(y)
    # On the CPU the forward is the eager norm's own arithmetic in its order: bit for bit
    assert a.dtype == b.dtype and torch.equal(a, b)
    grad = torch.randn_like(a)
    a.backward(grad)
    b.backward(grad)
    # The backward is the analytic gradient, not autograd's chain: the same fp32 terms summed in another order, so
    # each input gradient is within a few fp32 roundings of a row's largest (bf16: the one cast back, then equal)
    tol = dict(rtol=0, atol=1e-5 * float(x.grad.abs().max())) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(y.grad, x.grad, **tol)
    torch.testing.assert_close(fused.weight.grad, eager.weight.grad, rtol=1e-5, atol=1e-6)


def test_a_trace_sees_one_op_each_way_and_the_eager_norm_ten():
    counts = {}
    for name, norm in zip(("eager", "fused"), _pair(32, torch.float32)):
        x = torch.randn(4, 32, requires_grad=True)
        with _Ops() as ops:
            norm(x).sum().backward()
        counts[name] = [n for n in ops.names if n not in ("aten.ones_like", "aten.sum", "aten.expand")]
    assert [n for n in counts["fused"] if n.startswith("cpbench.")] == ["cpbench.rms_norm", "cpbench.rms_norm_backward"]
    assert {n for n in counts["fused"] if n.startswith("aten.")} <= {"aten.detach", "aten.clone"}  # views, and the
    # weight's gradient accumulated
    assert len(counts["eager"]) >= 10, counts["eager"]


def _saved_bytes(norm, x) -> int:
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        norm(x)
    return total


def test_the_fused_norm_keeps_its_input_and_a_statistic_a_row():
    eager, fused = _pair(64, torch.bfloat16)
    x = torch.randn(16, 64, dtype=torch.bfloat16, requires_grad=True)
    kept = _saved_bytes(fused, x)
    assert kept == x.numel() * 2 + 64 * 2 + 16 * 4  # the input, the weight, one fp32 rstd a row
    assert _saved_bytes(eager, x) > 2 * kept  # the eager norm keeps fp32 copies of the whole input


def test_a_model_runs_the_fused_ops_and_keeps_its_loss():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3"), dtype=torch.float32, attn_implementation="sdpa")
    batch = make_batch("plain", seq_len=24)
    eager = model(**batch).loss
    cpbench.use_fused_norm(model)
    cpbench.use_fused_norm(model)  # again: nothing more
    with _Ops() as ops:
        fused = model(**batch).loss
    # 2 layers x (2 layer norms + q_norm + k_norm) + the final norm
    assert ops.names.count("cpbench.rms_norm") == 2 * 4 + 1
    assert torch.equal(eager, fused)
    assert fusion_problem(model) is None


@pytest.mark.parametrize("case", ["contiguous", "transposed", "fp32_weight"])
def test_the_ops_keep_torchs_custom_op_contract(case):
    """torch.library.opcheck: the fake (what a projection traces) gives the real outputs' shapes, dtypes and strides,
    the autograd registration is sound, and the ops survive being traced (dynamo, AOT)."""
    torch.manual_seed(0)
    x = torch.randn(6, 4, 16, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(16, dtype=torch.float32 if case == "fp32_weight" else torch.bfloat16, requires_grad=True)
    if case == "transposed":
        x = x.detach().transpose(0, 1).requires_grad_()
    torch.library.opcheck(torch.ops.cpbench.rms_norm.default, (x, w, 1e-6))
    out, rstd = rms_norm(x, w, 1e-6)
    grad = torch.randn_like(out)
    torch.library.opcheck(torch.ops.cpbench.rms_norm_backward.default, (grad, x.detach(), w.detach(), rstd.detach()))
    assert not rstd.requires_grad  # the statistic is no differentiable output


def test_a_model_with_another_rmsnorm_is_refused_with_its_classes():
    model = AutoModelForCausalLM.from_config(tiny_config("gemma3"))
    with pytest.raises(ValueError, match="Gemma3RMSNorm.*leave norm = 'eager'"):
        cpbench.use_fused_norm(model)
    with pytest.raises(ValueError, match="no RMSNorm module"):
        cpbench.use_fused_norm(torch.nn.Linear(2, 2))


def test_the_fused_norm_goes_before_the_tiled_mlp():
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    cpbench.use_tiled_mlp(model, 2)
    with pytest.raises(ValueError, match="post_attention_layernorm.*use_tiled_mlp.*call cpbench.use_fused_norm first"):
        cpbench.use_fused_norm(model)
    # refused before anything changed: no norm of the model was fused
    assert not any(getattr(m, "_cpbench_fused_norm", False) for m in model.modules())


def test_torchs_fused_forward_agrees_with_the_cpu_arithmetic_to_one_rounding():
    """The CUDA path calls aten._fused_rms_norm, which applies the weight before its one cast back; on the CPU torch
    decomposes the same op, so its values can be set beside the eager order here: equal in fp32 terms, a bf16 output
    one rounding apart at most."""
    torch.manual_seed(1)
    x, w = torch.randn(8, 64, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16)
    theirs, rstd = torch.ops.aten._fused_rms_norm(x, [64], w, 1e-6)
    ours, our_rstd = rms_norm(x, w, 1e-6)
    torch.testing.assert_close(our_rstd.view(-1), rstd.view(-1).float(), rtol=1e-6, atol=0)
    ulp = torch.finfo(torch.bfloat16).eps * theirs.float().abs()
    assert bool(((ours.float() - theirs.float()).abs() <= 2 * ulp + 1e-30).all())


def test_the_cuda_branch_called_as_torchs_own_reference_of_its_kernels(monkeypatch):
    """The CUDA branch hands torch's fused kernels (aten/src/ATen/native/cuda/layer_norm_kernel.cu:
    `_fused_rms_norm_cuda`, `_fused_rms_norm_backward_cuda`) the normalized shape as the last dim, the forward's
    statistic back as `[..., 1]`, and asks for both gradients. No CUDA here: the calls are run through torch's own
    reference of those kernels (torch/_decomp/decompositions.py `_fused_rms_norm` and `_fused_rms_norm_backward`,
    which torch's CPU build runs for the forward and which inductor lowers them to), with the branch taken as on a GPU:
    values within the one rounding the kernels' weight-before-cast order differs by."""
    from torch._decomp.decompositions import _fused_rms_norm_backward

    from cpbench.cp.fused import norm

    monkeypatch.setattr(norm, "_torch_kernel", lambda x, w: True)
    monkeypatch.setattr(torch.ops.aten, "_fused_rms_norm_backward", _fused_rms_norm_backward)
    torch.manual_seed(2)
    eager, fused = _pair(48, torch.bfloat16)
    x = torch.randn(3, 5, 48, dtype=torch.bfloat16, requires_grad=True)
    y = x.detach().clone().requires_grad_()
    a, b = eager(x), fused(y)
    grad = torch.randn_like(a)
    a.backward(grad)
    b.backward(grad)
    bf16 = dict(rtol=2 * torch.finfo(torch.bfloat16).eps, atol=1e-2)
    torch.testing.assert_close(b, a, **bf16)
    torch.testing.assert_close(y.grad, x.grad, **bf16)
    torch.testing.assert_close(fused.weight.grad.float(), eager.weight.grad.float(), rtol=2e-2, atol=5e-2)


def test_a_fused_norm_point_runs_the_fused_ops_in_its_step():
    """The suite field reaches the step: a point with norm = "fused" distributes its model with every norm fused (and
    an eager point with none), so what a sweep measures and a projection traces is the fused norm."""
    from cpbench.harness.measure import step
    from cpbench.harness.suite.spec import load_suite

    text = 'model = "tiny-llama"\nseq_lens = [64]\ncp_sizes = [1]\nactivation_checkpointing = true\ntiled_mlp = 2\n'
    counts = {}
    for norm in ("eager", "fused"):
        (point,) = load_suite("t.toml", text=text + f'norm = "{norm}"\n').points()
        model = step.distribute(step.build_model(point, "cpu"), point)
        model.train()
        batch = step.make_batch(point, model.config.vocab_size, "cpu")
        with _Ops() as ops:
            model(**batch).loss.backward()
        counts[norm] = (ops.names.count("cpbench.rms_norm"), ops.names.count("cpbench.rms_norm_backward"))
    layers = model.config.num_hidden_layers
    # every layer's two norms and the final one, each forward again in its layer's recompute (the MLP's norm inside
    # the tiled MLP's tiles: once a tile, twice over with the tile's own recompute)
    assert counts["eager"] == (0, 0)
    forwards, backwards = counts["fused"]
    assert backwards == 2 * layers + 1 + layers  # the tiled norm: one backward a tile (2 tiles), the other norm one
    assert forwards > backwards
