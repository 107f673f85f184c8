"""Op-level selective recompute (cpbench/cp/recompute.py): what a recomputed layer keeps, that its gradients are the
unrecomputed ones, and that its backward runs fewer matmuls again than whole-layer recompute."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext
from transformers import AutoModelForCausalLM, Qwen2Config

import cpbench
from cpbench.cp.recompute import KEPT_ATTENTION, MATMULS, kept_attention, op_policy, recomputed
from tests.dist.models import make_batch, tiny_config

aten = torch.ops.aten
SAVE, RECOMPUTE = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE


def test_a_layer_keeps_its_attention_and_every_other_matmul():
    policy = op_policy()
    layer = [aten.mm.default, aten.add.Tensor, aten.addmm.default, aten._scaled_dot_product_flash_attention_for_cpu
             .default, aten.mm.default, aten.silu.default, aten.bmm.default, aten.mul.Tensor, aten.mm.default]
    assert [policy(None, op) for op in layer] == [SAVE, RECOMPUTE, RECOMPUTE, SAVE, SAVE, RECOMPUTE, RECOMPUTE,
                                                  RECOMPUTE, SAVE]
    assert op_policy()(None, aten.mm.default) == SAVE  # a new call (the next layer) counts from its first matmul
    assert {aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_cudnn_attention.default,
            aten._scaled_dot_product_efficient_attention.default} <= KEPT_ATTENTION
    assert aten.mm.default in MATMULS and aten.add.Tensor not in MATMULS | KEPT_ATTENTION
    assert KEPT_ATTENTION <= kept_attention()  # and flash-attn's ops, where that package is loaded


def test_float8_matmuls_and_flex_attention_are_kept_without_shifting_the_count():
    from torch._higher_order_ops.flex_attention import flex_attention

    policy = op_policy()
    layer = [aten.mm.default, aten._scaled_mm.default, flex_attention, aten._scaled_mm.default, aten.mm.default,
             aten.mm.default]
    assert [policy(None, op) for op in layer] == [SAVE, SAVE, SAVE, SAVE, RECOMPUTE, SAVE]
    assert flex_attention in kept_attention()


def test_a_recompute_that_asks_again_gets_the_forwards_answers():
    # torch before 2.13 asks the policy again while it recomputes, and hands kept outputs back first in, first out:
    # the recompute's answers must be the forward's, op for op, though the forward has counted its matmuls already
    policy = op_policy()
    layer = [aten.mm.default] * 7 + [aten.silu.default, aten._scaled_dot_product_flash_attention.default]
    forward = [policy(SelectiveCheckpointContext(is_recompute=False), op) for op in layer]
    again = [policy(SelectiveCheckpointContext(is_recompute=True), op) for op in layer]
    assert again == forward and forward[:7] == [SAVE, RECOMPUTE] * 3 + [SAVE]


def test_what_runs_under_recomputed_keeps_nothing_and_counts_no_matmul():
    policy = op_policy()
    with recomputed():  # the ring's tiles, a tiled MLP's tiles
        inside = [policy(None, op) for op in (aten.mm.default, aten._scaled_dot_product_flash_attention.default)]
    assert inside == [RECOMPUTE, RECOMPUTE]
    assert policy(None, aten.mm.default) == SAVE  # the layer's first matmul outside still counts as its first


class _Matmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in MATMULS
        return func(*args, **(kwargs or {}))


def _config(family: str):
    if family == "qwen2":  # biased q/k/v projections: addmm
        return Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    return tiny_config(family)


def _step(family: str, policy: str | None):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(family), dtype=torch.float32, attn_implementation="sdpa")
    if policy is not None:
        cpbench.use_recompute(model, policy)
    model.train()
    batch = make_batch("plain", seq_len=24)
    loss = model(**batch).loss
    counter = _Matmuls()
    with counter:
        loss.backward()
    return [p.grad for p in model.parameters()], counter.count


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_op_recompute_keeps_the_gradients_and_runs_fewer_matmuls_again(family):
    plain, matmuls = _step(family, None)
    # A layer makes 7 projections. Whole-layer recompute runs 6 again (torch's recompute stops once it has remade
    # every tensor the backward needs: the last, down's, output is none of them); "op" keeps the 1st, 3rd, 5th and
    # 7th and remakes the other 3.
    for policy, again in (("full", 6), ("op", 3)):
        grads, count = _step(family, policy)
        # the same kernels on the same inputs (fp32, CPU): recomputed values are the forward's, bit for bit
        assert all(torch.equal(g, h) for g, h in zip(grads, plain)), policy
        assert count - matmuls == again * 2, (policy, count, matmuls)  # 2 layers


def test_an_unknown_policy_is_refused_with_the_choices():
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), dtype=torch.float32)
    with pytest.raises(ValueError, match=r"policy='ops' is not one of full, op"):
        cpbench.use_recompute(model, "ops")


def test_plan_says_the_call_that_sets_the_policy():
    from cpbench.harness.project.commands import _model_calls

    row = {"activation_checkpointing": True, "offload_activations": True, "tiled_mlp": "off", "loss_mode": "full"}
    assert _model_calls({**row, "recompute_policy": "op"}) == ["cpbench.use_recompute(model, 'op', offload=True)"]
    assert _model_calls({**row, "recompute_policy": "full"}) == ["model.activation_checkpointing_enable(offload=True)"]


def test_the_sharded_reference_recomputes_whole_layers_with_the_eager_norm(monkeypatch):
    from cpbench.harness.measure import reference
    from cpbench.harness.suite.spec import load_suite

    (point,) = load_suite("t.toml", text='model = "tiny-qwen3"\nseq_lens = [64]\ncp_sizes = [2]\n'
                          'activation_checkpointing = true\nrecompute_policy = "op"\nnorm = "fused"\n').points()
    seen = []

    def distribute(model, ref_point, *args, **kwargs):
        seen.append(ref_point)
        raise StopIteration  # nothing past the point the reference is built from

    monkeypatch.setattr(reference.step, "distribute", distribute)
    with pytest.raises(StopIteration):
        reference._sharded_reference(point, "full", "cpu", 0)
    assert [(p.recompute_policy, p.activation_checkpointing, p.cp_size, p.norm) for p in seen] == [
        ("full", True, 1, "eager")]
