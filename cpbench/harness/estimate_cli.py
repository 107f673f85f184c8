"""`cpbench estimate`: argument parsing and printing, and the suite that `--model` / `--seq` / `--cp` build without a
suite file; the work is in project/estimate.py. Shares the sweep's flags and exit codes (commands.py)."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

from cpbench.harness.commands import (BALANCE_HELP, COMPILE_HELP, CP_PLAN_HELP, DOCUMENTS_HELP, _exit_code,
                                      _suite_with_flags, add_optimizer_flags)

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
    est.add_argument("--gpus-per-node", type=int, default=8,
                     help="ranks per node, for --host-memory: ranks 0..N-1 share node 0's host memory (default 8)")
    est.add_argument("--max-seq", action="store_true",
                     help="per configuration, search the largest length that fits both capacities (see "
                          "--granularity)")
    est.add_argument("--granularity", type=int, default=1024, help="tokens: the --max-seq search's step (1024)")
    est.add_argument("--jobs", type=int, default=None,
                     help="worker processes, one (point, rank) projection each (default: the CPUs, at most 8)")
    est.add_argument("--out", type=Path, default=Path("results"), help="results folder (default: results)")
    est.add_argument("--run-name", dest="run", default=None, help="run folder name (default: a UTC timestamp)")
    est.add_argument("--wait", action="store_true",
                     help="another process is writing the run: wait for it to finish (default: refuse, naming it)")
    quick = est.add_argument_group("one model without a suite file")
    quick.add_argument("--model", default=None, help="a preset, e.g. qwen3-0.6b")
    quick.add_argument("--seq", default=None, help="lengths, e.g. 16384,32768")
    quick.add_argument("--cp", default="1,2", help="cp sizes (default 1,2)")
    quick.add_argument("--attn", default=None, help="attention backends (default: sdpa, or eager for a family "
                                                      "without sdpa, as transformers picks)")
    quick.add_argument("--styles", default="cp_ulysses,cp_ring_zigzag",
                       help="CP styles at cp > 1 (default cp_ulysses,cp_ring_zigzag)")
    quick.add_argument("--dtype", default="bfloat16", help="float32 | bfloat16 | float16 (default bfloat16)")
    quick.add_argument("--device", default="cuda", help="the device projected: its kernels (default cuda)")
    quick.add_argument("--world-size", type=int, default=None, help="ranks; fsdp fills what cp leaves")
    quick.add_argument("--batch-kind", default="plain", help="plain | packed | padded")
    quick.add_argument("--batch-size", type=int, default=1, help="sequences per data-parallel replica (default 1)")
    quick.add_argument("--loss", default="full", help="full | chunked (the output projection and loss in chunks)")
    quick.add_argument("--recompute", action="store_true", help="activation checkpointing of every decoder layer")
    quick.add_argument("--recompute-every", type=int, default=1, metavar="N",
                       help="with --recompute: recompute every N-th decoder layer only (default 1: every layer)")
    quick.add_argument("--recompute-policy", default="full", choices=("full", "op"),
                       help="with --recompute: full (whole layers, the default) | op (each recomputed layer keeps its "
                            "attention kernels' and every other matmul's outputs: torchtitan's selective op recompute)")
    quick.add_argument("--norm", default="eager", choices=("eager", "fused"),
                       help="the model's RMSNorms: eager (transformers', the default) | fused (one op forward and one "
                            "backward: cpbench.use_fused_norm)")
    add_optimizer_flags(quick, "the step")
    quick.add_argument("--offload-activations", action="store_true",
                       help="with --recompute: the recompute checkpoints in pinned host memory")
    quick.add_argument("--offload-params", action="store_true",
                       help="FSDP2's CPU offload: parameters, gradients and optimizer state on the host")
    quick.add_argument("--tiled-mlp", nargs="?", const="auto", default=None, metavar="TILES",
                       help="each layer's MLP over tiles of the sequence: a tile count, or auto (the default when "
                            "the flag is given alone: tiles whose largest intermediate stays within 1 GiB)")
    quick.add_argument("--mixed-precision", action="store_true",
                       help="FSDP2 mixed precision: fp32 master weights, bf16 compute (--dtype bfloat16)")
    est.add_argument("--cp-plan", default=None, metavar="JSON|STYLE", help=CP_PLAN_HELP)
    est.add_argument("--documents", default=None, metavar="MIX|LENGTHS", help=DOCUMENTS_HELP)
    est.add_argument("--compile", nargs="?", const="on", default=None, metavar="MODE", help=COMPILE_HELP)
    est.add_argument("--balance", choices=("documents", "sequence"), default=None, help=BALANCE_HELP)
    quick.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                       help="a model config value (repeatable), e.g. max_position_embeddings=1048576")
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


def _quick_suite(args):
    from cpbench.harness.suite.spec import load_suite
    from cpbench.harness.suite.grid_checks import default_backend
    from cpbench.harness.suite.suite_errors import in_flags

    from cpbench.harness.suite.suites import resolve_suite

    if args.suite is not None:
        if args.model is not None:
            raise ValueError("give a suite file or --model, not both")
        if args.documents is not None or args.compile is not None or args.balance is not None:
            return resolve_suite(_suite_with_flags(args), cp_plan=args.cp_plan)
        return resolve_suite(args.suite, cp_plan=args.cp_plan)
    if args.model is None or args.seq is None:
        raise ValueError("give a suite file, or --model and --seq (e.g. --model qwen3-0.6b --seq 16384,32768)")
    # The run's name from the model's last path component: a path or hub id given as --model is not a name.
    given = Path(args.model.rstrip("/"))
    given = given.parent if given.name == "config.json" else given
    short = re.sub(r"[^A-Za-z0-9._-]+", "-", given.name).strip("-") or "model"
    fields = {"name": f"estimate-{short}", "model": args.model, "seq_lens": _ints("--seq", args.seq),
              "cp_sizes": _ints("--cp", args.cp),
              "attn_implementations": _names(args.attn) if args.attn else [default_backend(args.model)],
              "cp_styles": _names(args.styles), "dtype": args.dtype, "device": args.device,
              "batch_kind": args.batch_kind, "batch_size": args.batch_size, "loss": args.loss,
              "activation_checkpointing": args.recompute,
              "mixed_precision": args.mixed_precision, "recompute_every_n_layers": args.recompute_every,
              "recompute_policy": args.recompute_policy, "norm": args.norm, "optimizer": args.optimizer,
              "max_grad_norm": args.max_grad_norm,
              "offload_activations": args.offload_activations, "offload_params": args.offload_params,
              "warmup_steps": 1, "measured_steps": 1}
    if args.compile is not None:
        fields["compile"] = args.compile
    if args.balance is not None:
        fields["balance"] = args.balance
    if args.tiled_mlp is not None:
        fields["tiled_mlp"] = "auto" if args.tiled_mlp == "auto" else _ints("--tiled-mlp", args.tiled_mlp)[0]
    if args.world_size is not None:
        fields["world_size"] = args.world_size
    text = "\n".join(f"{k} = {_toml(v)}" for k, v in fields.items())
    if args.override:
        text += "\nmodel_overrides = {" + ", ".join(_override(o) for o in args.override) + "}"
    overrides = {}
    if args.cp_plan is not None:
        from cpbench.harness.suite.presets import get_preset, plan_from_flag

        overrides["cp_plan"] = plan_from_flag(args.cp_plan, get_preset(args.model))
    if args.documents is not None:
        from cpbench.harness.suite import documents

        overrides["documents"] = documents.parse(args.documents)
    try:
        return load_suite(f"--model {args.model}", text=text, overrides=overrides)
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


def _ints(flag: str, text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: give comma-separated integers, e.g. 16384,32768") from None


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _toml(value) -> str:
    import json

    return json.dumps(value)  # lists of ints/strings and strings: JSON is TOML here


def estimate_command(args) -> int:
    from cpbench.harness.project.estimate import EstimateOptions, run_estimate
    from cpbench.harness.project.record import record_block
    from cpbench.harness.run.summary import summary_table
    from cpbench.report.runs import store
    from cpbench.report.tables import fits

    t0 = time.perf_counter()
    try:
        suite = _quick_suite(args)
        opts = EstimateOptions(suite=suite, out=args.out, run=args.run, device_memory=args.device_memory,
                               host_memory=args.host_memory, gpus_per_node=args.gpus_per_node, max_seq=args.max_seq,
                               granularity=args.granularity, jobs=args.jobs, gpu=args.gpu,
                               sdpa_kernel=args.sdpa_kernel, wait=args.wait)
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
