"""FSDP2 mixed precision under CP (`DistributedConfig(fsdp_mixed_precision=True)`, the suite's `mixed_precision`):
fp32 master weights, gradients and optimizer state, bf16 compute, fp32 gradient reduction. At cp = 2 (FSDP over
the two cp ranks, gloo) the step must equal the unsharded run of the same weights cast to bf16 (what FSDP2 casts
them to for every forward), within bf16's parity tolerance (`cpbench.harness.measure.parity.tolerances`)."""

from __future__ import annotations

import pytest
import torch

from tests.dist.models import full_grads, make_batch, save_tiny, worst_grad_error

STYLES = ["cp_ulysses", "cp_ring_zigzag"]


def worker(path: str) -> dict:
    from transformers import AutoModelForCausalLM

    import cpbench

    batch = make_batch("packed")
    ref = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32)
    ref = ref.to(torch.bfloat16)
    ref_out = ref(**batch, use_cache=False)
    ref_out.loss.backward()
    ref_grads = {n: p.grad.float() for n, p in ref.named_parameters()}
    out = {}
    for style in STYLES:
        model = AutoModelForCausalLM.from_pretrained(
            path, attn_implementation="sdpa", dtype=torch.float32,
            distributed_config=cpbench.DistributedConfig(
                cp_size=2, fsdp_mixed_precision=True, cp_plan={"model.layers.*.self_attn": style}),
        )
        result = model(**batch, use_cache=False)
        result.loss.backward()
        grads = full_grads(model)
        err, where = worst_grad_error(grads, ref_grads)
        out[style] = {
            "loss": result.loss.item(), "ref_loss": ref_out.loss.item(), "grad_err": err, "grad_param": where,
            "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            "grad_dtypes": sorted({str(g.dtype) for g in grads.values()}),
            "logits_dtype": str(result.logits.dtype),
        }
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from tests.spawn import run_ranks

    path = save_tiny("qwen3", tmp_path_factory.mktemp("qwen3"), tie_word_embeddings=True)
    return run_ranks(worker, 2, path)


@pytest.mark.parametrize("style", STYLES)
def test_mixed_precision_keeps_fp32_masters_computes_bf16_and_matches_the_bf16_run(results, style):
    from cpbench.harness.measure.parity import tolerances

    tol = tolerances("bfloat16", 2)
    for rank_result in results:
        r = rank_result[style]
        assert r["param_dtypes"] == ["torch.float32"] and r["grad_dtypes"] == ["torch.float32"], r
        assert r["logits_dtype"] == "torch.bfloat16", r  # the forward ran in bf16
        assert abs(r["loss"] - r["ref_loss"]) <= tol["loss_rtol"] * abs(r["ref_loss"]), r
        assert r["grad_err"] <= tol["grad_rtol"], r
