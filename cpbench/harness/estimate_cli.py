"""`cpbench estimate`: argument parsing and printing, and the suite that `--model` / `--seq` / `--cp` build without a
suite file; the work is in project/estimate.py. Shares the sweep's flags and exit codes (commands.py)."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

from cpbench.harness.commands import (BALANCE_HELP, COMPILE_HELP, CP_PLAN_HELP, DOCUMENTS_HELP, _exit_code,
                                      add_optimizer_flags)
from cpbench.harness.suite.choices import BATCH_KINDS, DEVICES, DTYPES, LOSSES

# The suite field each flag sets: a suite built from flags has its errors said in these words (suite_errors.in_flags).
FLAGS = {"model": "--model", "seq_lens": "--seq", "cp_sizes": "--cp", "attn_implementations": "--attn",
         "cp_styles": "--styles", "dtype": "--dtype", "device": "--device", "batch_kind": "--batch-kind",
         "batch_size": "--batch-size", "loss": "--loss", "activation_checkpointing": "--recompute",
         "mixed_precision": "--mixed-precision", "recompute_every_n_layers": "--recompute-every",
         "recompute_policy": "--recompute-policy", "norm": "--norm", "optimizer": "--optimizer",
         "max_grad_norm": "--max-grad-norm", "offload_activations": "--offload-activations",
         "offload_params": "--offload-params", "compile": "--compile", "balance": "--balance",
         "tiled_mlp": "--tiled-mlp", "world_size": "--world-size", "cp_plan": "--cp-plan",
         "documents": "--documents", "model_overrides": "--override"}


def register(subparsers) -> None:
    est = subparsers.add_parser(
        "estimate", help="project a suite's points (fake tensors, fake process group): memory per rank, no GPU",
        description="Project a suite's points: cpbench's own step on fake tensors against a fake process group, in "
                    "this process, into results/<suite>/<run>/runs.parquet (measurement = projected). Give a suite "
                    "file, or --model/--seq/--cp for one model without a suite. Exit status: 1 when a point's "
                    "projection is an `error`; 0 otherwise (`oom` and `skipped` are results); 2 for bad arguments.")
    est.add_argument("suite", nargs="?", default=None, help="suite file (or use --model)")
    est.add_argument("--gpu", default=None, metavar="NAME|FILE",
                     help="price each projected step on this GPU: step time, its breakdown, tokens/s, MFU "
                          "(h100-sxm, h100-pcie, h200, a100-sxm, b200, or a profile file from `cpbench calibrate`); "
                          "its memory is the capacity unless --device-memory or the suite's memory_budget is given")
    est.add_argument("--sdpa-kernel", default=None, choices=("flash", "cudnn", "efficient"),
                     help="with --gpu: the kernel a model's own SDPA call runs (default: the profile's, what torch "
                          "picks there today: cudnn on H100/H200/B200 with torch >= 2.10, flash on A100)")
    est.add_argument("--device-memory", default=None,
                     help="capacity per rank, e.g. 80GiB: a point whose projected peak passes it is `oom` "
                          "(default: the suite's memory_budget, else the --gpu profile's memory)")
    est.add_argument("--host-memory", default=None,
                     help="host memory per node, e.g. 2TiB: a point whose node's ranks hold more on the host "
                          "(offloaded checkpoints, parameters, gradients, optimizer state) is `oom` (default: none)")
    est.add_argument("--gpus-per-node", type=int, default=None,
                     help="ranks per node (default 8): ranks 0..N-1 share node 0's host memory (each row's "
                          "host_node_peak_bytes, and --host-memory's check), and --gpu prices collectives across "
                          "nodes")
    est.add_argument("--max-seq", action="store_true",
                     help="per configuration, search the largest length that fits both capacities (see "
                          "--granularity)")
    est.add_argument("--granularity", type=int, default=None, help="tokens: the --max-seq search's step (1024)")
    est.add_argument("--jobs", type=int, default=None,
                     help="worker processes, one (point, rank) projection each (default: the CPUs, at most 8)")
    est.add_argument("--out", type=Path, default=Path("results"), help="results folder (default: results)")
    est.add_argument("--run-name", dest="run", default=None, help="run folder name (default: a UTC timestamp)")
    est.add_argument("--wait", action="store_true",
                     help="another process is writing the run: wait for it to finish (default: refuse, naming it)")
    quick = est.add_argument_group(
        "one model, or a suite's fields", "with --model, the suite these flags build (each flag's default in its "
        "help); with a suite file, each flag given sets its field in place of the file's (--override adds to its "
        "model_overrides), and the run's rows record what ran")
    quick.add_argument("--model", default=None, metavar="PRESET|CONFIG",
                       help="a preset (e.g. qwen3-0.6b), a Hugging Face config.json or a directory holding one, or a "
                            "hub id whose config is in the local cache (nothing is downloaded)")
    quick.add_argument("--seq", default=None, type=_int_list, help="lengths, e.g. 16384,32768")
    quick.add_argument("--cp", default=None, type=_int_list, help="cp sizes (default 1,2)")
    quick.add_argument("--attn", default=None, help="attention backends (default: sdpa, or eager for a family "
                                                      "without sdpa, as transformers picks)")
    quick.add_argument("--styles", default=None, help="CP styles at cp > 1 (default cp_ulysses,cp_ring_zigzag)")
    quick.add_argument("--dtype", default=None, choices=DTYPES, help="(default bfloat16)")
    quick.add_argument("--device", default=None, choices=DEVICES, help="the device projected: its kernels (default "
                                                                        "cuda)")
    quick.add_argument("--world-size", type=int, default=None, help="ranks; fsdp fills what cp leaves")
    quick.add_argument("--batch-kind", default=None, choices=BATCH_KINDS, help="(default plain)")
    quick.add_argument("--batch-size", type=int, default=None, help="sequences per data-parallel replica (default 1)")
    quick.add_argument("--loss", default=None, choices=LOSSES,
                       help="full (the default) | chunked (the output projection and loss in chunks) | liger")
    quick.add_argument("--recompute", action="store_true", default=None,
                       help="activation checkpointing of every decoder layer")
    quick.add_argument("--recompute-every", type=int, default=None, metavar="N",
                       help="with --recompute: recompute every N-th decoder layer only (default 1: every layer)")
    quick.add_argument("--recompute-policy", default=None, choices=("full", "op"),
                       help="with --recompute: full (whole layers, the default) | op (each recomputed layer keeps its "
                            "attention kernels' and every other matmul's outputs: torchtitan's selective op recompute)")
    quick.add_argument("--norm", default=None, choices=("eager", "fused"),
                       help="the model's RMSNorms: eager (transformers', the default) | fused (one op forward and one "
                            "backward: cpbench.use_fused_norm)")
    add_optimizer_flags(quick, "the step")
    quick.add_argument("--offload-activations", action="store_true", default=None,
                       help="with --recompute: the recompute checkpoints in pinned host memory")
    quick.add_argument("--offload-params", action="store_true", default=None,
                       help="FSDP2's CPU offload: parameters, gradients and optimizer state on the host")
    quick.add_argument("--tiled-mlp", nargs="?", const="auto", default=None, metavar="TILES",
                       help="each layer's MLP over tiles of the sequence: a tile count, or auto (the default when "
                            "the flag is given alone: tiles whose largest intermediate stays within 1 GiB)")
    quick.add_argument("--mixed-precision", action="store_true", default=None,
                       help="FSDP2 mixed precision: fp32 master weights, bf16 compute (--dtype bfloat16)")
    est.add_argument("--cp-plan", default=None, metavar="JSON|STYLE", help=CP_PLAN_HELP)
    est.add_argument("--documents", default=None, metavar="MIX|LENGTHS", help=DOCUMENTS_HELP)
    est.add_argument("--compile", nargs="?", const="on", default=None, metavar="MODE", help=COMPILE_HELP)
    est.add_argument("--balance", choices=("documents", "sequence"), default=None, help=BALANCE_HELP)
    quick.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                       help="a model config value (repeatable), e.g. max_position_embeddings=1048576")
    est.set_defaults(optimizer=None, max_grad_norm=None)  # given or not: a suite file keeps its own
    est.set_defaults(func=estimate_command)


def ulysses_mask_hint(points) -> str | None:
    """What to say where a cp_ulysses point runs the model's S x S mask (a sliding window, packed documents) through
    SDPA or eager attention (flash attention takes the window itself): cp_usp at degree cp runs without it."""
    from cpbench.harness.project.plan import masked
    from cpbench.harness.suite.presets import get_preset

    for p in points:
        if p.cp_style == "cp_ulysses" and \
                masked(get_preset(p.preset).config(p.model_overrides), p.documents, p.attn_implementation):
            return (f"{p.point_id}: cp_ulysses hands the model's own attention its whole S x S mask (a sliding "
                    "window, or packed documents), which its masked kernel copies in every layer; cp_usp with "
                    "cp_ulysses_degree = cp (--styles cp_usp) runs the same all-to-all on the ring's kernel, which "
                    "builds no such mask.")
    return None


# What the quick form uses for a flag not given; with a suite file, a flag not given keeps the file's value.
QUICK_DEFAULTS = {"cp_sizes": [1, 2], "cp_styles": ["cp_ulysses", "cp_ring_zigzag"], "dtype": "bfloat16",
                  "device": "cuda", "batch_kind": "plain", "batch_size": 1, "loss": "full",
                  "activation_checkpointing": False, "mixed_precision": False, "recompute_every_n_layers": 1,
                  "recompute_policy": "full", "norm": "eager", "optimizer": "foreach", "max_grad_norm": 0.0,
                  "offload_activations": False, "offload_params": False, "warmup_steps": 1, "measured_steps": 1}


def flag_fields(args) -> dict:
    """The suite fields the flags given set (a flag not given sets nothing): {field: value}."""
    value = {"seq_lens": args.seq, "cp_sizes": args.cp, "attn_implementations": args.attn and _names(args.attn),
             "cp_styles": args.styles and _names(args.styles), "dtype": args.dtype, "device": args.device,
             "batch_kind": args.batch_kind, "batch_size": args.batch_size, "loss": args.loss,
             "activation_checkpointing": args.recompute, "mixed_precision": args.mixed_precision,
             "recompute_every_n_layers": args.recompute_every, "recompute_policy": args.recompute_policy,
             "norm": args.norm, "optimizer": args.optimizer, "max_grad_norm": args.max_grad_norm,
             "offload_activations": args.offload_activations, "offload_params": args.offload_params,
             "compile": args.compile, "balance": args.balance, "world_size": args.world_size,
             "tiled_mlp": None if args.tiled_mlp is None else
             "auto" if args.tiled_mlp == "auto" else _int_list(args.tiled_mlp, "--tiled-mlp")[0]}
    fields = {k: v for k, v in value.items() if v is not None}
    if args.documents is not None:
        from cpbench.harness.suite import documents

        fields["documents"] = documents.parse(args.documents)
    if args.override:
        import tomllib

        fields["model_overrides"] = tomllib.loads("\n".join(_override(o) for o in args.override))
    return fields


def _quick_suite(args):
    from cpbench.harness.suite.grid_checks import default_backend
    from cpbench.harness.suite.spec import load_suite
    from cpbench.harness.suite.suite_errors import in_flags

    given = flag_fields(args)
    flags = {f: FLAGS[f] for f in given}  # a suite file's own fields keep their names in its errors
    if args.suite is not None:
        if args.model is not None:
            raise ValueError("give a suite file or --model, not both")
        from cpbench.harness.suite.suites import resolve_suite

        try:
            return resolve_suite(args.suite, cp_plan=args.cp_plan, fields=given)
        except ValueError as e:
            raise in_flags(e, {**flags, "cp_plan": "--cp-plan"} if args.cp_plan else flags) from None
    if args.model is None or args.seq is None:
        raise ValueError("give a suite file, or --model and --seq (e.g. --model qwen3-0.6b --seq 16384,32768)")
    # The run's name from the model's last path component: a path or hub id given as --model is not a name.
    named = Path(args.model.rstrip("/"))
    named = named.parent if named.name == "config.json" else named
    short = re.sub(r"[^A-Za-z0-9._-]+", "-", named.name).strip("-") or "model"
    fields = {"name": f"estimate-{short}", "model": args.model,
              "attn_implementations": [default_backend(args.model)], **QUICK_DEFAULTS, **given}
    if args.cp_plan is not None:
        from cpbench.harness.suite.presets import get_preset, plan_from_flag

        fields["cp_plan"] = plan_from_flag(args.cp_plan, get_preset(args.model))
    try:
        return load_suite(f"--model {args.model}", text="", overrides=fields)
    except ValueError as e:
        raise in_flags(e, FLAGS) from None


def _override(text: str) -> str:
    """KEY=VALUE -> a TOML inline-table entry, the value read as TOML (a number, true/false, or a quoted string)."""
    import tomllib

    key, sep, value = text.partition("=")
    try:
        valid = bool(sep) and key.strip().isidentifier() and tomllib.loads(f"v = {value}") is not None
    except tomllib.TOMLDecodeError:
        valid = False
    if not valid:
        raise ValueError(f"--override {text!r}: write KEY=VALUE with a TOML value, e.g. "
                         "max_position_embeddings=1048576 or rope_scaling_type=\"linear\"")
    return f"{key.strip()} = {value.strip()}"


def _int_list(text: str, flag: str = "") -> list[int]:
    """Comma-separated integers (an argparse type: a wrong one is refused before anything is imported)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values:
        import argparse

        raise argparse.ArgumentTypeError(f"{flag + ' ' if flag else ''}{text!r}: give comma-separated integers, "
                                         "e.g. 16384,32768")
    return values


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def estimate_options(args):
    """The projection the arguments ask for: the suite (a file's, with the flags given in place of its fields, or the
    one --model and the flags build) and every other option."""
    from cpbench.harness.project.estimate import EstimateOptions

    return EstimateOptions(suite=_quick_suite(args), out=args.out, run=args.run, device_memory=args.device_memory,
                           host_memory=args.host_memory, gpus_per_node=args.gpus_per_node, max_seq=args.max_seq,
                           granularity=args.granularity, jobs=args.jobs, gpu=args.gpu, sdpa_kernel=args.sdpa_kernel,
                           wait=args.wait)


