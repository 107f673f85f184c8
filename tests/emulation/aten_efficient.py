"""aten's memory-efficient (cutlass) ops, emulated: `_scaled_dot_product_efficient_attention` and its backward, each
taking exactly the real op's schema. The sdpa-level op transposes BHSD to BMHK and calls `_efficient_attention_forward
/ _backward`, whose host code and kernels (mem_eff_attention/kernel_forward.h, kernel_backward.h) this follows for
an sm80+ GPU (A100/H100/H200: the Sm80 kernels, all "aligned").

Sources: kernel_forward.h, kernel_backward.h, gemm_kernel_utils.h, mma_from_smem.h, epilogue_rescale_output.h as
installed with torch 2.13.0 (exact lines, "KF"/"KB"); attention.cu `_scaled_dot_product_efficient_attention_cuda` and
the cutlass forward host code (main: efficient_attention_forward_cutlass_origin); attention_backward.cu
`_efficient_attention_backward` and `_scaled_dot_product_efficient_attention_backward_cuda` (lines of the annotated
main copy, "BWD"); torch/_meta_registrations.py (2.13.0).

What a caller must know (all verified in those files):
- `out` in the fp16/bf16 backward: the kernel computes delta = rowsum(dO * O) itself (KB:272-273
  kKernelComputesDelta = kIsHalf && ... on sm80) reading O at batch/head strides from the tensor (BWD L802-803) but a
  ROW stride assumed to be num_heads * head_dim_value of the call (KB:684-686 o_strideM(), used at KB:793 and
  KB:2524-2527). fp32: delta = (grad_out.float() * out.float()).sum(-1) with torch ops (BWD L759-764), through out's
  own strides, and out is read nowhere else. grad_out is copied contiguous first in both.
- the LSE: rows contiguous, batch/head strides from the tensor (BWD L796-797), checked %8 (KB:1189-1194); the kernel
  reads ceil(M / 32) * 32 rows per (b, h) (mma_from_smem.h:1603-1605), padding included, as exp(s - lse) against
  zero-filled query rows: padding of NaN or -inf poisons dk/dv. The forward writes +inf there (KF:1168-1185).
- attn_bias: sizes exactly [B, H, M, N], no broadcasting (BWD L836-848, same in the forward); any strides with a
  contiguous last dim, so a stride-0 expanded view passes; strides aligned (KF:579-593, KB:1222-1238).
- a row that sees no key: out 0 (epilogue_rescale_output.h:150) and LSE 0, not -inf (KF:1176-1181).
- is_causal is CausalFromTopLeft (BWD L1082-1084; attention.cu): row i sees keys j <= i, also when M != N.
"""

from __future__ import annotations

import math

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
    expect,
    scores,
    softmax,
    storage_read,
)

ATEN = torch.ops.aten
KF, KB = "mem_eff_attention/kernel_forward.h (2.13.0)", "mem_eff_attention/kernel_backward.h (2.13.0)"
BWD, ATTN = "attention_backward.cu (main, annotated copy)", "attention.cu (main)"
DTYPES = "Only fp32, half & bf16 supported at the moment"
ALIGN_LSE = 32  # KF:114 kAlignLSE


def _align_fwd(dtype):  # kAlignmentQ/K = DefaultConfig::kAlignmentA/B (128 bits) for the aligned Sm80 kernels, KF:510
    return 4 if dtype == torch.float32 else 8


ALIGN_BWD = 4  # GemmType::kMinimumAlignment for Sm80 TensorOp, fp32 and 16-bit alike (gemm_kernel_utils.h:125,141)


