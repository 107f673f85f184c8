"""The causal-aware FLOP count, against hand counts."""

from __future__ import annotations

import pytest

from cpbench.harness.flops import causal_pairs, forward_flops, peak_flops, train_step_flops
from cpbench.harness.presets import PRESETS, get_preset


def test_causal_pairs():
    assert causal_pairs(4) == 4 + 3 + 2 + 1
    assert causal_pairs(5, window=2) == 1 + 2 + 2 + 2 + 2
    assert causal_pairs(5, window=5) == causal_pairs(5) == causal_pairs(5, window=100)
    assert causal_pairs(1000) / 1000**2 == pytest.approx(0.5, abs=1e-3)  # causal ~ half the full square


def test_forward_flops_by_hand():
    c = get_preset("tiny-llama").config({"num_hidden_layers": 1})
    s, h, inter, v, heads, kv, d = 8, 64, 128, 256, 4, 2, 16
    dense = 2 * s * (h * heads * d + 2 * h * kv * d + heads * d * h + 3 * h * inter)
    attention = 4 * causal_pairs(s) * heads * d
    assert forward_flops(c, s) == dense + 2 * s * h * v + attention
    assert train_step_flops(c, s) == 3 * forward_flops(c, s)
    assert forward_flops(c, s, batch_size=3) == 3 * forward_flops(c, s)


def test_sliding_windows_count_fewer_pairs():
    full = get_preset("tiny-llama").config()
    mistral = get_preset("tiny-mistral").config()  # same sizes, a 64-token window
    gemma = get_preset("tiny-gemma3").config()  # one sliding, one full layer
    assert forward_flops(mistral, 64) == forward_flops(full, 64)  # the window covers the sequence
    assert forward_flops(mistral, 4096) < forward_flops(full, 4096)
    all_full = get_preset("tiny-gemma3").config({"layer_types": ["full_attention"] * 2})
    assert gemma.layer_types == ["sliding_attention", "full_attention"]
    saved = forward_flops(all_full, 4096) - forward_flops(gemma, 4096)
    assert saved == 4 * (causal_pairs(4096) - causal_pairs(4096, 64)) * 4 * 16  # one layer's pairs, 4 heads x 16


def test_real_presets_have_their_published_sizes():
    n = {name: p.config() for name, p in PRESETS.items()}
    assert (n["qwen3-0.6b"].hidden_size, n["qwen3-0.6b"].num_hidden_layers) == (1024, 28)
    assert (n["llama-3-8b"].intermediate_size, n["llama-3-8b"].vocab_size) == (14336, 128256)
    assert n["mistral-7b"].sliding_window == 4096
    assert n["gemma3-1b"].layer_types.count("full_attention") == 26 // 6
    # ~6 N FLOPs per token for a training step, N the non-embedding parameters, at short lengths
    c = n["llama-3-8b"]
    assert train_step_flops(c, 1) / 1 == pytest.approx(6 * 7.5e9, rel=0.1)


def test_peak_flops_table():
    assert peak_flops("NVIDIA H100 80GB HBM3", "bfloat16") == 989e12
    assert peak_flops("Intel(R) Xeon(R)", "float32") is None and peak_flops(None, "float32") is None
