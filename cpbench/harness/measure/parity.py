"""Parity: the point's first step against an unsharded run of the same weights and batch.

Both sides are reduced to the same *summary* by the same code: the loss, the logits (all positions in `full`
mode; 64 seeded positions in `projected` mode) and, per parameter, the whole gradient (`full`) or its norm and
four seeded random projections (`projected`: a Johnson-Lindenstrauss sketch, so the relative error of the
projections estimates the relative error of the gradient while nothing model-sized is stored). The reference
summary is computed once per (model, length, dtype, backend, batch, device, mode) and cached on disk.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import zlib
from pathlib import Path

import torch

FULL_MODE_MAX_PARAMS = 50_000_000  # `auto` compares whole gradients below this, projections above
NUM_PROJECTIONS = 4
NUM_LOGIT_POSITIONS = 64
_CHUNK = 1 << 24

# Tolerances, derived from the dtype. CP computes the same sums as the unsharded run in another order
# (per-block softmax, per-rank partial sums, all-reduces), so the two differ by rounding only, in two parts:
# - each op's output is rounded to the dtype once: a few units of torch.finfo(dtype).eps;
# - the reductions (matmuls, softmax sums, cross-rank sums) accumulate in fp32 whatever the dtype, so their
#   error is fp32's eps times the reduction depth: REDUCTION_DEPTH stands for that depth (a few tens of
#   effective terms, since rounding errors of long sums partly cancel).
# For fp32 the second part dominates (33 eps), for bf16/fp16 the first (the fp32 part is ~1e-3 of it).
# FACTORS scale that unit per quantity: the loss is a mean over every token (errors average out); a logit
# is one value of the last layer (every layer's rounding reaches it); a gradient's relative error is a norm
# over a whole parameter. Each doubling of the world adds a reduction level (`world_scale`).
# Observed on the default CPU suite (fp32, world 2): loss <= 1.8e-7, logits <= 4.2e-7, grads <= 6.1e-7, i.e.
# >= 25x below these tolerances; a dropped mask or a wrong slice errs by > 1e-2. For bf16 they give 2.3e-2,
# 1.6e-1 and 6.3e-2 (x world_scale): about the hand-set bf16 values they replace (2e-2, 1.5e-1, 5e-2).
# A gradient's relative error has a floor: a parameter whose true gradient is zero holds only rounding noise on either
# side (a key projection's bias without rotary embeddings shifts every score of a query by one constant, which the
# softmax removes: biogpt's and ctrl's are 2.5e-11 in fp32 and 4e-20 in fp64, next to gradients of order 1), and noise
# against noise is no error. A gradient's rounding is that of the terms summed into it, so the floor is the unit
# above times the largest gradient norm of the model: a parameter under it is judged by its absolute error over the
# floor. A wrong gradient of a parameter above the floor (q_proj's bias there, 1e-4) still errs by far more.
REDUCTION_DEPTH = 32
FACTORS = {"loss_rtol": 3.0, "logits_atol": 20.0, "grad_rtol": 8.0}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def world_scale(world_size: int) -> float:
    return 1.0 + math.log2(max(1, world_size)) / 2


def rounding_unit(dtype: str) -> float:
    return torch.finfo(DTYPES[dtype]).eps + REDUCTION_DEPTH * torch.finfo(torch.float32).eps


def tolerances(dtype: str, world_size: int) -> dict[str, float]:
    """`FACTORS` x (eps(dtype) + REDUCTION_DEPTH x eps(fp32)) x world_scale (see the comment above)."""
    return {k: f * rounding_unit(dtype) * world_scale(world_size) for k, f in FACTORS.items()}


def resolve_mode(mode: str, num_params: int) -> str:
    if mode == "auto":
        return "full" if num_params <= FULL_MODE_MAX_PARAMS else "projected"
    return mode


def logit_positions(seq_len: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 7)
    n = min(seq_len, NUM_LOGIT_POSITIONS)
    return torch.randperm(seq_len, generator=g)[:n].sort().values


def _projections(flat: torch.Tensor, seed: int) -> torch.Tensor:
    """<flat, z_k> for K seeded standard-normal z_k, generated in chunks on flat's device."""
    g = torch.Generator(device=flat.device).manual_seed(seed)
    out = torch.zeros(NUM_PROJECTIONS, dtype=torch.float64, device=flat.device)
    for start in range(0, flat.numel(), _CHUNK):
        part = flat[start : start + _CHUNK].double()
        z = torch.randn(NUM_PROJECTIONS, part.numel(), generator=g, device=flat.device, dtype=torch.float64)
        out += z @ part
    return out.cpu()


