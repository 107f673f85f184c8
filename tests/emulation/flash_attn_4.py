"""FlashAttention-4's Python interface, emulated: flash_attn/cute/interface.py (@0251105a) - `_flash_attn_fwd` and
`_flash_attn_bwd` (_fa4.py) and the public `flash_attn_func` / `flash_attn_varlen_func` transformers calls
(`FlashAttnFunc` / `FlashAttnVarlenFunc`: (out, lse), the LSE only when asked for), on the architecture `ARCH` names.

    from tests.emulation import flash_attn_4
    with flash_attn_4.installed(arch=90):   # `import flash_attn.cute` finds this module's stand-ins
        ...
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import sys
import types

import torch

from ._common import contract_rows, emulated
from ._fa4 import (  # noqa: F401 - the emulated interface, as flash_attn.cute.interface has it
    ARCH,
    CALLS,
    PY,
    Assertion,
    _flash_attn_bwd,
    _flash_attn_fwd,
    maybe_contiguous,
    resolve_window,
    visible,
)


class _Func(torch.autograd.Function):
    """interface.FlashAttnFunc / FlashAttnVarlenFunc: (out, lse); the lse only when asked for or needed."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window, softcap, return_lse):
        out, lse, *_ = _flash_attn_fwd(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
                                       max_seqlen_k=max_k, softmax_scale=scale, causal=causal, softcap=softcap,
                                       window_size_left=window[0], window_size_right=window[1], return_lse=True)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
        ctx.args = (max_q, max_k, scale, causal, window, softcap)
        return out, (lse if return_lse else None)

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        max_q, max_k, scale, causal, window, softcap = ctx.args
        dq, dk, dv = _flash_attn_bwd(q, k, v, out, dout, lse, scale, causal, softcap or 0.0, window[0], window[1],
                                     cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k)
        return dq, dk, dv, *([None] * 9)


def flash_attn_func(q, k, v, qv=None, gather_kv_indices=None, softmax_scale=None, causal=False,
                    window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None,
                    deterministic=False, return_lse=False, **mods):
    emulated(qv is None and learnable_sink is None and not any(x is not None for x in mods.values()), "qv/sinks/mods")
    return _Func.apply(q, k, v, None, None, None, None, softmax_scale, causal, window_size, softcap, return_lse)


def flash_attn_varlen_func(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                           max_seqlen_k=None, min_seqlen_k=None, seqused_q=None, seqused_k=None, gather_kv_indices=None,
                           page_table=None, softmax_scale=None, causal=False, window_size=(None, None),
                           learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False,
                           return_lse=False, **mods):
    emulated(qv is None and learnable_sink is None and page_table is None and seqused_q is None, "qv/sinks/paging")
    max_q = int(max_seqlen_q) if max_seqlen_q is not None else None
    max_k = int(max_seqlen_k) if max_seqlen_k is not None else None
    return _Func.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, softmax_scale, causal, window_size, softcap,
                       return_lse)


def _module(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)  # find_spec needs one
    module.__path__ = []
    for key, value in attrs.items():
        setattr(module, key, value)
    return module


@contextlib.contextmanager
def installed(arch: int = 90):
    """This module as `flash_attn.cute` and `flash_attn.cute.interface`, on a GPU of architecture `arch`."""
    interface = _module("flash_attn.cute.interface", _flash_attn_fwd=_flash_attn_fwd, _flash_attn_bwd=_flash_attn_bwd,
                        flash_attn_func=flash_attn_func, flash_attn_varlen_func=flash_attn_varlen_func)
    cute = _module("flash_attn.cute", interface=interface, flash_attn_func=flash_attn_func,
                   flash_attn_varlen_func=flash_attn_varlen_func)
    root = _module("flash_attn", cute=cute)
    names = {"flash_attn": root, "flash_attn.cute": cute, "flash_attn.cute.interface": interface}
    saved, before = ARCH[0], {n: sys.modules.get(n) for n in names}
    ARCH[0] = arch
    sys.modules.update(names)
    try:
        yield interface
    finally:
        ARCH[0] = saved
        for n, m in before.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


_FWD, _BWD = ("_flash_attn_fwd",), ("_flash_attn_bwd",)
_ALL = _FWD + _BWD
_row = contract_rows("fa4.")

CONTRACT = [
    _row("fwd_dtype", _FWD, f"{PY} _flash_attn_fwd", "fp16/bf16 (fp8: not emulated)",
         "inputs must be float16, bfloat16, fp8 e4m3fn, or fp8 e5m2"),
    _row("same_dtype", _FWD, f"{PY} _flash_attn_fwd", "q, k, v alike", "q, k, v, and qv must have the same dtype"),
    _row("fwd_arch", _FWD, f"{PY} _flash_attn_fwd", "arch 8.x-12.x", "Supported: 8.x, 9.x, 10.x, 11.x, 12.x"),
    _row("bwd_arch", _BWD, f"{PY} _flash_attn_bwd", "arch 9.x-12.x", "Supported: 9.x, 10.x, 11.x, 12.x"),
    _row("gqa", _ALL, f"{PY} _flash_attn_fwd / _flash_attn_bwd", "H % H_kv == 0",
         "num_head must be divisible by num_head_kv"),
    _row("cu_dtype", _ALL, f"{PY} _flash_attn_fwd", "cu_seqlens int32", "must be int32"),
    _row("cu_contiguous", _FWD, f"{PY} _flash_attn_fwd", "cu_seqlens stride(0) == 1", "must be contiguous"),
    _row("kv_shape", _ALL, f"{PY} _flash_attn_fwd (bare asserts)", "k/v [B, S_k, H_kv, D] / [total_k, H_kv, D]",
         "assert k.shape"),
    _row("sm90_head_dims", _ALL, f"{PY} _validate_head_dims", "sm90: 8 <= d, d_v <= 256, multiples of 8",
         "is not supported on SM90"),
    _row("sm100_head_dims", _ALL, f"{PY} _validate_head_dims", "sm100/110: <= 128, (192, 128), (256, 256)",
         "is not supported on SM100/SM110"),
    _row("bwd_dtype", _BWD, f"{PY} _flash_attn_bwd", "fp16/bf16", "inputs must be float16 or bfloat16"),
    _row("bwd_same_dtype", _BWD, f"{PY} _flash_attn_bwd", "q, k, v, out, dout alike", "inputs must have the same dtype"),
    _row("lse_shape", _BWD, f"{PY} _flash_attn_bwd", "LSE [B, H, S_q] / [H, total_q]", "lse must have shape"),
    _row("lse_dtype", _BWD, f"{PY} _flash_attn_bwd", "LSE fp32", "lse must be float32"),
    _row("maybe_contiguous", _ALL, "flash_attn/cute/cute_dsl_utils.py maybe_contiguous", "unaligned or strided "
         "inputs are copied, never refused", kind="semantics", test="test_fa4_copies_unaligned_inputs"),
    _row("lse_only_when_asked", _FWD, f"{PY} _flash_attn_fwd", "the LSE exists only with requires_grad or "
         "return_lse", kind="semantics", test="test_fa4_returns_the_lse_only_when_asked"),
    _row("window", _ALL, f"{PY} _resolve_causal_local_window; flash_attn/cute/mask.py", "None is unbounded; causal "
         "with a left window is local (left, 0)", kind="semantics", test="test_fa4_window_rules"),
    _row("causal_alignment", _ALL, "flash_attn/cute/mask.py causal_row_offset", "bottom-right per sequence",
         kind="semantics", test="test_fa4_causal_is_bottom_right"),
]
