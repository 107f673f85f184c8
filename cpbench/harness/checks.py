"""Suite validation: everything that can be checked before a process is launched.

Each error names the field, the value and the fix. The allowed values live here, beside their checks.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from cpbench.report.units import parse_bytes

from .presets import check_overrides, get_preset

if TYPE_CHECKING:
    from .spec import Suite

BACKENDS = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3")
CUDA_ONLY_BACKENDS = ("flash_attention_2", "flash_attention_3")
# cpbench's documented attention styles. A documented style that this install has not registered yet is
# `skipped` (with why) rather than refused, so a suite can name a style before its implementation lands.
DOCUMENTED_STYLES = ("cp_ulysses", "cp_ring", "cp_ring_zigzag", "cp_usp")
DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("cpu", "cuda")
BATCH_KINDS = ("plain", "packed", "padded")
PARITY_MODES = ("auto", "full", "projected", "off")
REFERENCES = ("auto", "unsharded", "sharded")  # where the parity reference runs (see `Suite.reference`)
LEVELS = ("model", "attention")  # what a point runs: the model's training step, or one attention op (attention_level.py)
LOSSES = ("full", "chunked", "liger")  # cpbench.cp.chunked_loss.LOSSES
FAULTS = ("crash", "oom", "hang", "reference_crash")  # injected by cpbench's own tests only (see `Suite.faults`)
NO_STYLE = "none"


def err(field_name: str, value, fix: str) -> ValueError:
    return ValueError(f"suite field `{field_name}` = {value!r}: {fix}")


class SuiteErrors(ValueError):
    """Every error of a suite at once: one line each (field, value, fix)."""

    def __init__(self, source, errors: list[str]):
        self.errors = errors
        lines = errors if len(errors) > 1 else []
        head = f"{source}: {len(errors)} errors:" if len(errors) > 1 else f"{source}: {errors[0]}"
        super().__init__("\n".join([head, *(f"  - {e}" for e in lines)]))


class Collector:
    """Runs checks and keeps their errors instead of stopping at the first."""

    def __init__(self):
        self.errors: list[str] = []

    def run(self, check, *args):
        try:
            return check(*args)
        except ValueError as e:
            self.errors.extend(e.errors if isinstance(e, SuiteErrors) else [str(e)])
            return None


def validate(suite: Suite, *, allow_faults: bool = False, source: str = "suite") -> None:
    """Raises SuiteErrors listing every error found. Checks that need a sound value (the model config for the
    lengths and heads) run only once the fields they read passed."""
    found = Collector()
    for name in _SCALARS:
        found.run(_check_scalar, suite, name)
    for name in _LISTS:
        found.run(_check_list, suite, name)
    if found.errors:  # a wrong type would make the checks below crash or mislead
        raise SuiteErrors(source, found.errors)
    found.run(_check_name, suite)
    preset = found.run(get_preset, suite.model)
    if preset is not None:
        found.run(check_overrides, preset, suite.model_overrides)
    for name, choices in (("device", DEVICES), ("dtype", DTYPES), ("batch_kind", BATCH_KINDS),
                          ("parity", PARITY_MODES), ("loss", LOSSES), ("reference", REFERENCES),
                          ("level", LEVELS)):
        found.run(_check_choice, name, getattr(suite, name), choices)
    for check in (_check_counts, _check_backends, _check_world, _check_budget, _check_mixed_precision,
                  _check_implementations):
        found.run(check, suite)
    found.run(_check_faults, suite, allow_faults)
    config = found.run(preset.config, suite.model_overrides) if preset is not None and not found.errors else None
    if config is not None:
        found.run(_check_lengths, suite, config)
        found.run(_check_styles, suite, config)
    if found.errors:
        raise SuiteErrors(source, found.errors)


def _check_implementations(suite: Suite) -> None:
    """Peers run the attention op alone; the model-level settings mean nothing to it."""
    from .peers import CPBENCH, PEERS

    for name in suite.implementations:
        _check_choice("implementations", name, sorted(PEERS))
        if name != CPBENCH and suite.level != "attention":
            raise err("implementations", name, "peers run at level = \"attention\" (the attention op alone, forward "
                      "+ backward): set level = \"attention\", or keep implementations = [\"cpbench\"].")
    if suite.level == "attention":
        model_only = {"batch_kind": ("plain", suite.batch_kind), "loss": ("full", suite.loss),
                      "activation_checkpointing": (False, suite.activation_checkpointing),
                      "mixed_precision": (False, suite.mixed_precision), "keep_outputs": (False, suite.keep_outputs),
                      "fsdp_size": (1, suite.fsdp_size), "dp_replicate_size": (1, suite.dp_replicate_size)}
        for name, (default, value) in model_only.items():
            if value != default:
                raise err(name, value, f"is a model-level setting; level = \"attention\" runs one causal attention op "
                          f"on plain sequences: drop it (or set {name} = {default!r}).")
        if suite.world_size is not None:
            raise err("world_size", suite.world_size, "level = \"attention\" runs on cp_size ranks: drop world_size.")


def _check_mixed_precision(suite: Suite) -> None:
    if suite.mixed_precision and suite.dtype != "bfloat16":
        raise err("mixed_precision", True, f"FSDP2's mixed precision computes in bfloat16 over fp32 master weights, "
                  f"but dtype = {suite.dtype!r}: set dtype = \"bfloat16\", or mixed_precision = false.")


def _check_name(suite: Suite) -> None:
    if not re.fullmatch(r"[A-Za-z0-9._-]+", suite.name):
        raise err("name", suite.name, "use letters, digits, '.', '_' or '-' (it names a results folder).")


def _check_counts(suite: Suite) -> None:
    found = Collector()
    for name in ("batch_size", "measured_steps", "fsdp_size", "dp_replicate_size", "seed"):
        minimum = 0 if name == "seed" else 1
        if getattr(suite, name) < minimum:
            found.errors.append(str(err(name, getattr(suite, name), f"must be an integer >= {minimum}.")))
    if suite.warmup_steps < 1:
        found.errors.append(str(err("warmup_steps", suite.warmup_steps, "must be >= 1: memory is measured over the "
                                    "warmup steps (the only tracked steps with the optimizer state allocated); 3 "
                                    "lets the smallest of their peaks drop the noise of buffers freed late (see "
                                    "README).")))
    if suite.timeout_s <= 0:
        found.errors.append(str(err("timeout_s", suite.timeout_s, "must be a positive number of seconds.")))
    if found.errors:
        raise SuiteErrors("suite", found.errors)


def _check_budget(suite: Suite) -> None:
    if suite.memory_budget is not None:
        parse_bytes(suite.memory_budget, field_name="memory_budget")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # TOML `true` is not a count


_SCALARS = {  # field -> (check, what to write)
    "name": (lambda v: isinstance(v, str), 'a string, e.g. name = "my-suite"'),
    "model": (lambda v: isinstance(v, str), 'a preset name string, e.g. model = "tiny-qwen3"'),
    "description": (lambda v: isinstance(v, str), "a string"),
    "model_overrides": (lambda v: isinstance(v, dict), "a table, e.g. model_overrides = {num_hidden_layers = 4}"),
    "world_size": (lambda v: v is None or _is_int(v), "an integer (not a string or boolean), e.g. world_size = 8"),
    "fsdp_size": (_is_int, "an integer, e.g. fsdp_size = 2"),
    "dp_replicate_size": (_is_int, "an integer, e.g. dp_replicate_size = 1"),
    "dtype": (lambda v: isinstance(v, str), 'a string, e.g. dtype = "bfloat16"'),
    "device": (lambda v: isinstance(v, str), 'a string, e.g. device = "cuda"'),
    "batch_size": (_is_int, "an integer (not a boolean), e.g. batch_size = 1"),
    "batch_kind": (lambda v: isinstance(v, str), 'a string, e.g. batch_kind = "plain"'),
    "warmup_steps": (_is_int, "an integer, e.g. warmup_steps = 1"),
    "measured_steps": (_is_int, "an integer, e.g. measured_steps = 6"),
    "keep_outputs": (lambda v: isinstance(v, bool), "true or false"),
    "loss": (lambda v: isinstance(v, str), 'a string, e.g. loss = "chunked"'),
    "activation_checkpointing": (lambda v: isinstance(v, bool), "true or false"),
    "mixed_precision": (lambda v: isinstance(v, bool), "true or false"),
    "parity": (lambda v: isinstance(v, str), 'a string, e.g. parity = "auto"'),
    "reference": (lambda v: isinstance(v, str), 'a string, e.g. reference = "sharded"'),
    "timeout_s": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number of seconds"),
    "seed": (_is_int, "an integer, e.g. seed = 0"),
    "memory_budget": (lambda v: v is None or isinstance(v, str) or _is_int(v), 'a size, e.g. "80GiB"'),
    "faults": (lambda v: isinstance(v, dict), "a table of point-id glob = fault"),
    "level": (lambda v: isinstance(v, str), 'a string, e.g. level = "attention"'),
    "cp_ulysses_degree": (_is_int, "an integer, e.g. cp_ulysses_degree = 2"),
}
_LISTS = {"seq_lens": _is_int, "cp_sizes": _is_int, "attn_implementations": lambda v: isinstance(v, str),
          "cp_styles": lambda v: isinstance(v, str), "implementations": lambda v: isinstance(v, str)}


def _check_scalar(suite: Suite, name: str) -> None:
    ok, what = _SCALARS[name]
    if not ok(getattr(suite, name)):
        raise err(name, getattr(suite, name), f"must be {what}.")


def _check_list(suite: Suite, name: str) -> None:
    ok, values = _LISTS[name], getattr(suite, name)
    if not isinstance(values, (list, tuple)) or not values or not all(ok(v) for v in values):
        kind = "integers" if ok is _is_int else "strings"
        raise err(name, values, f"must be a non-empty list of {kind}.")


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise err(name, value, f"use one of {list(choices)}.")


def _check_lengths(suite: Suite, config) -> None:
    for s in suite.seq_lens:
        if s < 2:
            raise err("seq_lens", list(suite.seq_lens), "every length must be an integer >= 2 (tokens).")
        if s > config.max_position_embeddings:
            raise err(
                "seq_lens", s, f"exceeds the model's max_position_embeddings={config.max_position_embeddings}; "
                "drop it or raise it with model_overrides = {max_position_embeddings = ...}.",
            )


def _check_backends(suite: Suite) -> None:
    for b in suite.attn_implementations:
        _check_choice("attn_implementations", b, BACKENDS)
        if b in CUDA_ONLY_BACKENDS and suite.device != "cuda":
            raise err("attn_implementations", b, "needs device = \"cuda\"; use eager or sdpa on CPU.")
        if b in CUDA_ONLY_BACKENDS and suite.dtype == "float32":
            raise err("attn_implementations", b, f"FlashAttention has no float32 kernels (dtype = "
                       f"{suite.dtype!r}); set dtype = \"bfloat16\" or \"float16\", or use sdpa.")


def _check_styles(suite: Suite, config) -> None:
    from cpbench.cp import STYLES, AttentionStyle

    registered = [n for n in STYLES.names() if isinstance(STYLES.get(n), AttentionStyle)]
    for style in suite.cp_styles:
        if style not in registered and style not in DOCUMENTED_STYLES:
            known = sorted(set(registered) | set(DOCUMENTED_STYLES))
            raise err("cp_styles", style, f"is not a CP attention style; use one of {known}.")
    heads = config.num_attention_heads
    for cp in suite.cp_sizes:
        if cp < 1:
            raise err("cp_sizes", cp, "every cp size must be an integer >= 1.")
        if cp > 1 and "cp_usp" in suite.cp_styles and (cp % suite.cp_ulysses_degree or suite.cp_ulysses_degree < 1):
            raise err("cp_ulysses_degree", suite.cp_ulysses_degree, f"cp_usp splits each cp group into Ulysses "
                      f"groups of this many ranks, which must divide every cp size > 1 (cp_sizes has {cp}); pick a "
                      "common divisor, or sweep cp_usp in its own suite.")
        if cp > 1 and "cp_usp" in suite.cp_styles and heads % suite.cp_ulysses_degree:
            raise err("cp_ulysses_degree", suite.cp_ulysses_degree, f"cp_usp shards the {heads} query heads of "
                      f"{suite.model} over each Ulysses group: use a degree that divides {heads}.")
        if cp > 1 and "cp_ulysses" in suite.cp_styles and heads % cp:
            raise err(
                "cp_sizes", cp, f"cp_ulysses shards the {heads} query heads of {suite.model} over the cp group, "
                f"and {cp} does not divide {heads}. Use cp sizes that divide {heads}, or drop cp_ulysses from "
                "`cp_styles` (the ring styles serve any head count).",
            )
    if max(suite.cp_sizes) > 1:  # styles only run at cp > 1
        _check_style_backends(suite, STYLES, registered)


def _check_style_backends(suite: Suite, styles, registered: list[str]) -> None:
    """Every (style, backend) pair of the grid must be one the style serves (its registered `implementations`)."""
    for style in suite.cp_styles:
        served = styles.get(style).implementations if style in registered else None
        for b in suite.attn_implementations:
            if served is not None and b not in served:
                raise err(
                    "attn_implementations", b, f"{style} serves only {list(served)}; drop {b!r} from "
                    f"`attn_implementations`, drop {style!r} from `cp_styles`, or sweep them in separate suites.",
                )


def _check_world(suite: Suite) -> None:
    if suite.world_size is None:
        return
    if suite.world_size < 1:
        raise err("world_size", suite.world_size, "must be an integer >= 1 (the number of ranks).")
    for cp in suite.cp_sizes:
        group = cp * suite.dp_replicate_size
        if suite.world_size < group or suite.world_size % group:
            raise err(
                "cp_sizes", cp, f"cp_size x dp_replicate_size = {group} does not divide "
                f"world_size = {suite.world_size}. Use cp sizes that divide the world, or change world_size.",
            )
        if suite.fsdp_size != 1 and suite.fsdp_size != suite.world_size // group:
            raise err(
                "fsdp_size", suite.fsdp_size, f"conflicts with world_size = {suite.world_size}, which sets "
                f"fsdp_size = world_size / (cp_size x dp_replicate_size) = {suite.world_size // group} at "
                f"cp_size {cp}. Remove fsdp_size (or world_size).",
            )


def _check_faults(suite: Suite, allow_faults: bool) -> None:
    if not suite.faults:
        return
    if not allow_faults:
        raise err(
            "faults", suite.faults, "fault injection is for cpbench's own tests; remove the table, or pass "
            "--allow-faults to `cpbench sweep` if you mean it.",
        )
    for pattern, fault in suite.faults.items():
        if isinstance(fault, dict):
            unknown = sorted(set(fault) - {"fault", "timeout_s"})
            timeout = fault.get("timeout_s", 1.0)
            if unknown or not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
                raise err(f"faults[{pattern!r}]", fault, 'write {fault = "hang", timeout_s = 10} (a positive '
                           "number of seconds), or just the fault's name.")
            fault = fault.get("fault")
        _check_choice(f"faults[{pattern!r}]", fault, FAULTS)
