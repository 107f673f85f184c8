"""The CP side of a point's parity: rank 0's summary of the sharded step's loss, logits and gradients.

Every rank runs the same collectives (the logits gather, each gradient's `full_tensor`), so what goes wrong on
rank 0 while summarizing cannot leave a peer blocked; the unsharded reference it is compared with is the
reference's (`reference.py`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cpbench.harness.measure import parity
from cpbench.harness.suite.spec import Point


def _full_grads(model):
    for name, p in model.named_parameters():
        g = p.grad
        yield name, (g.full_tensor() if hasattr(g, "full_tensor") else g)


def _parity_logits(model, out, batch, point, mode):
    """The logits the comparison needs, on rank 0 (other ranks return None) — a collective at cp_size > 1.

    Projected mode gathers only `parity.logit_positions` (each rank contributes the ones it holds, zeros
    elsewhere, summed exactly), so nothing [B, S, V]-sized is built; full mode (small models) gathers the
    whole sequence."""
    if out.logits is None:  # loss = "chunked": no logits exist to compare (the loss and gradients are compared)
        return None, None
    logits, valid = out.logits.detach(), batch.get("attention_mask")
    if point.cp_size == 1:
        return parity.select_positions(logits, valid, mode, point.seed)
    import cpbench

    cp_rank = dist.get_rank(model.cp_group)
    layout = model.cp_layout(point.seq_len)
    if mode != "projected":
        full = cpbench.gather_sequence(logits, layout, model.cp_group)
        return (full, valid) if cp_rank == 0 else (None, None)
    keep = parity.logit_positions(point.seq_len, point.seed).tolist()
    local_index = {pos: i for i, pos in enumerate(layout.positions)}
    mine = [(k, local_index[pos]) for k, pos in enumerate(keep) if pos in local_index]
    picked = torch.zeros(logits.shape[0], len(keep), logits.shape[-1], dtype=torch.float32, device=logits.device)
    if mine:
        to = torch.tensor([k for k, _ in mine], device=logits.device)
        picked[:, to] = logits.index_select(1, torch.tensor([i for _, i in mine], device=logits.device)).float()
    dist.all_reduce(picked, group=model.cp_group)  # each position held by one rank: x + 0 is exact
    if cp_rank != 0:
        return None, None
    keep_t = torch.tensor(keep)
    return picked, valid.index_select(1, keep_t.to(valid.device)) if valid is not None else None


def capture(model, out, batch, point: Point, mode: str, rank: int) -> tuple[dict | None, str | None]:
    """Rank 0's summary of step 0 (or None and why it failed). Every rank runs the same collectives (the
    logits gather, each gradient's full_tensor) whatever happens to rank 0's summary, so a failure there
    cannot leave a peer blocked in a collective; the point keeps its measurements either way."""
    summary, error = None, None
    try:
        logits, valid = _parity_logits(model, out, batch, point, mode)
        if rank == 0:
            summary = parity.summarize_outputs(out.loss, logits, valid)
        del logits
    except Exception as e:  # noqa: BLE001 - recorded in parity_detail; the measurement goes on
        summary, error = None, _why("capturing the logits", e)
    try:
        for name, g in _full_grads(model):  # collectives: every rank, every parameter
            if summary is None or g is None:
                continue
            try:
                summary["grads"][name] = parity.summarize_grad(name, g, mode, point.seed)
            except Exception as e:  # noqa: BLE001 - as above
                summary, error = None, _why(f"summarizing the gradient of {name}", e)
    except Exception as e:  # noqa: BLE001 - a gather that failed on every rank; as above
        summary, error = None, _why("gathering the gradients", e)
    return summary, error


def _why(what: str, e: BaseException) -> str:
    oom = " (out of memory)" if isinstance(e, torch.OutOfMemoryError) else ""
    return f"parity capture failed{oom} while {what}: {type(e).__name__}: {e}"[:2000]
