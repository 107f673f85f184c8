"""Context parallelism for Hugging Face transformers models (docs/DESIGN.md: the modules of cp/ and every touch point
with transformers)."""

from cpbench.cp import apply, hf_compat, loops
from cpbench.cp.hf_compat.trainer import install_loops
from cpbench.cp.apply import parallelize, use_loss
from cpbench.cp.balance import use_balance
from cpbench.cp.config import DistributedConfig
from cpbench.cp.fused import use_fused_norm
from cpbench.cp.layout import SequenceLayout, gather_sequence
from cpbench.cp.loss.causal_lm import cp_causal_lm_loss
from cpbench.cp.plan import DEFAULT_BASE_MODEL_CP_PLAN, FAMILY_CP_PLANS, ResolvedPlan, resolve_plan
from cpbench.cp.ring.attention import RING_IMPLEMENTATIONS, ring_attention
from cpbench.cp.styles import STYLES, AttentionStyle, SplitStyle, register_attention_style
from cpbench.cp.recompute import use_recompute
from cpbench.cp.tiled_mlp import use_tiled_mlp
from cpbench.cp.ulysses import check_ulysses, ulysses_attention
from cpbench.cp.usp import check_usp, usp_attention

register_attention_style("cp_ulysses", ulysses_attention, check=check_ulysses, replace=True, traces=True)
# The ring styles build every tile's mask from the batch's inputs (cp/batch_mask.py), never from the model's S x S one
register_attention_style("cp_ring", ring_attention, layout="contiguous", implementations=RING_IMPLEMENTATIONS,
                         replace=True, model_mask=False)
register_attention_style("cp_ring_zigzag", ring_attention, layout="zigzag", implementations=RING_IMPLEMENTATIONS,
                         replace=True, model_mask=False)
register_attention_style("cp_usp", usp_attention, layout="zigzag", implementations=RING_IMPLEMENTATIONS,
                         check=check_usp, replace=True, model_mask=False)
hf_compat.install(apply)
install_loops(loops)  # transformers' Trainer and TRL's SFTTrainer with a CP model (hf_compat/trainer.py)

__all__ = [
    "DEFAULT_BASE_MODEL_CP_PLAN",
    "FAMILY_CP_PLANS",
    "STYLES",
    "AttentionStyle",
    "DistributedConfig",
    "ResolvedPlan",
    "SequenceLayout",
    "SplitStyle",
    "cp_causal_lm_loss",
    "gather_sequence",
    "parallelize",
    "register_attention_style",
    "resolve_plan",
    "use_balance",
    "use_fused_norm",
    "use_loss",
    "use_recompute",
    "use_tiled_mlp",
]
