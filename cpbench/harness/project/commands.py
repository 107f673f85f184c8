"""`cpbench plan` and `cpbench calibrate`: argument parsing and printing; the work is in plan.py and calibrate.py."""

from __future__ import annotations

import sys
import time
from pathlib import Path


def register(subparsers) -> None:
    from cpbench.harness.commands import add_optimizer_flags

    plan = subparsers.add_parser(
        "plan", help="the configurations that fit a model at a length on N GPUs, ranked by projected speed",
        description="Search cp size, CP style, backend and memory levers for a model at one length on a machine, "
                    "projecting each (memory on device and host, and time on the GPU profile), and print the "
                    "configurations that fit, fastest first, with what reproduces them. Exit status 2 for bad "
                    "arguments, 1 when nothing fits.")
    plan.add_argument("--model", required=True, help="a preset, e.g. llama-3-8b")
    plan.add_argument("--seq", required=True, type=int, help="tokens per sequence, e.g. 1048576")
    plan.add_argument("--gpus", required=True, type=int, help="GPUs in all (the world size)")
    plan.add_argument("--gpu", required=True, metavar="NAME|FILE", help="GPU profile: h100-sxm, h100-pcie, h200, "
                      "a100-sxm, b200, or a file from `cpbench calibrate`")
    plan.add_argument("--nodes", type=int, default=1, help="nodes the GPUs are spread over (default 1)")
    plan.add_argument("--host-memory", default=None, help="host memory per node, e.g. 2TiB (default: not checked)")
    plan.add_argument("--device-memory", default=None, help="memory per GPU (default: the profile's)")
    plan.add_argument("--headroom", default="4GiB",
                      help="memory per GPU a configuration must leave free of its projected peak, for what a "
                           "projection does not see: the CUDA context, NCCL's buffers, fragmentation (default 4GiB)")
    plan.add_argument("--styles", default="cp_ulysses,cp_ring_zigzag,cp_usp",
                      help="CP styles searched (default cp_ulysses,cp_ring_zigzag,cp_usp: USP at each Ulysses degree)")
    plan.add_argument("--attn", default=None, help="attention backends searched (default: sdpa, or eager for a "
                                                    "family without sdpa, as transformers picks)")
    plan.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                      help="a model config value (repeatable), e.g. max_position_embeddings=1048576")
    plan.add_argument("--min-gain", type=float, default=0.02,
                      help="skip a smaller cp that could beat the best found by less than this fraction (0.02)")
    plan.add_argument("--top", type=int, default=10, help="configurations printed (default 10)")
    plan.add_argument("--out", type=Path, default=None,
                      help="write each configuration that fits as a runnable suite file in this folder")
    plan.add_argument("--results", type=Path, default=Path("results"), help="results folder for the search's run")
    plan.add_argument("--jobs", type=int, default=2, help="projections side by side (default 2)")
    plan.add_argument("--no-prune", action="store_true",
                      help="project every configuration the memory floor allows (slower; the same ranking)")
    plan.add_argument("--documents", default=None, metavar="MIX|LENGTHS",
                      help="packed documents: a shipped mix (meta-128k, prolong-64k, llama3-sft, longalign, pile) or "
                           "lengths summing to --seq (e.g. 500000,300000,248576; pad:N for N padded tokens)")
    plan.add_argument("--cp-plan", default=None, metavar="JSON|STYLE",
                      help="the CP plan's shape for a family without a default plan (docs/families.md): a JSON object "
                           "of module pattern -> style, or a style name for the default plan's shape; each searched "
                           "configuration puts its own style on the attention entries")
    plan.add_argument("--norm", default="eager", choices=("eager", "fused"),
                      help="the model's RMSNorms in every configuration searched: eager (transformers', the default) | "
                           "fused (one op each way: cpbench.use_fused_norm; less memory kept, fewer kernels)")
    add_optimizer_flags(plan, "every configuration searched")
    plan.set_defaults(func=plan_command)

    cal = subparsers.add_parser(
        "calibrate", help="fit the time model's efficiencies to a measured GPU sweep; write a GPU profile",
        description="Project every measured `ok` point of a run (keeping its op trace), fit the efficiencies and "
                    "per-op overheads of a GPU profile so the projected step times meet the measured ones, and "
                    "write the fitted profile (for --gpu FILE). Points named by --holdout are not fitted: their "
                    "error is the honest one.")
    cal.add_argument("run", help="a run folder or runs.parquet of measured points")
    cal.add_argument("--gpu", required=True, metavar="NAME|FILE", help="the profile to start from")
    cal.add_argument("--out", type=Path, required=True, help="the profile file to write, e.g. my-h100.toml")
    cal.add_argument("--name", default=None, help="the profile's name (default: the file's stem)")
    cal.add_argument("--holdout", action="append", default=[], metavar="POINT_ID",
                     help="a point kept out of the fit (repeatable); its error is reported apart")
    cal.add_argument("--gpus-per-node", type=int, default=None,
                     help="GPUs per node of the measured run (default: the GPUs it saw, its device_count)")
    cal.add_argument("--any-device", action="store_true",
                     help="fit the profile to a run measured on another GPU than the profile's (refused otherwise)")
    cal.set_defaults(func=calibrate_command)


