"""What one kernel call of a projected step computes: its FLOPs and the shape its efficiency depends on
(efficiency.py prices that shape), for GEMMs and attention kernels. Pure functions of an op's name and arguments,
called by the op trace (trace.py); nothing here knows a GPU. What a call moves is work.py's.

Conventions, as the kernels' own papers count them:
- a matrix multiply-add is 2 FLOPs: an (m, k) x (k, n) GEMM is 2 m k n; a grouped GEMM (MoE experts) is the sum
  over its groups, whatever their sizes;
- attention forward is 2 x pairs x heads x (d_qk + d_v) (QK^T and PV; 4 x pairs x heads x d when the head dims
  agree), the backward 2 x pairs x heads x (3 d_qk + 2 d_v) (QK^T again, dV, dP, dQ, dK: 2.5 times the forward when
  the head dims agree, the FlashAttention papers' convention); a causal call counts the query-key pairs its mask
  keeps, aligned as the kernel aligns them (`causal_pairs`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.utils._python_dispatch import _disable_current_modes


class Attention(NamedTuple):
    direction: str  # forward | backward
    family: str  # "" (FlashAttention-2 class) | _efficient | _cudnn | _fa3 | _sdpa (the model's own call)
    causal: tuple  # (argument name, its index): where the call says it is causal
    layout: str  # bhsd | bshd (varlen: [tokens, heads, dim])
    align: str  # top_left (torch's is_causal) | bottom_right (the flash kernels, flash-attn) | mask_type
    offsets_at: int | None = None  # cu_seqlens_q's index (cu_seqlens_k follows it), for a varlen call
    window: tuple = ()  # ((name, index), (name, index)) of its sliding window's left and right sizes (index None:
    # keyword only); a size of -1 or None is unbounded, and a causal call's right size is 0 (flash's mha_fwd)


_TL, _BR = "top_left", "bottom_right"


def _window(at: int) -> tuple:
    """flash-attn's window_size_left / window_size_right, positional at `at` and the next."""
    return ("window_size_left", at), ("window_size_right", at + 1)


# aten's flash kernels take their window by keyword only (native_functions.yaml: `*, ..., window_size_left=None`);
# the memory-efficient kernel's `window_size` is not read (cpbench never passes one)
_KW_WINDOW = (("window_size_left", None), ("window_size_right", None))
# The CPU flash kernel is what a projection's fake CPU tensors dispatch where the model calls SDPA itself (no CP,
# Ulysses): it stands for the kernel SDPA picks on the GPU (trace.py). torch's SDPA refuses the flash kernel a
# non-square causal call (sdp_utils.cpp check_flash_causal_non_square_seqlens), so its square calls align either way.
ATTENTION = {
    "aten._scaled_dot_product_flash_attention_for_cpu": Attention("forward", "_sdpa", ("is_causal", 4), "bhsd", _TL),
    "aten._scaled_dot_product_flash_attention_for_cpu_backward": Attention("backward", "_sdpa", ("is_causal", 7),
                                                                           "bhsd", _TL),
    "aten._scaled_dot_product_flash_attention": Attention("forward", "", ("is_causal", 4), "bhsd", _BR),
    "aten._scaled_dot_product_flash_attention_backward": Attention("backward", "", ("is_causal", 11), "bhsd", _BR),
    "aten._scaled_dot_product_efficient_attention": Attention("forward", "_efficient", ("is_causal", 6), "bhsd", _TL),
    "aten._scaled_dot_product_efficient_attention_backward": Attention("backward", "_efficient", ("is_causal", 11),
                                                                       "bhsd", _TL),
    "aten._scaled_dot_product_cudnn_attention": Attention("forward", "_cudnn", ("is_causal", 6), "bhsd", _TL),
    "aten._scaled_dot_product_cudnn_attention_backward": Attention("backward", "_cudnn", ("is_causal", 14), "bhsd",
                                                                   _TL),
    "aten._flash_attention_forward": Attention("forward", "", ("is_causal", 8), "bshd", _BR, 3, _KW_WINDOW),
    "aten._flash_attention_backward": Attention("backward", "", ("is_causal", 11), "bshd", _BR, 6, _KW_WINDOW),
    # custom_mask_type: 0 none, 1 causal from the top left, 2 from the bottom right (mem_eff_attention kernel_forward.h)
    "aten._efficient_attention_forward": Attention("forward", "_efficient", ("custom_mask_type", 9), "bshd",
                                                   "mask_type", 4),
    "aten._efficient_attention_backward": Attention("backward", "_efficient", ("custom_mask_type", 14), "bshd",
                                                    "mask_type", 6),
    # flash-attn >= 2.7's custom ops (cpbench/cp/ring/flash.py calls them with these positions)
    "flash_attn._flash_attn_forward": Attention("forward", "", ("causal", 5), "bshd", _BR, None, _window(6)),
    "flash_attn._flash_attn_backward": Attention("backward", "", ("causal", 11), "bshd", _BR, None, _window(12)),
    "flash_attn._flash_attn_varlen_forward": Attention("forward", "", ("causal", 9), "bshd", _BR, 3, _window(10)),
    "flash_attn._flash_attn_varlen_backward": Attention("backward", "", ("causal", 15), "bshd", _BR, 9,
                                                        _window(16)),
    # FlashAttention-3's custom ops (hopper/flash_attn_interface.py; cpbench/cp/ring/fa3.py calls them by keyword),
    # dense [b, s, h, d] or varlen [tokens, h, d] with cu_seqlens. FlashAttention-4's `_flash_attn_fwd` is a plain
    # Python function over CuTe kernels, not an op the dispatcher sees: a model's own call is priced as SDPA's kernel
    # (`--sdpa-kernel fa4`).
    "flash_attn_3._flash_attn_forward": Attention("forward", "_fa3", ("causal", 24), "bshd", _BR, 7, _window(25)),
    "flash_attn_3._flash_attn_backward": Attention("backward", "_fa3", ("is_causal", 16), "bshd", _BR, 6,
                                                   _window(17)),
}
GEMM = {"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten._scaled_mm", "aten._grouped_mm",
        "transformers.grouped_mm_fallback", "transformers.grouped_mm_fallback_backward"}


