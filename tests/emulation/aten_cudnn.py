"""aten's cuDNN attention ops, emulated: `_scaled_dot_product_cudnn_attention` and its backward, each taking exactly
the real op's schema, returning what the op returns on the GPU `TARGET` names (default an H100 with torch 2.13's
cuDNN 9.20), computed in fp32.

Sources (pytorch; the installed torch 2.13.0 ships no .cu/.cpp, so these are the nearest copies, as listed in
/work/notes/kernels.md): attention.cu `_scaled_dot_product_cudnn_attention_cuda` and `_cudnn_attention_forward`
("ATTN"); attention_backward.cu `_cudnn_attention_backward` ("BWD"); cudnn/MHA.cpp `run_cudnn_SDP_fprop`,
`run_cudnn_SDP_bprop`, `build_graph`, `alloc_with_matching_layout` ("MHA"); sdp_utils.cpp `can_use_cudnn_attention`
and its checks ("SDP", @001f694a); attention.cpp `convert_boolean_attn_mask_cudnn`; torch/_meta_registrations.py
(2.13.0) for the outputs; cudnn-frontend graph_properties.h / softmax.h for the mask alignment and the LSE.

The ring calls the op directly, where SDPA would call it only after `can_use_cudnn_attention`; the emulation holds
every call to SDPA's rules too (SDP rows), so a tile SDPA would never send to cuDNN fails here. Two assumptions are
conservative, not quoted rules (cuDNN's own `check_support` is closed source): 16-byte aligned pointers and strides
for q/k/v/out/grad_out (the rule PyTorch states for cuDNN's varlen path, MHA.cpp has_aligned_varlen_layout), and a
row whose scores are all -inf gives NaN (the reason SDPA converts bool masks to -65504 for cuDNN: "workaround -inf
issue").
"""

from __future__ import annotations

import torch

from ._common import (
    INF,
    Undefined,
    aligned,
    attention_grads,
    bind,
    check,
    contract_rows,
    emulated,
    repeat_kv,
    storage_read,
)

ATEN = torch.ops.aten
SDP, MHA = "sdp_utils.cpp (@001f694a)", "cudnn/MHA.cpp"
ATTN, BWD = "attention.cu _cudnn_attention_forward", "attention_backward.cu _cudnn_attention_backward"
TARGET = {"capability": (9, 0), "cudnn": 92000}  # the GPU the emulated op runs on (tests may change it)
DTYPE = "Expected query, key and value to all be of dtype: {Half, BFloat16}. Got Query dtype: "
HEADS = "The number of heads in key/value must divide number of heads in query."
ALIGN = "cuDNN SDPA expected 16-byte-aligned storage and strides, with a contiguous last dimension"


def _head_dim_limit(d_qk: int, d_v: int) -> int:
    """SDP check_cudnn_tensor_shapes: 128; 256 on sm90/sm10x with cuDNN > 9.22 (and frontend >= 1.24, assumed with
    it here); 192 for (192, 128) on sm90/sm10x with cuDNN >= 9.11; sm107 with cuDNN <= 9.25 has no d256."""
    cap, cudnn = TARGET["capability"], TARGET["cudnn"]
    sm90_or_10x = cap == (9, 0) or cap[0] == 10
    unsupported_sm107 = cap == (10, 7) and cudnn <= 92500
    if sm90_or_10x and not unsupported_sm107 and cudnn > 92200:
        return 256
    if sm90_or_10x and cudnn >= 91100 and (d_qk, d_v) == (192, 128):
        return 192
    return 128


