"""`loss = "liger"`: Liger-Kernel's fused linear cross-entropy (`LigerFusedLinearCrossEntropyLoss`), the GPU form of
the chunked loss (cp/loss/chunked.py): Triton kernels that compute the output projection, the loss and its gradients
chunk by chunk, never holding the full logits. An optional extra (`pip install 'cpbench[liger]'`, CUDA only);
the pure-torch `loss = "chunked"` is the reference it is held to and runs anywhere.

The glue is the same as the chunked loss's (the head sees an empty slice; the loss takes the final hidden states
and the head's weight and bias) with a sum over valid tokens, so cpbench's token-weighted mean over the cp group
applies unchanged. Liger applies a soft-cap after the projection and nothing else, so a family's scale of the logits
(cohere's `logit_scale`, granite's `1 / logits_scaling`; cp/loss/head.py) is applied to the hidden states and the
bias instead: `(h * s) @ W.T + b * s == (h @ W.T + b) * s`, equal up to rounding (bit-exact for a power-of-two
scale). Liger computes the gradients during the forward and keeps them for backward: the hidden states' gradient and
the head weight's, in the model dtype.
"""

from __future__ import annotations

import torch

from cpbench.cp.loss.causal_lm import IGNORE_INDEX
from cpbench.cp.loss.head import Ops, apply_ops, softcap_ops

INSTALL_HINT = ("loss='liger' needs Liger-Kernel (Triton kernels, CUDA): pip install 'cpbench[liger]'. "
                "loss='chunked' computes the same loss in pure torch on any device.")


def liger_loss_class():
    """Liger's loss module class, or None when Liger-Kernel is not installed."""
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None
    return LigerFusedLinearCrossEntropyLoss


def liger_form(ops: Ops) -> tuple[Ops, float | None]:
    """`ops` as Liger can run them: scale ops to apply before the projection, and a soft-cap after it (or None)."""
    head, tail = ops[:-3], ops[-3:]
    if len(tail) == 3 and [op[0] for op in tail] == ["div", "tanh", "mul"] and tail[0][1] == tail[2][1]:
        ops, softcap = head, float(tail[0][1])
    else:
        softcap = None
    if any(op[0] not in ("mul", "div") for op in ops):
        raise ValueError(f"loss='liger': the logits' ops {[op[0] for op in ops]} are not a scale followed by a "
                         "soft-cap, all that Liger's fused loss applies. Use loss='chunked' (the same loss in pure "
                         "torch).")
    return ops, softcap


def liger_cross_entropy_sum(
    hidden_bsh: torch.Tensor, weight_vh: torch.Tensor, targets_bs: torch.Tensor, softcap: float | None = None, *,
    bias_v: torch.Tensor | None = None, ops: Ops = (),
) -> torch.Tensor:
    """Sum over every position of cross_entropy(ops(hidden @ weight.T + bias), target), -100 ignored, by Liger's
    kernels. `softcap` is a shorthand for the soft-cap ops, applied after `ops`."""
    cls = liger_loss_class()
    if cls is None:
        raise ImportError(INSTALL_HINT)
    scale, softcap = liger_form((*ops, *softcap_ops(softcap)))
    kwargs = {"ignore_index": IGNORE_INDEX, "reduction": "sum"}
    if softcap:
        kwargs["softcap"] = softcap
    hidden_nh = apply_ops(hidden_bsh.reshape(-1, hidden_bsh.shape[-1]), scale)
    bias_v = apply_ops(bias_v, scale) if bias_v is not None else None
    extra = {"bias": bias_v} if bias_v is not None else {}  # a bias-free call stays the one every Liger version has
    result = cls(**kwargs)(weight_vh, hidden_nh, targets_bs.reshape(-1), **extra)
    loss = result if isinstance(result, torch.Tensor) else getattr(result, "loss", None)
    if loss is None:  # a tuple (loss, z_loss) from versions that return one
        loss = result[0]
    return loss.float()
