"""`cpbench estimate` as a user runs it: capacity and `oom`, `--max-seq`, the quick form, its errors, and the
report, compare and gate commands on a projected run."""

from __future__ import annotations

import re

import pytest

from cpbench.cli import main
from cpbench.report.runs import store

SUITE = """name = "est"
model = "tiny-qwen3"
seq_lens = [256, 512, 1024]
cp_sizes = [1]
attn_implementations = ["eager"]
warmup_steps = 1
measured_steps = 1
parity = "off"
"""


def _estimate(tmp_path, *args) -> tuple[int, object]:
    jobs = [] if "--jobs" in args else ["--jobs", "1"]
    try:
        rc = main(["estimate", *args, "--out", str(tmp_path / "results"), *jobs])
    except SystemExit as e:  # refused by the parser, before anything is imported
        rc = e.code
    runs = sorted((tmp_path / "results").glob("*/*/runs.parquet"))
    return rc, (store.read_run(runs[-1]).set_index("point_id") if runs else None)


@pytest.fixture(scope="module")
def projected(tmp_path_factory):
    """The suite projected without a capacity."""
    tmp = tmp_path_factory.mktemp("projected")
    (tmp / "s.toml").write_text(SUITE)
    rc, df = _estimate(tmp, str(tmp / "s.toml"))
    assert rc == 0 and set(df["status"]) == {"ok"} and set(df["measurement"]) == {"projected"}
    (run,) = (tmp / "results" / "est").glob("*")
    return {"run": run, "suite": tmp / "s.toml", "df": df}


@pytest.fixture(scope="module")
def peaks(projected):
    """Every length's projected peak."""
    return {int(r.seq_len): int(r.peak_bytes) for r in projected["df"].itertuples()}


def test_a_capacity_between_two_lengths_makes_the_longer_oom_and_skips_the_rest(tmp_path, peaks):
    (tmp_path / "s.toml").write_text(SUITE)
    capacity = (peaks[256] + peaks[512]) // 2
    rc, df = _estimate(tmp_path, str(tmp_path / "s.toml"), "--device-memory", str(capacity))
    assert rc == 0  # oom and skipped are results
    by_len = df.set_index("seq_len")
    assert by_len.loc[256, "status"] == "ok" and by_len.loc[512, "status"] == "oom"
    assert by_len.loc[512, "peak_bytes"] == peaks[512] and "memory budget" in by_len.loc[512, "status_detail"]
    assert by_len.loc[1024, "status"] == "skipped" and "ran out of memory at seq_len=512" in by_len.loc[1024,
                                                                                                         "status_detail"]
    assert set(df["memory_budget_bytes"]) == {capacity} and set(df["parity_status"]) == {"skipped"}
    assert df["step_time_median_s"].isna().all()  # a projection has no time


def test_max_seq_finds_the_largest_length_that_fits_to_the_granularity(tmp_path, peaks):
    (tmp_path / "s.toml").write_text(SUITE.replace("seq_lens = [256, 512, 1024]", "seq_lens = [128]"))
    capacity = (peaks[512] + peaks[1024]) // 2
    rc, df = _estimate(tmp_path, str(tmp_path / "s.toml"), "--device-memory", str(capacity), "--max-seq",
                       "--granularity", "256")
    assert rc == 0
    ok, oom = df[df["status"] == "ok"]["seq_len"], df[df["status"] == "oom"]["seq_len"]
    largest = int(ok.max())
    assert 512 <= largest < 1024 and largest % 256 == 0
    assert largest + 256 in set(oom)  # the next multiple of the granularity was tried and did not fit
    assert (df[df["seq_len"] <= largest]["status"] == "ok").all()


def test_the_quick_form_projects_one_model_without_a_suite(tmp_path, capsys):
    rc, df = _estimate(tmp_path, "--model", "tiny-llama", "--seq", "128", "--cp", "2", "--device", "cpu",
                       "--dtype", "float32", "--styles", "cp_ring_zigzag", "--override", "max_position_embeddings=4096")
    assert rc == 0 and len(df) == 1 and set(df["status"]) == {"ok"}
    out = capsys.readouterr().out
    assert "no point was checked against a device's memory" in out  # `ok` is not "fits"
    assert "published steps" not in out  # no --gpu, no time: nothing to hold to a record
    assert '"max_position_embeddings": 4096' in df["spec_json"].iloc[0]  # the config value reached the point
    cp2 = df[df["cp_size"] == 2]
    assert (cp2["comm_p2p_count"] > 0).all() and (cp2["comm_all_gather_count"] > 0).all()
    assert len(cp2["peak_bytes_per_rank"].iloc[0]) == 2


