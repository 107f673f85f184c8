"""A small, realistic run for the report and gate tests, written like the harness writes one (ARROW_SCHEMA).

`make_run()` gives a DataFrame: seq lens x cp sizes x (at cp > 1) two styles, cp=1 out of memory at the
longest-but-one length and skipped beyond it, per-rank lists, and step-time samples from a seeded RNG.
Tests doctor copies of it (worse memory, failed parity, slower steps) and write them with `write_run`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from cpbench.report.runs.schema import ARROW_SCHEMA, KEY_COLUMNS, SCHEMA_VERSION

MIB = 1024**2
NUM_PARAMS = 2_000_000
HARDWARE_ID = "Test CPU x 0"


def make_run(
    *,
    seed: int = 0,
    seq_lens: tuple[int, ...] = (256, 512, 1024, 2048),
    cp_sizes: tuple[int, ...] = (1, 2),
    styles: tuple[str, ...] = ("cp_ulysses", "cp_ring"),
    backends: tuple[str, ...] = ("sdpa",),
    oom_cp1_at: int | None = 1024,
    steps: int = 10,
    noise: float = 0.05,
    run_id: str = "run-a",
) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rows = []
    for backend in backends:
        for cp in cp_sizes:
            for style in (styles if cp > 1 else ("none",)):
                for seq_len in seq_lens:
                    rows.append(_row(rng, backend, cp, style, seq_len, oom_cp1_at, steps, noise, run_id))
    return pd.DataFrame(rows, columns=ARROW_SCHEMA.names)


def write_run(frame: pd.DataFrame, run_dir: str | Path) -> Path:
    """Write `frame` as `<run_dir>/runs.parquet`; returns the run directory."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pandas(frame, schema=ARROW_SCHEMA, preserve_index=False)
    pq.write_table(table, run_dir / "runs.parquet")
    return run_dir


def _row(rng, backend, cp, style, seq_len, oom_cp1_at, steps, noise, run_id) -> dict:
    spec = {"model": "llama-tiny", "seq_len": seq_len, "batch_size": 1, "batch_kind": "plain", "cp_size": cp,
            "fsdp_size": 1, "dp_replicate_size": 1, "attn_implementation": backend, "cp_style": style,
            "dtype": "float32", "device": "cpu", "keep_outputs": False,
            "loss_mode": "full", "activation_checkpointing": False, "mixed_precision": False,
            "level": "model", "implementation": "cpbench", "cp_ulysses_degree": 1, "recompute_every_n_layers": 1,
            "offload_activations": False, "offload_params": False, "tiled_mlp": "off", "documents": "none",
            "compile": "off", "balance": "documents", "recompute_policy": "full",
            "norm": "eager", "optimizer": "foreach", "max_grad_norm": 0.0, "loop": "own"}
    row = {name: None for name in ARROW_SCHEMA.names}
    row.update(spec)
    row.update(_identity(spec, run_id, steps))
    row.update(_environment())
    if cp == 1 and oom_cp1_at is not None and seq_len >= oom_cp1_at:
        if seq_len == oom_cp1_at:
            row.update(status="oom", status_detail="peak 300 MiB over the memory budget 256 MiB",
                       memory_budget_bytes=256 * MIB, parity_status="skipped", parity_detail="point ran out of memory")
        else:
            row.update(status="skipped", status_detail=f"cp_size 1 ran out of memory at seq_len {oom_cp1_at}",
                       parity_status="skipped", parity_detail="point skipped")
        return row
    row.update(status="ok", wall_s=3.0 + seq_len / 500)
    row.update(_memory(cp, style, seq_len))
    row.update(_timing(rng, cp, seq_len, steps, noise))
    row.update(_parity(cp, seq_len))
    return row


def _identity(spec: dict, run_id: str, steps: int) -> dict:
    key = hashlib.sha1(json.dumps([spec[k] for k in KEY_COLUMNS]).encode()).hexdigest()[:16]
    point_id = f"{spec['model']}/s{spec['seq_len']}/cp{spec['cp_size']}/{spec['attn_implementation']}/{spec['cp_style']}"
    return {"schema_version": SCHEMA_VERSION, "measurement": "measured", "suite": "test-suite", "run_id": run_id, "point_id": point_id,
            "point_key": key, "model_type": "llama", "num_params": NUM_PARAMS, "world_size": spec["cp_size"],
            "warmup_steps": 2, "measured_steps": steps, "parity_mode": "full", "spec_json": json.dumps(spec)}


