"""Fused kernels cpbench swaps into a model in place of transformers' eager modules: norm.py, RMSNorm as one op
forward and one op backward (`cpbench.use_fused_norm`). May import torch and transformers; never the rest of cp,
cpbench.harness or cpbench.report.
"""

from cpbench.cp.fused.norm import NORM_MODES, use_fused_norm

__all__ = ["NORM_MODES", "use_fused_norm"]