def estimate_command(args) -> int:
    from cpbench.harness.project.estimate import run_estimate
    from cpbench.harness.project.record import record_block
    from cpbench.harness.run.summary import summary_table
    from cpbench.report.runs import store
    from cpbench.report.tables import fits

    t0 = time.perf_counter()
    try:
        opts = estimate_options(args)
        suite = opts.suite
        run_dir = run_estimate(opts, on_row=lambda row: print(f"  {row['point_id']}: {row['status']}", flush=True))
    except ValueError as e:
        print(f"cpbench estimate: {e}", file=sys.stderr)
        return 2
    df = store.read_run(run_dir)
    print(summary_table(df))
    if df["memory_budget_bytes"].isna().all():
        print("\nno capacity given (--gpu, --device-memory, or the suite's memory_budget): no point was checked "
              "against a device's memory, so `ok` says only that the step projected; give --gpu h100-sxm or "
              "--device-memory 80GiB to check.")
    if args.gpu is None:
        print("no --gpu given: no time projected; give --gpu h100-sxm (or a100-sxm, h200, ...) for step times.")
    hint = ulysses_mask_hint(suite.points())
    if hint:
        print(f"\n{hint}")
    record = record_block(df)
    if record:
        print(f"\n{record}")
    if (df["host_node_peak_bytes"].fillna(0) > 0).any() and df["host_memory_budget_bytes"].isna().all():
        print("no host capacity given (--host-memory): the host memory of a node (host/node) was not checked; give "
              "--host-memory 2TiB to check.")
    if args.max_seq:
        print("\nlargest length that fits (projected), per configuration:")
        print(fits(df).to_string(index=False))
    print(f"\n{len(df)} projected points in {store.runs_path(run_dir)} ({time.perf_counter() - t0:.0f}s)")
    errors = [f"{r['point_id']}: error" for r in df.to_dict("records") if r["status"] == "error"]
    return _exit_code(errors, "estimate")
