"""`cpbench plan`: the configurations of a model at a length on a machine that fit, ranked by projected speed.

The search covers cp size (the powers of two up to the GPUs), style (Ulysses, the zigzag ring, USP at each
Ulysses degree: `masked`; others on request), attention backend, and a ladder of memory levers (`RUNGS`), each rung
holding less than the one below and adding time. Every configuration tried is a projected row of one run
(estimate.py's machinery), so `cpbench report` reads the search.

The search goes by cp size, largest first, one level at a time: every configuration of a level is projected (side
by side, `jobs` at once), then the level's results decide what the next level tries. What is pruned depends only
on finished levels, never on which projection of a level finished first, so the ranking does not depend on
`--jobs` or on timing; `prune=False` projects everything the memory floor allows (the test that pruning never
changes the best configuration compares the two).

Pruning, each said in the output:
- a rung whose analytic floor (`floor_bytes`) already passes the device's memory is not projected;
- per configuration (backend, style, Ulysses degree), a smaller cp starts at the rung the larger one needed (it
  holds more per rank); when no rung fits at a cp, smaller ones are not tried. A cp whose projection failed (an
  error, a skip) is said in its row and the next smaller cp is still tried, from the same rung;
- the first rung that fits ends a cp (the higher ones only add time);
- a smaller cp is not tried when it cannot beat the best of the finished levels by `min_gain`: its tokens/s are at
  most the tokens per GPU over the larger cp's floor (timing.floor_seconds: its GEMMs and attention at their best
  efficiencies, nothing else: the work per token no cp size changes). Everything a smaller cp changes only lowers
  its time per token above that floor (a ring's merges and steps, short tiles, heads per call, the optimizer and
  the host spread over more tokens), never the floor itself. Element-wise work is left out: per token it is not
  the same at every cp (Ulysses' layout copies and the ring's merges grow with it), so a floor holding it would
  not bound a smaller cp;
- USP, at each level after the other styles, is not tried where that bound of the zigzag ring of the same backend
  at the same or a larger cp (the same pairs and tile kernels: the same floor) is not above the best.
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
from cpbench.harness.suite.suite_errors import in_flags
from cpbench.report.units import parse_bytes

RUNGS = (
    {},
    {"loss": "chunked"},
    {"activation_checkpointing": True, "recompute_policy": "op", "loss": "chunked"},
    {"activation_checkpointing": True, "loss": "chunked"},
    {"activation_checkpointing": True, "loss": "chunked", "offload_activations": True},
    {"activation_checkpointing": True, "loss": "chunked", "offload_activations": True, "tiled_mlp": "auto"},
    {"activation_checkpointing": True, "loss": "chunked", "offload_activations": True, "tiled_mlp": "auto",
     "offload_params": True},
)
RUNG_NAMES = ("none", "chunked loss", "op recompute + chunked loss", "recompute + chunked loss", "+ activation offload",
              "+ tiled MLP", "+ parameter offload")
# The suite fields plan's own flags set: a bad flag's error is said in these words (suite_errors.in_flags).
FLAGS = {"model": "--model", "seq_lens": "--seq", "world_size": "--gpus", "attn_implementations": "--attn",
         "cp_styles": "--styles", "documents": "--documents", "norm": "--norm", "optimizer": "--optimizer",
         "max_grad_norm": "--max-grad-norm", "cp_plan": "--cp-plan", "model_overrides": "--override"}


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
    prune: bool = True  # False: every configuration the memory floor allows (what pruning is tested against)
    documents: str | list = "none"  # --documents: packed documents (suite/documents.py)
    norm: str = "eager"  # --norm fused: every configuration searched with the fused RMSNorm (cp/fused/norm.py)
    optimizer: str = "foreach"  # --optimizer fused: every configuration searched with AdamW(fused=True)
    max_grad_norm: float = 0.0  # --max-grad-norm: every configuration clips its gradients first (0: none)


def cp_sizes(gpus: int) -> list[int]:
    """The cp sizes searched on `gpus` GPUs: the powers of two that divide them, largest first."""
    return sorted((c for c in (2 ** i for i in range(12)) if c <= gpus and gpus % c == 0), reverse=True)


def masked(config, documents, attn: str) -> bool:
    """Whether `cp_ulysses` would run the model's S x S mask (a sliding window, packed documents) through SDPA or eager
    attention, whose masked kernel copies it in every layer (flash takes the window and the documents itself): then
    USP at degree cp (that exchange on the ring's kernel) is searched."""
    window = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True) is not False
    layers = getattr(config, "layer_types", None) or ()
    return attn in ("sdpa", "eager") and (bool(window) or "sliding_attention" in layers or documents != "none")


