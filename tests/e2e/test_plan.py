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
    # cp 1 without levers is over the capacity, and with the chunked loss alone; recompute + chunked loss fits
    cp1 = df[df["cp_size"] == 1]
    assert list(zip(cp1["activation_checkpointing"], cp1["recompute_policy"], cp1["loss_mode"], cp1["status"])) == [
        (False, "full", "full", "oom"), (False, "full", "chunked", "oom"), (True, "op", "chunked", "ok")]
    assert (df[df["cp_size"] > 1]["activation_checkpointing"] == False).all()  # noqa: E712 - the first rung fit
    # the printed ranking: tokens/s per GPU, fastest first, every fitting configuration once
    speeds = [float(m) for m in re.findall(r"(\S+)\s+\d+\.\d%\s+DistributedConfig\(", out)]
    assert len(speeds) == len(ok) and speeds == sorted(speeds, reverse=True)
    expected = (ok["projected_tokens_per_s"] / ok["world_size"]).sort_values(ascending=False)
    assert speeds == pytest.approx([float(f"{v:.3g}") for v in expected], rel=1e-2)
    assert "#1 in a training loop: from_pretrained(..., distributed_config=cpbench.DistributedConfig(" in out
    # how far the ranking's absolute times ran from published ones of their regime (record.record_lines)
    assert re.search(r"published steps of these points' regimes .*\n  (<=|over) 64k tokens per GPU on (one GPU|several "
                     r"GPUs): ", out), out
    # --out: one suite per fitting configuration, each reproducing its row's point
    suites = sorted((tmp_path / "suites").glob("*.toml"))
    assert len(suites) == len(ok)
    ids = {load_suite(str(p), text=p.read_text()).points()[0].point_id for p in suites}
    assert ids == set(ok["point_id"])


def test_the_floor_of_a_rung_is_what_every_layer_must_hold():
    config = get_preset("llama-3-8b").config({})
    tokens, h, layers, vocab = 131072, 4096, 32, config.vocab_size
    assert floor_bytes(config, tokens, RUNGS[0]) == layers * tokens * h * 2 * 4 + tokens * vocab * 4
    assert floor_bytes(config, tokens, RUNGS[1]) == layers * tokens * h * 2 * 4  # the chunked loss alone
    assert floor_bytes(config, tokens, RUNGS[2]) == layers * tokens * h * 2  # checkpoints (op by op: at least)
    assert floor_bytes(config, tokens, RUNGS[3]) == layers * tokens * h * 2  # checkpoints; the loss is chunked
    assert floor_bytes(config, tokens, RUNGS[4]) == 0  # the checkpoints live on the host


def _row(status: str, step: float = 1.0, floor: float | None = None):
    return {"status": status, "projected_tokens_per_s": 8192 / step, "projected_step_s": step, "floor_s": floor}


def _drive(chain, rows, first=None):
    """Sends a configuration's rows (one per rung tried); returns the points it asked for (`first`: the point it
    already asked for)."""
    points = [first or next(chain)]
    for row in rows:
        try:
            points.append(chain.send(row))
        except StopIteration:
            return points
    raise AssertionError("the chain asked for more rungs than given")


ULYSSES, RING, USP = ("sdpa", "cp_ulysses", 1), ("sdpa", "cp_ring_zigzag", 1), ("sdpa", "cp_usp", 2)


def test_where_ulysses_would_run_the_models_mask_usp_at_degree_cp_is_searched_too():
    # a sliding window (or packed documents): cp_ulysses runs the model's S x S mask through SDPA's masked kernel,
    # and cp_usp at degree cp is the same exchange on the ring's kernel, which builds none
    from cpbench.harness.project.plan import candidates_for, masked

    opts = PlanOptions(model="tiny-llama", seq=8192, gpus=4, gpu="h100-sxm")
    llama = get_preset("tiny-llama").config({})
    window = get_preset("tiny-llama").config({"sliding_window": 64})
    assert not masked(llama, "none", "sdpa") and masked(window, "none", "sdpa") and masked(llama, "mixed", "eager")
    assert not masked(window, "mixed", "flash_attention_2")  # flash takes the window and the documents itself
    assert ("sdpa", "cp_usp", 4) not in candidates_for(opts, llama)
    assert ("sdpa", "cp_usp", 4) in candidates_for(opts, window)
    assert Search(opts, 1 << 40, llama).cps(USP) == [4] and Search(opts, 1 << 40, window).cps(USP) == [4, 2]
    assert Search(opts, 1 << 40, window).cps(("sdpa", "cp_usp", 4)) == [4]


