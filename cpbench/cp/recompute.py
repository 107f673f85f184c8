"""Op-level selective recompute: each checkpointed decoder layer keeps its attention kernels' outputs and every other
matmul's, and recomputes the rest (the norms, rotary, activations, residual adds, copies and the other matmuls).

Recomputing a whole layer (transformers' `activation_checkpointing_enable`) keeps only its input and runs its whole
forward again in backward, attention included: the cheapest in memory and the dearest in time. Keeping what is
costly to recompute and cheap to hold is the middle ground torchtitan ships as its "selective op" activation
checkpointing (torchtitan/distributed/activation_checkpoint.py: save the outputs of `mm` and the SDPA kernels, but
only every second `mm`); its Llama 3 benchmarks run with it. Here the same rule rides on transformers' own
recompute (torch's non-reentrant `checkpoint` with a selective-checkpoint `context_fn`), so it composes with
`every_n_layers`, the checkpoint offload, FSDP2 and every CP style, and keeps the values: a kept output is the
forward's own tensor, a recomputed one is the same op on the same inputs.

What is kept, per checkpointed call (one decoder layer's forward; the count starts afresh at every call, as
torchtitan's `selective_checkpointing_context_fn` makes a fresh counter per call):
- `KEPT_ATTENTION`: every attention kernel's outputs (the output and its log-sum-exp); inside a ring that is every
  tile's, as torchtitan's policy does under torch's ring;
- `MATMULS`: the 1st, 3rd, 5th ... matmul of the call (`mm`, `addmm`, `bmm`, `baddbmm`, `_grouped_mm`): a Llama layer's
  q, k, v, o, gate, up, down projections keep q, v, gate and down, and recompute k, o and up;
- everything else, collectives included, is recomputed (as whole-layer recompute does).
torchtitan counts `mm` alone (its Llama has no biases); counting the biased and batched forms too keeps the rule
for families whose projections carry a bias (`addmm`) or whose experts run as one batched call.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

POLICIES = ("full", "op")  # "full": the whole layer recomputed (transformers' own); "op": this module's rule

_aten = torch.ops.aten


def _ops(*names: str) -> frozenset:
    """The default overloads of the aten ops named that this torch has."""
    return frozenset(getattr(_aten, name).default for name in names if hasattr(_aten, name))


MATMULS = _ops("mm", "addmm", "bmm", "baddbmm", "_grouped_mm")
KEPT_ATTENTION = _ops("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
                      "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                      "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward",
                      "_efficient_attention_forward")


def op_policy():
    """A fresh policy for one checkpointed call: what it keeps and what it recomputes (the module's docstring)."""
    matmuls = 0

    def policy(ctx, op, *args, **kwargs):
        nonlocal matmuls
        if op in MATMULS:
            matmuls += 1
            return CheckpointPolicy.MUST_SAVE if matmuls % 2 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in KEPT_ATTENTION else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def op_contexts():
    """`checkpoint`'s `context_fn`: the forward's and the recompute's contexts under a fresh `op_policy`."""
    return create_selective_checkpoint_contexts(op_policy())


def use_recompute(model: torch.nn.Module, policy: str = "op", every_n_layers: int = 1, offload: bool = False):
    """Recompute `model`'s decoder layers in backward through transformers' own `activation_checkpointing_enable`:
    `policy="full"` the whole of every n-th layer, `"op"` all but its attention kernels' and every other matmul's
    outputs. `offload` holds the checkpoints (each layer's inputs) in pinned host memory. Returns the model."""
    if policy not in POLICIES:
        raise ValueError(f"use_recompute: policy={policy!r} is not one of {', '.join(POLICIES)}: 'full' recomputes "
                         "whole layers, 'op' keeps the attention kernels' and every other matmul's outputs.")
    kwargs = {"use_reentrant": False}
    if policy == "op":
        kwargs["context_fn"] = op_contexts
    model.activation_checkpointing_enable(kwargs, every_n_layers=every_n_layers, offload=offload)
    return model


__all__ = ["KEPT_ATTENTION", "MATMULS", "POLICIES", "op_contexts", "op_policy", "use_recompute"]
