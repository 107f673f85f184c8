"""Model presets: a name -> a transformers config. Weights are always random (seeded), never downloaded.

Tiny presets are for CPU sweeps and tests. The real architectures use their published `config.json` values
(the source is named next to each one), so memory and FLOPs scale as the real model's do; only the weights are
random, which is all a memory/speed/parity benchmark needs.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

from transformers import AutoConfig

from cpbench.harness.suite.suite_errors import near

# Keys of a saved config.json that describe the file, not the model.
_META_KEYS = ("architectures", "transformers_version", "_name_or_path", "torch_dtype", "dtype", "model_type",
              "auto_map", "_attn_implementation_autoset", "use_cache")


@dataclass(frozen=True)
class Preset:
    name: str
    family: str  # transformers model_type
    values: dict = field(default_factory=dict)
    source: str = ""  # where the published values come from

    def config(self, overrides: dict | None = None):
        """The transformers config with `overrides` applied (unknown keys are refused by `check_overrides`)."""
        try:
            return AutoConfig.for_model(self.family, **{**self.values, **(overrides or {})})
        except Exception as e:  # noqa: BLE001 - transformers' own validation errors are not all ValueErrors
            raise ValueError(f"`model = {self.name!r}` with model_overrides {overrides or {}}: {e}") from None


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
            "qwen3-8b", "qwen3",
            dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                 rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
            "Qwen/Qwen3-8B config.json",
        ),
        Preset(
            "qwen3-30b-a3b", "qwen3_moe",
            dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                 num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                 num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                 mlp_only_layers=[], router_aux_loss_coef=0.001, output_router_logits=False,
                 max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
            "Qwen/Qwen3-30B-A3B config.json (128 experts, 8 per token: the MoE TRL trains at 1M tokens on 8 H100s)",
        ),
        Preset(
            "llama-3.1-70b", "llama",
            dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                 num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=131072,
                 rope_theta=500_000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
            "meta-llama/Llama-3.1-70B config.json (its llama3 RoPE scaling left out: irrelevant to memory and "
            "speed)",
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
    """A preset by name, or the user's own model: a path to a Hugging Face `config.json`, a directory holding one,
    or a hub id whose config is already in the local Hugging Face cache (nothing is downloaded)."""
    if name in PRESETS:
        return PRESETS[name]
    return _own_model(name)


@functools.lru_cache(maxsize=64)
def _own_model(name: str) -> Preset:
    path = Path(name).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file() and (name.endswith(".json") or name.startswith(("/", ".", "~"))):
        raise ValueError(f"`model = {name!r}`: no config.json there.{near(name, PRESETS)} Give a preset "
                         f"({sorted(PRESETS)}), a path to a "
                         "config.json, a directory holding one, or a hub id whose config is in the local HF cache.")
    try:
        raw = json.loads(path.read_text()) if path.is_file() else _cached_hub_config(name)
    except json.JSONDecodeError as e:
        raise ValueError(f"`model = {name!r}`: {path} is not valid JSON ({e.msg} at line {e.lineno}, column "
                         f"{e.colno}); fix the file, or save the config again with `config.save_pretrained(dir)`.") \
            from None
    if not isinstance(raw, dict):
        raise ValueError(f"`model = {name!r}`: {path} holds a {type(raw).__name__}, not a JSON object: it is not a "
                         "transformers config.json.")
    if "model_type" not in raw:
        raise ValueError(f"`model = {name!r}`: {path} has no `model_type`: it is not a transformers config.json.")
    _check_family(raw, name)
    values = {k: v for k, v in raw.items() if k not in _META_KEYS}
    if len(set(values.get("layer_types") or ["mixed", "types"])) == 1:
        del values["layer_types"]  # one type for every layer: derived, and it would pin num_hidden_layers
    short = path.parent.name if path.is_file() else name.rsplit("/", 1)[-1]
    return Preset(short or raw["model_type"], raw["model_type"], values, f"{name} (the user's config)")


def _cached_hub_config(name: str) -> dict:
    try:
        config = AutoConfig.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError):
        raise ValueError(
            f"`model = {name!r}` is not a cpbench preset.{near(name, PRESETS)} Use one of {sorted(PRESETS)}, a path to a config.json or a "
            "directory holding one (none exists there), or a hub id whose config is in the local Hugging Face cache "
            f"(none is for this one, and cpbench never downloads: fetch it where there is network with `hf download "
            f"{name} config.json`, or add a Preset to cpbench/harness/suite/presets.py)."
        ) from None
    return config.to_dict()


def _check_family(raw: dict, name: str) -> None:
    """Decoder-only causal LMs; the rest refused, saying why and what to do. A family no sequence cut makes exact
    (a hybrid's recurrent mixer) is a model like any other at cp_size 1: `check_has_plan` refuses its cp > 1."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    family = raw["model_type"]
    if "vision_config" in raw or "audio_config" in raw or "text_config" in raw:
        raise ValueError(f"`model = {name!r}` is a multimodal config ({family}): cpbench measures the training step "
                         "of a decoder-only language model. Give its text model's config (`text_config`) instead.")
    if family in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not raw.get("is_decoder"):
        raise ValueError(f"`model = {name!r}` ({family}) is an encoder: its attention is bidirectional and it has no "
                         "causal-LM training step; cpbench measures decoder-only causal language models.")
    if raw.get("is_encoder_decoder") or family not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"`model = {name!r}` ({family}) is not a decoder-only causal LM: context parallelism here "
                         "cuts the sequence of a causal language model's decoder layers (AutoModelForCausalLM).")


