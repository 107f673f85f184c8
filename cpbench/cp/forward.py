"""The model-level forward under CP: what goes in whole and what comes out per rank.

Wraps the top model's `forward`. Every CP model refuses a KV cache (it would hold only this rank's tokens) and
runs with `use_cache=False`. A causal LM takes the full `labels` and returns the loss of the whole sequences and
this rank's logits; a base model returns this rank's `last_hidden_state`. A rank whose tail is padding returns
only its real tokens. An MoE causal LM asked for its router logits adds its router auxiliary loss of the whole
sequences (cp/loss/router.py) and returns it as `aux_loss`, with this rank's router logits as `router_logits`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect

from cpbench.cp.batch_mask import BatchFacts
from cpbench.cp.layout import SequenceLayout
from cpbench.cp.loss.causal_lm import cp_causal_lm_loss, shift_and_cut_labels, whole_sequence_mean
from cpbench.cp.loss.chunked import HeadInput
from cpbench.cp.loss.router import RouterCapture, local_token_mask, router_aux, whole_sequence_aux


class ForwardState:
    """The layout of the forward in flight, shared by the model's forward wrapper (which makes it from the full
    inputs) and its split hooks (which hand it to the layers)."""

    def __init__(self, make_layout):
        self.make_layout = make_layout
        self.layout: SequenceLayout | None = None
        self.loss = "full"  # or "chunked" (cp/loss/chunked.py), "liger" (cp/loss/liger.py); set by `cpbench.use_loss`
        # the embedding on this rank's ids (split.LocalEmbedding); off for a forward that returns every hidden state,
        # whose first one is the whole embedding
        self.local_embedding = True
        self.documents = True  # the model's mask isolates packed documents (set from its forward: hf_compat)
        # a zigzag layout placed by the batch's documents ("documents"), or the plain zigzag ("sequence");
        # set by `cpbench.cp.balance.use_balance`
        self.balance = "documents"
        self._last: SequenceLayout | None = None  # the latest forward's layout (what `model.cp_layout` returns)
        self.layout_of = None  # (input_ids, args, kwargs) -> the layout of a forward of those inputs (wrap_forward)

    @contextlib.contextmanager
    def active(self, layout: SequenceLayout):
        previous, self.layout = self.layout, layout
        try:
            yield
        finally:
            self.layout = previous

    def layout_for(self, seq_len: int) -> SequenceLayout:
        """The forward's layout; a layer called outside the model's forward gets one without batch facts."""
        if self.layout is not None and self.layout.seq_len == seq_len:
            return self.layout
        return self.make_layout(seq_len)

    def forward_layout(self, seq_len: int, facts: BatchFacts) -> SequenceLayout:
        """The layout of a forward: a zigzag one placed by the batch's documents (cp/balance.py), unless turned off."""
        self._last = self.make_layout(seq_len, facts=facts).balanced(self.balance)
        return self._last

    def last_layout(self, seq_len: int) -> SequenceLayout:
        """`model.cp_layout`: the layout of the latest forward of `seq_len` tokens (which the logits follow), else the
        plain one."""
        if self._last is not None and self._last.seq_len == seq_len:
            return self._last
        return self.make_layout(seq_len)


def refuse_generate(*args, **kwargs):
    raise ValueError(
        "generate() is not supported while cp_size > 1: decoding one token at a time has no sequence to split. "
        "Load the model without cpbench's DistributedConfig (or with cp_size=1) to generate."
    )


def _check_kwargs(kwargs: dict) -> None:
    if kwargs.get("use_cache") or kwargs.get("past_key_values") is not None:
        raise ValueError(
            "use_cache=True / past_key_values are not supported while cp_size > 1: a KV cache would hold only "
            "this rank's tokens. Call the model with use_cache=False (the default under cpbench)."
        )
    if kwargs.get("logits_to_keep", 0) not in (0, None):
        raise ValueError(
            f"logits_to_keep={kwargs['logits_to_keep']!r} is not supported while cp_size > 1: every rank returns "
            "the logits of its own slice. Drop the argument (or pass 0) and slice the gathered logits instead."
        )


def _trim(x, layout: SequenceLayout):
    valid = layout.valid_len
    return x[:, :valid].clone() if valid < x.shape[1] else x


