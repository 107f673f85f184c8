"""A point: one configuration of a sweep (a length, a cp size, an attention implementation, a style and the suite's
fixed settings), its key, its id and its dict form. Suites (spec.py) expand into them; every room that runs,
measures, projects or reports a point reads this."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields

from cpbench.report.runs.schema import DEFAULTS, KEY_COLUMNS

BALANCED_STYLES = ("cp_ring_zigzag", "cp_usp")  # the styles whose zigzag ring `balance` places (cp/balance.py)


@dataclass(frozen=True, kw_only=True)
class Point:
    suite: str
    model: str  # the preset name, with overrides spelled out when there are any
    preset: str
    model_overrides: dict
    seq_len: int
    batch_size: int
    batch_kind: str
    cp_size: int
    fsdp_size: int
    dp_replicate_size: int
    world_size: int
    attn_implementation: str
    cp_style: str
    dtype: str
    device: str
    warmup_steps: int
    measured_steps: int
    keep_outputs: bool
    loss_mode: str
    activation_checkpointing: bool
    recompute_every_n_layers: int = 1
    recompute_policy: str = "full"
    offload_activations: bool = False
    offload_params: bool = False
    tiled_mlp: str = "off"  # "off", "auto" or a tile count
    norm: str = "eager"
    optimizer: str = "foreach"  # torch's AdamW: foreach (its default) | fused (Suite.optimizer)
    max_grad_norm: float = 0.0  # > 0: the gradients clipped to this global norm before each optimizer step
    loop: str = "own"  # what drives the step: cpbench's own loop | transformers' Trainer (Suite.loop)
    mixed_precision: bool = False
    parity_mode: str
    reference: str = "auto"
    timeout_s: float
    seed: int
    fault: str | None = None
    level: str = "model"
    implementation: str = "cpbench"
    cp_ulysses_degree: int = 1
    cp_plan: dict = field(default_factory=dict)
    documents: str = "none"  # "none", a shipped mix's name, or "lengths:<hash>" (schema `documents`)
    compile: str = "off"  # torch.compile of each decoder layer: "off" or the mode
    document_lengths: tuple = ()  # the given rows of lengths behind "lengths:<hash>" (in spec_json)
    balance: str = "documents"  # the zigzag ring's placement: "documents" or "sequence" (Suite.balance)

    @property
    def point_id(self) -> str:
        style = self.cp_style + (f"-u{self.cp_ulysses_degree}" if self.cp_style == "cp_usp" else "")
        parts = [self.model, f"s{self.seq_len}", f"cp{self.cp_size}", self.attn_implementation, style]
        if self.fsdp_size > 1:
            parts.append(f"fsdp{self.fsdp_size}")
        if self.dp_replicate_size > 1:
            parts.append(f"dpr{self.dp_replicate_size}")
        if self.batch_size != 1 or self.batch_kind != "plain":
            parts.append(f"b{self.batch_size}{self.batch_kind}")
        if self.documents != "none":
            parts.append("docs-" + self.documents.replace(":", "-"))
        if self.balance != "documents" and self.cp_style in BALANCED_STYLES:
            parts.append(f"{self.balance}-balance")
        if self.keep_outputs:
            parts.append("keep-outputs")
        if self.loss_mode != "full":
            parts.append(f"{self.loss_mode}-loss")
        if self.activation_checkpointing:
            every = self.recompute_every_n_layers
            parts.append("recompute" + (str(every) if every > 1 else "")
                         + (f"-{self.recompute_policy}" if self.recompute_policy != "full" else ""))
        if self.offload_activations:
            parts.append("offload-act")
        if self.offload_params:
            parts.append("offload-params")
        if self.tiled_mlp != "off":
            parts.append(f"tiled-mlp-{self.tiled_mlp}")
        if self.norm != "eager":
            parts.append(f"{self.norm}-norm")
        if self.optimizer != "foreach":
            parts.append(f"{self.optimizer}-adamw")
        if self.max_grad_norm:
            parts.append(f"clip{self.max_grad_norm:g}")
        if self.loop != "own":
            parts.append(f"{self.loop}-loop")
        if self.compile != "off":
            parts.append("compiled" + ("" if self.compile == "default" else f"-{self.compile}"))
        if self.mixed_precision:
            parts.append("mixed-precision")
        if self.level != "model":
            parts.append(self.level)
        if self.implementation != "cpbench":
            parts.append(self.implementation)
        return "/".join(parts) + (f"/{self.dtype}" if self.dtype != "float32" else "")

    @property
    def point_key(self) -> str:
        return key_hash(self._key_values())

    @property
    def family_key(self) -> str:
        """The point without its length: longer points of an out-of-memory family are skipped."""
        return key_hash({c: v for c, v in self._key_values().items() if c != "seq_len"})

    def _key_values(self) -> dict:
        """The key columns, but those added since version 8 where they hold their default: a point that uses none of
        them keeps the key it had (its reference cache, its records)."""
        return {c: getattr(self, c) for c in KEY_COLUMNS if not (c in DEFAULTS and getattr(self, c) == DEFAULTS[c])}

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Point":
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


def key_hash(values: dict) -> str:
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:16]

