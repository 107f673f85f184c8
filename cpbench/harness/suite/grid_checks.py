"""Checks of the sweep grid: lengths, cp sizes, attention backends and CP styles, and what their combinations
and the model's config allow.

Every value of every list is checked on its own, and every error is reported: an unknown backend does not hide a
bad length or an unknown style. Checks that need the model's config (lengths against max_position_embeddings,
head counts against cp sizes) run whenever the model and its overrides are sound, whatever else is wrong.
Each check takes the `spec.Suite` being validated (spec imports this module, so the type is not imported here).
"""

from __future__ import annotations

from cpbench.harness.suite.suite_errors import Collector, each, err, near

BACKENDS = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3", "flash_attention_4")
CUDA_ONLY_BACKENDS = ("flash_attention_2", "flash_attention_3", "flash_attention_4")
# cpbench's documented attention styles. A documented style that this install has not registered yet is
# `skipped` (with why) rather than refused, so a suite can name a style before its implementation lands.
DOCUMENTED_STYLES = ("cp_ulysses", "cp_ring", "cp_ring_zigzag", "cp_usp")


def check_lengths(suite) -> None:
    each(_length, suite.seq_lens)


def _length(s: int) -> None:
    if s < 2:
        raise err("seq_lens", s, "every length must be an integer >= 2 (tokens).")


def check_lengths_fit(suite, config) -> None:
    each(_fits, [s for s in suite.seq_lens if s >= 2], config.max_position_embeddings)


def _fits(s: int, max_positions: int) -> None:
    if s > max_positions:
        raise err("seq_lens", s, f"exceeds the model's max_position_embeddings={max_positions}; "
                  "drop it or raise it with model_overrides = {max_position_embeddings = ...}.")


def check_backends(suite) -> None:
    each(_backend, suite.attn_implementations, suite)


def _backend(b: str, suite) -> None:
    if b not in BACKENDS:
        raise err("attn_implementations", b, f"use one of {list(BACKENDS)}.{near(b, BACKENDS)}")
    if b in CUDA_ONLY_BACKENDS and suite.device != "cuda":
        raise err("attn_implementations", b, "needs device = \"cuda\"; use eager or sdpa on CPU.")
    if b in CUDA_ONLY_BACKENDS and suite.dtype == "float32":
        raise err("attn_implementations", b, f"FlashAttention has no float32 kernels (dtype = "
                  f"{suite.dtype!r}); set dtype = \"bfloat16\" or \"float16\", or use sdpa.")


# transformers' own flags of what a model class supports (PreTrainedModel._supports_*), by backend; eager needs none
SUPPORT_FLAGS = {"sdpa": "_supports_sdpa", "flex_attention": "_supports_flex_attn",
                 "flash_attention_2": "_supports_flash_attn", "flash_attention_3": "_supports_flash_attn",
                 "flash_attention_4": "_supports_flash_attn"}


def supported_backends(config) -> tuple[str, list[str]] | None:
    """(the model class's name, the backends it supports), or None for a config no auto class builds."""
    from transformers import AutoModelForCausalLM

    try:
        cls = AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:  # not an auto class's config: the build says what is wrong
        return None
    return cls.__name__, ["eager"] + [b for b, flag in SUPPORT_FLAGS.items() if getattr(cls, flag, False)]


def default_backend(model: str) -> str:
    """The backend transformers picks when none is named: sdpa where the model's class supports it, else eager.
    sdpa for a model that cannot be read (its own error comes with the suite)."""
    from cpbench.harness.suite.presets import get_preset

    try:
        found = supported_backends(get_preset(model).config({}))
    except (ValueError, OSError):
        return "sdpa"
    return "sdpa" if found is None or "sdpa" in found[1] else "eager"


def check_backends_supported(suite, config) -> None:
    """Each backend against what the model's class says it supports: transformers refuses the rest when the model
    is built, in every point's process; here the suite is refused first, naming the backends it does support."""
    found = supported_backends(config) if suite.level == "model" else None
    if found is not None:
        each(_supported, suite.attn_implementations, *found)


def _supported(b: str, model: str, usable: list) -> None:
    if b in SUPPORT_FLAGS and b not in usable:
        raise err("attn_implementations", b, f"{model} does not support it (transformers' {SUPPORT_FLAGS[b]}); use "
                  f"one of {usable}.")


