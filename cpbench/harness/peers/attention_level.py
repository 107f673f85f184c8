"""`level = "attention"`: one causal attention op, forward + backward, per implementation (registry.py).

Every rank builds the same full q, k, v and output gradient [B, S, H, D] from the point's seed (heads, kv heads
and head dim are the point's model's), keeps its shard in the implementation's layout, and runs `fn(q, k, v)`
then backward. Measured as a model point is: warmup steps tracked for memory (the smallest peak of identical
steps counts), measured steps timed with the ranks started together. At cp 1 the op is torch's sdpa on the whole
sequence: the unsharded time the peers table divides by.

Parity: the shards of the output and of dq, dk, dv are gathered in sequence order and held to the unsharded op
(torch's sdpa on the same full inputs, computed after the measurements) with the model points' tolerances:
`loss` is <out, dout> (the scalar whose gradient the step propagates), `logits` the output, `grads` dq, dk, dv.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

from cpbench.cp.layout import SequenceLayout
from cpbench.harness.measure import parity
from cpbench.harness.measure.probes import StepTimer, memory_probe, rss_peak_bytes
from cpbench.harness.peers import adapters
from cpbench.harness.peers.registry import AttentionContext, get_peer, unsharded
from cpbench.harness.suite.presets import get_preset
from cpbench.harness.suite.spec import NO_STYLE, Point


def attention_shape(point: Point) -> tuple[int, int, int]:
    """(query heads, kv heads, head dim) of the point's model."""
    config = get_preset(point.preset).config(point.model_overrides)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, kv_heads, head_dim


def attention_flops(point: Point) -> float:
    """Forward + backward of causal attention: 4·B·H·S²·D forward (two matmuls), halved by causality; the
    backward's five matmuls make it 2.5 times the forward."""
    heads, _, head_dim = attention_shape(point)
    forward = 4 * point.batch_size * heads * point.seq_len**2 * head_dim / 2
    return 3.5 * forward


def full_inputs(point: Point, device) -> list[torch.Tensor]:
    heads, kv_heads, head_dim = attention_shape(point)
    g = torch.Generator().manual_seed(point.seed)
    dtype = parity.DTYPES[point.dtype]
    b, s = point.batch_size, point.seq_len
    shapes = ((b, s, heads, head_dim), (b, s, kv_heads, head_dim), (b, s, kv_heads, head_dim), (b, s, heads, head_dim))
    return [torch.randn(shape, generator=g).to(device=device, dtype=dtype) for shape in shapes]


def run_attention_point(point: Point, *, rank: int, device, budget: int | None) -> tuple[dict, dict | None]:
    """This rank's record and, on rank 0, the parity verdict. Every rank of the point calls it."""
    t_start = time.perf_counter()
    heads, kv_heads, head_dim = attention_shape(point)
    full = full_inputs(point, device)
    if point.cp_style == NO_STYLE:
        layout, fn = None, unsharded
    else:
        peer = get_peer(point.implementation)
        layout = SequenceLayout(point.seq_len, point.cp_size, rank, peer.styles[point.cp_style])
        ctx = AttentionContext(dist.group.WORLD, rank, point.cp_size, point.seq_len, heads, kv_heads, head_dim,
                               point.cp_style, device)
        fn = getattr(adapters, peer.adapter)(ctx)
    q, k, v, dout = (x if layout is None else layout.cut(x, dim=1).contiguous() for x in full)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    outputs = {}

    context = getattr(fn, "step_context", contextlib.nullcontext)  # a peer whose backward needs its context

    def step():
        for x in (q, k, v):
            x.grad = None
        with context():
            out = fn(q, k, v)
            out.backward(dout)
        outputs["out"] = out.detach()

    memory = memory_probe(point.device, (q, k, v, dout), None, budget)  # the inputs count as held state
    for _ in range(max(1, point.warmup_steps)):
        with memory.segment("step"):
            step()
    timer = StepTimer(point.device)
    for _ in range(point.measured_steps):
        if point.world_size > 1:
            dist.barrier()
        with timer.step():
            step()
    record = {"rank": rank, "status": "ok", **memory.result(), "rss_peak_bytes": rss_peak_bytes(),
              "step_times_s": timer.times_s, "num_params": 0, "model_type": "attention", "parity_mode": "full",
              "layout": None if layout is None else layout.kind, "run_s": time.perf_counter() - t_start}
    mine = [outputs["out"], q.grad, k.grad, v.grad]
    verdict = _parity(point, full, mine, layout, rank)
    return record, verdict


_REFERENCES: dict[tuple, dict] = {}  # the last few unsharded results of this process: the points of one length
REFERENCES_KEPT = 2  # a launch runs its points style by style, each over the suite's lengths


def _reference(point: Point, full) -> dict:
    """The unsharded op's output and gradients on the point's inputs, computed once per inputs in a launch (the
    implementations and styles of one length share them)."""
    key = (point.preset, tuple(sorted(point.model_overrides.items())), point.seq_len, point.batch_size, point.dtype,
           point.seed, point.device)
    if key not in _REFERENCES:
        q, k, v, dout = (x.detach().clone().requires_grad_(i < 3) for i, x in enumerate(full))
        ref = unsharded(q, k, v)
        ref.backward(dout)
        while len(_REFERENCES) >= REFERENCES_KEPT:
            _REFERENCES.pop(next(iter(_REFERENCES)))
        _REFERENCES[key] = {"loss": float((ref.detach().double() * dout.double()).sum()), "logits": ref.detach().float(),
                            "grads": {"dq": q.grad.float(), "dk": k.grad.float(), "dv": v.grad.float()}}
    return _REFERENCES[key]


def _gathered(x: torch.Tensor, layout: SequenceLayout | None) -> torch.Tensor:
    if layout is None:
        return x
    pieces = [torch.empty_like(x) for _ in range(layout.cp_size)]
    dist.all_gather(pieces, x.contiguous())
    return layout.restore(pieces, dim=1)


def _parity(point: Point, full, mine, layout, rank: int) -> dict | None:
    """Rank 0's verdict: the gathered output and gradients against the unsharded op on the same inputs."""
    out, dq, dk, dv = (_gathered(x, layout) for x in mine)
    if rank != 0:
        return None
    dout = full[3]
    ours = {"loss": float((out.double() * dout.double()).sum()), "logits": out.float(),
            "grads": {"dq": dq.float(), "dk": dk.float(), "dv": dv.float()}}
    want = _reference(point, full)
    verdict = parity.compare(ours, want, point.dtype, point.world_size)
    return {**verdict, "parity_reference": "unsharded"}
