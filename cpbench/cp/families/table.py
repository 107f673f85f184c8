"""The audit of every causal-LM family of the pinned transformers (audit.toml, beside this file), as plain data.

A family is `default` (the default plan under its base-model prefix: every decoder layer `layers.*` cuts the sequence,
every `layers.*.self_attn` runs Ulysses), `own` (exact with the plan the audit gives, keyed under the prefix, as
transformers' `base_model_tp_plan`), or `refused` with the reason: a refused family is refused whatever plan a user
writes, since a cut there would be silently wrong. A family the table does not know (a newer transformers, a model of
your own) has no default plan: give it a `cp_plan`, and `mixers.check_layer` still refuses a layer that mixes tokens
outside its attention. docs/families.md is this table rendered (`markdown()`, held equal by its test).
"""

from __future__ import annotations

import functools
import tomllib
from dataclasses import dataclass
from importlib import resources

DEFAULT_PLAN = {"layers.*": "cp_split_sequence", "layers.*.self_attn": "cp_ulysses"}
VERDICTS = ("default", "own", "refused")
TRANSFORMERS_AUDITED = "5.23"


@dataclass(frozen=True)
class Family:
    name: str
    verdict: str
    plan: dict | None  # keys under the base-model prefix; None when refused
    reason: str | None  # why it is refused
    features: tuple[str, ...]  # what it brings that CP keeps exact (moe, sinks, mla, sliding_window, ...)


@functools.cache
def families() -> dict[str, Family]:
    raw = tomllib.loads(resources.files(__package__).joinpath("audit.toml").read_text())
    out = {}
    for name, entry in raw.items():
        verdict = entry["verdict"]
        assert verdict in VERDICTS, (name, verdict)
        plan = DEFAULT_PLAN if verdict == "default" else entry.get("plan")
        out[name] = Family(name, verdict, plan, entry.get("reason"), tuple(entry.get("features", ())))
    return out


@functools.cache
def _aliases() -> dict[str, str]:
    """config.model_type -> family, where a family's causal LM takes a config that calls itself otherwise (emu3's
    Emu3ForCausalLM takes an `emu3_text_model` config)."""
    raw = tomllib.loads(resources.files(__package__).joinpath("audit.toml").read_text())
    return {entry["config_model_type"]: name for name, entry in raw.items() if "config_model_type" in entry}


def family(model_type: str) -> Family | None:
    """The audit's verdict on a family, by its mapping name or by the model_type its causal LM's config carries."""
    return families().get(model_type) or families().get(_aliases().get(model_type, ""))


def base_plan(model_type: str) -> dict | None:
    """The family's base-model plan (keys under its base-model prefix), or None: refused, or not in the audit."""
    known = family(model_type)
    return dict(known.plan) if known is not None and known.plan is not None else None


def refusal_reason(model_type: str) -> str | None:
    """Why the family cannot be context-parallel (whatever the plan), or None."""
    known = family(model_type)
    return known.reason if known is not None and known.verdict == "refused" else None


def supported() -> list[str]:
    return sorted(name for name, f in families().items() if f.verdict != "refused")


def markdown() -> str:
    """docs/families.md's table: every family, its verdict, and its plan, features or reason."""
    counts = {v: sum(f.verdict == v for f in families().values()) for v in VERDICTS}
    lines = [f"{len(families())} causal-LM families in transformers {TRANSFORMERS_AUDITED}: {counts['default']} take "
             f"the default plan, {counts['own']} their own plan, {counts['refused']} are refused.", "",
             "| family | verdict | plan, features, or why it is refused |", "|---|---|---|"]
    for name, f in sorted(families().items()):
        if f.verdict == "refused":
            detail = f.reason
        elif f.verdict == "own":
            detail = ", ".join(f"`{k}`: {v}" for k, v in f.plan.items())
        else:
            detail = ""
        if f.features:
            detail = "; ".join(filter(None, [detail, ", ".join(f.features)]))
        lines.append(f"| {name} | {f.verdict} | {detail.replace('|', '/')} |")
    return "\n".join(lines) + "\n"
