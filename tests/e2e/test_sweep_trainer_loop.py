"""`loop = "trainer"`: a point's tracked and timed steps driven by transformers' Trainer (measure/trainer_loop.py), a row
like any other. The same step as cpbench's own loop: parity is the first step's, and the memory is the same step's
(Trainer adds scalars: its token count, its loss accumulator). No test asserts a timing."""

from __future__ import annotations

from pathlib import Path

import pytest

from cpbench.cli import main
from cpbench.report.runs import store

SUITE = """
name = "{name}"
model = "tiny-qwen3"
seq_lens = [256]
cp_sizes = [2]
cp_styles = ["cp_ulysses"]
attn_implementations = ["sdpa"]
max_grad_norm = 1.0
loop = "{loop}"
warmup_steps = 2
measured_steps = 2
parity = "full"
timeout_s = 180
"""


def _sweep(tmp_path: Path, loop: str):
    suite = tmp_path / f"{loop}.toml"
    suite.write_text(SUITE.format(name=f"loop-{loop}", loop=loop))
    assert main(["sweep", str(suite), "--out", str(tmp_path / "results"), "--no-progress"]) == 0
    (run_dir,) = (tmp_path / "results" / f"loop-{loop}").glob("2*")
    (row,) = store.read_run(run_dir).to_dict("records")
    return row


@pytest.mark.heavy  # a launch of its own (about 25 s here): .ci/run
def test_a_trainer_driven_point_is_a_row(tmp_path):
    row = _sweep(tmp_path, "trainer")
    assert row["point_id"].endswith("/trainer-loop") and row["loop"] == "trainer"
    assert row["status"] == "ok" and row["parity_status"] == "pass", row["status_detail"]
    assert len(row["step_times_s"]) == 2 and all(t > 0 for t in row["step_times_s"])
    # the optimizer state that accelerate's wrapper re-made is counted, as in the own loop
    assert row["optimizer_bytes"] > 0 and row["peak_bytes"] > row["params_bytes"] + row["optimizer_bytes"]


@pytest.mark.heavy
def test_the_trainer_driven_step_holds_the_own_loops_memory(tmp_path):
    own, trainer = _sweep(tmp_path, "own"), _sweep(tmp_path, "trainer")
    assert own["point_key"] != trainer["point_key"]
    for column in ("params_bytes", "grads_bytes", "optimizer_bytes"):
        assert trainer[column] == own[column], column
    # Trainer's own tensors are scalars (its token count, its loss accumulator): well under 1 % of the step's peak
    assert abs(trainer["peak_bytes"] - own["peak_bytes"]) <= 0.01 * own["peak_bytes"]
