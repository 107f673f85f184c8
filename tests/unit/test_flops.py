"""The mask-aware FLOP count (causal, windows, packed documents, padding) against hand counts; the peak table."""

from __future__ import annotations

import pytest

from cpbench.harness.measure.flops import (
    PEAK_FLOPS,
    BatchMaskCount,
    causal_pairs,
    forward_flops,
    no_peak_reason,
    peak_flops,
    train_step_flops,
)
from cpbench.harness.suite.presets import PRESETS, get_preset


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


def test_peak_flops_match_exact_device_names():
    # NVL parts start with their SXM sibling's name but have a lower peak (data sheets: 1,671 vs 1,979 sparse)
    assert peak_flops("NVIDIA H200", "bfloat16") == 989e12 and peak_flops("NVIDIA H200 NVL", "bfloat16") == 835e12
    assert peak_flops("NVIDIA H100 NVL", "bfloat16") == 835e12 and peak_flops("NVIDIA H100 PCIe", "bfloat16") == 756e12
    for a100 in ("NVIDIA A100-SXM4-40GB", "NVIDIA A100-SXM4-80GB", "NVIDIA A100-PCIE-40GB", "NVIDIA A100 80GB PCIe"):
        assert peak_flops(a100, "bfloat16") == 312e12 and peak_flops(a100, "float32") == 19.5e12, a100
    assert peak_flops("NVIDIA B200", "bfloat16") == 2250e12 and peak_flops("NVIDIA L40S", "float16") == 362.05e12
    # a MIG slice, or a name that merely starts with a known one, is not that GPU
    assert peak_flops("NVIDIA A100-SXM4-40GB MIG 3g.20gb", "bfloat16") is None
    assert peak_flops("NVIDIA H200 NVL-X", "bfloat16") is None
    assert all(p.source and p.bfloat16 > p.float32 > 0 for p in PEAK_FLOPS.values())


def test_an_unknown_peak_says_why():
    assert no_peak_reason("NVIDIA H200", "bfloat16") is None
    why = no_peak_reason("NVIDIA RTX 9090", "bfloat16")
    assert "mfu is null" in why and "'NVIDIA RTX 9090'" in why and "PEAK_FLOPS" in why
    assert "no float8 peak" in no_peak_reason("NVIDIA H200", "float8")


def _tiny_one_layer(**overrides):
    return get_preset("tiny-llama").config({"num_hidden_layers": 1, **overrides})


def _by_hand(tokens: int, pairs: int) -> int:
    """tiny-llama, one layer: h 64, intermediate 128, vocab 256, 4 heads, 2 kv heads, head dim 16."""
    h, inter, v, heads, kv, d = 64, 128, 256, 4, 2, 16
    dense = 2 * tokens * (h * heads * d + 2 * h * kv * d + heads * d * h + 3 * h * inter)
    return dense + 2 * tokens * h * v + 4 * pairs * heads * d


def test_packed_rows_count_each_documents_pairs():
    import torch

    c = _tiny_one_layer()
    positions = torch.arange(64) % 16  # four documents of 16 a row, as the harness packs them
    flops = forward_flops(c, 64, 2, position_ids=positions.expand(2, -1))
    assert flops == _by_hand(2 * 64, 2 * 4 * causal_pairs(16))
    assert flops < forward_flops(c, 64, 2)  # the whole-row count was ~4x too many attention pairs
    # documents of different lengths, in different rows
    rows = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1], [0, 1, 2, 0, 1, 2, 3, 4]])
    assert BatchMaskCount(8, 2, rows).pairs() == causal_pairs(6) + causal_pairs(2) + causal_pairs(3) + causal_pairs(5)


def test_windows_apply_within_a_document():
    import torch

    positions = torch.tensor([[*range(10), *range(6)]])
    count = BatchMaskCount(16, 1, positions)
    assert count.pairs(4) == causal_pairs(10, 4) + causal_pairs(6, 4)
    # a window does not reach back into the previous document: 3 + 3 tokens, window 4
    assert BatchMaskCount(6, 1, torch.tensor([0, 1, 2, 0, 1, 2])).pairs(4) == 2 * causal_pairs(3) < causal_pairs(6, 4)
    mistral = get_preset("tiny-mistral").config({"num_hidden_layers": 1, "sliding_window": 4})
    assert forward_flops(mistral, 16, position_ids=positions) == _by_hand(16, count.pairs(4))
    assert forward_flops(_tiny_one_layer(), 16, position_ids=positions) == _by_hand(16, count.pairs())  # no window


def test_padded_tokens_are_neither_queries_nor_keys():
    import torch

    c = _tiny_one_layer()
    mask = torch.ones(2, 64, dtype=torch.long)
    mask[0, 48:] = 0  # right padding, as the harness pads every other row
    assert forward_flops(c, 64, 2, attention_mask=mask) == _by_hand(48 + 64, causal_pairs(48) + causal_pairs(64))
    left = torch.tensor([[0, 0, 1, 1, 1]])
    assert BatchMaskCount(5, 1, attention_mask=left).pairs() == causal_pairs(3)
    assert BatchMaskCount(5, 1, attention_mask=left).tokens == 3
    # transformers reads documents only when no 2-D mask is given: restarting positions + a mask = one document
    assert BatchMaskCount(6, 1, torch.tensor([0, 1, 2, 0, 1, 2]), torch.ones(1, 6)).pairs() == causal_pairs(6)


