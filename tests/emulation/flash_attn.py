"""flash-attn 2.8's private functions, emulated: `_flash_attn_forward`, `_flash_attn_backward`,
`_flash_attn_varlen_forward`, `_flash_attn_varlen_backward` with flash_attn/flash_attn_interface.py's signatures at
v2.8.3 (060c9188; separate window_size_left/right, softcap). Like the real ones (torch >= 2.4) they are
`torch.library.custom_op`s, here in the namespace "cpbench_emulation" and without a device restriction: the
dispatcher checks argument types as it does for flash-attn's (a float for an int, None for a float: errors), and
`fn._init_fn` has the real signature. The C++ they call (mha_fwd, mha_varlen_fwd, mha_bwd, mha_varlen_bwd of
csrc/flash_attn/flash_api.cpp) is _flash.py with aten=False.

Wrapper behaviour (flash_attn_interface.py): q/k/v (backward: also dout, out) whose last dim is not contiguous are
copied first (maybe_contiguous, :19-20, :90, :259); dq/dk/dv are passed as given, so the backward writes into them
through their strides (dk/dv at the kv head count: GQA sums in C++), and returns softmax_d.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import _flash
from ._common import contract_rows, emulated

SRC = "flash-attn v2.8.3 csrc/flash_attn/flash_api.cpp"
PY = "flash-attn v2.8.3 flash_attn/flash_attn_interface.py"
NS = "cpbench_emulation"


def maybe_contiguous(x):
    return x.contiguous() if x is not None and x.stride(-1) != 1 else x


@torch.library.custom_op(f"{NS}::_flash_attn_forward", mutates_args=())
def _flash_attn_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, softmax_scale: float,
                        causal: bool, window_size_left: int, window_size_right: int, softcap: float,
                        alibi_slopes: Optional[torch.Tensor], return_softmax: bool
                        ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    emulated(alibi_slopes is None, "alibi_slopes")
    q, k, v = [maybe_contiguous(x) for x in (q, k, v)]
    out, lse = _flash.mha_fwd(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                              softcap, return_softmax, aten=False)
    return out, lse, torch.empty(0, dtype=q.dtype), torch.zeros(2, dtype=torch.int64)  # p, rng_state (:449, :483)


@torch.library.custom_op(f"{NS}::_flash_attn_varlen_forward", mutates_args=())
def _flash_attn_varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                               cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
                               softmax_scale: float, causal: bool, window_size_left: int = -1,
                               window_size_right: int = -1, softcap: float = 0.0,
                               alibi_slopes: Optional[torch.Tensor] = None, return_softmax: bool = False,
                               block_table: Optional[torch.Tensor] = None, leftpad_k: Optional[torch.Tensor] = None,
                               seqused_k: Optional[torch.Tensor] = None, zero_tensors: bool = False
                               ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    emulated(all(x is None for x in (alibi_slopes, block_table, leftpad_k, seqused_k)),
             "alibi_slopes / block_table / leftpad_k / seqused_k")
    q, k, v = [maybe_contiguous(x) for x in (q, k, v)]
    out, lse = _flash.mha_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                     softmax_scale, zero_tensors, causal, window_size_left, window_size_right,
                                     softcap, return_softmax, aten=False)
    return out, lse, torch.empty(0, dtype=q.dtype), torch.zeros(2, dtype=torch.int64)


@torch.library.custom_op(f"{NS}::_flash_attn_backward", mutates_args=("dq", "dk", "dv"))
def _flash_attn_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                         softmax_lse: torch.Tensor, dq: Optional[torch.Tensor], dk: Optional[torch.Tensor],
                         dv: Optional[torch.Tensor], dropout_p: float, softmax_scale: float, causal: bool,
                         window_size_left: int, window_size_right: int, softcap: float,
                         alibi_slopes: Optional[torch.Tensor], deterministic: bool,
                         rng_state: Optional[torch.Tensor] = None) -> torch.Tensor:
    emulated(alibi_slopes is None, "alibi_slopes")
    dout, q, k, v, out = [maybe_contiguous(x) for x in (dout, q, k, v, out)]
    *_, softmax_d = _flash.mha_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                                   window_size_left, window_size_right, softcap, aten=False)
    return softmax_d


@torch.library.custom_op(f"{NS}::_flash_attn_varlen_backward", mutates_args=("dq", "dk", "dv"))
def _flash_attn_varlen_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                out: torch.Tensor, softmax_lse: torch.Tensor, dq: Optional[torch.Tensor],
                                dk: Optional[torch.Tensor], dv: Optional[torch.Tensor], cu_seqlens_q: torch.Tensor,
                                cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
                                softmax_scale: float, causal: bool, window_size_left: int, window_size_right: int,
                                softcap: float, alibi_slopes: Optional[torch.Tensor], deterministic: bool,
                                rng_state: Optional[torch.Tensor] = None, zero_tensors: bool = False) -> torch.Tensor:
    emulated(alibi_slopes is None, "alibi_slopes")
    dout, q, k, v, out = [maybe_contiguous(x) for x in (dout, q, k, v, out)]
    *_, softmax_d = _flash.mha_varlen_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                          max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, zero_tensors, causal,
                                          window_size_left, window_size_right, softcap, aten=False)
    return softmax_d


FUNCTIONS = {"fwd": _flash_attn_forward, "bwd": _flash_attn_backward, "varlen_fwd": _flash_attn_varlen_forward,
             "varlen_bwd": _flash_attn_varlen_backward}

_FWD = ("_flash_attn_forward", "_flash_attn_varlen_forward")
_BWD = ("_flash_attn_backward", "_flash_attn_varlen_backward")
_ALL = _FWD + _BWD


_row = contract_rows("flash_attn.")


CONTRACT = [
    _row("types", _ALL, f"{PY}:76-106 (custom_op schema from the annotations)", "argument types as annotated",
         "Expected a value of type", enforced="the dispatcher, as for flash-attn's own custom ops"),
    _row("dtype", _ALL, f"{SRC}:373-374,545-546,804-805,1015-1016", "fp16 or bf16", _flash.DTYPE),
    _row("kv_dtype", _ALL, f"{SRC}:375-376", "k, v in q's dtype", "query and key must have the same dtype"),
    _row("out_dtype", _BWD, f"{SRC}:808-809,1019-1020", "out, dout in q's dtype",
         "query and out must have the same dtype"),
    _row("head_mult8_fwd", _FWD, f"{SRC}:394,605", "head_size % 8 == 0", _flash.HEAD_MULT8[False]),
    _row("head_max_fwd", _FWD, f"{SRC}:393,604", "head_size <= 256", _flash.FWD_MAX_HEAD),
    _row("head_mult8_bwd", _BWD, f"{SRC}:829,1045", "head_size % 8 == 0", _flash.BWD_HEAD_MULT8),
    _row("head_max_bwd", _BWD, f"{SRC}:830,1046", "head_size <= 256", _flash.BWD_MAX_HEAD),
    _row("gqa", _ALL, f"{SRC}:395,606,831,1047", "heads % kv heads == 0", _flash.GQA),
    _row("batch", _FWD, f"{SRC}:392,603", "batch > 0 (varlen: cu_seqlens has >= 2 entries)",
         "batch size must be positive"),
    _row("kv_shape", _FWD, f"{SRC}:417-418", "k/v [B, Sk, Hk, D]",
         _flash.shape_msg("k", "batch_size, seqlen_k, num_heads_k, head_size")),
    _row("out_shape", _BWD, f"{SRC}:846-847", "out/dout shaped like q",
         _flash.shape_msg("out", "batch_size, seqlen_q, num_heads, head_size")),
    _row("softcap_dropout", _ALL, f"{SRC}:397,578,838,1048", "softcap > 0 needs dropout 0",
         "Softcapping does not support dropout for now"),
    _row("dq_dtype", _BWD, f"{SRC}:852,861,870,1069,1078,1087", "given dq/dk/dv in q's dtype",
         "dq must have the same dtype as q"),
    _row("dq_last_dim", _BWD, f"{SRC}:854,1071", "given dq/dk/dv with a contiguous last dim",
         "dq must have contiguous last dimension"),
    _row("dk_shape", _BWD, f"{SRC}:864,1081", "dk/dv at the kv head count",
         _flash.shape_msg("dk", "batch_size, seqlen_k, num_heads_k, head_size")),
    _row("cu_dtype", ("_flash_attn_varlen_forward", "_flash_attn_varlen_backward"), f"{SRC}:549-550,1021-1022",
         "cu_seqlens int32", "cu_seqlens_q must have dtype int32"),
    _row("cu_contiguous", ("_flash_attn_varlen_forward", "_flash_attn_varlen_backward"), f"{SRC}:568-569,1033-1034",
         "cu_seqlens contiguous", "cu_seqlens_q must be contiguous"),
    _row("cu_shape", ("_flash_attn_varlen_forward",), f"{SRC}:622-623", "cu_seqlens_k [batch + 1]",
         _flash.shape_msg("cu_seqlens_k", "batch_size + 1")),
    _row("maybe_contiguous", _ALL, f"{PY}:19-20,90,259", "inputs with a strided last dim are copied; other strides "
         "are read as given", kind="semantics", test="test_flash_strided_inputs_are_read_through_their_strides"),
    _row("lse_layout", _BWD, f"{SRC}:908-923,1138-1151 (softmax_lse.data_ptr() only); src/flash_bwd_kernel.h:124",
         "LSE read as contiguous fp32 [B, H, Sq] / [H, total_q] from its data pointer; nothing checked",
         kind="layout", test="test_flash_backward_reads_lse_through_the_assumed_layout",
         enforced="storage_read with the assumed strides; Undefined past the storage or for non-fp32"),
    _row("writes_grads", _BWD, f"{SRC}:212-231,966-967,1195-1196", "dq/dk/dv written through their strides; GQA "
         "dk/dv = sum over the group of per-head grads", kind="semantics",
         test="test_flash_attn_backward_writes_into_the_given_buffers"),
    _row("window", _ALL, f"{SRC}:137-144,399-404,585-609,791,840-841", "windows >= seqlen_k -> -1; causal -> "
         "right 0; left >= 0 > right -> right = seqlen_k (varlen max_seqlen_k)", kind="semantics",
         test="test_flash_window_rules"),
    _row("empty_rows", _FWD, "src/flash_fwd_kernel.h:125, src/softmax.h:180", "no visible key: out 0, LSE +inf",
         kind="semantics", test="test_flash_rows_without_keys_get_lse_plus_inf"),
    _row("causal_alignment", _ALL, "src/mask.h:53-54", "bottom-right per sequence", kind="semantics",
         test="test_flash_causal_is_bottom_right"),
    _row("bwd_lse_minus_inf", _BWD, "src/softmax.h:76", "LSE -inf taken as 0", kind="semantics",
         test="test_flash_backward_takes_lse_minus_inf_as_zero"),
    _row("softcap", _ALL, f"{SRC}:111-122", "scores = softcap * tanh(scale * qk / softcap)", kind="semantics",
         test="test_emulations_match_references"),
    _row("outputs", _FWD, f"{SRC}:441,652; {PY}:123-139 (fake)", "LSE fp32 [B, H, Sq] / [H, total_q]",
         kind="semantics", test="test_output_layouts"),
]
