"""`cpbench plan` and `cpbench calibrate` end to end on a tiny model: the search (fits, ranking, pruning, runnable
suites), and a calibration from a measured run that an estimate then prices with."""

from __future__ import annotations

import re

import pyarrow as pa
import pytest

from cpbench.cli import main
from cpbench.harness.project.plan import RUNGS, PlanOptions, Search, floor_bytes
from cpbench.harness.suite.presets import get_preset
from cpbench.harness.suite.spec import load_suite
from cpbench.report.runs import store

# Between the projected peak of tiny-llama at 8192 tokens on cp 2 (~37 MB) and on cp 1 (~71 MB): cp 1 needs a lever.
# Two GPUs: cp 2 (Ulysses, the zigzag ring) and cp 1; USP needs more ranks than its Ulysses degree.
CAPACITY = 50_000_000


def _plan(tmp, capsys):
    rc = main(["plan", "--model", "tiny-llama", "--seq", "8192", "--gpus", "2", "--gpu", "h100-sxm", "--device-memory",
               f"{CAPACITY + 1000}B", "--headroom", "1000B", "--jobs", "1", "--results", str(tmp / "results"),
               "--out", str(tmp / "suites")])
    return rc, capsys.readouterr().out


def test_plan_ranks_the_configurations_that_fit_and_writes_runnable_suites(tmp_path, capsys):
    rc, out = _plan(tmp_path, capsys)
    assert rc == 0, out
    (run_dir,) = (tmp_path / "results").glob("plan-*/2*")
    df = store.read_run(run_dir)
    assert set(df["measurement"]) == {"projected"} and df["projected_step_s"].notna().all()
    ok = df[df["status"] == "ok"]
    assert (ok["peak_bytes"] <= CAPACITY).all() and (df[df["status"] == "oom"]["peak_bytes"] > CAPACITY).all()
    # cp 1 without levers is over the capacity; the ladder went on to recompute + chunked loss, which fits
    cp1 = df[df["cp_size"] == 1].set_index("activation_checkpointing")
    assert cp1.loc[False, "status"] == "oom" and cp1.loc[True, "status"] == "ok"
    assert (df[df["cp_size"] > 1]["activation_checkpointing"] == False).all()  # noqa: E712 - the first rung fit
    # the printed ranking: tokens/s per GPU, fastest first, every fitting configuration once
    speeds = [float(m) for m in re.findall(r"(\S+)\s+\d+\.\d%\s+DistributedConfig\(", out)]
    assert len(speeds) == len(ok) and speeds == sorted(speeds, reverse=True)
    expected = (ok["projected_tokens_per_s"] / ok["world_size"]).sort_values(ascending=False)
    assert speeds == pytest.approx([float(f"{v:.3g}") for v in expected], rel=1e-2)
    assert "#1 in a training loop: from_pretrained(..., distributed_config=cpbench.DistributedConfig(" in out
    # --out: one suite per fitting configuration, each reproducing its row's point
    suites = sorted((tmp_path / "suites").glob("*.toml"))
    assert len(suites) == len(ok)
    ids = {load_suite(str(p), text=p.read_text()).points()[0].point_id for p in suites}
    assert ids == set(ok["point_id"])


def test_the_floor_of_a_rung_is_what_every_layer_must_hold():
    config = get_preset("llama-3-8b").config({})
    tokens, h, layers, vocab = 131072, 4096, 32, config.vocab_size
    assert floor_bytes(config, tokens, RUNGS[0]) == layers * tokens * h * 2 * 4 + tokens * vocab * 4
    assert floor_bytes(config, tokens, RUNGS[1]) == layers * tokens * h * 2  # checkpoints; the loss is chunked
    assert floor_bytes(config, tokens, RUNGS[2]) == 0  # the checkpoints live on the host


def _row(status: str, step: float = 1.0, compute: float = 0.9):
    return {"status": status, "projected_tokens_per_s": 8192 / step, "projected_step_s": step,
            "projected_compute_s": compute, "projected_optimizer_s": 0.0}


