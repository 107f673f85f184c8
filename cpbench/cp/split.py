"""`cp_split_sequence`: cut the sequence to this rank's tokens at the decoder layers.

The first split layer cuts `hidden_states` to this rank's tokens (padding the sequence to a multiple of the chunk
count first); every split layer gets its rotary `position_embeddings` cut the same way (one copy per forward, shared
by the layers: see `RotaryCuts`) and hands the `SequenceLayout` on to the attention style. The model-built mask and
`position_ids` stay whole.

Where the model hands the embedding's output unchanged to its first layer (`LOCAL_EMBEDDING_FAMILIES`), the
embedding runs on this rank's token ids only (`LocalEmbedding`): the base model keeps its `inputs_embeds` variable
alive through the whole forward, so a whole-sequence embedding costs `[tokens, hidden]` on every rank for every
layer's forward (32 GiB at 4M tokens and Llama-3-8B's 4,096). Elsewhere every rank embeds the full batch and the
first layer cuts it.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

from cpbench.cp.hf_compat import HIDDEN_STATES, LAYOUT_KWARG, POSITION_EMBEDDINGS, POSITION_IDS
from cpbench.cp.layout import SequenceLayout


def full_length(args: tuple, kwargs: dict, cuts_input: bool, forward_len: int | None = None) -> int:
    """The full sequence length a decoder layer works on: from its positions, its rotary tables, the hidden states
    the first layer cuts, or (a layer called with none of them: gpt_bigcode, ctrl) the model forward in flight."""
    position_ids = kwargs.get(POSITION_IDS)
    if position_ids is not None:
        return position_ids.shape[-1]
    rotary = kwargs.get(POSITION_EMBEDDINGS)
    if rotary is not None:
        return _tables(rotary)[0].shape[-2]
    if cuts_input:
        return _hidden(args, kwargs).shape[1]
    if forward_len is not None:
        return forward_len
    raise ValueError("cp_split_sequence: the decoder layer got neither `position_ids` nor `position_embeddings`.")


def _tables(rotary) -> tuple[torch.Tensor, ...]:
    """The rotary tables a model hands its layers: (cos, sin), or one complex `freqs_cis` tensor (deepseek_v2)."""
    return (rotary,) if isinstance(rotary, torch.Tensor) else tuple(rotary)


def _hidden(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs[HIDDEN_STATES]


class RotaryCuts:
    """This rank's slice of the rotary tables, cut once per forward and shared by every split layer of a model.

    The model computes cos/sin once and hands the same tensors to every layer, and each layer's `q * cos` saves
    its cos for backward. A per-layer cut would cost memory there: a contiguous cut is a view that pins the whole
    tables, a zigzag cut is a new copy per layer. One copy per forward costs this rank's positions once. The
    cache holds the full tables weakly, so nothing outlives the forward that made them. In a compiled layer the cut is
    traced (no cache): the compiler decides what the graph saves for backward."""

    def __init__(self):
        self._cuts = WeakIdKeyDictionary()

    def cut(self, rotary, layout: SequenceLayout):
        """This rank's rows (dim -2) of the tables, in the form the model gave them: a tuple, or one tensor."""
        tables = _tables(rotary)
        if torch.compiler.is_compiling():  # traced: a cut per layer (no weak cache in a graph)
            cut = tuple(layout.cut(t, dim=-2) for t in tables)
            return cut[0] if isinstance(rotary, torch.Tensor) else cut
        versions = tuple(t._version for t in tables)  # an in-place change to the tables is a new table
        hit = self._cuts.get(tables[0])
        if hit is not None:
            hit_layout, refs, hit_versions, cut = hit
            same = len(refs) == len(tables) and all(r() is t for r, t in zip(refs, tables))
            if same and hit_layout == layout and hit_versions == versions:
                return cut[0] if isinstance(rotary, torch.Tensor) else cut
        cut = tuple(layout.cut(t, dim=-2).clone(memory_format=torch.contiguous_format) for t in tables)
        self._cuts[tables[0]] = (layout, tuple(weakref.ref(t) for t in tables), versions, cut)
        return cut[0] if isinstance(rotary, torch.Tensor) else cut


