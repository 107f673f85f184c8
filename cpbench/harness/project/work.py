"""What one kernel call of a projected step moves: the bytes it reads and writes, read the way the CUDA kernel reads
them, what it writes in place, and whether it runs vectorized. Pure functions of an op's name and arguments, called by
the op trace (trace.py); nothing here knows a GPU. What a call computes is flops.py's.

Bytes are what an op reads plus what it writes, each tensor once: an expanded input (a stride-0 dimension) is read
at its stored size, what an op only overwrites (`copy_`, `fill_`, an `out=` tensor) and a factory's template
(`new_zeros`, `zeros_like`) are not read; gathers, scatters and the NLL loss touch the rows they pick or put, a
softmax over wide rows reads them as often as its kernel does.
"""

from __future__ import annotations

import math

import torch

# Ops that overwrite their first argument without reading it
WRITE_ONLY = {"aten.copy_", "aten.fill_", "aten.zero_", "aten._foreach_copy_", "aten._foreach_zero_", "aten.normal_",
              "aten.uniform_", "aten.random_", "aten.bernoulli_", "aten.exponential_", "aten.set_"}

# Factories that take a tensor for its dtype, device or shape only (`new_zeros` is at::zeros(size, self.options()),
# `zeros_like` empty_like(self).zero_()): they write their output and read nothing
TEMPLATE = {"aten.new_zeros", "aten.new_ones", "aten.new_full", "aten.zeros_like", "aten.ones_like", "aten.full_like",
            "aten.rand_like", "aten.randn_like", "aten.randint_like"}

# Gathers: their first argument is read only where they pick (an embedding of a 151,936-row table for 8k tokens
# reads 8k rows, not the table): it counts at the output's size. `aten.index` is advanced indexing (`x[ids]`).
GATHER = {"aten.embedding", "aten.index_select", "aten.gather", "aten.index"}
# The NLL loss's CUDA kernels (ATen/native/cuda/Loss.cu) touch one element of each row of the log-probabilities, the
# target's: the forward reads it (nll_loss_forward_reduce_cuda_kernel_2d), the backward zeroes its whole gradient
# (nll_loss_backward_out_cuda: grad_input.zero_()) and writes it there; neither reads the rest of `self`.
NLL = {"aten.nll_loss_forward", "aten.nll_loss_backward"}
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
# reads the gradient for the row's sum and again for the result. A vocabulary's logits are such rows; so is every
# softmax over an inner dim (cunn_SpatialSoftMaxForward / Backward: the same passes, strided).
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
    product = 2 * tensor_bytes(x) + tensor_bytes(args[1]) if name == "aten._softmax_backward_data" else 0
    passes = tensor_bytes(x) * (1 if backward else 2)
    if math.prod(x.shape[dim + 1:]) != 1:
        return product + passes  # cunn_SpatialSoftMax*: rows strided across the inner dims, no on-chip copy
    size = x.shape[dim] if x.dim() else 1
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
    reduction = threads // 32 * (8 if x.dtype == torch.float64 else 4)  # a partial per warp, in accscalar_t
    if size < (_SMEM_PER_BLOCK - reduction) // x.element_size() and size % ilp == 0:
        return product  # cunn_SoftMax*Smem: the row read once into shared memory
    return product + passes


def tensor_bytes(t: torch.Tensor) -> int:
    """The bytes a kernel touches reading or writing `t`: a stride-0 (expanded) dimension is one element wide."""
    return math.prod(s for s, st in zip(t.shape, t.stride()) if st != 0) * t.element_size() if t.numel() else 0


def moved_bytes(name: str, args, kwargs, inputs: list, outputs: list, backward: bool = False) -> int:
    """Bytes read plus bytes written; each distinct tensor counts once per direction. `outputs`: what the op writes,
    its results and what it writes in place (`mutated`: an in-place foreach op returns nothing). `backward`:
    the op is one of autograd's backward formulas (IN_PLACE_OF), not a recomputed forward replayed in backward."""
    skip = {id(t) for t in _flat((kwargs or {}).get("out"))}
    if name in WRITE_ONLY and args:
        skip |= {id(t) for t in _flat(args[0])}
    picked = 0
    if name in GATHER and args and isinstance(args[0], torch.Tensor) and outputs:
        source = args[0]
        skip.add(id(source))
        picked = min(tensor_bytes(source), outputs[0].numel() * source.element_size())
    if name in NLL and len(args) > 2 and isinstance(args[1], torch.Tensor):
        log_probs = args[0] if name == "aten.nll_loss_forward" else args[1]
        skip.add(id(log_probs))
        picked = (log_probs.shape[0] if log_probs.dim() == 2 else 1) * log_probs.element_size()
    if name in TEMPLATE:
        inputs = []
    if name == "fsdp.all_gather_copy_in" and args:  # FSDP2's all_gather_copy_in_cuda: one _foreach_copy_ of its
        return 2 * sum(map(tensor_bytes, _flat(args[0])))  # inputs into this rank's slice of the buffer it is handed
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
    norm's weight, a row's statistic) is left out, priced at the contiguous figure as every fit prices it, though the
    same loop runs it unvectorized: the H100's published add + RMSNorm and complex RoPE, whose multiplies broadcast,
    run 5-20 % under that figure (docs/time.md), and module totals cannot set a figure of their own (elementwise/)."""
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


def schema_arg(func, args, kwargs, name: str):
    """An op's argument by its schema name (positional or keyword), or None."""
    if kwargs and name in kwargs:
        return kwargs[name]
    schema = getattr(func, "_schema", None)
    for i, a in enumerate(schema.arguments if schema is not None else ()):
        if a.name == name:
            return args[i] if i < len(args) else None
    return None
