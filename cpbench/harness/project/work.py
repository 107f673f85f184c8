"""What one kernel call of a projected step computes and moves: its FLOPs, the bytes it reads and writes, and the
shape its efficiency depends on (efficiency.py prices that shape). Pure functions of an op's name and arguments,
called by the op trace (trace.py); nothing here knows a GPU.

Conventions, as the kernels' own papers count them:
- a matrix multiply-add is 2 FLOPs: an (m, k) x (k, n) GEMM is 2 m k n; a grouped GEMM (MoE experts) is the sum
  over its groups, whatever their sizes;
- attention forward is 2 x pairs x heads x (d_qk + d_v) (QK^T and PV; 4 x pairs x heads x d when the head dims
  agree), the backward 2.5 times that (five matmuls against two: the FlashAttention papers' convention); a causal
  call counts the query-key pairs its mask keeps, aligned as the kernel aligns them (`causal_pairs`);
- bytes are what an op reads plus what it writes, each tensor once: an expanded input (a stride-0 dimension) is
  read at its stored size, and what an op only overwrites (`copy_`, `fill_`, an `out=` tensor) is not read.
"""

from __future__ import annotations

import math
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


_TL, _BR = "top_left", "bottom_right"
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
    "aten._flash_attention_forward": Attention("forward", "", ("is_causal", 8), "bshd", _BR, 3),
    "aten._flash_attention_backward": Attention("backward", "", ("is_causal", 11), "bshd", _BR, 6),
    # custom_mask_type: 0 none, 1 causal from the top left, 2 from the bottom right (mem_eff_attention kernel_forward.h)
    "aten._efficient_attention_forward": Attention("forward", "_efficient", ("custom_mask_type", 9), "bshd",
                                                   "mask_type", 4),
    "aten._efficient_attention_backward": Attention("backward", "_efficient", ("custom_mask_type", 14), "bshd",
                                                    "mask_type", 6),
    # flash-attn >= 2.7's custom ops (cpbench/cp/ring/flash.py calls them with these positions)
    "flash_attn._flash_attn_forward": Attention("forward", "", ("causal", 5), "bshd", _BR),
    "flash_attn._flash_attn_backward": Attention("backward", "", ("causal", 11), "bshd", _BR),
    "flash_attn._flash_attn_varlen_forward": Attention("forward", "", ("causal", 9), "bshd", _BR, 3),
    "flash_attn._flash_attn_varlen_backward": Attention("backward", "", ("causal", 15), "bshd", _BR, 9),
    # FlashAttention-3's custom ops (hopper/flash_attn_interface.py; cpbench/cp/ring/fa3.py calls them by keyword),
    # dense [b, s, h, d] or varlen [tokens, h, d] with cu_seqlens. FlashAttention-4's `_flash_attn_fwd` is a plain
    # Python function over CuTe kernels, not an op the dispatcher sees: a model's own call is priced as SDPA's kernel
    # (`--sdpa-kernel fa4`).
    "flash_attn_3._flash_attn_forward": Attention("forward", "_fa3", ("causal", 24), "bshd", _BR, 7),
    "flash_attn_3._flash_attn_backward": Attention("backward", "_fa3", ("is_causal", 16), "bshd", _BR, 6),
}
GEMM = {"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten._scaled_mm", "aten._grouped_mm",
        "transformers.grouped_mm_fallback", "transformers.grouped_mm_fallback_backward"}
# Ops that overwrite their first argument without reading it
WRITE_ONLY = {"aten.copy_", "aten.fill_", "aten.zero_", "aten._foreach_copy_", "aten._foreach_zero_", "aten.normal_",
              "aten.uniform_", "aten.random_", "aten.bernoulli_", "aten.exponential_", "aten.set_"}


