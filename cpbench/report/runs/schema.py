"""The results' data model: one row per sweep point, a versioned Parquet schema.

Units are base units in storage (bytes, seconds); GiB and ms exist only when rendered. Per-rank values are
kept as lists beside their max over ranks (never a sum, never rank 0 alone). Nullable columns are null where a
measurement does not apply (e.g. CUDA allocator columns on CPU) and the row says why in `status_detail` or
`parity_status`.
"""

from __future__ import annotations

import pyarrow as pa

# 2: `peak_bytes` (and its breakdown) covers the parity step and the smallest peak of the identical warmup
#    steps, each step keeping its outputs through the optimizer step; version 1 took the largest of all.
# 3: a row is `measured` or `projected` (`measurement`); the step keeps only the loss through backward unless
#    `keep_outputs`; the parity step is no longer tracked; `temporaries_bytes` and the collectives of one step
#    (`comm_*`) are new.
# 7: host memory and transfers of the offload levers (`host_*`, `d2h_bytes`, `h2d_bytes`).
# 8: a projection's time on a GPU profile (`gpu_profile`, `projected_*`). Only columns were added: a version 7
#    file is read with them null (ADDED_SINCE).
# 9: packed documents and how the attention work spreads over the ranks (`documents`, `attention_pairs_per_rank`,
#    `attention_imbalance`, per-rank step times), the kernels the ring's tiles ran (`attention_kernels`), compiled
#    steps (`compile`, `graph_breaks`, `recompiles`, `compile_s`, `projected_pricing`). Only columns were added: an
#    older file is read with them null, or with DEFAULTS for the two that identify a point.
# 10: the zigzag ring's placement (`balance`: documents or sequence), which identifies a point (an older file's rows
#     ran the default, "documents").
# 11: a projected step's forward and backward times (`projected_forward_s`, `projected_backward_s`). Only columns
#     were added: an older file is read with them null.
# 12: a projected step's attention share on one clock (`projected_attention_s`). Only a column was added: an older
#     file is read with it null.
# 13: what a recomputed layer keeps (`recompute_policy`: full or op), which identifies a point (an older file's rows
#     recomputed whole layers, "full").
# 14: how a point runs the model's RMSNorms (`norm`: eager or fused), which identifies a point (an older file's rows
#     ran transformers' eager norm).
# 15: which AdamW a point steps with (`optimizer`: foreach or fused) and the norm its gradients are clipped to first
#     (`max_grad_norm`, 0: none), which identify a point (an older file's rows ran torch's default, foreach, unclipped).
# 16: what drives the step (`loop`: cpbench's own loop, or transformers' Trainer), which identifies a point (an older
#     file's rows ran cpbench's own loop).
SCHEMA_VERSION = 16
MEASUREMENTS = ("measured", "projected")

STATUSES = ("ok", "oom", "error", "timeout", "skipped")
PARITY_STATUSES = ("pass", "fail", "reference_oom", "error", "skipped")

_LIST_I64 = pa.list_(pa.int64())
_LIST_F64 = pa.list_(pa.float64())

