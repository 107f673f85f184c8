"""`cpbench plan`: the configurations of a model at a length on a machine that fit, ranked by projected speed.

The search covers cp size (the powers of two up to the GPUs), style (Ulysses, the zigzag ring, USP at each
Ulysses degree; others on request), attention backend, and a ladder of memory levers, each rung keeping the ones
below (they only add time): none; recompute + chunked loss; + activation offload; + tiled MLP; + parameter offload.
Every configuration tried is a projected row of one run (estimate.py's machinery: memory on both sides, and time
on the GPU profile), so `cpbench report` reads the search.

Pruning, each said in the output:
- a rung whose analytic floor (`floor_bytes`) already passes the device's memory is not projected;
- per style, cp sizes are tried from the largest down and a smaller cp starts at the rung the larger one needed
  (it holds more per rank); when no rung fits at a cp, smaller ones are not tried;
- the first rung that fits ends a cp (the higher ones only add time);
- a smaller cp is not tried when it cannot be faster than the best found so far by `min_gain`: its compute per
  token is the larger cp's (the same work, split over the same GPUs), so its tokens/s are at most the larger
  cp's tokens over that cp's compute and optimizer time;
- USP runs after the other styles, and is not tried at a cp where the zigzag ring's bound is not above the best:
  its attention is the zigzag ring's, on groups of `degree` ranks (the same pairs, the same tile kernel), with
  all-to-alls on top.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from cpbench.harness.project.estimate import Estimator, run_chains
from cpbench.harness.project.hardware import load as load_hardware
from cpbench.harness.run.sweep import pick_run_dir, writing
from cpbench.harness.suite.presets import get_preset
from cpbench.harness.suite.spec import load_suite
from cpbench.report.units import parse_bytes

RUNGS = (
    {},
    {"activation_checkpointing": True, "loss": "chunked"},
    {"activation_checkpointing": True, "loss": "chunked", "offload_activations": True},
    {"activation_checkpointing": True, "loss": "chunked", "offload_activations": True, "tiled_mlp": "auto"},
    {"activation_checkpointing": True, "loss": "chunked", "offload_activations": True, "tiled_mlp": "auto",
     "offload_params": True},
)
RUNG_NAMES = ("none", "recompute + chunked loss", "+ activation offload", "+ tiled MLP", "+ parameter offload")


@dataclass(kw_only=True)
class PlanOptions:
    model: str
    seq: int
    gpus: int
    gpu: str
    nodes: int = 1
    host_memory: str | None = None
    device_memory: str | None = None
    headroom: str = "4GiB"  # kept free of the projected peak: the CUDA context, NCCL's buffers, fragmentation
    styles: tuple = ("cp_ulysses", "cp_ring_zigzag", "cp_usp")
    attn: tuple = ("sdpa",)
    dtype: str = "bfloat16"
    mixed_precision: bool = True
    overrides: dict = field(default_factory=dict)
    min_gain: float = 0.02
    out: Path = Path("results")
    run: str | None = None
    jobs: int = 2
    cp_plan: dict | None = None  # --cp-plan, resolved (presets.plan_from_flag): for a family without a default plan


def cp_sizes(gpus: int) -> list[int]:
    """The cp sizes searched on `gpus` GPUs: the powers of two that divide them, largest first."""
    return sorted((c for c in (2 ** i for i in range(12)) if c <= gpus and gpus % c == 0), reverse=True)


def candidates_for(opts: PlanOptions, config) -> list[tuple[str, str, int]]:
    """(attn, style, ulysses degree): one chain each; USP once per degree that shares the heads and leaves a ring."""
    largest, heads = cp_sizes(opts.gpus)[0], config.num_attention_heads
    out = []
    for attn in opts.attn:
        for style in opts.styles:
            if style == "cp_usp":
                out += [(attn, style, d) for d in (2 ** i for i in range(1, 6)) if d < largest and heads % d == 0]
            else:
                out.append((attn, style, 1))
    return out


def floor_bytes(config, tokens_per_rank: int, rung: dict) -> int:
    """What a rank holds at least, whatever else: without recompute each layer keeps >= 4 [tokens, hidden] bf16
    tensors (its input, the attention's input and output, the MLP's input); with recompute, not offloaded, each
    layer's checkpoint; the full loss, the fp32 logits."""
    h, layers = config.hidden_size, config.num_hidden_layers
    floor = 0
    if not rung.get("activation_checkpointing"):
        floor += layers * tokens_per_rank * h * 2 * 4
    elif not rung.get("offload_activations"):
        floor += layers * tokens_per_rank * h * 2
    if rung.get("loss", "full") == "full":
        floor += tokens_per_rank * config.vocab_size * 4
    return floor


def suite_text(opts: PlanOptions, attn: str, style: str, degree: int, cp: int, rung: dict) -> str:
    """A runnable suite of one configuration (what `--out` writes, and what is projected)."""
    fields = {"name": f"plan-{Path(opts.model).name}-{opts.seq}", "model": opts.model, "seq_lens": [opts.seq],
              "cp_sizes": [cp], "world_size": opts.gpus, "attn_implementations": [attn],
              "cp_styles": [style if cp > 1 else "cp_ulysses"], "dtype": opts.dtype, "device": "cuda",
              "mixed_precision": opts.mixed_precision, "warmup_steps": 3, "measured_steps": 3,
              "parity": "projected", "timeout_s": 7200, **rung}
    if style == "cp_usp":
        fields["cp_ulysses_degree"] = degree
    lines = [f"{k} = {json.dumps(v)}" for k, v in fields.items()]
    if opts.overrides:
        lines.append("model_overrides = {" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in opts.overrides.items())
                     + "}")
    if opts.cp_plan:
        lines.append("cp_plan = {" + ", ".join(f"{json.dumps(k)} = {json.dumps(v)}" for k, v in opts.cp_plan.items())
                     + "}")
    return "\n".join(lines) + "\n"


