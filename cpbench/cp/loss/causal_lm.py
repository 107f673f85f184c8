"""The loss of the whole sequences, computed from each rank's slice of the logits.

Labels are shifted on the full sequence *before* the cut, so the last token of one rank's slice predicts the
first token of the next rank's. Each rank sums the cross-entropy of its own valid tokens; the sum is divided by
the number of valid tokens of the whole cp group (or by `num_items_in_batch` when the caller counts them, as
with gradient accumulation) and summed over the group with a differentiable all-reduce. Every rank then holds
the same loss as an unsharded run.

Gradient scale: the all-reduce's backward sums the ranks' output gradients, so each rank's local gradient is
`cp_size` times its share; FSDP2 averages over `fsdp x cp`, which divides that factor out again.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cpbench.cp.comm import all_reduce_sum
from cpbench.cp.layout import SequenceLayout

IGNORE_INDEX = -100


def shift_and_cut_labels(labels_bs: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
    """The next-token targets of this rank's positions ([B, local_len]); padding and the last token get -100."""
    shifted = F.pad(labels_bs, (0, 1), value=IGNORE_INDEX)[:, 1:]
    return layout.cut(shifted, dim=1, pad_value=IGNORE_INDEX)


def cp_causal_lm_loss(
    logits_bsv: torch.Tensor,
    labels_bs: torch.Tensor,
    layout: SequenceLayout,
    group: dist.ProcessGroup | None,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean next-token cross-entropy over every valid token of the full sequences (token-weighted)."""
    targets = shift_and_cut_labels(labels_bs.to(logits_bsv.device), layout)
    local_sum = F.cross_entropy(
        logits_bsv.float().reshape(-1, logits_bsv.shape[-1]),
        targets.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return whole_sequence_mean(local_sum, targets, group, num_items_in_batch)


def whole_sequence_mean(local_sum: torch.Tensor, targets: torch.Tensor, group, num_items_in_batch=None):
    """This rank's sum of token losses -> the mean over the valid tokens of the whole cp group (every rank holds
    it). `group` None: a model without CP, nothing to reduce."""
    if num_items_in_batch is None:
        count = (targets != IGNORE_INDEX).sum()
        if group is not None:
            dist.all_reduce(count, group=group)
        denominator = count.clamp(min=1).to(local_sum.dtype)
    else:
        denominator = torch.as_tensor(num_items_in_batch, dtype=local_sum.dtype, device=local_sum.device)
    mean = local_sum / denominator
    return all_reduce_sum(mean, group) if group is not None else mean