def test_a_batch_of_the_wrong_shape_is_refused():
    import torch

    with pytest.raises(ValueError, match=r"position_ids has shape \(2, 8\).*\[batch_size, seq_len\] = \[3, 8\]"):
        forward_flops(_tiny_one_layer(), 8, 3, position_ids=torch.zeros(2, 8, dtype=torch.long))


@pytest.mark.parametrize("kind,pairs,tokens", [
    ("plain", 2 * causal_pairs(64), 128),
    ("packed", 2 * 4 * causal_pairs(16), 128),
    ("padded", causal_pairs(48) + causal_pairs(64), 112),
])
def test_the_harness_counts_the_batch_it_runs(kind, pairs, tokens):
    from cpbench.harness.run import rows
    from cpbench.harness.suite.spec import load_suite

    text = (f'name = "t"\nmodel = "tiny-llama"\nseq_lens = [64]\ncp_sizes = [2]\nbatch_size = 2\n'
            f'batch_kind = "{kind}"\nworld_size = 4\nmodel_overrides = {{num_hidden_layers = 1}}\n')
    point = load_suite("t.toml", text=text).points()[0]
    assert (point.cp_size, point.world_size) == (2, 4)  # two data-parallel replicas, each with its own batch
    assert rows.model_flops(point, _tiny_one_layer()) == 2 * 3 * _by_hand(tokens, pairs)


def _cuda_record(rank: int) -> dict:
    return {"rank": rank, "status": "ok", "peak_bytes": 100, "reserved_bytes": 200, "alloc_retries": 0,
            "device_peak_bytes": 300, "rss_peak_bytes": 1000, "params_bytes": 10, "grads_bytes": 10,
            "optimizer_bytes": 20, "activations_bytes": 60, "step_times_s": [0.5, 0.5], "num_params": 5,
            "model_type": "llama", "parity_mode": "full", "notes": [],
            "parity": {"parity_status": "pass", "parity_detail": None}}


def test_a_null_mfu_carries_its_reason_in_the_row():
    from cpbench.harness.run import rows
    from cpbench.harness.suite.spec import load_suite

    text = 'name = "t"\nmodel = "tiny-llama"\nseq_lens = [64]\ncp_sizes = [1]\ndevice = "cuda"\ndtype = "bfloat16"\n'
    point = load_suite("t.toml", text=text).points()[0]

    def row(device_name):
        ctx = {"run_id": "r", "env": {"device_name": device_name}, "budget": None}
        return rows.measured_row(point, [_cuda_record(0)], 1.0, **ctx)

    known, unknown = row("NVIDIA H200 NVL"), row("NVIDIA H200 NVL-X")
    assert known["mfu"] == pytest.approx(known["flops_per_step"] / 0.5 / 835e12) and known["status_detail"] is None
    assert unknown["mfu"] is None and unknown["tflops_per_s"] == known["tflops_per_s"]
    assert "mfu is null" in unknown["status_detail"] and "'NVIDIA H200 NVL-X'" in unknown["status_detail"]


def _tiny(family: str):
    from cpbench.cp.families.tiny import tiny_config

    return tiny_config(family)


def test_dense_work_is_read_from_the_modules_of_any_family():
    from cpbench.harness.measure.flops import matmul_work

    # GPT-NeoX: fused qkv, a two-matmul MLP of 4 x 64... as its module builds it, no num_key_value_heads in its config
    neox = _tiny("gpt_neox")
    h, inter, v = neox.hidden_size, neox.intermediate_size, neox.vocab_size
    assert not hasattr(neox, "num_key_value_heads")
    assert matmul_work(neox).per_token == neox.num_hidden_layers * (3 * h * h + h * h + 2 * h * inter) + h * v
    # a Llama-shaped model: the config formula it always had (q, k, v, o, gate, up, down, the head)
    llama = get_preset("tiny-llama").config({"num_hidden_layers": 1})
    q, kv = 4 * 16, 2 * 16
    assert matmul_work(llama).per_token == 64 * q + 2 * 64 * kv + q * 64 + 3 * 64 * 128 + 64 * 256


def test_experts_count_at_the_share_a_token_is_routed_to():
    from cpbench.harness.measure.flops import matmul_work

    import torch
    from transformers import AutoModelForCausalLM

    moe = _tiny("qwen3_moe")  # 4 experts, 2 per token
    h, i, e, k = moe.hidden_size, moe.moe_intermediate_size, moe.num_experts, moe.num_experts_per_tok
    with torch.device("meta"):
        sparse = sum(name.endswith(".experts") for name, _ in AutoModelForCausalLM.from_config(moe).named_modules())
    assert sparse >= 1
    work = matmul_work(moe).per_token
    every = matmul_work(moe.__class__(**{**moe.to_dict(), "num_experts_per_tok": e})).per_token
    assert every - work == sparse * (e - k) * 3 * h * i  # the experts a token is not routed to


def test_latent_attention_counts_its_query_key_and_value_widths():
    from cpbench.harness.measure.flops import matmul_work

    mla = _tiny("deepseek_v3")
    qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    assert qk != mla.v_head_dim
    assert matmul_work(mla).attention_width == (mla.num_attention_heads * (qk + mla.v_head_dim),) * 2


def test_stacked_weights_no_router_explains_are_not_counted():
    import torch

    from cpbench.harness.measure.flops import _routed

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = torch.nn.Module()
            self.experts.w = torch.nn.Parameter(torch.zeros(4, 8, 8))

    block = Block()
    with pytest.raises(ValueError, match="how many experts a token runs"):
        _routed(block, get_preset("tiny-llama").config())
    block.top_k = 3
    assert _routed(block, get_preset("tiny-llama").config()) == 3