def _common_checks(q, k, v):
    """efficient_attention_forward_cutlass_origin / _efficient_attention_backward: q/k/v BMHK."""
    for name, x in (("query", q), ("key", k), ("value", v)):
        expect(x.dim() == 4, f"{name}.dim() == 4")
    expect(q.size(0) == k.size(0), "query.size(0) == key.size(0)")
    expect(q.size(0) == v.size(0), "query.size(0) == value.size(0)")
    expect(k.size(1) == v.size(1), "key.size(1) == value.size(1)")
    expect(q.size(2) == k.size(2), "query.size(2) == key.size(2)")  # equal head counts: no GQA
    expect(q.size(2) == v.size(2), "query.size(2) == value.size(2)")
    expect(q.size(3) == k.size(3), "query.size(3) == key.size(3)")
    for name, x in (("query", q), ("key", k), ("value", v)):
        check(x.stride(-1) == 1, f"{name}: last dimension must be contiguous")  # CHECK_NOSPARSE_LASTCONTIGUOUS_CUDA
    check(q.dtype in (torch.float32, torch.float16, torch.bfloat16), DTYPES)  # DISPATCH_TYPES(query)
    for name, x in (("key", k), ("value", v)):
        if x.dtype != q.dtype:  # DISPATCH_TYPES reads query's dtype only; the kernel reads k/v bytes as that
            raise Undefined(f"{name} is {x.dtype}, read as {q.dtype} (no check)")


def _bias_checks(bias, q, k, align: int, ptr: str):
    if bias is None:
        return
    check(bias.stride(-1) == 1, "(*bias): last dimension must be contiguous")
    check(bias.dtype == q.dtype, "invalid dtype for bias - should match query's dtype")
    check(bias.dim() == 4, "Bias expected in BMHK format")
    check(bias.size(0) == q.size(0), "attn_bias: wrong shape (batch dimension)")
    check(bias.size(1) == q.size(2), "attn_bias: wrong shape (head dimension)")
    check(bias.size(2) == q.size(1), "attn_bias: wrong shape (seqlenQ dimension)")
    check(bias.size(3) == k.size(1), "attn_bias: wrong shape (seqlenKV dimension)")
    b, m, h = q.size(0), q.size(1), q.size(2)
    check(aligned(bias, align), f"{ptr} is not correctly aligned")
    for dim, n, name in ((0, b, "strideB"), (1, h, "strideH"), (2, m, "strideM")):
        check(n <= 1 or bias.stride(dim) % align == 0,
              f"attn_bias is not correctly aligned ({name}). attn_bias.stride({dim}) = {bias.stride(dim)}, and "
              f"should be a multiple of {align}.")


def _strides(tensors, align: int, fwd: bool):
    """check_supported (KF:573-612, KB:1185-1221): strides and pointers in multiples of the kernel's alignment."""
    for name, x in tensors:
        num_b, num_h = x.size(0), x.size(2)
        check(aligned(x, align), f"p.{name}_ptr is not correctly aligned")
        check(x.stride(1) % align == 0, f"{name} is not correctly aligned (strideM)")
        check(num_h <= 1 or x.stride(2) % align == 0, f"{name} is not correctly aligned (strideH)")
        if not fwd:
            check(num_b <= 1 or x.stride(0) % align == 0, f"{name} is not correctly aligned (strideB)")


def _mask(m: int, n: int, causal: bool) -> torch.Tensor:
    """CausalFromTopLeft (KB:1631-1641): query i sees key j <= i, whatever M and N."""
    ones = torch.ones(m, n, dtype=torch.bool)
    return ones.tril() if causal else ones