def _can_use(q, k, v, bias, dropout: float):
    """The rules of SDP can_use_cudnn_attention a direct call can break, in its order."""
    deterministic = torch.are_deterministic_algorithms_enabled() and \
        not torch.is_deterministic_algorithms_warn_only_enabled()
    check(torch.backends.cuda.cudnn_sdp_enabled(), "cuDNN attention has been runtime disabled.")
    for x in (q, k, v):
        check(x.dim() == 4, "All fused kernels requires query, key and value to be 4 dimensional")
    check(not deterministic, "cuDNN SDPA is not deterministic.")
    check(q.dtype in (torch.float16, torch.bfloat16) and k.dtype == v.dtype == q.dtype, f"{DTYPE}{q.dtype}")
    if bias is not None:
        check(not bias.requires_grad, "cuDNN SDPA does not support an attn_mask that requires grad")
        check(bias.dim() in (2, 4) and bias.size(-2) in (q.size(2), 1) and bias.size(-1) in (k.size(2), 1)
              and (bias.dim() == 2 or (bias.size(0) in (q.size(0), 1) and bias.size(1) in (q.size(1), 1))),
              "Please use the following attn mask shapes: 2d - ({Q_seq_len, 1}  x {KV_seq_len, 1}); 4d - "
              "({Batch, 1} x {Num_heads, 1} x {Q_seq_len, 1}  x {KV_seq_len, 1})")
    check((8, 0) <= TARGET["capability"] <= (12, 1),
          "cuDNN MHA only supports gpu architectures in the range [sm80, sm121].")
    emulated(dropout == 0, "dropout")
    check(q.size(2) != 0 and k.size(2) != 0, "All fused kernels do not support zero seq_len_q or seq_len_kv.")
    for x in (q, k, v) + (() if bias is None else (bias,)):
        check(x.stride(-1) == 1 or x.size(-1) == 1,
              "All fused kernels require the last dimension of the input to have stride 1.")
    check(q.size(0) == k.size(0) == v.size(0), "For dense inputs, both fused kernels require query, key and value "
          "to have the same batch_size.")
    check(q.size(1) % k.size(1) == 0 and q.size(1) % v.size(1) == 0, HEADS)
    check(q.size(0) <= 65535 and q.size(1) <= 65535,
          "cuDNN SDPA does not support batch size or num_heads greater than 65535.")
    d_qk, d_v = q.size(3), v.size(3)
    limit = _head_dim_limit(d_qk, d_v)
    check(d_qk <= limit and d_v <= limit, f"head_dim should be no more than {limit}")
    check(d_qk % 8 == 0 and d_v % 8 == 0, "head_dim should be a multiple of 8")
    check(k.size(2) != 1, "cudnn SDPA does not support key/value sequence length 1.")


def _aligned(tensors):
    """The conservative alignment assumption (module docstring): 16 bytes = 8 fp16/bf16 elements."""
    for x in tensors:
        check(x.stride(-1) == 1 and aligned(x, 8) and all(s % 8 == 0 for s, n in zip(x.stride()[:-1], x.shape)
                                                            if n > 1), ALIGN)


def _bias(bias, q, k):
    """ATTN: rank 2 and 3 expand to (B, 1, Sq, Skv), rank 4 to (B, bias.size(1), Sq, Skv); read as q's dtype
    (MHA build_graph: the bias has the graph's io data type)."""
    if bias is None:
        return None
    if bias.dtype != q.dtype:
        raise Undefined(f"attn_bias is {bias.dtype}, read by the graph as {q.dtype}")
    b, sq, sk = q.size(0), q.size(2), k.size(2)
    heads = 1 if bias.dim() < 4 else bias.size(1)
    return bias.expand(b, heads, sq, sk).float()


def _scores(q, k, scale, bias, causal: bool):
    """fp32 scores, scaled then biased (cudnn-frontend composite SDPA order), causal TOP_LEFT (j <= i whatever the
    lengths: graph_properties.h set_causal_mask -> DiagonalAlignment_t::TOP_LEFT)."""
    s = q.float() @ repeat_kv(k, q.size(1)).transpose(-1, -2) * scale
    if bias is not None:
        s = s + bias
    if causal:
        s = s.masked_fill(torch.ones(q.size(2), k.size(2), dtype=torch.bool).triu(1), -INF)
    return s


def _softmax(s):
    """Stats = max + log(sum(exp(s - max))) (softmax.h CompositeSoftmaxNode), natural log; a row of only -inf has
    max -inf and gives NaN (the module docstring's assumption)."""
    m = s.amax(-1, keepdim=True)
    e = torch.exp(s - m)
    total = e.sum(-1, keepdim=True)
    return e / total, (m + torch.log(total))[..., 0]


def _matching_layout(like: torch.Tensor, shape) -> torch.Tensor:
    """MHA alloc_with_matching_layout: `like`'s stride order (stride 0 counted as the largest), dense."""
    order = sorted(range(4), key=lambda i: (-(like.stride(i) or 2**62), i))
    strides, step = [0] * 4, 1
    for i in reversed(order):
        strides[i] = step
        step *= shape[i]
    return torch.empty_strided(shape, strides, dtype=like.dtype)


def _scale(q, scale):
    return scale if scale is not None else q.size(-1) ** -0.5  # sdp::calculate_scale


