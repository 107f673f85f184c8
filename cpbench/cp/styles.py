"""The registry of CP styles that a `cp_plan` names.

Two kinds of style:
- a *split* style goes on the decoder layers: the first one cuts `hidden_states` to this rank's tokens,
  every one cuts the rotary `position_embeddings` the same way (see `split.py`);
- an *attention* style goes on attention modules: it replaces the model's attention call with a function that
  exchanges what attention needs across the cp group and returns this rank's output rows.

An attention function has the signature of transformers' attention interface plus three keywords:

    fn(module, query_bhsd, key_bhsd, value_bhsd, attention_mask, *, inner, group, layout, **kwargs)
        -> (output_bshd, weights_or_None)

`inner` is the model's own attention function (eager, sdpa, flex, flash), `group` the cp process group and
`layout` the `SequenceLayout` of this forward. q/k/v hold this rank's tokens in `layout` order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from cpbench.cp.layout import LAYOUT_KINDS

AttentionFn = Callable[..., tuple]


@dataclass(frozen=True)
class SplitStyle:
    name: str


@dataclass(frozen=True)
class AttentionStyle:
    """An attention algorithm. `layout` is the sequence layout it needs; `implementations` the model attention
    implementations it can serve (None: any)."""

    name: str
    fn: AttentionFn
    layout: str = "contiguous"
    implementations: tuple[str, ...] | None = None
    check: Callable[[object, int], None] | None = None  # (attention module, cp_size) -> raises if unservable
    # dynamo traces `fn` whole (functional collectives, no host reads); otherwise a compiled layer runs it as one
    # custom op (cp/ring/compiled.py)
    traces: bool = False
    # `fn` reads the mask the model builds; False: it works every mask out of the batch's own inputs
    # (cp/batch_mask.py) and ignores the model's, so a model whose every CP layer is such a style builds none
    model_mask: bool = True

    def __post_init__(self):
        if self.layout not in LAYOUT_KINDS:
            raise ValueError(f"Style {self.name!r}: layout {self.layout!r} is not one of {list(LAYOUT_KINDS)}.")


Style = SplitStyle | AttentionStyle


class StyleRegistry:
    """Name -> style. One instance, `STYLES`, is what plans resolve against."""

    def __init__(self):
        self._styles: dict[str, Style] = {}

    def register(self, style: Style, *, replace: bool = False) -> Style:
        if not isinstance(style, (SplitStyle, AttentionStyle)):
            raise TypeError(f"Expected a SplitStyle or AttentionStyle, got {type(style).__name__}.")
        if style.name in self._styles and not replace:
            raise ValueError(f"A CP style named {style.name!r} is already registered; pass replace=True to override.")
        self._styles[style.name] = style
        return style

    def unregister(self, name: str) -> None:
        self._styles.pop(name, None)

    def get(self, name: str) -> Style:
        if name not in self._styles:
            raise ValueError(f"Unknown CP style {name!r}. Registered styles: {sorted(self._styles)}.")
        return self._styles[name]

    def __contains__(self, name: str) -> bool:
        return name in self._styles

    def names(self) -> list[str]:
        return sorted(self._styles)


STYLES = StyleRegistry()
STYLES.register(SplitStyle("cp_split_sequence"))


def register_attention_style(
    name: str,
    fn: AttentionFn,
    *,
    layout: str = "contiguous",
    implementations: tuple[str, ...] | None = None,
    check: Callable[[object, object], None] | None = None,
    replace: bool = False,
    traces: bool = False,
    model_mask: bool = True,
) -> AttentionStyle:
    """Registers a custom attention style that a `cp_plan` can name. `check(attention_module, distributed_config)`
    raises a ValueError when the style cannot serve the module under that config. `traces`: torch.compile can trace
    `fn` whole; otherwise a compiled layer runs it as one opaque custom op (cp/ring/compiled.py). `model_mask`: `fn`
    reads the `attention_mask` the model builds (False: it ignores it, and the model need not build one)."""
    return STYLES.register(AttentionStyle(name, fn, layout, implementations, check, traces, model_mask),
                           replace=replace)
