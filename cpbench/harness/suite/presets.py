"""Model presets: a name -> a transformers config. Weights are always random (seeded), never downloaded.

Tiny presets are for CPU sweeps and tests. The real architectures use their published `config.json` values
(the source is named next to each one), so memory and FLOPs scale as the real model's do; only the weights are
random, which is all a memory/speed/parity benchmark needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen3Config

_FAMILIES = {"qwen3": Qwen3Config, "llama": LlamaConfig, "mistral": MistralConfig, "gemma3_text": Gemma3TextConfig}


@dataclass(frozen=True)
class Preset:
    name: str
    family: str  # transformers model_type
    values: dict = field(default_factory=dict)
    source: str = ""  # where the published values come from

    def config(self, overrides: dict | None = None):
        """The transformers config with `overrides` applied (unknown keys are refused by `check_overrides`)."""
        return _FAMILIES[self.family](**{**self.values, **(overrides or {})})


_TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=8192, tie_word_embeddings=False,
)

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "tiny-qwen3", "qwen3", {**_TINY, "head_dim": 16, "tie_word_embeddings": True},
            "cpbench: a 2-layer Qwen3 for CPU sweeps, its embeddings tied as the small Qwen3 models' are",
        ),
        Preset("tiny-llama", "llama", dict(_TINY), "cpbench: a 2-layer Llama for CPU sweeps"),
        Preset(
            "attention-h8-d64", "llama",
            {**_TINY, "num_hidden_layers": 1, "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 64,
             "max_position_embeddings": 131072},
            "cpbench: the attention shape of the peers suites (8 heads, head dim 64), for level = \"attention\"",
        ),
        Preset(
            "tiny-mistral", "mistral", {**_TINY, "sliding_window": 64},
            "cpbench: a 2-layer Mistral with a 64-token sliding window",
        ),
        Preset(
            "tiny-gemma3", "gemma3_text",
            {**_TINY, "head_dim": 16, "sliding_window": 64, "layer_types": ["sliding_attention", "full_attention"]},
            "cpbench: a 2-layer Gemma3 text model, one sliding and one full layer",
        ),
        Preset(
            "qwen3-0.6b", "qwen3",
            dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                 rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
            "Qwen/Qwen3-0.6B config.json",
        ),
        Preset(
            "llama-3-8b", "llama",
            dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                 rope_theta=500_000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
            "meta-llama/Meta-Llama-3-8B config.json (max_position_embeddings raised from 8192 for long-context "
            "sweeps; RoPE scaling is irrelevant to memory and speed)",
        ),
        Preset(
            "mistral-7b", "mistral",
            dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
                 rope_theta=10_000.0, rms_norm_eps=1e-5, sliding_window=4096, tie_word_embeddings=False),
            "mistralai/Mistral-7B-v0.1 config.json (4096-token sliding window)",
        ),
        Preset(
            "gemma3-1b", "gemma3_text",
            dict(vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                 num_attention_heads=4, num_key_value_heads=1, head_dim=256, max_position_embeddings=32768,
                 sliding_window=512, query_pre_attn_scalar=256, rms_norm_eps=1e-6, tie_word_embeddings=True,
                 layer_types=[("full_attention" if (i + 1) % 6 == 0 else "sliding_attention") for i in range(26)]),
            "google/gemma-3-1b-pt config.json (5 sliding layers : 1 full layer)",
        ),
    )
}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(
            f"`model = {name!r}` is not a cpbench preset. Use one of {sorted(PRESETS)}, or add a Preset to "
            "cpbench/harness/suite/presets.py."
        )
    return PRESETS[name]


def check_overrides(preset: Preset, overrides: dict) -> None:
    """Refuses override keys the family's config does not know (a typo would otherwise be silently kept)."""
    known = set(_FAMILIES[preset.family]().to_dict())
    unknown = sorted(set(overrides) - known - set(preset.values))
    if unknown:
        raise ValueError(
            f"`model_overrides` has keys {unknown} that {_FAMILIES[preset.family].__name__} does not know. "
            f"Fix the spelling or remove them (e.g. num_hidden_layers, hidden_size, sliding_window)."
        )


def window_per_layer(config) -> list[int | None]:
    """Each layer's attention window in tokens (None: full causal attention) — for the FLOP count."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types:
        return [window if t == "sliding_attention" else None for t in types[:n]]
    return [window] * n