def sdpa_cudnn(*args, **kwargs):
    """aten::_scaled_dot_product_cudnn_attention -> (output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
    philox_seed, philox_offset, debug_attn_mask)."""
    a = bind(ATEN._scaled_dot_product_cudnn_attention.default, args, kwargs)
    q, k, v, bias = a["query"], a["key"], a["value"], a["attn_bias"]
    _can_use(q, k, v, bias, a["dropout_p"])
    emulated(not a["return_debug_mask"], "debug mask")
    if k.size(2) != v.size(2):
        raise Undefined("key and value have different sequence lengths; the graph has one s_kv")
    _aligned((q, k, v))
    p, lse = _softmax(_scores(q, k, _scale(q, a["scale"]), _bias(bias, q, k), a["is_causal"]))
    out = _matching_layout(q, (q.size(0), q.size(1), q.size(2), v.size(3)))
    out.copy_(p @ repeat_kv(v, q.size(1)))
    stats = torch.empty(q.size(0), q.size(1), q.size(2), 1).copy_(lse[..., None]) if a["compute_log_sumexp"] \
        else None
    seed, offset = torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)
    return out, stats, None, None, q.size(2), k.size(2), seed, offset, None


def sdpa_cudnn_backward(*args, **kwargs):
    """aten::_scaled_dot_product_cudnn_attention_backward -> (grad_query, grad_key, grad_value)."""
    a = bind(ATEN._scaled_dot_product_cudnn_attention_backward.default, args, kwargs)
    q, k, v, out, dout, lse = (a[n] for n in ("query", "key", "value", "out", "grad_out", "logsumexp"))
    bias = a["attn_bias"]
    _can_use(q, k, v, bias, a["dropout_p"])
    emulated(a["cum_seq_q"] is None, "nested (varlen) backward")
    b, h, sq, _ = q.shape
    sk = k.size(2)
    if (a["max_q"], a["max_k"]) != (sq, sk):
        raise Undefined(f"the graph is built with s_q={a['max_q']}, s_kv={a['max_k']} for tensors of {sq}, {sk}")
    if dout.stride(-1) != 1:  # MHA run_cudnn_SDP_bprop (cuDNN >= 9.5.1): permute_to_matching_layout(o, dO)
        dout = _matching_layout(out, dout.shape).copy_(dout)
    _aligned((q, k, v, out, dout))
    for name, x in (("out", out), ("grad_out", dout)):
        if x.dtype != q.dtype:
            raise Undefined(f"{name} is {x.dtype}, read by the graph as {q.dtype}")
    if lse is None or lse.dtype != torch.float32:
        raise Undefined("logsumexp must be the fp32 Stats tensor the forward returned")
    check(lse.dim() == 4 and tuple(lse.shape) == (b, h, sq, 1),
          "cudnn_frontend: the Stats tensor does not match the graph's {b, h, s_q, 1}")
    stats = storage_read(lse, lse.shape, lse.stride(), "Stats read through its strides")[..., 0]
    scale = _scale(q, a["scale"])
    s = _scores(q, k, scale, _bias(bias, q, k), a["is_causal"])
    p = torch.exp(s - stats[..., None])
    delta = (dout.float() * out.float()).sum(-1)
    dq, dk_h, dv_h, _ = attention_grads(dout, q, k, v, p, delta, scale)
    g = h // k.size(1)
    dk = dk_h.unflatten(1, (k.size(1), g)).sum(2)  # summed in fp32 over the group, then rounded once
    dv = dv_h.unflatten(1, (v.size(1), g)).sum(2)
    # BWD: dq = empty_like(query), dk = empty_like(key), dv = empty_like(value): the inputs' strides
    return tuple(torch.empty_like(x).copy_(gr) for x, gr in ((q, dq), (k, dk), (v, dv)))


_FWD, _BWD = ("sdpa_cudnn",), ("sdpa_cudnn_backward",)
_ALL = _FWD + _BWD
_row = contract_rows("aten.cudnn.")

