"""The sharded parity reference (`reference = "sharded"`): for models larger than one device, the reference step
runs on every rank of the point — FSDP over all of them, no CP, every layer recomputed — instead of unsharded on
rank 0. One sweep (one launch per point, gloo): a point whose verdict comes from it, and a point whose reference
fails on one rank (an injected out-of-memory error) and keeps its measurements, its parity saying why."""

from __future__ import annotations

import pytest

from cpbench.cli import main
from cpbench.report.runs import store

SUITE = """
name = "sharded-ref"
model = "tiny-qwen3"
seq_lens = [128, 256]
cp_sizes = [2]
attn_implementations = ["sdpa"]
cp_styles = ["cp_ring_zigzag"]
batch_kind = "packed"
warmup_steps = 1
measured_steps = 1
parity = "full"
reference = "sharded"
timeout_s = 120

[faults]
"tiny-qwen3/s256/*" = "reference_crash"
"""


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sharded")
    (tmp / "s.toml").write_text(SUITE)
    rc = main(["sweep", str(tmp / "s.toml"), "--out", str(tmp), "--run-name", "r", "--allow-faults", "--no-progress"])
    df = store.read_run(tmp / "sharded-ref" / "r").set_index("seq_len")
    return rc, df


def test_the_sharded_reference_gives_the_verdict(rows):
    _, df = rows
    r = df.loc[128]
    assert r["status"] == "ok" and r["parity_reference"] == "sharded"
    assert r["parity_status"] == "pass", r["parity_detail"]
    assert r["loss_rel_err"] <= r["loss_rtol"] and 0 < r["grad_max_rel_err"] <= r["grad_rtol"]


def test_a_failed_reference_keeps_the_measurements(rows):
    _, df = rows
    r = df.loc[256]
    assert r["status"] == "ok" and r["peak_bytes"] > 0 and len(r["step_times_s"]) == 1
    assert r["parity_status"] == "reference_oom", r["parity_detail"]
    assert "injected reference_crash" in r["parity_detail"]
