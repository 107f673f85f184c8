"""Suite validation: everything that can be checked before a process is launched.

Each error names the field, the value and the fix, and every error of a suite is reported at once
(suite_errors.py); the grid's checks (lengths, cp sizes, backends, styles) are in grid_checks.py.
Each check takes the `spec.Suite` being validated (spec imports this module, so the type is not imported here).
"""

from __future__ import annotations

import math
import re
from dataclasses import MISSING, replace
from dataclasses import fields as dataclass_fields

from cpbench.harness.suite import documents, grid_checks, levers
from cpbench.harness.suite.choices import BATCH_KINDS, DEVICES, DTYPES, LEVELS, LOSSES, PARITY_MODES, REFERENCES
from cpbench.harness.suite.grid_checks import BACKENDS, CUDA_ONLY_BACKENDS, DOCUMENTED_STYLES  # noqa: F401 - the allowed values
from cpbench.harness.suite.presets import check_has_plan, check_overrides, get_preset
from cpbench.harness.suite.suite_errors import Collector, SuiteErrors, each, err, near  # noqa: F401 - spec and tests import them from here
from cpbench.report.units import parse_bytes

# The grid's allowed values live with the grid's checks (grid_checks.py); the enumerated fields' in choices.py (which
# the command line reads before importing torch); the faults' here, beside their check.
FAULTS = ("crash", "oom", "hang", "kill", "reference_crash")  # injected by cpbench's own tests only (see `Suite.faults`)
NO_STYLE = "none"


def validate(suite, *, allow_faults: bool = False, source: str = "suite") -> None:
    """Raises SuiteErrors listing every error found. Every field is checked on its own, so an error in one never
    hides one in another: a field of the wrong type is reported, and the other checks then run with the field's
    default in its place and say nothing more of it (only a wrong `model` or `seq_lens`, which have no default, stops
    them). The checks that read the model's config run only when the model and its overrides are sound."""
    found = Collector()
    wrong = [name for name in _SCALARS if not found.passes(_check_scalar, suite, name)]
    wrong += [name for name in _LISTS if not found.passes(_check_list, suite, name)]
    if {"model", "seq_lens"} & set(wrong):
        found.raise_any(source)
    typed = list(found.errors)
    defaults = {f.name: f.default if f.default is not MISSING else f.default_factory()
                if f.default_factory is not MISSING else "suite"  # `name`, the one other field without a default
                for f in dataclass_fields(suite) if f.name in wrong}
    _check_typed(found, replace(suite, **defaults), allow_faults)
    found.errors = typed + [e for e in found.errors[len(typed):] if not _names_any(e, wrong)]
    found.raise_any(source)


def _names_any(error: str, names: list[str]) -> bool:
    return any(f"`{n}`" in error or f"{n} =" in error for n in names)


def _check_typed(found: Collector, suite, allow_faults: bool) -> None:
    """Every check of a suite whose fields have their types."""
    found.run(_check_name, suite)
    config = _model_config(found, suite)
    for name, choices in (("device", DEVICES), ("dtype", DTYPES), ("batch_kind", BATCH_KINDS),
                          ("parity", PARITY_MODES), ("loss", LOSSES), ("reference", REFERENCES),
                          ("level", LEVELS)):
        found.run(_check_choice, name, getattr(suite, name), choices)
    for check in (_check_counts, grid_checks.check_lengths, grid_checks.check_cp_sizes, grid_checks.check_backends,
                  grid_checks.check_style_names, grid_checks.check_style_backends, grid_checks.check_world,
                  _check_budget, _check_mixed_precision, _check_implementations, levers.check_levers,
                  levers.check_offload_world, documents.check):
        found.run(check, suite)
    found.run(_check_faults, suite, allow_faults)
    if config is not None:
        found.run(grid_checks.check_lengths_fit, suite, config)
        found.run(grid_checks.check_heads, suite, config)
        found.run(grid_checks.check_backends_supported, suite, config)
        found.run(levers.check_norm, suite, config)


def _model_config(found: Collector, suite):
    """The model's config, or None (its error recorded) when the preset or its overrides are wrong."""
    preset = found.run(get_preset, suite.model)
    if preset is None or not found.passes(check_overrides, preset, suite.model_overrides):
        return None
    found.run(check_has_plan, preset, suite.cp_plan, suite.cp_sizes)
    found.run(_check_plan_styles, suite.cp_plan)
    return found.run(preset.config, suite.model_overrides)


