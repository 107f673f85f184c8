"""Differentiable collectives over a cp group, on torch.distributed's public API.

Equal-split all-to-all is its own transpose, so its backward is the same exchange applied to the gradient.
The all-reduce's backward sums the ranks' output gradients (each rank's input reaches every rank's output).

Under torch.compile the all-to-all is torch's functional collective with autograd
(`_functional_collectives.all_to_all_single_autograd`), which dynamo traces into the graph (forward and backward)
where the autograd.Function above, calling the in-place c10d op, would break it. Eager keeps the c10d op.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group):
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()  # empty_like keeps a permuted grad's strides; the collective needs dense memory
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group):
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.clone()
        dist.all_reduce(out, group=ctx.group)
        return out, None


def all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Chunk i of dim 0 goes to rank i; chunk i of the result came from rank i."""
    if torch.compiler.is_compiling():
        return funcol.all_to_all_single_autograd(x.contiguous(), None, None, group)
    return _AllToAll.apply(x, group)


def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    return _AllReduceSum.apply(x, group)