def _overrides(items: list[str]) -> dict:
    import tomllib

    from cpbench.harness.estimate_cli import _override

    return tomllib.loads("\n".join(_override(o) for o in items)) if items else {}


def _documents(text: str | None):
    from cpbench.harness.suite import documents

    return documents.NONE if text is None else documents.parse(text)


def plan_options(args):
    """The search the arguments ask for (--top and --out only shape what is printed and written after it)."""
    from cpbench.harness.project.plan import PlanOptions
    from cpbench.harness.suite.grid_checks import default_backend

    cp_plan = None
    if args.cp_plan is not None:
        from cpbench.harness.suite.presets import get_preset, plan_from_flag

        cp_plan = plan_from_flag(args.cp_plan, get_preset(args.model))
    return PlanOptions(cp_plan=cp_plan, model=args.model, seq=args.seq, gpus=args.gpus, gpu=args.gpu, nodes=args.nodes,
                       host_memory=args.host_memory, device_memory=args.device_memory, headroom=args.headroom,
                       styles=tuple(s.strip() for s in args.styles.split(",") if s.strip()),
                       attn=tuple(a.strip() for a in (args.attn or default_backend(args.model)).split(",")
                                  if a.strip()),
                       overrides=_overrides(args.override), min_gain=args.min_gain, out=args.results,
                       jobs=args.jobs, documents=_documents(args.documents), norm=args.norm,
                       optimizer=args.optimizer, max_grad_norm=args.max_grad_norm, prune=not args.no_prune)


def plan_command(args) -> int:
    from cpbench.harness.project.record import record_block
    from cpbench.harness.project.plan import ranked, run_plan
    from cpbench.report.runs import store

    t0 = time.perf_counter()
    try:
        opts = plan_options(args)
        run_dir, search = run_plan(opts, on_row=lambda r: print(f"  {r['point_id']}: {r['status']}", flush=True))
    except ValueError as e:
        print(f"cpbench plan: {e}", file=sys.stderr)
        return 2
    df = store.read_run(run_dir)
    best = ranked(df).head(args.top)
    print(plan_table(best))
    record = record_block(best)  # the ranking's absolute times: how far they ran from published ones of that regime
    if record:
        print(f"\n{record}")
    if len(best):
        print("\n#1 in a training loop: from_pretrained(..., distributed_config=cpbench." + _config(best.iloc[0]) + ")"
              + "".join(f"; {call}" for call in _model_calls(best.iloc[0])))
    if search.pruned:
        print("\nnot projected:")
        print("\n".join(f"  {p}" for p in search.pruned))
    if args.out is not None and len(best):
        args.out.mkdir(parents=True, exist_ok=True)
        for i, r in enumerate(best.to_dict("records"), 1):
            path = args.out / f"{i:02d}-cp{r['cp_size']}-{r['cp_style']}.toml"
            path.write_text(f"# cpbench plan rank {i}: {r['point_id']}\n" + search.suites[r["point_id"]])
        print(f"\n{len(best)} suites in {args.out}/ (run one: python -m cpbench sweep {args.out}/01-...toml)")
    print(f"\n{len(df)} configurations projected in {store.runs_path(run_dir)} ({time.perf_counter() - t0:.0f}s)")
    return 0 if len(best) else 1


def plan_table(best) -> str:
    from cpbench.harness.run.summary import _render
    from cpbench.report.units import gib, seconds, sig

    header = ["#", "cp", "style", "levers", "peak/GPU", "host/node", "step", "compute", "comm exp.", "xfer exp.",
              "tok/s/GPU", "MFU", "DistributedConfig"]
    lines = []
    for i, r in enumerate(best.to_dict("records"), 1):
        style = r["cp_style"] + (f" (ulysses {r['cp_ulysses_degree']})" if r["cp_style"] == "cp_usp" else "")
        recompute = "recompute" + (" (op)" if r.get("recompute_policy", "full") == "op" else "")
        levers = [n for n, on in ((recompute, r["activation_checkpointing"]), ("chunked loss",
                  r["loss_mode"] == "chunked"), ("offload act.", r["offload_activations"]),
                  ("tiled MLP", r["tiled_mlp"] not in (None, "off", "")), ("offload params", r["offload_params"]),
                  ("fused norm", r.get("norm") == "fused"), ("fused AdamW", r.get("optimizer") == "fused"),
                  ("clipped", bool(r.get("max_grad_norm"))))
                  if on]
        config = _config(r)
        host = r.get("host_node_peak_bytes")
        lines.append([i, r["cp_size"], style, ", ".join(levers) or "none", gib(r["peak_bytes"]),
                      gib(host) if host else "-", seconds(r["projected_step_s"]), seconds(r["projected_compute_s"]),
                      seconds(r["projected_comm_exposed_s"]), seconds(r["projected_transfer_exposed_s"]),
                      sig(r["tokens_per_s_per_gpu"]), f"{100 * r['projected_mfu']:.1f}%", config])
    return _render(header, lines) if lines else "nothing fits"