def sdpa_efficient(*args, **kwargs):
    """aten::_scaled_dot_product_efficient_attention (BHSD) -> (output, log_sumexp, philox_seed, philox_offset)."""
    a = bind(ATEN._scaled_dot_product_efficient_attention.default, args, kwargs)
    emulated(a["dropout_p"] == 0, "dropout")
    emulated(a["query"].size(0) <= 65535, "batch chunking")
    q, k, v = (a[n].transpose(1, 2) for n in ("query", "key", "value"))  # BMHK, as _efficient_attention_forward
    bias = a["attn_bias"]
    _common_checks(q, k, v)
    _bias_checks(bias, q, k, _align_fwd(q.dtype), "p.attn_bias_ptr")
    align = _align_fwd(q.dtype)
    # launch: a kernel is picked only when the head strides (stride(2) of BMHK) are aligned
    check(all(x.stride(2) % align == 0 for x in (q, k)), "cutlassF: no kernel found to launch!")
    _strides((("query", q), ("key", k)), align, fwd=True)
    b, m, h, kv = q.size(0), q.size(1), q.size(2), v.size(3)
    scale = a["scale"] if a["scale"] is not None else q.size(3) ** -0.5
    s, _ = scores(q.transpose(1, 2), k.transpose(1, 2), scale, bias=bias)
    p, lse = softmax(s, _mask(m, k.size(1), a["is_causal"]))
    res = torch.empty(b, m, h, kv, dtype=q.dtype)  # BMHK contiguous, handed back transposed
    res.copy_((p @ v.transpose(1, 2).float()).transpose(1, 2))  # rows with no key: P 0, so out 0
    width = math.ceil(m / ALIGN_LSE) * ALIGN_LSE if a["compute_log_sumexp"] else 0
    out_lse = torch.full((b, h, width), INF)  # padding: +inf (KF:1182-1184)
    out_lse[..., :min(m, width)] = lse.masked_fill(torch.isneginf(lse), 0)[..., :width]  # no key: 0 (KF:1176-1181)
    seed, offset = torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)
    return res.transpose(1, 2), out_lse, seed, offset


