"""Parity: comparisons (NaN/inf are failures), dtype-derived tolerances, the reference cache key, and a point
that keeps its measurements when the parity work fails."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from cpbench.harness.measure import parity, reference
from cpbench.harness.run import worker
from cpbench.harness.suite import presets
from cpbench.harness.suite.spec import load_suite

SUITE = """
name = "t"
model = "tiny-qwen3"
seq_lens = [64]
cp_sizes = [1]
attn_implementations = ["sdpa"]
warmup_steps = 1
measured_steps = 1
parity = "full"
"""


def _summary(grads: dict[str, torch.Tensor], loss: float = 2.0, logits=None) -> dict:
    logits = torch.zeros(1, 4, 8) if logits is None else logits
    return {"loss": loss, "logits": logits, "grads": grads}


def _grads(**overrides):
    g = {"a.weight": torch.ones(10), "b.weight": torch.full((10,), 2.0), "c.weight": torch.full((10,), 3.0)}
    return {**g, **overrides}


def test_identical_summaries_pass():
    got = parity.compare(_summary(_grads()), _summary(_grads()), "float32", 2)
    assert got["parity_status"] == "pass" and got["grad_max_rel_err"] == 0.0


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_gradient_on_a_later_parameter_fails(bad):
    ours = _grads(**{"b.weight": torch.tensor([2.0] * 9 + [bad])})
    got = parity.compare(_summary(ours), _summary(_grads()), "float32", 2)
    assert got["parity_status"] == "fail", got
    assert got["grad_worst_param"] == "b.weight" and not got["grad_max_rel_err"] <= got["grad_rtol"]


def test_a_nan_projection_fails_in_projected_mode():
    def proj(grads):
        return {n: parity.summarize_grad(n, g, "projected", 0) for n, g in grads.items()}

    ours = proj(_grads(**{"c.weight": torch.tensor([math.nan] + [3.0] * 9)}))
    got = parity.compare(_summary(ours), _summary(proj(_grads())), "float32", 1)
    assert got["parity_status"] == "fail" and got["grad_worst_param"] == "c.weight"


def test_nan_loss_or_logits_fail():
    ref = _summary(_grads())
    assert parity.compare(_summary(_grads(), loss=math.nan), ref, "float32", 1)["parity_status"] == "fail"
    logits = torch.zeros(1, 4, 8)
    logits[0, 3, 5] = math.nan
    got = parity.compare(_summary(_grads(), logits=logits), ref, "float32", 1)
    assert got["parity_status"] == "fail" and "logits" in got["parity_detail"]


def test_tolerances_come_from_the_dtype_eps_and_grow_with_the_world():
    for dtype, torch_dtype in parity.DTYPES.items():
        tol = parity.tolerances(dtype, 1)
        unit = torch.finfo(torch_dtype).eps + parity.REDUCTION_DEPTH * torch.finfo(torch.float32).eps
        assert tol == pytest.approx({k: f * unit for k, f in parity.FACTORS.items()})
    fp32, bf16 = parity.tolerances("float32", 2), parity.tolerances("bfloat16", 2)
    assert all(fp32[k] < 1e-3 < bf16[k] < 0.5 for k in fp32)  # tight for fp32, loose only where bf16 rounds
    assert all(parity.tolerances("float32", 8)[k] > fp32[k] for k in fp32)


def _point(text: str = SUITE, **kw):
    return replace(load_suite("t.toml", text=text).points()[0], **kw)


def test_the_reference_cache_key_follows_the_resolved_config_not_the_preset_name(monkeypatch, tmp_path):
    point = _point()
    before = parity.cache_path(tmp_path, point, "full")
    assert parity.cache_path(tmp_path, point, "full") == before  # stable
    old = presets.PRESETS["tiny-qwen3"]
    monkeypatch.setitem(presets.PRESETS, "tiny-qwen3", replace(old, values={**old.values, "rms_norm_eps": 1e-5}))
    assert parity.cache_path(tmp_path, point, "full") != before  # same name, other model
    monkeypatch.setitem(presets.PRESETS, "tiny-qwen3", old)
    for change in ({"seq_len": 128}, {"batch_size": 2}, {"batch_kind": "packed"}, {"seed": 1},
                   {"dtype": "bfloat16"}, {"attn_implementation": "eager"}):
        assert parity.cache_path(tmp_path, replace(point, **change), "full") != before, change
    assert parity.cache_path(tmp_path, point, "projected") != before
    assert parity.cache_path(tmp_path, replace(point, cp_size=2, timeout_s=1.0), "full") == before  # not keyed


def _run(tmp_path, point=None):
    point = point or _point()
    return worker.run_point(point, rank=0, device=torch.device("cpu"), budget=None, cache_dir=tmp_path)


def test_a_point_passes_parity_against_its_own_reference(tmp_path):
    record = _run(tmp_path)
    assert record["status"] == "ok" and record["parity"]["parity_status"] == "pass", record["parity"]


def test_a_failing_capture_is_a_parity_error_and_the_measurements_stay(monkeypatch, tmp_path):
    def boom(*a, **k):
        raise RuntimeError("no room for the logits")

    monkeypatch.setattr(parity, "summarize_outputs", boom)
    record = _run(tmp_path)
    assert record["status"] == "ok" and record["peak_bytes"] > 0 and len(record["step_times_s"]) == 1
    assert record["parity"]["parity_status"] == "error"
    assert "no room for the logits" in record["parity"]["parity_detail"]


@pytest.mark.parametrize("exc,status", [(torch.OutOfMemoryError("reference too big"), "reference_oom"),
                                        (RuntimeError("reference broke"), "error")])
def test_a_failing_reference_keeps_the_measurements(monkeypatch, tmp_path, exc, status):
    def boom(*a, **k):
        raise exc

    monkeypatch.setattr(reference, "_reference", boom)
    record = _run(tmp_path)
    assert record["status"] == "ok" and record["peak_bytes"] > 0 and record["step_times_s"]
    assert record["parity"]["parity_status"] == status and str(exc) in record["parity"]["parity_detail"]


def test_the_parity_capture_does_not_change_the_memory_measured(tmp_path):
    """The capture runs between measured segments; what it keeps must not stay counted in later ones (at cp=1
    the logits and fp32 gradients it summarizes are the step's own tensors, so a reference would pin them)."""
    point = _point(seq_len=128, warmup_steps=1)
    keys = ("peak_bytes", "activations_bytes", "grads_bytes", "optimizer_bytes")
    measured = {mode: _run(tmp_path, replace(point, parity_mode=mode)) for mode in ("full", "projected", "off")}
    off = {k: measured["off"][k] for k in keys}
    assert {k: measured["full"][k] for k in keys} == off
    assert {k: measured["projected"][k] for k in keys} == off


def test_a_gradient_at_the_rounding_noise_is_judged_against_the_floor():
    """A key bias without rotary embeddings has a zero gradient: both sides hold rounding noise (biogpt: 2.5e-11
    beside gradients of order 1), which differs by 100 % and is no error. A small gradient above the floor is still
    held to its relative error, and a missing one still fails."""
    noise = _grads(**{"k.bias": torch.full((10,), 1e-12)})
    other_noise = _grads(**{"k.bias": torch.full((10,), -1e-12)})
    assert parity.compare(_summary(other_noise), _summary(noise), "float32", 2)["parity_status"] == "pass"
    small = _grads(**{"q.bias": torch.full((10,), 1e-4)})
    off = _grads(**{"q.bias": torch.full((10,), 1.03e-4)})
    got = parity.compare(_summary(off), _summary(small), "float32", 2)
    assert got["parity_status"] == "fail" and got["grad_worst_param"] == "q.bias"
    missing = {k: v for k, v in other_noise.items() if k != "k.bias"}
    assert parity.compare(_summary(missing), _summary(noise), "float32", 2)["parity_status"] == "fail"

    def proj(grads):
        return {n: parity.summarize_grad(n, g, "projected", 0) for n, g in grads.items()}

    assert parity.compare(_summary(proj(other_noise)), _summary(proj(noise)), "float32", 2)["parity_status"] == "pass"
    assert parity.compare(_summary(proj(off)), _summary(proj(small)), "float32", 2)["parity_status"] == "fail"