def causal_pairs(q_len: int, k_len: int, align: str = _TL) -> int:
    """Query-key pairs a causal kernel computes. Top left (torch's `is_causal`): query i sees keys 0..i. Bottom right
    (the flash kernels, flash-attn): the last query sees every key, query i sees keys 0..k_len - q_len + i."""
    if align == _BR:
        if q_len <= k_len:
            return q_len * (k_len - q_len) + q_len * (q_len + 1) // 2
        return k_len * (k_len + 1) // 2
    if q_len <= k_len:
        return q_len * (q_len + 1) // 2
    return k_len * (k_len + 1) // 2 + (q_len - k_len) * k_len


def _arg(spec: tuple, args, kwargs, default=None):
    name, at = spec
    if kwargs and name in kwargs:
        return kwargs[name]
    return args[at] if at is not None and len(args) > at else default


def pairs_within(q_len: int, k_len: int, causal: bool, align: str = _TL, left: int = -1, right: int = -1) -> int:
    """Query-key pairs a call computes: query i sees keys i + off - left .. i + off + right (off = k_len - q_len
    from the bottom right, 0 from the top left), within 0 .. k_len - 1; a negative size is unbounded, and a causal
    call's right size is 0. Counted by diagonals (j - i), so a window of a million queries costs no loop."""
    if not causal and left < 0 and right < 0:
        return q_len * k_len
    off = k_len - q_len if align == _BR else 0
    high = off + (0 if causal else right) if causal or right >= 0 else k_len
    low = off - left if left >= 0 else -q_len
    return max(0, _at_most(q_len, k_len, high) - _at_most(q_len, k_len, low - 1))


def _at_most(q_len: int, k_len: int, d: int) -> int:
    """Pairs (i, j), 0 <= i < q_len, 0 <= j < k_len, with j - i <= d: the sum over i of min(max(i + d + 1, 0),
    k_len)."""
    c = d + 1
    lo = min(q_len, max(0, -c))  # rows before it see no key
    hi = min(q_len, max(lo, k_len - c))  # rows from it on see every key
    return (hi - lo) * c + (hi - lo) * (lo + hi - 1) // 2 + (q_len - hi) * k_len


