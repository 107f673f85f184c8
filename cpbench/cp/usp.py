"""`cp_usp`: the hybrid of Ulysses inside groups and the ring across them (USP), for cp groups that span nodes.

`cp_size = ring x ulysses` ranks (`DistributedConfig.cp_ulysses_degree` = ulysses): each Ulysses group is
`ulysses` consecutive ranks (inside a node, where all-to-all is cheap), and the ring runs over the `ring` groups
(point-to-point across nodes). Per layer:

1. Ulysses inside the group: one all-to-all turns this rank's tokens x all heads into the group's tokens x
   heads / ulysses (kv heads fewer than the degree are replicated first, as `cp_ulysses` does). The layout
   (`SequenceLayout` with `ulysses`) makes the group's tokens, in member order, the ring's zigzag slice (on packed
   documents, the ring's per-document placement: the ring is balanced as `cp_ring_zigzag` is, cp/balance.py).
2. The ring over the ring group on those tokens and heads (`ring.ring_attention`, the same exact masks: packed,
   padded, sliding windows, mixed layers), with the zigzag layout of `ring` ranks.
3. All-to-all back to this rank's tokens x all heads.

Attention sinks (`s_aux`, one logit per query head) follow the heads: sliced to this rank's Ulysses heads, they join
the ring's merged result (cp/ring/sinks.py).

Degree 1 is the ring (zigzag), degree cp_size is Ulysses with the ring's exact block kernel. Heads must be
shared by the group (num_attention_heads a multiple of the degree).
"""

from __future__ import annotations

import torch

from cpbench.cp.layout import SequenceLayout
from cpbench.cp.ring.attention import ring_attention
from cpbench.cp.ulysses import _heads_to_seq, _kv_for_heads, _seq_to_heads, heads_of


def usp_attention(module, query, key, value, attention_mask, *, inner, group, layout, **kwargs):
    """The attention function of `cp_usp`; `group` is the mesh's `UspGroups`."""
    u, ring = group.ulysses_size, group.ring_size
    heads, local = query.shape[1], query.shape[2]
    member, ring_rank = layout.rank % u, layout.rank // u
    k_src, _ = _kv_for_heads(key, heads, u)
    v_src, _ = _kv_for_heads(value, heads, u)
    gathered = SequenceLayout(u * local, u, member)  # the group's tokens in member order: nothing to reorder
    q, k, v = _seq_to_heads([query, k_src, v_src], group.ulysses, gathered)
    if kwargs.get("s_aux") is not None:  # the ring reads the sinks from s_aux only (never module.sinks)
        kwargs["s_aux"] = heads_of(kwargs["s_aux"], member, u)
    ring_layout = layout.ring_view()  # the same padding and per-document placement (cp/balance.py)
    assert (ring_layout.cp_size, ring_layout.rank, ring_layout.local_len) == (ring, ring_rank, u * local), layout
    out_bshd, _ = ring_attention(module, q, k, v, attention_mask, inner=inner, group=group.ring, layout=ring_layout,
                                 **kwargs)
    return _heads_to_seq(out_bshd.transpose(1, 2), group.ulysses, u).transpose(1, 2).contiguous(), None


def check_usp(module: torch.nn.Module, config) -> None:
    heads, u = module.config.num_attention_heads, config.cp_ulysses_degree
    if heads % u:
        raise ValueError(
            f"cp_usp shards query heads over each Ulysses group, but {type(module).__name__} has "
            f"num_attention_heads={heads}, which cp_ulysses_degree={u} does not divide. Use a degree that divides "
            f"{heads} (1 is the ring alone)."
        )
