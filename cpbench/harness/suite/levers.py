"""The levers of a suite, checked: recompute (every layer or every n-th; whole layers or op by op), activation
offload (the recompute checkpoints in host memory), parameter and optimizer offload (FSDP2's CPUOffloadPolicy), the
sequence-tiled MLP, the fused norm, the fused AdamW and torch.compile of each decoder layer. Each error names the
field, the value and the fix; every one is reported (suite_errors.py)."""

from __future__ import annotations

from cpbench.harness.suite.suite_errors import Collector, err

TILED_MLP_AUTO = "auto"
# torch's AdamW as a point steps with it: "foreach" (torch's default) or "fused" (AdamW(fused=True))
OPTIMIZERS = ("foreach", "fused")
LOOPS = ("own", "trainer")  # what drives the step: cpbench's loop, or transformers' Trainer (measure/trainer_loop.py)
# torch.compile's modes; a suite's `compile` is false / "off", true / "on" (torch's default mode) or one of them
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def compile_mode(value) -> str:
    """A suite's `compile` (false, true, "off", "on" or a mode) as the point's column: "off" or the mode."""
    if value is False or value == "off":
        return "off"
    if value is True or value == "on":
        return "default"
    return str(value)


def tiled_mlp_tiles(value) -> str:
    """A suite's `tiled_mlp` (false, true, "auto" or a tile count) as the point's column: "off", "auto" or the
    count as a string ("8")."""
    if value is True or value == TILED_MLP_AUTO:
        return TILED_MLP_AUTO
    if value is False or value in (0, 1):  # (True == 1 in Python: bools are settled above)
        return "off"
    return str(value)


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_levers(suite) -> None:
    found = Collector()
    every = suite.recompute_every_n_layers
    if not _is_count(every) or every < 1:
        found.errors.append(str(err("recompute_every_n_layers", every, "must be an integer >= 1: 1 recomputes every "
                                    "decoder layer, n every n-th (the others keep their activations).")))
    elif every != 1 and not suite.activation_checkpointing:
        found.errors.append(str(err("recompute_every_n_layers", every, "chooses which layers recompute: set "
                                    "activation_checkpointing = true, or drop it.")))
    from cpbench.cp.recompute import POLICIES

    policy = suite.recompute_policy
    if policy not in POLICIES:
        found.errors.append(str(err("recompute_policy", policy, f"must be one of {', '.join(map(repr, POLICIES))}: "
                                    "'full' recomputes whole layers, 'op' keeps each layer's attention kernels' and "
                                    "every other matmul's outputs and recomputes the rest.")))
    elif policy != "full" and not suite.activation_checkpointing:
        found.errors.append(str(err("recompute_policy", policy, "chooses what recomputed layers keep: set "
                                    "activation_checkpointing = true, or drop it.")))
    elif policy == "op" and "flash_attention_4" in (suite.attn_implementations or ()):
        found.errors.append(str(err("recompute_policy", policy, "cannot keep FlashAttention-4's outputs (it calls no "
                                    "dispatcher op a policy sees): drop flash_attention_4 from attn_implementations, "
                                    "or recompute whole layers (\"full\").")))
    elif policy == "op" and suite.compile not in (False, "off"):
        found.errors.append(str(err("recompute_policy", policy, "is not supported with compile yet (a compiled layer's "
                                    "kernels are inductor's, not the ops the policy keeps): set compile = false, or "
                                    "recompute whole layers (\"full\").")))
    if not isinstance(suite.offload_activations, bool):
        found.errors.append(str(err("offload_activations", suite.offload_activations, "must be true or false.")))
    elif suite.offload_activations and not suite.activation_checkpointing:
        found.errors.append(str(err("offload_activations", True, "holds the recompute checkpoints (each recomputed "
                                    "layer's inputs) in host memory: set activation_checkpointing = true.")))
    if not isinstance(suite.offload_params, bool):
        found.errors.append(str(err("offload_params", suite.offload_params, "must be true or false.")))
    tiles = suite.tiled_mlp
    if not (isinstance(tiles, bool) or tiles == TILED_MLP_AUTO or (_is_count(tiles) and tiles >= 1)):
        found.errors.append(str(err("tiled_mlp", tiles, "must be true, false, \"auto\" (tiles whose largest "
                                    "intermediate stays within 1 GiB) or a tile count >= 1.")))
    from cpbench.cp.fused.norm import NORM_MODES

    if suite.norm not in NORM_MODES:
        found.errors.append(str(err("norm", suite.norm, f"must be one of {', '.join(map(repr, NORM_MODES))}: "
                                    "'fused' runs every RMSNorm as one op forward and one backward.")))
    if suite.optimizer not in OPTIMIZERS:
        found.errors.append(str(err("optimizer", suite.optimizer, f"must be one of {', '.join(map(repr, OPTIMIZERS))}"
                                    ": torch's AdamW as it picks (foreach) or AdamW(fused=True), one kernel over "
                                    "every parameter.")))
    if suite.loop not in LOOPS:
        found.errors.append(str(err("loop", suite.loop, f"must be one of {', '.join(map(repr, LOOPS))}: 'own' is "
                                    "cpbench's loop, 'trainer' drives the same step with transformers' Trainer.")))
    elif suite.loop == "trainer" and suite.keep_outputs:
        found.errors.append(str(err("keep_outputs", True, "keeps the whole output through backward, which Trainer "
                                    "never does (it keeps the loss): set keep_outputs = false with loop = "
                                    "\"trainer\".")))
    mode = suite.compile
    if not (isinstance(mode, bool) or mode in ("off", "on", *COMPILE_MODES)):
        found.errors.append(str(err("compile", mode, f"must be true, false, \"on\", \"off\" or a torch.compile mode "
                                    f"{list(COMPILE_MODES)}.")))
    found.raise_any()


def check_norm(suite, config) -> None:
    """`norm = "fused"` on a model whose RMSNorm the fused op does not compute: refused before any launch (the model
    built on the meta device, its norms' classes read)."""
    if suite.norm != "fused":
        return
    import torch
    from transformers import AutoModelForCausalLM

    from cpbench.cp.fused.norm import fusion_problem

    with torch.device("meta"):
        problem = fusion_problem(AutoModelForCausalLM.from_config(config))
    if problem:
        raise err("norm", "fused", f"{suite.model}: {problem}: set norm = \"eager\" (on the command line: drop "
                  "--norm fused).")


def check_offload_world(suite) -> None:
    """Parameter offload is FSDP2's: it needs a sharded model, i.e. more than one rank."""
    if suite.offload_params is True and suite.world_size in (None, 1) and max(suite.cp_sizes) * suite.fsdp_size \
            * suite.dp_replicate_size == 1:
        raise err("offload_params", True, "offloads FSDP2's sharded parameters, gradients and optimizer state: it "
                  "needs more than one rank (cp_sizes above 1, or fsdp_size / world_size).")
