"""Peers side by side at level = "attention" (one launch per world size, gloo): cpbench's three styles and
DeepSpeed-Ulysses on the same inputs, each row held to the unsharded op (its output and dq, dk, dv), with per-rank
peaks and step times; a peer that cannot run on CPU is `skipped` with why; the report gets its peers table."""

from __future__ import annotations

import importlib.util

import pytest

from cpbench.cli import main
from cpbench.report.runs import store
from cpbench.report.peers import peers_table

SUITE = """
name = "peers"
model = "attention-h8-d64"
level = "attention"
implementations = ["cpbench", "deepspeed", "torch_cp"]
seq_lens = [256]
cp_sizes = [1, 2]
cp_styles = ["cp_ulysses", "cp_ring", "cp_ring_zigzag"]
warmup_steps = 1
measured_steps = 2
parity = "full"
timeout_s = 120
"""
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("peers")
    (tmp / "s.toml").write_text(SUITE)
    rc = main(["sweep", str(tmp / "s.toml"), "--out", str(tmp), "--run-name", "r", "--no-progress"])
    return rc, store.read_run(tmp / "peers" / "r")


def test_every_implementation_that_runs_here_matches_the_unsharded_op(run):
    rc, df = run
    assert rc == 0
    ran = df[df["status"] == "ok"]
    expected = {("cpbench", "none"), ("cpbench", "cp_ulysses"), ("cpbench", "cp_ring"), ("cpbench", "cp_ring_zigzag")}
    if HAS_DEEPSPEED:
        expected.add(("deepspeed", "cp_ulysses"))
    assert set(zip(ran["implementation"], ran["cp_style"])) == expected
    assert (ran["level"] == "attention").all() and len(ran) == len(expected)
    assert (ran["parity_status"] == "pass").all(), ran[["point_id", "parity_detail"]]
    assert (ran["grad_worst_param"].isin(["dq", "dk", "dv"])).all()
    assert (ran["logits_max_err"] < ran["logits_atol"]).all()
    for _, row in ran[ran["cp_size"] == 2].iterrows():
        assert len(row["peak_bytes_per_rank"]) == 2 and min(row["peak_bytes_per_rank"]) > 0
        assert row["step_time_median_s"] > 0 and row["step_time_p10_s"] <= row["step_time_p90_s"]


def test_zigzag_keeps_less_per_rank_than_the_unsharded_op(run):
    """At cp 2 each rank holds half the sequence's q, k, v, output and gradients."""
    df = run[1].set_index(["seq_len", "implementation", "cp_style"])
    assert df.loc[(256, "cpbench", "cp_ring_zigzag"), "peak_bytes"] < df.loc[(256, "cpbench", "none"), "peak_bytes"]


def test_peers_that_cannot_run_here_are_skipped_with_why(run):
    df = run[1]
    torch_cp = df[df["implementation"] == "torch_cp"]
    assert set(torch_cp["cp_style"]) == {"cp_ring", "cp_ring_zigzag"}  # it has no Ulysses: no such point
    assert (torch_cp["status"] == "skipped").all()
    assert torch_cp["status_detail"].str.contains("runs on \\['cuda'\\]").all()
    if not HAS_DEEPSPEED:
        ds = df[df["implementation"] == "deepspeed"]
        assert (ds["status"] == "skipped").all() and ds["status_detail"].str.contains("cpbench\\[peers\\]").all()


def test_the_peers_table_divides_by_the_unsharded_time(run):
    df = run[1]
    table = peers_table(df)
    assert list(table.index) == [256]
    assert table.columns[0] == "unsharded (cp 1)" and table.loc[256, "unsharded (cp 1)"].startswith("1.000×")
    row = df[(df["seq_len"] == 256) & (df["cp_style"] == "cp_ring") & (df["implementation"] == "cpbench")].iloc[0]
    base = df[(df["seq_len"] == 256) & (df["cp_size"] == 1)].iloc[0]
    ratio = row["step_time_median_s"] / base["step_time_median_s"]
    assert table.loc[256, "cpbench · cp_ring · cp 2"].startswith(f"{ratio:.3f}×")
    assert table.loc[256, "torch_cp · cp_ring · cp 2"].startswith("skipped")
