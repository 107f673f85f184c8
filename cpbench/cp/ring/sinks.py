"""Attention sinks in the ring: one learned logit per head that joins every row's softmax denominator with no value.

gpt_oss (and flint, granite_swa, granitemoe_swa, mimo_v2_flash) hand their attention interface `s_aux`, a logit
s_h per query head: row i's weights are exp(x_ij) / (sum_j exp(x_ij) + exp(s_h)) and the sink's own weight is
dropped (transformers' eager_attention_forward of those models; flex_attention.py renormalises by the LSE the same
way). The ring merges its blocks into the output O and the log-sum-exp L of the keys alone, so the sink is one exact
correction after the merge:

    L' = logaddexp(L, s_h),    O' = O * exp(L - L') = O * sigmoid(L - s_h)

(a row that sees no key keeps O' = 0, and gets L' = s_h, a finite LSE every kernel's backward takes as is).

Backward. The weights p_ij = exp(x_ij - L') and p_sink = exp(s_h - L') are one softmax over the keys and the sink,
and O' = sum_j p_ij v_j (the sink has no value, dO'/dp_sink = 0). The softmax's backward gives

    dx_ij   = p_ij   (dO'_i . v_j - D_i),    D_i = sum_j p_ij dO'_i . v_j + p_sink * 0 = dO'_i . O'_i
    ds_h    = sum over the rows i of head h (every batch row, every position) of  p_sink,i * (0 - D_i)
            = -sum_i exp(s_h - L'_i) * (dO'_i . O'_i)

So the flash-style tile backward, handed O' and L' in place of O and L, computes P = exp(x - L') and
D = rowsum(dO' * O'): exactly the dq, dk, dv above, with no change to any kernel. The sink's gradient is the one
reduction `sink_grad`, over this rank's rows; the cp group's parameter-gradient reduction sums the ranks' shares as
it does for every other weight. All of it is elementwise or a row reduction on [B, H, S_local] tensors: O(S/cp).
"""

from __future__ import annotations

import torch


def check_sinks(sinks: torch.Tensor | None, heads: int) -> torch.Tensor | None:
    """`s_aux` as the ring takes it: None, or one logit per query head this rank computes."""
    if sinks is None:
        return None
    if sinks.dim() != 1 or sinks.shape[0] != heads:
        raise ValueError(
            f"cp_ring: the attention sinks `s_aux` have shape {tuple(sinks.shape)}, but the ring computes {heads} "
            f"query heads; it takes one sink logit per query head (shape [{heads}]), as the model's "
            "`self.sinks` of shape [num_attention_heads]. Pass s_aux=None for a layer without sinks."
        )
    return sinks


def add_sinks(out_bhsd: torch.Tensor, lse_bhs: torch.Tensor, sinks_h: torch.Tensor) -> torch.Tensor:
    """In place: the merged output becomes O' = O * exp(L - L'); returns L' = logaddexp(L, sink) [B, H, S]. Both are
    in the accumulation dtype (the sinks are cast to it)."""
    sink = sinks_h.to(lse_bhs.dtype)[None, :, None]
    lse_final = torch.logaddexp(lse_bhs, sink)
    out_bhsd.mul_(torch.exp(lse_bhs - lse_final)[..., None])  # L = -inf (no key): exp(-inf) = 0, O stays 0
    return lse_final


def sink_grad(dout_bhsd: torch.Tensor, out_bhsd: torch.Tensor, lse_bhs: torch.Tensor,
              sinks_h: torch.Tensor) -> torch.Tensor:
    """d loss / d sink [H] from this rank's rows: -sum_rows exp(sink - L') * (dO' . O'), given the final O' and L'."""
    acc = lse_bhs.dtype
    # delta = rowsum(dO' * O') in the accumulation dtype, one head at a time: in bf16 the casts would otherwise be two
    # fp32 copies of the whole output, more than the ring's backward itself holds with few kv heads.
    delta = torch.stack([torch.linalg.vecdot(dout_bhsd[:, h].to(acc), out_bhsd[:, h].to(acc))
                         for h in range(out_bhsd.shape[1])], dim=1)  # [B, H, S]
    p_sink = torch.exp(sinks_h.to(acc)[None, :, None] - lse_bhs)
    return -(p_sink * delta).sum(dim=(0, 2)).to(sinks_h.dtype)
