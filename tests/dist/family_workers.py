"""Rank function of the family parity matrix: for each family, its tiny model (cpbench/cp/families/tiny.py) seeded alike on
every rank, the unsharded run of a copy of the same weights, then CP over the ranks with each style and batch kind.
Plain numbers come back; tests/dist/test_families.py asserts on them."""

from __future__ import annotations

import copy
import traceback

import torch
import torch.distributed as dist

import cpbench
from cpbench.cp.apply import model_cp_plan
from tests.dist.models import full_grads
from cpbench.cp.families.tiny import VOCAB, causal_lm_class, tiny_config

SEQ = 24  # tokens per row: 3 documents when packed, and not a multiple of 4 (zigzag pads it)


def batch(kind: str, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=g)
    out = {"input_ids": ids, "labels": ids.clone()}
    if kind == "packed":  # documents of 9, 6 and 9 tokens: position_ids restart where each begins
        out["position_ids"] = torch.cat([torch.arange(n) for n in (9, 6, 9)]).expand(2, -1).clone()
    return out


def _attn(model_class) -> str:
    return "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"


def _unsharded(model, data: dict) -> dict:
    out = model(**data, use_cache=False)
    out.loss.backward()
    return {"loss": out.loss.detach(), "logits": out.logits.detach(),
            "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}}


def worst_grad_error(grads: dict, ref: dict) -> tuple[float, str]:
    """The worst parameter's gradient error, relative to its own gradient's norm, or, where that gradient is tiny, to
    the norm an average parameter of its size has: a gradient that is zero in exact arithmetic (a key bias, which the
    softmax cancels) is rounding noise in both runs, and noise over noise says nothing."""
    if set(grads) != set(ref):
        return float("inf"), f"different parameters have gradients: {sorted(set(grads) ^ set(ref))}"
    total = torch.sqrt(sum(r.double().square().sum() for r in ref.values()))
    count = sum(r.numel() for r in ref.values())
    worst, where = 0.0, ""
    for name, g in grads.items():
        r = ref[name].double()
        scale = max(r.norm().item(), (total * (r.numel() / count) ** 0.5).item(), 1e-30)
        err = (g.double() - r).norm().item() / scale
        if err != err:
            return float("inf"), f"{name} (NaN)"
        if err > worst:
            worst, where = err, name
    return worst, where


def family_case(family: str, style: str, kind: str) -> dict:
    model_class = causal_lm_class(family)
    config = tiny_config(family)
    config._attn_implementation = _attn(model_class)
    torch.manual_seed(0)
    model = model_class(config).float()
    model.train()
    data = batch(kind)
    ref = _unsharded(copy.deepcopy(model), data)
    plan = {k: (v if v == "cp_split_sequence" else style) for k, v in model_cp_plan(model).items()}
    model = cpbench.parallelize(model, cpbench.DistributedConfig(cp_size=dist.get_world_size(), cp_plan=plan))
    out = model(**data)
    out.loss.backward()
    grad_err, grad_param = worst_grad_error(full_grads(model), ref["grads"])
    logits = cpbench.gather_sequence(out.logits.detach(), model.cp_layout(SEQ), model.cp_group)
    return {"loss": out.loss.item(), "ref_loss": ref["loss"].item(), "grad_err": grad_err, "grad_param": grad_param,
            "logits_err": (logits - ref["logits"]).abs().max().item(), "attn": config._attn_implementation}


def families_worker(cases: list[tuple[str, str, str]]) -> dict:
    """Every (family, style, kind) in one process group; a case that raises is reported with its error, and the
    ranks stay in step (every rank runs every case, and a failing case fails on every rank alike)."""
    from cpbench.cp.hf_compat import init_distributed

    init_distributed()
    results = {}
    for case in cases:
        try:
            results[case] = family_case(*case)
        except Exception as e:  # noqa: BLE001 - recorded: the test names the case and its error
            results[case] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-1500:]}
        dist.barrier()
    return results
