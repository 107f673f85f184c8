"""CP plans: the per-family defaults, overrides, and resolution into plain data.

A plan maps module patterns (`*` for a layer number, as in `tp_plan`) to style names. The default base-model
plan cuts the sequence at every decoder layer and runs Ulysses in every self-attention module; which family takes it,
which its own plan, and which is refused is the audit's (cp/families/). Resolution
turns a plan plus a model's module names into a `ResolvedPlan` without touching any process group, so it is
unit-tested on its own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from cpbench.cp.families import table
from cpbench.cp.styles import STYLES, AttentionStyle, SplitStyle, StyleRegistry

DEFAULT_BASE_MODEL_CP_PLAN = table.DEFAULT_PLAN

# model_type -> base-model plan, for every family the audit of its modeling code found exact under CP (families/): the
# default plan or the family's own. Others need an explicit `cp_plan` (or `config.base_model_cp_plan`), except the
# refused ones (`refusal_reason`), which no plan makes exact.
FAMILY_CP_PLANS: dict[str, dict[str, str]] = {name: table.base_plan(name) for name in table.supported()}
refusal_reason = table.refusal_reason


@dataclass(frozen=True)
class ResolvedPlan:
    """A plan as concrete module names. `split_modules` are in model order; the first one cuts the input."""

    split_modules: tuple[str, ...]
    attention_modules: dict[str, str]
    layout: str

    @property
    def first_split(self) -> str:
        return self.split_modules[0]


def default_cp_plan(model_type: str, base_model_prefix: str, config_plan: dict | None = None) -> dict | None:
    """The model's full plan (keys prefixed like `model.cp_plan`), or None if the family has none."""
    base = config_plan if config_plan is not None else table.base_plan(model_type)
    if base is None:
        return None
    prefix = f"{base_model_prefix}." if base_model_prefix else ""
    return {f"{prefix}{k}": v for k, v in base.items()}


def merge_plan(plan: dict[str, str] | None, override: dict[str, str | None] | None) -> dict[str, str]:
    merged = dict(plan or {})
    for key, style in (override or {}).items():
        if style is None:
            merged.pop(key, None)
        else:
            merged[key] = style
    return merged


def _pattern(key: str) -> re.Pattern:
    return re.compile(re.escape(key).replace(r"\*", r"\d+"))


def _no_plan_error(cp_size: int, model_name: str, why: str) -> ValueError:
    return ValueError(
        f"`cp_size={cp_size}` was requested, but `{model_name}` {why}. Pass `cp_plan` in `DistributedConfig` "
        f"(e.g. cp_plan={{'model.layers.*': 'cp_split_sequence', 'model.layers.*.self_attn': 'cp_ulysses'}}), "
        "or set `cp_size=1`."
    )


def resolve_plan(
    plan: dict[str, str] | None,
    module_names: list[str],
    *,
    cp_size: int,
    model_name: str,
    registry: StyleRegistry = STYLES,
) -> ResolvedPlan:
    """Expands `plan` over `module_names` (in model order) and checks it is complete and consistent."""
    if not plan:
        raise _no_plan_error(cp_size, model_name, "has no `cp_plan`")
    for key, style in plan.items():
        if not isinstance(style, str):
            raise TypeError(f"`cp_plan[{key!r}]` must be a style name (str), got {style!r}.")
        registry.get(style)  # raises with the registered names

    unmatched = [k for k in plan if not any(_pattern(k).fullmatch(n) for n in module_names)]
    if unmatched:
        raise ValueError(
            f"`cp_plan` keys {unmatched} match no module of `{model_name}`. Keys are full module names with `*` "
            f"for a layer number, e.g. {_example_names(module_names)}."
        )

    split, attention = [], {}
    patterns = [(_pattern(k), k, registry.get(s)) for k, s in plan.items()]
    for name in module_names:
        # The most specific matching key wins: a literal layer number beats `*`, then the longer key.
        matches = [(k, s) for p, k, s in patterns if p.fullmatch(name)]
        if not matches:
            continue
        style = max(matches, key=lambda m: (-m[0].count("*"), len(m[0])))[1]
        if isinstance(style, SplitStyle):
            split.append(name)
        else:
            attention[name] = style.name

    if not split:
        raise _no_plan_error(cp_size, model_name, "has a `cp_plan` without a sequence-split style")
    if not attention:
        raise _no_plan_error(cp_size, model_name, "has a `cp_plan` without an attention style")
    _check_nesting(split, attention)
    layouts = {registry.get(s).layout for s in attention.values()}
    if len(layouts) > 1:
        raise ValueError(
            f"`cp_plan` mixes attention styles with different sequence layouts ({sorted(layouts)}); every layer "
            "must hold the same tokens. Use one layout for all attention modules."
        )
    return ResolvedPlan(tuple(split), attention, layouts.pop())


def _check_nesting(split: list[str], attention: dict[str, str]) -> None:
    """Every cut layer must exchange tokens in its attention, and every CP attention must see cut inputs."""
    for layer in split:
        if not any(a.startswith(layer + ".") for a in attention):
            raise ValueError(
                f"`cp_plan` cuts the sequence at `{layer}` but none of its attention modules has an attention style: "
                "its attention would see only this rank's tokens. Add an attention style for it."
            )
    for module in attention:
        if not any(module.startswith(layer + ".") for layer in split):
            raise ValueError(
                f"`cp_plan` gives `{module}` an attention style, but no enclosing decoder layer has a split style "
                "('cp_split_sequence')."
            )


def _example_names(module_names: list[str]) -> list[str]:
    seen = []
    for n in module_names:
        generic = re.sub(r"\.\d+(\.|$)", r".*\1", n)
        if generic.endswith(("layers.*", "self_attn")) and generic not in seen:
            seen.append(generic)
    return seen[:3]


def attention_style(name: str, registry: StyleRegistry = STYLES) -> AttentionStyle:
    style = registry.get(name)
    assert isinstance(style, AttentionStyle), name
    return style