def _memory(cp: int, style: str, seq_len: int) -> dict:
    params = NUM_PARAMS * 4
    activations = int(seq_len * 160 * 1024 / cp * (1.1 if style == "cp_ring" else 1.0))
    per_rank = [params * 4 + activations - rank * 4096 for rank in range(cp)]
    rss = [p + 400 * MIB for p in per_rank]
    return {"peak_bytes": max(per_rank), "peak_bytes_per_rank": per_rank, "rss_peak_bytes": max(rss),
            "rss_peak_bytes_per_rank": rss, "params_bytes": params, "grads_bytes": params,
            "optimizer_bytes": 2 * params, "activations_bytes": activations}


def _timing(rng, cp: int, seq_len: int, steps: int, noise: float) -> dict:
    median = 0.02 + seq_len * (1 + seq_len / 2048) / cp * 2e-5 + (0.005 if cp > 1 else 0.0)
    samples = median * rng.lognormal(0.0, noise, size=steps)
    return {"step_times_s": samples.tolist(), "step_time_median_s": float(np.median(samples)),
            "step_time_p10_s": float(np.quantile(samples, 0.1)), "step_time_p90_s": float(np.quantile(samples, 0.9)),
            "tokens_per_s": seq_len / float(np.median(samples)), "flops_per_step": 6.0 * NUM_PARAMS * seq_len}


def _parity(cp: int, seq_len: int) -> dict:
    # deterministic like a real CPU run: the same seeded weights and batch give the same errors in every run
    scale = 0.0 if cp == 1 else seq_len / 1024
    return {"parity_status": "pass", "loss": 10.4, "ref_loss": 10.4, "loss_rel_err": scale * 3e-7,
            "logits_max_err": scale * 2e-6, "grad_max_rel_err": scale * 1e-5,
            "grad_worst_param": "model.layers.0.self_attn.q_proj.weight", "loss_rtol": 1e-5, "logits_atol": 1e-4,
            "grad_rtol": 1e-4}


def _environment() -> dict:
    return {"torch_version": "2.13.0", "transformers_version": "5.23.0", "cpbench_version": "0.1.0",
            "device_name": "Test CPU", "device_count": 0, "hardware_id": HARDWARE_ID, "git_commit": "0" * 40,
            "git_dirty": False, "host": "ci", "cpu_count": 2, "timestamp": "2025-01-01T00:00:00Z"}


def projected(frame: pd.DataFrame) -> pd.DataFrame:
    """The run as `cpbench estimate` writes it: the same memory, no time, no parity."""
    out = frame.copy()
    out["measurement"] = "projected"
    out["step_times_s"] = None
    for column in ("step_time_median_s", "step_time_p10_s", "step_time_p90_s", "tokens_per_s", "loss",
                   "ref_loss", "loss_rel_err", "logits_max_err", "grad_max_rel_err", "rss_peak_bytes"):
        out[column] = float("nan")
    out["rss_peak_bytes_per_rank"] = None
    out["grad_worst_param"] = None
    ran = out["status"].isin(["ok", "oom"])
    out.loc[ran, "parity_status"] = "skipped"
    out.loc[ran, "parity_detail"] = "a projection computes no values: no parity"
    return out


def slowed(frame: pd.DataFrame, factor: float) -> pd.DataFrame:
    """A copy whose every step-time sample (and the summaries) is `factor` times the original."""
    out = frame.copy()
    out["step_times_s"] = [None if s is None else [t * factor for t in s] for s in frame["step_times_s"]]
    for column in ("step_time_median_s", "step_time_p10_s", "step_time_p90_s"):
        out[column] = frame[column] * factor
    out["tokens_per_s"] = frame["tokens_per_s"] / factor
    return out


def row_of(frame: pd.DataFrame, point_id: str) -> int:
    """The index of the row with this point_id."""
    (index,) = frame.index[frame["point_id"] == point_id]
    return index
