"""What a family's head does after its output projection (cp/loss/head.py, read by cp/loss/family.py), redone by the
chunked and Liger losses; and the MoE router auxiliary loss without a process group (cp/loss/router.py).

One process, fp32, each family's tiny model against its own forward's loss: the chunked loss must give the same
loss and gradients (fp32, the same sums in another order: loss 1e-5, gradients 1e-4 relative; tests/dist/models.py).
The multi-rank cases (the aux loss over the cp group, a logit transform under CP) are tests/dist/test_moe_aux_loss.py.
"""

from __future__ import annotations

import ast
import copy
import inspect
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM

import cpbench
from cpbench.cp.layout import SequenceLayout
from cpbench.cp.loss.chunked import chunked_cross_entropy_sum
from cpbench.cp.loss.head import logit_ops
from cpbench.cp.loss.liger import liger_cross_entropy_sum, liger_form
from cpbench.cp.loss.router import local_token_mask
from tests.dist.models import GRAD_RTOL, LOSS_RTOL, VOCAB, make_batch, worst_grad_error

COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, pad_token_id=0,
              bos_token_id=1, eos_token_id=2)
MOE = dict(num_experts_per_tok=2, output_router_logits=True)
# family -> (config overrides, the ops its forward applies to the projection's output); a bias is the module's own
FAMILIES = {
    "cohere": (dict(logit_scale=0.25), (("mul", 0.25),)),
    "granite": (dict(logits_scaling=4.0), (("div", 4.0),)),
    "hyperclovax": (dict(logits_scaling=0.5), (("mul", 0.5),)),
    "gemma2": (dict(final_logit_softcapping=3.0, head_dim=8), (("div", 3.0), ("tanh", None), ("mul", 3.0))),
    "recurrent_gemma": (dict(logits_soft_cap=3.0, head_dim=8, lru_width=32, attention_window_size=8,
                             block_types=["recurrent", "attention"]), (("div", 3.0), ("tanh", None), ("mul", 3.0))),
    "phi": ({}, ()),  # lm_head has a bias
    "ctrl": (dict(n_embd=32, n_layer=2, n_head=4, dff=64), ()),  # lm_head has a bias
    "modernbert-decoder": ({}, ()),  # logits = self.decoder(self.lm_head(h)): the decoder (with a bias) projects
    "granitemoe": (dict(num_local_experts=4, logits_scaling=4.0, router_aux_loss_coef=0.5, **MOE), (("div", 4.0),)),
    "jetmoe": (dict(num_local_experts=4, kv_channels=8, aux_loss_coef=0.5, **MOE), ()),  # aux_loss_coef, MoA router
}


def tiny(family: str, **extra):
    torch.manual_seed(0)
    config = AutoConfig.for_model(family, **{**COMMON, **FAMILIES.get(family, ({}, ()))[0], **extra})
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()


def _loss_and_grads(model, batch):
    out = model(**batch, use_cache=False)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


@pytest.mark.parametrize("family", FAMILIES)
def test_the_chunked_loss_is_the_familys_own(family):
    model = tiny(family)
    assert logit_ops(model, "chunked") == FAMILIES[family][1]
    batch = make_batch("right_pad", seq_len=12)
    want, want_grads = _loss_and_grads(copy.deepcopy(model), batch)
    got, grads = _loss_and_grads(cpbench.use_loss(model, "chunked"), batch)
    assert got.logits is None
    assert abs(got.loss.item() - want.loss.item()) <= LOSS_RTOL * abs(want.loss.item())
    err, where = worst_grad_error(grads, want_grads)
    assert err <= GRAD_RTOL, (err, where)
    if getattr(want, "aux_loss", None) is not None:  # without CP the aux loss is the family's, mask and all
        assert abs(got.aux_loss.item() - want.aux_loss.item()) <= LOSS_RTOL * abs(want.aux_loss.item())


