"""What holds whatever plan a user writes: a layer cut to this rank's tokens may mix tokens only through the attention
modules the plan gives a CP style. Two checks, one before and one at the first forward:

- `other_token_mixers(layer)`: before anything runs, the layer's submodules that mix tokens along the sequence some
  other way — a state-space scan (Mamba), linear attention or a delta rule, a recurrence (RWKV, RG-LRU, LSTM), a
  convolution over the sequence. Under a cut each would see this rank's tokens only, silently (falcon_h1's Mamba-2
  beside its attention returned a NaN loss). Found by class name and by the parameters such mixers carry
  (`A_log`, `dt_bias`, ...), and by `nn.Conv1d` (transformers' GPT-2 `Conv1D` is a linear layer, not a convolution).
- `AttentionCalls`: at a layer's first forward, every attention module the plan bound must have called the attention
  interface (transformers' ALL_ATTENTION_FUNCTIONS), where its CP style runs; a family that computes attention in its
  own code (bloom, falcon, gpt_neo, ...) never does, and its layer would attend within this rank's tokens only. The
  check removes itself once every layer passed, so later steps run no Python of it. A layer compiled before its first
forward is not watched (the hooks do nothing while dynamo traces): run one eager step first to have it checked.
"""

from __future__ import annotations

import re

import torch

MIXER_CLASS = re.compile(
    r"Mamba|SSM(?![a-z])|Mixer\b|ShortConv|GatedDelta|DeltaNet|LinearAttention|LightningAttention|RWKV|TimeMix|"
    r"ChannelMix|RGLRU|Rglru|Recurrent(Block|Layer)|LSTM|Retention|Hyena")
MIXER_PARAM = re.compile(r"(^|\.)(A_log|dt_bias|D|time_decay|time_first|time_mix_\w+|time_maa\w*|recurrent_param)$")


def other_token_mixers(layer: torch.nn.Module) -> list[str]:
    """`name (Class)` of each submodule of `layer` that mixes tokens along the sequence outside attention."""
    found = []
    for name, module in layer.named_modules():
        cls = type(module).__name__
        params = [p for p, _ in module.named_parameters(recurse=False) if MIXER_PARAM.search(p)]
        named = MIXER_CLASS.search(cls) and not cls.endswith("Norm")  # a Mamba family's RMSNorm mixes nothing
        if isinstance(module, torch.nn.Conv1d) or named or params:
            found.append(f"{name or '(the layer)'} ({cls}{': ' + ', '.join(params) if params else ''})")
    return found


def check_layers(model: torch.nn.Module, split_modules, model_name: str) -> None:
    """Refuses a plan that cuts a layer holding another token mixer (before any process group is touched)."""
    for name in split_modules:
        mixers = other_token_mixers(model.get_submodule(name))
        if mixers:
            raise ValueError(
                f"`{model_name}`: the plan cuts the sequence at `{name}`, which mixes tokens outside its attention "
                f"({'; '.join(mixers[:3])}): under a cut each rank's mixer would see only its own tokens, silently "
                "wrong. Context parallelism cannot serve this model: set `cp_size=1` (docs/families.md lists every "
                "family and why)."
            )


class AttentionCalls:
    """At each cut layer's first forward: did every attention module the plan bound run its CP style?"""

    def __init__(self, model: torch.nn.Module, split_modules, attention_modules, model_name: str):
        self.model_name = model_name
        self.handles = []
        self.pending = set(split_modules)
        for layer_name in split_modules:
            layer = model.get_submodule(layer_name)
            bound = [(a, model.get_submodule(a)) for a in attention_modules if a.startswith(layer_name + ".")]
            self.handles.append(layer.register_forward_pre_hook(self._before(bound)))
            self.handles.append(layer.register_forward_hook(self._after(layer_name, bound)))

    def _before(self, bound):
        def hook(module, args):
            if torch.compiler.is_compiling():  # a compiled layer is checked at its first eager forward, if any
                return
            for _, attention in bound:
                attention._cpbench_calls = 0

        return hook

    def _after(self, layer_name: str, bound):
        def hook(module, args, output):
            if torch.compiler.is_compiling():
                return
            silent = [a for a, attention in bound if not getattr(attention, "_cpbench_calls", 0)]
            if silent:
                raise RuntimeError(
                    f"`{self.model_name}`: `{layer_name}` was cut to this rank's tokens, but its attention "
                    f"{silent} never called transformers' attention interface (ALL_ATTENTION_FUNCTIONS), where its CP "
                    "style exchanges tokens: the family computes attention in its own code, and each rank attended "
                    "within its own tokens only. Context parallelism cannot serve it: set `cp_size=1`."
                )
            for _, attention in bound:
                attention.__dict__.pop("_cpbench_calls", None)  # counted only while watched (hf_compat)
            self.pending.discard(layer_name)
            if not self.pending:
                self.remove()

        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
