"""cpbench: context parallelism for Hugging Face transformers models, and a benchmark suite around it."""

from .cp import DistributedConfig, SequenceLayout, gather_sequence, parallelize, register_attention_style

__version__ = "0.1.0"
__all__ = ["DistributedConfig", "SequenceLayout", "gather_sequence", "parallelize", "register_attention_style"]
