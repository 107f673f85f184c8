"""Next-token cross-entropy without the full logits: the output projection and the loss, chunk by chunk.

A full loss holds, per rank, the logits in the model dtype, their fp32 copy, the saved log-softmax and two fp32
gradients: at 16k tokens and a 152k vocabulary about 27 GiB. Here the model's output projection is given only an
empty slice of the final hidden states (a forward pre-hook on the head, after FSDP's own, so the head's weights
are gathered as usual), and the loss is computed from the hidden states in chunks of tokens: each chunk's logits
(with what the family's head does after its projection: a bias, a scale, a soft-cap; cp/loss/head.py) are made in
fp32, reduced to a sum of cross-entropies and dropped, and recomputed in backward (activation checkpointing per
chunk). Chunks hold 256 MiB of fp32 logits, or more where that would make more than 256 chunks. At most one chunk's
logits and their gradient exist at a time; the sum over chunks is the full loss's sum in another order (fp32
rounding only). `out.logits` is None with this loss: ask for the full loss to get logits.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from cpbench.cp.loss.causal_lm import IGNORE_INDEX
from cpbench.cp.loss.head import Ops, apply_ops, logit_ops, softcap_ops

CHUNK_BYTES = 1 << 28  # fp32 logits of one chunk: 256 MiB (441 tokens of a 152k vocabulary)
# ... or larger chunks where 256 MiB ones would be more than this many: each chunk is a sequence of kernels and a
# checkpoint, and past this count the chunk's logits are small beside the rest of the step (at 512k tokens a rank
# and a 128k vocabulary: 256 chunks of 1 GiB, where the step's peak is tens of GiB).
MAX_CHUNKS = 256
LOSSES = ("full", "chunked", "liger")  # "liger": Liger-Kernel's fused kernels (cp/loss/liger.py), an optional extra


def check_loss(loss: str) -> None:
    if loss not in LOSSES:
        raise ValueError(f"loss={loss!r} is not one of {list(LOSSES)}: 'full' computes the whole logits (out.logits "
                         "is set), 'chunked' never holds them (out.logits is None), 'liger' is 'chunked' by "
                         "Liger-Kernel's fused CUDA kernels.")
    if loss == "liger":
        from cpbench.cp.loss.liger import INSTALL_HINT, liger_loss_class

        if liger_loss_class() is None:
            raise ImportError(INSTALL_HINT)


def _chunk_sum(hidden_nh, weight_vh, bias_v, targets_n, ops: Ops) -> torch.Tensor:
    # The ops run on fp32 logits: the family's own head runs them in the model dtype and its loss upcasts after,
    # so in fp32 the two agree to rounding and in bf16 this is the more precise of the two.
    logits = apply_ops(F.linear(hidden_nh, weight_vh, bias_v).float(), ops)
    return F.cross_entropy(logits, targets_n, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_cross_entropy_sum(
    hidden_bsh: torch.Tensor, weight_vh: torch.Tensor, targets_bs: torch.Tensor, softcap: float | None = None,
    chunk_bytes: int = CHUNK_BYTES, *, bias_v: torch.Tensor | None = None, ops: Ops = (),
) -> torch.Tensor:
    """Sum over every position of cross_entropy(ops(hidden @ weight.T + bias), target), -100 ignored, one chunk at a
    time. `softcap` is a shorthand for the soft-cap ops, applied after `ops`."""
    ops = (*ops, *softcap_ops(softcap))
    hidden_nh = hidden_bsh.reshape(-1, hidden_bsh.shape[-1])
    targets_n = targets_bs.reshape(-1)
    rows = max(1, chunk_bytes // (4 * weight_vh.shape[0]), -(-hidden_nh.shape[0] // MAX_CHUNKS))
    total = hidden_nh.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden_nh.shape[0], rows):
        part = slice(start, start + rows)
        total = total + checkpoint(_chunk_sum, hidden_nh[part], weight_vh, bias_v, targets_n[part], ops,
                                   use_reentrant=False)
    return total


class HeadInput:
    """While entered, the model's output projection sees an empty slice of its input, which is kept here."""

    def __init__(self, model: torch.nn.Module, loss: str = "chunked"):
        self.loss = loss
        self.head = model.get_output_embeddings()
        self.ops = logit_ops(model, loss)  # before the forward: a head cpbench cannot redo fails fast
        self.hidden: torch.Tensor | None = None

    def _hook(self, module, args):
        self.hidden = args[0]
        return (args[0][..., :0, :], *args[1:])

    @contextlib.contextmanager
    def capture(self):
        handle = self.head.register_forward_pre_hook(self._hook)
        try:
            yield self
        finally:
            handle.remove()

    def loss_sum(self, targets_bs: torch.Tensor) -> torch.Tensor:
        if self.hidden is None:
            raise RuntimeError(f"the model's forward did not call its output projection; loss={self.loss!r} needs it.")
        if self.loss == "liger":
            from cpbench.cp.loss.liger import liger_cross_entropy_sum

            return liger_cross_entropy_sum(self.hidden, self.head.weight, targets_bs, bias_v=self.head.bias,
                                           ops=self.ops)
        return chunked_cross_entropy_sum(self.hidden, self.head.weight, targets_bs, bias_v=self.head.bias,
                                         ops=self.ops)