def test_ulysses_on_a_windowed_model_is_told_of_the_mask_it_runs_and_of_usp(tmp_path, capsys):
    rc, _ = _estimate(tmp_path, "--model", "tiny-mistral", "--seq", "128", "--cp", "2", "--device", "cpu",
                      "--dtype", "float32", "--styles", "cp_ulysses,cp_ring_zigzag")
    assert rc == 0
    out = capsys.readouterr().out
    assert "cp_ulysses hands the model's own attention its whole S x S mask" in out and "cp_usp with" in out
    from cpbench.harness.estimate_cli import ulysses_mask_hint
    from cpbench.harness.suite.spec import load_suite

    text = 'model = "tiny-llama"\nseq_lens = [128]\ncp_sizes = [2]\ncp_styles = ["cp_ulysses"]\ndevice = "cpu"\n'
    assert ulysses_mask_hint(load_suite("plain", text=text).points()) is None  # no window, no documents: no mask
    flash = load_suite("flash", text=text.replace("tiny-llama", "tiny-mistral").replace('"cpu"', '"cuda"')
                       + 'attn_implementations = ["flash_attention_2"]\ndtype = "bfloat16"\n')
    assert ulysses_mask_hint(flash.points()) is None  # flash takes the window itself


def test_a_timed_point_is_told_its_regimes_record_against_published_measurements(tmp_path, capsys):
    rc, df = _estimate(tmp_path, "--model", "tiny-qwen3", "--seq", "128", "--cp", "2", "--world-size", "4",
                       "--gpu", "h100-sxm")
    assert rc == 0 and df["projected_step_s"].notna().all()
    out = capsys.readouterr().out
    # 128 tokens over cp 2 on 4 GPUs: the short regime on several GPUs, whose rows table.md judges
    assert "the step-time model against published steps of these points' regimes" in out
    assert re.search(r"<= 64k tokens per GPU on several GPUs: \d+ published measurements \(cp [^)]+\), projected steps",
                     out), out


@pytest.mark.parametrize("args, message", [
    (["--model", "tiny-qwen9", "--seq", "128"], "not a cpbench preset"),
    (["--model", "tiny-qwen3", "--seq", "12k"], "argument --seq: '12k': give comma-separated integers"),
    (["--model", "tiny-qwen3", "--seq", "128", "--dtype", "float64"], "argument --dtype: invalid choice: 'float64'"),
    (["--model", "tiny-qwen3", "--seq", "128", "--device-memory", "80XB"], "write a size like 80GiB"),
    (["--model", "tiny-qwen3", "--seq", "128", "--max-seq"], "--max-seq needs a capacity"),
    (["--model", "tiny-qwen3"], "--model and --seq"),
    (["--model", "tiny-qwen3", "--seq", "128", "--device-memory", "1GiB", "--max-seq", "--granularity", "0"],
     "--granularity 0"),
    (["--model", "tiny-qwen3", "--seq", "128", "--jobs", "0"], "--jobs 0"),
    (["--model", "tiny-qwen3", "--seq", "128", "--override", "rope_theta"], "--override 'rope_theta': write KEY=VALUE"),
])
def test_bad_arguments_exit_2_with_the_fix(tmp_path, capsys, args, message):
    rc, _ = _estimate(tmp_path, *args)
    assert rc == 2 and message in capsys.readouterr().err


def test_a_suite_built_from_flags_is_refused_in_the_flags_words(tmp_path, capsys):
    # the same checks as a suite file's, said as the command line a user typed: no suite field names, the fix a flag
    rc, _ = _estimate(tmp_path, "--model", "tiny-qwen3", "--seq", "16384", "--cp", "3", "--world-size", "2",
                      "--styles", "cp_rnig")
    err = capsys.readouterr().err
    assert rc == 2 and "suite field" not in err and "model_overrides" not in err
    assert "`--seq 16384`: exceeds the model's max_position_embeddings=8192" in err
    assert "--override max_position_embeddings=<value>" in err
    assert "`--styles cp_rnig`: is not a CP attention style" in err and "Did you mean `cp_ring`?" in err
    assert "`--cp 3`: " in err and "does not divide --world-size 2" in err


def test_a_suite_and_a_model_together_are_refused(tmp_path, capsys):
    (tmp_path / "s.toml").write_text(SUITE)
    rc, _ = _estimate(tmp_path, str(tmp_path / "s.toml"), "--model", "tiny-qwen3", "--seq", "128")
    assert rc == 2 and "not both" in capsys.readouterr().err


def test_report_compare_and_gate_on_a_projected_run(tmp_path, capsys, projected):
    run, suite = projected["run"], projected["suite"]
    assert main(["report", str(run)]) == 0
    assert "projected" in (run / "table.md").read_text() and "(projected)" in (run / "report.md").read_text()
    assert main(["gate", "--baseline", str(run / "runs.parquet"), str(run), "--rules",
                 "results/baselines/gate-rules.toml"]) == 0
    measured = tmp_path / "measured"
    point = "tiny-qwen3/s256/cp1/eager/none"
    assert main(["run", str(suite), "--point", point, "--out", str(measured), "--no-progress"]) == 0
    (measured_run,) = (measured / "est").glob("*")
    capsys.readouterr()
    assert main(["compare", str(measured_run), str(run)]) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith(f"| {point} |"))
    assert "measured → projected" in line and "(same)" in line  # the same peak, measured and projected
    assert main(["gate", "--baseline", str(measured_run / "runs.parquet"), str(run), "--rules",
                 "results/baselines/gate-rules.toml"]) == 2
    assert "measurement" in capsys.readouterr().err


