"""A point's parity verdict: its sharded step's summary (`capture.py`) against the reference step's.

The reference is the same step without context parallelism, on the same weights and batch: unsharded on rank 0
(its peers wait), or, for models larger than one device, sharded — every rank runs it with FSDP over all of them,
no CP, every decoder layer recomputed, each rank the whole batch (so the mean of their gradients is the batch's).
References are cached by what they compute from (`parity.cache_path`).
"""

from __future__ import annotations

import dataclasses
import gc
from pathlib import Path

import torch
import torch.distributed as dist

from cpbench.harness.measure import parity, step
from cpbench.harness.measure.capture import capture
from cpbench.harness.suite.spec import NO_STYLE, Point


def sharded_reference(point: Point, mode: str) -> bool:
    """Whether the reference runs on every rank (FSDP, no CP) rather than unsharded on rank 0."""
    if point.world_size == 1 or mode == "off":
        return False
    return point.reference == "sharded" or (point.reference == "auto" and mode == "projected")


def reference_phase(point: Point, side: dict, *, rank: int, device, cache_dir: Path) -> dict | None:
    """Rank 0's parity columns (None on other ranks). Unsharded: rank 0 alone, its peers wait. Sharded: every rank
    runs the reference step together (a failure there raises, and the point keeps its measurements)."""
    mode, ours, capture_error = side["mode"], side["ours"], side["capture_error"]
    if not sharded_reference(point, mode):
        return _parity(point, ours, capture_error, mode, device, cache_dir) if rank == 0 else None
    path = parity.cache_path(cache_dir, point, mode, reference="sharded")
    ref = parity.load_cached(path) if rank == 0 else None
    cached, ref_error = [ref is not None], None
    dist.broadcast_object_list(cached, src=0)
    if not cached[0]:
        ref, ref_error = _sharded_reference(point, mode, device, rank)
        if rank == 0 and ref is not None:
            parity.save_cached(path, ref)
    if rank != 0:
        return None
    why = capture_error or (f"the sharded reference: {ref_error}" if ref is None else None)
    if why is not None:
        return {"parity_status": "error", "parity_detail": why, "parity_reference": "sharded"}
    return {**parity.compare(ours, ref, point.dtype, point.world_size), "parity_reference": "sharded"}


def _sharded_reference(point: Point, mode: str, device, rank: int) -> tuple[dict | None, str | None]:
    """The same step without CP: FSDP over every rank, each with the whole batch (so the mean of their gradients
    is the batch's), every decoder layer recomputed whole (an op-recompute point is held to whole-layer recompute,
    which keeps less), transformers' eager norm (a fused-norm point is held to it), the point's loss and precision."""
    ref_point = dataclasses.replace(point, cp_size=1, fsdp_size=point.world_size, dp_replicate_size=1,
                                    cp_style=NO_STYLE, activation_checkpointing=True, recompute_policy="full",
                                    norm="eager", fault=None)
    if point.fault == "reference_crash" and rank == point.world_size - 1:
        raise torch.OutOfMemoryError(f"injected reference_crash in {point.point_id} (suite [faults] table)")
    model = step.distribute(step.build_reference_model(ref_point, device), ref_point)
    batch = step.make_batch(ref_point, model.config.vocab_size, device)
    out = step.forward(model, batch)
    out.loss.backward()
    summary, error = capture(model, out, batch, ref_point, mode, rank)
    del model, out
    gc.collect()
    return summary, error


def _parity(point: Point, ours: dict | None, capture_error: str | None, mode: str, device, cache_dir: Path) -> dict:
    """The parity columns. A failure here never costs the point its measurements: it becomes
    `reference_oom` or `error` with the message."""
    if mode == "off":
        return {"parity_status": "skipped", "parity_detail": "parity = \"off\" in the suite"}
    if capture_error is not None:
        return {"parity_status": "error", "parity_detail": capture_error, "parity_reference": "unsharded"}
    try:
        path = parity.cache_path(cache_dir, point, mode)
        ref = parity.load_cached(path)
        if ref is None:
            ref = _reference(point, mode, device)
            parity.save_cached(path, ref)
        return {**parity.compare(ours, ref, point.dtype, point.world_size), "parity_reference": "unsharded"}
    except torch.OutOfMemoryError as e:
        return {"parity_status": "reference_oom", "parity_detail": f"the unsharded reference ran out of memory: {e} "
                "(a suite's reference = \"sharded\" runs it over every rank)", "parity_reference": "unsharded"}
    except Exception as e:  # noqa: BLE001 - recorded in parity_detail; the point keeps its measurements
        return {"parity_status": "error", "parity_detail": f"parity reference or comparison failed: "
                f"{type(e).__name__}: {e}"[:2000], "parity_reference": "unsharded"}
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _reference(point: Point, mode: str, device) -> dict:
    model = step.build_reference_model(point, device)
    batch = step.make_batch(point, model.config.vocab_size, device)
    out = step.forward(model, batch)
    out.loss.backward()
    grads = ((n, p.grad) for n, p in model.named_parameters())
    return parity.summarize(out.loss, out.logits, grads, mode, point.seed, batch.get("attention_mask"))
