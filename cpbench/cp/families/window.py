"""Whether a family tells its attention its sliding window, read from its attention module's code.

transformers' families with a sliding window build the model's mask with it (`create_sliding_window_causal_mask`),
and most also pass it to the attention interface (`sliding_window=...` in the attention module's forward: mistral,
gemma2/3, gpt_oss, ...), where the ring styles take it and build each tile's mask from the batch. One that does not
(phimoe) has the window in the model's S x S mask only, which the ring then reads. The model's mask is skipped (it
costs S x S bytes per rank, 16 GiB at 128k tokens) only where every cut attention module is told its window.
"""

from __future__ import annotations

import inspect
import re

import torch

PASSES_WINDOW = re.compile(r"\bsliding_window\s*=")


def tells_window(attention: torch.nn.Module) -> bool:
    """True when the module's forward passes `sliding_window=` on (to the attention interface); False when it does
    not, or when its code cannot be read (the model's mask is then kept, as before)."""
    try:
        source = inspect.getsource(type(attention).forward)
    except (OSError, TypeError):
        return False
    return PASSES_WINDOW.search(source) is not None
