"""`cp_ring` and `cp_ring_zigzag`: ring attention with exact per-block masks and O(S/cp) activation memory.

Each rank keeps its queries. Forward: the packed K/V block travels around the ring (cp - 1 steps, the next
transfer posted before the current block is computed, so they overlap); at step i a rank holds the K/V of rank
(rank - i) mod cp, computes every tile (query chunk x key chunk) whose mask is not empty, and merges each tile's
output into its rows by log-sum-exp in fp32. Only q, k, v, the output and the LSE are kept for backward.
Backward: K/V travel the same way again, and each block's dK/dV accumulator (fp32) travels with it: a rank adds
its share and passes it on, and after cp hops the accumulator is back with the block's owner. No rank ever holds
more than two K/V blocks and two dK/dV blocks of other ranks. The next K/V transfer overlaps the compute; the
dK/dV hop does not (a rank needs the accumulator before adding to it), which costs one dK/dV transfer of latency
per step and saves two K/V-sized buffers.

P2P transfers per rank (one tensor sent, and one received, per transfer; K and V travel as they are, no packed
copy): forward 2 (cp - 1); backward 2 (cp - 1) for K/V + 2 cp for dK/dV.

Attention sinks (`s_aux`, one logit per head: gpt_oss and others) join the merged result once, after the last
block, and their gradient is one row reduction: see cp/ring/sinks.py. The value head dim may differ from the
query's (multi-head latent attention): the output and dV take v's.

Zigzag is the same algorithm on the zigzag layout: rank r holds chunks r and 2cp-1-r, and the tile skipping
(causal: a key chunk after a query chunk is never computed) gives every rank the same work at every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpbench.cp.hf_compat import model_attention_implementation, model_config
from cpbench.cp.layout import SequenceLayout
from cpbench.cp.recompute import recomputed
from cpbench.cp.ring.comm import DKV_TAG, KV_TAG, P2PCounter, RingComm
from cpbench.cp.ring.kernels import RING_IMPLEMENTATIONS, acc_dtype, safe_lse
from cpbench.cp.ring.masks import CAUSAL, DENSE, FULL, SEGMENTS, SKIP, RingMasks, TileMask, build_ring_masks
from cpbench.cp.ring.select import select_kernel
from cpbench.cp.ring.sinks import add_sinks, check_sinks, sink_grad

__all__ = ["RING_IMPLEMENTATIONS", "P2PCounter", "ring_attention", "ring_attention_with_lse", "ring_p2p_count"]


@dataclass(frozen=True)
class RingPlan:
    comm: RingComm
    layout: SequenceLayout
    masks: RingMasks
    kernel: object
    scale: float
    varlen: bool = False  # the kernel takes SEGMENTS tiles (one varlen call per tile)

    def tiles(self, step: int):
        """(query rows, key rows, mask) of every non-empty tile at `step` (K/V of rank `rank - step`). A tile is a
        query slot against a key slot (a chunk, or a per-document placement's runs: cp/balance.py). For a kernel
        without varlen, a SEGMENTS tile comes as one plain sub-tile per document (its rows against its keys: full, or
        causal on the diagonal), so no tile-sized mask is built and masked-out pairs are not computed."""
        n = self.layout.chunk_len
        source = (self.layout.rank - step) % self.layout.cp_size
        for qi, qc in enumerate(self.layout.chunks_of(self.layout.rank)):
            for ki, kc in enumerate(self.layout.chunks_of(source)):
                tile = self._tile(qc, kc, n)
                if tile.kind == SKIP:
                    continue
                rows, cols = slice(qi * n, (qi + 1) * n), slice(ki * n, (ki + 1) * n)
                if tile.kind != SEGMENTS or self.varlen:
                    yield rows, cols, tile
                elif tile.segments.rows == 1 and tile.segments.window == (-1, -1):
                    plain = TileMask(CAUSAL if tile.segments.causal else FULL)
                    for _, qs, qe, ks, ke in tile.segments.runs:
                        yield slice(rows.start + qs, rows.start + qe), slice(cols.start + ks, cols.start + ke), plain
                else:  # per-row documents, or a window inside them: the tile's mask
                    yield rows, cols, self.masks.dense_slots(self.layout.slot_runs(qc), self.layout.slot_runs(kc))

    def _tile(self, qc: int, kc: int, n: int) -> TileMask:
        """The tile's mask; a placement's host-only ones (no tensor) are made once per forward for all layers alike."""
        placement, masks = self.layout.placement, self.masks
        if placement is None or masks.dense is not None or any(masks.blocked):
            return masks.slots(self.layout.slot_runs(qc), self.layout.slot_runs(kc), n, qc == kc)
        key = (qc, kc, masks.causal, masks.window, masks.varlen, masks.seq_len, id(masks.batch))
        tile = placement.tiles.get(key)
        if tile is None:
            tile = masks.slots(self.layout.slot_runs(qc), self.layout.slot_runs(kc), n, qc == kc)
            if tile.kind != DENSE:
                placement.tiles[key] = tile
        return tile


def ring_p2p_count(cp_size: int) -> dict[str, int]:
    """Transfers one rank sends (and receives) per call, by phase: what `P2PCounter` must count."""
    return {"forward": 2 * (cp_size - 1), "backward": 2 * (cp_size - 1) + 2 * cp_size}


def _merge(out_acc: torch.Tensor, lse_acc: torch.Tensor, out_blk: torch.Tensor, lse_blk: torch.Tensor) -> None:
    """In place: out_acc/lse_acc become the softmax-weighted union of both partial results."""
    lse = torch.logaddexp(lse_acc, lse_blk)
    safe = safe_lse(lse)  # rows that saw no key yet stay 0 with LSE -inf
    out_acc.mul_(torch.exp(lse_acc - safe)[..., None]).add_(out_blk * torch.exp(lse_blk - safe)[..., None])
    lse_acc.copy_(lse)


def _forward(q, k, v, sinks, plan: RingPlan):
    b, h, s, _ = q.shape
    acc = acc_dtype(q.dtype)
    # Laid out [B, S, H, Dv] in memory: the caller's `transpose(1, 2).contiguous()` is then free, so the output the
    # autograd function saves and the one the model's o_proj saves are one tensor, not two.
    out = torch.zeros(b, s, h, v.shape[-1], dtype=acc, device=q.device).transpose(1, 2)
    lse = torch.full((b, h, s), float("-inf"), dtype=acc, device=q.device)
    for step in range(plan.layout.cp_size):
        pending = None
        if step < plan.layout.cp_size - 1:
            pending = plan.comm.exchange(k, v, phase="forward", tag=KV_TAG)
        for rows, cols, tile in plan.tiles(step):
            o, l = plan.kernel.forward(q[:, :, rows], k[:, :, cols], v[:, :, cols], tile, plan.scale)
            _merge(out[:, :, rows], lse[:, :, rows], o, l)
        if pending is not None:
            k, v = pending.wait()
    if sinks is not None:
        lse = add_sinks(out, lse, sinks)  # in the accumulation dtype, before the output is rounded to q's
    return out.to(q.dtype), lse


def _backward(dout, q, k, v, out, lse, plan: RingPlan):
    acc, kv_dtype = acc_dtype(q.dtype), k.dtype
    cp = plan.layout.cp_size
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc, device=q.device)
    dkv_pending = None  # the dK/dV accumulators in flight to this rank (from step 1 on)
    for step in range(cp):
        kv_pending = plan.comm.exchange(k, v, phase="backward", tag=KV_TAG) if step < cp - 1 else None
        if step > 0:
            # The accumulators of the block now held, with the shares of the ranks it visited before. Adding into
            # them (rather than into fresh buffers while they travel) keeps two fewer K/V-sized buffers alive.
            dk, dv = dkv_pending.wait()
        for rows, cols, tile in plan.tiles(step):
            plan.kernel.backward(
                dout[:, :, rows], q[:, :, rows], k[:, :, cols], v[:, :, cols], out[:, :, rows], lse[:, :, rows],
                tile, plan.scale, dq[:, :, rows], dk[:, :, cols], dv[:, :, cols],
            )
        if kv_pending is None:
            del k, v  # the last block is done with: free it before the last hop allocates its buffers
        dkv_pending = plan.comm.exchange(dk, dv, phase="backward", tag=DKV_TAG)
        del dk, dv  # the pending send holds them until it completes
        if kv_pending is not None:
            k, v = kv_pending.wait()
    dk, dv = dkv_pending.wait()  # after cp hops, the accumulators of this rank's own block
    return dq.to(q.dtype), dk.to(kv_dtype), dv.to(kv_dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, plan: RingPlan):
        # K/V are sent as they are, so keep them contiguous once here (the model hands over transposed views)
        # rather than letting every hop copy them.
        k, v = k.contiguous(), v.contiguous()
        out, lse = _forward(q, k, v, sinks, plan)
        # With sinks, out and lse are the final (sink-corrected) ones: what the tile backward needs (sinks.py).
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.plan = plan
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        # Let go of the plan (it holds the model's whole mask) with the saved tensors: a graph node can outlive its
        # backward (a memory tracker's hooks keep them), and the mask would then stay alive step after step.
        plan, ctx.plan = ctx.plan, None
        if plan is None:
            raise RuntimeError(
                "cp_ring's backward ran twice on the same graph (backward(retain_graph=True), then backward again); "
                "ring attention frees its state after one backward: run the forward again for a second backward."
            )
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            # First, while no dQ/dK/dV accumulator exists yet: its temporaries do not add to the backward's peak.
            dsinks = sink_grad(dout, out, lse, sinks)
        dq, dk, dv = _backward(dout, q, k, v, out, lse, plan)
        return dq, dk, dv, dsinks, None


def ring_attention_with_lse(
    q_bhsd, k_bhsd, v_bhsd, masks: RingMasks, *, layout: SequenceLayout, group, kernel, scale: float,
    counter: P2PCounter | None = None, sinks: torch.Tensor | None = None,
):
    """Ring attention over the cp group: (output [B, H, S_local, Dv], LSE [B, H, S_local] in fp32/fp64).

    `sinks`: one attention-sink logit per query head [H], or None; with sinks the LSE includes the sink's term."""
    comm = RingComm(group, counter)
    assert comm.size == layout.cp_size and comm.rank == layout.rank, (comm.size, comm.rank, layout)
    assert q_bhsd.shape[2] == k_bhsd.shape[2] == layout.local_len, (q_bhsd.shape, k_bhsd.shape, layout)
    if q_bhsd.shape[1] % k_bhsd.shape[1]:
        raise ValueError(
            f"cp_ring: {q_bhsd.shape[1]} query heads are not a multiple of {k_bhsd.shape[1]} key/value heads; "
            "GQA needs num_attention_heads to be a multiple of num_key_value_heads (fix the model config)."
        )
    sinks = check_sinks(sinks, q_bhsd.shape[1])
    varlen = bool(getattr(kernel, "takes_segments", lambda q, v=None: False)(q_bhsd, v_bhsd))
    with recomputed():  # op recompute keeps no tile (cp/recompute.py): 2·cp tiles would hold the whole sequence's
        plan = RingPlan(comm, layout, masks, kernel, scale, varlen)
        return _RingAttention.apply(q_bhsd, k_bhsd, v_bhsd, sinks, plan)


def ring_attention(
    module, query, key, value, attention_mask, *, inner, group, layout, p2p_counter=None, kernel_device=None, **kwargs
):
    """The attention function of the `cp_ring` / `cp_ring_zigzag` styles (see styles.py for the contract)."""
    del inner  # the ring runs its own block kernel, chosen from the model's attn_implementation
    dropout = kwargs.get("dropout") or 0.0
    if dropout > 0:
        raise ValueError(
            f"cp_ring does not implement attention dropout (got dropout={dropout}); set the config's "
            "attention_dropout=0.0, call model.eval(), or use cp_ulysses."
        )
    implementation = model_attention_implementation(module)
    kernel = select_kernel(implementation, query, kwargs.get("softcap"), kernel_device, value=value)
    sinks = kwargs.get("s_aux")
    batch = layout.facts.get() if layout.facts is not None else None
    if "sliding_window" not in kwargs and getattr(model_config(module), "sliding_window", None) and \
            isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
        # The family windows its mask but does not tell its attention (phimoe): the batch's facts cannot say where
        # the window is, the model's own mask can, so its tiles are read from it.
        batch = None
    masks = build_ring_masks(
        attention_mask, seq_len=layout.seq_len, padded_len=layout.padded_len, device=query.device,
        is_causal=getattr(module, "is_causal", True), position_ids=kwargs.get("position_ids"),
        # Eager's uniform rows (a row that sees no key averages all of them) need no sink: with a sink, the
        # dtype's minimum on every key leaves the sink alone in the softmax, so such a row is 0 in eager, as here.
        sliding_window=kwargs.get("sliding_window"), eager=implementation == "eager" and sinks is None,
        batch=batch, varlen=True,  # masked tiles as documents: one varlen call, or a plain sub-tile each (RingPlan)
    )
    scale = kwargs.get("scaling")
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    out, _ = ring_attention_with_lse(
        query, key, value, masks, layout=layout, group=group, kernel=kernel, scale=scale, counter=p2p_counter,
        sinks=sinks,
    )
    return out.transpose(1, 2).contiguous(), None  # no copy: see _forward