# Their base model's forward: `inputs_embeds = embed_tokens(input_ids)`, used for its shape, dtype and device only
# (positions, masks, rotary tables), then `hidden_states = inputs_embeds` into the first decoder layer.
LOCAL_EMBEDDING_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


class LocalEmbedding:
    """The input embedding on this rank's token ids. Its forward pre-hook cuts the ids as the first split layer would
    cut the hidden states (padding with id 0: padded positions sit at the global end, where no real token attends to
    them, and they are trimmed from every output); its forward hook keeps the local embedding for the first split
    layer and hands the model a stand-in of the full shape that holds one element (`expand`), which the model reads
    only for its shape, dtype and device. The embedding's gradient is the same: before, the cut's backward gave the
    other ranks' positions zeros."""

    def __init__(self, state):
        self.state = state
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None  # (stand-in, local embedding) of this forward
        self.full_len: int | None = None  # set between the pre-hook that cut the ids and the hook after

    def before(self, module, args, kwargs):
        ids = args[0] if args else kwargs.get("input")
        layout = self.state.layout
        self.full_len = None
        if not self.state.local_embedding or layout is None or ids.dim() != 2 or ids.shape[1] != layout.seq_len:
            return None
        self.full_len = ids.shape[1]
        local = layout.cut(ids, dim=1)
        return ((local, *args[1:]), kwargs) if args else (args, {**kwargs, "input": local})

    def after(self, module, args, kwargs, output):
        if self.full_len is None:
            return None
        full = output.new_zeros(()).expand(output.shape[0], self.full_len, output.shape[-1])
        self.pending, self.full_len = (full, output), None
        return full

    def take(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The local embedding, if `hidden` is this forward's stand-in for it."""
        if self.pending is None or self.pending[0] is not hidden:
            return None
        local, self.pending = self.pending[1], None
        return local

    def feed(self, layer: torch.nn.Module) -> None:
        """Makes the first split layer take the local embedding in place of the stand-in *before* its own call, so
        that activation checkpointing (transformers' layers checkpoint inside `__call__`) saves the local embedding,
        not the stand-in, which an offload would copy at full size. The layer's class becomes a subclass whose
        `__call__` swaps the argument; FSDP2 subclasses it again as it does any module."""
        local_embedding, base = self, type(layer)

        def __call__(module, *args, **kwargs):
            if args and (local := local_embedding.take(args[0])) is not None:
                args = (local, *args[1:])
            elif HIDDEN_STATES in kwargs and (local := local_embedding.take(kwargs[HIDDEN_STATES])) is not None:
                kwargs[HIDDEN_STATES] = local
            return base.__call__(module, *args, **kwargs)

        layer.__class__ = type(base.__name__, (base,), {"__call__": __call__, "__module__": base.__module__})


def make_split_hook(cuts_input: bool, state, rotary_cuts: RotaryCuts, local_embedding: LocalEmbedding | None = None):
    """A forward pre-hook (with kwargs) for one decoder layer; `state` (forward.ForwardState) and `rotary_cuts`
    are shared by a model's layers."""

    def hook(module, args, kwargs):
        forward_len = state.layout.seq_len if state.layout is not None else None
        layout = state.layout_for(full_length(args, kwargs, cuts_input, forward_len))
        hidden = _hidden(args, kwargs) if cuts_input else None
        if cuts_input and not (local_embedding is not None and hidden.shape[1] == layout.local_len < layout.seq_len):
            # (a local embedding is this rank's slice already). A copy, not a view: a view would keep the whole
            # sequence's hidden states alive through backward.
            if local_embedding is not None and hidden.numel() > 1 and not any(hidden.stride()):
                raise RuntimeError(
                    f"cp_split_sequence: {type(module).__name__} got the local embedding's stand-in, not the embedding "
                    "(something between the embedding and the first decoder layer changed it); this family cannot "
                    "run the embedding on local ids: remove it from cpbench.cp.split.LOCAL_EMBEDDING_FAMILIES.")
            hidden = layout.cut(hidden, dim=1).clone()
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
