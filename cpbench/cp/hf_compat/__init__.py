"""Every touch point between cpbench and transformers internals, in one place (this package: here, masks.py for its
mask code, views.py for the views both hand it), but for two that read a family's own code: cp/loss/family.py (what
a causal LM's forward does between its head and its loss, and its router aux loss) and cp/families/ (the audit of
every family, and the check that a cut layer mixes tokens only in attention).

Tested against transformers 5.23 (pinned in pyproject.toml). What cpbench relies on:

1. `DistributedMixin.prepare_distribute_model` / `maybe_distribute_model` (classmethods that
   `from_pretrained(distributed_config=...)` calls before and after building the model). `install(apply)` wraps
   them: a `cpbench.DistributedConfig` with `cp_size > 1` gets cpbench's mesh and CP; anything else goes to
   transformers unchanged.
2. The attention interface `ALL_ATTENTION_FUNCTIONS`: attention modules call
   `ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)`.
   A CP attention module gets a config *view* whose `_attn_implementation` is `CP_ATTENTION_KEY`; the function
   registered under that key runs the module's CP style around the model's real implementation.
3. Tied input/output embeddings under FSDP2 (`tie_embedded_tail`): `model.all_tied_weights_keys`, the model's
   `fsdp_plan` (its setter), `_get_fsdp_policy_kwargs(distributed_config)` and the mesh manager's `fsdp` /
   `(dp_replicate, fsdp)` meshes, as transformers' own `apply_fully_sharded_data_parallelism` uses them.
   transformers shards the embedding with the final norm and leaves the output projection to the root group:
   a model tied before sharding then fails FSDP2's duplicate-parameter check, and one tied after (as
   `from_pretrained` does) gathers the same matrix twice per step. cpbench shards [norm, embedding, head] as
   one group around one shared parameter first and hands transformers the plan without them. A module built in
   another dtype than the model's by hand gets an entry of its own in that plan (`plan_other_dtypes`).
4. Decoder layers are called as `layer(hidden_states, attention_mask=..., position_ids=...,
   position_embeddings=(cos, sin), **kwargs)` and pass `**kwargs` on to the attention interface; the split
   hook uses those names and passes the `SequenceLayout` along as `cp_layout`.
5. `transformers.distributed.fsdp._get_fsdp_policy_kwargs`, which `apply_fsdp2` looks up as a module global:
   `fsdp_cpu_offload` becomes FSDP2's `CPUOffloadPolicy()`, which pins host memory and so fails where no
   accelerator exists. `install` wraps it (`fsdp_policy_kwargs`): without an accelerator the policy pins nothing,
   so parameter offload runs (and moves nothing) on CPU.
6. `transformers.modeling_utils.save_on_cpu`, which `activation_checkpointing_enable(offload=True)` calls as
   `save_on_cpu(pin_memory=True, ...)`: pinning fails where no accelerator exists. `install` wraps it the same way
   (`save_on_cpu_where_pinnable`), so activation offload runs on CPU too (where it copies to host what already is).
7. transformers' mask code: masks.py (`masks_isolate_documents`, `builds_no_mask`, `known_values_are_not_tracing`);
   its init table `initialization.TORCH_INIT_FUNCTIONS` (`value_free_init`, for a projection's fake weights).
8. Activation checkpointing: `GradientCheckpointingLayer` checkpoints its forward when its `gradient_checkpointing`
   is on and it is training; `activation_checkpointing_enable(every_n_layers=n)` turns that on for every n-th such
   layer (and sets the flag on other modules, e.g. the base model, that checkpoint nothing):
   `recomputed_layers` names the layers a step recomputes, for the time model's trace.

May import torch, transformers and, lazily, cpbench.cp.ring.compiled (a compiled layer's one op around its style); the
rest of cpbench.cp is handed in (`install(apply)`), so that anything in cpbench.cp may import this package.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from transformers import modeling_utils
from transformers.distributed import fsdp as hf_fsdp
from transformers.distributed.mixin import DistributedMixin
from transformers.distributed.parallel_utils import replace_layer_number_by_wildcard
from transformers.distributed.utils import _bind_local_device, _ensure_torch_distributed
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from cpbench.cp.hf_compat.masks import builds_no_mask, known_values_are_not_tracing, masks_isolate_documents
from cpbench.cp.hf_compat.views import (
    CP_ATTENTION_KEY,
    HIDDEN_STATES,
    KERNEL_DEVICE_KWARG,
    LAYOUT_KWARG,
    POSITION_EMBEDDINGS,
    POSITION_IDS,
    AttentionConfigView,
    ModuleView,
)

__all__ = [
    "CP_ATTENTION_KEY", "HIDDEN_STATES", "KERNEL_DEVICE_KWARG", "LAYOUT_KWARG", "POSITION_EMBEDDINGS",
    "POSITION_IDS", "AttentionConfigView", "ModuleView", "bind_attention", "builds_no_mask", "init_distributed",
    "inner_attention", "install", "known_values_are_not_tracing", "masks_isolate_documents", "model_config",
    "model_attention_implementation", "recomputed_layers", "run_style", "tie_embedded_tail", "value_free_init",
]


def model_config(module: torch.nn.Module):
    """The model's own config, behind an attention module's CP view of it."""
    config = module.config
    return config._cp_base_config if isinstance(config, AttentionConfigView) else config


def model_attention_implementation(module: torch.nn.Module) -> str:
    return model_config(module)._attn_implementation or "eager"


def inner_attention(module: torch.nn.Module) -> Callable:
    """The model's own attention function for `module` (what it would call without CP)."""
    impl = model_attention_implementation(module)
    # the family's modeling module, past a wrapper class (FSDP2 makes `FSDP<Name>` where it shards the module itself)
    found = (getattr(sys.modules.get(c.__module__), "eager_attention_forward", None) for c in type(module).__mro__)
    eager = next((f for f in found if f is not None), None)
    if impl == "eager" and eager is None:
        raise ValueError(
            f"{type(module).__name__}: cannot find the model's `eager_attention_forward` for CP; "
            "use attn_implementation='sdpa' or register a CP style that needs no inner attention."
        )
    return ALL_ATTENTION_FUNCTIONS.get_interface(impl, eager)


