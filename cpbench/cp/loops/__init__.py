"""A CP model inside the training loops people run (transformers' Trainer, TRL's SFTTrainer): the CP side.

The loops' touch points are in `cp/hf_compat/trainer.py`, which is handed this package. What a loop must know of a CP
model is one fact: the ranks of a cp group share one batch, and each of them holds the whole sequences' loss, as the
ranks of a tensor-parallel group do. So a loop shards its data over the data-parallel ranks only, counts each token
once per cp group, and keeps one copy of what a cp group reports. outputs.py: how a model's ranks share batches, and
what a loop reads per token (logits, TRL's per-token log-probabilities) in the whole sequence's order; checkpoint.py:
the sharded weights and optimizer state, written and read at any mesh (torch's distributed checkpoint).

May import torch and the CP core (forward state, layout, loss); never transformers' Trainer, TRL or accelerate (those
are hf_compat's), cpbench.harness or cpbench.report.
"""

from cpbench.cp.loops.checkpoint import has_state, load_state, save_state
from cpbench.cp.loops.outputs import cp_config, fused_head_forward, sharing, whole_logits, whole_sequence

__all__ = ["cp_config", "fused_head_forward", "has_state", "load_state", "save_state", "sharing", "whole_logits",
           "whole_sequence"]
