"""cuDNN's fused attention as the ring's tile kernel for sdpa models, where PyTorch's SDPA itself would pick it.

On Hopper and Blackwell with cuDNN > 9.15 (`target.sdpa_prefers_cudnn`) SDPA tries cuDNN first, and the model's own
attention (cp 1, Ulysses) runs it; the ring calls the same op, `aten._scaled_dot_product_cudnn_attention` with
`compute_log_sumexp=True`, and its backward, which takes the merged output and LSE as the ring needs. The time model's
figures (cpbench/harness/project/gpus.toml, H100, causal, head dim 128, 16k tokens: cuDNN 0.545 / 0.522 of the bf16
peak forward / backward, the FA2-class flash kernel 0.339 / 0.326, the memory-efficient kernel 0.165 / 0.159, each
from the FlashAttention-3 paper's figures) make it the fastest kernel for every tile it can take. The contract the
calls keep, from PyTorch's sources (tests/emulation/aten_cudnn.py enforces each):

- `takes`: the rules of sdp_utils.cpp `can_use_cudnn_attention` that a tile can break: cuDNN SDP not disabled
  (check_runtime_disabled_cudnn), not in deterministic mode (check_cudnn_deterministic), sm80..sm121
  (check_cudnn_hardware_support), fp16/bf16 (check_dtypes_low_precision), batch and heads <= 65535, head dims
  multiples of 8 (the ring pads) up to 128, or (192, 128) on sm90/sm10x with cuDNN >= 9.11
  (check_cudnn_tensor_shapes; the 256 limit of cuDNN > 9.22 also needs a cudnn-frontend >= 1.24 in the torch build,
  which cannot be read at run time: such head dims stay on the flash kernel), and seq_kv != 1. The ring calls
  the op directly, never where SDPA would not.
- causal is aligned top-left (cudnn/MHA.cpp build_graph: set_causal_mask -> DiagonalAlignment_t::TOP_LEFT): a causal
  call is only ever a square diagonal tile, where top-left and bottom-right agree;
- GQA as it is (k/v with fewer heads; dk/dv come back at the kv head count); d_qk != d_v allowed;
- the LSE is fp32 [B, H, S_q, 1] (MHA.cpp run_cudnn_SDP_fprop); the backward reads it through the strides it is
  given and is handed a contiguous one; an LSE of -inf is made 0 first (a row that sees no key anywhere);
- a masked (DENSE) tile: an additive bias [B, 1, rows, k] in the query's dtype with the masked positions at -65504,
  as SDPA converts a bool mask for cuDNN (attention.cpp convert_boolean_attn_mask_cudnn: "workaround -inf issue"),
  its rows padded to 16 elements; exp(-65504 + s - lse) is 0 in fp32, so the rows are exact, and a row with no
  visible key gets LSE -inf from the ring (its finite cuDNN LSE would be the bias's).

Masked tiles of packed documents (SEGMENTS, cp/ring/segments.py): torch 2.13 exposes cuDNN's ragged form only to
nested tensors behind an experimental switch (sdp_utils.cpp check_for_nested_inputs:
TORCH_CUDNN_SDPA_NESTED_TENSOR_ENABLED, sm90/sm100, query runs > 128 tokens) and without windows, so a SEGMENTS tile
runs either as one dense cuDNN call per document run (`runs_worth_it`) or as one flash varlen call (cp/ring/cuda.py).
The time model decides: a run on cuDNN saves flops * (1 / 0.339 - 1 / 0.545) / peak of its forward against flash
varlen on an H100 (and more in the backward), and costs one more call (the host's dispatch, cpu_op_s = 10 us, and
the kernel floor, kernel_s = 3 us), so it pays from `RUN_MIN_FLOPS` forward FLOPs per call (1.3e-5 s x 989e12
FLOP/s / 1.115); a tile whose every run pays goes to cuDNN run by run, any other (or one with a sliding window,
which the op cannot say) to flash varlen.
"""

from __future__ import annotations

import torch

from cpbench.cp.ring.kernels import safe_lse
from cpbench.cp.ring.masks import CAUSAL, DENSE
from cpbench.cp.ring.segments import Segments
from cpbench.cp.ring.target import KernelTarget, sdpa_prefers_cudnn

