"""The sequence-tiled MLP (cpbench/cp/tiled_mlp.py) on one process: the same loss, logits and every gradient as the
untiled model (the MLP is per token, so tiling changes only the order of nothing: the values are the same up to
fp32 rounding of the matmuls' tiles), the tracked peak lower (at most one tile's intermediates live), and the
refusals. Multi-rank parity with every style and lever is tests/dist/test_levers.py."""

from __future__ import annotations

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker
from transformers import AutoModelForCausalLM, LlamaConfig

import cpbench
from cpbench.cp.tiled_mlp import auto_tiles

# fp32: the tiled and untiled MLPs compute the same dot products over the same hidden dim (tiling splits rows,
# never a reduction), so outputs agree to the last bit or within a few ulp where BLAS blocks rows differently;
# 1e-6 relative is ~10 fp32 eps, and a wrong tile (a dropped or repeated row) errs by O(1).
RTOL = 1e-6


def _model(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    values = dict(vocab_size=64, hidden_size=64, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)
    config = LlamaConfig(**{**values, **overrides})
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")


def _run(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    return out.loss.detach(), out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


@pytest.mark.parametrize("tiles", [2, 3, 7])
def test_tiled_equals_untiled(tiles):
    ids = torch.randint(0, 64, (2, 45), generator=torch.Generator().manual_seed(1))  # 45: tiles of unequal length
    ref_loss, ref_logits, ref_grads = _run(_model(), ids)
    loss, logits, grads = _run(cpbench.use_tiled_mlp(_model(), tiles), ids)
    assert _rel(loss, ref_loss) <= RTOL and _rel(logits, ref_logits) <= RTOL
    assert max(_rel(grads[n], ref_grads[n]) for n in ref_grads) <= RTOL


def _peak(model, ids) -> int:
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    return max(v["Total"] for v in tracker.get_tracker_snapshot("peak").values())


def test_tiling_lowers_the_tracked_peak():
    ids = torch.randint(0, 64, (1, 1024), generator=torch.Generator().manual_seed(2))
    plain, tiled = _peak(_model(num_hidden_layers=1), ids), _peak(cpbench.use_tiled_mlp(_model(num_hidden_layers=1),
                                                                                          8), ids)
    # Untiled, the MLP holds gate, up and their product ([1024, 512] fp32, 2 MiB each) and their gradients at once;
    # tiled, an eighth of them. The rest of the step (attention, logits) is the same on both sides.
    intermediate = 1024 * 512 * 4
    assert plain - tiled >= intermediate, (plain, tiled)


def test_the_norm_that_feeds_the_mlp_joins_the_tile():
    """Llama: `mlp(post_attention_layernorm(h))`; the norm's call moves into the tiles (its weight stays put), so its
    fp32 [tokens, hidden] temporaries exist per tile too: the peak drops by more than the MLP's own share."""
    model = cpbench.use_tiled_mlp(_model(num_hidden_layers=1), 8)
    layer = model.model.layers[0]
    x = torch.randn(1, 5, 64)
    assert torch.equal(layer.post_attention_layernorm(x), x)  # its own call passes the input on
    assert layer.mlp._cpbench_tiled_mlp.norm is not None and "model.layers.0.post_attention_layernorm.weight" in \
        dict(model.named_parameters())
    assert torch.equal(layer.input_layernorm(x), _model(num_hidden_layers=1).model.layers[0].input_layernorm(x))
    ids = torch.randint(0, 64, (1, 1024), generator=torch.Generator().manual_seed(2))
    mlp_only = cpbench.use_tiled_mlp(_model(num_hidden_layers=1), 8)
    mlp_only.model.layers[0].mlp._cpbench_tiled_mlp.norm = None  # the MLP alone in the tile, the norm called whole
    del mlp_only.model.layers[0].post_attention_layernorm.forward
    assert _peak(model, ids) < _peak(mlp_only, ids)


def test_auto_tiles_keep_a_tile_within_the_bound():
    assert auto_tiles(1024, 14336, 2) == 1
    assert auto_tiles(512 * 1024, 14336, 2) == 14  # 14 GiB of [tokens, intermediate] in 1 GiB tiles
    assert auto_tiles(512 * 1024, 14336, 2, tile_bytes=1 << 28) == 56


def test_no_grad_runs_untiled_and_refusals():
    model = cpbench.use_tiled_mlp(_model(), 4)
    calls = []
    original = model.model.layers[0].mlp._cpbench_tiled_mlp.original
    model.model.layers[0].mlp._cpbench_tiled_mlp.original = lambda x: calls.append(x.shape) or original(x)
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 8, dtype=torch.long))
    assert calls == [torch.Size([1, 8, 64])]  # one call: nothing to recompute without a backward
    with pytest.raises(ValueError, match="`tiles` must be 'auto' or an integer >= 1, got 0"):
        cpbench.use_tiled_mlp(model, 0)
    with pytest.raises(ValueError, match="no decoder-layer MLP"):
        cpbench.use_tiled_mlp(torch.nn.Linear(2, 2), 2)