def attention(name: str, args, kwargs=None, flash: tuple | None = None) -> tuple[float, tuple]:
    """(FLOPs, shape) of one attention kernel call. `shape`: (queries, keys per query as the kernel loops over them,
    head dim, causal, batch x heads): what efficiency.py reads the kernel's efficiency curve at. `flash`: a model's
    masked SDPA call that stands for its flash path, as `flash_as_called` describes it (the mask is not read)."""
    spec = ATTENTION[name]
    q, k, v = (args[1], args[2], args[3]) if spec.direction == "backward" else (args[0], args[1], args[2])
    flag = _arg(spec.causal, args, kwargs, 0)
    align = spec.align
    if align == "mask_type":
        flag, align = int(flag or 0), {1: _TL, 2: _BR}.get(int(flag or 0), _TL)
    causal = bool(flag)
    if spec.layout == "bhsd":
        batch, heads, q_len, d_qk = q.shape
        lengths = [(q_len, k.shape[-2])] * batch
    else:  # [batch, seq, heads, dim], or varlen [tokens, heads, dim] with offsets
        heads, d_qk = q.shape[-2], q.shape[-1]
        lengths = _lengths(spec, args, q, k)
    left, right = (_size(_arg(w, args, kwargs)) for w in spec.window) if spec.window else (-1, -1)
    if flash is not None:
        causal, left, right, documents = flash
        align = _BR
        lengths = [(n, n) for n in documents] if documents else lengths
    pairs = [pairs_within(a, b, causal, align, left, right) for a, b in lengths]
    if left >= 0:  # a sliding window: the keys its kernel loops over are the window's, not the sequence's
        band = left + 1 + (0 if causal else right if right >= 0 else max(b for _, b in lengths))
        lengths = [(a, min(b, band)) for a, b in lengths]
    d_v = v.shape[-1]
    per_pair = 3 * d_qk + 2 * d_v if spec.direction == "backward" else d_qk + d_v
    flops = 2.0 * sum(pairs) * heads * per_pair
    total = sum(pairs) or 1
    q_mean = sum(p * a for p, (a, _) in zip(pairs, lengths)) / total  # pair-weighted: where the work is
    k_mean = sum(p * b for p, (_, b) in zip(pairs, lengths)) / total
    return flops, (q_mean, k_mean, d_qk, causal, len(lengths) * heads)


def flash_as_called(module, key_len: int, sliding_window, position_ids, is_causal=None, rows=None) -> tuple:
    """What transformers' flash path hands the kernel for an attention call (integrations/flash_attention.py,
    modeling_flash_attention_utils.py: _flash_attention_forward): (causal: the call's `is_causal`, else the
    module's; the window's left and right sizes: `sliding_window` - 1 each where the keys outrun it, the right one
    hidden by causality; the sequences of its varlen form, else None). The flash path takes a padded batch's
    attention mask first: it unpads the rows (_upad_input) and runs varlen over each row's own tokens, `rows` (the
    mask's sum per row, the padding computed by no one); else a batch of one whose `position_ids` restart runs
    varlen per document (_is_packed_sequence, prepare_fa_kwargs_from_position_ids)."""
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    window = sliding_window - 1 if sliding_window is not None and key_len > sliding_window else -1
    documents = list(rows) if rows is not None else None
    if documents is None and position_ids is not None and position_ids.dim() == 2 and position_ids.shape[0] == 1:
        try:  # known in a projection: the batch's own positions, read on the real tensor, which no mode may see
            with _disable_current_modes():
                pos = _constant(position_ids)[0]
                starts, total = torch.nonzero(pos == pos.min()).flatten().tolist(), pos.numel()
        except Exception:  # noqa: BLE001 - unknown positions: one sequence
            starts = []
        if len(starts) > 1:
            documents = [b - a for a, b in zip(starts, starts[1:] + [total])]
    return causal, window, -1 if causal else window, documents


def _size(value) -> int:
    """A window size as flash-attn reads it: None or negative is unbounded (-1)."""
    return -1 if value is None or int(value) < 0 else int(value)