def _registered() -> dict:
    """The attention styles this install has registered: name -> style."""
    from cpbench.cp import STYLES, AttentionStyle

    return {n: STYLES.get(n) for n in STYLES.names() if isinstance(STYLES.get(n), AttentionStyle)}


def check_style_names(suite) -> None:
    known = sorted(set(_registered()) | set(DOCUMENTED_STYLES))
    each(_style, suite.cp_styles, known)


def _style(style: str, known: list[str]) -> None:
    if style not in known:
        raise err("cp_styles", style, f"is not a CP attention style; use one of {known}.{near(style, known)}")


def check_cp_sizes(suite) -> None:
    each(_cp_size, suite.cp_sizes, suite)


def _cp_size(cp: int, suite) -> None:
    if cp < 1:
        raise err("cp_sizes", cp, "every cp size must be an integer >= 1.")
    degree = suite.cp_ulysses_degree
    if cp > 1 and "cp_usp" in suite.cp_styles and (degree < 1 or cp % degree):
        raise err("cp_ulysses_degree", degree, f"cp_usp splits each cp group into Ulysses groups of this many "
                  f"ranks, which must divide every cp size > 1 (cp_sizes has {cp}); pick a common divisor, or sweep "
                  "cp_usp in its own suite.")


def check_heads(suite, config) -> None:
    """Head counts the Ulysses styles shard over their groups."""
    heads, degree = config.num_attention_heads, suite.cp_ulysses_degree
    found = Collector()
    if any(cp > 1 for cp in suite.cp_sizes) and "cp_usp" in suite.cp_styles and degree >= 1 and heads % degree:
        found.errors.append(str(err("cp_ulysses_degree", degree, f"cp_usp shards the {heads} query heads of "
                                    f"{suite.model} over each Ulysses group: use a degree that divides {heads}.")))
    if "cp_ulysses" in suite.cp_styles:
        found.run(each, _ulysses_heads, [cp for cp in suite.cp_sizes if cp > 1], suite.model, heads)
    found.raise_any()


def _ulysses_heads(cp: int, model: str, heads: int) -> None:
    if heads % cp:
        raise err("cp_sizes", cp, f"cp_ulysses shards the {heads} query heads of {model} over the cp group, and {cp} "
                  f"does not divide {heads}. Use cp sizes that divide {heads}, or drop cp_ulysses from `cp_styles` "
                  "(the ring styles serve any head count).")


def check_style_backends(suite) -> None:
    """Every (style, backend) pair of the grid must be one the style serves (its registered `implementations`).
    Styles run only at cp > 1; unknown styles and backends are reported by their own checks."""
    if not any(cp > 1 for cp in suite.cp_sizes):
        return
    registered = _registered()
    found = Collector()
    for style in suite.cp_styles:
        served = registered[style].implementations if style in registered else None
        for b in suite.attn_implementations:
            if served is not None and b in BACKENDS and b not in served:
                found.errors.append(str(err(
                    "attn_implementations", b, f"{style} serves only {list(served)}; drop {b!r} from "
                    f"`attn_implementations`, drop {style!r} from `cp_styles`, or sweep them in separate suites.")))
    found.raise_any()


def check_world(suite) -> None:
    if suite.world_size is None:
        return
    if suite.world_size < 1:
        raise err("world_size", suite.world_size, "must be an integer >= 1 (the number of ranks).")
    if suite.dp_replicate_size < 1:  # reported by the counts' check
        return
    each(_fits_world, [cp for cp in suite.cp_sizes if cp >= 1], suite)


def _fits_world(cp: int, suite) -> None:
    group = cp * suite.dp_replicate_size
    if suite.world_size < group or suite.world_size % group:
        raise err("cp_sizes", cp, f"cp_size x dp_replicate_size = {group} does not divide world_size = "
                  f"{suite.world_size}. Use cp sizes that divide the world, or change world_size.")
    if suite.fsdp_size != 1 and suite.fsdp_size != suite.world_size // group:
        raise err("fsdp_size", suite.fsdp_size, f"conflicts with world_size = {suite.world_size}, which sets "
                  f"fsdp_size = world_size / (cp_size x dp_replicate_size) = {suite.world_size // group} at "
                  f"cp_size {cp}. Remove fsdp_size (or world_size).")
