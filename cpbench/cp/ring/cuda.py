"""The ring's block kernel for sdpa models on CUDA: PyTorch's fused attention kernels, which return the LSE.

The matmul kernel (`TorchKernel`) computes a tile in fp32 and holds its scores: at 128k tokens over cp 8 a zigzag
tile is 8k x 8k per head, GiBs per layer and no tensor cores. This kernel calls the ops sdpa itself dispatches to,
as PyTorch's own context parallelism does, in the model's dtype:

- Where the target GPU's SDPA puts cuDNN first (Hopper and Blackwell with cuDNN > 9.15: cp/ring/target.py
  `sdpa_prefers_cudnn`, mirroring torch's own rule), every tile cuDNN takes: FULL, CAUSAL and DENSE ones (the mask as
  cuDNN's additive bias), and SEGMENTS ones run by run where that is faster than flash varlen (cp/ring/cudnn.py, with
  the time model's figures and the contract it keeps).
- Otherwise FULL and CAUSAL tiles in fp16/bf16 (head dim <= 256): the flash kernel
  (`_scaled_dot_product_flash_attention` and its backward). A ring's CAUSAL tile is square, where flash's
  bottom-right and the usual top-left causal alignment agree.
- SEGMENTS tiles in fp16/bf16 (packed documents, padded keys and sliding windows that flash's varlen form says;
  see cp/ring/segments.py): the flash kernel's variable-length form (`_flash_attention_forward` with cu_seqlens and
  window sizes, and its backward), no mask tensor.
- DENSE tiles (the masks varlen cannot say), fp32 inputs, head dims above 256 and a value head dim other than the
  query's (multi-head latent attention, e.g. q/k 192 and v 128): the memory-efficient kernel
  (`_scaled_dot_product_efficient_attention`), with the tile's mask as an additive bias in the query's dtype; a
  masked tile runs in blocks of query rows whose [B, 1, rows, k] bias stays within 256 MiB (no scores are kept, and
  no tile-sized bias exists).
- Logit soft-capping, fp64 and eager's fully blocked rows (`TileMask.uniform`): `TorchKernel`, exact.

The value head dim: the flash kernel (dense and varlen) takes one head dim for q, k and v (flash_api.cpp mha_fwd /
mha_varlen_fwd: CHECK_SHAPE(v, ..., head_size_og); emulated in tests/emulation/_flash.py `mha_fwd`), as sdpa's
dispatcher knows (cuda/sdp_utils.cpp check_head_dim_size_flash: "Flash attention requires q,k,v to have the same
last dimension and to be less than or equal to 256"). The efficient kernel checks q's head dim against k's only and
sizes its output and dV by v's (attention.cu efficient_attention_forward_cutlass_origin, attention_backward.cu;
tests/emulation/aten_efficient.py `_common_checks`): sdpa runs an MLA model there at cp=1, and so does the ring
(`route`), whose masked tiles then stay DENSE (`takes_segments` is False: varlen is the flash kernel too).

Both fused kernels take the merged (final) output and LSE in backward, as the ring needs: the tile's gradients
are then its exact share. The flash kernel takes GQA as it is (fewer kv heads; dk/dv come back at the kv head
count), one call per tile. The efficient kernel wants equal head counts: it is called one kv head at a time with
that head's k/v expanded to its query heads (a copy of one kv head per call, not of the whole block), and dk/dv are
summed back over the group. Outputs and the LSE go to the accumulation dtype for the merge.

On CPU this runs against emulations of the eight ops written from their sources (tests/emulation/, used by
tests/unit/test_ring_cuda.py, test_ring_contracts.py and tests/dist/test_ring_cuda_models.py); a projection
(`cpbench estimate`) runs the real ops' meta kernels, so it sees what they allocate.
"""

from __future__ import annotations

import torch

from cpbench.cp.ring import cudnn
from cpbench.cp.ring.kernels import TorchKernel, acc_dtype, safe_lse
from cpbench.cp.ring.masks import CAUSAL, DENSE, SEGMENTS, TileMask
from cpbench.cp.ring.segments import VarlenOps, varlen_backward, varlen_forward
from cpbench.cp.ring.target import AMPERE, KernelTarget

FLASH_DTYPES = (torch.float16, torch.bfloat16)
FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FLASH_MAX_HEAD_DIM = 256
LSE_ALIGN = 32  # the efficient kernel's LSE is [B, H, ceil(S / 32) * 32] (see torch's meta registration)
BIAS_BLOCK_BYTES = 1 << 28  # a masked tile runs in row blocks whose bias is at most this (256 MiB)


