"""`cpbench.use_loss(model, "chunked")` on real models against the unsharded full loss (fp32, gloo): the same loss
and gradients, no logits; on CP models (Ulysses, zigzag ring; tied and untied) and on a model without CP."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import cpbench
from tests.dist.cp_workers import _load
from tests.dist.models import full_grads, make_batch, reference, save_tiny, worst_grad_error
from tests.dist.test_cp_parity import check


def _chunked(model, batch, path, attn) -> dict:
    cpbench.use_loss(model, "chunked")
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    ref = reference(path, batch, attn)
    err, where = worst_grad_error(full_grads(model), ref["grads"])
    return {"loss": out.loss.item(), "ref_loss": ref["loss"].item(), "logits_err": 0.0, "grad_err": err,
            "grad_param": where, "logits_is_none": out.logits is None}


def worker(paths: dict, attn: str) -> dict:
    out = {}
    for tie, path in paths.items():
        for style in ("cp_ulysses", "cp_ring_zigzag"):
            model = _load(path, attn, cp_size=2, cp_plan={"model.layers.*.self_attn": style})
            for kind in (("plain", "left_pad") if tie == "tied" else ("plain",)):
                out[(tie, style, kind)] = _chunked(model, make_batch(kind), path, attn)
        plain = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn, dtype=torch.float32)
        out[(tie, "no-cp", "packed")] = _chunked(plain, make_batch("packed"), path, attn)
    # chosen before parallelize(): the CP wrapper keeps the choice
    torch.manual_seed(0)
    early = cpbench.use_loss(AutoModelForCausalLM.from_pretrained(paths["tied"], attn_implementation=attn,
                                                                  dtype=torch.float32), "chunked")
    early = cpbench.parallelize(early, cpbench.DistributedConfig(cp_size=2))
    out["early"] = early(**make_batch("plain")).logits is None
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from tests.spawn import run_ranks

    paths = {tie: save_tiny("qwen3", tmp_path_factory.mktemp(tie), tie_word_embeddings=(tie == "tied"))
             for tie in ("tied", "untied")}
    return run_ranks(worker, 2, paths, "sdpa")


def test_the_chunked_loss_matches_the_unsharded_full_loss(results):
    for rank_result in results:
        cases = [k for k in rank_result if k != "early"]
        assert len(cases) == 8
        for case in cases:
            check(rank_result[case])
            assert rank_result[case]["logits_is_none"], case


def test_use_loss_before_parallelize_is_kept(results):
    assert all(r["early"] for r in results)
