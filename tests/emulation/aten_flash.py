"""aten's flash ops, emulated: `_scaled_dot_product_flash_attention` and its backward (the sdpa-level ops, BHSD) and
`_flash_attention_forward` / `_flash_attention_backward` (BSHD, or THD with cum_seq_q/k for varlen), each taking
exactly the real op's schema. The kernel itself (aten's vendored FlashAttention-2) is _flash.py.

Sources read (pytorch; the installed torch is 2.13.0, git cf30153c, whose .cu/.cpp files are not in the wheel):
- attention.cu, `_scaled_dot_product_flash_attention_cuda`, `_flash_attention_forward` (main; line numbers of the
  annotated copy in the search corpus, "ATTN"); attention_backward.cu `_flash_attention_backward` and
  `_scaled_dot_product_flash_attention_backward_cuda` (commit 00afd8f2; "BWD" line numbers from the same annotated
  copy); flash_attn/flash_api.cpp mha_* (commit 03b7c19d, "API", cited by function and message);
  attention.cpp `scaled_dot_product_attention`: sdpa pads the head dim to a multiple of 8 (`pad_last_dim<8>`)
  BEFORE calling the flash op, which itself refuses other head dims; torch/_meta_registrations.py (2.13.0) for
  the output shapes and dtypes.
"""

from __future__ import annotations

import torch

from . import _flash
from ._common import bind, check, contract_rows, emulated

ATEN = torch.ops.aten
API = "aten flash_attn/flash_api.cpp @03b7c19d"
ATTN = "attention.cu (main, annotated copy)"
BWD = "attention_backward.cu (@00afd8f2; lines of the annotated copy)"
FA = "flash-attn v2.8.3 csrc/flash_attn"
BOTH_CU = "cumulative_sequence_length_q and cumulative_sequence_length_k must be both set or both not set"


def _scale(q, scale):
    return scale if scale is not None else q.shape[-1] ** -0.5  # sdp::calculate_scale: 1/sqrt(query.size(-1))


def _window(w):
    return -1 if w is None else w  # `window_size_left.value_or(-1)` (ATTN L515-516): None and -1 are the same


def flash_attention_forward(*args, **kwargs):
    """aten::_flash_attention_forward -> (output, softmax_logsumexp, rng_state, unused, debug_attn_mask)."""
    a = bind(ATEN._flash_attention_forward.default, args, kwargs)
    # block_table and num_splits are in the schema from torch 2.12 on (2.11's has neither): absent is not given
    emulated(all(a.get(n) is None for n in ("seqused_k", "alibi_slopes", "block_table", "num_splits")),
             "seqused_k / alibi_slopes / block_table / num_splits")
    check((a["cum_seq_q"] is None) == (a["cum_seq_k"] is None), BOTH_CU)  # ATTN L522-525
    q, k, v = a["query"], a["key"], a["value"]
    common = dict(dropout_p=a["dropout_p"], scale=_scale(q, a["scale"]), causal=a["is_causal"],
                  left=_window(a["window_size_left"]), right=_window(a["window_size_right"]), softcap=0.0,
                  return_softmax=a["return_debug_mask"], aten=True)
    if a["cum_seq_q"] is not None:  # ATTN L528-562: mha_varlen_fwd, zero_tensors false
        out, lse = _flash.mha_varlen_fwd(q, k, v, a["cum_seq_q"], a["cum_seq_k"], a["max_q"], a["max_k"],
                                         zero_tensors=False, **common)
    else:  # ATTN L563-587: mha_fwd; max_q / max_k are not used
        out, lse = _flash.mha_fwd(q, k, v, **common)
    # [Note] BC breaking change to flash seed/offset (API mha_fwd): rng_state uint64 [2], unused uint64 []
    rng, unused = torch.zeros(2, dtype=torch.uint64), torch.zeros((), dtype=torch.uint64)
    return out, lse, rng, unused, torch.empty(0, dtype=q.dtype)