CUDNN_DTYPES = (torch.float16, torch.bfloat16)
MAX_BATCH_OR_HEADS = 65535  # sdp_utils.cpp check_cudnn_tensor_shapes
MAX_HEAD_DIM = 128  # the same: head_dim_limit without the d256 support of cuDNN > 9.22 and frontend >= 1.24
MASKED = -65504.0  # attention.cpp convert_boolean_attn_mask_cudnn
RUN_MIN_FLOPS = 1.15e10  # the break-even of one more cuDNN call against flash varlen (module docstring)


def prefers(target: KernelTarget) -> bool:
    """Whether this target's SDPA tries cuDNN first, and the process allows cuDNN's attention at all."""
    deterministic = torch.are_deterministic_algorithms_enabled() and \
        not torch.is_deterministic_algorithms_warn_only_enabled()
    return (sdpa_prefers_cudnn(target) and torch.backends.cuda.cudnn_sdp_enabled() and not deterministic
            and (8, 0) <= target.capability <= (12, 1))


def takes(target: KernelTarget, q: torch.Tensor, v: torch.Tensor | None, k_len: int) -> bool:
    """Whether cuDNN takes a tile of these queries and values (`k_len` keys): the module docstring's rules, on the
    head dims as the ring pads them (multiples of 8)."""
    b, h, s_q, d = q.shape
    d_qk, d_v = _round8(d), _round8(d if v is None else v.shape[-1])
    sm90_or_10x = target.capability == (9, 0) or target.capability[0] == 10
    limit = MAX_HEAD_DIM
    if sm90_or_10x and (target.cudnn_version or 0) >= 91100 and (d_qk, d_v) == (192, 128):
        limit = 192
    return (q.dtype in CUDNN_DTYPES and b <= MAX_BATCH_OR_HEADS and h <= MAX_BATCH_OR_HEADS and d_qk <= limit
            and d_v <= limit and k_len != 1 and s_q > 0 and k_len > 0)


def forward(op, q, k, v, causal: bool, scale: float, bias=None):
    """One cuDNN call: (out [B, H, q, Dv] in q's dtype, LSE fp32 [B, H, q])."""
    if causal:
        assert q.shape[2] == k.shape[2], "a causal cuDNN call is a square diagonal tile (top-left alignment)"
    out, lse, *_ = op(q, k, v, bias, True, 0.0, causal, False, scale=scale)
    return out, lse[..., 0]


def backward(op, dout, q, k, v, out, lse, causal: bool, scale: float, bias=None):
    """One cuDNN backward call: (dq, dk, dv) at q's and k/v's shapes. `lse` [B, H, q] in the accumulation dtype."""
    lse4 = safe_lse(lse).float().contiguous()[..., None]  # the [B, H, S_q, 1] fp32 the forward returned
    seed = torch.zeros((), dtype=torch.int64, device=q.device)  # dropout's Philox state: unread at dropout 0
    return op(dout, q, k, v, out, lse4, seed, seed.clone(), bias, None, None, q.shape[2], k.shape[2], 0.0, causal,
              scale=scale)[:3]


def tile_forward(op, q, k, v, tile, scale: float, acc: torch.dtype, blocks, pad):
    """A FULL, CAUSAL or DENSE tile: GQA natively, one call per row block of `blocks` ((rows, bias or None), a DENSE
    tile's rows with their bias; any other tile whole). Returns out [B, H, q, Dv] and LSE [B, H, q] in `acc`."""
    b, h, sq, _ = q.shape
    d_v = v.shape[-1]
    out = torch.empty(b, h, sq, d_v, dtype=acc, device=q.device)
    lse = torch.empty(b, h, sq, dtype=acc, device=q.device)
    q, k, v = pad(q), pad(k), pad(v)
    for rows, bias in blocks:
        o, l = forward(op, q[:, :, rows], k, v, tile.kind == CAUSAL, scale, bias)
        out[:, :, rows], lse[:, :, rows] = o[..., :d_v], l
        del o, l
    if tile.kind == DENSE:  # a row that sees no key: 0 and -inf for the merge (cuDNN averaged its masked keys)
        blind = ~tile.allowed.any(-1)
        lse.masked_fill_(blind, float("-inf"))
        out.masked_fill_(blind[..., None], 0.0)
    return out, lse


