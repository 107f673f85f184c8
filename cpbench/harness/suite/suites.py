"""Finding a suite: `default` (embedded, also shipped as suites/default-cpu.toml), or a TOML file."""

from __future__ import annotations

import tomllib
from pathlib import Path

from cpbench.harness.suite.presets import get_preset, plan_from_flag
from cpbench.harness.suite.spec import Suite, load_suite

DEFAULT = "default"

# The default CPU suite: cp 1/2 x eager/sdpa x the three styles x 2 lengths on a tiny Qwen3, 2 launches.
# Kept byte-identical to suites/default-cpu.toml (a test checks it).
DEFAULT_SUITE_TOML = """\
# The default CPU suite: what `python -m cpbench sweep` runs with no argument (<= 3 minutes on 2 cores).
# Two launches (world size 1, then 2); a style that is not registered yet is `skipped`, with why.
name = "default-cpu"
description = "tiny Qwen3 on CPU: cp 1/2 x eager/sdpa x cp_ulysses/cp_ring/cp_ring_zigzag x 2 lengths"
model = "tiny-qwen3"
seq_lens = [512, 2048]
cp_sizes = [1, 2]
attn_implementations = ["eager", "sdpa"]
cp_styles = ["cp_ulysses", "cp_ring", "cp_ring_zigzag"]
dtype = "float32"
device = "cpu"
batch_size = 1
batch_kind = "plain"
warmup_steps = 3
measured_steps = 6
parity = "full"
timeout_s = 120
seed = 0
"""


def resolve_suite(ref: str | Path | None, *, allow_faults: bool = False, cp_plan: str | None = None,
                  fields: dict | None = None) -> Suite:
    """The suite `ref` names; `cp_plan` (the `--cp-plan` flag: a JSON plan or a style name) replaces its plan, and
    `fields` (what other flags set) its fields, but `model_overrides`, which add to the file's."""
    if ref is None or str(ref) == DEFAULT:
        source, text = "default-cpu.toml", DEFAULT_SUITE_TOML
    else:
        source = Path(ref)
        if not source.exists():
            raise ValueError(
                f"suite {str(ref)!r} does not exist. Pass a suite file (e.g. suites/qwen3-0.6b-long.toml) or "
                f"'{DEFAULT}' for the default CPU suite."
            )
        text = source.read_text()
    overrides = dict(fields or {})
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        raw = {}  # load_suite says what is wrong with the file
    if "model_overrides" in overrides and isinstance(raw.get("model_overrides"), dict):
        overrides["model_overrides"] = {**raw["model_overrides"], **overrides["model_overrides"]}
    if cp_plan is not None and isinstance(raw.get("model"), str):
        overrides["cp_plan"] = plan_from_flag(cp_plan, get_preset(raw["model"]))
    return load_suite(source, text=text, allow_faults=allow_faults, overrides=overrides)


def suite_ref(ref: str | Path | None) -> str:
    """What a worker process is told: 'default' or an absolute path."""
    return DEFAULT if ref is None or str(ref) == DEFAULT else str(Path(ref).resolve())