def sdpa_efficient_backward(*args, **kwargs):
    """aten::_scaled_dot_product_efficient_attention_backward (BHSD) -> (grad_query, grad_key, grad_value,
    grad_bias or None)."""
    a = bind(ATEN._scaled_dot_product_efficient_attention_backward.default, args, kwargs)
    if a["grad_out_"] is None:
        return None, None, None, None
    emulated(a["dropout_p"] == 0, "dropout")
    emulated(a["query"].size(0) <= 65535, "batch chunking")
    dout_t, q, k, v, out = (a[n].transpose(1, 2) for n in ("grad_out_", "query", "key", "value", "out"))
    bias, lse = a["attn_bias"], a["logsumexp"]
    _common_checks(q, k, v)
    expect(q.dim() == dout_t.dim(), "query.dim() == grad_out_.dim()")
    expect(q.size(0) == dout_t.size(0), "query.size(0) == grad_out_.size(0)")
    expect(q.size(1) == dout_t.size(1), "query.size(1) == grad_out_.size(1)")
    expect(q.size(2) == dout_t.size(2), "query.size(2) == grad_out_.size(2)")
    expect(v.size(3) == dout_t.size(3), "value.size(3) == grad_out_.size(3)")
    dout = dout_t.contiguous()  # "handle potentially non-contiguous grad_out through a copy"
    b, m, h, d = q.shape
    n, kv = k.size(1), v.size(3)
    check(all(x.stride(2) % ALIGN_BWD == 0 for x in (q, k, v)), "cutlassB: no kernel found to launch!")
    half = q.dtype != torch.float32
    if half and out.dtype != q.dtype:
        raise Undefined(f"out is {out.dtype}, read as {q.dtype} by the kernel's delta (no check)")
    if dout.dtype != q.dtype:
        raise Undefined(f"grad_out is {dout.dtype}, read as {q.dtype} (no check)")
    _bias_checks(bias, q, k, ALIGN_BWD, "p.bias_ptr")
    _strides((("query", q), ("key", k), ("value", v)), ALIGN_BWD, fwd=False)
    check(aligned(out, ALIGN_BWD), "p.output_ptr is not correctly aligned")
    check(h <= 1 or lse.stride(1) % 8 == 0, "LSE is not correctly aligned (strideH)")
    check(b <= 1 or lse.stride(0) % 8 == 0, "LSE is not correctly aligned (strideB)")
    if lse.dtype != torch.float32:
        raise Undefined(f"logsumexp is {lse.dtype}, read as float32 (no check)")
    rows = math.ceil(m / ALIGN_LSE) * ALIGN_LSE  # the last block reads its LSE up to a multiple of 32 rows
    lse_read = storage_read(lse, (b, h, rows), (lse.stride(0), lse.stride(1), 1), "logsumexp rows")
    if half:  # the kernel's computeDelta: row m of head h at out + b*sB + h*sH + m*(H*Kv)
        o = storage_read(out, (b, m, h, kv), (out.stride(0), h * kv, out.stride(2), 1), "out read at row stride H*Kv")
    else:
        o = out
    delta = (dout.float() * o.float()).sum(-1).transpose(1, 2)  # [B, H, M]
    scale = a["scale"] if a["scale"] is not None else d ** -0.5
    qh, kh, vh, doh = (x.transpose(1, 2) for x in (q, k, v, dout))
    s, _ = scores(qh, kh, scale, bias=bias)
    s = s.masked_fill(~_mask(m, n, a["is_causal"]), -INF)
    p = torch.exp(s - lse_read[..., :m, None])  # no special case: an LSE of -inf gives inf/NaN here, as on the GPU
    dq, dk, dv, ds = attention_grads(doh, qh, kh, vh, p, delta, scale)
    # padding rows (zero queries, zero grad_out) add exp(0 - pad) * 0: NaN when that is not finite
    poisoned = ~torch.isfinite(torch.exp(-lse_read[..., m:])).all(-1)  # [B, H]
    dk[poisoned], dv[poisoned] = float("nan"), float("nan")
    grad_bias = None
    if bias is not None and a["grad_input_mask"][3]:  # last dim allocated padded to 16 (BWD, bias_requires_grad)
        grad_bias = torch.empty(*bias.shape[:-1], -(-n // 16) * 16, dtype=bias.dtype)[..., :n]
        grad_bias.copy_(ds)
    # grad_q/k/v: at::empty(query.sizes()) in BMHK, handed back transposed to BHSD
    grads = [torch.empty(x.transpose(1, 2).shape, dtype=q.dtype).copy_(g.transpose(1, 2)).transpose(1, 2)
             for g, x in ((dq, qh), (dk, kh), (dv, vh))]
    return (*grads, grad_bias)


_FWD, _BWD = ("sdpa_efficient",), ("sdpa_efficient_backward",)
_ALL = _FWD + _BWD


_row = contract_rows("aten.efficient.")


CONTRACT = [
    _row("schema", _ALL, "op._schema", "arguments bind to the op's schema; grad_input_mask has 4 entries",
         "Tried to convert a List with", enforced="_common.bind"),
    _row("dims", _ALL, f"{ATTN} forward_cutlass_origin; {BWD} _efficient_attention_backward", "4-D q/k/v",
         "Expected query.dim() == 4 to be true, but got false."),
    _row("heads", _ALL, f"{ATTN}; {BWD}", "equal head counts for q, k, v (no GQA)",
         "Expected query.size(2) == key.size(2) to be true, but got false."),
    _row("kv_seqlen", _ALL, f"{ATTN}; {BWD}", "key.size(1) == value.size(1)",
         "Expected key.size(1) == value.size(1) to be true, but got false."),
    _row("dtype", _ALL, "gemm_kernel_utils.h:18-32 DISPATCH_TYPES", "query fp32, fp16 or bf16", DTYPES),
    _row("kv_dtype", _ALL, "gemm_kernel_utils.h:18-32", "k/v (and out, grad_out) are read as query's dtype; not "
         "checked", kind="layout", test="test_efficient_reads_other_dtypes_as_the_querys",
         enforced="Undefined"),
    _row("last_dim", _ALL, "gemm_kernel_utils.h:70-74", "q/k/v stride(-1) == 1",
         "query: last dimension must be contiguous"),
    _row("bias_dtype", _ALL, f"{BWD} L830-832 (forward alike)", "bias in query's dtype",
         "invalid dtype for bias - should match query's dtype"),
    _row("bias_dim", _ALL, f"{BWD} L836", "bias 4-D", "Bias expected in BMHK format"),
    _row("bias_batch", _ALL, f"{BWD} L837-839", "bias.size(0) == batch: no broadcasting",
         "attn_bias: wrong shape (batch dimension)"),
    _row("bias_heads", _ALL, f"{BWD} L840-842", "bias.size(1) == heads: no broadcasting (expand it)",
         "attn_bias: wrong shape (head dimension)"),
    _row("bias_q", _ALL, f"{BWD} L843-845", "bias.size(2) == M", "attn_bias: wrong shape (seqlenQ dimension)"),
    _row("bias_k", _ALL, f"{BWD} L846-848", "bias.size(3) == N", "attn_bias: wrong shape (seqlenKV dimension)"),
    _row("bias_last", _ALL, "gemm_kernel_utils.h:70-74", "bias stride(-1) == 1",
         "(*bias): last dimension must be contiguous"),
    _row("bias_align_fwd", _FWD, f"{KF}:579-593", "bias strides % 8 (fp16/bf16) or 4 (fp32) where the dim > 1",
         "attn_bias is not correctly aligned (strideM)"),
    _row("bias_align_bwd", _BWD, f"{KB}:1222-1238", "bias strides % 4 where the dim > 1",
         "attn_bias is not correctly aligned (strideM)"),
    _row("launch_fwd", _FWD, f"{ATTN} launchKernel 'Alignment'", "q/k head strides (BMHK stride(2)) % 8 or 4",
         "cutlassF: no kernel found to launch!"),
    _row("launch_bwd", _BWD, f"{BWD} L743-748", "q/k/v head strides % 4", "cutlassB: no kernel found to launch!"),
    _row("row_align", _ALL, f"{KF}:595-603, {KB}:1213-1221", "q/k row strides (BMHK stride(1)) % alignment",
         "query is not correctly aligned (strideM)"),
    _row("ptr_align", _ALL, f"{KF}:574-578, {KB}:1181-1188", "data pointers aligned (storage offset)",
         "p.query_ptr is not correctly aligned"),
    _row("lse_align", _BWD, f"{KB}:1189-1194", "LSE stride(1) % 8 (heads > 1), stride(0) % 8 (batch > 1)",
         "LSE is not correctly aligned (strideH)"),
    _row("bwd_out_rows", _BWD, f"{KB}:272-273,684-686,2524-2527; {BWD} L759-764,802-803",
         "fp16/bf16: out read with row stride H * Kv of the call (batch/head strides its own); fp32: its own strides",
         kind="layout", test="test_efficient_backward_reads_out_rows_at_heads_times_dim",
         enforced="storage_read(out, strides (sB, H*Kv, sH, 1)); Undefined past the storage"),
    _row("bwd_lse_rows", _BWD, f"{KB}:770,1684; mma_from_smem.h:1603-1605", "LSE rows contiguous, ceil(M/32)*32 "
         "of them read per (b, h); padding NaN or -inf poisons dk/dv", kind="layout",
         test="test_efficient_backward_reads_lse_padding", enforced="storage_read; NaN dk/dv"),
    _row("lse_layout", _FWD, f"{KF}:114,1168-1185; meta__scaled_dot_product_efficient_attention",
         "LSE fp32 [B, H, ceil(M/32)*32], padding +inf; [B, H, 0] without compute_log_sumexp", kind="semantics",
         test="test_output_layouts"),
    _row("empty_rows", _FWD, f"{KF}:1176-1181; epilogue_rescale_output.h:150", "no visible key: out 0, LSE 0",
         kind="semantics", test="test_efficient_rows_without_keys_get_lse_zero"),
    _row("causal_alignment", _ALL, f"{BWD} L1082-1084; {KB}:1631-1641", "is_causal = CausalFromTopLeft",
         kind="semantics", test="test_efficient_causal_is_top_left"),
    _row("expanded_bias", _ALL, f"{BWD} L836-854", "only sizes are checked: a stride-0 expanded bias passes",
         kind="semantics", test="test_efficient_bias_may_be_an_expanded_view"),
]
