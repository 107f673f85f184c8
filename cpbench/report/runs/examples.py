"""Example runs, drawn as the sweep and the projection write them: Hypothesis strategies for the property tests of
everything that reads a run (tables, figures, the report page, compare, gate, the notebook).

Beside the schema on purpose: a row is built by walking `schema.COLUMNS`, so a column added there is generated — by
the rules below where a writer gives it a meaning, else from its Arrow type — and every reader is tested on it the
moment it exists. What a status leaves empty is empty (null, NaN once in pandas), as `harness/run/rows.py` leaves it:
`outcome_row` for error, timeout, skipped and an out-of-memory point that ended before its records; `measured_row`
for ok (measured or projected) and for an out-of-memory point over its capacity.

Needs `hypothesis` (the `test` extra); nothing in cpbench imports this module at run time.
"""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pyarrow as pa
from hypothesis import strategies as st

from .schema import (ADDED_SINCE, COLUMNS, DEFAULTS, KEY_COLUMNS, MEASUREMENTS, PARITY_STATUSES, SCHEMA_VERSION,
                     STATUSES)

GIB = 1024**3
STYLES = ("cp_ulysses", "cp_ring", "cp_ring_zigzag", "cp_usp")
# The values each key column takes in real suites; a key column added to the schema without an entry here gets
# values from its Arrow type (`_pool`).
KEY_VALUES = {
    "model": ("qwen3-tiny", "llama-tiny", "qwen3-0.6b"),
    "seq_len": (128, 256, 1024, 4096, 16384, 32768, 131072, 1 << 20),
    "batch_size": (1, 2),
    "batch_kind": ("plain", "packed", "padded"),
    "cp_size": (1, 2, 4, 8),
    "fsdp_size": (1, 2, 8),
    "dp_replicate_size": (1, 2),
    "attn_implementation": ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3"),
    "cp_style": STYLES,
    "dtype": ("float32", "bfloat16"),
    "device": ("cpu", "cuda"),
    "keep_outputs": (False, True),
    "loss_mode": ("full", "chunked"),
    "activation_checkpointing": (False, True),
    "mixed_precision": (False, True),
    "level": ("model", "attention"),
    "implementation": ("cpbench", "deepspeed", "torch_cp"),
    "cp_ulysses_degree": (1, 2),
    "recompute_every_n_layers": (1, 2),
    "recompute_policy": ("full", "op"),
    "norm": ("eager", "fused"),
    "optimizer": ("foreach", "fused"),
    "max_grad_norm": (0.0, 1.0),
    "loop": ("own", "trainer"),
    "offload_activations": (False, True),
    "offload_params": (False, True),
    "tiled_mlp": ("off", "auto", "4"),
    "documents": ("none", "long-sft", "lengths:0a1b2c"),
    "compile": ("off", "default"),
}
# Columns a finished step fills (measured_row): memory, host, collectives, time, parity. An outcome row leaves them
# empty. Named by prefix or name; anything else not written by `_spec`/`_identity` is generic.
MEASURED = ("peak_bytes", "reserved_bytes", "alloc_retries", "device_peak_bytes", "rss_peak_bytes", "params_bytes",
            "grads_bytes", "optimizer_bytes", "activations_bytes", "temporaries_bytes", "host_", "d2h_bytes",
            "h2d_bytes", "comm_", "step_", "tokens_per_s", "tflops_per_s", "mfu", "num_params", "gpu_profile",
            "projected_", "loss", "ref_loss", "loss_rel_err", "loss_rtol", "slowest_rank", "attention_",
            "graph_breaks", "recompiles", "compile_s", "logits_max_err", "grad_", "logits_atol",
            "parity_reference")


def _is_measured_column(name: str) -> bool:
    base = name.removesuffix("_per_rank")
    return any(base == m or (m.endswith("_") and base.startswith(m)) for m in MEASURED)