def _lengths(spec: Attention, args, q, k) -> list[tuple[int, int]]:
    """(queries, keys) of each sequence: per document where the call has offsets (the memory-efficient kernel's
    varlen form keeps q 4-D, [1, tokens, heads, dim]: meta__efficient_attention_forward), else the batch's."""
    at = spec.offsets_at
    if at is not None and len(args) > at + 1 and args[at] is not None:
        try:  # the offsets are known values in a projection when they derive from the batch's positions
            cq, ck = _values(args[at]), _values(args[at + 1])
            return [(cq[i + 1] - cq[i], ck[i + 1] - ck[i]) for i in range(len(cq) - 1)]
        except Exception:  # noqa: BLE001 - unknown offsets: one sequence of all the tokens (an upper bound)
            pass
    if q.dim() == 4:
        return [(q.shape[1], k.shape[1])] * q.shape[0]
    return [(q.shape[0], k.shape[0])]


def _constant(t: torch.Tensor) -> torch.Tensor:
    """A fake tensor's known values, as the real tensor it carries (a real tensor as it is)."""
    constant = getattr(t, "constant", None)
    if constant is None:
        if type(t) is not torch.Tensor:
            raise ValueError("a fake tensor without known values")
        return t
    return constant


def _values(t: torch.Tensor) -> list:
    """A tensor's values as a list; a fake tensor's known values read from the real tensor it carries (a fake
    tensor's own `tolist` dispatches an op per element: a packed tile's offsets, hundreds of documents, in every
    attention call was a third of a packed projection's time)."""
    constant = getattr(t, "constant", None)
    if constant is None:
        return t.tolist()
    with _disable_current_modes():  # a real tensor: no mode of the projection's (fake tensors, trace) may see it
        return constant.tolist()


def gemm(name: str, args) -> tuple[float, tuple]:
    """(FLOPs, shape) of one matrix multiplication. `shape`: (m, n, k, groups), one group's problem (a batched or
    grouped GEMM runs its groups side by side in one launch)."""
    if name in ("aten.addmm", "aten.baddbmm"):
        a, b = args[1], args[2]
    else:
        a, b = args[0], args[1]
    if name.startswith("transformers.grouped_mm_fallback"):  # (input [S, K], weight [E, K, N], offs, [grad])
        s, kk, n, groups = a.shape[0], a.shape[1], b.shape[-1], b.shape[0]
        passes = 2 if name.endswith("backward") else 1  # the backward: grad input and grad weight
        return 2.0 * s * kk * n * passes, (max(1, s // groups), n, kk, groups)
    if name == "aten._grouped_mm":
        offs = args[2] if len(args) > 2 else None
        return _grouped(a, b, offs.shape[0] if isinstance(offs, torch.Tensor) else 1)
    batch = a.shape[0] if a.dim() == 3 else 1
    m, k = a.shape[-2], a.shape[-1]
    n = b.shape[-1]
    return 2.0 * batch * m * k * n, (m, n, k, batch)


def _grouped(a: torch.Tensor, b: torch.Tensor, groups: int) -> tuple[float, tuple]:
    """torch._grouped_mm: 2-D x 3-D (token rows grouped by expert: the experts' forward and input gradient), 2-D x
    2-D (the contraction grouped: the experts' weight gradient, one [m, n] output per group), 3-D x 3-D (batched)."""
    if a.dim() == 2 and b.dim() == 3:
        (m, k), n = a.shape, b.shape[-1]
        return 2.0 * m * k * n, (max(1, m // groups), n, k, groups)
    if a.dim() == 2 and b.dim() == 2:  # out [groups, m, n]; each group contracts its own slice of k
        m, k, n = a.shape[0], a.shape[1], b.shape[1]
        return 2.0 * m * k * n, (m, n, max(1, k // groups), groups)
    if a.dim() == 3 and b.dim() == 2:  # out [m, n_total], each group its own columns
        m, k = a.shape[1], a.shape[2]
        n = b.shape[-1]
        return 2.0 * m * k * n, (m, max(1, n // groups), k, groups)
    groups, m, k = a.shape
    return 2.0 * groups * m * k * b.shape[-1], (m, b.shape[-1], k, groups)