@pytest.mark.heavy
def test_host_memory_is_a_capacity_too_and_max_seq_respects_it(tmp_path):
    """Activation offload puts the checkpoints on the host, growing with the length: a host capacity per node
    between two lengths' host peaks stops `--max-seq` there (the device capacity is far away), and the `oom` says
    it was the host. Opt-in (`-m heavy`, 10 s): the default suite holds the verdict by side in
    tests/unit/test_host_ledger.py and the search's use of verdicts in the max-seq test above."""
    quick = ["--model", "tiny-qwen3", "--cp", "1", "--device", "cpu", "--dtype", "float32", "--recompute",
             "--offload-activations", "--gpus-per-node", "1"]
    rc, df = _estimate(tmp_path / "a", *quick, "--seq", "256,512")
    host = {int(r.seq_len): int(r.host_node_peak_bytes) for r in df.itertuples()}
    assert rc == 0 and 0 < host[256] < host[512] and (df["d2h_bytes"] > 0).all()
    rc, df = _estimate(tmp_path / "b", *quick, "--seq", "256", "--device-memory", "1TiB", "--host-memory",
                       str((host[256] + host[512]) // 2), "--max-seq", "--granularity", "256")
    by_len = df.set_index("seq_len")
    assert rc == 0 and by_len.loc[256, "status"] == "ok" and by_len.loc[512, "status"] == "oom"
    assert by_len.loc[512, "status_detail"].startswith("host: a node's ranks hold")
    assert "device:" not in by_len.loc[512, "status_detail"]


def test_an_moe_config_json_projects_with_no_plan_written_by_hand(tmp_path, capsys):
    """A family outside the five that had a plan (qwen3_moe, as Qwen3-30B-A3B's published config.json): its audited
    default plan applies; the experts and router run in the projected step."""
    from transformers import Qwen3MoeConfig

    Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                   num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16).save_pretrained(tmp_path / "moe")
    # as a GPU runs it (bf16 on CUDA: torch's meta function of the experts' grouped GEMM accepts bf16 only)
    rc, df = _estimate(tmp_path, "--model", str(tmp_path / "moe"), "--seq", "128", "--cp", "2",
                       "--styles", "cp_ulysses,cp_ring_zigzag")
    assert rc == 0 and set(df["status"]) == {"ok"} and len(df) == 2, capsys.readouterr().err
    assert set(df["model_type"]) == {"qwen3_moe"}


@pytest.mark.heavy
def test_a_hybrid_family_projects_and_sweeps_at_cp_1_over_fsdp_and_is_told_what_to_do_at_cp_2(tmp_path, capsys):
    """docs/families.md: a refused family runs without CP (here FSDP over two ranks), projected and measured (its
    parity against the unsharded run passes); its cp > 1 is refused before anything runs, saying to run it at cp 1.
    Opt-in (`-m heavy`, 90 s)."""
    from transformers import Qwen3NextConfig

    Qwen3NextConfig(vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                    num_experts_per_tok=2, shared_expert_intermediate_size=32, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16).save_pretrained(tmp_path / "hybrid")
    rc, df = _estimate(tmp_path, "--model", str(tmp_path / "hybrid"), "--seq", "128", "--cp", "1", "--world-size", "2")
    assert rc == 0 and list(df["status"]) == ["ok"] and list(df["fsdp_size"]) == [2], capsys.readouterr().err
    capsys.readouterr()
    rc, _ = _estimate(tmp_path / "refused", "--model", str(tmp_path / "hybrid"), "--seq", "128", "--cp", "1,2")
    assert rc == 2 and "cannot be context-parallel at cp_size [2]" in capsys.readouterr().err
    hybrid = tmp_path / "hybrid"
    (tmp_path / "s.toml").write_text(f'model = "{hybrid}"\nseq_lens = [64]\ncp_sizes = [1]\n'
                                     "world_size = 2\nwarmup_steps = 1\nmeasured_steps = 1\n")
    assert main(["sweep", str(tmp_path / "s.toml"), "--out", str(tmp_path / "swept"), "--no-progress"]) == 0
    (run,) = (tmp_path / "swept" / "s").glob("*/runs.parquet")
    row = store.read_run(run).iloc[0]
    assert (row["status"], row["parity_status"], row["fsdp_size"]) == ("ok", "pass", 2)