def _cp_attention(module, query, key, value, attention_mask, **kwargs):
    if "_cpbench_calls" in module.__dict__:  # watched at its layer's first forward (families/mixers.py)
        module._cpbench_calls += 1
    if torch.compiler.is_compiling() and not module._cpbench_attention.style.traces:
        from cpbench.cp.ring.compiled import opaque_attention  # one op in the graph; the style runs eagerly in it

        kwargs.pop(LAYOUT_KWARG, None)  # the op reads the forward's layout when it runs
        return opaque_attention(module, query, key, value, attention_mask, **kwargs)
    return run_style(module, query, key, value, attention_mask, **kwargs)


def run_style(module, query, key, value, attention_mask, **kwargs):
    """`module`'s CP style on q/k/v (this rank's tokens). The split hook hands the layout on in the layer's kwargs; a
    layer that does not pass them on to its attention (nemotron, stablelm) leaves it to the forward's state."""
    binding = module._cpbench_attention
    layout = kwargs.pop(LAYOUT_KWARG, None) or binding.state.layout
    if layout is None:
        raise RuntimeError(f"{type(module).__name__} has a CP attention style but its decoder layer has no split "
                           "style: add the layer to `cp_plan` with 'cp_split_sequence'.")
    if binding.kernel_target is not None:  # only when set (projections): a custom style need not know it
        kwargs[KERNEL_DEVICE_KWARG] = binding.kernel_target
    return binding.style.fn(
        module, query, key, value, attention_mask,
        inner=inner_attention(module), group=binding.group, layout=layout, **kwargs,
    )


def bind_attention(module: torch.nn.Module, binding) -> None:
    """Routes `module`'s attention call through `binding` (a `.style`, a `.group`, and the forward's `.state`)."""
    from cpbench.cp.ring.compiled import bind_site

    module._cpbench_attention = binding
    bind_site(module, run_style)
    if not isinstance(module.config, AttentionConfigView):
        module.config = AttentionConfigView(module.config, CP_ATTENTION_KEY)