def test_the_search_starts_a_smaller_cp_at_the_rung_the_larger_needed_and_prunes_what_cannot_win():
    opts = PlanOptions(model="tiny-llama", seq=8192, gpus=4, gpu="h100-sxm")
    search = Search(opts, capacity=1 << 40, config=get_preset("tiny-llama").config({}))
    chain = search.chain("sdpa", "cp_ulysses", 1)
    point = next(chain)
    assert (point.cp_size, point.activation_checkpointing) == (4, False)
    point = chain.send(_row("oom"))
    assert (point.cp_size, point.activation_checkpointing, point.offload_activations) == (4, True, False)
    point = chain.send(_row("ok", step=1.0, compute=0.5))  # cp 4 fits at rung 1; half its step is communication
    assert (point.cp_size, point.activation_checkpointing) == (2, True)  # cp 2 starts at rung 1, not at none
    # cp 2 fits, its compute 0.99 of its step: cp 1 could not beat the best (cp 2's 8192 tok/s) by 2 %
    with pytest.raises(StopIteration):
        chain.send(_row("ok", step=1.0 / 4, compute=0.99 / 4))
    assert search.best == pytest.approx(8192 * 4 / 4)
    assert any("cp <= 1" in p and "not 2 % above the best" in p for p in search.pruned)
    # USP's attention is the zigzag ring's: once the ring's bound is not above the best, no USP point is projected
    search.ring_bound[4] = search.best
    with pytest.raises(StopIteration):
        next(search.chain("sdpa", "cp_usp", 2))
    assert any(p.startswith("cp_usp-u2/sdpa cp 4: at most") for p in search.pruned)
    # a cp where no rung fits ends the chain: smaller cps hold more
    chain = search.chain("sdpa", "cp_ring_zigzag", 1)
    next(chain)
    for _ in range(len(RUNGS) - 1):
        chain.send(_row("oom"))
    with pytest.raises(StopIteration):
        chain.send(_row("oom"))


def test_calibrate_fits_a_measured_run_and_estimate_prices_with_the_written_profile(tmp_path, capsys):
    # A "measured" run: three projected points whose measured step is 1.5x what the shipped profile projects
    rc = main(["estimate", "--model", "tiny-llama", "--seq", "2048,4096", "--cp", "2", "--styles",
               "cp_ulysses", "--world-size", "2", "--gpu", "h100-sxm", "--jobs", "1", "--out", str(tmp_path)])
    assert rc == 0
    (run_dir,) = tmp_path.glob("estimate-*/2*")
    table = store.read_table(run_dir)
    df = table.to_pandas()
    projected = df.set_index("point_id")["projected_step_s"]
    for name, values in (("measurement", pa.array(["measured"] * len(df))),
                         ("step_time_median_s", pa.array(df["projected_step_s"] * 1.5))):
        table = table.set_column(table.schema.get_field_index(name), name, values)
    store.write_table(run_dir, table)
    capsys.readouterr()
    profile = tmp_path / "slow-h100.toml"
    held = df["point_id"].iloc[-1]
    assert main(["calibrate", str(run_dir), "--gpu", "h100-sxm", "--out", str(profile), "--holdout", held]) == 0
    out = capsys.readouterr().out
    errors = [float(m) for m in re.findall(r"([+-]\d+\.\d)%", out)]
    assert len(errors) == len(df) and max(abs(e) for e in errors) < 5, out  # the held-out point too
    rc = main(["estimate", "--model", "tiny-llama", "--seq", "4096", "--cp", "2", "--styles", "cp_ulysses",
               "--world-size", "2", "--gpu", str(profile), "--jobs", "1", "--out", str(tmp_path / "again")])
    assert rc == 0
    (again,) = (tmp_path / "again").glob("estimate-*/2*")
    row = store.read_run(again).iloc[0]
    assert row["gpu_profile"] == "slow-h100"
    assert row["projected_step_s"] == pytest.approx(1.5 * projected[row["point_id"]], rel=0.05)
