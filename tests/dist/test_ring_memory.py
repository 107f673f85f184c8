"""Activation memory of ring attention shrinks with cp: a benchmark-style check, not a timed test.

One attention layer of a tiny Llama (hidden 256, 8 query heads, 2 kv heads) at 4096 tokens, forward and
backward, tracked with torch's MemTracker (the peak of live tensor bytes, per rank): at cp=2 with cp_ring the
peak must be at most 0.6 x the cp=1 peak (the model's own sdpa on the whole sequence). Perfect halving gives 0.5;
the ring adds only O(S/cp) buffers (the K/V block in flight and the dK/dV accumulators).
"""

from __future__ import annotations

import pytest
import torch

SEQ = 4096
MAX_RATIO = 0.6


def tiny_attention_model():
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=256, intermediate_size=64, num_hidden_layers=1, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=SEQ,
    )
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)


def attention_peak_bytes(model, layout=None) -> int:
    """Peak tracked bytes of one attention layer's forward+backward on this rank's tokens."""
    from torch.distributed._tools.mem_tracker import MemTracker

    attn = model.model.layers[0].self_attn
    full = torch.randn(1, SEQ, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    position_ids = torch.arange(SEQ)[None]
    full_cos, full_sin = model.model.rotary_emb(full, position_ids)
    kwargs = {} if layout is None else {"cp_layout": layout}
    local = [x if layout is None else layout.cut(x, dim=1) for x in (full, full_cos, full_sin)]
    tracker = MemTracker()
    tracker.track_external(attn)
    with tracker:
        # This rank's inputs, as its decoder layer hands them over, counted from here on (cloned inside the
        # tracker: a view would carry the whole sequence's storage).
        hidden, cos, sin = (x.clone() for x in local)
        hidden.requires_grad_()
        out, _ = attn(hidden, position_embeddings=(cos, sin), attention_mask=None, position_ids=position_ids, **kwargs)
        out.sum().backward()
        del out, hidden, cos, sin
    return max(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values())


STYLES = ("cp_ring", "cp_ring_zigzag")


def memory_worker() -> dict:
    import torch.distributed as dist

    from cpbench.cp import STYLES as REGISTRY
    from cpbench.cp import SequenceLayout
    from cpbench.cp.apply import AttentionBinding
    from cpbench.cp.hf_compat import bind_attention

    dist.init_process_group("gloo")
    group = dist.group.WORLD
    cp = dist.get_world_size(group)
    peaks = {"cp1": attention_peak_bytes(tiny_attention_model())}
    for style in STYLES:
        model = tiny_attention_model()
        bind_attention(model.model.layers[0].self_attn, AttentionBinding(REGISTRY.get(style), group))
        layout = SequenceLayout(SEQ, cp, dist.get_rank(group), REGISTRY.get(style).layout)
        peaks[style] = attention_peak_bytes(model, layout)
    return peaks


@pytest.fixture(scope="module")
def peaks():
    from tests.spawn import run_ranks

    return run_ranks(memory_worker, 2, timeout=300)


@pytest.mark.parametrize("style", STYLES)
def test_ring_attention_memory_halves(peaks, style, capsys):
    per_rank = peaks
    worst = max(r[style] for r in per_rank)  # memory: the max over ranks, never a sum or rank 0 alone
    whole = max(r["cp1"] for r in per_rank)
    with capsys.disabled():
        print(f"\n{style} attention-layer peak: cp=1 {whole / 2**20:.2f} MiB, cp=2 {worst / 2**20:.2f} MiB "
              f"(ratio {worst / whole:.3f}, per rank {[r[style] for r in per_rank]})", end="")
    assert worst <= MAX_RATIO * whole, f"cp=2 peak {worst} B > {MAX_RATIO} x cp=1 peak {whole} B"
