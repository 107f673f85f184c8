"""The automated part of the family audit: every causal-LM family of the installed transformers built tiny on the meta
device (tiny.py), and read for what makes CP exact or not. `python -m cpbench.cp.families.audit` prints each family's
findings beside its verdict in audit.toml, and the disagreements; tests/unit/test_families.py holds the two together.

What it reads, per family (each finding names the module or statement):
- the plan: the family's plan (audit.toml's, or the default's shape under its base-model prefix) must match a split
  module per decoder layer and an attention module inside each;
- the attention: each planned attention module's class must call transformers' attention interface
  (ALL_ATTENTION_FUNCTIONS / get_interface) in its forward, where a CP style can take over;
- other token mixers in a cut layer (mixers.other_token_mixers: Mamba/SSM, linear attention, recurrences, conv1d);
- extra full-sequence inputs: decoder-layer forward parameters beyond what every family passes;
- whether the model's mask isolates packed documents (hf_compat.masks_isolate_documents), for the record.

Families the hand audit refuses for reasons this cannot see (encoders' bidirectional masks, positions read from the
local length, selection outside the interface) keep their hand-written reason; the automation confirms what it can
and never turns a refused family into a supported one.
"""

from __future__ import annotations

import inspect
import re
import sys
from dataclasses import dataclass, field

import torch

from cpbench.cp.families import mixers, table
from cpbench.cp.families.tiny import causal_lm_class, tiny_config
from cpbench.cp.hf_compat import masks_isolate_documents

INTERFACE = re.compile(r"ALL_ATTENTION_FUNCTIONS|get_interface\(")
# What decoder layers take besides hidden_states, in every family that passes (positions, the mask, the cache).
STANDARD_INPUTS = {"self", "hidden_states", "attention_mask", "position_ids", "past_key_values", "past_key_value",
                   "use_cache", "cache_position", "position_embeddings", "output_attentions", "output_router_logits",
                   "kwargs", "layer_past", "head_mask", "x", "mask", "inputs", "layer_idx", "flash_attn_kwargs",
                   "output_hidden_states", "freqs_cis", "residual", "layer_head_mask", "encoder_hidden_states",
                   "encoder_attention_mask",
                   # this rank's k/v of an earlier layer, which the sharing layer's CP style exchanges again
                   # (gemma4_unified; num_kv_shared_layers)
                   "shared_kv_states"}
CROSS_INPUTS = {"encoder_hidden_states", "encoder_attention_mask", "cross_attention_states", "per_layer_input",
                "original_hidden_states"}


@dataclass
class Finding:
    family: str
    verdict: str  # the hand audit's (audit.toml)
    built: bool = True
    problems: list[str] = field(default_factory=list)  # what makes a cut wrong or unreachable, automatically seen
    documents_in_mask: bool | None = None

    @property
    def agrees(self) -> bool:
        """A supported family shows no problem; a refused one may show its reason or not (the hand audit's stands)."""
        return self.verdict == "refused" or (self.built and not self.problems)


def _plan_for(model: torch.nn.Module, family: str) -> dict:
    prefix = model.base_model_prefix if model.base_model is not model else ""
    base = table.base_plan(family) or table.DEFAULT_PLAN
    return {f"{prefix}.{k}" if prefix else k: v for k, v in base.items()}


def _matches(pattern: str, names: list[str]) -> list[str]:
    rx = re.compile(re.escape(pattern).replace(r"\*", r"\d+"))
    return [n for n in names if rx.fullmatch(n)]


def audit_family(family: str) -> Finding:
    finding = Finding(family, table.family(family).verdict)
    try:
        with torch.device("meta"):
            model = causal_lm_class(family)(tiny_config(family))
    except Exception as e:  # noqa: BLE001 - a family that cannot be built tiny is a finding, not a crash
        finding.built = False
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        finding.problems.append(f"cannot build a tiny model: {type(e).__name__}: {first[:120]}")
        return finding
    names = [n for n, _ in model.named_modules()]
    plan = _plan_for(model, family)
    splits = [n for key, style in plan.items() if style == "cp_split_sequence" for n in _matches(key, names)]
    attention = [n for key, style in plan.items() if style != "cp_split_sequence" for n in _matches(key, names)]
    if not splits or not attention:  # no plan fits: read the model's decoder stack as it is
        finding.problems.append(f"no module matches the plan {plan}")
        splits = _decoder_layers(model)
        attention = [f"{s}.{n}" for s in splits for n, m in model.get_submodule(s).named_children()
                     if ATTENTION_NAME.search(type(m).__name__)]
    for name in attention:
        source = inspect.getsource(type(model.get_submodule(name)).forward)
        if not INTERFACE.search(source):
            finding.problems.append(f"{name} ({type(model.get_submodule(name)).__name__}) does not call the "
                                    "attention interface")
            break
    for name in splits:
        layer = model.get_submodule(name)
        found = mixers.other_token_mixers(layer)
        if found:
            finding.problems.append(f"{name} mixes tokens outside attention: {'; '.join(found[:2])}")
            break
        params = set(inspect.signature(type(layer).forward).parameters)
        extra = sorted((params - STANDARD_INPUTS) | (params & CROSS_INPUTS))
        if extra:
            finding.problems.append(f"{name} ({type(layer).__name__}) takes other inputs: {extra}")
            break
    if splits:
        stack = splits[0].rsplit(".", 2)[0] if splits[0].count(".") >= 2 else ""
        finding.documents_in_mask = masks_isolate_documents(type(model.get_submodule(stack)))
    else:
        finding.problems.append("no decoder stack found")
    return finding


ATTENTION_NAME = re.compile(r"Attention|Attn|MultiHead")
MULTIMODAL = re.compile(r"vision|visual|image|audio|speech|encoder(?!_)|vq", re.IGNORECASE)


def _decoder_layers(model: torch.nn.Module) -> list[str]:
    """The longest list of blocks outside a vision, audio or encoder tower: where a family keeps its decoder layers."""
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m)
             and not MULTIMODAL.search(n)]
    if not lists:
        return []
    name, blocks = max(lists, key=lambda item: len(item[1]))
    return [f"{name}.{i}" for i in range(len(blocks))]


def substantive(finding: Finding) -> list[str]:
    """Its problems but the plan's names: what makes a cut wrong, not what a plan would have to be called."""
    return [p for p in finding.problems if not p.startswith(("no module matches the plan", "cannot build"))]


def audit(families=None) -> list[Finding]:
    return [audit_family(name) for name in (families or sorted(table.families()))]


def main(argv: list[str]) -> int:
    findings = audit(argv or None)
    for f in findings:
        mark = "ok " if f.agrees else "DISAGREES"
        print(f"{mark} {f.family:28s} {f.verdict:8s} {'; '.join(f.problems) or '-'}")
    disagree = [f.family for f in findings if not f.agrees]
    print(f"\n{len(findings)} families; {len(disagree)} where the automated audit finds a supported family wrong: "
          f"{disagree}")
    return 1 if disagree else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
