"""Model-level parity at cp=2 of cp_ring, cp_ring_zigzag and cp_ulysses with the unsharded model.

Loss, this rank's logits mapped to global positions, and every parameter gradient, for Qwen3, Llama, Mistral
(sliding_window=5) and Gemma3 (one sliding and one full layer), on plain, packed, left/right-padded, -100-label
and odd-length batches, with sdpa (and eager for Llama). One spawn runs every case: loading a tiny model and a
forward/backward take milliseconds, a spawn takes seconds.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist.models import GRAD_RTOL, LOGITS_ATOL, LOSS_RTOL

FAMILIES = ("qwen3", "llama", "mistral", "gemma3")
STYLES = ("cp_ring", "cp_ring_zigzag", "cp_ulysses")
KINDS = ("plain", "packed", "left_pad", "right_pad", "ignore_labels", "odd")
CP = 2


def configs():
    """(family, attn_implementation): every family with sdpa, and Llama with eager (an additive float mask)."""
    return [(f, "sdpa") for f in FAMILIES] + [("llama", "eager")]


def case_key(family, attn, style, kind) -> str:
    return f"{family}-{attn}-{style}-{kind}"


def batch_for(kind: str) -> dict:
    from tests.dist.models import make_batch

    return make_batch("plain", seq_len=15) if kind == "odd" else make_batch(kind)


def compare(model, batch: dict, ref: dict, layout_kind: str) -> dict:
    """`compare_layout` with the model's own layout of the forward (a zigzag one placed by the batch's documents),
    which must be of the style's kind."""
    errs = compare_layout(model, batch, ref)
    layout = model.cp_layout(batch["input_ids"].shape[1])
    assert (layout.kind, layout.cp_size) == (layout_kind, CP), layout
    return errs


def compare_layout(model, batch: dict, ref: dict, layout=None) -> dict:
    """Loss, logits and gradient errors of one CP forward/backward; `layout` defaults to the model's own."""
    import cpbench
    from tests.dist.models import full_grads, worst_grad_error

    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    layout = layout or model.cp_layout(batch["input_ids"].shape[1])
    logits = cpbench.gather_sequence(out.logits.detach(), layout, model.cp_group)
    # Logits are compared where a real token sits: a padded query attends to nothing, and what a backend puts
    # there (0 for sdpa and the ring, a uniform average for eager) feeds no loss and no gradient.
    real = batch.get("attention_mask", torch.ones_like(batch["input_ids"])).bool()
    grad, where = worst_grad_error(full_grads(model), ref["grads"])
    return {
        "loss": abs(out.loss.item() - ref["loss"].item()) / abs(ref["loss"].item()),
        "logits": (logits - ref["logits"])[real].abs().max().item(),
        "grad": grad,
        "grad_where": where,
    }


def models_worker(paths: dict) -> dict:
    from transformers import AutoModelForCausalLM

    import cpbench
    from tests.dist.models import reference

    results = {}
    for family, attn in configs():
        refs = {kind: reference(paths[family], batch_for(kind), attn) for kind in KINDS}
        for style in STYLES:
            model = AutoModelForCausalLM.from_pretrained(
                paths[family], attn_implementation=attn, dtype=torch.float32,
                distributed_config=cpbench.DistributedConfig(cp_size=CP, cp_plan={"model.layers.*.self_attn": style}),
            )
            layout_kind = cpbench.cp.STYLES.get(style).layout
            for kind in KINDS:
                results[case_key(family, attn, style, kind)] = compare(model, batch_for(kind), refs[kind], layout_kind)
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from tests.dist.models import save_tiny
    from tests.spawn import run_ranks

    root = tmp_path_factory.mktemp("ring_models")
    paths = {f: save_tiny(f, root / f) for f in FAMILIES}
    return run_ranks(models_worker, CP, paths, timeout=300)


CASES = [(f, a, s, k) for f, a in configs() for s in STYLES for k in KINDS]


@pytest.mark.parametrize("family,attn,style,kind", CASES)
def test_cp_matches_unsharded(results, family, attn, style, kind):
    for rank, per_rank in enumerate(results):
        errs = per_rank[case_key(family, attn, style, kind)]
        assert errs["loss"] <= LOSS_RTOL, f"rank {rank}: loss relative error {errs['loss']:.3g}"
        assert errs["logits"] <= LOGITS_ATOL, f"rank {rank}: logits error {errs['logits']:.3g}"
        assert errs["grad"] <= GRAD_RTOL, f"rank {rank}: gradient error {errs['grad']:.3g} in {errs['grad_where']}"