def aten_ops() -> dict:
    """The eight aten ops the kernel calls, by role (a test stands emulations in here for a whole model's run)."""
    aten = torch.ops.aten
    return {
        "flash": aten._scaled_dot_product_flash_attention,
        "flash_backward": aten._scaled_dot_product_flash_attention_backward,
        "efficient": aten._scaled_dot_product_efficient_attention,
        "efficient_backward": aten._scaled_dot_product_efficient_attention_backward,
        "varlen": aten._flash_attention_forward,
        "varlen_backward": aten._flash_attention_backward,
        "cudnn": aten._scaled_dot_product_cudnn_attention,
        "cudnn_backward": aten._scaled_dot_product_cudnn_attention_backward,
    }


FLASH_MIN_CAPABILITY = AMPERE  # PyTorch's flash kernels (and flash-attn 2) are built for Ampere and newer


class CudaSdpaKernel:
    def __init__(self, ops=None, bias_block_bytes: int = BIAS_BLOCK_BYTES, capability: tuple[int, int] | None = None,
                 target: KernelTarget | None = None):
        """`target`: the GPU the tiles are chosen for (cp/ring/target.py; default an A100), or just its
        `capability`. Below 8.0 (T4, V100) the flash kernels do not run: every tile goes to the memory-efficient
        kernel, which runs there in fp16 and fp32 (bf16 needs 8.0: refused)."""
        self.ops = ops or aten_ops()
        self.softcap = None  # the selector sends soft-capped models to TorchKernel
        self.bias_block_bytes = bias_block_bytes
        self.target = target or KernelTarget(capability=tuple(capability or AMPERE))
        self.capability = self.target.capability
        self.cudnn_first = cudnn.prefers(self.target)
        self.efficient_only = self.target.sdpa_kernel == "efficient"  # `cpbench estimate --sdpa-kernel efficient`
        self._exact = TorchKernel()
        self._varlen = VarlenOps(self._varlen_forward, self._varlen_backward)

    @property
    def flash(self) -> bool:
        """Whether this GPU runs the flash kernels (Ampere and newer)."""
        return self.capability >= FLASH_MIN_CAPABILITY

    def takes_segments(self, q: torch.Tensor, v: torch.Tensor | None = None) -> bool:
        """Whether this layer's masked tiles can come as SEGMENTS (the flash kernel's GPUs, dtypes and head dims:
        one head dim for q, k and v, at most 256)."""
        return self.flash and not self.efficient_only and q.dtype in FLASH_DTYPES and _flash_head_dims(q, v)

    def route(self, q: torch.Tensor, tile: TileMask, v: torch.Tensor | None = None) -> str:
        """"cudnn", "cudnn_runs", "flash", "varlen", "efficient" or "torch": which kernel serves this tile (`v`: the
        tile's values, whose head dim may differ from q's; default: the same, and as many keys as queries)."""
        k_len = q.shape[2] if v is None else v.shape[2]
        if tile.kind == SEGMENTS:
            assert _flash_head_dims(q, v), "SEGMENTS tiles are built only where takes_segments() holds"
            if self.cudnn_first and cudnn.runs_worth_it(self.target, q, q if v is None else v, tile.segments):
                return "cudnn_runs"
            return "varlen"
        if tile.uniform is not None or q.dtype not in FUSED_DTYPES:
            return "torch"
        if not self.flash and q.dtype == torch.bfloat16:
            raise ValueError(
                f"cp_ring: bfloat16 attention needs a GPU of compute capability 8.0 (Ampere) or newer; this one is "
                f"sm{self.capability[0]}{self.capability[1]}. Load the model in float16 or float32 on this GPU."
            )
        if self.cudnn_first and cudnn.takes(self.target, q, v, k_len):
            return "cudnn"
        if self.efficient_only:
            return "efficient"
        if self.flash and tile.kind != DENSE and q.dtype in FLASH_DTYPES and _flash_head_dims(q, v):
            return "flash"
        return "efficient"

    def forward(self, q, k, v, tile: TileMask, scale: float):
        route = self.route(q, tile, v)
        if route == "torch":
            return self._exact.forward(q, k, v, tile, scale)
        acc = acc_dtype(q.dtype)
        if route == "varlen":
            return varlen_forward(self._varlen, q, k, v, tile.segments, scale, acc)
        if route == "cudnn_runs":
            return cudnn.runs_forward(self.ops["cudnn"], q, k, v, tile.segments, scale, acc, _pad8)
        if route == "cudnn":
            blocks = self._row_blocks(tile, q.dtype, q.shape[2], k.shape[2], q.shape[0], cudnn_bias=True)
            return cudnn.tile_forward(self.ops["cudnn"], q, k, v, tile, scale, acc, blocks, _pad8)
        if route == "flash":  # GQA natively: one call for all heads
            out, lse, *_ = self.ops["flash"](_pad8(q), _pad8(k), _pad8(v), 0.0, tile.kind == CAUSAL, False,
                                             scale=scale)
            return out[..., : v.shape[-1]].to(acc), lse.to(acc)
        b, h, sq, _ = q.shape
        g, d_v = h // k.shape[1], v.shape[-1]
        out = torch.empty(b, h, sq, d_v, dtype=acc, device=q.device)
        lse = torch.empty(b, h, sq, dtype=acc, device=q.device)
        q, k, v = _pad8(q), _pad8(k), _pad8(v)  # the efficient kernel's aligned strides (see _pad8)
        for rows, bias in self._row_blocks(tile, q.dtype, sq, k.shape[2], b):
            n = rows.stop - rows.start
            for j, heads in _groups(k.shape[1], g):
                o, l, *_ = self.ops["efficient"](q[:, heads, rows], _expand(k, j, g), _expand(v, j, g),
                                                 _call_bias(bias, b, heads, g), True, 0.0, tile.kind == CAUSAL,
                                                 scale=scale)
                out[:, heads, rows] = o[..., :d_v]
                lse[:, heads, rows] = l[..., :n]
                del o, l
        if tile.kind == DENSE:
            lse.masked_fill_(~tile.allowed.any(-1), float("-inf"))  # a row that sees no key: -inf for the merge
        return out, lse

    def backward(self, dout, q, k, v, out, lse, tile: TileMask, scale: float, dq, dk, dv) -> None:
        route = self.route(q, tile, v)
        if route == "torch":
            return self._exact.backward(dout, q, k, v, out, lse, tile, scale, dq, dk, dv)
        if route == "varlen":
            return varlen_backward(self._varlen, dout, q, k, v, out, lse, tile.segments, scale, dq, dk, dv)
        sq = q.shape[2]
        causal = tile.kind == CAUSAL
        out, dout = out.to(q.dtype), dout.to(q.dtype)
        d, d_v = q.shape[-1], v.shape[-1]
        if route == "cudnn_runs":
            return cudnn.runs_backward(self.ops["cudnn_backward"], dout, q, k, v, out, lse, tile.segments, scale, dq,
                                       dk, dv, _pad8)
        if route == "cudnn":
            blocks = self._row_blocks(tile, q.dtype, sq, k.shape[2], q.shape[0], cudnn_bias=True)
            return cudnn.tile_backward(self.ops["cudnn_backward"], dout, q, k, v, out, lse, tile, scale, dq, dk, dv,
                                       blocks, _pad8)
        lse = safe_lse(lse).float()
        if route == "flash":
            seed, offset = _philox(q.device)
            gq, gk, gv = self.ops["flash_backward"](_pad8(dout), _pad8(q), _pad8(k), _pad8(v), _pad8(out),
                                                    lse.contiguous(), None, None, sq, k.shape[2], 0.0, causal, seed,
                                                    offset, scale=scale)[:3]
            dq += gq[..., :d]
            dk += gk[..., :d]
            dv += gv[..., :d_v]
            return None
        b, g = q.shape[0], q.shape[1] // k.shape[1]
        dout, q, k, v, out = (_pad8(x) for x in (dout, q, k, v, out))
        for rows, bias in self._row_blocks(tile, q.dtype, sq, k.shape[2], b):
            n = rows.stop - rows.start
            for j, heads in _groups(k.shape[1], g):
                lj = torch.nn.functional.pad(lse[:, heads, rows], (0, -n % LSE_ALIGN))
                seed, offset = _philox(q.device, flash=False)
                gq, gk, gv = self.ops["efficient_backward"](
                    dout[:, heads, rows], q[:, heads, rows], _expand(k, j, g), _expand(v, j, g),
                    _call_bias(bias, b, heads, g), _rows_packed(out[:, heads, rows]), lj, seed, offset, 0.0,
                    [True, True, True, False], causal, scale=scale,
                )[:3]
                dq[:, heads, rows] += gq[..., :d]
                dk[:, j] += gk[..., :d].sum(1, dtype=dk.dtype)  # the group's shares, summed in the accumulation dtype
                dv[:, j] += gv[..., :d_v].sum(1, dtype=dv.dtype)
                del gq, gk, gv
        return None

    def _varlen_forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, left, right, scale):
        out, lse, *_ = self.ops["varlen"](q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale,
                                          **_window(left, right))
        return out, lse

    def _varlen_backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, left, right, scale):
        seed, offset = _philox(q.device)
        return self.ops["varlen_backward"](dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal, seed,
                                           offset, scale=scale, **_window(left, right))[:3]

    def _row_blocks(self, tile: TileMask, dtype: torch.dtype, sq: int, sk: int, batch: int,
                    cudnn_bias: bool = False):
        """(query rows, their bias or None): a masked tile in blocks of rows whose bias stays within
        `bias_block_bytes`, so no tile-sized bias exists at long context; any other tile whole, without a bias.
        `cudnn_bias`: cuDNN's (finite masked value, the batch materialised), else the efficient kernel's."""
        if tile.kind != DENSE:
            yield slice(0, sq), None
            return
        rows_of = batch if cudnn_bias else tile.allowed.shape[0]
        per_row = rows_of * tile.allowed.shape[1] * (sk + 16) * dtype.itemsize
        step = max(1, self.bias_block_bytes // per_row)
        for start in range(0, sq, step):
            rows = slice(start, min(start + step, sq))
            if cudnn_bias:
                yield rows, cudnn.bias_rows(tile.allowed[..., rows, :], dtype, batch)
            else:
                yield rows, _bias(TileMask(DENSE, tile.allowed[..., rows, :]), dtype)


def _flash_head_dims(q: torch.Tensor, v: torch.Tensor | None) -> bool:
    """Whether the flash kernel takes these head dims: one for q, k and v (see the module docstring), at most 256."""
    return (v is None or v.shape[-1] == q.shape[-1]) and q.shape[-1] <= FLASH_MAX_HEAD_DIM


def _groups(kv_heads: int, g: int):
    return ((j, slice(j * g, (j + 1) * g)) for j in range(kv_heads))


def _expand(x: torch.Tensor, j: int, g: int) -> torch.Tensor:
    """kv head j for its g query heads, contiguous (no kernel is asked to read a stride-0 head dimension)."""
    return x[:, j : j + 1].expand(x.shape[0], g, *x.shape[2:]).contiguous()


def _bias(tile: TileMask, dtype: torch.dtype) -> torch.Tensor | None:
    """A DENSE tile's mask as the efficient kernel's additive bias [B, 1|H, q, k] in the query's dtype. The last
    dim is laid out padded to a multiple of 16 elements (then sliced), the alignment the kernel wants, as sdpa's
    own dispatch pads attention masks."""
    if tile.kind != DENSE:
        return None
    allowed = tile.allowed
    sk = allowed.shape[-1]
    padded = torch.zeros(*allowed.shape[:-1], sk + (-sk % 16), dtype=dtype, device=allowed.device)
    bias = padded[..., :sk]
    bias.masked_fill_(~allowed, float("-inf"))
    return bias


def _call_bias(bias: torch.Tensor | None, batch: int, heads: slice, g: int) -> torch.Tensor | None:
    """The bias of one kv head's query heads at the call's exact [B, g, q, k] size: the efficient kernel checks
    every dimension of the bias against the call (batch and heads included) and never broadcasts, so a shared
    [1|B, 1, q, k] bias is expanded (a stride-0 view, which it reads as such) and a per-head one sliced."""
    if bias is None:
        return None
    if bias.shape[1] != 1:
        bias = bias[:, heads]
    return bias.expand(batch, g, *bias.shape[2:])


def _rows_packed(x: torch.Tensor) -> torch.Tensor:
    """[B, h, n, D] laid out as [B, n, h, D] contiguous memory. The fp16/bf16 efficient backward computes
    delta = rowsum(dO * O) inside the kernel and reads O's row stride as h * D of the call (kernel_backward.h,
    `o_strideM()`), not from the tensor: a slice of the ring's saved output over some heads has the row stride of
    all heads, so the kernel would read other rows."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _pad8(x: torch.Tensor) -> torch.Tensor:
    """The head dim zero-padded to a multiple of 8: the flash op checks `head_size % 8 == 0` itself (sdpa pads in
    its dispatcher before calling it), and the efficient kernel wants its row and head strides (and data pointers)
    aligned to 8 elements in fp16/bf16 and 4 in fp32, or finds no kernel to launch (kernel_forward.h,
    kernel_backward.h). Zeros change no score, and the scale is always passed explicitly."""
    d = x.shape[-1]
    return torch.nn.functional.pad(x, (0, -d % 8)) if d % 8 else x


def _window(left: int, right: int) -> dict:
    """aten's window arguments: None is unbounded (flash-attn's -1)."""
    return {"window_size_left": None if left < 0 else left, "window_size_right": None if right < 0 else right}


def _philox(device, flash: bool = True):
    """Dropout's RNG state for a backward without dropout: read by neither kernel at dropout 0."""
    seed = torch.zeros(2 if flash else (), dtype=torch.int64, device=device)
    return seed, torch.zeros((), dtype=torch.int64, device=device)