def candidates_for(opts: PlanOptions, config) -> list[tuple[str, str, int]]:
    """(attn, style, ulysses degree): one chain each; USP once per degree that shares the heads and leaves a ring (or,
    where Ulysses would run the model's mask, `masked`, none: degree cp)."""
    largest, heads = cp_sizes(opts.gpus)[0], config.num_attention_heads
    out = []
    for attn in opts.attn:
        top = masked(config, opts.documents, attn)
        for style in opts.styles:
            if style == "cp_usp":
                out += [(attn, style, d) for d in (2 ** i for i in range(1, 6))
                        if (d < largest or top and d == largest) and heads % d == 0]
            else:
                out.append((attn, style, 1))
    return out


def floor_bytes(config, tokens_per_rank: int, rung: dict) -> int:
    """What a rank holds at least, whatever else: without recompute each layer keeps >= 4 [tokens, hidden] bf16
    tensors (its input, the attention's input and output, the MLP's input); with recompute, not offloaded, each
    layer's checkpoint (op by op it keeps more, so the same floor bounds it); the full loss, the fp32 logits."""
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
    if opts.documents != "none":
        fields["documents"] = opts.documents
    if opts.norm != "eager":
        fields["norm"] = opts.norm
    if opts.optimizer != "foreach":
        fields["optimizer"] = opts.optimizer
    if opts.max_grad_norm:
        fields["max_grad_norm"] = opts.max_grad_norm
    lines = [f"{k} = {json.dumps(v)}" for k, v in fields.items()]
    if opts.overrides:
        lines.append("model_overrides = {" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in opts.overrides.items())
                     + "}")
    if opts.cp_plan:
        lines.append("cp_plan = {" + ", ".join(f"{json.dumps(k)} = {json.dumps(v)}" for k, v in opts.cp_plan.items())
                     + "}")
    return "\n".join(lines) + "\n"


