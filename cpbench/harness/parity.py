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

# Tolerances per dtype. CP computes the same sums as the unsharded run in another order (per-block softmax,
# per-rank partial sums, all-reduces), so the two differ by rounding: a few units of the dtype's epsilon
# (fp32 1.2e-7, bf16 7.8e-3, fp16 9.8e-4) times the depth of the reductions. The fp32 values leave ~100x
# headroom over the ~1e-6 observed on the tiny models, yet a dropped mask or a wrong slice errs by > 1e-2.
# bf16/fp16 logits are rounded once more at the output, so their absolute tolerance is a few ulp at |logit|~8.
TOLERANCES = {
    "float32": {"loss_rtol": 1e-5, "logits_atol": 1e-4, "grad_rtol": 1e-4},
    "bfloat16": {"loss_rtol": 2e-2, "logits_atol": 1.5e-1, "grad_rtol": 5e-2},
    "float16": {"loss_rtol": 5e-3, "logits_atol": 3e-2, "grad_rtol": 1e-2},
}


def tolerances(dtype: str, world_size: int) -> dict[str, float]:
    """Each extra doubling of the world adds a reduction level, so the tolerance grows with log2(world)."""
    scale = 1.0 + math.log2(max(1, world_size)) / 2
    return {k: v * scale for k, v in TOLERANCES[dtype].items()}


def resolve_mode(mode: str, num_params: int) -> str:
    if mode == "auto":
        return "full" if num_params <= FULL_MODE_MAX_PARAMS else "projected"
    return mode


def _logit_positions(seq_len: int, seed: int) -> torch.Tensor:
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


def summarize(loss: torch.Tensor, logits_bsv: torch.Tensor, grads, mode: str, seed: int, valid_bs=None) -> dict:
    """`grads` yields (name, full gradient); every rank must iterate it when it gathers shards."""
    logits = logits_bsv.detach()
    if mode == "projected":  # select first: a long sequence's full fp32 logits would not fit beside the model
        keep = _logit_positions(logits.shape[1], seed).to(logits.device)
        logits = logits.index_select(1, keep)
        valid_bs = valid_bs.index_select(1, keep.to(valid_bs.device)) if valid_bs is not None else None
    logits = logits.float()
    if valid_bs is not None:  # padding positions' logits are not part of the comparison
        logits = logits.masked_fill(~valid_bs.bool().to(logits.device).unsqueeze(-1), 0.0)
    summary = {"loss": float(loss.detach().float()), "logits": logits.cpu(), "grads": {}}
    for name, g in grads:
        if g is None:
            continue
        flat = g.detach().float().reshape(-1)
        if mode == "full":
            summary["grads"][name] = flat.cpu()
        else:
            seed_p = zlib.crc32(name.encode()) ^ seed
            summary["grads"][name] = (float(flat.norm()), _projections(flat, seed_p))
    return summary


def compare(ours: dict, ref: dict, dtype: str, world_size: int) -> dict:
    """The parity columns of one point."""
    tol = tolerances(dtype, world_size)
    loss_err = abs(ours["loss"] - ref["loss"]) / max(abs(ref["loss"]), 1e-30)
    logits_err = float((ours["logits"] - ref["logits"]).abs().max())
    worst, where = 0.0, None
    for name, r in ref["grads"].items():
        err = _grad_error(ours["grads"].get(name), r)
        if err > worst or where is None:
            worst, where = err, name
    checks = [("loss", loss_err, tol["loss_rtol"]), ("logits", logits_err, tol["logits_atol"]),
              ("gradient " + str(where), worst, tol["grad_rtol"])]
    failed = [f"{what} error {err:.3g} > {t:.3g}" for what, err, t in checks if not err <= t]
    return {
        "parity_status": "fail" if failed else "pass", "parity_detail": "; ".join(failed) or None,
        "loss": ours["loss"], "ref_loss": ref["loss"], "loss_rel_err": loss_err, "logits_max_err": logits_err,
        "grad_max_rel_err": worst, "grad_worst_param": where, "loss_rtol": tol["loss_rtol"],
        "logits_atol": tol["logits_atol"], "grad_rtol": tol["grad_rtol"],
    }


def _grad_error(g, r) -> float:
    if g is None:
        return math.inf  # a parameter without a gradient on our side is a parity failure
    if isinstance(r, tuple):
        (norm, proj), (ref_norm, ref_proj) = g, r
        proj_err = float((proj - ref_proj).norm() / ref_proj.norm().clamp(min=1e-30))
        return max(proj_err, abs(norm - ref_norm) / max(ref_norm, 1e-30))
    return float((g - r).norm() / r.norm().clamp(min=1e-30))


def cache_path(cache_dir: Path, point, mode: str) -> Path:
    key = {k: getattr(point, k) for k in ("model", "seq_len", "dtype", "attn_implementation", "batch_size",
                                          "batch_kind", "device", "seed")}
    key["mode"] = mode
    # seeded initialisation may change between versions: a reference is only reused by the same stack
    key["versions"] = [torch.__version__, _transformers_version()]
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
