"""The touch points between cpbench and transformers' mask code (the rest: hf_compat/__init__.py). Tested
against transformers 5.23. What cpbench relies on:

1. `transformers.masking_utils.is_tracing` and `packed_sequence_compatibility_function` (only inside
   `known_values_are_not_tracing`, which projections use): transformers treats every fake tensor as tracing and then
   builds a dense mask where real values would let it skip one; a fake tensor that carries its real values (a
   constant) is not tracing. A packed row's mask indexes the positions by the query and key indices: on known
   positions torch would compute the S x S mask for real (and then drop its values, too large to keep), so the mask
   function reads the positions without their values.
2. Whether a base model builds its mask with `position_ids` (`masks_isolate_documents`, read from its forward's source):
   transformers' mask functions isolate packed documents (position_ids restarting) only when given them, and a few
   families (afmoe) leave them out, so their unsharded model attends across documents; CP must do the same.
3. `masking_utils._preprocess_mask_arguments` returns no mask for a config whose `_attn_implementation` has no mask
   function in `ALL_MASK_ATTENTION_FUNCTIONS` (a 4-D mask given by the caller still passes through unchanged):
   `builds_no_mask` gives the module that builds a model's mask a config view under `CP_ATTENTION_KEY`, which has none,
   when every CP layer's style works its masks out of the batch's inputs (the ring styles) and the model has no
   sliding window (phimoe windows its mask without telling its attention: the ring reads that window from the mask).
   A packed row's S x S mask is 16 GiB at 131k tokens, and no layer would read it.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import re
import textwrap

import torch

from cpbench.cp.hf_compat.views import CP_ATTENTION_KEY, POSITION_IDS, AttentionConfigView

MASK_CALL = re.compile(r"(^|_)mask|mask_function")


@functools.cache
def masks_isolate_documents(base_model_class: type) -> bool:
    """Whether `base_model_class.forward` hands `position_ids` to the function that builds its attention mask (a call
    whose name says mask, or a `mask_kwargs` dict it unpacks into one): only then does a packed row's mask keep each
    document to itself. A forward whose source cannot be read is taken to isolate them (transformers' usual way)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(base_model_class.forward)))
    except (OSError, TypeError, SyntaxError):
        return True
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            if MASK_CALL.search(name) and any(k.arg == POSITION_IDS for k in node.keywords):
                return True
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "mask_kwargs" for t in node.targets):
            if isinstance(node.value, ast.Dict) and any(getattr(k, "value", None) == POSITION_IDS
                                                        for k in node.value.keys):
                return True
    return False


def builds_no_mask(module: torch.nn.Module) -> None:
    """`module` (the one whose forward builds the decoder layers' mask) builds none (point 3 above)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    if CP_ATTENTION_KEY in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        raise RuntimeError(f"{CP_ATTENTION_KEY!r} has a mask function in transformers: cannot skip the model's mask")
    if not isinstance(module.config, AttentionConfigView):
        module.config = AttentionConfigView(module.config, CP_ATTENTION_KEY)


@contextlib.contextmanager
def known_values_are_not_tracing():
    """While entered, transformers' mask code reads fake tensors that carry their values (FakeTensor.constant) as
    it reads real ones. Fake tensors without values still count as tracing, as before."""
    from torch._subclasses.fake_tensor import FakeTensor
    from transformers import masking_utils

    original = masking_utils.is_tracing

    def is_tracing(tensor=None) -> bool:
        if isinstance(tensor, FakeTensor) and tensor.constant is not None:
            return original(None)  # still tracing under torch.compile or jit
        return original(tensor)

    compatible = masking_utils.packed_sequence_compatibility_function

    def packed_compatible(mask_function, position_ids, packed_sequence_mask):
        inner = compatible(mask_function, position_ids, packed_sequence_mask)

        def mask(*indices):
            with _values_hidden(position_ids, packed_sequence_mask):
                return inner(*indices)

        return mask

    masking_utils.is_tracing = is_tracing
    masking_utils.packed_sequence_compatibility_function = packed_compatible
    try:
        yield
    finally:
        masking_utils.is_tracing = original
        masking_utils.packed_sequence_compatibility_function = compatible


@contextlib.contextmanager
def _values_hidden(*tensors):
    """While entered, fake tensors that carry their values carry none: what is computed from them stays fake (no real
    compute), and nothing is allocated (a copy without values would add to a projection's tracked memory)."""
    from torch._subclasses.fake_tensor import FakeTensor

    hidden = [(t, t.constant) for t in tensors if isinstance(t, FakeTensor) and t.constant is not None]
    for t, _ in hidden:
        t.constant = None
    try:
        yield
    finally:
        for t, constant in hidden:
            t.constant = constant
