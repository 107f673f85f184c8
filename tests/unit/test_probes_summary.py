"""The sweep's printed summary: what the probes measured, rendered through cpbench.report.units."""

from __future__ import annotations


def test_the_sweep_summary_renders_numbers_through_report_units():
    import pandas as pd

    from cpbench.harness.run.summary import summary_table
    from cpbench.report.units import human_bytes, ms

    df = pd.DataFrame([
        {"point_id": "a", "status": "ok", "peak_bytes": 3 * 2**30, "activations_bytes": 5 * 2**20,
         "rss_peak_bytes": float("nan"), "step_time_median_s": 0.0456, "tokens_per_s": 12345.6,
         "parity_status": "pass", "status_detail": None},
        {"point_id": "b", "status": "skipped", "peak_bytes": None, "activations_bytes": None, "rss_peak_bytes": None,
         "step_time_median_s": None, "tokens_per_s": None, "parity_status": "skipped", "status_detail": "why"},
    ])
    text = summary_table(df)
    assert human_bytes(3 * 2**30) in text and human_bytes(5 * 2**20) in text and ms(0.0456) in text
    assert "3.00 GiB" in text and "skipped [1]" in text and "\n[1] why" in text and "nan" not in text


def test_a_column_reads_in_one_unit_and_reasons_are_never_cut():
    import pandas as pd

    from cpbench.harness.run.summary import projected_table

    reason = "a projection cannot run Liger-Kernel's Triton kernels on fake tensors; project loss = \"chunked\""
    rows = [{"point_id": "small", "status": "ok", "peak_bytes": 4.2 * 2**20},
            {"point_id": "large", "status": "oom", "peak_bytes": 2 * 2**30},
            {"point_id": "liger", "status": "skipped", "peak_bytes": None, "status_detail": reason}]
    text = projected_table(pd.DataFrame(rows))
    assert "0.00410 GiB" in text and "2.00 GiB" in text and "MiB" not in text  # one unit for the peak column
    assert "skipped [1]" in text and text.endswith(f"[1] {reason}")  # the whole reason, once, below the table


def test_overrides_are_listed_once_and_rows_without_a_spec_render():
    import json

    import pandas as pd

    from cpbench.harness.run.summary import summary_table

    spec = json.dumps({"model_overrides": {"num_hidden_layers": 3}})
    df = pd.DataFrame([{"point_id": "m+abc123/s1", "model": "m+abc123", "status": "ok", "spec_json": spec},
                       {"point_id": "m+abc123/s2", "model": "m+abc123", "status": "ok", "spec_json": spec},
                       {"point_id": "plain/s1", "model": "plain", "status": "ok", "spec_json": float("nan")}])
    text = summary_table(df)
    assert text.count('m+abc123: model_overrides = {"num_hidden_layers": 3}') == 1 and "plain/s1" in text


def test_a_projected_rows_time_cells_line_up_with_the_header_old_rows_included():
    import pandas as pd

    from cpbench.harness.run.summary import projected_table
    from cpbench.report.units import seconds

    timed = {"point_id": "new", "status": "ok", "peak_bytes": 2**30, "world_size": 2, "gpu_profile": "h100-sxm",
             "projected_step_s": 0.5, "projected_compute_s": 0.4, "projected_comm_exposed_s": 0.05,
             "projected_transfer_exposed_s": 0.0, "projected_optimizer_s": 0.05, "projected_forward_s": 0.15,
             "projected_backward_s": 0.3, "projected_tokens_per_s": 8192.0, "projected_mfu": 0.4}
    older = {**timed, "point_id": "v10", "projected_forward_s": None, "projected_backward_s": None}  # read as null
    lines = projected_table(pd.DataFrame([timed, older])).splitlines()
    header = lines[0].split()
    at = header.index("fwd")  # "fwd | bwd": one column
    assert header[at:at + 3] == ["fwd", "|", "bwd"] and header[-2:] == ["tok/s/GPU", "MFU"]
    new_row, old_row = (next(line for line in lines if line.startswith(p)) for p in ("new", "v10"))
    column = lines[0].index("fwd | bwd")
    assert new_row[column:].startswith(f"{seconds(0.15)} | {seconds(0.3)}")
    assert old_row[column:].startswith("- ")
    assert new_row.rstrip().endswith("40.0%") and old_row.rstrip().endswith("40.0%")