def wrap_forward(model, state: ForwardState, group, *, causal_lm: bool):
    """`forward` of a CP model: full sequences in, this rank's slice (and the whole-sequence loss) out. With
    `group` None (a model without CP, for `use_loss`) the layout is the whole sequence and nothing is reduced."""
    forward = model.forward
    # Which named parameter each positional argument binds to, worked out once: `inspect.Signature.bind` at call time
    # breaks a whole-model torch.compile's graph (dynamo guards on the signature's mapping proxy).
    parameters = inspect.signature(forward).parameters.values()
    named = [p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    positional = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if group is not None:  # gather_sequence needs the forward's layout, which follows the batch's documents
        model.cp_layout = state.last_layout

    def given_inputs(input_ids, args: tuple, kwargs: dict) -> dict:
        """The model's named arguments as given (the mask may come positionally)."""
        return {**dict(zip(positional, (input_ids, *args))), **{k: v for k, v in kwargs.items() if k in named}}

    def layout_of(input_ids, args: tuple, kwargs: dict) -> SequenceLayout:
        """The layout of a forward of these full inputs (a loop's own head calls it too: cpbench/cp/loops/outputs.py)."""
        given = given_inputs(input_ids, args, kwargs)
        tokens = given.get("input_ids") if given.get("input_ids") is not None else kwargs.get("inputs_embeds")
        seq_len = tokens.shape[1]
        # position_ids may reach the model through its **kwargs (a multimodal wrapper passes them on to its language
        # model); documents only where the model's own mask keeps them apart (hf_compat.masks_isolate_documents)
        positions = given.get("position_ids", kwargs.get("position_ids")) if state.documents else None
        return state.forward_layout(seq_len, BatchFacts(seq_len, given.get("attention_mask"), positions))

    state.layout_of = layout_of

    @functools.wraps(forward)
    def cp_forward(input_ids=None, *args, labels=None, num_items_in_batch=None, **kwargs):
        if group is not None:
            _check_kwargs(kwargs)
        if labels is not None and not causal_lm:
            raise ValueError("labels were passed to a CP base model; use a *ForCausalLM model to get the loss.")
        return_dict = kwargs.pop("return_dict", None)
        kwargs.update(use_cache=False, return_dict=True)
        tokens = input_ids if input_ids is not None else kwargs.get("inputs_embeds")
        given = given_inputs(input_ids, args, kwargs)
        layout = layout_of(input_ids, args, kwargs)
        head = HeadInput(model, state.loss) if causal_lm and labels is not None and state.loss != "full" else None
        aux = router_aux(model, kwargs) if causal_lm else None  # turns the family's own (local) aux loss off
        router = RouterCapture(model) if aux is not None else None
        if aux is not None:  # before the forward: a mask the aux loss cannot count by fails fast
            token_mask = local_token_mask(given.get("attention_mask"), layout, tokens.shape[0], tokens.device)
        state.local_embedding = not kwargs.get("output_hidden_states")
        with state.active(layout), (head.capture() if head else contextlib.nullcontext()), \
                (router.capture() if router else contextlib.nullcontext()):
            out = forward(input_ids, *args, **kwargs)
        if head is not None:
            targets = shift_and_cut_labels(labels.to(head.hidden.device), layout)
            loss = whole_sequence_mean(head.loss_sum(targets), targets, group, num_items_in_batch)
            fields = {"logits": None, "loss": loss}
        elif causal_lm:
            fields = {"logits": _trim(out.logits, layout)}
            if labels is not None:
                fields["loss"] = cp_causal_lm_loss(out.logits, labels, layout, group, num_items_in_batch)
        else:
            fields = {"last_hidden_state": _trim(out.last_hidden_state, layout)}
        if aux is not None:
            fields["aux_loss"] = whole_sequence_aux(router.logits, aux, token_mask, group)
            fields["router_logits"] = tuple(router.logits)
            if labels is not None:  # as the family adds it: the cross-entropy plus coef x aux
                fields["loss"] = fields["loss"] + aux.coef * fields["aux_loss"].to(fields["loss"].device)
        # Rebuilt rather than assigned: a ModelOutput orders its tuple form by field, only from construction.
        out = type(out)(**{**out, **fields})
        return out.to_tuple() if return_dict is False else out

    return cp_forward
