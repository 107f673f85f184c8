"""transformers' flash_attention_3 and flash_attention_4 backends on CPU, through the emulations, so that a model
loaded with either runs every CP style here (the model's own attention under cp_ulysses and the unsharded reference
call `flash_attn_interface.flash_attn_func` / `flash_attn.cute.flash_attn_func`; the ring's tiles call the private
functions), as `tests/dist/test_ring_cuda_models.py` runs flash_attention_2's glue.

transformers (modeling_flash_attention_utils.py, 5.23) loads these backends only where the package's distribution is
installed and CUDA is available (`FLASH_ATTENTION_COMPATIBILITY_MATRIX[3|4]["general_availability_check"]`,
`supported_devices`, `cuda_min_major_version`); `installed` lets it take the emulations on CPU instead, and forgets
the functions it loaded before (`_loaded_implementation`), so the next call imports the stand-ins.

    with hf_backends.installed(capability=(9, 0)):
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="flash_attention_3", dtype=bf16)
"""

from __future__ import annotations

import contextlib

from . import flash_attn_3, flash_attn_4


@contextlib.contextmanager
def installed(capability=(9, 0)):
    from transformers import modeling_flash_attention_utils as fa_utils

    matrix = fa_utils.FLASH_ATTENTION_COMPATIBILITY_MATRIX
    saved = {v: dict(matrix[v]) for v in (3, 4)}
    with flash_attn_3.installed(capability), flash_attn_4.installed(arch=capability[0] * 10 + capability[1]):
        for v in (3, 4):
            matrix[v].update(general_availability_check=lambda *a, **k: True, cuda_min_major_version=None,
                             supported_devices=((lambda: True, "cpu (cpbench's kernel emulations)"),))
        fa_utils._loaded_implementation = None
        try:
            yield
        finally:
            for v in (3, 4):
                matrix[v].clear()
                matrix[v].update(saved[v])
            fa_utils._loaded_implementation = None
