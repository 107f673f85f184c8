"""Per-rank records -> one row of the results schema. Every aggregation names its reducer:

- memory: `max` over ranks, beside the per-rank list (never a sum, never rank 0 alone); the breakdown is the
  one of the rank with the highest peak, so its parts add up to `peak_bytes`. Host memory is the one sum: a node's
  ranks share its host memory (`host_node_peak_bytes`: ranks r of a node are r // gpus_per_node alike; a measured
  run on one machine is one node);
- time: per measured step, the `max` over ranks (a step ends when its slowest rank ends); median and p10/p90
  of those;
- parity: rank 0's comparison (it holds the gathered logits and full gradients).
"""

from __future__ import annotations

import json
import statistics

from cpbench.harness.measure.env import now_iso
from cpbench.harness.measure.flops import attention_pairs_per_rank, no_peak_reason, peak_flops, train_step_flops
from cpbench.harness.suite.presets import get_preset
from cpbench.harness.suite.spec import Point
from cpbench.report.runs.schema import SCHEMA_VERSION


def base_row(point: Point, *, run_id: str, env: dict, budget: int | None, measurement: str = "measured",
             host_budget: int | None = None, gpus_per_node: int | None = None) -> dict:
    spec = point.to_dict()
    row = {c: spec[c] for c in (
        "suite", "model", "seq_len", "batch_size", "batch_kind", "cp_size", "fsdp_size", "dp_replicate_size",
        "world_size", "attn_implementation", "cp_style", "dtype", "device", "warmup_steps", "measured_steps",
        "keep_outputs", "loss_mode", "activation_checkpointing", "mixed_precision", "parity_mode", "level",
        "implementation", "cp_ulysses_degree", "recompute_every_n_layers", "offload_activations", "offload_params",
        "tiled_mlp", "documents", "compile", "balance", "recompute_policy", "norm", "optimizer", "max_grad_norm", "loop",
    )}
    config = get_preset(point.preset).config(point.model_overrides)
    if point.level == "attention":
        from cpbench.harness.peers.attention_level import attention_flops

        flops = attention_flops(point)
    else:
        flops = model_flops(point, config)
    row.update(
        schema_version=SCHEMA_VERSION, measurement=measurement, run_id=run_id, point_id=point.point_id, point_key=point.point_key,
        model_type=config.model_type, spec_json=json.dumps(spec, sort_keys=True), memory_budget_bytes=budget,
        host_memory_budget_bytes=host_budget, flops_per_step=flops,
        timestamp=now_iso(), **env,
    )
    return row


def model_flops(point: Point, config, batch: dict | None = None) -> float | None:
    """Model FLOPs of the point's training step over the whole world, counted on the point's own batch (its packed
    documents and padding: flops.py), once per data-parallel replica (a cp group shares one batch); None where the
    count cannot tell a model's work (flops.matmul_work: experts with no `top_k`), so that TFLOP/s and MFU are null
    rather than wrong."""
    if batch is None:
        from cpbench.harness.measure.step import make_batch

        batch = make_batch(point, config.vocab_size, "cpu")
    try:
        per_batch = train_step_flops(config, point.seq_len, point.batch_size, position_ids=batch["position_ids"],
                                     attention_mask=batch.get("attention_mask"))
    except ValueError:
        return None
    return float(per_batch * _dp(point))


def attention_work(point: Point) -> dict:
    """How the attention work spreads over the cp ranks (flops.attention_pairs_per_rank): each rank's pairs in one
    layer's forward, the busiest rank's, and max / mean (1: balanced). The same count for a measured and a projected
    row: it is the point's batch under the layout its style makes, not a timing. A finished row's only (none for the
    attention op alone, whose peers lay out their own sequences)."""
    if point.level != "model":
        return {}
    from cpbench.harness.measure.step import make_batch

    config = get_preset(point.preset).config(point.model_overrides)
    per_rank = attention_pairs_per_rank(point, config, make_batch(point, config.vocab_size, "cpu"))
    mean = sum(per_rank) / len(per_rank)
    return {"attention_pairs": max(per_rank), "attention_pairs_per_rank": per_rank,
            "attention_imbalance": max(per_rank) / mean if mean else 1.0}


def _dp(point: Point) -> int:
    """Data-parallel replicas with their own batch: every rank of a cp group shares one batch."""
    return point.world_size // point.cp_size


