"""The ring family: `cp_ring`, `cp_ring_zigzag` (and the ring half of `cp_usp`).

Owns ring attention's algorithm (attention.py: K/V around the ring, the LSE merge, the backward; sinks.py: attention
sinks joined to the merged result), its P2P transfers (comm.py), the exact mask of every tile (masks.py;
segments.py: masked tiles in flash's varlen form; given_mask.py: a caller's own 4-D mask), the block kernels that
compute one tile (kernels.py: CPU and exact; cuda.py and cudnn.py: PyTorch's fused CUDA kernels; flash.py, fa3.py,
fa4.py: FlashAttention 2, 3 and 4) and which of them serves a layer on which GPU (select.py, target.py), and how a
ring style runs inside a compiled layer (compiled.py: one torch.library op around the eager style, for any style
dynamo cannot trace). May import torch, transformers (through `cpbench.cp.hf_compat`) and the CP core's leaf modules
(layout, batch_mask, hf_compat); never cpbench.harness, cpbench.report or the rest of cpbench.cp (plan, apply, the
losses).
"""

from cpbench.cp.ring.attention import (
    RING_IMPLEMENTATIONS,
    P2PCounter,
    ring_attention,
    ring_attention_with_lse,
    ring_p2p_count,
)

__all__ = ["RING_IMPLEMENTATIONS", "P2PCounter", "ring_attention", "ring_attention_with_lse", "ring_p2p_count"]
