"""What every emulation shares: the error types, binding a call to an op's schema, reading memory the way a kernel
does (through the strides it assumes, not the tensor's own), and the attention math in fp32.

Device: nothing checks `is_cuda` (the kernels' CHECK_DEVICE / CHECK_NOSPARSE_*_CUDA device halves), so the
emulations run on CPU tensors; every other host check raises `KernelError` with the kernel's message. Pointer
alignment is judged from the storage offset (CUDA allocations start 256-byte aligned, so a pointer's alignment is
its offset's). Memory the kernel leaves unwritten (torch::empty) comes back NaN, so a reader of it fails.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INF = float("inf")


class KernelError(RuntimeError):
    """A TORCH_CHECK of the kernel's host code failed (c10::Error reaches Python as a RuntimeError)."""


class Undefined(KernelError):
    """No host check stops the call, but the kernel would read or write outside the tensor's memory (on a GPU:
    another tensor's bytes or a fault) or reinterpret bytes of another dtype. The emulation refuses instead of
    inventing values."""


class NotEmulated(AssertionError):
    """A feature the emulation does not model (dropout, ALiBi, paged KV, ...): cpbench never uses it."""


def check(cond: bool, message: str) -> None:
    """TORCH_CHECK(cond, message)."""
    if not cond:
        raise KernelError(message)


def expect(cond: bool, expr: str) -> None:
    """TORCH_CHECK(cond) without a message: c10 reports the condition's text."""
    check(cond, f"Expected {expr} to be true, but got false.")


def emulated(cond: bool, what: str) -> None:
    if not cond:
        raise NotEmulated(what)


@dataclass(frozen=True)
class Contract:
    """One row of a module's CONTRACT: a requirement or assumption of a kernel, read in its source.

    kind: "check" - the host code checks it; the emulation raises `message` (KernelError) when it fails.
          "layout" - no check: the device code reads or writes through strides or sizes it assumes; the emulation
                     does the same (as_strided on the storage) and raises Undefined past the storage's end.
          "semantics" - what the kernel computes where the obvious reading differs (masks, empty rows, padding).
    test: for layout/semantics rows, the test in tests/unit/test_kernel_emulations.py that pins the behaviour.
    """

    id: str
    ops: tuple[str, ...]
    source: str
    requires: str
    enforced: str
    kind: str = "check"
    message: str = ""
    test: str = ""


def contract_rows(prefix: str):
    """The row maker of one module's CONTRACT: ids prefixed with the module's kernel ("aten.flash.", ...)."""

    def row(id_, ops, source, requires, message="", kind="check", test="", enforced=""):
        enforced = enforced or ("KernelError with the kernel's message" if kind == "check" else "see test")
        return Contract(prefix + id_, ops, source, requires, enforced, kind, message, test)

    return row


# -- binding a call to an aten schema ---------------------------------------------------------------------------


def bind(op, args: tuple, kwargs: dict) -> dict:
    """The call's arguments by name, as the real op's schema binds them: too many positional arguments, an unknown,
    repeated or missing one, or a value of the wrong type is an error, with the dispatcher's coercions (int for
    float, bool for int, None for a `Tensor`, which becomes an undefined tensor)."""
    schema = op._schema
    params = schema.arguments
    positional = [p for p in params if not p.kwarg_only]
    check(len(args) <= len(positional),
          f"{schema.name}() takes {len(positional)} positional argument(s) but {len(args)} was/were given.")
    given = dict(zip((p.name for p in positional), args))
    names = {p.name for p in params}
    for key, value in kwargs.items():
        check(key in names, f"Unknown keyword argument '{key}' for operator '{schema.name}'.")
        check(key not in given, f"{schema.name}() got multiple values for argument '{key}'")
        given[key] = value
    bound = {}
    for p in params:
        if p.name in given:
            bound[p.name] = _convert(schema.name, p, given[p.name])
        else:
            check(p.has_default_value(), f"{schema.name}() is missing value for argument '{p.name}'.")
            bound[p.name] = p.default_value
    return bound


