"""FlashAttention-3's Python interface, emulated: hopper/flash_attn_interface.py (@0251105a) - `_flash_attn_forward`
and `_flash_attn_backward` with their exact signatures (torch custom ops, here in the namespace
"cpbench_emulation_fa3" and without the "cuda" device restriction, so the dispatcher checks argument types as it
does for FlashAttention-3's own), and the public `flash_attn_func` / `flash_attn_varlen_func` transformers calls
(`FlashAttnFunc` / `FlashAttnVarlenFunc`). The C++ (`mha_fwd`, `mha_bwd`) is _fa3.py, on the GPU `CAPABILITY`
names (default an H100).

    from tests.emulation import flash_attn_3
    with flash_attn_3.installed():   # `import flash_attn_interface` finds this module's stand-in
        ...

Wrapper behaviour (flash_attn_interface.py): q, k (and k_new) are copied when their last dim is not contiguous, v
unless its stride(-1) or stride(-3) is 1 (`_flash_attn_forward`); dout, q, k, v, out likewise in the backward, the
LSE never (`_flash_attn_backward`); the backward's dq/dk/dv are written in place; `flash_attn_func`'s default scale
is head_dim ** -0.5; no dropout argument exists.
"""

from __future__ import annotations

import collections
import contextlib
import sys
import types
from typing import Optional, Tuple

import torch

from . import _fa3
from ._common import NotEmulated, contract_rows, emulated

NS = "cpbench_emulation_fa3"
PY, API = "hopper/flash_attn_interface.py", "hopper/flash_api.cpp"
CAPABILITY = [(9, 0)]  # the GPU the emulated kernels run on; a list so a test can change it in place
CALLS = collections.Counter()  # "fa3" / "fa3_backward": calls of the two functions, by whoever (ring or model)


def maybe_contiguous(x):
    return x.contiguous() if x is not None and x.stride(-1) != 1 else x


@torch.library.custom_op(f"{NS}::_flash_attn_forward", mutates_args=())
def _flash_attn_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_new: Optional[torch.Tensor] = None,
    v_new: Optional[torch.Tensor] = None, qv: Optional[torch.Tensor] = None, out_: Optional[torch.Tensor] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None, cu_seqlens_k: Optional[torch.Tensor] = None,
    cu_seqlens_k_new: Optional[torch.Tensor] = None, seqused_q: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None, max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
    page_table: Optional[torch.Tensor] = None, kv_batch_idx: Optional[torch.Tensor] = None,
    leftpad_k: Optional[torch.Tensor] = None, rotary_cos: Optional[torch.Tensor] = None,
    rotary_sin: Optional[torch.Tensor] = None, seqlens_rotary: Optional[torch.Tensor] = None,
    q_descale: Optional[torch.Tensor] = None, k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None, softmax_scale: Optional[float] = None, causal: bool = False,
    window_size_left: int = -1, window_size_right: int = -1, attention_chunk: int = 0, softcap: float = 0.0,
    rotary_interleaved: bool = True, scheduler_metadata: Optional[torch.Tensor] = None, num_splits: int = 1,
    pack_gqa: Optional[bool] = None, sm_margin: int = 0,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    unused = (k_new, v_new, qv, out_, cu_seqlens_k_new, seqused_q, seqused_k, page_table, kv_batch_idx, leftpad_k,
              rotary_cos, rotary_sin, seqlens_rotary, q_descale, k_descale, v_descale, scheduler_metadata)
    emulated(all(x is None for x in unused) and attention_chunk == 0, "kv cache / paging / rotary / fp8 / chunks")
    CALLS["fa3"] += 1
    q, k = maybe_contiguous(q), maybe_contiguous(k)
    v = v.contiguous() if v.stride(-1) != 1 and v.stride(-3) != 1 else v
    cu_seqlens_q, cu_seqlens_k = maybe_contiguous(cu_seqlens_q), maybe_contiguous(cu_seqlens_k)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale  # mha_fwd: 1 / sqrt(head_size)
    out, lse = _fa3.mha_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal,
                            window_size_left, window_size_right, softcap, CAPABILITY[0])
    return out, lse, torch.tensor([]), torch.tensor([])  # out_accum, softmax_lse_accum: empty without splits


