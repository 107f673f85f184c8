"""Suites: a TOML file -> a validated `Suite` -> its `Point`s.

A suite is one grid: every combination of `seq_lens` x `cp_sizes` x `attn_implementations` x `cp_styles`
(at cp_size 1 the style is `none`, so styles collapse) with the fixed settings of the file: each combination is a
`Point` (point.py). Everything that can be checked without launching is checked (checks.py), and each error names
the field, the value and the fix.
"""

from __future__ import annotations

import fnmatch
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path

from cpbench.harness.suite.checks import NO_STYLE, SuiteErrors, err, validate
from cpbench.harness.suite.levers import compile_mode, tiled_mlp_tiles
from cpbench.harness.suite.point import BALANCED_STYLES, Point, key_hash
from cpbench.harness.suite.suite_errors import near



@dataclass(frozen=True, kw_only=True)
class Suite:
    """One sweep definition. See suites/*.toml for the documented format."""

    name: str
    model: str
    seq_lens: tuple[int, ...]
    cp_sizes: tuple[int, ...] = (1, 2)
    attn_implementations: tuple[str, ...] = ("sdpa",)
    cp_styles: tuple[str, ...] = ("cp_ulysses",)
    description: str = ""
    model_overrides: dict = field(default_factory=dict)
    # module pattern -> style (cpbench.cp.plan): for a family without a default CP plan; each point puts its own
    # cp_style on the plan's attention entries. Part of the model's name (its hash), as overrides are.
    cp_plan: dict = field(default_factory=dict)
    world_size: int | None = None  # when set, fsdp_size = world_size / (cp_size * dp_replicate_size)
    fsdp_size: int = 1
    dp_replicate_size: int = 1
    dtype: str = "float32"
    device: str = "cpu"
    batch_size: int = 1
    batch_kind: str = "plain"
    warmup_steps: int = 3  # tracked for memory: the smallest peak of identical steps counts (probes.py)
    measured_steps: int = 3
    keep_outputs: bool = False  # True: the step keeps the whole output (logits) through backward (step.py)
    loss: str = "full"  # "chunked": the output projection and the loss chunk by chunk (cpbench.use_loss)
    activation_checkpointing: bool = False  # recompute every decoder layer in backward (transformers' own)
    recompute_every_n_layers: int = 1  # with activation_checkpointing: recompute every n-th layer only
    # with activation_checkpointing: "full" recomputes whole layers, "op" keeps their attention kernels' and every
    # other matmul's outputs (torchtitan's selective op recompute; cpbench/cp/recompute.py)
    recompute_policy: str = "full"
    offload_activations: bool = False  # the recompute checkpoints in (pinned) host memory (transformers' offload)
    offload_params: bool = False  # FSDP2's CPUOffloadPolicy: parameters, gradients, optimizer state on the host
    norm: str = "eager"  # "fused": every RMSNorm as one op each way (cpbench.use_fused_norm)
    # torch's AdamW: "foreach" (torch's default: its multi-tensor kernels on a GPU, the per-tensor loop on the CPU)
    # or "fused" (AdamW(fused=True): one kernel over every parameter, no temporaries; step.make_optimizer)
    optimizer: str = "foreach"
    # > 0: every step clips the gradients' global norm to it before the optimizer step (torch.nn.utils.clip_grad_norm_,
    # as transformers' Trainer and torchtitan do by default at 1.0); 0: no clipping (Trainer's "off")
    max_grad_norm: float = 0.0
    # What drives the tracked and timed steps: "own" (cpbench's loop, step.train_step) or "trainer" (transformers'
    # Trainer.train(), measure/trainer_loop.py): Trainer's overhead is then a row like any other. Measured runs only.
    loop: str = "own"
    tiled_mlp: bool | int | str = False  # true / "auto" / a tile count: each layer's MLP over tiles of the sequence
    # FSDP2's mixed precision: fp32 weights, gradients and optimizer state (the master copy), compute in `dtype`
    # (bfloat16), gradients reduced in fp32 (transformers' `fsdp_mixed_precision`). Needs FSDP: world_size > 1.
    mixed_precision: bool = False
    parity: str = "auto"
    # Where the parity reference runs: "unsharded" (rank 0 alone, the model on one device), "sharded" (every rank,
    # FSDP over all of them, no CP, recompute on: for models larger than one device), "auto" (sharded when the
    # parity mode resolves to projected, i.e. a large model, and the point has more than one rank).
    reference: str = "auto"
    timeout_s: float = 300.0
    seed: int = 0
    memory_budget: str | None = None
    # point-id glob -> "crash" | "oom" | "hang" | "kill" (SIGKILL of a rank), or {fault = "hang", timeout_s = 10} to give that point its own
    # timeout (a hang costs its timeout; the other points keep the suite's). Only honoured when loaded with
    # allow_faults=True (the test hook, `cpbench sweep --allow-faults`); a fault is recorded in the point's
    # spec_json.
    faults: dict = field(default_factory=dict)
    # What runs: "model" (the training step) or "attention" (one causal attention op, forward + backward, with
    # heads / kv heads / head dim of `model`), and which CP implementations (peers/registry.py) run it side by side.
    level: str = "model"
    implementations: tuple[str, ...] = ("cpbench",)
    # cp_usp's Ulysses degree: the ranks of each Ulysses group; the ring runs over cp_size / degree groups. Only the
    # cp_usp points of a cp size it divides use it (other styles and cp sizes keep 1).
    cp_ulysses_degree: int = 2
    # Packed documents (documents.py): "none", a shipped mix's name ("meta-128k", ...), or the lengths of one row
    # ([65536, 32768, 32768], "pad:N" for N padded tokens) or of each row ([[...], [...]]), summing to the length.
    # Points with documents are packed (batch_kind "padded": every other row ends in a pad segment).
    documents: str | list = "none"
    # The zigzag ring's placement (cp_ring_zigzag, cp_usp): "documents" (balanced by the batch's documents,
    # cp/balance.py) or "sequence" (the plain zigzag: the balance off). Part of a point's key (schema 10): the two
    # run different layouts, so a point of one is never compared with a baseline of the other.
    balance: str = "documents"
    # torch.compile of each decoder layer (harness/measure/compiled.py): false / "off", true / "on" (torch's default
    # mode) or a mode ("max-autotune-no-cudagraphs", ...). The first step compiles; it is kept out of the timed ones.
    compile: bool | str = False

    def points(self) -> list["Point"]:
        return expand(self)