def outcome_row(point: Point, status: str, detail: str | None, wall_s: float, **ctx) -> dict:
    """A point that did not produce measurements (error, timeout, oom before the end, skipped)."""
    row = base_row(point, **ctx)
    parity = "skipped" if status == "skipped" else "error"
    row.update(status=status, status_detail=detail, wall_s=wall_s, parity_status=parity,
               parity_detail=f"no parity: the point ended {status}")
    return row


def measured_row(point: Point, records: list[dict], wall_s: float, **ctx) -> dict:
    row = base_row(point, **ctx)
    records = sorted(records, key=lambda r: r["rank"])
    peaks = [r["peak_bytes"] for r in records]
    top = records[peaks.index(max(peaks))]
    row.update(
        status="ok", status_detail=_notes(records), wall_s=wall_s, num_params=records[0]["num_params"],
        model_type=records[0]["model_type"], parity_mode=records[0]["parity_mode"],
        peak_bytes=max(peaks), peak_bytes_per_rank=peaks,
        **_per_rank(records, "reserved_bytes"), **_per_rank(records, "device_peak_bytes"),
        **_per_rank(records, "rss_peak_bytes"),
        alloc_retries=_max_or_none(r["alloc_retries"] for r in records),
        params_bytes=top["params_bytes"], grads_bytes=top["grads_bytes"], optimizer_bytes=top["optimizer_bytes"],
        activations_bytes=top["activations_bytes"], temporaries_bytes=top.get("temporaries_bytes"),
        **_comm_columns(records), **_host_columns(records, ctx.get("gpus_per_node") or point.world_size),
        **attention_work(point), **_compile_columns(records),
    )
    moved = [name for name, on in (("activations", point.offload_activations), ("parameters and optimizer state",
                                    point.offload_params)) if on]
    if moved and point.device == "cpu" and row["measurement"] == "measured":
        note = (f"on CPU an offload moves nothing ({' and '.join(moved)} already live in host memory): the host "
                f"columns are cpbench's own accounting of what a GPU run would move, and RSS does not shrink")
        row["status_detail"] = "; ".join(filter(None, [row["status_detail"], note]))
    if row["measurement"] == "projected":
        row.update(parity_status="skipped", parity_detail="a projection computes no values: no parity")
        row.update(projected_time_columns(records, row["flops_per_step"], point))
        if not row.get("projected_pricing"):  # each op priced on its own: no fused chains (torch.compile) yet
            row["projected_pricing"] = "eager"
        if point.compile != "off":
            note = (f"compile={point.compile}: the projection priced the eager step (each op on its own, no fused "
                    "chains); a measured run gives the compiled step's time")
            row["status_detail"] = "; ".join(filter(None, [row["status_detail"], note]))
    else:
        times = _time_columns(records, row["flops_per_step"], point, ctx["env"])
        row.update(times)
        if "mfu" in times and times["mfu"] is None:  # a CUDA row whose device has no known peak: say why
            why = no_peak_reason(ctx["env"].get("device_name"), point.dtype)
            row["status_detail"] = "; ".join(filter(None, [row["status_detail"], why]))
        row.update(records[0].get("parity") or {"parity_status": "error", "parity_detail": "rank 0 sent no parity"})
    over = over_capacity(row, ctx.get("budget"), ctx.get("host_budget"))
    if over:
        row.update(status="oom", status_detail="; ".join(filter(None, [over, row["status_detail"]])))
    return row


def projected_time_columns(records: list[dict], flops: float, point: Point) -> dict:
    """A projection's time (timing.py): the slowest rank's step and its breakdown; none without a GPU profile."""
    times = [r["time"] for r in records if r.get("time")]
    if not times:
        return {}
    slowest = max(times, key=lambda t: t["step_s"])
    step_s = slowest["step_s"]
    parts = ("compute_s", "optimizer_s", "comm_exposed_s", "transfer_exposed_s", "overhead_s", "comm_s", "forward_s",
             "backward_s", "attention_s")
    per_rank = {}
    if len(times) == len(records):  # every rank's projected step (a rank that was not projected repeats its stand-in)
        steps = [t["step_s"] for t in times]
        per_rank = {"step_time_per_rank_s": steps, "slowest_rank": records[steps.index(max(steps))]["rank"]}
    # the kernels the slowest rank's attention calls were priced as (timing.attention_kernels: forward calls per
    # kernel class, e.g. 'cudnn:36'), so a row says which kernel its ring tiles (or its model's own call) ran
    kernels = {"attention_kernels": slowest["attention_kernels"]} if slowest.get("attention_kernels") else {}
    pricing = {"projected_pricing": slowest["pricing"]} if slowest.get("pricing") else {}
    return {"gpu_profile": slowest["gpu"], "projected_step_s": step_s, **per_rank, **kernels, **pricing,
            **{f"projected_{k}": slowest.get(k) for k in parts},
            "projected_tokens_per_s": point.seq_len * point.batch_size * _dp(point) / step_s,
            "projected_mfu": None if flops is None else flops / point.world_size / step_s / slowest["peak_flops"]}


