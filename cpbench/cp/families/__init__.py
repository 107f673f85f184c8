"""The model families context parallelism serves, and how each was judged: the audit of every causal-LM family of the
pinned transformers (audit.toml: default plan, its own plan, or refused with the reason; table.py reads it), the
automated part of that audit (audit.py: what a decoder layer takes, what mixes tokens in it, where its attention is
and whether it goes through the attention interface), and the check that holds whatever plan a user gives: a cut layer
must exchange tokens only through its attention styles (mixers.py: no other token mixer, every bound attention
called), and whether a family tells its attention its sliding window (window.py: where it does not, the model's mask
is kept for the ring to read). May import torch and transformers, and cpbench.cp's hf_compat; nothing else of
cpbench.
"""
