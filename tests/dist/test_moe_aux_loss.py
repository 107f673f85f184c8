"""An MoE causal LM's router auxiliary loss under CP (cp/loss/router.py) against the unsharded run of the same
weights (fp32, gloo, 2 ranks): the loss (cross-entropy + coef x aux), `aux_loss` and every gradient, the router's
included, on the whole sequences, with the family's attention mask and without the layout's padding.

The default cases cover both styles, the three batch kinds (plain, packed, right-padded with a mask, at an odd length
so the layout pads the last rank's tail) and both losses, once each; one case backpropagates `aux_loss` alone, so the
router's gradient from the aux term is compared without the cross-entropy's beside it. granitemoe brings a logit
transform (`/ logits_scaling`) too, so its chunked case holds head.py's ops under CP. The full matrix (two families,
and activation checkpointing) is heavy.
Tolerances: tests/dist/models.py (fp32, the same sums in another order: loss 1e-5, gradients 1e-4 relative).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, GraniteMoeConfig, MixtralConfig, Qwen3MoeConfig

import cpbench
from tests.dist.models import GRAD_RTOL, LOSS_RTOL, VOCAB, full_grads, make_batch, worst_grad_error

ATTN = "sdpa"
MOE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, num_experts_per_tok=2,
           output_router_logits=True, router_aux_loss_coef=0.5)  # a large coef: the aux term is felt in every grad
CONFIGS = {
    "qwen3_moe": lambda: Qwen3MoeConfig(**MOE, head_dim=8, num_experts=4, moe_intermediate_size=16),
    "mixtral": lambda: MixtralConfig(**MOE, num_local_experts=4),
    "granitemoe": lambda: GraniteMoeConfig(**MOE, num_local_experts=4, logits_scaling=4.0),
}
KINDS = {"plain": 16, "packed": 16, "right_pad": 15}  # kind -> sequence length (15: the layout pads the tail)


def save_moe(family: str, path) -> str:
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(CONFIGS[family](), dtype=torch.float32).save_pretrained(path)
    return str(path)


def _objective(out, aux_only: bool) -> torch.Tensor:
    # aux alone, plus the loss times 0: a gradient (of zeros) still reaches every layer's output, where FSDP2's
    # pre-backward hooks gather the layer's weights (the router's among them) for its backward.
    return out.aux_loss + 0.0 * out.loss if aux_only else out.loss


def _reference(path: str, batch: dict, aux_only: bool) -> dict:
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=ATTN, dtype=torch.float32)
    out = model(**batch, use_cache=False)
    _objective(out, aux_only).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": out.loss.item(), "aux": out.aux_loss.item(), "grads": grads}


def _router_params(model) -> set[str]:
    from cpbench.cp.loss.router import RouterCapture

    routers = [module for module, _ in RouterCapture(model).sources]
    return {n for n, p in model.named_parameters() if any(p is q for m in routers for q in m.parameters())}


def _case(model, path: str, kind: str, loss: str, aux_only: bool = False) -> dict:
    batch = make_batch(kind, seq_len=KINDS[kind])
    cpbench.use_loss(model, loss)
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    _objective(out, aux_only).backward()
    grads = full_grads(model)
    ref = _reference(path, batch, aux_only)
    routers = _router_params(model)
    router_err, _ = worst_grad_error({n: grads[n] for n in routers}, {n: ref["grads"][n] for n in routers})
    grad_err, where = worst_grad_error(grads, ref["grads"])
    return {"loss": out.loss.item(), "ref_loss": ref["loss"], "aux": out.aux_loss.item(), "ref_aux": ref["aux"],
            "grad_err": grad_err, "grad_param": where, "router_err": router_err, "routers": sorted(routers),
            "router_logits_rows": [t.shape[0] for t in out.router_logits]}


def _model(path: str, style: str, recompute: bool):
    model = AutoModelForCausalLM.from_pretrained(
        path, attn_implementation=ATTN, dtype=torch.float32, distributed_config=cpbench.DistributedConfig(
            cp_size=2, cp_plan={"model.layers.*": "cp_split_sequence", "model.layers.*.self_attn": style}))
    if recompute:  # the router runs again in backward: the aux loss keeps the forward's router logits
        model.activation_checkpointing_enable()
        model.train()
    return model


def worker(paths: dict, cases: list[tuple]) -> dict:
    out, models = {}, {}
    for case in cases:
        family, style, kind, loss, aux_only, recompute = case
        if (family, style, recompute) not in models:
            models[family, style, recompute] = _model(paths[family], style, recompute)
        out[case] = _case(models[family, style, recompute], paths[family], kind, loss, aux_only)
    dist.barrier()
    return out


DEFAULT_CASES = [  # (family, style, batch kind, loss, backpropagate aux_loss alone, recompute)
    ("qwen3_moe", "cp_ulysses", "right_pad", "full", False, False),
    ("qwen3_moe", "cp_ulysses", "plain", "chunked", True, False),
    ("granitemoe", "cp_ring_zigzag", "packed", "chunked", False, False),
]
HEAVY_CASES = [(family, style, kind, loss, aux_only, False)
               for family in ("qwen3_moe", "mixtral") for style in ("cp_ulysses", "cp_ring_zigzag")
               for kind in KINDS for loss in ("full", "chunked") for aux_only in (False, True)]
HEAVY_CASES += [("qwen3_moe", style, "right_pad", loss, False, True)
                for style in ("cp_ulysses", "cp_ring_zigzag") for loss in ("full", "chunked")]


def _run(tmp_path_factory, cases):
    from tests.spawn import run_ranks

    paths = {f: save_moe(f, tmp_path_factory.mktemp(f)) for f in sorted({c[0] for c in cases})}
    return run_ranks(worker, 2, paths, cases)


def check(result: dict) -> None:
    assert result["routers"], result  # the router's weights are among the compared gradients
    assert abs(result["aux"] - result["ref_aux"]) <= LOSS_RTOL * abs(result["ref_aux"]), result
    assert abs(result["loss"] - result["ref_loss"]) <= LOSS_RTOL * abs(result["ref_loss"]), result
    assert result["grad_err"] <= GRAD_RTOL and result["router_err"] <= GRAD_RTOL, result


@pytest.fixture(scope="module")
def default_results(tmp_path_factory):
    return _run(tmp_path_factory, DEFAULT_CASES)


@pytest.mark.parametrize("case", DEFAULT_CASES, ids=lambda c: "-".join(map(str, c)))
def test_the_aux_loss_and_its_gradients_are_the_unsharded_ones(default_results, case):
    for rank_result in default_results:
        check(rank_result[case])


def test_router_logits_are_this_ranks_tokens(default_results):
    # 2 rows x 15 tokens, padded to 16 and cut in two: each rank's router sees 2 x 8 rows, padding included
    # (the aux loss leaves it out by the mask)
    for rank_result in default_results:
        assert rank_result[DEFAULT_CASES[0]]["router_logits_rows"] == [16, 16]


@pytest.mark.heavy
def test_the_whole_matrix(tmp_path_factory):
    results = _run(tmp_path_factory, HEAVY_CASES)
    for rank_result in results:
        for case in HEAVY_CASES:
            check(rank_result[case])