def over_capacity(row: dict, budget: int | None, host_budget: int | None) -> str | None:
    """Which side a row's peaks pass, and by how much (None: neither)."""
    from cpbench.report.units import human_bytes

    why = []
    if budget is not None and row["peak_bytes"] > budget:
        why.append(f"device: peak {row['peak_bytes']} bytes > memory budget {budget} bytes "
                   f"(over by {human_bytes(row['peak_bytes'] - budget)})")
    node = row.get("host_node_peak_bytes")
    if host_budget is not None and node is not None and node > host_budget:
        why.append(f"host: a node's ranks hold {node} bytes > host memory {host_budget} bytes per node "
                   f"(over by {human_bytes(node - host_budget)})")
    return "; ".join(why) or None


HOST_PARTS = ("host_params_bytes", "host_grads_bytes", "host_optimizer_bytes", "host_activations_bytes")


def _host_columns(records: list[dict], per_node: int) -> dict:
    """Host peaks (max over ranks, and summed per node), the breakdown of the rank with the highest host peak, and
    the step's transfers (max over ranks). Null where a record has none (a peer's op-level record)."""
    peaks = [r.get("host_peak_bytes") for r in records]
    if any(v is None for v in peaks):
        return {}
    top = records[peaks.index(max(peaks))]
    nodes = [sum(peaks[i:i + per_node]) for i in range(0, len(peaks), per_node)]
    return {"host_peak_bytes": max(peaks), "host_peak_bytes_per_rank": peaks, "host_node_peak_bytes": max(nodes),
            **{k: top[k] for k in HOST_PARTS}, "d2h_bytes": max(r["d2h_bytes"] for r in records),
            "h2d_bytes": max(r["h2d_bytes"] for r in records)}


def _compile_columns(records: list[dict]) -> dict:
    """A compiled point's dynamo counters and compile time: the max over ranks (none for an eager point)."""
    if "graph_breaks" not in records[0]:
        return {}
    return {k: max(r[k] for r in records) for k in ("graph_breaks", "recompiles", "compile_s")}


def _comm_columns(records: list[dict]) -> dict:
    """Collectives of one step: the max over ranks per column (null where a record has none)."""
    names = [k for k in records[0] if k.startswith("comm_")]
    return {k: _max_or_none(r.get(k) for r in records) for k in names}


def _notes(records: list[dict]) -> str | None:
    """Why a measured column is null or partial (e.g. NVML unavailable), once per distinct message."""
    notes = [f"rank {r['rank']}: {n}" if len(records) > 1 else n for r in records for n in r.get("notes", [])]
    return "; ".join(dict.fromkeys(notes)) or None


def _per_rank(records: list[dict], name: str) -> dict:
    values = [r.get(name) for r in records]
    if any(v is None for v in values):
        return {name: None, f"{name}_per_rank": None}
    return {name: max(values), f"{name}_per_rank": values}


def _max_or_none(values):
    values = [v for v in values if v is not None]
    return max(values) if values else None


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]), as numpy's default."""
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo, hi = int(pos), min(int(pos) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _time_columns(records: list[dict], flops: float, point: Point, env: dict) -> dict:
    # the slowest rank of each step
    per_step = [max(steps) for steps in zip(*(r["step_times_s"] for r in records), strict=True)]
    if not per_step:
        return {}
    median = statistics.median(per_step)
    tokens = point.seq_len * point.batch_size * _dp(point)
    ranks = [statistics.median(r["step_times_s"]) for r in records]  # each rank's own median step
    out = {"step_times_s": per_step, "step_time_median_s": median, "step_time_p10_s": percentile(per_step, 10),
           "step_time_p90_s": percentile(per_step, 90), "tokens_per_s": tokens / median,
           "step_time_per_rank_s": ranks, "slowest_rank": records[ranks.index(max(ranks))]["rank"]}
    if point.device == "cuda" and flops is not None:
        per_device = flops / point.world_size / median
        out["tflops_per_s"] = per_device / 1e12
        peak = peak_flops(env.get("device_name"), point.dtype)
        out["mfu"] = per_device / peak if peak else None
    return out
