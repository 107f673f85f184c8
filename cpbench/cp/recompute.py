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
- the attention kernels' outputs (the output and its log-sum-exp): torch's SDPA kernels and FlexAttention's
  higher-order op (`KEPT_ATTENTION`), and flash-attn 2's and 3's registered ops where those packages are loaded
  (`kept_attention`). FlashAttention-4 calls no dispatcher op, so nothing could keep it: suites refuse `op` with it
  (harness/suite/levers.py);
- the 1st, 3rd, 5th ... matmul of the call (`MATMULS`: `mm`, `addmm`, `bmm`, `baddbmm`, `_grouped_mm`): a Llama
  layer's q, k, v, o, gate, up, down projections keep q, v, gate and down, and recompute k, o and up; a Float8
  matmul (`_scaled_mm`, torchao's) is always kept and not counted, as torchtitan's list keeps it;
- everything else, collectives included, is recomputed (as whole-layer recompute does), and so is all of what runs
  under `recomputed()`: the ring's attention (cp_ring, cp_ring_zigzag, cp_usp), whose tiles would otherwise all be
  kept (2·cp tiles of S/(2·cp) rows: the whole sequence's attention output on every rank, whatever cp), and the
  tiles of the tiled MLP, whose intermediates tiling exists not to hold.
The forward's and the recompute's matmuls are counted apart: torch before 2.13 asks the policy again while it
recomputes (and takes kept outputs first in, first out), and one count over both would shift the parity of every
layer with an odd number of matmuls. torchtitan counts `mm` alone (its Llama has no biases); counting the biased and
batched forms too keeps the rule for families whose projections carry a bias (`addmm`). With the checkpoint offload,
the kept outputs stay on the device; only the layers' inputs move to the host.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
from torch._higher_order_ops.flex_attention import flex_attention
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
                      "_efficient_attention_forward") | {flex_attention}
KEPT_ALWAYS = _ops("_scaled_mm")  # Float8 matmuls: kept whatever the count (torchtitan's _save_list)


# flash-attn's registered forward ops (namespace, name): 2.6+ and 3 register them with torch.library
FLASH_ATTENTION_OPS = (("flash_attn", "_flash_attn_forward"), ("flash_attn", "_flash_attn_varlen_forward"),
                       ("flash_attn_3", "_flash_attn_forward"), ("flash_attn_3", "fwd"))
_RECOMPUTED = contextvars.ContextVar("cpbench_recomputed", default=False)
_SELECTIVE = contextvars.ContextVar("cpbench_selective", default=False)


class _Flagged:
    """A selective-checkpoint mode that says, while it is entered, that ops run under it (`under_op_policy`): its
    Python runs for every op, a host cost a projection prices (timing.py: cpu_selective_op_s). Re-entrant, as the
    mode it wraps (a second backward replays again)."""

    def __init__(self, mode):
        self.mode, self.tokens = mode, []

    def __enter__(self):
        self.tokens.append(_SELECTIVE.set(True))
        return self.mode.__enter__()

    def __exit__(self, *exc):
        try:
            return self.mode.__exit__(*exc)
        finally:
            _SELECTIVE.reset(self.tokens.pop())


def under_op_policy() -> bool:
    """Whether the op dispatched now runs under op recompute's selective-checkpoint modes (a forward or a replay)."""
    return _SELECTIVE.get()


@contextlib.contextmanager
def recomputed():
    """What runs inside is recomputed under the op policy, whatever its ops (the ring's attention, a tiled MLP's
    tiles: see the module's docstring); its matmuls do not count in the alternation."""
    token = _RECOMPUTED.set(True)
    try:
        yield
    finally:
        _RECOMPUTED.reset(token)


def kept_attention() -> frozenset:
    """The attention kernels whose outputs the op policy keeps: torch's, and flash-attn's where loaded."""
    found = set(KEPT_ATTENTION)
    for namespace, name in FLASH_ATTENTION_OPS:
        packet = getattr(getattr(torch.ops, namespace), name, None) if hasattr(torch.ops, namespace) else None
        if packet is not None:
            found.add(packet.default)
    return frozenset(found)


def op_policy():
    """A fresh policy for one checkpointed call: what it keeps and what it recomputes (the module's docstring)."""
    matmuls = {False: 0, True: 0}  # the forward's and the recompute's apart
    kept = kept_attention() | KEPT_ALWAYS

    def policy(ctx, op, *args, **kwargs):
        if _RECOMPUTED.get():
            return CheckpointPolicy.PREFER_RECOMPUTE
        if op in MATMULS:
            phase = bool(getattr(ctx, "is_recompute", False))
            matmuls[phase] += 1
            return CheckpointPolicy.MUST_SAVE if matmuls[phase] % 2 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in kept else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def op_contexts():
    """`checkpoint`'s `context_fn`: the forward's and the recompute's contexts under a fresh `op_policy`."""
    forward, recompute = create_selective_checkpoint_contexts(op_policy())
    return _Flagged(forward), _Flagged(recompute)


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


__all__ = ["KEPT_ALWAYS", "KEPT_ATTENTION", "MATMULS", "POLICIES", "kept_attention", "op_contexts", "op_policy",
           "recomputed", "under_op_policy", "use_recompute"]