def _check_implementations(suite) -> None:
    """Peers run the attention op alone; the model-level settings mean nothing to it."""
    found = Collector()
    found.run(each, _implementation, suite.implementations, suite.level)
    if suite.level == "attention":
        model_only = {"batch_kind": ("plain", suite.batch_kind), "loss": ("full", suite.loss),
                      "activation_checkpointing": (False, suite.activation_checkpointing),
                      "offload_params": (False, suite.offload_params), "tiled_mlp": (False, suite.tiled_mlp),
                      "norm": ("eager", suite.norm), "optimizer": ("foreach", suite.optimizer),
                      "max_grad_norm": (0.0, suite.max_grad_norm), "loop": ("own", suite.loop),
                      "mixed_precision": (False, suite.mixed_precision), "keep_outputs": (False, suite.keep_outputs),
                      "fsdp_size": (1, suite.fsdp_size), "dp_replicate_size": (1, suite.dp_replicate_size)}
        for name, (default, value) in model_only.items():
            if value != default:
                found.errors.append(str(err(name, value, f"is a model-level setting; level = \"attention\" runs one "
                                            f"causal attention op on plain sequences: drop it (or set {name} = "
                                            f"{default!r}).")))
        if suite.world_size is not None:
            found.errors.append(str(err("world_size", suite.world_size, "level = \"attention\" runs on cp_size ranks: "
                                        "drop world_size.")))
    found.raise_any()


def _implementation(name: str, level: str) -> None:
    from cpbench.harness.peers.registry import CPBENCH, PEERS

    _check_choice("implementations", name, sorted(PEERS))
    if name != CPBENCH and level != "attention":
        raise err("implementations", name, "peers run at level = \"attention\" (the attention op alone, forward "
                  "+ backward): set level = \"attention\", or keep implementations = [\"cpbench\"].")


def _check_mixed_precision(suite) -> None:
    if suite.mixed_precision and suite.dtype != "bfloat16":
        raise err("mixed_precision", True, f"FSDP2's mixed precision computes in bfloat16 over fp32 master weights, "
                  f"but dtype = {suite.dtype!r}: set dtype = \"bfloat16\", or mixed_precision = false.")


def _check_name(suite) -> None:
    if not re.fullmatch(r"[A-Za-z0-9._-]+", suite.name):
        raise err("name", suite.name, "use letters, digits, '.', '_' or '-' (it names a results folder).")


def _check_counts(suite) -> None:
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
    found.raise_any()


def _check_budget(suite) -> None:
    if suite.memory_budget is not None:
        parse_bytes(suite.memory_budget, field_name="memory_budget")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # TOML `true` is not a count


_SCALARS = {  # field -> (check, what to write)
    "name": (lambda v: isinstance(v, str), 'a string, e.g. name = "my-suite"'),
    "model": (lambda v: isinstance(v, str), 'a preset name string, e.g. model = "tiny-qwen3"'),
    "description": (lambda v: isinstance(v, str), "a string"),
    "model_overrides": (lambda v: isinstance(v, dict), "a table, e.g. model_overrides = {num_hidden_layers = 4}"),
    "cp_plan": (lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in (*v, *v.values())),
                'a table of module pattern = style name, e.g. cp_plan = {"model.layers.*" = "cp_split_sequence", '
                '"model.layers.*.self_attn" = "cp_ulysses"}'),
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
    "norm": (lambda v: isinstance(v, str), 'a string, e.g. norm = "fused"'),
    "optimizer": (lambda v: isinstance(v, str), 'a string, e.g. optimizer = "fused"'),
    "loop": (lambda v: isinstance(v, str), 'a string, e.g. loop = "trainer"'),
    "max_grad_norm": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                      and v >= 0, "a finite number >= 0, e.g. max_grad_norm = 1.0 (0: no clipping)"),
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


def _check_plan_styles(plan: dict) -> None:
    from cpbench.cp.styles import STYLES

    unknown = {k: v for k, v in plan.items() if v not in STYLES.names()}
    if unknown:
        raise err("cp_plan", plan, f"styles {sorted(set(unknown.values()))} are not registered; use "
                                   f"{STYLES.names()}.")
    if plan and "cp_split_sequence" not in plan.values():
        raise err("cp_plan", plan, 'needs a sequence split, e.g. "model.layers.*" = "cp_split_sequence".')


def _check_scalar(suite, name: str) -> None:
    ok, what = _SCALARS[name]
    if not ok(getattr(suite, name)):
        raise err(name, getattr(suite, name), f"must be {what}.")


def _check_list(suite, name: str) -> None:
    ok, values = _LISTS[name], getattr(suite, name)
    if not isinstance(values, (list, tuple)) or not values or not all(ok(v) for v in values):
        kind = "integers" if ok is _is_int else "strings"
        raise err(name, values, f"must be a non-empty list of {kind}.")


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise err(name, value, f"use one of {list(choices)}.{near(value, choices)}")


def _check_faults(suite, allow_faults: bool) -> None:
    if not suite.faults:
        return
    if not allow_faults:
        raise err(
            "faults", suite.faults, "fault injection is for cpbench's own tests; remove the table, or pass "
            "--allow-faults to `cpbench sweep` if you mean it.",
        )
    each(_fault, suite.faults.items())


def _fault(item) -> None:
    pattern, fault = item
    if isinstance(fault, dict):
        unknown = sorted(set(fault) - {"fault", "timeout_s"})
        timeout = fault.get("timeout_s", 1.0)
        if unknown or not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
            raise err(f"faults[{pattern!r}]", fault, 'write {fault = "hang", timeout_s = 10} (a positive '
                      "number of seconds), or just the fault's name.")
        fault = fault.get("fault")
    _check_choice(f"faults[{pattern!r}]", fault, FAULTS)