@torch.library.custom_op(f"{NS}::_flash_attn_backward", mutates_args=("dq", "dk", "dv"))
def _flash_attn_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    softmax_lse: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None, sequed_q: Optional[torch.Tensor] = None,
    sequed_k: Optional[torch.Tensor] = None, max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
    dq: Optional[torch.Tensor] = None, dk: Optional[torch.Tensor] = None, dv: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None, is_causal: bool = False, window_size_left: int = -1,
    window_size_right: int = -1, softcap: float = 0.0, deterministic: bool = False, sm_margin: int = 0,
) -> torch.Tensor:
    emulated(sequed_q is None and sequed_k is None, "seqused")
    CALLS["fa3_backward"] += 1
    dout, q, k, v, out = [maybe_contiguous(x) for x in (dout, q, k, v, out)]
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    softmax_d, *_ = _fa3.mha_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                 max_seqlen_q, max_seqlen_k, scale, is_causal, window_size_left, window_size_right,
                                 softcap, deterministic, CAPABILITY[0])
    return softmax_d


class FlashAttnFunc(torch.autograd.Function):
    """flash_attn_interface.FlashAttnFunc (dense), and with cu_seqlens FlashAttnVarlenFunc."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal, window_size, softcap, deterministic,
                return_softmax):
        if softmax_scale is None:
            softmax_scale = q.shape[-1] ** (-0.5)
        out, lse, *_ = _flash_attn_forward(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
                                           max_seqlen_k=max_k, softmax_scale=softmax_scale, causal=causal,
                                           window_size_left=window_size[0], window_size_right=window_size[1],
                                           softcap=softcap)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
        ctx.args = (max_q, max_k, softmax_scale, causal, window_size, softcap, deterministic)
        return (out, lse) if return_softmax else out

    @staticmethod
    def backward(ctx, dout, *_):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        max_q, max_k, scale, causal, window_size, softcap, deterministic = ctx.args
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _flash_attn_backward(dout, q, k, v, out, lse, cu_q, cu_k, None, None, max_q, max_k, dq, dk, dv, scale, causal,
                             window_size[0], window_size[1], softcap, deterministic, 0)
        return dq, dk, dv, *([None] * 10)


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                    v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None,
                    deterministic=False, sm_margin=0, return_attn_probs=False):
    emulated(qv is None and attention_chunk == 0, "qv / attention_chunk")
    return FlashAttnFunc.apply(q, k, v, None, None, None, None, softmax_scale, causal, window_size, softcap,
                               deterministic, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                           seqused_k=None, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                           v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                           pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False):
    emulated(seqused_q is None and seqused_k is None and qv is None, "seqused / qv")
    return FlashAttnFunc.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                               window_size, softcap, deterministic, return_attn_probs)


def flash_attn_with_kvcache(*args, **kwargs):
    raise NotEmulated("flash_attn_with_kvcache (continuous batching)")


@contextlib.contextmanager
def installed(capability=(9, 0)):
    """This module as `flash_attn_interface` (what transformers' flash_attention_3 and cpbench import), on a GPU of
    `capability`."""
    module = types.ModuleType("flash_attn_interface")
    for name in ("_flash_attn_forward", "_flash_attn_backward", "flash_attn_func", "flash_attn_varlen_func",
                 "flash_attn_with_kvcache"):
        setattr(module, name, globals()[name])
    saved, before = CAPABILITY[0], sys.modules.get("flash_attn_interface")
    CAPABILITY[0] = tuple(capability)
    sys.modules["flash_attn_interface"] = module
    try:
        yield module
    finally:
        CAPABILITY[0] = saved
        if before is None:
            sys.modules.pop("flash_attn_interface", None)
        else:
            sys.modules["flash_attn_interface"] = before


_FWD, _BWD = ("_flash_attn_forward",), ("_flash_attn_backward",)
_ALL = _FWD + _BWD
_row = contract_rows("fa3.")

CONTRACT = [
    _row("types", _ALL, f"{PY} custom_op schemas", "argument types as annotated", "Expected a value of type",
         enforced="the dispatcher, as for FlashAttention-3's own custom ops"),
    _row("arch", _ALL, f"{API} mha_fwd / mha_bwd", "compute capability >= 8.0", _fa3.ARCH),
    _row("fwd_dtype", _FWD, f"{API} mha_fwd", "fp16, bf16 (fp8 e4m3: not emulated)", _fa3.FWD_DTYPE),
    _row("bwd_dtype", _BWD, f"{API} mha_bwd", "fp16, bf16", _fa3.BWD_DTYPE),
    _row("kv_dtype", _ALL, f"{API} mha_fwd / mha_bwd", "k, v in q's dtype", "query and key must have the same dtype"),
    _row("out_dtype", _BWD, f"{API} mha_bwd", "out, dout in q's dtype", "query and out must have the same dtype"),
    _row("cu_dtype", _ALL, f"{API} mha_fwd / mha_bwd", "cu_seqlens int32", "cu_seqlens_q must have dtype torch.int32"),
    _row("max_seqlen", _ALL, f"{API} mha_fwd", "max_seqlen_q with cu_seqlens_q",
         "max_seqlen_q must be provided if cu_seqlens_q is provided"),
    _row("batch", _FWD, f"{API} mha_fwd", "k's batch is q's", "batch_size must be equal to batch_size_k"),
    _row("head_max", _ALL, f"{API} mha_fwd / mha_bwd (max(d, d_v) in the backward)", "head dims <= 256", _fa3.MAX_HEAD),
    _row("gqa", _ALL, f"{API} mha_fwd / mha_bwd", "H % H_k == 0", _fa3.GQA),
    _row("dv", _FWD, f"{API} mha_fwd", "d_v != d only in (128, 192] x (96, 128] or d <= 64", _fa3.DV),
    _row("dv_hopper", _FWD, f"{API} mha_fwd", "d_v != d only on Hopper", "Only Hopper supports different V headdim"),
    _row("head_mult8", _ALL, f"{API} mha_fwd / mha_bwd", "head dims multiples of 8",
         "head_size should be a multiple of 8"),
    _row("shape", _ALL, f"{API} CHECK_SHAPE", "k/v [B, S_k, H_k, D] / [total_k, H_k, D]", "must have shape"),
    _row("deterministic", _BWD, f"{API} mha_bwd", "no deterministic backward at hdim 256", _fa3.DETERMINISTIC),
    _row("dq_dtype", _BWD, f"{API} mha_bwd", "given dq/dk/dv in q's dtype", "dq must have the same dtype as q"),
    _row("maybe_contiguous", _ALL, f"{PY} _flash_attn_forward / _flash_attn_backward", "a strided last dim is "
         "copied; other strides are read as given", kind="semantics", test="test_fa3_strided_inputs"),
    _row("lse_layout", _BWD, "hopper/flash_bwd_launch_template.h stride_LSE; flash_api.cpp mha_bwd checks nothing",
         "LSE read as contiguous fp32 [B, H, S_q] / [H, total_q] from its data pointer", kind="layout",
         test="test_fa3_backward_reads_lse_contiguous", enforced="storage_read; Undefined for non-fp32"),
    _row("window", _ALL, f"{API} mha_fwd, set_params_fprop", "left >= S_k - 1, right >= S_q - 1 -> -1; causal -> "
         "right 0; then -1 -> S_k - 1 / S_q - 1", kind="semantics", test="test_fa3_window_rules"),
    _row("causal_alignment", _ALL, "hopper/mask.h Mask::apply (causal_row_offset)",
         "causal and local bottom-right per sequence", kind="semantics", test="test_fa3_causal_is_bottom_right"),
    _row("outputs", _FWD, f"{API} mha_fwd; {PY} _flash_attn_forward_fake", "out [.., H, D_v] in q's dtype; LSE fp32 "
         "[B, H, S_q] / [H, total_q]; empty rows out 0, LSE -inf", kind="semantics", test="test_fa3_outputs"),
]