CONTRACT = [
    _row("schema", _ALL, "native_functions.yaml via op._schema", "arguments bind to the op's schema",
         "Unknown keyword argument", enforced="_common.bind"),
    _row("disabled", _ALL, f"{SDP} check_runtime_disabled_cudnn", "torch.backends.cuda.cudnn_sdp_enabled()",
         "cuDNN attention has been runtime disabled."),
    _row("dims", _ALL, "sdp_utils_cpp.h check_tensor_shapes", "4-D q/k/v",
         "All fused kernels requires query, key and value to be 4 dimensional"),
    _row("deterministic", _ALL, f"{SDP} check_cudnn_deterministic", "not use_deterministic_algorithms(True) without "
         "warn_only", "cuDNN SDPA is not deterministic."),
    _row("dtype", _ALL, "sdp_utils_cpp.h check_tensor_dtype (check_dtypes_low_precision)", "fp16/bf16, all alike",
         DTYPE),
    _row("bias_grad", _ALL, "sdp_utils_cpp.h check_attn_mask_shape", "attn_mask does not require grad",
         "does not support an attn_mask that requires grad"),
    _row("bias_shape", _ALL, "sdp_utils_cpp.h check_attn_mask_shape", "bias 2-D or 4-D ({B,1} x {H,1} x {Sq,1} x "
         "{Skv,1}); 3-D refused", "Please use the following attn mask shapes"),
    _row("arch", _ALL, f"{SDP} check_cudnn_hardware_support", "sm80..sm121",
         "cuDNN MHA only supports gpu architectures in the range [sm80, sm121]."),
    _row("nonzero", _ALL, "sdp_utils_cpp.h check_nonzero_sequence_lengths_dense", "S_q, S_kv > 0",
         "All fused kernels do not support zero seq_len_q or seq_len_kv."),
    _row("last_dim", _ALL, "sdp_utils_cpp.h check_last_dim_stride_equals_1_dense", "q/k/v/bias stride(-1) == 1",
         "All fused kernels require the last dimension of the input to have stride 1."),
    _row("batch", _ALL, "sdp_utils_cpp.h check_batch_size_and_num_heads_dense", "equal batch sizes",
         "to have the same batch_size"),
    _row("gqa", _ALL, "sdp_utils_cpp.h check_grouped_query_attention", "H_q % H_k == 0 and H_q % H_v == 0", HEADS),
    _row("limits", _ALL, f"{SDP} check_cudnn_tensor_shapes", "batch and heads <= 65535",
         "cuDNN SDPA does not support batch size or num_heads greater than 65535."),
    _row("head_max", _ALL, f"{SDP} check_cudnn_tensor_shapes", "d_qk, d_v <= 128 (256 / 192 by GPU and cuDNN)",
         "head_dim should be no more than"),
    _row("head_mult8", _ALL, f"{SDP} check_cudnn_tensor_shapes", "d_qk, d_v multiples of 8",
         "head_dim should be a multiple of 8"),
    _row("seq_kv_1", _ALL, f"{SDP} check_cudnn_tensor_shapes", "S_kv != 1",
         "cudnn SDPA does not support key/value sequence length 1."),
    _row("alignment", _ALL, f"conservative: {MHA} has_aligned_varlen_layout (varlen path); dense: cuDNN check_support",
         "16-byte aligned pointers and strides (8 elements)", ALIGN),
    _row("bwd_lse_shape", _BWD, f"{MHA} build_graph_backward Stats set_dim(softmaxstats.sizes())",
         "the LSE as the forward returned it: [B, H, S_q, 1]", "does not match the graph's {b, h, s_q, 1}"),
    _row("bwd_lse_dtype", _BWD, f"{MHA} build_graph_backward: Stats set_data_type(FLOAT)", "LSE fp32, read through "
         "its strides (set_stride(softmaxstats.strides()))", kind="layout",
         test="test_cudnn_backward_reads_lse_as_fp32_through_its_strides", enforced="Undefined for another dtype"),
    _row("max_qk", _BWD, f"{BWD}: s_q = max_q, s_kv = max_k", "max_q/max_k are the tensors' lengths", kind="layout",
         test="test_cudnn_backward_builds_its_graph_from_max_q_and_max_k", enforced="Undefined otherwise"),
    _row("causal_alignment", _ALL, "MHA build_graph set_causal_mask; graph_properties.h TOP_LEFT",
         "causal is top-left (j <= i), also when S_q != S_kv", kind="semantics", test="test_cudnn_causal_is_top_left"),
    _row("bias_semantics", _ALL, "cudnn-frontend composite SDPA: S * scale + bias; attention.cpp "
         "convert_boolean_attn_mask_cudnn (-65504)", "additive bias after the scale; a row of only -inf is NaN",
         kind="semantics", test="test_cudnn_bias_is_added_after_the_scale_and_all_minus_inf_rows_are_nan"),
    _row("outputs", _ALL, f"{MHA} run_cudnn_SDP_fprop; _meta_registrations.py meta__scaled_dot_product_cudnn_"
         "attention", "out [B, H, Sq, Dv] in q's stride order; LSE fp32 [B, H, Sq, 1]; cum_seq undefined; "
         "dq/dk/dv empty_like the inputs", kind="semantics", test="test_cudnn_outputs"),
]