def test_a_transform_matters_to_the_loss():
    """The test above would catch a dropped transform: without cohere's scale the loss is another number."""
    model = tiny("cohere")
    hidden = torch.randn(1, 6, 32)
    targets = torch.randint(0, VOCAB, (1, 6))
    kept = chunked_cross_entropy_sum(hidden, model.lm_head.weight, targets, ops=logit_ops(model, "chunked"))
    dropped = chunked_cross_entropy_sum(hidden, model.lm_head.weight, targets)
    assert abs(kept - dropped) > 1e-3 * abs(dropped)


class SlicedHeadLlama(LlamaForCausalLM):
    """A head cpbench cannot redo: the vocabulary cut after the projection (as inkling's `unpadded_vocab_size`)."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        hidden_states = self.model(input_ids=input_ids, **kwargs).last_hidden_state
        logits = self.lm_head(hidden_states)
        logits = logits[..., :50]
        return self.loss_function(logits, labels, 50)


def test_a_head_it_cannot_redo_is_refused_with_the_statement():
    from tests.dist.models import tiny_config

    model = cpbench.use_loss(SlicedHeadLlama(tiny_config("llama")), "chunked")
    batch = make_batch("plain")
    refusal = r"loss='chunked'.*`logits = logits\[\.\.\., :50\]`.*use_loss\(model, 'full'\)"
    with pytest.raises(ValueError, match=refusal):
        model(**batch)


def test_a_projection_inside_another_module_is_refused():
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "bert", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        is_decoder=True))
    with pytest.raises(ValueError, match=r"output projection `cls\.predictions\.decoder` runs inside `self\.cls`"):
        logit_ops(model, "chunked")


@pytest.fixture
def fake_liger(monkeypatch):
    """Liger's loss module as its forward computes it (bias and soft-cap included), for the glue on CPU."""

    class Emulated(torch.nn.Module):
        def __init__(self, ignore_index=-100, reduction="mean", softcap=None):
            super().__init__()
            self.ignore_index, self.reduction, self.softcap = ignore_index, reduction, softcap

        def forward(self, lin_weight, _input, target, bias=None):
            logits = F.linear(_input, lin_weight, bias).float()
            if self.softcap:
                logits = torch.tanh(logits / self.softcap) * self.softcap
            return F.cross_entropy(logits, target, ignore_index=self.ignore_index, reduction=self.reduction)

    package, sub = types.ModuleType("liger_kernel"), types.ModuleType("liger_kernel.transformers")
    sub.LigerFusedLinearCrossEntropyLoss = Emulated
    package.transformers = sub
    monkeypatch.setitem(sys.modules, "liger_kernel", package)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", sub)


@pytest.mark.parametrize("ops", [(("mul", 0.25),), (("div", 4.0),), (("div", 0.5), ("div", 3.0), ("tanh", None),
                                                                       ("mul", 3.0))], ids=["mul", "div", "scale+cap"])
def test_liger_folds_a_scale_into_its_input_and_bias(fake_liger, ops):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 9, 16, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(40, 16, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(40, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 40, (2, 9), generator=g)
    targets[0, :3] = -100
    got = liger_cross_entropy_sum(hidden, weight, targets, bias_v=bias, ops=ops)
    want = chunked_cross_entropy_sum(hidden, weight, targets, bias_v=bias, ops=ops, chunk_bytes=4 * 40 * 5)
    # fp64 in, fp32 logits on both sides, the scale applied before the projection here and after it there
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
    inputs = (hidden, weight, bias)
    for a, b in zip(torch.autograd.grad(got, inputs), torch.autograd.grad(want, inputs)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_liger_refuses_ops_it_has_no_form_for():
    with pytest.raises(ValueError, match=r"loss='liger'.*Use loss='chunked'"):
        liger_form((("tanh", None),))


def test_a_family_with_another_aux_loss_is_refused_by_name():
    config = AutoConfig.for_model("doge", **{**COMMON, "is_moe": True, "num_experts": 4, **MOE, "keep_window_size": 4})
    model = cpbench.use_loss(AutoModelForCausalLM.from_config(config), "full")
    batch = make_batch("plain", seq_len=8)
    with pytest.raises(ValueError, match=r"output_router_logits=True: doge .*Pass output_router_logits=False"):
        model(**batch)
    assert model(**batch, output_router_logits=False).aux_loss is None  # the fix works


def test_the_aux_mask_is_this_ranks_slice_without_the_layout_padding():
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1]])
    layout = SequenceLayout(seq_len=7, cp_size=2, rank=1, kind="zigzag")  # chunks 1 and 2 of 4 (2 tokens each)
    assert local_token_mask(mask, layout, 2, "cpu").tolist() == [1, 1, 1, 0, 1, 1, 1, 1]
    last = SequenceLayout(seq_len=7, cp_size=2, rank=1)  # positions 4..7, 7 is the layout's padding
    assert local_token_mask(None, last, 1, "cpu").tolist() == [1, 1, 1, 0]
    with pytest.raises(ValueError, match=r"attention_mask of shape \(1, 1, 7, 7\).*2-D padding mask \[batch, 7\]"):
        local_token_mask(torch.ones(1, 1, 7, 7), layout, 1, "cpu")