def load_suite(source: str | Path, *, text: str | None = None, allow_faults: bool = False,
               overrides: dict | None = None) -> Suite:
    """Reads and validates a suite file (or `text`, named `source`), with `overrides` (fields the command line sets,
    e.g. `--cp-plan`) in place of the file's; every error of it is reported at once."""
    try:
        raw = tomllib.loads(text if text is not None else Path(source).read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{source}: not valid TOML: {e} (fix the syntax at that line)") from None
    raw.update(overrides or {})
    errors = []
    known = {f.name for f in fields(Suite)}
    unknown = sorted(set(raw) - known)
    for name in unknown:
        hint = near(name, known)
        errors.append(f"unknown suite field `{name}`:{hint}" if hint else
                      f"unknown suite field `{name}`: the known fields are {sorted(known)} (docs/sweeps.md).")
    raw = {k: v for k, v in raw.items() if k in known}
    for name in ("seq_lens", "cp_sizes", "attn_implementations", "cp_styles", "implementations"):
        if name in raw:
            if not isinstance(raw[name], list) or not raw[name]:
                errors.append(str(err(name, raw[name], "give a non-empty list, e.g. [1, 2] or [\"sdpa\"].")))
                del raw[name]
            else:
                raw[name] = tuple(raw[name])
    if "name" not in raw:
        raw["name"] = Path(str(source)).stem
    for name in ("model", "seq_lens"):
        if name not in raw:
            errors.append(f"suite field `{name}` is required (e.g. model = \"tiny-qwen3\", seq_lens = [2048]).")
    if errors and ("model" not in raw or "seq_lens" not in raw):
        raise SuiteErrors(source, errors)
    suite = Suite(**raw)
    try:
        validate(suite, allow_faults=allow_faults, source=source)
    except SuiteErrors as e:
        raise SuiteErrors(source, errors + e.errors) from None
    if errors:
        raise SuiteErrors(source, errors)
    return suite


def model_name(model: str, overrides: dict, cp_plan: dict | None = None) -> str:
    """A point's model, readable: the preset's (or the user's config's) short name, and with overrides (or a suite's
    `cp_plan`) a short hash of them, so that points of other overrides never share a key (the summary lists the
    overrides once)."""
    from cpbench.harness.suite.presets import get_preset

    name = get_preset(model).name
    if not overrides and not cp_plan:
        return name
    return f"{name}+{key_hash({**overrides, 'cp_plan': cp_plan} if cp_plan else overrides)[:6]}"


def expand(suite: Suite) -> list[Point]:
    """The suite's points, grouped by world size, each configuration's lengths ascending."""
    model = model_name(suite.model, suite.model_overrides, suite.cp_plan)
    seen, points = set(), []
    for cp in sorted(suite.cp_sizes):
        for attn in suite.attn_implementations:
            for impl, style in _runs(suite, cp):
                for seq_len in sorted(suite.seq_lens):
                    p = _point(suite, model, cp, attn, style, seq_len, impl)
                    if p.point_key not in seen:
                        seen.add(p.point_key)
                        points.append(p)
    return sorted(points, key=lambda p: p.world_size)  # stable: keeps the order above within a world size


def _runs(suite: Suite, cp: int) -> list[tuple[str, str]]:
    """(implementation, style) pairs at one cp size: at cp 1 the unsharded op alone; above, every implementation
    with each of the suite's styles it has at level "attention" (a peer without a style is not a point)."""
    from cpbench.harness.peers.registry import CPBENCH, PEERS

    if cp == 1:
        return [(CPBENCH, NO_STYLE)]
    return [(impl, style) for impl in suite.implementations for style in suite.cp_styles
            if suite.level == "model" or impl not in PEERS or style in PEERS[impl].styles]


def _point(suite: Suite, model: str, cp: int, attn: str, style: str, seq_len: int, impl: str = "cpbench") -> Point:
    from cpbench.harness.suite import documents

    packed = suite.documents != documents.NONE
    fsdp = suite.fsdp_size
    world = cp * fsdp * suite.dp_replicate_size
    if suite.world_size is not None:
        fsdp = suite.world_size // (cp * suite.dp_replicate_size)
        world = suite.world_size
    p = Point(
        suite=suite.name, model=model, preset=suite.model, model_overrides=dict(suite.model_overrides),
        seq_len=seq_len, batch_size=suite.batch_size, cp_size=cp, fsdp_size=fsdp,
        batch_kind="packed" if packed and suite.batch_kind == "plain" else suite.batch_kind,
        documents=documents.key(suite.documents),
        balance=suite.balance if style in BALANCED_STYLES else "documents",
        document_lengths=documents.as_rows(suite.documents) if packed else (),
        dp_replicate_size=suite.dp_replicate_size, world_size=world, attn_implementation=attn, cp_style=style,
        dtype=suite.dtype, device=suite.device, warmup_steps=suite.warmup_steps,
        measured_steps=suite.measured_steps, keep_outputs=suite.keep_outputs, loss_mode=suite.loss,
        activation_checkpointing=suite.activation_checkpointing, mixed_precision=suite.mixed_precision,
        recompute_every_n_layers=suite.recompute_every_n_layers if suite.activation_checkpointing else 1,
        recompute_policy=suite.recompute_policy if suite.activation_checkpointing else "full",
        offload_activations=suite.offload_activations, offload_params=suite.offload_params and world > 1,
        tiled_mlp=tiled_mlp_tiles(suite.tiled_mlp), norm=suite.norm, optimizer=suite.optimizer,
        max_grad_norm=float(suite.max_grad_norm), loop=suite.loop, compile=compile_mode(suite.compile),
        parity_mode=suite.parity, reference=suite.reference, timeout_s=float(suite.timeout_s),
        seed=suite.seed, level=suite.level, implementation=impl,
        cp_ulysses_degree=suite.cp_ulysses_degree if style == "cp_usp" else 1, cp_plan=dict(suite.cp_plan),
    )
    fault = next((f for pat, f in suite.faults.items() if fnmatch.fnmatchcase(p.point_id, pat)), None)
    if not fault:
        return p
    if isinstance(fault, dict):
        timeout = float(fault.get("timeout_s", p.timeout_s))
        return Point(**{**p.to_dict(), "fault": fault["fault"], "timeout_s": timeout})
    return Point(**{**p.to_dict(), "fault": fault})
