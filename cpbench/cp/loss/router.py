"""The router auxiliary (load-balancing) loss of an MoE causal LM, over the whole sequences.

MoE families called with `output_router_logits=True` add `coef * load_balancing_loss_func(router_logits, num_experts,
top_k, attention_mask)` to their loss: num_experts * sum_e(f_e * P_e), where f_e is the mean over tokens (and layers)
of the top-k assignments to expert e and P_e the mean router probability of e. A product of two means over *all*
tokens: under CP each rank holds a slice of them, so the family's own value would be a local estimate (and its 2-D
mask, of the full length, would not fit the local router logits). Here the forward runs with the family's aux loss
off, the router outputs transformers would record are recorded by cpbench's own hooks, and each rank sums its
tokens' statistics (assignment counts, probability sums, token count; masked by its slice of the attention mask,
the layout's padding left out), the sums are all-reduced over the cp group, and every rank computes the one global
value. The probability sums go through a differentiable all-reduce (comm.all_reduce_sum), so the router weights'
gradients are the unsharded ones in the same convention as the cross-entropy's (causal_lm.py: each rank holds cp_size
times its share; FSDP's mean over fsdp x cp divides it out). The counts carry no gradient (top-k is a selection).

The statistics are transformers 5.23's Switch-Transformer form (mixtral's `load_balancing_loss_func`, one copy per
family), term for term; family.py checks that a family's copy is that form and refuses one that is not (doge's).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cpbench.cp.comm import all_reduce_sum
from cpbench.cp.layout import SequenceLayout
from cpbench.cp.loss.family import router_aux_form, router_recorders

REQUEST = "output_router_logits"


@dataclass(frozen=True)
class RouterAux:
    num_experts: int
    top_k: int
    coef: float


def router_aux(model: torch.nn.Module, kwargs: dict) -> RouterAux | None:
    """The aux loss this call of `model` asks for (its `output_router_logits`, else the config's), or None: not asked,
    or the family adds none. Turns the family's own off in `kwargs`; refuses a family whose form differs."""
    asked = kwargs.get(REQUEST)
    if not (asked if asked is not None else getattr(model.config, REQUEST, False)):
        return None
    form = router_aux_form(type(model))
    if form is None:  # router logits without an aux loss (deepseek_v3, afmoe, ...): the family's forward as it is
        return None
    family = getattr(model.config, "model_type", None) or type(model).__name__
    try:
        values = form.values(model) if form.unknown is None else None
    except AttributeError as e:  # the forward names an attribute this model lacks
        form, values = type(form)(unknown=str(e)), None
    if values is None:
        raise ValueError(
            f"{REQUEST}=True: {family} adds a router auxiliary loss that cpbench cannot redo over the whole sequences "
            f"({type(model).__name__}.forward: {form.unknown}); cpbench replaces the model's loss and reproduces only "
            f"transformers' Switch-Transformer load-balancing loss (mixtral's). Pass {REQUEST}=False (or set "
            f"config.{REQUEST}=False): the loss is then the cross-entropy alone."
        )
    kwargs[REQUEST] = False
    return RouterAux(int(values[0]), int(values[1]), values[2])


class RouterCapture:
    """While entered, keeps the router output of every module transformers records as `router_logits`, in call order."""

    def __init__(self, model: torch.nn.Module):
        self.sources = _sources(model.base_model)
        if not self.sources:
            raise ValueError(f"{type(model).__name__} declares no `router_logits` recorder; cpbench cannot collect its "
                             f"router logits. Pass {REQUEST}=False.")
        self.logits: list[torch.Tensor] = []

    @contextlib.contextmanager
    def capture(self):
        self.logits = []
        # Removed when the forward returns: a recompute in backward runs the router again, recording nothing.
        handles = [module.register_forward_hook(self._hook(index)) for module, index in self.sources]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def _hook(self, index: int):
        def hook(module, args, output):
            value = output[index] if isinstance(output, tuple) else output
            if value is not None:
                self.logits.append(value)

        return hook


def _sources(base_model: torch.nn.Module) -> list[tuple[torch.nn.Module, int]]:
    """The modules and output indices transformers' recorders select (output_capturing.recursively_install_hooks)."""
    recorders, out = router_recorders(base_model), []
    for name, module in base_model.named_modules():
        for target, class_name, layer_name, index in recorders:
            matches = ((target is not None and isinstance(module, target))
                       or (class_name is not None and f".{name}".endswith(class_name)))
            if matches and (layer_name is None or f".{layer_name.strip('.')}." in f".{name}."):
                out.append((module, index))
    return out


def local_token_mask(attention_mask, layout: SequenceLayout, batch: int, device) -> torch.Tensor:
    """1.0 for this rank's real tokens, in the order its router logits hold them ([batch * local_len]); 0.0 for a
    masked token and for the layout's padding."""
    if attention_mask is None:
        full = torch.ones(batch, layout.seq_len, device=device)
    elif isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
        full = attention_mask.to(device=device, dtype=torch.float32)
    else:
        shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
        raise ValueError(f"{REQUEST}=True with an attention_mask of shape {shape}: the router auxiliary loss counts "
                         f"tokens by a 2-D padding mask [batch, {layout.seq_len}], as transformers' does. Pass a 2-D "
                         f"mask (or none), or {REQUEST}=False.")
    return layout.cut(full, dim=1, pad_value=0.0).reshape(-1)


def _local_sums(router_logits: list[torch.Tensor], aux: RouterAux, mask_n: torch.Tensor):
    """This rank's assignment counts and probability sums per expert, and its token count (over layers)."""
    device = router_logits[0].device
    mask_n = mask_n.to(device)
    counts = torch.zeros(aux.num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(aux.num_experts, dtype=torch.float32, device=device)
    for layer in router_logits:
        layer = layer.to(device).reshape(-1, layer.shape[-1])
        if layer.shape[0] != mask_n.shape[0]:
            raise ValueError(f"router logits of {layer.shape[0]} rows, but this rank holds {mask_n.shape[0]} tokens "
                             "(batch x local length): the router does not see this rank's slice whole, token by "
                             f"token (e.g. a tiled MoE block). Pass {REQUEST}=False.")
        weights = torch.softmax(layer, dim=-1)  # in the router's dtype, as transformers' does
        _, selected = torch.topk(weights, aux.top_k, dim=-1)
        assigned = torch.zeros_like(counts).scatter_add_(0, selected.reshape(-1), mask_n.repeat_interleave(aux.top_k))
        counts = counts + assigned
        probs = probs + (weights.float() * mask_n.unsqueeze(-1)).sum(dim=0)
    return counts, probs, mask_n.sum() * len(router_logits)


def whole_sequence_aux(router_logits: list[torch.Tensor], aux: RouterAux, mask_n: torch.Tensor, group) -> torch.Tensor:
    """The load-balancing loss of the whole sequences (every rank holds it) from this rank's router logits."""
    counts, probs, tokens = _local_sums(router_logits, aux, mask_n)
    if group is not None:
        stats = torch.cat([counts, tokens.reshape(1)])
        dist.all_reduce(stats, group=group)  # counts and the token count: no gradient to carry
        counts, tokens = stats[:-1], stats[-1]
        probs = all_reduce_sum(probs, group)
    return torch.sum((counts / tokens) * (probs / tokens).unsqueeze(0)) * aux.num_experts
