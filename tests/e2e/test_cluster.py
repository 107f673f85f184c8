"""`cpbench sweep --launcher submitit-local --nodes 2 --gpus-per-node 1`: each world size's points as one submitit
job whose tasks stand for nodes, every task running torch's launcher with a c10d rendezvous on localhost
(`--nnodes 2 --rdzv-backend c10d`): the cp 2 points run as two "nodes" of one rank. The rows must be the ones a
local sweep writes (statuses, parity, every rank's peak and collectives, byte for byte on CPU); a resumed run
submits nothing; an injected crash is an `error` row with the failing rank's message, as locally.

Five tracked steps, not three: a step's tracked peak is the smallest of its repeats (probes.py: gloo's worker thread
can keep a finished collective's buffer counted a moment longer, +80-128 KiB), and with three repeats a rare run had
all three inflated, or inflated more each time (the "grew" rule then counts the last): seen once in this project's
CI runs, 1,381,416 against 1,463,336 B. Five make both far rarer."""

from __future__ import annotations

import pytest

from cpbench.cli import main
from cpbench.report.runs import store

pytest.importorskip("submitit")
# ~27 s of the README's test command: opt-in (-m heavy), run by .ci/run, to keep that command under 12 minutes
pytestmark = pytest.mark.heavy

SUITE = """
name = "cluster"
model = "tiny-qwen3"
seq_lens = [64]
cp_sizes = [2]
attn_implementations = ["sdpa"]
cp_styles = ["cp_ring_zigzag", "cp_ulysses"]
warmup_steps = 5
measured_steps = 2
parity = "full"
timeout_s = 120

[faults]
"tiny-qwen3/s64/cp2/sdpa/cp_ulysses" = "crash"
"""
SAME = ["status", "parity_status", "peak_bytes", "peak_bytes_per_rank", "comm_all_to_all_count",
        "comm_p2p_count", "comm_p2p_bytes", "loss", "ref_loss"]


def _sweep(tmp, run, *extra):
    return main(["sweep", str(tmp / "s.toml"), "--out", str(tmp), "--run-name", run, "--allow-faults",
                 "--no-progress", *extra])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cluster")
    (tmp / "s.toml").write_text(SUITE)
    local_rc = _sweep(tmp, "local")
    cluster_rc = _sweep(tmp, "job", "--launcher", "submitit-local", "--nodes", "2", "--gpus-per-node", "1")
    read = lambda run: store.read_run(tmp / "cluster" / run).set_index("point_id").sort_index()  # noqa: E731
    return tmp, (local_rc, read("local")), (cluster_rc, read("job"))


def test_a_cluster_job_writes_the_rows_a_local_sweep_writes(runs):
    _, (local_rc, local), (cluster_rc, job) = runs
    assert local_rc == cluster_rc == 1  # the injected crash fails both runs alike
    assert list(job.index) == list(local.index) and len(job) == 2
    ok = local["status"] == "ok"
    assert ok.sum() == 1 and (local.loc[ok, "parity_status"] == "pass").all()
    for column in SAME:
        for pid in local.index[ok]:
            a, b = local.loc[pid, column], job.loc[pid, column]
            assert (a == b) if not hasattr(a, "__len__") else list(a) == list(b), (pid, column, a, b)


def test_the_crash_is_the_same_error_row(runs):
    _, (_, local), (_, job) = runs
    pid = "tiny-qwen3/s64/cp2/sdpa/cp_ulysses"
    for df in (local, job):
        assert df.loc[pid, "status"] == "error"
        assert df.loc[pid, "status_detail"].startswith("rank 1: RuntimeError: injected crash")


def test_the_cp2_points_ran_as_two_nodes(runs):
    tmp, *_ = runs
    logs = "".join(p.read_text() for p in (tmp / "cluster" / "job" / "logs").glob("launch-*.log"))
    assert "global_rank=1(2)" in logs  # submitit's second task: the second "node"


def test_a_resumed_cluster_run_submits_nothing(runs):
    tmp, _, (_, job) = runs
    before = sorted((tmp / "cluster" / "job" / "records").glob("launch-*"))
    _sweep(tmp, "job", "--resume", "--launcher", "submitit-local", "--nodes", "2", "--gpus-per-node", "1")
    assert sorted((tmp / "cluster" / "job" / "records").glob("launch-*")) == before
    assert len(store.read_run(tmp / "cluster" / "job")) == len(job)


def test_a_world_size_that_does_not_fit_the_nodes_is_refused_before_submitting(runs, capsys):
    tmp, *_ = runs
    capsys.readouterr()
    rc = _sweep(tmp, "refused", "--launcher", "submitit-local", "--nodes", "1", "--gpus-per-node", "1")
    assert rc == 2 and "world size 2 does not fit --nodes 1 x --gpus-per-node 1" in capsys.readouterr().err
    assert not (tmp / "cluster" / "refused" / "records").exists()
