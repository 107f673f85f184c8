"""Putting CP on a model: plan resolution, hooks, the loss wrapper, and `parallelize`.

`from_pretrained(distributed_config=cpbench.DistributedConfig(cp_size=N))` reaches `prepare` and
`apply_context_parallel` through the wrappers in `hf_compat`; `parallelize` does the same for a model that is
already built (e.g. with `from_config`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cpbench.cp import hf_compat
from cpbench.cp.config import DistributedConfig
from cpbench.cp.families.mixers import AttentionCalls, check_layers
from cpbench.cp.families.window import tells_window
from cpbench.cp.forward import ForwardState, refuse_generate, wrap_forward
from cpbench.cp.layout import SequenceLayout
from cpbench.cp.loss.chunked import check_loss
from cpbench.cp.mesh import CPDeviceMesh, build_mesh
from cpbench.cp.plan import ResolvedPlan, attention_style, default_cp_plan, merge_plan, refusal_reason, resolve_plan
from cpbench.cp.ring.target import kernel_target
from cpbench.cp.split import LOCAL_EMBEDDING_FAMILIES, LocalEmbedding, RotaryCuts, make_split_hook
from cpbench.cp.usp import usp_attention


@dataclass(frozen=True)
class AttentionBinding:
    style: object
    group: dist.ProcessGroup
    kernel_target: object | None = None  # the GPU the kernels are chosen for (cp/ring/target.py), from the config
    state: ForwardState | None = None  # the forward in flight (its layout, for layers that drop their kwargs)


def wants_cp(config) -> bool:
    return isinstance(config, DistributedConfig) and config.cp_size > 1


def shards_with_cpbench(config) -> bool:
    """A cpbench config that shards without CP (cp_size 1, FSDP over more than one rank): transformers' FSDP path,
    with cpbench's fix for tied embeddings (`hf_compat.tie_embedded_tail`)."""
    return isinstance(config, DistributedConfig) and config.cp_size == 1 and config.dp_size > 1


def check_model_class(model_cls: type, model_type: str | None = None) -> None:
    if getattr(model_cls, "_supports_context_parallel", True) is False:
        raise ValueError(
            f"`{model_cls.__name__}` sets `_supports_context_parallel = False`: its layers need inputs that a "
            "sequence cut would break. Set `cp_size=1`."
        )
    reason = refusal_reason(model_type) if model_type else None
    if reason:
        raise ValueError(
            f"`{model_cls.__name__}` (model_type={model_type!r}) cannot use context parallelism: {reason}. No "
            "`cp_plan` makes a sequence cut exact there (docs/families.md has every family and why); set `cp_size=1`."
        )


def prepare(model_cls: type, config: DistributedConfig, device_map=None):
    """Initialises torch.distributed and the 5-D mesh; returns what transformers' `prepare_distribute_model` does."""
    check_model_class(model_cls, getattr(getattr(model_cls, "config_class", None), "model_type", None))
    device = hf_compat.init_distributed()
    return config, (device_map if device_map is not None else device), build_mesh(config, device.type)


def model_cp_plan(model: torch.nn.Module, config: DistributedConfig | None = None) -> dict[str, str] | None:
    """The model's full plan: the family default (or `config.base_model_cp_plan`) merged with the overrides."""
    prefix = model.base_model_prefix if model.base_model is not model else ""  # as transformers' tp_plan
    base = default_cp_plan(model.config.model_type, prefix, getattr(model.config, "base_model_cp_plan", None))
    if base is None and not (config and config.cp_plan):
        return None
    return merge_plan(base, config.cp_plan if config else None)


def resolve_for(model: torch.nn.Module, config: DistributedConfig) -> ResolvedPlan:
    check_model_class(type(model), model.config.model_type)
    check_model_head(model)
    names = [n for n, _ in model.named_modules()]
    plan = resolve_plan(model_cp_plan(model, config), names, cp_size=config.cp_size, model_name=type(model).__name__)
    check_layers(model, plan.split_modules, type(model).__name__)
    for name, style_name in plan.attention_modules.items():
        style = attention_style(style_name)
        if style.check is not None:
            style.check(model.get_submodule(name), config)
        impl = model.config._attn_implementation or "eager"
        if style.implementations is not None and impl not in style.implementations:
            raise ValueError(
                f"CP style {style_name!r} cannot serve attn_implementation={impl!r}; it serves "
                f"{list(style.implementations)}. Load the model with one of those or pick another style."
            )
    return plan


