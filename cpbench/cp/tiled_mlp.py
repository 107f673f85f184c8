"""Sequence-tiled MLP: each decoder layer's MLP over tiles of the sequence, each tile recomputed in backward.

At long context the MLP's `[tokens, intermediate]` tensors are the largest a layer makes (at 512k tokens a rank and
Llama-3-8B's 14,336 that is 14 GiB each, several alive at once: gate, up, their product, and their gradients).
The MLP is per token, so computing it tile by tile is exact: here each tile runs under activation checkpointing
(non-reentrant), which keeps only the tile's input (a view of the layer's) and recomputes the tile's intermediates in
backward, so at most one tile's intermediates exist at a time, forward or backward. The output is the tiles' outputs
concatenated: `[tokens, hidden]`, as the untiled MLP returns.

Where the layer's norm feeds its MLP directly (`MLP_NORMS`), the norm joins the tile: RMSNorm computes in fp32, so
untiled its backward holds several `[tokens, hidden]` fp32 tensors (at 512k tokens and Llama-3-8B's 4,096, 8 GiB
each: the peak of a long-context step once the MLP is tiled). The norm module keeps its weight (same names, same
FSDP group); only its call moves into the tile.

DeepSpeed's ALST ships the same idea (`TiledMLP`), written around ZeRO-3's parameter handling; this one is plain
torch, so it composes with FSDP2, every CP style, recompute and offload, and needs no optional package.
"""

from __future__ import annotations

import math
import types

import torch
from torch.utils.checkpoint import checkpoint

from cpbench.cp.recompute import recomputed

TILE_BYTES = 1 << 30  # "auto": tiles whose largest intermediate stays within this (1 GiB)
TILED_ATTR = "_cpbench_tiled_mlp"
NORM_ATTR = "_cpbench_tiled_norm"

# The norm whose output is the MLP's input, per family (their decoder layers: `mlp(norm(h))`, then the residual add).
# Families not listed tile the MLP alone.
MLP_NORMS = {"llama": "post_attention_layernorm", "mistral": "post_attention_layernorm",
             "qwen2": "post_attention_layernorm", "qwen3": "post_attention_layernorm",
             "gemma3_text": "pre_feedforward_layernorm"}


def auto_tiles(tokens: int, intermediate_size: int, itemsize: int, tile_bytes: int = TILE_BYTES) -> int:
    """Tiles that keep one tile's `[tokens, intermediate]` tensor within `tile_bytes`."""
    return max(1, math.ceil(tokens * intermediate_size * itemsize / tile_bytes))


def _tiled_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The MLP over tiles of the sequence (dim -2 of [batch, seq, hidden]); untiled when no gradient is taken."""
    forward = getattr(self, TILED_ATTR)
    tiles = forward.tiles
    if tiles == "auto":
        intermediate = getattr(self, "intermediate_size", None) or x.shape[-1] * 4
        tiles = auto_tiles(x[..., 0].numel(), intermediate, x.element_size())
    seq = x.shape[-2]
    if tiles <= 1 or seq <= 1 or not torch.is_grad_enabled():
        return _tile(forward, x, *args, **kwargs)
    size = math.ceil(seq / tiles)
    outs = [checkpoint(_recomputed_tile, forward, part, *args, use_reentrant=False, **kwargs)
            for part in x.split(size, -2)]
    return torch.cat(outs, dim=-2)


def _tile(forward, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """One tile: the layer's norm (where it joined the tile) and the MLP."""
    return forward.original(forward.norm(x) if forward.norm is not None else x, *args, **kwargs)


def _recomputed_tile(forward, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """A tile whose outputs op recompute keeps none of (cp/recompute.py): tiling exists not to hold them."""
    with recomputed():
        return _tile(forward, x, *args, **kwargs)


def _passes_through(self, x: torch.Tensor) -> torch.Tensor:
    """A norm whose call moved into the MLP's tiles: its own call passes the input on."""
    return x


def use_tiled_mlp(model: torch.nn.Module, tiles: int | str = "auto") -> torch.nn.Module:
    """Compute every decoder layer's MLP (`*.layers.<i>.mlp`), with the norm that feeds it where the family is known
    (`MLP_NORMS`), over `tiles` tiles of the sequence ("auto": tiles whose largest intermediate stays within 1 GiB;
    1 turns tiling off). Returns the model; calling it again changes the tile count."""
    if not (tiles == "auto" or (isinstance(tiles, int) and not isinstance(tiles, bool) and tiles >= 1)):
        raise ValueError(f"tiled MLP: `tiles` must be 'auto' or an integer >= 1, got {tiles!r}.")
    found = 0
    norm_name = MLP_NORMS.get(getattr(getattr(model, "config", None), "model_type", None))
    for name, module in model.named_modules():
        parent, _, leaf = name.rpartition(".")
        if leaf != "mlp" or ".layers." not in f".{parent}" or not parent.rpartition(".")[2].isdigit():
            continue
        state = getattr(module, TILED_ATTR, None)
        if state is None:
            norm = getattr(model.get_submodule(parent), norm_name, None) if norm_name else None
            state = types.SimpleNamespace(original=module.forward, tiles=tiles,
                                          norm=norm.forward if norm is not None else None)
            if norm is not None:
                setattr(norm, NORM_ATTR, True)
                norm.forward = types.MethodType(_passes_through, norm)
            setattr(module, TILED_ATTR, state)
            module.forward = types.MethodType(_tiled_forward, module)
        state.tiles = tiles
        found += 1
    if not found:
        raise ValueError(
            f"tiled MLP: {type(model).__name__} has no decoder-layer MLP named like `model.layers.<i>.mlp`; tiling "
            "needs one (the MLP must act on each token alone)."
        )
    return model