# Gathers: their first argument is read only where they pick (an embedding of a 151,936-row table for 8k tokens
# reads 8k rows, not the table): it counts at the output's size. `aten.index` is advanced indexing (`x[ids]`).
GATHER = {"aten.embedding", "aten.index_select", "aten.gather", "aten.index"}
# Scatters in place: their first argument is written (and, where they accumulate, read) only where they put, and
# their values read only where they are put from (_put_elements)
SCATTER = {"aten.index_put_", "aten._index_put_impl_", "aten.index_add_", "aten.index_copy_", "aten.scatter_",
           "aten.scatter_add_", "aten.scatter_reduce_", "aten.masked_scatter_"}
_ACCUMULATE = {"aten.index_add_", "aten.scatter_add_", "aten.scatter_reduce_"}  # index_put_, scatter_ by argument
FUSED_ADAM = {"aten::_fused_adam_", "aten::_fused_adamw_"}  # torch's fused Adam(W): one kernel, every tensor
# Under a dispatch mode autograd takes its tensor-subclass-safe backward, the out-of-place forms into fresh zeros
# (the backward of x[ids], index_select, gather); eager CUDA autograd puts in place into them: priced so in backward
IN_PLACE_OF = {"aten.index_put": "aten.index_put_", "aten.index_add": "aten.index_add_",
               "aten.scatter_add": "aten.scatter_add_", "aten.scatter": "aten.scatter_",
               "aten.index_copy": "aten.index_copy_", "aten.scatter_reduce": "aten.scatter_reduce_"}


# torch's CUDA softmax over rows (ATen/native/cuda/SoftMax.cu) reads a row more than once where the row fits neither
# the warp-per-row kernel, nor registers, nor a block's 48 KiB of shared memory (cudaDeviceProp.sharedMemPerBlock):
# cunn_SoftMaxForward reads it for its max, for its sum of exponentials and for the output; cunn_SoftMaxBackward
# reads the gradient for the row's sum and again for the result. A vocabulary's logits are such rows.
SOFTMAX = {"aten._softmax", "aten._log_softmax", "aten._softmax_backward_data", "aten._log_softmax_backward_data"}
_SMEM_PER_BLOCK = 48 * 1024


