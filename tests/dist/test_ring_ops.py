"""Op-level parity of cp_ring / cp_ring_zigzag with full attention, and their point-to-point transfer count.

One spawn of 4 ranks runs every case (mask kind x mask source x GQA ratio x layout x dtype) at cp=2 (two
groups of two ranks, the second one at global ranks 2 and 3) and at cp=4, and returns the worst errors per
case; the parametrized tests below assert them. A spawn costs seconds (importing transformers), a case ~10 ms.
"""

from __future__ import annotations

import itertools

import pytest
import torch

B, H, D = 2, 4, 8
SEQ = 24  # divisible by 2 * cp for cp in {2, 4}; the "odd" kind uses 21
KINDS = ("causal", "packed", "left_pad", "right_pad", "sliding", "sliding_packed", "odd")
KV_HEADS = (4, 2, 1)  # GQA ratio 1, 2, 4 (1 kv head: fewer kv heads than ranks)
LAYOUTS = ("contiguous", "zigzag")  # cp_ring, cp_ring_zigzag
DTYPES = ("float32", "float64")
WINDOW = 5
WORLD_SIZES = (2, 4)

# Tolerances, relative to the largest reference magnitude. The ring computes the same softmax sums as the
# reference in another order (per tile, then merged by LSE) and the reference runs in fp64 on the same inputs,
# so the error is rounding only: each value is a reduction over <= SEQ keys of length-D products, and the
# gradients chain two or three such reductions, so ~(SEQ + D) * eps per reduction. We measure <= 15 * eps;
# 200 * eps leaves >10x headroom while a wrong mask (an error of O(1e-2) or more) is caught by orders.
TOL = {"float32": 200 * torch.finfo(torch.float32).eps, "float64": 200 * torch.finfo(torch.float64).eps}


def case_key(kind, source, kv_heads, layout, dtype) -> str:
    return f"{kind}-{source}-kv{kv_heads}-{layout}-{dtype}"


def all_cases():
    """Every kind x GQA ratio x layout x dtype with masks derived from positions; the model-built dense masks
    (sdpa's bool in fp64, eager's additive in fp32, as those models run) for every kind x layout."""
    cases = list(itertools.product(KINDS, ("positions",), KV_HEADS, LAYOUTS, DTYPES))
    cases += [(kind, "dense_bool", 2, lay, "float64") for kind in KINDS for lay in LAYOUTS]
    cases += [(kind, "dense_additive", 2, lay, "float32") for kind in KINDS for lay in LAYOUTS]
    return cases


def global_inputs(kind: str):
    """seq_len, position_ids [B, S] or None, 2-D padding mask or None, window or None."""
    seq = 21 if kind == "odd" else SEQ
    pos = None
    if kind in ("packed", "sliding_packed"):
        docs = [[7, 10, 7], [12, 12]]  # row 0: three documents, row 1: two
        pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in docs])
    pad = None
    if kind in ("left_pad", "right_pad"):
        pad = torch.ones(B, seq, dtype=torch.long)
        if kind == "left_pad":
            pad[0, :5] = 0
        else:
            pad[0, -4:] = 0
    window = WINDOW if kind.startswith("sliding") else None
    return seq, pos, pad, window


def allowed_mask(seq, pos, pad, window) -> torch.Tensor:
    """The whole bool mask [B, 1, S, S] (True = attend), built independently of ring_masks."""
    q = torch.arange(seq)[:, None]
    k = torch.arange(seq)[None, :]
    allowed = (k <= q).expand(B, 1, seq, seq).clone()
    if window is not None:
        allowed &= q - k < window
    if pos is not None:
        doc = torch.cumsum((pos == 0).long(), -1)
        allowed &= doc[:, None, :, None] == doc[:, None, None, :]
    if pad is not None:
        allowed &= pad.bool()[:, None, None, :]
    return allowed


def full_attention(q, k, v, allowed, scale, additive=None):
    """Reference attention (any dtype; GQA by repeating kv heads): output [B, H, S, D] and LSE [B, H, S].

    With `additive`, it is eager attention: the additive mask is added to the scores, so a row it blocks entirely
    becomes a uniform average (the mask's minimum absorbs the scores) whose gradient still flows.
    """
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) * scale
    s = s + additive if additive is not None else s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num()  # softmax subtracts the row max: exact for eager's constant rows too
    return p @ v, torch.logsumexp(s, -1)


