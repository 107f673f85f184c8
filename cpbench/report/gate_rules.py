"""The gate's rules per metric, read from a committed TOML file (results/baselines/gate-rules.toml).

    [metrics.peak_bytes]
    direction = "lower"      # which way is better: "lower" or "higher"
    threshold = 0.0          # relative change allowed in the worse direction (0.2 = 20 %)
    abs_threshold = 0        # changes smaller than this (in the column's base unit) never fail
    improvement = 0.05       # a change this large the better way is reported as an improvement
    action = "fail"          # "fail" (exit 1) or "warn" (listed, exit 0)

List columns (step_times_s) are judged statistically and also take
    test = "mannwhitney"     # or "bootstrap" (CI on the median ratio) or "median" (ratio of medians only)
    alpha = 0.01             # significance: a slow-down must be this unlikely to be noise
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from .runs.schema import COLUMNS

DIRECTIONS = ("lower", "higher")
ACTIONS = ("fail", "warn")
TESTS = ("mannwhitney", "bootstrap", "median")
_KEYS = {"direction", "threshold", "abs_threshold", "improvement", "action", "test", "alpha", "bootstrap_resamples"}


@dataclass(frozen=True, kw_only=True)
class Rule:
    metric: str
    direction: str = "lower"
    threshold: float = 0.0
    abs_threshold: float = 0.0
    improvement: float = 0.0
    action: str = "fail"
    test: str | None = None
    alpha: float = 0.01
    bootstrap_resamples: int = 2000

    def __post_init__(self) -> None:
        where = f"[metrics.{self.metric}]"
        if self.metric not in COLUMNS:
            raise ValueError(f"{where}: '{self.metric}' is not a column of the results schema; use one of the "
                             f"numeric columns in cpbench/report/schema.py (e.g. peak_bytes, step_times_s)")
        _one_of(where, "direction", self.direction, DIRECTIONS)
        _one_of(where, "action", self.action, ACTIONS)
        for name in ("threshold", "abs_threshold", "improvement"):
            if not isinstance(getattr(self, name), (int, float)) or getattr(self, name) < 0:
                raise ValueError(f"{where} {name} = {getattr(self, name)!r}: must be a number >= 0 (0.1 means 10 %)")
        if not 0 < self.alpha < 1:
            raise ValueError(f"{where} alpha = {self.alpha!r}: must be in (0, 1), e.g. 0.01")
        is_list = pa.types.is_list(COLUMNS[self.metric][0])
        if is_list and self.test is None:
            raise ValueError(f"{where}: '{self.metric}' holds samples; set test = \"mannwhitney\", \"bootstrap\" or \"median\"")
        if is_list:
            _one_of(where, "test", self.test, TESTS)
        elif self.test is not None:
            raise ValueError(f"{where} test = {self.test!r}: '{self.metric}' is one number per point; remove `test` "
                             f"(statistical tests apply to sample columns such as step_times_s)")

    @property
    def samples(self) -> bool:
        return self.test is not None


def _one_of(where: str, field: str, value, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{where} {field} = {value!r}: must be one of {', '.join(repr(a) for a in allowed)}")


def parse_rules(text: str, source: str = "rules") -> list[Rule]:
    data = tomllib.loads(text)
    unknown = set(data) - {"metrics"}
    if unknown:
        raise ValueError(f"{source}: unknown tables {sorted(unknown)}; rules live under [metrics.<column>]")
    metrics = data.get("metrics", {})
    if not metrics:
        raise ValueError(f"{source}: no [metrics.<column>] tables; add at least one rule (e.g. [metrics.peak_bytes])")
    rules = []
    for metric, fields in metrics.items():
        extra = set(fields) - _KEYS
        if extra:
            raise ValueError(f"{source} [metrics.{metric}]: unknown keys {sorted(extra)}; known: {sorted(_KEYS)}")
        rules.append(Rule(metric=metric, **fields))
    return rules


def load_rules(path: str | Path) -> list[Rule]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"rules: no gate rules at '{path}'; pass --rules FILE "
                                f"(see results/baselines/gate-rules.toml for the format)")
    return parse_rules(path.read_text(), str(path))


DEFAULT_RULES = Path(__file__).with_name("default-gate-rules.toml")  # shipped; kept equal to results/baselines'


def rules_path(explicit: str | Path | None, baseline: Path) -> Path:
    """`--rules`, else gate-rules.toml beside the baseline, else the rules shipped with cpbench."""
    if explicit:
        return Path(explicit)
    beside = baseline.with_name("gate-rules.toml")
    return beside if beside.exists() else DEFAULT_RULES
