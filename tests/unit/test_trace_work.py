"""What the op trace counts for one kernel call (flops.py, work.py, trace.py): the causal flag read where each kernel's
schema has it, each kernel's causal alignment, grouped and MLA shapes, and what a flash backend's call computes."""

from __future__ import annotations

import torch

from cpbench.harness.project import flops as kernel_flops


def test_every_aten_attention_kernel_reads_its_causal_flag_where_its_schema_puts_it():
    # the cuDNN backward's is_causal is argument 14 (its cum_seq / max_q / max_k arguments come before it), not 9
    for name, spec in kernel_flops.ATTENTION.items():
        if not name.startswith("aten."):
            continue  # flash-attn's ops: not installed here; their positions are cpbench/cp/ring/flash.py's calls
        schema = getattr(torch.ops.aten, name.split(".", 1)[1]).default._schema
        arg_name, at = spec.causal
        assert schema.arguments[at].name == arg_name, (name, at, schema.arguments[at].name)
        if spec.offsets_at is not None:
            assert schema.arguments[spec.offsets_at].name in ("cum_seq_q", "cu_seqlens_q"), name


def _bhsd(batch=1, heads=2, seq=4, dim=8):
    return torch.empty(batch, heads, seq, dim, device="meta")


def test_the_cudnn_backward_counts_causal_pairs_from_its_own_flag():
    q = _bhsd()
    args = [q, q, q, q, q, q, None, None, None, None, None, 4, 4, 0.0, True]  # grad_out, q, k, v, out, lse, ...
    causal, _ = kernel_flops.attention("aten._scaled_dot_product_cudnn_attention_backward", tuple(args))
    args[14] = False
    full, _ = kernel_flops.attention("aten._scaled_dot_product_cudnn_attention_backward", tuple(args))
    assert causal == 2.5 * 4 * 10 * 2 * 8 and full == 2.5 * 4 * 16 * 2 * 8


def test_the_memory_efficient_kernel_counts_its_causal_mask_types():
    t = torch.empty(1, 4, 2, 8, device="meta")  # [batch, seq, heads, dim]
    args = [t, t, t, None, None, None, None, None, 0.0, 0]
    none = kernel_flops.attention("aten._efficient_attention_forward", tuple(args))[0]
    args[9] = 1  # causal from the top left
    top_left = kernel_flops.attention("aten._efficient_attention_forward", tuple(args))[0]
    assert none == 4 * 16 * 2 * 8 and top_left == 4 * 10 * 2 * 8
    q = torch.empty(1, 2, 2, 8, device="meta")  # 2 queries over 4 keys from the bottom right: 3 + 4 pairs
    args = [q, t, t, None, None, None, None, None, 0.0, 2]
    assert kernel_flops.attention("aten._efficient_attention_forward", tuple(args))[0] == 4 * 7 * 2 * 8
    # its varlen form keeps q 4-D ([1, tokens, heads, dim]) beside cu_seqlens: documents of 3 and 1 tokens, causal
    offsets = torch.tensor([0, 3, 4])
    args = [t, t, t, None, offsets, offsets, 3, 3, 0.0, 1]
    assert kernel_flops.attention("aten._efficient_attention_forward", tuple(args))[0] == 4 * (6 + 1) * 2 * 8


def test_flash_kernels_count_non_square_causal_calls_from_the_bottom_right():
    q, k = torch.empty(1, 2, 2, 8, device="meta"), torch.empty(1, 4, 2, 8, device="meta")
    args = (q, k, k, None, None, 2, 4, 0.0, True)
    assert kernel_flops.attention("aten._flash_attention_forward", args)[0] == 4 * (3 + 4) * 2 * 8
    fa = (q, k, k, 0.0, 1.0, True)  # flash-attn's _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal)
    assert kernel_flops.attention("flash_attn._flash_attn_forward", fa)[0] == 4 * 7 * 2 * 8
    # flash-attn's backward: causal is argument 11 (after dq, dk, dv, dropout_p, softmax_scale)
    bwd = (q, q, k, k, q, None, q, k, k, 0.0, 1.0, True)
    assert kernel_flops.attention("flash_attn._flash_attn_backward", bwd)[0] == 2.5 * 4 * 7 * 2 * 8