def tile_backward(op, dout, q, k, v, out, lse, tile, scale: float, dq, dk, dv, blocks, pad) -> None:
    """Adds the tile's gradients into the accumulators (out and dout in q's dtype)."""
    d, d_v = q.shape[-1], v.shape[-1]
    dout, q, k, v, out = (pad(x) for x in (dout, q, k, v, out))
    for rows, bias in blocks:
        gq, gk, gv = backward(op, dout[:, :, rows], q[:, :, rows], k, v, out[:, :, rows], lse[:, :, rows],
                              tile.kind == CAUSAL, scale, bias)
        dq[:, :, rows] += gq[..., :d]
        dk += gk[..., :d]
        dv += gv[..., :d_v]
        del gq, gk, gv


def bias_rows(allowed: torch.Tensor, dtype: torch.dtype, batch: int) -> torch.Tensor:
    """A DENSE tile's rows [B|1, 1|H, rows, k] (True = attend) as cuDNN's additive bias [B, 1|H, rows, k]: the
    batch materialised (no stride-0 dimension is handed to cuDNN), the last dim laid out padded to 16 elements."""
    sk = allowed.shape[-1]
    shape = (batch, allowed.shape[1], allowed.shape[2])
    padded = torch.zeros(*shape, sk + (-sk % 16), dtype=dtype, device=allowed.device)
    bias = padded[..., :sk]
    bias.masked_fill_(~allowed.expand(*shape, sk), MASKED)
    return bias


def runs_worth_it(target: KernelTarget, q: torch.Tensor, v: torch.Tensor, seg: Segments) -> bool:
    """Whether a SEGMENTS tile runs as one cuDNN call per run (see the module docstring), else flash varlen."""
    if seg.window != (-1, -1) or not takes(target, q, v, 2):
        return False
    heads, dim = q.shape[1], q.shape[-1]
    rows = q.shape[0] if seg.rows == 1 else 1  # a run shared by every batch row is one call over the batch
    for _, qs, qe, ks, ke in seg.runs:
        n_q, n_k = qe - qs, ke - ks
        if n_k == 1 or (seg.causal and n_q != n_k):
            return False
        pairs = n_q * (n_q + 1) // 2 if seg.causal else n_q * n_k
        if 4.0 * pairs * heads * dim * rows < RUN_MIN_FLOPS:
            return False
    return True


def _calls(seg: Segments, batch: int):
    """(batch rows, q rows, k rows) of each call of a SEGMENTS tile run by run."""
    for r, qs, qe, ks, ke in seg.runs:
        rows = slice(0, batch) if seg.rows == 1 else slice(r, r + 1)
        yield rows, slice(qs, qe), slice(ks, ke)


def runs_forward(op, q, k, v, seg: Segments, scale: float, acc: torch.dtype, pad):
    """A SEGMENTS tile run by run: out [B, H, n, Dv] and LSE [B, H, n] in `acc`, rows outside every run 0 / -inf.
    `pad`: the head-dim padding the kernel's calls take (cp/ring/cuda.py `_pad8`)."""
    b, h, n, _ = q.shape
    d_v = v.shape[-1]
    out = torch.zeros(b, h, n, d_v, dtype=acc, device=q.device)
    lse = torch.full((b, h, n), float("-inf"), dtype=acc, device=q.device)
    for rows, qr, kr in _calls(seg, b):
        o, l = forward(op, pad(q[rows, :, qr]), pad(k[rows, :, kr]), pad(v[rows, :, kr]), seg.causal, scale)
        out[rows, :, qr] = o[..., :d_v].to(acc)
        lse[rows, :, qr] = l.to(acc)
    return out, lse


def runs_backward(op, dout, q, k, v, out, lse, seg: Segments, scale: float, dq, dk, dv, pad) -> None:
    d, d_v = q.shape[-1], v.shape[-1]
    for rows, qr, kr in _calls(seg, q.shape[0]):
        gq, gk, gv = backward(op, pad(dout[rows, :, qr]), pad(q[rows, :, qr]), pad(k[rows, :, kr]),
                              pad(v[rows, :, kr]), pad(out[rows, :, qr]), lse[rows, :, qr], seg.causal, scale)
        dq[rows, :, qr] += gq[..., :d]
        dk[rows, :, kr] += gk[..., :d]
        dv[rows, :, kr] += gv[..., :d_v]


def _round8(d: int) -> int:
    return d + (-d % 8)