def select_positions(logits_bsv: torch.Tensor, valid_bs, mode: str, seed: int):
    """Projected mode keeps `logit_positions` only: a long sequence's full fp32 logits would not fit beside
    the model. The reference and the CP side (which gathers only these positions) call this the same way."""
    if mode != "projected":
        return logits_bsv, valid_bs
    keep = logit_positions(logits_bsv.shape[1], seed).to(logits_bsv.device)
    valid_bs = valid_bs.index_select(1, keep.to(valid_bs.device)) if valid_bs is not None else None
    return logits_bsv.index_select(1, keep), valid_bs


def summarize_outputs(loss: torch.Tensor, logits_bsv: torch.Tensor, valid_bs=None) -> dict:
    """The loss and the (already selected) logits; `summarize_grad` adds the gradients one by one. A summary owns
    host copies of what it keeps: `.cpu()` of a CPU tensor is the tensor itself, and a summary pinning the step's
    own logits or gradients would keep them counted in the memory measured after the capture."""
    if logits_bsv is None:  # a chunked loss computes no logits: the loss and gradients are compared
        return {"loss": float(loss.detach().float()), "logits": None, "grads": {}}
    logits = logits_bsv.detach().float()
    if valid_bs is not None:  # padding positions' logits are not part of the comparison
        logits = logits.masked_fill(~valid_bs.bool().to(logits.device).unsqueeze(-1), 0.0)
    return {"loss": float(loss.detach().float()), "logits": logits.to("cpu", copy=True), "grads": {}}


def summarize_grad(name: str, g: torch.Tensor, mode: str, seed: int):
    flat = g.detach().float().reshape(-1)
    if mode == "full":
        return flat.to("cpu", copy=True)  # a copy: see summarize_outputs
    seed_p = zlib.crc32(name.encode()) ^ seed
    return float(flat.norm()), _projections(flat, seed_p)


def summarize(loss: torch.Tensor, logits_bsv: torch.Tensor, grads, mode: str, seed: int, valid_bs=None) -> dict:
    """The whole summary of one side, from full-length logits and (name, full gradient) pairs."""
    logits, valid = select_positions(logits_bsv.detach(), valid_bs, mode, seed)
    summary = summarize_outputs(loss, logits, valid)
    for name, g in grads:
        if g is not None:
            summary["grads"][name] = summarize_grad(name, g, mode, seed)
    return summary


def _severity(err: float) -> float:
    """NaN (a non-finite value on either side) ranks as the worst error, like inf."""
    return math.inf if math.isnan(err) else err


def _worst(*errs: float) -> float:
    """max that keeps NaN (Python's max drops it when it is not first)."""
    return next((e for e in errs if math.isnan(e)), max(errs))