@st.composite
def runs(draw, *, max_points: int = 120, measurement: str | None = None, schema_version: int = SCHEMA_VERSION):
    """A run's rows (dicts keyed by column, as `store.to_table` takes them): a grid of points over sequence lengths,
    cp sizes and any other key columns, each point with a status and what that status fills."""
    # a writer of an older version had no column for what was added since: those points hold the defaults
    frozen = {c: DEFAULTS[c] for c in ADDED_SINCE.get(schema_version, ()) if c in DEFAULTS}
    grid = draw(_grids(max_points, frozen))
    statuses = draw(st.lists(st.sampled_from(STATUSES), min_size=len(grid), max_size=len(grid)))
    kinds = [measurement] if measurement else draw(st.sampled_from([["measured"], ["projected"], list(MEASUREMENTS)]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    env = {"suite": draw(st.sampled_from(["default-cpu", "qwen3-0.6b-long"])), "run_id": f"run-{seed % 1000}"}
    timed = bool(rng.integers(2))  # a projection has time only with --gpu
    rows = []
    for i, (spec, status) in enumerate(zip(grid, statuses)):
        kind = kinds[int(rng.integers(len(kinds)))]
        rows.append(row(rng, i, spec, status, kind, env, timed))
    if schema_version != SCHEMA_VERSION:
        for drawn in rows:
            drawn["schema_version"] = schema_version
    return rows


def older_table(table: pa.Table, version: int) -> pa.Table:
    """The same rows as a writer of `version` wrote them: without the columns added since, declared that version."""
    added = set(ADDED_SINCE[version])
    table = table.select([n for n in table.column_names if n not in added])
    table = table.set_column(table.column_names.index("schema_version"), "schema_version",
                             pa.array([version] * len(table), pa.int32()))
    return table.replace_schema_metadata({b"cpbench_schema_version": str(version).encode()})


@st.composite
def _grids(draw, max_points: int, frozen: dict):
    """The key columns' values of every point: lengths x cp sizes x styles x any other varying key columns."""
    seq_lens = draw(st.lists(st.sampled_from(KEY_VALUES["seq_len"]), min_size=1, max_size=6, unique=True))
    cps = draw(st.lists(st.sampled_from(KEY_VALUES["cp_size"]), min_size=1, max_size=3, unique=True))
    styles = draw(st.lists(st.sampled_from(STYLES), min_size=1, max_size=3, unique=True))
    others = [c for c in KEY_COLUMNS if c not in ("seq_len", "cp_size", "cp_style", *frozen)]
    fixed = {**{c: draw(st.sampled_from(_pool(c))) for c in others}, **frozen}
    varied = draw(st.lists(st.sampled_from(others), max_size=3, unique=True))
    axes = {c: draw(st.lists(st.sampled_from(_pool(c)), min_size=2, max_size=3, unique=True)) for c in varied}
    grid = []
    for values in itertools.product(seq_lens, cps, *axes.values()):
        seq_len, cp, rest = values[0], values[1], dict(zip(axes, values[2:]))
        for style in (styles if cp > 1 else ("none",)):
            grid.append({**fixed, **rest, "seq_len": seq_len, "cp_size": cp, "cp_style": style})
    limit = draw(st.integers(1, max_points))
    return grid[:limit]


def _pool(column: str) -> tuple:
    if column in KEY_VALUES:
        return KEY_VALUES[column]
    return _type_pool(COLUMNS[column][0])


def _type_pool(typ: pa.DataType) -> tuple:
    if pa.types.is_boolean(typ):
        return (False, True)
    if pa.types.is_integer(typ):
        return (0, 1, 7, 2**40)
    if pa.types.is_floating(typ):
        return (0.0, 1e-9, 0.5, 1e12)
    return ("a", "b|c", "")


def row(rng, index: int, spec: dict, status: str, kind: str, env: dict, timed: bool) -> dict:
    """One point's row: `spec` (its key columns), `status`, measured or projected (`kind`), with a projected time when
    `timed`; values drawn from the numpy generator `rng`."""
    out = {name: None for name in COLUMNS}
    out.update(spec)
    world = spec["cp_size"] * int(rng.choice([1, 2]))
    out.update(_identity(rng, index, spec, kind, env, world))
    if status == "ok" or (status == "oom" and (kind == "projected" or rng.random() < 0.5)):
        out.update(_finished(rng, out, world, kind, timed))
        if status == "oom":  # over its capacity: the budget below the peak
            out["memory_budget_bytes"] = int(out["peak_bytes"] * rng.uniform(0.3, 0.99))
            out["status_detail"] = "device: peak over the memory budget"
    else:
        out.update(status_detail=_text(rng, status), parity_status="skipped" if status == "skipped" else "error",
                   parity_detail=f"no parity: the point ended {status}")
    out["status"] = status
    for name, (typ, _) in COLUMNS.items():  # a column no rule above knows: from its type, or empty
        if name not in _KNOWN:
            out[name] = _generic(rng, typ)
    return out


def _identity(rng, index: int, spec: dict, kind: str, env: dict, world: int) -> dict:
    style = "" if spec["cp_style"] == "none" else f"/{spec['cp_style']}"
    point_id = f"{spec['model']}/s{spec['seq_len']}/cp{spec['cp_size']}/{spec['attn_implementation']}{style}/{index}"
    cuda = spec["device"] == "cuda"
    return {
        "schema_version": SCHEMA_VERSION, **env, "point_id": point_id, "point_key": f"{index:08x}",
        "model_type": "qwen3", "world_size": world, "warmup_steps": 1, "measured_steps": int(rng.integers(1, 8)),
        "parity_mode": "projected" if kind == "projected" else str(rng.choice(["full", "off"])),
        "spec_json": json.dumps(spec, sort_keys=True, default=str), "measurement": kind,
        "wall_s": float(rng.uniform(0, 600)), "flops_per_step": float(spec["seq_len"]) * 1e9,
        "memory_budget_bytes": int(80 * GIB) if rng.random() < 0.3 else None,
        "host_memory_budget_bytes": None,
        "torch_version": "2.13.0", "transformers_version": "5.23.0", "cpbench_version": "0.1.0",
        "cuda_version": "13.0" if cuda else None, "driver_version": "580" if cuda else None,
        "device_name": "NVIDIA H100 80GB HBM3" if cuda else "Test CPU", "device_count": 8 if cuda else 0,
        "hardware_id": "NVIDIA H100 80GB HBM3 x 8" if cuda else "Test CPU x 0", "git_commit": "0" * 40,
        "git_dirty": bool(rng.integers(2)), "host": "node-0", "cpu_count": 2,
        "timestamp": f"2026-12-0{1 + index % 9}T00:00:{index % 60:02d}Z",
    }


def _finished(rng, row: dict, world: int, kind: str, timed: bool) -> dict:
    """What a finished step fills: memory (the breakdown of the top rank adds up to its peak), host, collectives,
    then time and parity (measured) or the projected time (projected, with a GPU profile)."""
    cuda = row["device"] == "cuda"
    ranks = [int(v) for v in rng.integers(1, 90 * GIB, size=world)] if rng.random() < 0.9 else [0] * world
    peak = max(ranks)
    parts = rng.dirichlet(np.ones(4)) * peak
    out = {"num_params": int(rng.integers(1, 10**10)), "peak_bytes": peak, "peak_bytes_per_rank": ranks,
           "params_bytes": int(parts[0]), "grads_bytes": int(parts[1]), "optimizer_bytes": int(parts[2]),
           "activations_bytes": peak - int(parts[0]) - int(parts[1]) - int(parts[2]),
           "temporaries_bytes": None if cuda else int(parts[3] * rng.random()),
           "rss_peak_bytes": peak + 10**8, "rss_peak_bytes_per_rank": [r + 10**8 for r in ranks]}
    if cuda:
        out.update(reserved_bytes=peak + 2**20, reserved_bytes_per_rank=[r + 2**20 for r in ranks], alloc_retries=0,
                   device_peak_bytes=peak + 2**29, device_peak_bytes_per_rank=[r + 2**29 for r in ranks])
    if rng.random() < 0.8:
        out.update(_host(rng, world))
    if row["cp_size"] > 1 and rng.random() < 0.8:  # the attention work of each cp rank, and its spread
        pairs = [int(v) for v in rng.integers(1, 10**12, size=row["cp_size"])]
        out.update(attention_pairs=max(pairs), attention_pairs_per_rank=pairs,
                   attention_imbalance=max(pairs) / (sum(pairs) / len(pairs)))
    if (row["device"] == "cuda" or kind == "projected") and rng.random() < 0.5:  # a projection: its GPU's kernels
        out["attention_kernels"] = str(rng.choice(["cudnn:12,efficient:4", "flash:8", "fa3:16"]))
    if row["compile"] != "off":
        out.update(graph_breaks=int(rng.integers(0, 3)), recompiles=int(rng.integers(0, 2)),
                   compile_s=float(rng.uniform(1, 120)))
    if rng.random() < 0.8:
        for op in ("all_gather", "reduce_scatter", "all_to_all", "p2p", "all_reduce"):
            out[f"comm_{op}_count"] = int(rng.integers(0, 500))
            out[f"comm_{op}_bytes"] = int(rng.integers(0, 10**11))
    if kind == "projected":
        out.update(parity_status="skipped", parity_detail="a projection computes no values: no parity")
        if timed:
            out.update(_projected_time(rng, row))
        return out
    out.update(_time(rng, row, cuda))
    out.update(_parity(rng, row))
    return out


def _host(rng, world: int) -> dict:
    ranks = [int(v) for v in rng.integers(0, 200 * GIB, size=world)] if rng.random() < 0.5 else [0] * world
    top = max(ranks)
    share = rng.dirichlet(np.ones(4)) * top
    return {"host_peak_bytes": top, "host_peak_bytes_per_rank": ranks, "host_node_peak_bytes": sum(ranks),
            "host_params_bytes": int(share[0]), "host_grads_bytes": int(share[1]),
            "host_optimizer_bytes": int(share[2]), "host_activations_bytes": int(share[3]),
            "d2h_bytes": int(rng.integers(0, 10**11)) if top else 0, "h2d_bytes": int(rng.integers(0, 10**11)) if top
            else 0}


def _time(rng, row: dict, cuda: bool) -> dict:
    steps = sorted(float(v) for v in rng.lognormal(math.log(0.5), 0.3, size=row["measured_steps"]))
    median = float(np.median(steps))
    per_rank = [median * float(f) for f in rng.uniform(0.8, 1.0, size=row["world_size"])]
    out = {"step_times_s": steps, "step_time_median_s": median, "step_time_p10_s": float(np.percentile(steps, 10)),
           "step_time_p90_s": float(np.percentile(steps, 90)),
           "tokens_per_s": row["seq_len"] * row["batch_size"] / median, "step_time_per_rank_s": per_rank,
           "slowest_rank": int(np.argmax(per_rank))}
    if cuda:
        out["tflops_per_s"] = row["flops_per_step"] / median / 1e12
        out["mfu"] = out["tflops_per_s"] / 989.0 if rng.random() < 0.8 else None
    return out


def _projected_time(rng, row: dict) -> dict:
    step = float(rng.lognormal(0, 2))
    parts = rng.dirichlet(np.ones(5)) * step
    steps = [step * float(f) for f in rng.uniform(0.8, 1.0, size=row["world_size"])]  # every rank's projected step
    slowest = int(rng.integers(0, row["world_size"]))
    steps[slowest] = step  # the row's step is the slowest rank's (rows.projected_time_columns)
    per_rank = {"step_time_per_rank_s": steps, "slowest_rank": slowest} if rng.random() < 0.8 else {}
    return {"gpu_profile": str(rng.choice(["h100-sxm", "a100-sxm"])), "projected_step_s": step, **per_rank,
            "projected_pricing": "fused" if row["compile"] != "off" else "eager",
            "projected_compute_s": float(parts[0]), "projected_optimizer_s": float(parts[1]),
            "projected_comm_exposed_s": float(parts[2]), "projected_transfer_exposed_s": float(parts[3]),
            "projected_overhead_s": float(parts[4]), "projected_comm_s": float(parts[2] * 2),
            "projected_forward_s": float(parts[0] / 3), "projected_backward_s": float(parts[0] * 2 / 3 + parts[2]),
            "projected_attention_s": float(parts[0] / 4),
            "projected_tokens_per_s": row["seq_len"] / step, "projected_mfu": float(rng.uniform(0, 0.7))}


def _parity(rng, row: dict) -> dict:
    status = str(rng.choice(PARITY_STATUSES))
    if status not in ("pass", "fail"):
        return {"parity_status": status, "parity_detail": _text(rng, status),
                "parity_reference": "unsharded" if status == "reference_oom" else None}
    tolerances = {"loss_rtol": 1e-5, "logits_atol": 1e-4, "grad_rtol": 1e-4}
    scale = 10.0 if status == "fail" else 0.1

    def error(tolerance):  # exact zeros, NaN and inf happen (a NaN loss is a real outcome: a broken model)
        return float(rng.choice([0.0, tolerance * scale * rng.random(), math.nan, math.inf], p=[0.2, 0.7, 0.05, 0.05]))

    loss = float(rng.choice([rng.uniform(0, 12), math.nan], p=[0.95, 0.05]))
    return {"parity_status": status, "parity_detail": None if status == "pass" else "gradients over tolerance",
            "parity_reference": str(rng.choice(["unsharded", "sharded"])), "loss": loss, "ref_loss": loss,
            "loss_rel_err": error(1e-5), "logits_max_err": None if row["loss_mode"] == "chunked" else error(1e-4),
            "grad_max_rel_err": error(1e-4), "grad_worst_param": "model.layers.0.self_attn.q_proj.weight",
            **tolerances}


def _text(rng, status: str) -> str:
    return str(rng.choice([f"{status}: see the log", f"{status} | with a pipe\nand a newline", "x" * 300]))


def _generic(rng, typ: pa.DataType):
    """A value for a column no rule knows: from its Arrow type, sometimes empty."""
    if rng.random() < 0.3:
        return None
    if pa.types.is_list(typ):
        return [_generic(rng, typ.value_type) or 0 for _ in range(int(rng.integers(0, 4)))]
    return _type_pool(typ)[int(rng.integers(len(_type_pool(typ))))]


# Columns the rules above write (spec, identity, status, what a finished step fills); every other column of the
# schema is `_generic`.
_KNOWN = frozenset(KEY_COLUMNS) | {"schema_version", "suite", "run_id", "point_id", "point_key", "model_type",
                                   "world_size", "warmup_steps", "measured_steps", "parity_mode", "spec_json",
                                   "measurement", "status", "status_detail", "wall_s", "flops_per_step",
                                   "memory_budget_bytes", "host_memory_budget_bytes", "parity_status",
                                   "parity_detail", "torch_version", "transformers_version", "cpbench_version",
                                   "cuda_version", "driver_version", "device_name", "device_count", "hardware_id",
                                   "git_commit", "git_dirty", "host", "cpu_count", "timestamp"} | {
    name for name in COLUMNS if _is_measured_column(name)}