@pytest.mark.filterwarnings("ignore:`enable_expert_parallel`:FutureWarning")
def test_expert_parallel_with_cp_is_refused():
    with pytest.raises(ValueError, match=r"`ep_size=2` together with `cp_size=2`.*Set `ep_size=1` or `cp_size=1`"):
        cpbench.DistributedConfig(cp_size=2, fsdp_size=2, ep_size=2)
    with pytest.raises(ValueError, match=r"`enable_expert_parallel=True` together with `cp_size=2`.*never expert-"):
        cpbench.DistributedConfig(cp_size=2, enable_expert_parallel=True)
    assert cpbench.DistributedConfig(cp_size=1, enable_expert_parallel=True).cp_size == 1  # transformers' own rules


@pytest.mark.heavy
def test_every_causal_lm_head_is_redone_or_refused():
    """Every causal-LM class transformers ships, read by family.py: the transforms found, and the refusals."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from cpbench.cp.loss.family import head_form, router_aux_form

    found, aux = {}, {}
    for model_type, name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        cls = getattr(transformers, name)
        head = "lm_head"
        if "get_output_embeddings" in cls.__dict__:  # the attribute it returns, e.g. `self.decoder`
            head = inspect.getsource(cls.get_output_embeddings).strip().splitlines()[-1].split("self.")[-1].strip()
        form = head_form(cls, head)
        found[model_type] = "refused" if form.unknown else tuple(s[0] for s in form.steps)
        if (aux_form := router_aux_form(cls)) is not None:
            aux[model_type] = "refused" if aux_form.unknown else ast.unparse(aux_form.coef)
    transformed = {k: v for k, v in found.items() if v not in ((), "refused")}
    assert transformed == {
        **dict.fromkeys(["cohere", "cohere2", "cohere2_moe", "cohere_compass_text", "falcon_h1", "hyperclovax"],
                        ("mul",)),
        **dict.fromkeys(["granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoehybrid",
                         "granitemoeshared"], ("div",)),
        **dict.fromkeys(["beam", "gemma2", "gemma3_text", "gemma3n_text", "gemma4_text", "gemma4_unified_text",
                         "nanochat", "vaultgemma", "gemma3n", "gemma4", "gemma4_unified"], ("if_set",)),
        "recurrent_gemma": ("let", "div", "tanh", "mul"),
    }
    refused = sorted(k for k, v in found.items() if v == "refused")
    assert {"inkling_text", "inkling2_text", "xlstm", "gemma4_assistant", "musicgen", "bert", "roberta"} <= set(refused)
    # the MoE families' aux losses: every one the Switch form (jetmoe's coefficient under its own name), but doge's
    assert {k for k, v in aux.items() if v == "refused"} == {"doge"}
    assert aux["jetmoe"] == "self.aux_loss_coef" and aux["mixtral"] == aux["qwen3_moe"] == "self.router_aux_loss_coef"
    assert len(aux) >= 28
