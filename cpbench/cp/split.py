"""`cp_split_sequence`: cut the sequence to this rank's tokens at the decoder layers.

Every rank of a cp group runs the embedding on the same full batch. The first split layer cuts
`hidden_states` to this rank's tokens (padding the sequence to a multiple of the chunk count first); every split
layer gets its rotary `position_embeddings` cut the same way (one copy per forward, shared by the layers: see
`RotaryCuts`) and hands the `SequenceLayout` on to the attention style. The model-built mask and `position_ids`
stay whole.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

from cpbench.cp.hf_compat import HIDDEN_STATES, LAYOUT_KWARG, POSITION_EMBEDDINGS, POSITION_IDS
from cpbench.cp.layout import SequenceLayout


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


class RotaryCuts:
    """This rank's slice of the rotary tables, cut once per forward and shared by every split layer of a model.

    The model computes cos/sin once and hands the same tensors to every layer, and each layer's `q * cos` saves
    its cos for backward. A per-layer cut would cost memory there: a contiguous cut is a view that pins the whole
    tables, a zigzag cut is a new copy per layer. One copy per forward costs this rank's positions once. The
    cache holds the full tables weakly, so nothing outlives the forward that made them."""

    def __init__(self):
        self._cuts = WeakIdKeyDictionary()

    def cut(self, rotary: tuple[torch.Tensor, ...], layout: SequenceLayout) -> tuple[torch.Tensor, ...]:
        versions = tuple(t._version for t in rotary)  # an in-place change to the tables is a new table
        hit = self._cuts.get(rotary[0])
        if hit is not None:
            hit_layout, refs, hit_versions, cut = hit
            same = len(refs) == len(rotary) and all(r() is t for r, t in zip(refs, rotary))
            if same and hit_layout == layout and hit_versions == versions:
                return cut
        cut = tuple(layout.cut(t, dim=-2).clone(memory_format=torch.contiguous_format) for t in rotary)
        self._cuts[rotary[0]] = (layout, tuple(weakref.ref(t) for t in rotary), versions, cut)
        return cut


def make_split_hook(cuts_input: bool, state, rotary_cuts: RotaryCuts):
    """A forward pre-hook (with kwargs) for one decoder layer; `state` (forward.ForwardState) and `rotary_cuts`
    are shared by a model's layers."""

    def hook(module, args, kwargs):
        layout = state.layout_for(full_length(args, kwargs, cuts_input))
        if cuts_input:
            # A copy, not a view: a view would keep the whole sequence's hidden states alive through backward.
            hidden = layout.cut(_hidden(args, kwargs), dim=1).clone()
            if args:
                args = (hidden, *args[1:])
            else:
                kwargs[HIDDEN_STATES] = hidden
        rotary = kwargs.get(POSITION_EMBEDDINGS)
        if rotary is not None:
            kwargs[POSITION_EMBEDDINGS] = rotary_cuts.cut(rotary, layout)
        kwargs[LAYOUT_KWARG] = layout
        return args, kwargs

    return hook
