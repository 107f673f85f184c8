"""Parity across the model families CP serves (cpbench/cp/families/audit.toml): each family's tiny model
(cpbench/cp/families/tiny.py: its own config class, shrunk, its features on) at cp 2 with Ulysses and the zigzag ring,
plain and packed batches, against the unsharded run of the same weights: the loss (the router's aux loss included
where the family has one), the gathered logits and every gradient.

The default test command runs a sample that covers what the families bring (dense, MoE with its aux loss, sinks,
multi-head latent attention, sliding/full layers with soft-capping, an own plan, learned positions, a layer that drops
its kwargs); every family runs opt-in (`-m heavy`, .ci/run). fp32 tolerances: tests/dist/models.py; the gradient
error of a parameter whose gradient is zero in exact arithmetic is measured against an average parameter's
(family_workers.worst_grad_error).
"""

from __future__ import annotations

import pytest

from cpbench.cp.families import table
from tests.dist.family_workers import families_worker
from tests.dist.models import GRAD_RTOL, LOGITS_ATOL, LOSS_RTOL
from tests.spawn import run_ranks

STYLES = ("cp_ulysses", "cp_ring_zigzag")
KINDS = ("plain", "packed")
SAMPLE = ("llama", "qwen3_moe", "gpt_oss", "deepseek_v3", "gemma2", "gpt_neox", "opt", "nemotron")


def _run(families) -> dict:
    cases = [(f, s, k) for f in families for s in STYLES for k in KINDS]
    return run_ranks(families_worker, 2, cases, timeout=60 + 20 * len(cases))


def _check(results: dict) -> None:
    failed = []
    for case, r in results.items():
        if "error" in r:
            failed.append(f"{case}: {r['error']}")
        elif not (abs(r["loss"] - r["ref_loss"]) <= LOSS_RTOL * abs(r["ref_loss"]) and r["logits_err"] <= LOGITS_ATOL
                  and r["grad_err"] <= GRAD_RTOL):
            failed.append(f"{case}: loss {r['loss']} vs {r['ref_loss']}, logits {r['logits_err']:.2e}, "
                          f"grad {r['grad_err']:.2e} ({r['grad_param']})")
    assert not failed, "\n".join(failed)


@pytest.fixture(scope="module")
def sample():
    return run_ranks(families_worker, 2, [(f, s, k) for f in SAMPLE for s in STYLES for k in KINDS], timeout=600)


def test_a_sample_of_the_families_matches_the_unsharded_run(sample):
    for rank in sample:
        _check(rank)


def test_the_sample_brings_what_the_families_bring():
    features = {f for name in SAMPLE for f in table.family(name).features}
    assert {"moe", "router_aux_loss", "sinks", "mla", "sliding_window", "attention_softcap", "final_softcap",
            "learned_positions", "partial_rotary"} <= features
    assert {table.family(name).verdict for name in SAMPLE} == {"default", "own"}


@pytest.mark.heavy
@pytest.mark.parametrize("chunk", range(6))
def test_every_supported_family_matches_the_unsharded_run(chunk):
    families = table.supported()[chunk::6]
    for rank in _run(families):
        _check(rank)