# name -> (arrow type, one-line meaning). Order is the column order on disk.
COLUMNS: dict[str, tuple[pa.DataType, str]] = {
    # identity and the point's spec
    "schema_version": (pa.int32(), "SCHEMA_VERSION of the writer"),
    "suite": (pa.string(), "suite name"),
    "run_id": (pa.string(), "the sweep run this row belongs to"),
    "point_id": (pa.string(), "stable id of the point within its suite (readable, e.g. qwen3-tiny/s512/cp2/sdpa/cp_ulysses)"),
    "point_key": (pa.string(), "hash of the spec fields that define the point, for matching runs against baselines"),
    "model": (pa.string(), "model preset name (or 'custom')"),
    "model_type": (pa.string(), "transformers model_type"),
    "num_params": (pa.int64(), "parameter count"),
    "seq_len": (pa.int64(), "tokens per sequence"),
    "batch_size": (pa.int64(), "sequences per batch (per dp rank)"),
    "batch_kind": (pa.string(), "plain | packed | padded"),
    "cp_size": (pa.int64(), "context-parallel size"),
    "fsdp_size": (pa.int64(), "FSDP size"),
    "dp_replicate_size": (pa.int64(), "HSDP replicas"),
    "world_size": (pa.int64(), "processes of the point"),
    "attn_implementation": (pa.string(), "eager | sdpa | flex_attention | flash_attention_2 | flash_attention_3"),
    "cp_style": (pa.string(), "attention style in the cp_plan (cp_ulysses, cp_ring, ...); 'none' at cp_size 1"),
    "dtype": (pa.string(), "float32 | bfloat16 | float16"),
    "device": (pa.string(), "cpu | cuda"),
    "warmup_steps": (pa.int64(), "steps run before timing"),
    "measured_steps": (pa.int64(), "steps timed"),
    "loss_mode": (pa.string(), "full (the model's logits) | chunked (the output projection and loss chunk by chunk; "
                  "no logits, so parity compares the loss and gradients)"),
    "activation_checkpointing": (pa.bool_(), "every decoder layer recomputed in backward"),
    "mixed_precision": (pa.bool_(), "FSDP2 mixed precision: fp32 master weights and reduction, compute in `dtype`"),
    "recompute_every_n_layers": (pa.int32(), "with activation_checkpointing: every n-th decoder layer recomputed (the "
                                 "others keep their activations); 1 otherwise"),
    "recompute_policy": (pa.string(), "with activation_checkpointing: full (whole layers recomputed) | op (each "
                         "recomputed layer keeps its attention kernels' and every other matmul's outputs)"),
    "offload_activations": (pa.bool_(), "the recompute checkpoints held in (pinned) host memory"),
    "offload_params": (pa.bool_(), "FSDP2's CPUOffloadPolicy: parameters, gradients and optimizer state on the host"),
    "tiled_mlp": (pa.string(), "each decoder layer's MLP over tiles of the sequence: off | auto | the tile count"),
    "norm": (pa.string(), "the model's RMSNorms: eager (transformers') | fused (one op each way: "
             "cpbench.use_fused_norm)"),
    "optimizer": (pa.string(), "torch's AdamW: foreach (its default: multi-tensor kernels on a GPU) | fused (one "
                  "kernel over every parameter: AdamW(fused=True))"),
    "max_grad_norm": (pa.float64(), "the global norm the gradients are clipped to before each optimizer step "
                      "(torch.nn.utils.clip_grad_norm_); 0: not clipped"),
    "loop": (pa.string(), "what drives the step: own (cpbench's loop: model(**batch).loss.backward(), "
             "optimizer.step()) | trainer (transformers' Trainer.train(), its clipping and scheduler included)"),
    "documents": (pa.string(), "the packed documents of each row: none (batch_kind says plain, packed or padded as "
                  "before), a shipped mix's name, or lengths:<hash> for lengths given (spec_json holds them)"),
    "balance": (pa.string(), "the zigzag ring's placement (cp_ring_zigzag, cp_usp): documents (each rank the same "
                "attention work of the batch's documents) or sequence (the plain zigzag); documents for every other "
                "style"),
    "compile": (pa.string(), "torch.compile of each decoder layer: off, or the mode (default, max-autotune, ...)"),
    "cp_ulysses_degree": (pa.int32(), "cp_usp's Ulysses degree (ranks per Ulysses group; the ring spans cp_size / "
                          "degree groups); 1 for every other style"),
    "level": (pa.string(), "model (the training step) | attention (one causal attention op, forward + backward)"),
    "implementation": (pa.string(), "the CP implementation: cpbench, or a peer (deepspeed, torch_cp, ring_flash_attn, "
                       "yunchang)"),
    "keep_outputs": (pa.bool_(), "the step keeps the whole output (logits) through backward; false: only the loss, "
                     "as transformers' Trainer"),
    "parity_mode": (pa.string(), "full | projected | off"),
    "spec_json": (pa.string(), "the full point spec as JSON"),
    # outcome
    "measurement": (pa.string(), "measured (a real run) | projected (`cpbench estimate`: the same step on fake "
                    "tensors and a fake process group; no time, no parity)"),
    "status": (pa.string(), "ok | oom | error | timeout | skipped"),
    "status_detail": (pa.string(), "the error message, why the point was skipped, or notes on an ok point (e.g. why NVML is null)"),
    "wall_s": (pa.float64(), "wall time of the whole point, launch included"),
    # memory (max over ranks, and per rank)
    "peak_bytes": (pa.int64(), "peak memory per rank, max over ranks: CUDA max_memory_allocated, CPU peak live "
                   "tensor bytes; over the parity step and the warmup steps (the smallest of theirs, see README)"),
    "peak_bytes_per_rank": (_LIST_I64, "peak_bytes of each rank"),
    "reserved_bytes": (pa.int64(), "CUDA max_memory_reserved, max over ranks (null on CPU)"),
    "reserved_bytes_per_rank": (_LIST_I64, "reserved_bytes of each rank"),
    "alloc_retries": (pa.int64(), "CUDA allocator retries (num_alloc_retries), max over ranks (null on CPU)"),
    "device_peak_bytes": (pa.int64(), "NVML device memory peak (sampled), max over ranks (null on CPU)"),
    "device_peak_bytes_per_rank": (_LIST_I64, "device_peak_bytes of each rank"),
    "rss_peak_bytes": (pa.int64(), "process RSS high-water mark, max over ranks"),
    "rss_peak_bytes_per_rank": (_LIST_I64, "rss_peak_bytes of each rank"),
    "params_bytes": (pa.int64(), "parameters held by the rank with the highest peak"),
    "grads_bytes": (pa.int64(), "gradients held by that rank"),
    "optimizer_bytes": (pa.int64(), "optimizer state held by that rank"),
    "activations_bytes": (pa.int64(), "the rest of that rank's peak: tensors made in forward (and, on CUDA, "
                          "everything else)"),
    "temporaries_bytes": (pa.int64(), "tensors made in backward that are not gradients, at that rank's peak "
                          "(null on CUDA, where only at-rest sizes are known)"),
    # host memory and transfers (the offload levers; measure/host.py)
    "host_peak_bytes": (pa.int64(), "host memory one rank holds for the step at its peak, max over ranks: "
                        "offloaded checkpoints, parameters, gradients, optimizer state, and the host optimizer "
                        "step's temporaries"),
    "host_peak_bytes_per_rank": (_LIST_I64, "host_peak_bytes of each rank"),
    "host_node_peak_bytes": (pa.int64(), "the most host memory one node's ranks hold together (the sum of their "
                             "host peaks: the ranks step in lockstep), max over nodes"),
    "host_params_bytes": (pa.int64(), "parameters on the host, at the host peak of the rank with the highest one"),
    "host_grads_bytes": (pa.int64(), "gradients on the host, at that peak"),
    "host_optimizer_bytes": (pa.int64(), "optimizer state (and the optimizer step's temporaries) on the host, at that "
                             "peak"),
    "host_activations_bytes": (pa.int64(), "offloaded checkpoints on the host, at that peak"),
    "d2h_bytes": (pa.int64(), "bytes one rank copies device to host in one step, max over ranks"),
    "h2d_bytes": (pa.int64(), "bytes one rank copies host to device in one step, max over ranks"),
    "host_memory_budget_bytes": (pa.int64(), "the host capacity per node a point is judged against "
                                 "(--host-memory; null: none)"),
    "memory_budget_bytes": (pa.int64(), "the capacity a point is judged against (--memory-budget, --device-memory "
                            "or the suite's memory_budget; null: none)"),
    # collectives of one tracked step, max over ranks (collectives.py)
    "comm_all_gather_count": (pa.int64(), "all-gathers one rank posts in one step"),
    "comm_all_gather_bytes": (pa.int64(), "bytes one rank contributes to them (its shards)"),
    "comm_reduce_scatter_count": (pa.int64(), "reduce-scatters one rank posts in one step"),
    "comm_reduce_scatter_bytes": (pa.int64(), "bytes one rank hands to them (its full inputs)"),
    "comm_all_to_all_count": (pa.int64(), "all-to-alls one rank posts in one step"),
    "comm_all_to_all_bytes": (pa.int64(), "bytes one rank hands to them"),
    "comm_p2p_count": (pa.int64(), "point-to-point sends and receives one rank posts in one step"),
    "comm_p2p_bytes": (pa.int64(), "bytes one rank sends"),
    "comm_all_reduce_count": (pa.int64(), "all-reduces one rank posts in one step"),
    "comm_all_reduce_bytes": (pa.int64(), "bytes one rank hands to them"),
    # time (slowest rank per step)
    "step_times_s": (_LIST_F64, "every measured step's time, max over ranks per step"),
    "step_time_median_s": (pa.float64(), "median of step_times_s"),
    "step_time_p10_s": (pa.float64(), "10th percentile of step_times_s"),
    "step_time_p90_s": (pa.float64(), "90th percentile of step_times_s"),
    "tokens_per_s": (pa.float64(), "tokens of the global batch per second at the median step"),
    "flops_per_step": (pa.float64(), "model FLOPs per training step, whole world: real tokens, and the query-key "
                       "pairs the mask keeps (causal, documents, windows)"),
    "tflops_per_s": (pa.float64(), "achieved TFLOP/s per device (null on CPU)"),
    "mfu": (pa.float64(), "model FLOPs utilisation against the device's peak (null when unknown)"),
    "step_time_per_rank_s": (_LIST_F64, "each rank's median step time (measured) or projected step (projected)"),
    "slowest_rank": (pa.int64(), "the rank whose step is longest (the one that sets the step)"),
    # how the attention work spreads over the cp ranks
    "attention_pairs": (pa.int64(), "query-key pairs the busiest rank's attention computes in one forward of one "
                        "layer, max over the cp ranks"),
    "attention_pairs_per_rank": (_LIST_I64, "query-key pairs each rank's attention computes in one forward of one "
                                 "layer (what its mask keeps: causal, documents, windows)"),
    "attention_imbalance": (pa.float64(), "max / mean of attention_pairs_per_rank over the cp ranks (1: balanced)"),
    "attention_kernels": (pa.string(), "the kernels a projection priced the attention calls as (the ring's tiles "
                          "or the model's own call), forward calls per kernel, e.g. 'cudnn:12,efficient:4'; null "
                          "without a GPU profile"),
    # torch.compile
    "graph_breaks": (pa.int64(), "dynamo graph breaks in one compiled step, max over ranks (null: not compiled)"),
    "recompiles": (pa.int64(), "recompilations after the first step, max over ranks (null: not compiled)"),
    "compile_s": (pa.float64(), "the first step's compile time, max over ranks (kept out of the timed steps)"),
    # projected time (estimate --gpu: timing.py), the slowest projected rank
    "gpu_profile": (pa.string(), "the GPU profile a projection's time is priced on (a shipped name or a file's)"),
    "projected_step_s": (pa.float64(), "projected step time: the slowest rank's, every stream done"),
    "projected_compute_s": (pa.float64(), "of it: the compute stream busy with the model's kernels"),
    "projected_optimizer_s": (pa.float64(), "of it: the optimizer step"),
    "projected_comm_exposed_s": (pa.float64(), "of it: compute idle for collectives, and their tail"),
    "projected_transfer_exposed_s": (pa.float64(), "of it: offload copies on the compute stream, and waits for them"),
    "projected_overhead_s": (pa.float64(), "of it: compute idle for the host dispatching ops"),
    "projected_comm_s": (pa.float64(), "collectives' busy time, overlapped or not"),
    "projected_forward_s": (pa.float64(), "the step's start to its first backward op (the forward and the loss), "
                            "as a timer around the forward reads it (apart from the breakdown)"),
    "projected_backward_s": (pa.float64(), "from there to the optimizer step's first op (the backward, replayed "
                             "layers, the wait for the last gradient reduction)"),
    "projected_attention_s": (pa.float64(), "the step's time times the attention kernels' share of the GPU's "
                              "kernel time, collectives left out: a profiler's single-clock split (timing.py)"),
    "projected_tokens_per_s": (pa.float64(), "tokens of the global batch per projected second"),
    "projected_mfu": (pa.float64(), "model FLOPs utilisation at the projected step time, against the profile's peak"),
    "projected_pricing": (pa.string(), "how a projection priced the step: eager (each op) or fused (a compiled "
                          "point's element-wise chains fused), and a flash backend's point run as sdpa with its "
                          "attention priced as its own kernel"),
    # parity against the unsharded reference of the same weights and batch
    "parity_status": (pa.string(), "pass | fail | reference_oom | error | skipped"),
    "parity_detail": (pa.string(), "why parity is not pass, or null"),
    "parity_reference": (pa.string(), "where the reference ran: unsharded (rank 0 alone) | sharded (FSDP, no CP)"),
    "loss": (pa.float64(), "loss of the first step"),
    "ref_loss": (pa.float64(), "reference loss"),
    "loss_rel_err": (pa.float64(), "|loss - ref_loss| / |ref_loss|"),
    "logits_max_err": (pa.float64(), "max |logits - ref_logits| over all tokens"),
    "grad_max_rel_err": (pa.float64(), "worst per-parameter relative gradient error"),
    "grad_worst_param": (pa.string(), "the parameter with that error"),
    "loss_rtol": (pa.float64(), "tolerance the loss was judged against"),
    "logits_atol": (pa.float64(), "tolerance the logits were judged against"),
    "grad_rtol": (pa.float64(), "tolerance the gradients were judged against"),
    # environment
    "torch_version": (pa.string(), ""),
    "transformers_version": (pa.string(), ""),
    "cpbench_version": (pa.string(), ""),
    "cuda_version": (pa.string(), "null on CPU"),
    "driver_version": (pa.string(), "null on CPU"),
    "device_name": (pa.string(), "GPU name, or the CPU model"),
    "device_count": (pa.int64(), "GPUs visible (0 on CPU)"),
    "hardware_id": (pa.string(), "device_name x count: runs on different hardware are not compared"),
    "git_commit": (pa.string(), ""),
    "git_dirty": (pa.bool_(), ""),
    "host": (pa.string(), ""),
    "cpu_count": (pa.int64(), ""),
    "timestamp": (pa.string(), "ISO 8601 UTC, when the point finished"),
}

