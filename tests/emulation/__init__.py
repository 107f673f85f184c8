"""Strict CPU emulations of the CUDA attention kernels cpbench's ring attention calls, written from the kernels' own
source (PyTorch's fused SDPA ops in aten_sdpa.py, flash-attn 2.8's private functions in flash_attn.py): the checks
their host code makes, the layouts their device code assumes, and their math in fp32. Each module's CONTRACT lists
what was read, where, and how it is enforced.
"""