def apply_context_parallel(
    model: torch.nn.Module, mesh: CPDeviceMesh, config: DistributedConfig, plan: ResolvedPlan
) -> torch.nn.Module:
    group = mesh.cp_group
    rank = dist.get_rank(group)
    make_layout = functools.partial(SequenceLayout, cp_size=config.cp_size, rank=rank, kind=plan.layout,
                                    ulysses=config.cp_ulysses_degree if plan.layout == "zigzag" else 1)
    state = ForwardState(make_layout)
    # the module whose forward runs the decoder layers builds their mask (a multimodal wrapper's language model)
    stack = plan.first_split.rsplit(".", 2)[0] if plan.first_split.count(".") >= 2 else ""
    state.documents = hf_compat.masks_isolate_documents(type(model.get_submodule(stack)))
    if getattr(model, "cp_state", None) is not None:  # use_loss() before parallelize(): keep the choice
        state.loss = model.cp_state.loss
    rotary_cuts = RotaryCuts()
    local_embedding = _local_embedding(model, state)
    if local_embedding is not None:
        local_embedding.feed(model.get_submodule(plan.first_split))
    for name in plan.split_modules:
        hook = make_split_hook(name == plan.first_split, state, rotary_cuts, local_embedding)
        model.get_submodule(name).register_forward_pre_hook(hook, with_kwargs=True)
    styles = {name: attention_style(style_name) for name, style_name in plan.attention_modules.items()}
    for name, style in styles.items():
        groups = mesh.usp_groups if style.fn is usp_attention else group
        hf_compat.bind_attention(model.get_submodule(name),
                                 AttentionBinding(style, groups, _kernel_target(config), state))
    # No layer would read the model's mask (S x S bytes at long lengths). A family with a sliding window keeps it only
    # where an attention module is not told its window (phimoe windows its mask alone): the ring then reads the window
    # from the mask (cp/families/window.py).
    untold = getattr(model.config, "sliding_window", None) and \
        not all(tells_window(model.get_submodule(name)) for name in plan.attention_modules)
    if styles and not any(style.model_mask for style in styles.values()) and not untold:
        hf_compat.builds_no_mask(model.get_submodule(stack))
    model.cp_attention_calls = AttentionCalls(model, plan.split_modules, plan.attention_modules, type(model).__name__)
    model.cp_plan = model_cp_plan(model, config)
    model.cp_resolved_plan = plan
    model.cp_layout = make_layout  # seq_len -> this rank's SequenceLayout (what gather_sequence needs)
    model.cp_group = group
    model.forward = wrap_forward(model, state, group, causal_lm=_is_causal_lm(model))
    model.cp_state = state
    model.generate = refuse_generate
    return model


def _kernel_target(config: DistributedConfig):
    """`DistributedConfig.cp_kernel_*` as the `KernelTarget` the styles receive (None: the tensors' device)."""
    return kernel_target(config.cp_kernel_device, config.cp_kernel_capability, config.cp_kernel_cudnn_version,
                         config.cp_sdpa_kernel)


def _local_embedding(model: torch.nn.Module, state: ForwardState) -> LocalEmbedding | None:
    """The input embedding on this rank's ids only, where the family allows it (split.LOCAL_EMBEDDING_FAMILIES)."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if getattr(model.config, "model_type", None) not in LOCAL_EMBEDDING_FAMILIES or embedding is None:
        return None
    local = LocalEmbedding(state)
    embedding.register_forward_pre_hook(local.before, with_kwargs=True)
    embedding.register_forward_hook(local.after, with_kwargs=True)
    return local


def use_loss(model: torch.nn.Module, loss: str) -> torch.nn.Module:
    """How a causal LM computes its loss from `labels`: "full" (the model's logits, `out.logits` set) or "chunked"
    (the output projection and the loss chunk by chunk, never holding the full logits; `out.logits` is None).
    Works on a CP model and on one without CP (then the loss is the model's own mean over valid tokens)."""
    check_loss(loss)
    state = getattr(model, "cp_state", None)
    if state is None:
        if not _is_causal_lm(model):
            raise ValueError(f"use_loss(): `{type(model).__name__}` is not a causal LM; it has no loss to choose.")
        state = ForwardState(functools.partial(SequenceLayout, cp_size=1, rank=0))
        model.forward = wrap_forward(model, state, None, causal_lm=True)
        model.cp_state = state
    state.loss = loss
    return model


def _all_on(model: torch.nn.Module, device: torch.device) -> bool:
    tensors = [*model.parameters(), *model.buffers()]
    return all(t.device == device for t in tensors)


def _is_causal_lm(model: torch.nn.Module) -> bool:
    return model.base_model is not model and model.get_output_embeddings() is not None


def check_model_head(model: torch.nn.Module) -> None:
    """CP serves causal LMs and base models. Other heads (sequence classification, QA, ...) pool or score
    positions that a sequence cut scatters over the ranks, which would be silently wrong."""
    if model.base_model is not model and model.get_output_embeddings() is None:
        raise ValueError(
            f"`{type(model).__name__}` is neither a causal LM nor a base model: its head reads positions that "
            "context parallelism spreads over the ranks. Use a *ForCausalLM or base model, or set `cp_size=1`."
        )


def parallelize(model: torch.nn.Module, config: DistributedConfig, mesh: CPDeviceMesh | None = None):
    """Distributes a built model (e.g. from `from_config`, seeded identically on every rank) per `config`.

    `mesh`: a mesh built beforehand with `build_mesh(config, device_type)` (e.g. outside a fake-tensor mode,
    under which a DeviceMesh cannot be built); by default it is built here."""
    if not isinstance(config, DistributedConfig):
        raise TypeError(f"parallelize() needs a cpbench.DistributedConfig, got {type(config).__name__}.")
    if getattr(model, "cp_group", None) is not None or getattr(model, "_is_fsdp_managed_module", False):
        raise ValueError(
            f"parallelize(): this `{type(model).__name__}` is already distributed (by from_pretrained's "
            "distributed_config or an earlier parallelize). Pass the model built without a distributed_config."
        )
    cls = type(model)
    if mesh is None:
        config, device_map, mesh = cls.prepare_distribute_model(config)
        if mesh is None:
            return model
    else:
        if wants_cp(config):  # at cp_size 1 any causal LM shards (FSDP only), a hybrid family's included
            check_model_class(cls, model.config.model_type)
        device_map = hf_compat.init_distributed()
    if isinstance(device_map, torch.device) and not _all_on(model, device_map):
        model.to(device_map)  # a no-op move is skipped: `to()` swaps every parameter even then
    return cls.maybe_distribute_model(model, config, mesh)
