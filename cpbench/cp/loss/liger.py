"""`loss = "liger"`: Liger-Kernel's fused linear cross-entropy (`LigerFusedLinearCrossEntropyLoss`), the GPU form of
the chunked loss (cp/loss/chunked.py): Triton kernels that compute the output projection, the loss and its gradients
chunk by chunk, never holding the full logits. An optional extra (`pip install 'cpbench[liger]'`, CUDA only);
the pure-torch `loss = "chunked"` is the reference it is held to and runs anywhere.

The glue is the same as the chunked loss's (the head sees an empty slice; the loss takes the final hidden states
and the head's weight) with a sum over valid tokens, so cpbench's token-weighted mean over the cp group applies
unchanged. Liger computes the gradients during the forward and keeps them for backward: the hidden states'
gradient and the head weight's, in the model dtype.
"""

from __future__ import annotations

import torch

from cpbench.cp.loss.causal_lm import IGNORE_INDEX

INSTALL_HINT = ("loss='liger' needs Liger-Kernel (Triton kernels, CUDA): pip install 'cpbench[liger]'. "
                "loss='chunked' computes the same loss in pure torch on any device.")


def liger_loss_class():
    """Liger's loss module class, or None when Liger-Kernel is not installed."""
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None
    return LigerFusedLinearCrossEntropyLoss


def liger_cross_entropy_sum(
    hidden_bsh: torch.Tensor, weight_vh: torch.Tensor, targets_bs: torch.Tensor, softcap: float | None = None,
) -> torch.Tensor:
    """Sum over every position of cross_entropy(hidden @ weight.T, target), -100 ignored, by Liger's kernels."""
    cls = liger_loss_class()
    if cls is None:
        raise ImportError(INSTALL_HINT)
    kwargs = {"ignore_index": IGNORE_INDEX, "reduction": "sum"}
    if softcap:
        kwargs["softcap"] = float(softcap)
    hidden_nh = hidden_bsh.reshape(-1, hidden_bsh.shape[-1])
    result = cls(**kwargs)(weight_vh, hidden_nh, targets_bs.reshape(-1))
    loss = result if isinstance(result, torch.Tensor) else getattr(result, "loss", None)
    if loss is None:  # a tuple (loss, z_loss) from versions that return one
        loss = result[0]
    return loss.float()
