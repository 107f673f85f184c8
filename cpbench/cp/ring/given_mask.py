"""A caller's own 4-D attention mask, read tile by tile (masks.py's DENSE source when the model did not build the mask
from the batch): checked whole once per call, then sliced per tile as booleans.

A boolean mask is True where a query attends; an additive one (eager's) is 0 there and very negative (-inf or the
dtype's minimum) elsewhere. Any other value is a bias (ALiBi and the like), which a per-tile boolean mask cannot
carry: refused, with the style that can.
"""

from __future__ import annotations

import torch


def check_whole(mask: torch.Tensor, seq_len: int) -> torch.Tensor | None:
    """Refuses a mask the ring cannot read; returns the rows that see no key (an additive mask's: eager's uniform
    rows), or None when there are none."""
    if tuple(mask.shape[-2:]) != (seq_len, seq_len):
        raise ValueError(
            f"cp_ring: attention_mask has shape {tuple(mask.shape)}, but a whole mask over seq_len={seq_len} must "
            f"end in ({seq_len}, {seq_len}). Pass the mask unchanged (KV caches are not supported with CP)."
        )
    if not (mask.dtype == torch.bool or mask.is_floating_point()):
        raise ValueError(f"cp_ring: a 4-D attention_mask must be bool (True = attend) or additive float, got "
                         f"{mask.dtype}.")
    if not mask.is_floating_point():
        return None
    # Validated whole, here, where every rank holds the same mask: a per-tile refusal would raise on one rank
    # mid-ring and leave the others blocked on their next transfer. In row blocks, so the check's temporaries
    # stay small next to the mask itself.
    for rows in mask.split(256, dim=-2):
        as_allowed(rows)
    rows = ~(mask == 0).any(-1)
    return rows if bool(rows.any()) else None


def dense_tile(mask: torch.Tensor, q0: int, k0: int, n: int, seq_len: int) -> torch.Tensor:
    """The tile's bool mask sliced from a whole mask; rows/columns past seq_len stay False."""
    q1, k1 = min(q0 + n, seq_len), min(k0 + n, seq_len)
    block = as_allowed(mask[..., q0:q1, k0:k1])
    if (q1 - q0, k1 - k0) == (n, n):
        return block
    out = torch.zeros(*block.shape[:2], n, n, dtype=torch.bool, device=block.device)
    out[..., : q1 - q0, : k1 - k0] = block
    return out


def as_allowed(block: torch.Tensor) -> torch.Tensor:
    """A block of the mask as booleans (True = attend)."""
    if block.dtype == torch.bool:
        return block
    allowed = block == 0
    blocked = block <= torch.finfo(block.dtype).min / 2
    if not bool((allowed | blocked).all()):
        raise ValueError(
            "cp_ring: the attention mask holds values other than 0 and -inf (an attention bias, e.g. ALiBi). The "
            "ring builds a boolean mask per block and cannot carry a bias; use cp_ulysses for this model."
        )
    return allowed