def _reference(kind, kv_heads, dtype, eager: bool):
    seq, pos, pad, window = global_inputs(kind)
    g = torch.Generator().manual_seed(10 * KINDS.index(kind) + kv_heads)  # the same inputs on every rank
    q, dout = (torch.randn(B, H, seq, D, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(B, kv_heads, seq, D, generator=g, dtype=torch.float64) for _ in range(2))
    q, k, v, dout = (x.to(dtype) for x in (q, k, v, dout))
    allowed = allowed_mask(seq, pos, pad, window)
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    additive = _additive(allowed, dtype).double() if eager else None
    out, lse = full_attention(*leaves, allowed, D**-0.5, additive)
    lse = lse.masked_fill(~allowed.any(-1), float("-inf"))  # compare LSE only on rows that see a key
    out.backward(dout.double())
    ref = {"out": out.detach(), "lse": lse, "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}
    return (q, k, v, dout), ref, (seq, pos, pad, window, allowed)


def _ring_masks(source, seq, pos, pad, window, allowed, layout, dtype):
    from cpbench.cp.ring.masks import build_ring_masks

    common = dict(seq_len=seq, padded_len=layout.padded_len)
    if source == "positions":
        return build_ring_masks(pad, position_ids=pos, sliding_window=window, **common)
    if source == "dense_bool":  # what sdpa models pass
        return build_ring_masks(allowed, position_ids=pos, sliding_window=window, **common)
    return build_ring_masks(_additive(allowed, dtype), position_ids=pos, sliding_window=window, **common)


def _additive(allowed, dtype):
    """The eager form of a bool mask, as transformers builds it: 0 attends, the dtype's minimum blocks."""
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


def _errors(got, ref, layout, eager: bool) -> dict:
    errs = {}
    for name in ("out", "dq", "dk", "dv"):
        r = layout.cut(ref[name], dim=2)
        errs[name] = ((got[name].double() - r).abs().max() / r.abs().max()).item()
    r_lse = layout.cut(ref["lse"], dim=2, pad_value=float("-inf"))
    finite = torch.isfinite(r_lse)
    errs["lse"] = (got["lse"].double() - r_lse)[finite].abs().max().item()
    # Rows that see no key (padding, left-padded queries) must come back as LSE -inf (and output 0, checked
    # above) -- except eager's, which see every key uniformly (see cp/ring/masks.py).
    errs["empty_rows_ok"] = eager or bool(torch.isneginf(got["lse"][~finite]).all())
    return errs


def run_case(kind, source, kv_heads, layout_kind, dtype_name, group):
    import torch.distributed as dist

    from cpbench.cp.layout import SequenceLayout
    from cpbench.cp.ring.attention import P2PCounter, ring_attention_with_lse, ring_p2p_count
    from cpbench.cp.ring.select import select_kernel

    dtype = getattr(torch, dtype_name)
    eager = source == "dense_additive"
    inputs, ref, (seq, pos, pad, window, allowed) = _reference(kind, kv_heads, dtype, eager)
    layout = SequenceLayout(seq, dist.get_world_size(group), dist.get_rank(group), layout_kind)
    q, k, v = (layout.cut(x, dim=2).detach().clone().requires_grad_() for x in inputs[:3])
    masks = _ring_masks(source, seq, pos, pad, window, allowed, layout, dtype)
    counter = P2PCounter()
    out, lse = ring_attention_with_lse(
        q, k, v, masks, layout=layout, group=group, kernel=select_kernel("sdpa", q), scale=D**-0.5, counter=counter
    )
    forward_sends = counter.sends["forward"]
    out.backward(layout.cut(inputs[3], dim=2), retain_graph=True)
    errs_extra = {"plan_released": out.grad_fn.plan is None}  # the node no longer holds the masks
    try:
        out.backward(layout.cut(inputs[3], dim=2))
        errs_extra["second_backward"] = "ran"
    except RuntimeError as e:
        errs_extra["second_backward"] = str(e)
    got = {"out": out.detach(), "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    errs = _errors(got, ref, layout, eager)
    expected = ring_p2p_count(layout.cp_size)
    errs["p2p"] = (forward_sends, counter.sends["backward"], counter.recvs["backward"])
    errs["p2p_expected"] = (expected["forward"], expected["backward"], expected["backward"])
    return {**errs, **errs_extra}


def ops_worker() -> dict:
    """On 4 ranks: every case at cp=2 (groups {0, 1} and {2, 3}) and at cp=4 -> {cp: {case: errors}}."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank takes part in creating both
    groups = {2: pairs[dist.get_rank() // 2], 4: dist.group.WORLD}
    return {cp: {case_key(*c): run_case(*c, groups[cp]) for c in all_cases()} for cp in WORLD_SIZES}


@pytest.fixture(scope="module")
def results():
    from tests.spawn import run_ranks

    per_rank = run_ranks(ops_worker, 4, timeout=300)
    return {cp: {key: [r[cp][key] for r in per_rank] for key in per_rank[0][cp]} for cp in WORLD_SIZES}


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("kind,source,kv_heads,layout,dtype", all_cases())
def test_ring_matches_full_attention(results, world, kind, source, kv_heads, layout, dtype):
    per_rank = results[world][case_key(kind, source, kv_heads, layout, dtype)]
    tol = TOL[dtype]
    for rank, errs in enumerate(per_rank):
        for name in ("out", "lse", "dq", "dk", "dv"):
            assert errs[name] <= tol, f"rank {rank}: {name} error {errs[name]:.3g} > {tol:.3g}"
        assert errs["empty_rows_ok"], f"rank {rank}: a row that sees no key is not LSE -inf"


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_ring_p2p_transfers_are_what_the_algorithm_says(results, world):
    # forward: cp - 1 hops of K and V; backward: cp - 1 hops of K and V + cp hops of dK and dV (the last one
    # brings a block's accumulators home). Every tensor sent is also one received.
    expected = (2 * (world - 1), 2 * (world - 1) + 2 * world, 2 * (world - 1) + 2 * world)
    for key, per_rank in results[world].items():
        for rank, errs in enumerate(per_rank):
            assert errs["p2p"] == errs["p2p_expected"] == expected, (key, rank)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_ring_backward_lets_go_of_its_masks_and_refuses_to_run_twice(results, world):
    # After backward the graph node holds no masks (a node can outlive its step: the whole mask would pile up
    # step after step); a second backward on the same graph is a clear error, not a wrong gradient.
    for key, per_rank in results[world].items():
        for rank, errs in enumerate(per_rank):
            assert errs["plan_released"], (key, rank)
            assert "backward ran twice" in errs["second_backward"], (key, rank, errs["second_backward"])