def recomputed_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The layers whose forward activation checkpointing recomputes in training (touch point 8)."""
    from transformers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]


def init_distributed() -> torch.device:
    """Initialises torch.distributed from RANK/WORLD_SIZE/LOCAL_RANK (as torchrun sets them) if needed."""
    device_type = torch._C._get_accelerator().type
    if device_type == "mps":
        device_type = "cpu"
    _ensure_torch_distributed(device_type)
    return _bind_local_device(device_type, int(os.environ.get("LOCAL_RANK", 0)))


def _tied_tail(model: torch.nn.Module) -> dict[str, torch.nn.Module] | None:
    """{name: module} of the modules to shard as one FSDP group when the output projection shares the input
    embedding's weight (now, or once `from_pretrained` ties it after loading): the embedding, the head and the
    modules the plan keeps gathered with them (the final norm). None when nothing is tied."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if embed is None or head is None or getattr(head, "weight", None) is None:
        return None
    names = {module: name for name, module in model.named_modules()}
    embed_name, head_name = names.get(embed), names.get(head)
    tied_keys = getattr(model, "all_tied_weights_keys", None) or {}
    declared = tied_keys.get(f"{head_name}.weight") == f"{embed_name}.weight"
    if head.weight is not embed.weight and not declared:
        return None
    kept = [n for n, style in model.fsdp_plan.items() if style == "keep_full_weight" and "*" not in n]
    return {n: model.get_submodule(n) for n in dict.fromkeys([embed_name, head_name, *kept])}


def tie_embedded_tail(model: torch.nn.Module, distributed_config, mesh_manager) -> dict[str, str] | None:
    """For a tied model: ties head and embedding to one parameter, shards [norm, embedding, head] as one FSDP
    group (gathered once, kept through the step as transformers keeps the tail), and removes them from the
    model's `fsdp_plan`. Returns the full plan, to be restored once transformers has sharded the rest."""
    tail = _tied_tail(model)
    if tail is None:
        return None
    clash = sorted(set(distributed_config.fsdp_plan or {}) & set(tail))
    if clash:
        raise ValueError(
            f"`fsdp_plan` overrides {clash}, but this model ties its output projection to its input embedding: "
            "cpbench shards them (with the final norm) as one FSDP group under cp_size > 1. Drop those keys."
        )
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    head.weight = embed.weight  # one parameter for FSDP to manage; `from_pretrained` re-ties to the same one
    fully_shard(list(tail.values()), mesh=_fsdp_mesh(distributed_config, mesh_manager), reshard_after_forward=False,
                **fsdp_policy_kwargs(distributed_config))
    full_plan = dict(model.fsdp_plan)
    model.fsdp_plan = {k: v for k, v in full_plan.items() if k not in tail}
    return full_plan


def _fsdp_mesh(distributed_config, mesh_manager):
    replicate = distributed_config.dp_replicate_size > 1
    return mesh_manager.get_mesh(("dp_replicate", "fsdp") if replicate else "fsdp")


def plan_other_dtypes(model: torch.nn.Module) -> None:
    """FSDP2 keeps a group's trainable parameters in one dtype (`_init_mp_dtypes`: "FSDP expects uniform original
    parameter dtype"). transformers gives the modules a family keeps in fp32 by name (`_keep_in_fp32_modules_strict`)
    groups of their own; a family that builds one in another dtype by hand (HunYuan-MoE's router gate, an fp32
    Linear in a bf16 model) fails in its layer's group. Each module whose own trainable parameters keep another
    dtype than most of the model's is added to the model's `fsdp_plan`, so transformers shards it first, apart."""
    sizes: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.requires_grad:
            sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
    if len(sizes) < 2:
        return
    common = max(sizes, key=sizes.get)
    other = [name for name, m in model.named_modules()
             if name and any(p.requires_grad and p.dtype != common for p in m.parameters(recurse=False))]
    # the plan's names have `*` for layer numbers (transformers' replace_layer_number_by_wildcard)
    model.fsdp_plan = {**dict.fromkeys(map(replace_layer_number_by_wildcard, other), "free_full_weight"),
                       **model.fsdp_plan}


