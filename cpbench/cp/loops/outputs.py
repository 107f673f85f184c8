"""What a loop reads of a CP model: how its ranks share batches, and its per-token outputs (logits, TRL's fused LM
head's log-probabilities) in the whole sequence's order, the same on every rank of a cp group."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from cpbench.cp.layout import SequenceLayout, gather_sequence
from cpbench.cp.loss.causal_lm import IGNORE_INDEX, shift_and_cut_labels


@dataclass(frozen=True)
class Sharing:
    """How a model's ranks share batches: `dp` data-parallel ranks each get their own batch, which `share` ranks
    (cp x tp) hold together; `dp_rank` is this rank's data-parallel index."""

    dp: int
    share: int
    cp: int
    dp_replicate: int
    fsdp: int
    tp: int


def cp_config(model):
    """The model's cpbench `DistributedConfig` when it runs CP (cp_size > 1), else None."""
    model = getattr(model, "module", model)  # past a wrapper that keeps the model as `.module`
    if getattr(model, "cp_group", None) is None:
        return None
    config = getattr(model.config, "distributed_config", None)
    return config if getattr(config, "cp_size", 1) > 1 else None


def sharing(model) -> Sharing:
    config = cp_config(model)
    tp = config.tp_size or 1
    return Sharing(dp=config.dp_replicate_size * config.fsdp_size, share=config.cp_size * tp, cp=config.cp_size,
                   dp_replicate=config.dp_replicate_size, fsdp=config.fsdp_size, tp=tp)


class _GatherSequence(torch.autograd.Function):
    """The whole sequence from every cp rank's slice; backward: the gradient of this rank's positions summed over the
    group. Every rank of the group computes the same loss from the gathered tensor (as from an all-reduced one), so
    each rank's slice gets the gradients of every rank's copy, which FSDP's average over fsdp x cp divides again."""

    @staticmethod
    def forward(ctx, local, layout, group):
        ctx.layout, ctx.group = layout, group
        return gather_sequence(local, layout, group, dim=1)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return ctx.layout.cut(grad, dim=1), None, None


def whole_sequence(local: torch.Tensor, layout: SequenceLayout, group) -> torch.Tensor:
    """`local` ([B, local_len, ...], this rank's positions) in the whole sequence's order ([B, seq_len, ...]),
    differentiable where it is floating point (gloo gathers no bool: masks travel as bytes)."""
    if local.is_floating_point():
        return _GatherSequence.apply(local, layout, group)
    return gather_sequence(local.to(torch.uint8 if local.dtype == torch.bool else local.dtype), layout, group,
                           dim=1).to(local.dtype)


def whole_logits(model, logits, seq_len: int):
    """A loop's logits (a tensor or a tuple of them, this rank's slice) in the whole sequence's order."""
    if logits is None:
        return None
    if isinstance(logits, (tuple, list)):
        return type(logits)(whole_logits(model, x, seq_len) for x in logits)
    if logits.dim() < 2 or logits.shape[1] == seq_len:
        return logits
    return gather_sequence(logits, model.cp_layout(seq_len), model.cp_group)


# TRL's fused LM head (`trl.trainer.utils.FusedCausalLMOutput`): its per-token fields, of which only the
# log-probabilities carry a gradient
PER_TOKEN = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")


def fused_head_forward(model, fused_forward):
    """A forward for TRL's fused LM head (`add_fused_lm_head`), which computes per-token log-probabilities from the
    base model's last hidden states and the labels. Under CP the hidden states are this rank's slice: the head is
    handed this rank's pre-shifted labels (`shift_labels`, which TRL scores without shifting) and the forward's
    layout, and its per-token outputs come back in the whole sequence's order, the same on every rank of the cp
    group, so the loss TRL sums from them is the whole sequences' on every rank (as the model's own)."""
    state, group = model.cp_state, model.cp_group

    def forward(*args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
        if not fused_lm_head:
            return fused_forward(*args, labels=labels, shift_labels=shift_labels,
                                 num_items_in_batch=num_items_in_batch, **kwargs)
        if kwargs.get("output_router_logits") or getattr(model.config, "output_router_logits", False):
            raise ValueError(
                "TRL's fused LM head adds its MoE router auxiliary loss from each rank's router logits, which under "
                "cp_size > 1 cover one slice of the sequence. Set `router_aux_loss_coef=0.0` in SFTConfig, or train "
                "with transformers' Trainer, whose call to the model adds cpbench's whole-sequence aux loss.")
        input_ids = args[0] if args else kwargs.get("input_ids")
        layout = state.layout_of(input_ids, args[1:], kwargs)
        if shift_labels is not None:  # pre-shifted whole sequences: this rank's part of them
            targets = layout.cut(shift_labels.to(torch.long), dim=1, pad_value=IGNORE_INDEX)
        else:
            targets = shift_and_cut_labels(labels, layout)
        with state.active(layout):
            out = fused_forward(*args, fused_lm_head=True, shift_labels=targets, **kwargs)
        fields = {}
        for name in PER_TOKEN:
            local = getattr(out, name, None)
            if local is None:
                continue
            whole = whole_sequence(local, layout, group)
            # without `shift_labels` TRL's fields are those of labels[:, 1:]: the last position predicts nothing
            fields[name] = whole if shift_labels is not None else whole[:, :-1]
        mask = fields["label_mask"]
        count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        fields["loss"] = -fields["log_probs"].sum() / torch.as_tensor(count).to(fields["log_probs"].device)
        return type(out)(**{**out, **fields})

    return forward