def test_the_search_goes_by_levels_and_prunes_only_by_finished_ones():
    opts = PlanOptions(model="tiny-llama", seq=8192, gpus=4, gpu="h100-sxm")
    search = Search(opts, capacity=1 << 40, config=get_preset("tiny-llama").config({}))
    ulysses, ring = search.level(4, [ULYSSES, RING])
    points = _drive(ulysses, [_row("oom"), _row("oom"), _row("ok", step=1.0, floor=0.5)])
    assert [(p.cp_size, p.activation_checkpointing, p.recompute_policy, p.loss_mode) for p in points] == [
        (4, False, "full", "full"), (4, False, "full", "chunked"), (4, True, "op", "chunked")]
    _drive(ring, [_row("error")])  # a projection that failed at cp 4 does not end the smaller cps
    assert search.best == 0.0  # nothing is decided while a level runs
    search.finish_level()
    assert search.best == pytest.approx(8192 / 4) and search.bound[ULYSSES] == pytest.approx(2 * 8192 / 4)
    ulysses, ring = search.level(2, [ULYSSES, RING])
    first_ulysses, first_ring = next(ulysses), next(ring)
    assert first_ulysses.activation_checkpointing and first_ring.loss_mode == "full"  # the ring's own start: rung 0
    # cp 2 of Ulysses: 4 x the tokens per second at the same floor per token; cp 1 then cannot pass 2 % above it
    _drive(ulysses, [_row("ok", step=1.0 / 4, floor=0.99 / 4)], first_ulysses)
    _drive(ring, [_row("oom")] * len(RUNGS), first_ring)  # no rung fits the ring at cp 2: smaller cps hold more
    search.finish_level()
    assert search.level(1, [ULYSSES, RING]) == []
    assert any(p.startswith("cp_ulysses/sdpa cp <= 1") and "not 2 % above the best" in p for p in search.pruned)
    assert any(p.startswith("cp_ring_zigzag/sdpa cp 2: no rung fits") for p in search.pruned)
    # USP's floor is the zigzag ring's (the same pairs and tiles): not above the best, no USP point at that cp
    search.ring_bound["eager", 4] = search.best / 2  # another backend's ring: not USP-over-sdpa's bound
    assert len(search.level(4, [USP])) == 1
    search.ring_bound["sdpa", 4] = search.best
    assert search.level(4, [USP]) == []
    assert any(p.startswith("cp_usp-u2/sdpa cp 4: at most") for p in search.pruned)


def test_a_family_no_cut_makes_exact_is_searched_at_cp_1_only_saying_why():
    from transformers import Qwen3NextConfig

    opts = PlanOptions(model="hybrid", seq=8192, gpus=4, gpu="h100-sxm")
    search = Search(opts, capacity=1 << 40, config=Qwen3NextConfig(num_hidden_layers=4))
    assert search.cps(ULYSSES) == [1] and search.cps(RING) == [] and search.cps(USP) == []
    assert search.pruned == ["cp > 1: qwen3_next cannot be context-parallel (gated delta net layers (short conv + delta "
                             "rule) beside attention); searched at cp 1 only"]


def _best_and_pruned(tmp_path, prune: bool, jobs: int = 1, **kwargs):
    from cpbench.harness.project.plan import ranked, run_plan

    opts = PlanOptions(gpu="h100-sxm", jobs=jobs, prune=prune, out=tmp_path / f"{prune}-{jobs}", **kwargs)
    run_dir, search = run_plan(opts)
    df = store.read_run(run_dir)
    return ranked(df)["point_id"].iloc[0], len(df), search.pruned


def test_a_search_ranks_the_same_best_with_and_without_pruning(tmp_path):
    small = dict(model="tiny-llama", seq=2048, gpus=2, styles=("cp_ulysses",))
    assert _best_and_pruned(tmp_path, True, **small)[0] == _best_and_pruned(tmp_path, False, **small)[0]