# version -> the columns added after it (a file of that version is read with them null)
_V9 = ("documents", "compile", "step_time_per_rank_s", "slowest_rank", "attention_pairs", "attention_pairs_per_rank",
       "attention_imbalance", "attention_kernels", "graph_breaks", "recompiles", "compile_s", "projected_pricing")
_V11 = ("projected_forward_s", "projected_backward_s")
_V12 = ("projected_attention_s",)
ADDED_IN = {8: [name for name in COLUMNS if (name == "gpu_profile" or name.startswith("projected_"))
                and name not in _V9 + _V11 + _V12],
            9: list(_V9), 10: ["balance"], 11: list(_V11), 12: list(_V12), 13: ["recompute_policy"],
            14: ["norm"], 15: ["optimizer", "max_grad_norm"], 16: ["loop"]}
# version -> the columns added after it (a file of that version is read with them null, or with DEFAULTS)
ADDED_SINCE = {v: [name for later, names in ADDED_IN.items() if later > v for name in names]
               for v in range(7, SCHEMA_VERSION)}
# What an older file's rows had, for the added columns that identify a point: no documents, no compile, the zigzag
# balanced by documents, whole layers recomputed, the eager norm, torch's default AdamW, no clipping, cpbench's own
# loop.
DEFAULTS = {"documents": "none", "compile": "off", "balance": "documents", "recompute_policy": "full",
            "norm": "eager", "optimizer": "foreach", "max_grad_norm": 0.0, "loop": "own"}

ARROW_SCHEMA = pa.schema(
    [pa.field(name, typ) for name, (typ, _) in COLUMNS.items()],
    metadata={b"cpbench_schema_version": str(SCHEMA_VERSION).encode()},
)

# The fields of a point's spec that identify it across runs (a baseline and a new run match on these).
KEY_COLUMNS = (
    "model", "seq_len", "batch_size", "batch_kind", "cp_size", "fsdp_size", "dp_replicate_size",
    "attn_implementation", "cp_style", "dtype", "device", "keep_outputs", "loss_mode", "activation_checkpointing",
    "mixed_precision", "level", "implementation", "cp_ulysses_degree", "recompute_every_n_layers",
    "offload_activations", "offload_params", "tiled_mlp", "documents", "compile", "balance", "recompute_policy", "norm",
    "optimizer", "max_grad_norm", "loop",
)


def describe() -> str:
    """The schema as a Markdown table (for the README)."""
    lines = ["| column | type | meaning |", "|---|---|---|"]
    lines += [f"| `{n}` | {t} | {d} |" for n, (t, d) in COLUMNS.items()]
    return "\n".join(lines)
