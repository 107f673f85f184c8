"""The adapters behind peers.py: each returns `fn(q, k, v) -> out` on this rank's shards, [B, S_local, H, D],
causal. Imports of a peer's package happen here, when its point runs, never at cpbench's import."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from cpbench.harness.peers.registry import AttentionContext, unsharded


class _AttentionLayer(torch.nn.Module):
    """What cpbench's styles read from a model's attention layer: the config (its backend), causality, GQA."""

    def __init__(self, ctx: AttentionContext, implementation: str = "sdpa"):
        from transformers import PretrainedConfig

        super().__init__()
        self.config = PretrainedConfig()
        self.config._attn_implementation = implementation
        self.is_causal = True
        self.num_key_value_groups = ctx.heads // ctx.kv_heads
        self.layer_idx = 0


def cpbench_attention(ctx: AttentionContext) -> Callable:
    """cpbench's own style, called as a decoder layer calls it (transformers' attention interface)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from cpbench.cp import STYLES
    from cpbench.cp.layout import SequenceLayout

    style = STYLES.get(ctx.style)
    layout = SequenceLayout(ctx.seq_len, ctx.cp_size, ctx.rank, style.layout)
    layer = _AttentionLayer(ctx)
    scale = ctx.head_dim**-0.5

    def fn(q, k, v):
        out, _ = style.fn(layer, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None,
                                 inner=sdpa_attention_forward, group=ctx.group, layout=layout, scaling=scale,
                                 dropout=0.0)
        return out  # [B, S_local, H, D]

    return fn


def deepspeed_attention(ctx: AttentionContext) -> Callable:
    """DeepSpeed-Ulysses: `DistributedAttention` (all-to-all in, local attention, all-to-all out) on [B, S, H, D]:
    heads scattered (dim 2), the sequence gathered (dim 1)."""
    import deepspeed
    import deepspeed.comm
    from deepspeed.sequence.layer import DistributedAttention

    if not deepspeed.comm.is_initialized():
        # DeepSpeed's comm wraps the process group cpbench already made. On CPU it would first JIT-build its
        # shared-memory all-reduce op (g++, tens of seconds); Ulysses only needs all-to-all, so it is left out.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.init_distributed(dist_backend="gloo" if ctx.device.type == "cpu" else "nccl")
    if ctx.kv_heads % ctx.cp_size:
        raise ValueError(f"deepspeed Ulysses scatters kv heads too: kv_heads={ctx.kv_heads} must be a multiple of "
                         f"cp_size={ctx.cp_size}")
    attention = DistributedAttention(unsharded, ctx.group, scatter_idx=2, gather_idx=1)  # sdpa on [B, S, H, D]
    return lambda q, k, v: attention(q, k, v, batch_dim_idx=0)


def _gqa_expanded(fn: Callable, heads: int, kv_heads: int) -> Callable:
    """For a peer that wants equal head counts: each kv head repeated for its query heads (gradients sum back)."""
    if heads == kv_heads:
        return fn
    g = heads // kv_heads
    return lambda q, k, v: fn(q, k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2))


def torch_cp_options(style: str) -> dict:
    """PyTorch CP's options for a style: its head-tail load balancing is the zigzag layout; off, the shards are
    contiguous."""
    return {"enable_load_balance": style == "cp_ring_zigzag"}


def torch_cp_attention(ctx: AttentionContext) -> Callable:
    """PyTorch's context_parallel: inside its context, sdpa on the local shards runs its ring (the shards are
    DTensors sharded on the sequence). The whole step (forward and backward) runs in the context, as torchtitan's
    training context does: `fn.step_context`."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.experimental import _attention as cp_attention
    from torch.distributed.tensor.experimental import context_parallel

    mesh = DeviceMesh.from_group(ctx.group, ctx.device.type)

    def fn(q, k, v):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return out.transpose(1, 2)

    def step_context():
        for name, value in torch_cp_options(ctx.style).items():
            setattr(cp_attention._cp_options, name, value)
        return context_parallel(mesh)

    fn = _gqa_expanded(fn, ctx.heads, ctx.kv_heads)
    fn.step_context = step_context
    return fn


def ring_flash_attention(ctx: AttentionContext) -> Callable:
    """ring-flash-attn's ring (contiguous shards) or zigzag ring (chunks r and 2cp-1-r), [B, S, H, D], causal."""
    import transformers.modeling_flash_attention_utils as flash_utils
    import transformers.utils

    if not hasattr(flash_utils, "is_flash_attn_greater_or_equal_2_10"):
        # ring-flash-attn 0.1.8 imports this name from where transformers 4.x had it (upstream PR #88).
        flash_utils.is_flash_attn_greater_or_equal_2_10 = transformers.utils.is_flash_attn_greater_or_equal_2_10
    import ring_flash_attn

    func = ring_flash_attn.zigzag_ring_flash_attn_func if ctx.style == "cp_ring_zigzag" else \
        ring_flash_attn.ring_flash_attn_func
    return lambda q, k, v: func(q, k, v, causal=True, softmax_scale=ctx.head_dim**-0.5, group=ctx.group)


def yunchang_degrees(style: str, cp_size: int) -> tuple[int, int]:
    """(ulysses degree, ring degree) of yunchang's USP for a style: Ulysses alone, or the ring alone."""
    return (cp_size, 1) if style == "cp_ulysses" else (1, cp_size)


def yunchang_attention(ctx: AttentionContext) -> Callable:
    """yunchang's LongContextAttention (USP) on [B, S, H, D]; its process groups are globals that
    `set_seq_parallel_pg` sets on every rank."""
    import yunchang

    ulysses, ring = yunchang_degrees(ctx.style, ctx.cp_size)
    yunchang.set_seq_parallel_pg(ulysses, ring, ctx.rank, ctx.cp_size)
    attention = yunchang.LongContextAttention(ring_impl_type="zigzag" if ctx.style == "cp_ring_zigzag" else "basic")
    return lambda q, k, v: attention(q, k, v, causal=True, softmax_scale=ctx.head_dim**-0.5)