def flash_attention_backward(*args, **kwargs):
    """aten::_flash_attention_backward -> (grad_query, grad_key, grad_value)."""
    a = bind(ATEN._flash_attention_backward.default, args, kwargs)
    q, k, v = a["query"], a["key"], a["value"]
    # BWD L91-93 "CUDA code assumes that dout is contiguous": grad_out and out are copied; q/k/v and the LSE are not
    dout, out = a["grad_out"].contiguous(), a["out"].contiguous()
    common = dict(dropout_p=a["dropout_p"], scale=_scale(q, a["scale"]), causal=a["is_causal"],
                  left=_window(a["window_size_left"]), right=_window(a["window_size_right"]), softcap=0.0, aten=True)
    if a["cum_seq_q"] is not None:  # "whether cumulative_sequence_length_q is defined": varlen
        dq, dk, dv, _ = _flash.mha_varlen_bwd(dout, q, k, v, out, a["logsumexp"], None, None, None, a["cum_seq_q"],
                                              a["cum_seq_k"], a["max_q"], a["max_k"], zero_tensors=False, **common)
    else:  # dense: mha_bwd takes every size from q/k; max_q / max_k are not read
        dq, dk, dv, _ = _flash.mha_bwd(dout, q, k, v, out, a["logsumexp"], None, None, None, **common)
    return dq, dk, dv


def sdpa_flash(*args, **kwargs):
    """aten::_scaled_dot_product_flash_attention (BHSD) -> (output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
    rng_state, unused, debug_attn_mask); cum_seq_q/k are undefined (None)."""
    a = bind(ATEN._scaled_dot_product_flash_attention.default, args, kwargs)
    q, k, v = a["query"], a["key"], a["value"]
    sq, sk = q.shape[2], k.shape[2]
    check(sk == v.shape[2], "Key and Value must have the same sequence length")
    out, lse, rng, unused, debug = flash_attention_forward(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, None, sq, sk, a["dropout_p"], a["is_causal"],
        a["return_debug_mask"], scale=a["scale"])
    return out.transpose(1, 2), lse, None, None, sq, sk, rng, unused, debug


def sdpa_flash_backward(*args, **kwargs):
    """aten::_scaled_dot_product_flash_attention_backward (BHSD) -> (grad_query, grad_key, grad_value)."""
    a = bind(ATEN._scaled_dot_product_flash_attention_backward.default, args, kwargs)
    if a["grad_out"] is None:
        return None, None, None
    t = (a[n].transpose(1, 2) for n in ("grad_out", "query", "key", "value", "out"))
    grads = flash_attention_backward(*t, a["logsumexp"], a["cum_seq_q"], a["cum_seq_k"], a["max_q"], a["max_k"],
                                     a["dropout_p"], a["is_causal"], a["philox_seed"], a["philox_offset"],
                                     scale=a["scale"])
    return tuple(g.transpose(1, 2) for g in grads)


_FWD = ("sdpa_flash", "flash_attention_forward")
_BWD = ("sdpa_flash_backward", "flash_attention_backward")
_ALL = _FWD + _BWD


_row = contract_rows("aten.flash.")


