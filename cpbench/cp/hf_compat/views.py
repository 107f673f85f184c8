"""The names cpbench hands transformers' attention code, and the views it hands it: a config whose
`_attn_implementation` routes a module's attention through its CP style, a module with some attributes
replaced. Shared by the touch points of this package (hf_compat/__init__.py, masks.py)."""

from __future__ import annotations

import torch

CP_ATTENTION_KEY = "cpbench_cp"
HIDDEN_STATES = "hidden_states"
POSITION_EMBEDDINGS = "position_embeddings"
POSITION_IDS = "position_ids"
LAYOUT_KWARG = "cp_layout"
KERNEL_DEVICE_KWARG = "kernel_device"  # DistributedConfig.cp_kernel_* as a KernelTarget, handed to a style when set


class AttentionConfigView:
    """The model config as one attention module sees it: the same object, except `_attn_implementation`."""

    def __init__(self, config, attn_implementation: str):
        object.__setattr__(self, "_cp_base_config", config)
        object.__setattr__(self, "_attn_implementation", attn_implementation)

    def __getattr__(self, name):  # only for names not set here; a plain attribute read, which dynamo traces
        if name.startswith("_cp_"):  # not set yet (a copy being rebuilt): no recursion
            raise AttributeError(name)
        return getattr(self._cp_base_config, name)

    def __setattr__(self, name, value):
        setattr(self._cp_base_config, name, value)


class ModuleView:
    """An attention module with some attributes replaced (e.g. `num_key_value_groups` after head sharding).

    The model's attention functions read `module.config._attn_implementation` (flash attention picks its kernel
    from it), so a view handed to them must carry the model's own config, not the CP view of it.
    """

    def __init__(self, module: torch.nn.Module, **overrides):
        self._cp_module = module
        self.__dict__.update(overrides)

    def __getattr__(self, name):  # only for names not set here; a plain attribute read, which dynamo traces
        if name.startswith("_cp_"):
            raise AttributeError(name)
        return getattr(self._cp_module, name)