@contextlib.contextmanager
def value_free_init():
    """While entered, a truncated-normal init draws a clamped normal: torch's (`torch.nn.init.trunc_normal_`, which
    transformers' `initialization.trunc_normal_` calls through its TORCH_INIT_FUNCTIONS table) resamples until every
    value is in range, reading the tensor on the host, which fake tensors cannot (modernbert-decoder's init). For a
    projection, whose weights hold no values: same shapes, dtypes and storages."""
    from transformers import initialization

    def trunc_normal_(tensor, mean=0.0, std=1.0, a=-2.0, b=2.0, generator=None):
        with torch.no_grad():
            return tensor.normal_(mean, std, generator=generator).clamp_(a, b)

    table, original = initialization.TORCH_INIT_FUNCTIONS, initialization.TORCH_INIT_FUNCTIONS["trunc_normal_"]
    torch_original = torch.nn.init.trunc_normal_
    table["trunc_normal_"], torch.nn.init.trunc_normal_ = trunc_normal_, trunc_normal_
    try:
        yield
    finally:
        table["trunc_normal_"], torch.nn.init.trunc_normal_ = original, torch_original


def save_on_cpu_where_pinnable(pin_memory: bool = False, device_type: str = "cuda"):
    """torch's `save_on_cpu`, pinning host memory only where an accelerator exists to pin it for."""
    from torch.autograd.graph import save_on_cpu

    return save_on_cpu(pin_memory=pin_memory and torch.accelerator.is_available(), device_type=device_type)


def fsdp_policy_kwargs(distributed_config) -> dict:
    """transformers' `fully_shard` policy kwargs, with a parameter offload that pins host memory only where an
    accelerator exists (pinning needs one: `CPUOffloadPolicy()` fails on a CPU-only machine)."""
    kwargs = _ORIGINAL.get("policy", hf_fsdp._get_fsdp_policy_kwargs)(distributed_config)
    if "offload_policy" in kwargs and not torch.accelerator.is_available():
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    return kwargs


_ORIGINAL = {}


def install(apply) -> None:
    """Registers the CP attention function and wraps transformers' distribution hooks (idempotent). `apply`: what
    the wrapped hooks call (cpbench.cp.apply: wants_cp, prepare, shards_with_cpbench, resolve_for,
    apply_context_parallel), passed in because apply imports this module."""
    ALL_ATTENTION_FUNCTIONS.register(CP_ATTENTION_KEY, _cp_attention)
    if _ORIGINAL:
        return

    _ORIGINAL["policy"] = hf_fsdp._get_fsdp_policy_kwargs
    hf_fsdp._get_fsdp_policy_kwargs = fsdp_policy_kwargs
    modeling_utils.save_on_cpu = save_on_cpu_where_pinnable
    _ORIGINAL["prepare"] = DistributedMixin.prepare_distribute_model.__func__
    _ORIGINAL["maybe"] = DistributedMixin.maybe_distribute_model.__func__

    def prepare_distribute_model(cls, distributed_config, device_map=None):
        if not apply.wants_cp(distributed_config):
            return _ORIGINAL["prepare"](cls, distributed_config, device_map)
        return apply.prepare(cls, distributed_config, device_map)

    def maybe_distribute_model(cls, model, distributed_config, mesh_manager):
        if not apply.wants_cp(distributed_config):
            if not apply.shards_with_cpbench(distributed_config):
                return _ORIGINAL["maybe"](cls, model, distributed_config, mesh_manager)
            return _sharded(cls, model, distributed_config, mesh_manager)  # FSDP without CP, tied tail fixed
        plan = apply.resolve_for(model, distributed_config)
        model = _sharded(cls, model, distributed_config, mesh_manager)  # FSDP2 over fsdp x cp
        return apply.apply_context_parallel(model, mesh_manager, distributed_config, plan)

    def _sharded(cls, model, distributed_config, mesh_manager):
        plan_other_dtypes(model)
        full_fsdp_plan = tie_embedded_tail(model, distributed_config, mesh_manager)
        model = _ORIGINAL["maybe"](cls, model, distributed_config, mesh_manager)
        if full_fsdp_plan is not None:
            model.fsdp_plan = full_fsdp_plan
        return model

    DistributedMixin.prepare_distribute_model = classmethod(prepare_distribute_model)
    DistributedMixin.maybe_distribute_model = classmethod(maybe_distribute_model)
