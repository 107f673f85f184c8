"""The ring styles in a compiled layer: a CP attention style that dynamo cannot trace, as one `torch.library` op.

The ring styles (cp_ring, cp_ring_zigzag, cp_usp) post P2P transfers, choose their kernels and read the batch's
documents on the host: Python that would break the graph many times per layer. Inside a compiled layer their whole
call is one opaque op, `cpbench::cp_attention`, with a fake (meta) implementation for the trace and an autograd
registration, so the rest of the layer (projections, norms, rotary, MLP) compiles into one graph with no break.
The op's real implementation runs the style eagerly, exactly as without compile (its own autograd, its own O(S/cp)
backward): it keeps the style's autograd graph under a handle that the op returns as a tensor, and the backward op
runs that graph's backward.

What the style needs that is not a tensor comes from outside the graph at run time: the attention module (by a
site number bound once, `bind_site`, with the function that runs its style), its binding (style, group) and the forward's layout (the model-level forward,
which stays eager, works it out once per step). The per-call scalars (scaling, dropout, sliding window, softcap)
are op arguments: constants of the graph, the same every step, so no recompile.
"""

from __future__ import annotations

import itertools
import weakref

import torch

_SITES: dict[int, tuple] = {}  # site -> (attention module (weakly), the function that runs its style)
_GRAPHS: dict[int, tuple] = {}  # handle -> (output, inputs) of a forward whose backward has not run
_PENDING: dict[int, int] = {}  # site -> the handle of its latest forward (a forward never backed up is dropped)
_HANDLES = itertools.count(1)
TENSORS = ("position_ids",)  # the tensor kwargs the op carries (besides the mask); scalars: its own arguments


def bind_site(module: torch.nn.Module, run) -> int:
    """The module's site number (idempotent): what a compiled layer's op names it by. `run(module, q, k, v, mask,
    **kwargs)` runs its style eagerly (hf_compat.run_style)."""
    site = module.__dict__.get("_cpbench_site")
    if site is None:
        site = len(_SITES) + 1
        module._cpbench_site = site
    _SITES[site] = (weakref.ref(module), run)
    return site


@torch.library.custom_op("cpbench::cp_attention", mutates_args=())
def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                 position_ids: torch.Tensor | None, site: int, scaling: float | None, dropout: float,
                 sliding_window: int | None, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    ref, run_style = _SITES[site]
    module = ref()
    kwargs = {"scaling": scaling, "dropout": dropout, "sliding_window": sliding_window, "softcap": softcap,
              "position_ids": position_ids}
    inputs = [x.detach().requires_grad_(True) for x in (q, k, v)]  # the op cannot see if grad is wanted
    with _autograd_on(), torch.enable_grad():
        out, _ = run_style(module, *inputs, mask, **{k: v for k, v in kwargs.items() if v is not None})
    handle = next(_HANDLES)
    _GRAPHS.pop(_PENDING.get(site, 0), None)  # one pending graph per site: an inference forward leaks nothing
    _GRAPHS[handle], _PENDING[site] = (out, inputs), handle
    return out.detach().clone(), torch.tensor(handle)


def _autograd_on():
    """Autograd inside an op's implementation, where the dispatcher has turned it off (below the Autograd keys)."""
    keys = torch._C.DispatchKey
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in (keys.AutogradOther, keys.AutogradNestedTensor, keys.AutogradFunctionality):
        exclude = exclude.remove(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


@cp_attention.register_fake
def _(q, k, v, mask, position_ids, site, scaling, dropout, sliding_window, softcap):
    b, h, s, _ = q.shape
    return q.new_empty(b, s, h, v.shape[-1]), torch.empty((), dtype=torch.long)


@torch.library.custom_op("cpbench::cp_attention_backward", mutates_args=())
def cp_attention_backward(dout: torch.Tensor, handle: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                          v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    graph = _GRAPHS.pop(int(handle), None)
    if graph is None:
        raise RuntimeError("cpbench::cp_attention: the backward of a compiled ring-style layer ran after another forward "
                           "of the same layer (two forwards, then their backwards) or twice; run each forward's "
                           "backward before the layer's next forward.")
    out, inputs = graph
    with _autograd_on():
        grads = torch.autograd.grad(out, inputs, dout, allow_unused=True)
    # each laid out as its input (as the fake's: the compiled graph holds them to those strides)
    return tuple(torch.zeros_like(x) if g is None else torch.empty_like(x).copy_(g)
                 for g, x in zip(grads, (q, k, v), strict=True))


@cp_attention_backward.register_fake
def _(dout, handle, q, k, v):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output):
    q, k, v = inputs[:3]
    ctx.save_for_backward(output[1], q, k, v)


def _backward(ctx, dout, _dhandle):
    handle, q, k, v = ctx.saved_tensors
    dq, dk, dv = cp_attention_backward(dout.contiguous(), handle, q, k, v)
    return dq, dk, dv, None, None, None, None, None, None, None


cp_attention.register_autograd(_backward, setup_context=_setup)


def opaque_attention(module, query, key, value, attention_mask, **kwargs):
    """The style's call as the custom op (inside a compiled layer): [B, S, H, Dv] out, as the style returns it."""
    unknown = sorted(k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and k not in TENSORS)
    if unknown:  # e.g. attention sinks (`s_aux`); other non-tensor kwargs (use_cache, ...) the ring styles ignore
        raise NotImplementedError(
            f"{type(module).__name__}: a compiled layer runs its ring-style attention as one custom op, which does not "
            f"carry the tensors {unknown}; compile this model with cp_ulysses, or leave its layers eager.")
    mask = attention_mask if isinstance(attention_mask, torch.Tensor) else None
    out, _ = cp_attention(query, key, value, mask, kwargs.get("position_ids"), module._cpbench_site,
                          scaling=kwargs.get("scaling"), dropout=kwargs.get("dropout") or 0.0,
                          sliding_window=kwargs.get("sliding_window"), softcap=kwargs.get("softcap"))
    return out, None
