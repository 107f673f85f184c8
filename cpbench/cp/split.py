"""`cp_split_sequence`: cut the sequence to this rank's tokens at the decoder layers.

Every rank of a cp group runs the embedding on the same full batch. The first split layer cuts
`hidden_states` to this rank's tokens (padding the sequence to a multiple of the chunk count first); every split
layer cuts its rotary `position_embeddings` the same way and hands the `SequenceLayout` on to the attention
style. The model-built mask and `position_ids` stay whole.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .hf_compat import HIDDEN_STATES, LAYOUT_KWARG, POSITION_EMBEDDINGS, POSITION_IDS
from .layout import SequenceLayout


def full_length(args: tuple, kwargs: dict, cuts_input: bool) -> int:
    position_ids = kwargs.get(POSITION_IDS)
    if position_ids is not None:
        return position_ids.shape[-1]
    rotary = kwargs.get(POSITION_EMBEDDINGS)
    if rotary is not None:
        return rotary[0].shape[-2]
    if cuts_input:
        return _hidden(args, kwargs).shape[1]
    raise ValueError("cp_split_sequence: the decoder layer got neither `position_ids` nor `position_embeddings`.")


def _hidden(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs[HIDDEN_STATES]


def make_split_hook(cuts_input: bool, make_layout: Callable[[int], SequenceLayout]):
    """A forward pre-hook (with kwargs) for one decoder layer."""

    def hook(module, args, kwargs):
        layout = make_layout(full_length(args, kwargs, cuts_input))
        if cuts_input:
            # A copy, not a view: a view would keep the whole sequence's hidden states alive through backward.
            hidden = layout.cut(_hidden(args, kwargs), dim=1).clone()
            if args:
                args = (hidden, *args[1:])
            else:
                kwargs[HIDDEN_STATES] = hidden
        rotary = kwargs.get(POSITION_EMBEDDINGS)
        if rotary is not None:
            kwargs[POSITION_EMBEDDINGS] = tuple(layout.cut(t, dim=-2) for t in rotary)
        kwargs[LAYOUT_KWARG] = layout
        return args, kwargs

    return hook