def _config(r) -> str:
    return (f"DistributedConfig(fsdp_size={r['fsdp_size']}, cp_size={r['cp_size']}"
            + (f", cp_plan={_attention_entries(r)}" if r["cp_size"] > 1 else "")
            + (f", cp_ulysses_degree={r['cp_ulysses_degree']}" if r["cp_style"] == "cp_usp" else "")
            + (", fsdp_mixed_precision=True" if r["mixed_precision"] else "")
            + (", fsdp_cpu_offload=True" if r["offload_params"] else "") + ")")


def _attention_entries(r) -> dict:
    """The point's style on the attention entries of its plan (the suite's, or the family's from the audit)."""
    import json

    from cpbench.cp.families import table
    from cpbench.harness.suite.presets import base_model_prefix

    prefix = base_model_prefix(r["model_type"])
    plan = json.loads(r["spec_json"]).get("cp_plan") or {
        f"{prefix}.{k}" if prefix else k: v for k, v in (table.base_plan(r["model_type"]) or table.DEFAULT_PLAN).items()}
    return {k: r["cp_style"] for k, v in plan.items() if v != "cp_split_sequence"}


def _model_calls(r) -> list[str]:
    calls = ["cpbench.use_fused_norm(model)"] if r.get("norm") == "fused" else []
    if r["activation_checkpointing"] and r.get("recompute_policy", "full") != "full":
        calls.append(f"cpbench.use_recompute(model, {r['recompute_policy']!r}"
                     + (", offload=True" if r["offload_activations"] else "") + ")")
    elif r["activation_checkpointing"]:
        calls.append("model.activation_checkpointing_enable(" + ("offload=True" if r["offload_activations"] else "")
                     + ")")
    if r["tiled_mlp"] not in (None, "off", ""):
        calls.append(f"cpbench.use_tiled_mlp(model, {r['tiled_mlp']!r})")
    if r["loss_mode"] != "full":
        calls.append(f"cpbench.use_loss(model, {r['loss_mode']!r})")
    if r.get("balance") not in (None, "documents"):
        calls.append(f"cpbench.use_balance(model, {r['balance']!r})")
    if r.get("optimizer") == "fused":
        calls.append("torch.optim.AdamW(model.parameters(), fused=True)")
    return calls


def calibrate_command(args) -> int:
    from cpbench.harness.project.calibrate import calibrate, samples_of_run
    from cpbench.harness.project.hardware import load
    from cpbench.harness.run.summary import _render
    from cpbench.report.units import seconds

    try:
        base = load(args.gpu)
        if args.gpus_per_node is not None and args.gpus_per_node < 1:
            raise ValueError(f"--gpus-per-node {args.gpus_per_node}: give at least 1.")
        samples, note = samples_of_run(Path(args.run), args.gpus_per_node, base=base, any_device=args.any_device,
                                       progress=lambda pid: print(f"  traced {pid}", flush=True))
        hw, rows, errors = calibrate(samples, base, args.name or args.out.stem, args.holdout, run=str(args.run))
    except ValueError as e:
        print(f"cpbench calibrate: {e}", file=sys.stderr)
        return 2
    args.out.write_text(f"# written by cpbench calibrate from {args.run}\n" + hw.to_toml())
    header = ["point", "measured", f"projected ({base.name})", "projected (fitted)", "error", "held out"]
    lines = [[r["point_id"], seconds(r["measured_s"]), seconds(r["before_s"]), seconds(r["after_s"]),
              f"{100 * (r['after_s'] / r['measured_s'] - 1):+.1f}%", "yes" if r["held_out"] else ""] for r in rows]
    print(_render(header, lines))
    for part, label in (("fitted", "fitted on"), ("held_out", "held out")):
        e = errors[part]
        if e["points"]:
            print(f"{label} {e['points']} points: mean |error| {100 * e['mean_abs_error']:.1f} %, largest "
                  f"{100 * e['max_abs_error']:.1f} %" + ("  <- the honest one" if part == "held_out" else ""))
    if note:
        print(f"note: {note}")
    print(f"\nwrote {args.out}: use it with --gpu {args.out}")
    return 0