class Search:
    """The search's state between levels: the best tokens/s per GPU of the finished levels, each configuration's
    starting rung and bound, and what was pruned and why."""

    def __init__(self, opts: PlanOptions, capacity: int, config):
        self.opts, self.capacity, self.config = opts, capacity, config
        self.masked_attn = {a for a in opts.attn if masked(config, opts.documents, a)}  # backends USP runs at degree cp
        from cpbench.cp.families.table import refusal_reason

        self.refused = refusal_reason(config.model_type)  # a family no sequence cut makes exact: cp 1 only
        self.best = 0.0
        self.start: dict[tuple, int] = {}  # configuration -> the rung its next (smaller) cp starts at
        self.bound: dict[tuple, float] = {}  # configuration -> tokens/s per GPU its smaller cps cannot pass
        self.ended: set[tuple] = set()  # configurations whose smaller cps are not tried (said in `pruned`)
        self.ring_bound: dict[tuple, float] = {}  # (backend, cp) -> the zigzag ring's bound there (USP's too)
        self.pruned: list[str] = [f"cp > 1: {config.model_type} cannot be context-parallel ({self.refused}); "
                                   "searched at cp 1 only"] if self.refused else []
        self.suites: dict[str, str] = {}  # point_id -> its suite text
        self._level: list[tuple] = []  # (configuration, cp, rung or None, row) of the level running

    @staticmethod
    def label(key: tuple) -> str:
        attn, style, degree = key
        return f"{style}{f'-u{degree}' if style == 'cp_usp' else ''}/{attn}"

    def cps(self, key: tuple) -> list[int]:
        attn, style, degree = key
        least = degree if attn in self.masked_attn else degree + 1  # degree cp: Ulysses on the ring's kernel
        if self.refused:
            return [1] if style == self.opts.styles[0] else []
        return [c for c in cp_sizes(self.opts.gpus) if (c > 1 or style == self.opts.styles[0])
                and (style != "cp_usp" or (c >= least and c % degree == 0))]

    def level(self, cp: int, keys: list[tuple]) -> list:
        """The chains of one cp level: a configuration each, those that pruning leaves (decided now, from the
        finished levels only)."""
        chains = []
        for key in keys:
            if key in self.ended or cp not in self.cps(key):
                continue
            if self.opts.prune and self._beaten(key, cp):
                continue
            chains.append(self.config_chain(key, cp))
        return chains

    def _beaten(self, key: tuple, cp: int) -> bool:
        gain = 1 + self.opts.min_gain
        bound = self.bound.get(key)
        if bound is not None and bound <= self.best * gain:
            self.pruned.append(f"{self.label(key)} cp <= {cp}: at most {bound:.4g} tok/s/GPU (the floor of a larger "
                               f"cp), not {100 * self.opts.min_gain:g} % above the best {self.best:.4g}")
            self.ended.add(key)
            return True
        if key[1] == "cp_usp":
            ring = min((b for (a, c), b in self.ring_bound.items() if a == key[0] and c >= cp), default=None)
            if ring is not None and ring <= self.best * gain:
                self.pruned.append(f"{self.label(key)} cp {cp}: at most {ring:.4g} tok/s/GPU (the zigzag ring's "
                                   f"floor: the same pairs and tiles), not {100 * self.opts.min_gain:g} % above the "
                                   f"best {self.best:.4g}")
                return True
        return False

    def config_chain(self, key: tuple, cp: int):
        """One configuration at one cp: its rungs from the one it starts at up to the first that fits."""
        attn, style, degree = key
        label, row = self.label(key), None
        for i in range(self.start.get(key, 0), len(RUNGS)):
            if floor_bytes(self.config, self.opts.seq // cp, RUNGS[i]) > self.capacity:
                self.pruned.append(f"{label} cp {cp} {RUNG_NAMES[i]}: its floor passes the device memory")
                continue
            text = suite_text(self.opts, attn, style, degree, cp, RUNGS[i])
            try:
                point = load_suite(f"plan {label} cp {cp}", text=text).points()[0]
            except ValueError as e:  # this style cannot run at this cp (e.g. heads not shared over the group)
                self.pruned.append(f"{label} cp {cp}: {str(e).splitlines()[-1].strip()}")
                return
            self.suites[point.point_id] = text
            row = yield point
            if row["status"] == "ok":
                self._level.append((key, cp, i, row))
                return
            if row["status"] != "oom":
                self._level.append((key, cp, None, row))  # an error or a skip: its row says why; smaller cps go on
                return
        self.pruned.append(f"{label} cp {cp}: no rung fits, so no smaller cp does (each holds more per rank)")
        self.ended.add(key)

    def finish_level(self) -> None:
        """The finished level's results: the best, and each configuration's start rung and bound."""
        for key, cp, rung, row in self._level:
            if rung is None:
                continue
            self.start[key] = rung
            tokens = row["projected_tokens_per_s"] / self.opts.gpus
            self.best = max(self.best, tokens)
            floor = row.get("floor_s")
            if floor:
                bound = tokens * row["projected_step_s"] / floor
                self.bound[key] = min(self.bound.get(key, bound), bound)
                if key[1] == "cp_ring_zigzag":
                    self.ring_bound[key[0], cp] = bound
        self._level = []


class _Estimator(Estimator):
    """The estimator, handing each row's floor (timing.floor_seconds, the slowest projected rank's) to the search;
    the written row is the estimator's."""

    def finish(self, point, records, error, wall_s):
        row = super().finish(point, records, error, wall_s)
        times = [r["time"] for r in records or () if r.get("time") and r["time"].get("floor_s")]
        if not times:
            return row
        return {**row, "floor_s": max(t["floor_s"] for t in times)}


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
    try:
        base = load_suite(f"--model {opts.model}", text=suite_text(opts, opts.attn[0], "cp_ulysses", 1, 1, {}))
    except ValueError as e:  # said in the flags' words: the user gave flags, not this suite
        raise in_flags(e, FLAGS) from None
    run_dir = pick_run_dir(Path(opts.out) / base.name, opts.run, resume=False)
    search = Search(opts, capacity, config)
    with writing(run_dir, opts.run, False, False, "plan"):
        estimator = _Estimator(run_dir, base, capacity, on_row, host, opts.gpus // opts.nodes, hardware)
        keys = candidates_for(opts, config)
        for cp in cp_sizes(opts.gpus):  # one level at a time, largest first; USP after the other styles
            for phase in ([k for k in keys if k[1] != "cp_usp"], [k for k in keys if k[1] == "cp_usp"]):
                run_chains(estimator, search.level(cp, phase), opts.jobs)
                search.finish_level()
    return run_dir, search


def ranked(df):
    """The configurations that fit, fastest first (tokens/s per GPU)."""
    ok = df[(df["status"] == "ok") & df["projected_step_s"].notna()].copy()
    ok["tokens_per_s_per_gpu"] = ok["projected_tokens_per_s"] / ok["world_size"]
    return ok.sort_values("tokens_per_s_per_gpu", ascending=False)