def _convert(op: str, p, value):
    kind = str(p.type)
    base = kind[len("Optional["):-1] if kind.startswith("Optional[") else kind
    wrong = f"{op}() Expected a value of type '{kind}' for argument '{p.name}' but instead found type " \
            f"'{type(value).__name__}'."
    if value is None:
        check(kind != base or base == "Tensor", wrong)
        return None
    if base == "Tensor":
        check(isinstance(value, torch.Tensor), wrong)
        return value
    if base == "float":
        check(isinstance(value, (int, float)), wrong)
        return float(value)
    if base == "bool":
        check(isinstance(value, (bool, int)), wrong)
        return bool(value)
    if base in ("int", "SymInt"):
        check(isinstance(value, int), wrong)
        return int(value)
    if base == "List[bool]":
        check(isinstance(value, (list, tuple)) and all(isinstance(x, (bool, int)) for x in value), wrong)
        # std::array<bool, N> unboxing (c10/core/ivalue_inl.h generic_to) refuses a list of another length
        check(p.N is None or len(value) == p.N,
              f"Tried to convert a List with {len(value)} elements to a fixed-size array of size {p.N}")
        return [bool(x) for x in value]
    raise NotEmulated(f"{op}: argument type {kind}")


# -- memory as the kernel reads it ----------------------------------------------------------------------------


def storage_read(t: torch.Tensor, size, stride, what: str) -> torch.Tensor:
    """`t`'s memory read from its data pointer with the given sizes and strides (in elements), whatever its own
    strides are: how a kernel that assumes a layout sees a tensor."""
    n = t.untyped_storage().nbytes() // t.element_size()
    last = t.storage_offset() + sum((s - 1) * st for s, st in zip(size, stride))
    if all(size) and last >= n:
        raise Undefined(f"{what}: the kernel reads element {last} of a storage of {n} elements")
    return torch.as_strided(t, tuple(size), tuple(stride), t.storage_offset())


def aligned(t: torch.Tensor, elements: int) -> bool:
    """CHECK_ALIGNED_PTR: the data pointer is a multiple of `elements` elements."""
    return t.storage_offset() % elements == 0


def unwritten(shape, dtype) -> torch.Tensor:
    """torch::empty that the kernel never writes: NaN, so whoever reads it notices."""
    return torch.full(shape, float("nan"), dtype=dtype)


# -- the math, in fp32 (heads first: [..., H, M, D] queries, [..., Hk, N, D] keys/values) --------------------------


def repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """kv head j serves query heads j*g .. j*g+g-1 (flash's h / h_h_k_ratio)."""
    return x.float().repeat_interleave(heads // x.shape[-3], -3)


def scores(q, k, scale: float, softcap: float = 0.0, bias=None):
    """fp32 scores; flash's softcap (softcap * tanh(s / softcap) of the scaled score), the efficient kernel's bias
    (added to the scaled score). Also returns the uncapped scores (the softcap backward needs them)."""
    raw = q.float() @ repeat_kv(k, q.shape[-3]).transpose(-1, -2) * scale
    s = softcap * torch.tanh(raw / softcap) if softcap > 0 else raw
    if bias is not None:
        s = s + bias.float()
    return s, raw


def softmax(s, visible):
    """P and LSE of the visible scores; a row with no visible key: P 0, LSE -inf (each kernel then writes its own
    convention for such rows)."""
    s = s.masked_fill(~visible, -INF)
    lse = torch.logsumexp(s, -1)
    return torch.exp(s - lse.masked_fill(torch.isneginf(lse), 0)[..., None]), lse


def attention_grads(dout, q, k, v, p, delta, scale: float, dtanh=None):
    """fp32 dq [.., H, M, D] and per-query-head dk, dv [.., H, N, D], with dS = P * (dO V^T - delta) as both
    kernels compute it (delta = rowsum(dO * O), computed or given)."""
    heads = q.shape[-3]
    do = dout.float()
    dv = p.transpose(-1, -2) @ do
    ds = p * (do @ repeat_kv(v, heads).transpose(-1, -2) - delta[..., None])
    if dtanh is not None:
        ds = ds * dtanh
    dq = ds @ repeat_kv(k, heads) * scale
    dk = ds.transpose(-1, -2) @ q.float() * scale
    return dq, dk, dv, ds


def kv_grads(per_head: torch.Tensor, kv_heads: int, dtype) -> torch.Tensor:
    """Per-query-head grads [.., H, N, D] at the kv head count: each head's grad rounded to `dtype` (what flash writes
    into dk_expanded), then summed over the group and rounded again (at::sum_out)."""
    heads = per_head.shape[-3]
    x = per_head.to(dtype)
    if heads == kv_heads:
        return x
    return x.float().unflatten(-3, (kv_heads, heads // kv_heads)).sum(-3).to(dtype)