def softmax_rereads(name: str, args) -> int:
    """The bytes torch's CUDA softmax kernels read beyond each tensor once (host_softmax: `_softmax(self, dim,
    half_to_float)`; host_softmax_backward: `_softmax_backward_data(grad, output, dim, input_dtype)`), and the
    `grad * output` kernel softmax's backward runs first (softmax_backward_cuda_out), whose product it then reads."""
    x = args[0] if name in SOFTMAX and args and isinstance(args[0], torch.Tensor) else None
    if x is None or x.numel() == 0:
        return 0
    backward = name.endswith("_backward_data")
    dim = (args[2] if backward else args[1]) % max(x.dim(), 1)
    if math.prod(x.shape[dim + 1:]) != 1:
        return 0  # cunn_SpatialSoftMax*: a row strided across the inner dims, read once
    size = x.shape[dim] if x.dim() else 1
    product = 2 * tensor_bytes(x) + tensor_bytes(args[1]) if name == "aten._softmax_backward_data" else 0
    item = args[3].itemsize if backward else x.element_size()  # scalar_t: the input's dtype
    to_float = x.dtype != args[3] if backward else bool(args[2])
    rows = 1024 if backward or to_float else 2048  # dispatch_softmax_forward / _backward: a warp per row
    if size <= rows and size * item <= rows * 4:
        return product
    ilp = 16 // x.element_size()  # float4 loads
    if backward:  # dispatch_host_softmax_backward, SoftMax_getBlockSize(ILP, dim_size): a power of two, >= a warp
        threads, most = 1, min(size // ilp, 1024) // (2 if ilp > 1 else 1)
        while threads < most:
            threads *= 2
        threads = max(threads, 32)
    else:  # SoftMaxForward_getBlockSize: the row's length, at most 1024, up to a whole warp
        threads = -(-min(size, 1024) // 32) * 32
        if not to_float and -(-size // threads) < 10:
            return product  # cunn_SoftMaxForwardReg: the row held in registers
    if size < (_SMEM_PER_BLOCK - threads // 32 * 4) // x.element_size() and size % ilp == 0:
        return product  # cunn_SoftMax*Smem: the row read once into shared memory
    return product + tensor_bytes(x) * (1 if backward else 2)


def tensor_bytes(t: torch.Tensor) -> int:
    """The bytes a kernel touches reading or writing `t`: a stride-0 (expanded) dimension is one element wide."""
    return math.prod(s for s, st in zip(t.shape, t.stride()) if st != 0) * t.element_size() if t.numel() else 0


def moved_bytes(name: str, args, kwargs, inputs: list, outputs: list, backward: bool = False) -> int:
    """Bytes read plus bytes written; each distinct tensor counts once per direction. `outputs`: what the op writes,
    its results and what it writes in place (`mutated`: an in-place foreach op returns nothing). `backward`:
    the op runs in autograd's backward (IN_PLACE_OF)."""
    skip = {id(t) for t in _flat((kwargs or {}).get("out"))}
    if name in WRITE_ONLY and args:
        skip |= {id(t) for t in _flat(args[0])}
    picked = 0
    if name in GATHER and args and isinstance(args[0], torch.Tensor) and outputs:
        source = args[0]
        skip.add(id(source))
        picked = min(tensor_bytes(source), outputs[0].numel() * source.element_size())
    if backward and name in IN_PLACE_OF:
        name, outputs = IN_PLACE_OF[name], []  # the result is the zeros the put goes into: its rows written only
    if name in SCATTER and args and isinstance(args[0], torch.Tensor):
        target = args[0]
        elements, values = _put_elements(name, target, args)
        skip |= {id(target)} | ({id(values)} if values is not None else set())
        outputs = [t for t in outputs if t is not target]
        accumulate = name in _ACCUMULATE or bool((kwargs or {}).get("reduce")) or (
            name in ("aten.index_put_", "aten._index_put_impl_")
            and bool(args[3] if len(args) > 3 else (kwargs or {}).get("accumulate")))
        picked = min(elements, target.numel()) * target.element_size() * (2 if accumulate else 1)
        if values is not None:
            picked += min(tensor_bytes(values), elements * values.element_size())
    read = {id(t): t for t in inputs if id(t) not in skip}
    written = {id(t): t for t in outputs}
    return (picked + sum(map(tensor_bytes, read.values())) + sum(map(tensor_bytes, written.values()))
            + softmax_rereads(name, args))


def _put_elements(name: str, target: torch.Tensor, args) -> tuple[int, torch.Tensor | None]:
    """(the elements a scatter puts, some perhaps onto the same place of `target`; the tensor it takes them from)."""
    values = args[3] if name.startswith(("aten.scatter", "aten.index_add", "aten.index_copy")) else args[2]
    values = values if isinstance(values, torch.Tensor) else None
    if name.startswith("aten.scatter"):  # one element per index entry
        elements = args[2].numel()
    elif name in ("aten.index_add_", "aten.index_copy_"):  # whole slices, as its source holds
        elements = values.numel()
    elif name == "aten.masked_scatter_":  # where the mask is set: no more than the source holds
        elements = values.numel()
    else:  # index_put_: the indexed shape (a bool mask counted whole: where it is set is not known), values broadcast
        elements, dim, shapes = 1, 0, []
        for index in args[1]:
            if index is None:  # a full slice of this dim
                elements *= target.shape[dim]
                dim += 1
            elif index.dtype in (torch.bool, torch.uint8):
                elements *= index.numel()
                dim += index.dim()
            else:
                shapes.append(index.shape)
                dim += 1
        elements *= math.prod(torch.broadcast_shapes(*shapes)) * math.prod(target.shape[dim:]) if shapes else \
            math.prod(target.shape[dim:])
        elements = max(elements, values.numel() if values is not None else 0)
    return elements, values


def _flat(x) -> list:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _flat(item)]
    return []


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
    return args[at] if len(args) > at else default


def attention(name: str, args, kwargs=None) -> tuple[float, tuple]:
    """(FLOPs, shape) of one attention kernel call. `shape`: (queries, keys per query as the kernel loops over them,
    head dim, causal, batch x heads): what efficiency.py reads the kernel's efficiency curve at."""
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
    pairs = [causal_pairs(a, b, align) if causal else a * b for a, b in lengths]
    forward = 2.0 * sum(pairs) * heads * (d_qk + v.shape[-1])
    flops = forward * (2.5 if spec.direction == "backward" else 1.0)
    total = sum(pairs) or 1
    q_mean = sum(p * a for p, (a, _) in zip(pairs, lengths)) / total  # pair-weighted: where the work is
    k_mean = sum(p * b for p, (_, b) in zip(pairs, lengths)) / total
    return flops, (q_mean, k_mean, d_qk, causal, len(lengths) * heads)


def _lengths(spec: Attention, args, q, k) -> list[tuple[int, int]]:
    if q.dim() == 4:
        return [(q.shape[1], k.shape[1])] * q.shape[0]
    at = spec.offsets_at
    if at is not None and len(args) > at + 1 and args[at] is not None:
        try:  # the offsets are known values in a projection when they derive from the batch's positions
            cq, ck = _values(args[at]), _values(args[at + 1])
            return [(cq[i + 1] - cq[i], ck[i + 1] - ck[i]) for i in range(len(cq) - 1)]
        except Exception:  # noqa: BLE001 - unknown offsets: one sequence of all the tokens (an upper bound)
            pass
    return [(q.shape[0], k.shape[0])]


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


def mutated(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors an op writes in place, by its schema (`Tensor(a!)`): `self` of an in-place op, an `out=` tensor,
    and the lists of an in-place foreach op, which returns nothing (AdamW's `_foreach_lerp_` writes its averages,
    `_foreach_addcdiv_` the parameters; FSDP2's `split_with_sizes_copy` its `out=` list). The fused Adam(W) kernel's
    schema marks its gradients written, but it writes them only to unscale them, when given a `grad_scale`
    (ATen/native/cuda/fused_adam_utils.cuh, FusedAdamMathFunctor: it "writes out gradients only when
    `grad_scale_ptr != nullptr`")."""
    schema = getattr(func, "_schema", None)
    out = []
    unscaled = schema is not None and schema.name in FUSED_ADAM and (kwargs or {}).get("grad_scale") is None
    for i, a in enumerate(schema.arguments if schema is not None else ()):
        if unscaled and a.name == "grads":
            continue
        if a.alias_info is not None and a.alias_info.is_write:
            out += _flat(kwargs[a.name] if kwargs and a.name in kwargs else args[i] if i < len(args) else None)
    return out


def strided(inputs: list[torch.Tensor], written: list[torch.Tensor]) -> bool:
    """Whether an element-wise kernel runs unvectorized. torch's CUDA loop vectorizes its loads only when the
    iterator is contiguous (ATen/native/cuda/CUDALoops.cuh, gpu_kernel_impl: launch_vectorized_kernel, else
    launch_legacy_kernel with offset calculators), after TensorIterator has ordered the dims by the operands' memory
    layout, so a transposed tensor whose result is laid out alike runs vectorized. It does not where an operand is a
    view with gaps (a chunk or slice along an inner dim: not non-overlapping and dense) or is laid out in another
    order than the result (a transpose copied contiguous). A broadcast operand (a zero stride, or a smaller shape: a
    norm's weight, a row's statistic) is left out: the published add + RMSNorm timings, whose multiplies broadcast,
    run at the contiguous figure (elementwise.py)."""
    def order(t):  # the dims from outermost to innermost in memory, size-1 dims left out
        return tuple(sorted((d for d in range(t.dim()) if t.shape[d] > 1), key=lambda d: -t.stride(d)))

    def dense(t):  # its elements fill one block of memory, in some order of its dims
        step = 1
        for d in reversed(order(t)):
            if t.stride(d) != step:
                return False
            step *= t.shape[d]
        return True

    full = [t for t in inputs + written if t.dim() > 0 and t.numel() > 1 and 0 not in t.stride()]
    if not all(dense(t) for t in full):
        return True
    out = written[0] if written else None
    return out is not None and any(t.shape == out.shape and order(t) != order(out) for t in full)
