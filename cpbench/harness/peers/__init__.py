"""Peers side by side: other context-parallel implementations on the same attention op.

Owns the registry of implementations (registry.py: names, where each runs, why one is skipped), their adapters
(adapters.py: cpbench's styles, DeepSpeed-Ulysses, PyTorch CP, ring-flash-attn, yunchang) and the attention-level
point that runs them (attention_level.py). May import the suite and measure rooms and cpbench.cp; the registry
imports nothing (the suite's checks read it).
"""
