"""`cp_ulysses`: all-to-all from sequence-sharded to head-sharded q/k/v, the model's own attention on the full
sequence with its whole mask, all-to-all back (DeepSpeed-Ulysses).

Each rank ends up with `heads / cp` query heads over all tokens, so any attention backend (eager, sdpa, flex,
flash) runs unchanged with the model-built mask. k/v travel at the kv-head count; when there are fewer kv heads
than ranks they are replicated first, so each rank still receives the kv head its query heads use.

q, k and v travel in one all-to-all (each rank's share of the three packed side by side), and each arrives in
the sequence's global order with one copy: the reordering of a zigzag layout's chunks is folded into the copy
that lays the received heads out. Per layer: one all-to-all forward in, one out (and the same two in backward).

Per-head parameters the inner attention reads follow the heads: attention sinks (one logit per query head, passed
as `s_aux` and read by the models' eager functions as `module.sinks`) are sliced to this rank's query heads.
"""

from __future__ import annotations

import torch

from cpbench.cp.comm import all_to_all
from cpbench.cp.hf_compat import ModuleView, model_config
from cpbench.cp.layout import SequenceLayout


def _seq_to_heads(tensors: list[torch.Tensor], group, layout: SequenceLayout) -> list[torch.Tensor]:
    """[B, Hx, S/cp, D] each (this rank's tokens) -> [B, Hx/cp, S, D] each (this rank's heads, all tokens in the
    sequence's order, padding dropped), in one all-to-all."""
    cp = layout.cp_size
    b, _, s, d = tensors[0].shape
    if any(x.shape[3] != d for x in tensors):  # a different v head dim: no packing along the heads
        return [out for x in tensors for out in _seq_to_heads([x], group, layout)]
    parts = [x.reshape(b, cp, x.shape[1] // cp, s, d).transpose(0, 1) for x in tensors]
    recv_cbhsd = all_to_all(torch.cat(parts, dim=2), group)
    return [_laid_out(piece, layout) for piece in recv_cbhsd.split([p.shape[2] for p in parts], dim=2)]


def _laid_out(recv_cbhsd: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
    """[cp, B, h, S/cp, D] (rank r's tokens at r) -> [B, h, S, D] in global order: one copy."""
    cp, b, h, s, d = recv_cbhsd.shape
    if layout.kind == "contiguous":
        # A cat, not permute + reshape: the same one copy, into a buffer of the output's own 4-D shape. Inductor's
        # CPU flex template reads a query's size from its storage (CppFlexAttentionTemplate.choose_flex_template in
        # torch/_inductor/codegen/cpp_flex_attention_template.py), and the reshape left a view of a 5-D buffer.
        out = torch.cat(recv_cbhsd.unbind(0), dim=2)
    elif layout.placement is not None:  # a per-document placement (cp/balance.py): token by token, still one copy
        where = layout.inverse_rank_order(recv_cbhsd.device)[: layout.seq_len]  # global -> place among the ranks'
        return recv_cbhsd.permute(1, 2, 0, 3, 4)[:, :, where // s, where % s]
    else:
        n = layout.num_chunks // cp  # chunks per rank
        by_chunk = recv_cbhsd.reshape(cp, b, h, n, s // n, d).permute(1, 2, 0, 3, 4, 5)
        ranks, slots = _chunk_sources(layout, recv_cbhsd.device)
        out = by_chunk[:, :, ranks, slots].reshape(b, h, cp * s, d)
    return out[:, :, : layout.seq_len]


def _chunk_sources(layout: SequenceLayout, device) -> tuple[torch.Tensor, torch.Tensor]:
    """For each global chunk: the rank that holds it and its position among that rank's chunks."""
    where = {c: (r, j) for r in range(layout.cp_size) for j, c in enumerate(layout.chunks_of(r))}
    ranks, slots = zip(*(where[c] for c in range(layout.num_chunks)))
    return torch.tensor(ranks, device=device), torch.tensor(slots, device=device)


def _heads_to_seq(y_bhsd: torch.Tensor, group, cp: int) -> torch.Tensor:
    """[B, H/cp, S, D] -> [B, H, S/cp, D]: the inverse of `_seq_to_heads`."""
    b, h, s, d = y_bhsd.shape
    send_cbhsd = y_bhsd.reshape(b, h, cp, s // cp, d).permute(2, 0, 1, 3, 4).contiguous()
    recv_cbhsd = all_to_all(send_cbhsd, group)
    return recv_cbhsd.transpose(0, 1).reshape(b, cp * h, s // cp, d)


def _kv_for_heads(kv_bhsd: torch.Tensor, num_heads: int, cp: int) -> tuple[torch.Tensor, int]:
    """kv heads arranged so that head-sharding gives each rank the kv heads of its query heads.

    Returns the tensor to shard and the number of kv heads each rank ends up with.
    """
    kv_heads = kv_bhsd.shape[1]
    if kv_heads % cp == 0:
        return kv_bhsd, kv_heads // cp
    if cp % kv_heads == 0 and num_heads % cp == 0:
        # Fewer kv heads than ranks: rank r's query heads all use kv head r // (cp / kv_heads).
        return kv_bhsd.repeat_interleave(cp // kv_heads, dim=1), 1
    # Neither divides the other: give every query head its own kv head.
    return kv_bhsd.repeat_interleave(num_heads // kv_heads, dim=1), num_heads // cp


def _to_layout_order(x_bhsd: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
    x_bhsd = layout.pad(x_bhsd, dim=2)
    if layout.kind != "contiguous":
        x_bhsd = x_bhsd.index_select(2, layout.rank_order(x_bhsd.device))
    return x_bhsd


def heads_of(x: torch.Tensor | None, rank: int, size: int, what: str = "s_aux") -> torch.Tensor | None:
    """The query heads `rank` holds after `_seq_to_heads` over `size` ranks (the contiguous block `rank` of the
    heads: the head order the all-to-all keeps) of a per-head tensor [H, ...]."""
    if x is None:
        return None
    if x.shape[0] % size:
        raise ValueError(
            f"{what} has {x.shape[0]} entries along its head dim, which {size} ranks do not share; it must have one "
            "per query head (num_attention_heads, a multiple of the Ulysses degree)."
        )
    per = x.shape[0] // size
    return x[rank * per : (rank + 1) * per]


def per_head_overrides(module, kwargs: dict, rank: int, size: int) -> dict:
    """In place on `kwargs`, and as ModuleView overrides: the per-head tensors sliced to this rank's query heads.
    The sinks reach the inner attention twice: as `s_aux` (flex, flash) and as `module.sinks` (the eager functions
    of gpt_oss, flint, granite_swa, mimo_v2_flash read it there); both are sliced, so autograd sends each rank's
    share of their gradient to its own heads."""
    if kwargs.get("s_aux") is not None:
        kwargs["s_aux"] = heads_of(kwargs["s_aux"], rank, size)
    sinks = getattr(module, "sinks", None)
    return {"sinks": heads_of(sinks, rank, size, "sinks")} if isinstance(sinks, torch.Tensor) else {}


def ulysses_attention(module, query, key, value, attention_mask, *, inner, group, layout, **kwargs):
    kwargs.pop("kernel_device", None)  # the model's own backend runs: it picks its kernels itself
    cp = layout.cp_size
    num_heads = query.shape[1]
    k_src, kv_local = _kv_for_heads(key, num_heads, cp)
    v_src, _ = _kv_for_heads(value, num_heads, cp)
    q_bhsd, k_bhsd, v_bhsd = _seq_to_heads([query, k_src, v_src], group, layout)

    heads = per_head_overrides(module, kwargs, layout.rank, cp)
    local = ModuleView(module, num_key_value_groups=(num_heads // cp) // kv_local, config=model_config(module),
                       **heads)
    out_bshd, _ = inner(local, q_bhsd, k_bhsd, v_bhsd, attention_mask, **kwargs)
    out_bhsd = _to_layout_order(out_bshd.transpose(1, 2), layout)
    return _heads_to_seq(out_bhsd, group, cp).transpose(1, 2).contiguous(), None


def check_ulysses(module: torch.nn.Module, config) -> None:
    heads, cp_size = module.config.num_attention_heads, config.cp_size
    if heads % cp_size:
        raise ValueError(
            f"cp_ulysses shards query heads over the cp group, but {type(module).__name__} has "
            f"num_attention_heads={heads}, which cp_size={cp_size} does not divide. Use a cp_size that divides "
            f"{heads}, or a ring style (`cp_plan={{'model.layers.*.self_attn': 'cp_ring'}}`)."
        )