def test_a_sliding_window_counts_the_pairs_its_window_keeps_as_the_flash_kernels_read_it():
    # 256 queries, causal, a window of 63 keys back (flash's window_size_left): query i sees min(i + 1, 64) keys
    windowed = 64 * 65 // 2 + (256 - 64) * 64
    assert kernel_flops.pairs_within(256, 256, True, "bottom_right", 63, -1) == windowed
    t = torch.empty(1, 256, 2, 8, device="meta")  # [batch, seq, heads, dim]
    aten = (t, t, t, None, None, 256, 256, 0.0, True, False)  # aten's flash kernel: the window by keyword only
    flops, shape = kernel_flops.attention("aten._flash_attention_forward", aten,
                                          {"window_size_left": 63, "window_size_right": None})
    assert flops == 4 * windowed * 2 * 8 and shape[1] == 64  # the keys its kernel loops over: the window's
    full = kernel_flops.attention("aten._flash_attention_forward", aten)[0]
    assert full == 4 * (256 * 257 // 2) * 2 * 8
    # flash-attn's varlen call, per document (100 and 156 tokens), window (63, 0) at 10 and 11
    tokens, offsets = torch.empty(256, 2, 8, device="meta"), torch.tensor([0, 100, 256])
    varlen = (tokens, tokens, tokens, offsets, offsets, 156, 156, 0.0, 1.0, True, 63, 0)
    per_doc = sum(kernel_flops.pairs_within(n, n, True, "bottom_right", 63, 0) for n in (100, 156))
    assert kernel_flops.attention("flash_attn._flash_attn_varlen_forward", varlen)[0] == 4 * per_doc * 2 * 8
    # not causal, 20 keys back and none bounding it forward (a ring tile's (left, -1)): query i sees keys
    # max(0, i - 20) .. 255; FlashAttention-3's backward reads its window at 17 and 18
    grad = [t, t, t, t, t, None, None, None, None, None, 256, 256, None, None, None, 1.0, False, 20, -1]
    got = kernel_flops.attention("flash_attn_3._flash_attn_backward", tuple(grad))[0]
    assert got == 2 * kernel_flops.pairs_within(256, 256, False, "bottom_right", 20, -1) * 2 * (3 * 8 + 2 * 8)
    assert kernel_flops.pairs_within(256, 256, False, "bottom_right", 20, -1) == sum(256 - max(0, i - 20)
                                                                                     for i in range(256))


def test_attention_with_a_value_head_unlike_the_query_head_counts_both():
    q, v = _bhsd(dim=192), _bhsd(dim=128)  # multi-head latent attention: qk 192, v 128
    call = (q, q, v, None, False, 0.0, False)
    flops, shape = kernel_flops.attention("aten._scaled_dot_product_cudnn_attention", call)
    assert flops == 2 * 16 * 2 * (192 + 128) and shape == (4, 4, 192, False, 2)
    # its backward: QK^T again, dQ and dK over the qk dim, dV and dP over v's: 2 x pairs x heads x (3 x 192 + 2 x 128)
    grad = (v, q, q, v, v, None, None, None, 4, 4, 0.0, False)
    flops = kernel_flops.attention("aten._scaled_dot_product_cudnn_attention_backward", grad)[0]
    assert flops == 2 * 16 * 2 * (3 * 192 + 2 * 128)


def test_grouped_gemms_count_every_group_once():
    x, w, offs = torch.empty(96, 16, device="meta"), torch.empty(8, 16, 32, device="meta"), torch.empty(8)
    flops, shape = kernel_flops.gemm("aten._grouped_mm", (x, w, offs))
    assert flops == 2 * 96 * 16 * 32 and shape == (12, 32, 16, 8)  # 96 token rows over 8 experts
    # the weight gradient: x^T [16, 96] with grad [96, 32], the contraction grouped: 8 outputs of [16, 32]
    flops, shape = kernel_flops.gemm("aten._grouped_mm", (torch.empty(16, 96, device="meta"),
                                                  torch.empty(96, 32, device="meta"), offs))
    assert flops == 2 * 16 * 96 * 32 and shape == (16, 32, 12, 8)


def test_a_flash_backends_masked_call_counts_what_its_flash_path_computes():
    # A flash_attention_2 point runs as sdpa (projection.runs_as); where its model hands SDPA a mask (a sliding
    # window, packed documents) transformers' flash path calls the kernel causal with a window, or varlen per
    # document (_flash_attention_forward): counted so, forward and backward, not as the mask's whole square.
    from cpbench.harness.project.projection import project_rank
    from cpbench.harness.suite.spec import load_suite

    def attention_ops(model, attn, extra=""):
        text = (f'name = "t"\nmodel = "{model}"\nseq_lens = [512]\ncp_sizes = [1]\nworld_size = 1\n'
                f'dtype = "bfloat16"\ndevice = "cuda"\nattn_implementations = ["{attn}"]\n'
                'model_overrides = {num_hidden_layers = 1}\n' + extra)
        ops = project_rank(load_suite("t.toml", text=text).points()[0], 0, keep_trace=True)["trace"]
        return [o for o in ops if o.kind.startswith("attention")]

    heads, dim = 4, 16  # the tiny models'
    window = kernel_flops.pairs_within(512, 512, True, "bottom_right", 63, -1)  # tiny-mistral's sliding window, 64
    documents = sum(n * (n + 1) // 2 for n in (128, 128, 256))
    for model, extra, pairs in (("tiny-mistral", "", window),
                                ("tiny-llama", "documents = [128, 128, 256]\n", documents)):
        forward, backward = attention_ops(model, "flash_attention_2", extra)
        assert forward.kind == "attention_forward" and forward.flops == 2 * pairs * heads * 2 * dim, model
        assert backward.kind == "attention_backward" and backward.flops == 2 * pairs * heads * 5 * dim, model
    # a padded batch: the flash path unpads its rows (_upad_input) and runs varlen over each row's own tokens; the
    # batch pads every other row by a quarter (step.make_batch), none of which a kernel computes
    for size, rows in ((2, 512 * 513 // 2 + 384 * 385 // 2), (1, 384 * 385 // 2)):
        forward, backward = attention_ops("tiny-llama", "flash_attention_2",
                                          f'batch_size = {size}\nbatch_kind = "padded"\n')
        assert forward.flops == 2 * rows * heads * 2 * dim and backward.flops == 2 * rows * heads * 5 * dim
    # SDPA itself runs a masked call on the memory-efficient kernel, which computes the whole square
    forward = attention_ops("tiny-mistral", "sdpa")[0]
    assert forward.kind == "attention_efficient_forward" and forward.flops == 2 * 512 * 512 * heads * 2 * dim


def test_the_flash_paths_view_of_a_call_is_transformers_own():
    # transformers' flash path: the call's is_causal before the module's, a window of sliding_window - 1 on each
    # side where the keys outrun it (the right one hidden by causality), varlen per document where a batch of
    # one's positions restart
    class Attention:
        is_causal = True

    view = kernel_flops.flash_as_called
    assert view(Attention(), 512, 64, None) == (True, 63, -1, None)
    assert view(Attention(), 512, 64, None, is_causal=False) == (False, 63, 63, None)
    assert view(Attention(), 64, 64, None) == (True, -1, -1, None)  # the keys within the window: no window
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    assert view(Attention(), 9, None, positions)[3] == [3, 2, 4]
    assert view(Attention(), 9, None, torch.arange(9)[None])[3] is None  # one document
    assert view(Attention(), 9, None, positions.expand(2, 9))[3] is None  # a batch of two is not varlen
    # a window on a call that is not causal reaches both ways: query i sees keys i - 63 .. i + 63
    q = torch.empty(1, 2, 512, 8, device="meta")
    call = (q, q, q, 0.0, False)
    flops = kernel_flops.attention("aten._scaled_dot_product_flash_attention_for_cpu", call, None,
                                   view(Attention(), 512, 64, None, is_causal=False))[0]
    both = sum(min(511, i + 63) - max(0, i - 63) + 1 for i in range(512))
    assert flops == 2 * both * 2 * 16


def test_values_of_another_head_dim_run_a_fused_kernel_in_a_cuda_projection(tmp_path):
    # multi-head latent attention (DeepSeek: q/k 192, v 128): CUDA's SDPA runs a fused kernel; torch's CPU flash
    # kernel wants one head dim, and the math path would count S x S GEMMs and hold the scores. A CUDA point's values
    # are padded to the queries' head dim for the call (projection.values_padded), as transformers' flash path pads
    from transformers import DeepseekV3Config

    from cpbench.harness.project.projection import project_rank
    from cpbench.harness.suite.spec import load_suite

    DeepseekV3Config(vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                     num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32,
                     qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, max_position_embeddings=1024,
                     n_group=1, topk_group=1).save_pretrained(tmp_path)

    def trace(device):
        text = (f'name = "t"\nmodel = "{tmp_path}"\nseq_lens = [512]\ncp_sizes = [1]\nworld_size = 1\n'
                f'dtype = "bfloat16"\ndevice = "{device}"\n')
        return project_rank(load_suite("t.toml", text=text).points()[0], 0, keep_trace=True)["trace"]

    ops = trace("cuda")
    attention = [o for o in ops if o.kind.startswith("attention")]
    square = [o for o in ops if o.kind == "gemm" and o.shape[:2] == (512, 512)]
    assert len(attention) == 4 and not square  # two layers' forward and backward, no S x S product
    forward = next(o for o in attention if o.kind.endswith("_forward"))
    assert forward.flops == 2 * (512 * 513 // 2) * 4 * (16 + 16)  # causal, at the padded head dim
    # a CPU point runs what the CPU runs: SDPA's math path, its S x S products
    assert any(o.kind == "gemm" and o.shape[:2] == (512, 512) for o in trace("cpu"))