CONTRACT = [
    _row("schema", _ALL, "native_functions.yaml via op._schema", "arguments bind to the op's schema",
         "Unknown keyword argument", enforced="_common.bind: unknown/missing/repeated/extra args, wrong types"),
    _row("dtype", _ALL, f"{API} mha_fwd/mha_bwd; {FA}/flash_api.cpp:373", "q fp16 or bf16", _flash.DTYPE),
    _row("kv_dtype", _ALL, f"{API} mha_*", "k, v in q's dtype", "query and key must have the same dtype"),
    _row("out_dtype", _BWD, f"{API} mha_bwd", "out, dout in q's dtype", "query and out must have the same dtype"),
    _row("last_dim", _ALL, f"{API} mha_*", "q/k/v stride(-1) == 1 (other strides are read as given: "
         "set_params_fprop q_row_stride/q_head_stride/q_batch_stride)", _flash.LAST_DIM),
    _row("head_mult8_fwd", _FWD, f"{API} mha_fwd / mha_varlen_fwd; attention.cpp pads only in sdpa's dispatcher",
         "head_size % 8 == 0 for the direct op", _flash.HEAD_MULT8[True]),
    _row("head_max_fwd", _FWD, f"{API} mha_fwd", "head_size <= 256", _flash.FWD_MAX_HEAD),
    _row("head_mult8_bwd", _BWD, f"{API} mha_bwd", "head_size % 8 == 0", _flash.BWD_HEAD_MULT8),
    _row("head_og_bwd", _BWD, f"{API} mha_bwd", "dout's last dim % 8 == 0",
         "head_size_og should be a multiple of 8, this is ensured by padding!"),
    _row("gqa", _ALL, f"{API} mha_*", "heads % kv heads == 0 (GQA taken natively)", _flash.GQA),
    _row("kv_shape", _FWD, f"{API} mha_fwd CHECK_SHAPE", "k [B, Sk, Hk, D] (batch and head dim of q)",
         _flash.shape_msg("k", "batch_size, seqlen_k, num_heads_k, head_size_og")),
    _row("kv_seqlen", ("sdpa_flash",), f"{ATTN} _scaled_dot_product_flash_attention_cuda",
         "key.size(2) == value.size(2)", "Key and Value must have the same sequence length"),
    _row("debug_mask", _FWD, f"{API} mha_fwd", "return_debug_mask only with dropout",
         "return_softmax is only supported when p_dropout > 0.0"),
    _row("both_cu", ("flash_attention_forward",), f"{ATTN} L522-525", "cum_seq_q and cum_seq_k together", BOTH_CU),
    _row("cu_dtype", ("flash_attention_forward", "flash_attention_backward"), f"{API} mha_varlen_fwd/bwd",
         "cu_seqlens int32", "cu_seqlens_q must have dtype int32"),
    _row("cu_contiguous", ("flash_attention_forward", "flash_attention_backward"), f"{API} mha_varlen_fwd/bwd",
         "cu_seqlens contiguous", "cu_seqlens_q must be contiguous"),
    _row("cu_shape", ("flash_attention_forward",), f"{API} mha_varlen_fwd", "cu_seqlens_k [batch + 1] like cu_q",
         _flash.shape_msg("cu_seqlens_k", "batch_size + 1")),
    _row("bwd_lse_layout", _BWD, f"{FA}/src/flash_bwd_kernel.h:124 (same kernel in aten)",
         "LSE read from its data pointer as contiguous fp32 [B, H, Sq] (varlen [H, total_q]); no dtype, shape or "
         "stride check", kind="layout", test="test_flash_backward_reads_lse_through_the_assumed_layout",
         enforced="_common.storage_read with the assumed strides; Undefined past the storage or for non-fp32"),
    _row("bwd_copies", _BWD, f"{BWD} L91-93", "grad_out and out are made contiguous; q/k/v used as they are",
         kind="semantics", test="test_flash_strided_inputs_are_read_through_their_strides"),
    _row("window", ("flash_attention_forward", "flash_attention_backward"),
         f"{ATTN} L515-516; {FA}/flash_api.cpp:399-404,585-609,137-144", "None -> -1; >= seqlen_k -> -1; causal -> "
         "right 0; left >= 0 > right -> right = seqlen_k (varlen max_seqlen_k)", kind="semantics",
         test="test_flash_window_rules"),
    _row("empty_rows", _FWD, f"{FA}/src/flash_fwd_kernel.h:125, softmax.h:180", "a row with no visible key: out 0, "
         "LSE +inf", kind="semantics", test="test_flash_rows_without_keys_get_lse_plus_inf"),
    _row("causal_alignment", _ALL, f"{FA}/src/mask.h:53-54", "causal and windows bottom-right aligned per sequence",
         kind="semantics", test="test_flash_causal_is_bottom_right"),
    _row("bwd_lse_minus_inf", _BWD, f"{FA}/src/softmax.h:76", "an LSE of -inf is taken as 0 in exp(s - lse)",
         kind="semantics", test="test_flash_backward_takes_lse_minus_inf_as_zero"),
    _row("outputs", _ALL, "torch/_meta_registrations.py meta__flash_attention_forward (2.13.0)",
         "out in q's dtype and layout (empty_like); LSE fp32 [B, H, Sq], varlen [H, total_q]; rng uint64",
         kind="semantics", test="test_output_layouts"),
    _row("varlen_unwritten", ("flash_attention_forward",), f"{FA}/src/flash_fwd_launch_template.h:63",
         "tokens outside cu_seqlens and rows past max_seqlen_q are never written (torch::empty)",
         kind="semantics", test="test_varlen_memory_outside_the_sequences_is_unwritten"),
]