@pytest.mark.heavy
def test_pruning_skips_what_cannot_win_and_never_changes_the_best(tmp_path):
    # Qwen3-0.6B's widths (2 layers) at 128k on 4 GPUs, attention-bound: FlashAttention-2's cp 4 floor (its GEMMs and
    # attention at their best efficiencies) is under SDPA's (cuDNN's) tokens/s, so its smaller cps are not projected;
    # the best is the same as with every configuration projected, and with two projections at a time
    search = dict(model="qwen3-0.6b", seq=131072, gpus=4, styles=("cp_ulysses",), attn=("sdpa", "flash_attention_2"),
                  overrides={"num_hidden_layers": 2, "max_position_embeddings": 131072})
    pruned_best, pruned_rows, pruned = _best_and_pruned(tmp_path, True, **search)
    full_best, full_rows, _ = _best_and_pruned(tmp_path, False, **search)
    assert pruned_best == full_best and pruned_rows < full_rows
    assert any(p.startswith("cp_ulysses/flash_attention_2 cp <= 2") for p in pruned)
    assert _best_and_pruned(tmp_path, True, jobs=2, **search)[::2] == (pruned_best, pruned)


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


def test_plan_with_the_fused_norm_searches_and_says_it():
    """--norm fused: every configuration searched runs the fused RMSNorm, and the call that sets it is said beside
    the winner's DistributedConfig."""
    from cpbench.harness.project.commands import _model_calls
    from cpbench.harness.project.plan import suite_text

    opts = PlanOptions(model="tiny-llama", seq=8192, gpus=2, gpu="h100-sxm", norm="fused")
    for rung in RUNGS[:3]:
        point = load_suite("t.toml", text=suite_text(opts, "sdpa", "cp_ulysses", 1, 2, rung)).points()[0]
        assert point.norm == "fused" and "/fused-norm/" in point.point_id
    plain = load_suite("t.toml", text=suite_text(PlanOptions(model="tiny-llama", seq=8192, gpus=2, gpu="h100-sxm"),
                                                 "sdpa", "cp_ulysses", 1, 2, {})).points()[0]
    assert plain.norm == "eager"
    row = {"norm": "fused", "activation_checkpointing": False, "tiled_mlp": "off", "loss_mode": "full",
           "offload_activations": False, "balance": "documents"}
    assert _model_calls(row)[0] == "cpbench.use_fused_norm(model)"  # first: before a tiled MLP's
    assert _model_calls({**row, "norm": "eager"}) == []
    with pytest.raises(SystemExit):  # argparse's choices: a wrong value refused with the known ones
        main(["plan", "--model", "tiny-llama", "--seq", "8192", "--gpus", "2", "--gpu", "h100-sxm", "--norm", "x"])


def test_plan_with_the_fused_adamw_and_clipping_searches_and_says_it():
    """--optimizer fused --max-grad-norm 1: every configuration searched steps with AdamW(fused=True) after clipping
    its gradients, and the winner's line says the optimizer."""
    from cpbench.harness.project.commands import _model_calls
    from cpbench.harness.project.plan import suite_text

    opts = PlanOptions(model="tiny-llama", seq=8192, gpus=2, gpu="h100-sxm", optimizer="fused", max_grad_norm=1.0)
    point = load_suite("t.toml", text=suite_text(opts, "sdpa", "cp_ulysses", 1, 2, RUNGS[1])).points()[0]
    assert point.optimizer == "fused" and "/fused-adamw/clip1/" in point.point_id and point.max_grad_norm == 1.0
    row = {"norm": "eager", "optimizer": "fused", "activation_checkpointing": False, "tiled_mlp": "off",
           "loss_mode": "full", "offload_activations": False, "balance": "documents"}
    assert _model_calls(row) == ["torch.optim.AdamW(model.parameters(), fused=True)"]
    assert _model_calls({**row, "optimizer": "foreach"}) == []


def test_plan_passes_its_optimizer_flags_to_the_search(monkeypatch):
    from cpbench.harness.project import plan

    seen = {}

    def stop(opts, on_row):
        seen["opts"] = opts
        raise ValueError("stopped before the search")

    monkeypatch.setattr(plan, "run_plan", stop)
    args = ["plan", "--model", "tiny-llama", "--seq", "8192", "--gpus", "2", "--gpu", "h100-sxm"]
    assert main([*args, "--optimizer", "fused", "--max-grad-norm", "0.5"]) == 2
    assert (seen["opts"].optimizer, seen["opts"].max_grad_norm) == ("fused", 0.5)


def test_plan_refuses_a_bad_flag_in_the_flags_words(tmp_path, capsys):
    args = ["plan", "--model", "tiny-llama", "--seq", "16384", "--gpus", "2", "--gpu", "h100-sxm", "--attn", "sdpa9",
            "--results", str(tmp_path)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "suite field" not in err and "--model tiny-llama: 2 errors" in err and "`--attn sdpa9`: use one of" in err
    assert "`--seq 16384`: exceeds" in err and "--override max_position_embeddings=<value>" in err