class Search:
    """The chains' shared state: the best tokens/s per GPU so far, and what was pruned and why."""

    def __init__(self, opts: PlanOptions, capacity: int, config):
        self.opts, self.capacity, self.config = opts, capacity, config
        self.best = 0.0
        self.ring_bound: dict[int, float] = {}  # cp -> the zigzag ring's tokens/s per GPU at most (USP's too)
        self.pruned: list[str] = []
        self.suites: dict[str, str] = {}  # point_id -> its suite text

    def chain(self, attn: str, style: str, degree: int):
        cps = [c for c in cp_sizes(self.opts.gpus) if style != "cp_usp" or (c > degree and c % degree == 0)]
        label = f"{style}{f'-u{degree}' if style == 'cp_usp' else ''}/{attn}"
        start, bound = 0, None
        for cp in cps:
            if cp == 1 and style != self.opts.styles[0]:
                return  # cp 1 has no style: tried once, on the first style's chain
            if bound is not None and bound <= self.best * (1 + self.opts.min_gain):
                self.pruned.append(f"{label} cp <= {cp}: at most {bound:.4g} tok/s/GPU (the compute of cp {cp * 2}), "
                                   f"not {100 * self.opts.min_gain:g} % above the best {self.best:.4g}")
                return
            # the ring's bound at this cp or a larger one (a smaller cp's compute per token is the larger one's)
            ring = min((b for c, b in self.ring_bound.items() if c >= cp), default=None) if style == "cp_usp" else None
            if ring is not None and ring <= self.best * (1 + self.opts.min_gain):
                self.pruned.append(f"{label} cp {cp}: at most {ring:.4g} tok/s/GPU (its attention is the zigzag "
                                   f"ring's), not {100 * self.opts.min_gain:g} % above the best "
                                   f"{self.best:.4g}")
                continue
            fit, invalid = None, False
            for i in range(start, len(RUNGS)):
                tokens = self.opts.seq // cp
                if floor_bytes(self.config, tokens, RUNGS[i]) > self.capacity:
                    self.pruned.append(f"{label} cp {cp} {RUNG_NAMES[i]}: its floor passes the device memory")
                    continue
                text = suite_text(self.opts, attn, style, degree, cp, RUNGS[i])
                try:
                    point = load_suite(f"plan {label} cp {cp}", text=text).points()[0]
                except ValueError as e:  # this style cannot run at this cp (e.g. heads not shared over the group)
                    self.pruned.append(f"{label} cp {cp}: {str(e).splitlines()[-1].strip()}")
                    invalid = True
                    break
                self.suites[point.point_id] = text
                row = yield point
                if row["status"] == "ok":
                    fit = i
                    break
                if row["status"] != "oom":
                    break  # skipped or error: the row says why
            if invalid:
                continue  # not runnable at this cp (said above): a smaller one may be
            if fit is None:
                return
            row_tps = row["projected_tokens_per_s"] / self.opts.gpus
            self.best = max(self.best, row_tps)
            busy = row["projected_compute_s"] + row["projected_optimizer_s"]
            bound = row["projected_tokens_per_s"] / self.opts.gpus * row["projected_step_s"] / busy
            if style == "cp_ring_zigzag":
                self.ring_bound[cp] = bound
            start = fit


def run_plan(opts: PlanOptions, on_row=None) -> tuple[Path, Search]:
    """Searches, writes every tried configuration as a projected row; returns the run folder and the search."""
    if opts.gpus < 1 or opts.nodes < 1 or opts.gpus % opts.nodes:
        raise ValueError(f"--gpus {opts.gpus} --nodes {opts.nodes}: give GPUs (all nodes together) that the nodes "
                         "share evenly, e.g. --gpus 16 --nodes 2.")
    hardware = load_hardware(opts.gpu)
    config = get_preset(opts.model).config(opts.overrides)
    memory = parse_bytes(opts.device_memory, field_name="--device-memory") if opts.device_memory else \
        hardware.memory_bytes
    capacity = memory - parse_bytes(opts.headroom, field_name="--headroom")
    if capacity <= 0:
        raise ValueError(f"--headroom {opts.headroom}: leaves nothing of the {memory} bytes per GPU; give less.")
    host = parse_bytes(opts.host_memory, field_name="--host-memory") if opts.host_memory else None
    base = load_suite("plan", text=suite_text(opts, opts.attn[0], "cp_ulysses", 1, 1, {}))
    run_dir = pick_run_dir(Path(opts.out) / base.name, opts.run, resume=False)
    search = Search(opts, capacity, config)
    with writing(run_dir, opts.run, False, False, "plan"):
        estimator = Estimator(run_dir, base, capacity, on_row, host, opts.gpus // opts.nodes, hardware)
        axes = candidates_for(opts, config)
        for phase in ([a for a in axes if a[1] != "cp_usp"], [a for a in axes if a[1] == "cp_usp"]):  # USP last
            run_chains(estimator, [search.chain(attn, style, degree) for attn, style, degree in phase], opts.jobs)
    return run_dir, search


def ranked(df):
    """The configurations that fit, fastest first (tokens/s per GPU)."""
    ok = df[(df["status"] == "ok") & df["projected_step_s"].notna()].copy()
    ok["tokens_per_s_per_gpu"] = ok["projected_tokens_per_s"] / ok["world_size"]
    return ok.sort_values("tokens_per_s_per_gpu", ascending=False)