def check_has_plan(preset: Preset, cp_plan: dict, cp_sizes) -> None:
    """A family the audit refused (its layers mix tokens outside attention) runs at cp_size 1 only; one the audit does
    not know (cp/families/: every causal-LM family of the pinned transformers) runs at cp > 1 only with the suite's
    `cp_plan` (or a config carrying `base_model_cp_plan`)."""
    from cpbench.cp.families import table

    above = sorted(c for c in cp_sizes if c > 1)
    why = table.refusal_reason(preset.family)
    if why is not None and above:
        raise ValueError(
            f"`model = {preset.name!r}` ({preset.family}) cannot be context-parallel at cp_size {above}: {why}; no "
            "cp_plan makes a sequence cut exact there (docs/families.md). Run it at cp_size 1 (`--cp 1`, cp_sizes = "
            "[1]): the whole sequence on every rank, FSDP over the ranks (world_size), and the memory levers "
            "(recompute, chunked loss, offload) to fit a longer one.")
    if cp_plan or max(cp_sizes, default=1) <= 1 or table.base_plan(preset.family) is not None or \
            preset.values.get("base_model_cp_plan"):
        return
    raise ValueError(
        f"`model = {preset.name!r}`: the {preset.family} family has no default CP plan: it is not among the "
        f"{len(table.families())} causal-LM families of transformers {table.TRANSFORMERS_AUDITED} whose modeling code "
        "cpbench audited (docs/families.md). Give it a plan checked against its modeling code: `--cp-plan cp_ulysses` "
        "(the default plan's shape: every `model.layers.*` cut, every `model.layers.*.self_attn` exchanging), a JSON "
        'plan, or the suite\'s cp_plan = {"model.layers.*" = "cp_split_sequence", "model.layers.*.self_attn" = '
        '"cp_ulysses"} (each point puts its own style on the attention entries); in a training loop, '
        "`DistributedConfig(cp_plan=...)`."
    )


def plan_from_flag(text: str, preset: Preset) -> dict:
    """`--cp-plan`: a JSON plan (module pattern -> style), or a style name, which gives the default plan's shape
    under the model's base-model prefix with that style on its attention entries."""
    import json

    from cpbench.cp.families import table
    from cpbench.cp.styles import STYLES

    text = text.strip()
    if text.startswith("{"):
        try:
            plan = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--cp-plan {text!r}: not valid JSON ({e.msg} at column {e.colno}); write a JSON object "
                             'such as \'{"model.layers.*": "cp_split_sequence", "model.layers.*.self_attn": '
                             '"cp_ulysses"}\', or a style name.') from None
        if not isinstance(plan, dict) or not all(isinstance(v, str) for v in (*plan, *plan.values())):
            raise ValueError(f"--cp-plan {text!r}: give a JSON object of module pattern -> style name.")
        return plan
    if text not in STYLES.names():
        raise ValueError(f"--cp-plan {text!r}: give a JSON plan or a registered style name ({STYLES.names()}).")
    prefix = base_model_prefix(preset.family)
    head = f"{prefix}." if prefix else ""
    return {f"{head}{k}": (text if v != "cp_split_sequence" else v) for k, v in table.DEFAULT_PLAN.items()}


def base_model_prefix(family: str) -> str:
    """Where a family's causal LM keeps its base model (`model`, `transformer`, `gpt_neox`, ...): a plan's keys start
    with it."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.for_model(family))]
    except (KeyError, ValueError):
        return "model"
    return getattr(model_class, "base_model_prefix", "model") or ""


def check_overrides(preset: Preset, overrides: dict) -> None:
    """Refuses override keys the family's config does not know (a typo would otherwise be silently kept)."""
    config_class = type(AutoConfig.for_model(preset.family))
    known = set(config_class().to_dict())
    unknown = sorted(set(overrides) - known - set(preset.values))
    if unknown:
        raise ValueError(
            f"`model_overrides` has keys {unknown} that {config_class.__name__} does not know. "
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