def compare(ours: dict, ref: dict, dtype: str, world_size: int) -> dict:
    """The parity columns of one point. A NaN or inf anywhere is a failure, never a pass."""
    tol = tolerances(dtype, world_size)
    loss_err = abs(ours["loss"] - ref["loss"]) / max(abs(ref["loss"]), 1e-30)
    if not (math.isfinite(ours["loss"]) and math.isfinite(ref["loss"])):
        loss_err = math.nan
    logits_err = _logits_error(ours["logits"], ref["logits"])
    worst, where = 0.0, None
    norms = {name: _norm(r) for name, r in ref["grads"].items()}
    floor = rounding_unit(dtype) * max((n for n in norms.values() if math.isfinite(n)), default=0.0)
    for name, r in ref["grads"].items():
        err = _grad_error(ours["grads"].get(name), r, norms[name], floor)
        if where is None or _severity(err) > _severity(worst):
            worst, where = err, name
    checks = [("loss", loss_err, tol["loss_rtol"]), ("logits", logits_err, tol["logits_atol"]),
              ("gradient " + str(where), worst, tol["grad_rtol"])]
    checks = [c for c in checks if c[1] is not None]  # no logits with a chunked loss
    failed = [f"{what} error {err:.3g} > {t:.3g}" for what, err, t in checks if not err <= t]
    return {
        "parity_status": "fail" if failed else "pass", "parity_detail": "; ".join(failed) or None,
        "loss": ours["loss"], "ref_loss": ref["loss"], "loss_rel_err": loss_err, "logits_max_err": logits_err,
        "grad_max_rel_err": worst, "grad_worst_param": where, "loss_rtol": tol["loss_rtol"],
        "logits_atol": tol["logits_atol"], "grad_rtol": tol["grad_rtol"],
    }


def _logits_error(ours, ref) -> float | None:
    if ours is None or ref is None:
        return None
    diff = (ours - ref).abs()
    if not (torch.isfinite(ours).all() and torch.isfinite(ref).all()):
        return math.nan
    return float(diff.max()) if diff.numel() else 0.0


def _norm(r) -> float:
    return r[0] if isinstance(r, tuple) else float(r.norm())


def _grad_error(g, r, ref_norm: float, floor: float) -> float:
    """The relative error of one parameter's gradient (`ref_norm`: its reference's norm); under the rounding `floor`
    (see REDUCTION_DEPTH's comment) its error relative to the floor instead."""
    if g is None:
        return math.inf  # a parameter without a gradient on our side is a parity failure
    below = min(1.0, ref_norm / floor) if floor > 0 and math.isfinite(ref_norm) else 1.0
    if isinstance(r, tuple):
        (norm, proj), (_, ref_proj) = g, r
        values = (norm, ref_norm, *proj.tolist(), *ref_proj.tolist())
        if not all(math.isfinite(v) for v in values):
            return math.nan
        proj_err = float((proj - ref_proj).norm() / ref_proj.norm().clamp(min=1e-30))
        return below * _worst(proj_err, abs(norm - ref_norm) / max(ref_norm, 1e-30))
    if not (torch.isfinite(g).all() and torch.isfinite(r).all()):
        return math.nan
    return below * float((g - r).norm()) / max(ref_norm, 1e-30)


def cache_path(cache_dir: Path, point, mode: str, reference: str = "unsharded") -> Path:
    """Keyed by what the reference computes from, not by names: the resolved model config (a preset's values
    may change under the same name), the batch, dtype, backend, device, mode, and the torch/transformers
    versions (seeded initialisation may change between versions)."""
    from cpbench.harness.suite.presets import get_preset

    config = get_preset(point.preset).config(point.model_overrides)
    key = {
        "config": config.to_json_string(use_diff=False),
        "batch": {k: getattr(point, k) for k in ("seq_len", "batch_size", "batch_kind", "seed")},
        "dtype": point.dtype, "mixed_precision": point.mixed_precision, "attn_implementation": point.attn_implementation, "device": point.device,
        "mode": mode, "versions": [torch.__version__, _transformers_version()],
        # the sharded reference runs the point's loss (the unsharded one the full loss)
        **({"reference": reference, "loss": point.loss_mode} if reference != "unsharded" else {}),
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return Path(cache_dir) / f"reference-{digest}.pt"


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def load_cached(path: Path) -> dict | None:
    return torch.load(path, weights_only=True) if path.exists() else None


def save_cached(path: Path, summary: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save(summary, tmp)
    os.replace(tmp, path)
