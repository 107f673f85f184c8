"""cpbench: context parallelism for Hugging Face transformers models, and a benchmark suite around it.

The CP API is loaded on first use (PEP 562), so `cpbench.report` works where only pandas/pyarrow/matplotlib
are installed: importing it does not import torch.
"""

from importlib import import_module

__version__ = "0.1.0"
_CP_API = ("DistributedConfig", "SequenceLayout", "gather_sequence", "parallelize", "register_attention_style",
           "use_balance", "use_fused_norm", "use_loss", "use_recompute", "use_tiled_mlp")
__all__ = list(_CP_API)


def __getattr__(name: str):
    if name in _CP_API:
        return getattr(import_module("cpbench.cp"), name)
    raise AttributeError(f"module 'cpbench' has no attribute {name!r}")
