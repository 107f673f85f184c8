"""The losses of a CP model: the loss of the whole sequences from each rank's slice.

causal_lm.py: next-token cross-entropy token-weighted over the cp group (labels shifted on the full sequence, -100
ignored); chunked.py: the same without the full logits (the output projection and the loss chunk by chunk);
liger.py: Liger-Kernel's fused linear cross-entropy (an optional extra) with the chunked loss's glue; head.py: what a
family's head does to its logits after the projection (a scale, a soft-cap), redone by those two; router.py: an MoE
family's router auxiliary loss over the whole sequences; family.py: both read from the family's own forward. May
import torch, transformers and the CP core's leaf modules (layout, comm); never the ring, the plan, cpbench.harness or
cpbench.report.
"""

from cpbench.cp.loss.causal_lm import IGNORE_INDEX, cp_causal_lm_loss

__all__ = ["IGNORE_INDEX", "cp_causal_lm_loss"]
