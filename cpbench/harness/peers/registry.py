"""Context-parallel implementations a sweep runs side by side (`implementations = [...]` in a suite).

Every implementation is an adapter of a few lines: which styles and devices it serves, which package it needs
(each peer is an optional extra, `pip install 'cpbench[peers]'`), the sequence layout it expects its shards in,
and `build(ctx)`, which returns the function a rank calls on its local shards: `fn(q, k, v) -> out`, all
[batch, local tokens, heads, head dim], causal, differentiable. The attention-level runner (attention_level.py)
cuts the same full inputs for every implementation, times forward + backward, and holds each output and dq, dk,
dv to the unsharded op. A peer that is not installed, or cannot run on the point's device, is `skipped` with why.

- `cpbench`: this package's own styles (cp_ulysses, cp_ring, cp_ring_zigzag), called as a model layer calls them.
- `deepspeed`: DeepSpeed-Ulysses, `deepspeed.sequence.layer.DistributedAttention` around torch's sdpa; runs on
  gloo on CPU.
- `torch_cp`: PyTorch's `torch.distributed.tensor.experimental.context_parallel` (ring over sdpa, its own
  round-robin load balancing); CUDA only: its sdpa sharding rules cover the CUDA flash and efficient kernels, not
  the CPU flash kernel.
- `ring_flash_attn`: zhuzilin's ring-flash-attn (`ring_flash_attn_func`, `zigzag_ring_flash_attn_func`); CUDA with
  flash-attn.
- `yunchang`: USP's `LongContextAttention` (Ulysses x ring); CUDA with flash-attn.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
import torch.nn.functional as F

CPBENCH = "cpbench"


@dataclass(frozen=True)
class AttentionContext:
    """What an adapter gets: the point's cp group, this rank, and the model-like facts of the op."""

    group: object
    rank: int
    cp_size: int
    seq_len: int
    heads: int
    kv_heads: int
    head_dim: int
    style: str
    device: torch.device


@dataclass(frozen=True)
class Peer:
    name: str
    styles: dict[str, str]  # cp_style -> the layout its shards are in ("contiguous" | "zigzag")
    devices: tuple[str, ...]
    packages: tuple[str, ...]  # importable module names it needs
    extra: str  # how to install it
    adapter: str  # the function of adapters.py that builds its attention op from an AttentionContext
    note: str = ""  # why a device is missing, for the skip reason

    def why_unavailable(self, device: str) -> str | None:
        if device not in self.devices:
            return f"implementation {self.name!r} runs on {list(self.devices)}, not {device!r}{self.note}"
        missing = [p for p in self.packages if importlib.util.find_spec(p) is None]
        if missing:
            return f"implementation {self.name!r} needs {missing}, not installed here: {self.extra}"
        return None


PEERS: dict[str, Peer] = {}


def register(peer: Peer) -> Peer:
    PEERS[peer.name] = peer
    return peer


def get_peer(name: str) -> Peer:
    if name not in PEERS:
        raise ValueError(f"unknown implementation {name!r}; known: {sorted(PEERS)}")
    return PEERS[name]


def unsharded(q, k, v) -> torch.Tensor:
    """The op every implementation computes, unsharded: torch's sdpa, causal, on [B, S, H, D] (GQA through
    `enable_gqa`)."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                         enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


register(Peer(CPBENCH, {"cp_ulysses": "contiguous", "cp_ring": "contiguous", "cp_ring_zigzag": "zigzag"},
              ("cpu", "cuda"), (), "", "cpbench_attention"))
register(Peer("deepspeed", {"cp_ulysses": "contiguous"}, ("cpu", "cuda"), ("deepspeed",),
              "pip install 'cpbench[peers]'", "deepspeed_attention"))
register(Peer("torch_cp", {"cp_ring": "contiguous", "cp_ring_zigzag": "zigzag"}, ("cuda",), (), "",
              "torch_cp_attention", note=": PyTorch's context_parallel has sharding rules for the CUDA "
              "flash and memory-efficient sdpa kernels, not for the CPU flash kernel"))
register(Peer("ring_flash_attn", {"cp_ring": "contiguous", "cp_ring_zigzag": "zigzag"}, ("cuda",),
              ("ring_flash_attn", "flash_attn"), "pip install 'cpbench[peers-gpu]'", "ring_flash_attention",
              note=": its kernels are flash-attn's (CUDA)"))
register(Peer("yunchang", {"cp_ulysses": "contiguous", "cp_ring": "contiguous", "cp_ring_zigzag": "zigzag"},
              ("cuda",), ("yunchang", "flash_attn"), "pip install 'cpbench[peers-gpu]'", "yunchang_attention",
              note=": its kernels are flash-attn's (CUDA)"))
