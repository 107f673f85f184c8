"""Rank functions for tied input/output embeddings under CP (Qwen3-0.6B and Gemma3 tie them): both ways of
distributing a model — `from_pretrained(distributed_config=...)`, which builds the head apart and ties it after
loading, and `cpbench.parallelize` on a model that is tied already."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule
from transformers import AutoModelForCausalLM

import cpbench
from tests.dist.cp_workers import _load, _parity
from tests.dist.models import make_batch, tiny_config


def fsdp_gathered_numel(model) -> int:
    """Elements FSDP all-gathers per step, over every FSDP group once: equal to the model's unique parameter count
    unless some parameter is managed (and gathered) by two groups."""
    states, total = set(), 0
    for module in model.modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            if id(state) not in states:  # a group of several modules has one state
                states.add(id(state))
                total += sum(p._orig_size.numel() for g in state._fsdp_param_groups for p in g.fsdp_params)
    return total


def _tie_facts(model) -> dict:
    return {
        "tied": model.get_output_embeddings().weight is model.get_input_embeddings().weight,
        "gathered": fsdp_gathered_numel(model),
        "unique": sum(p.numel() for p in model.parameters()),
    }


def from_pretrained_worker(path: str, attn: str, styles: list[str]) -> dict:
    out = {}
    for style in styles:
        model = _load(path, attn, cp_size=2, cp_plan={"model.layers.*.self_attn": style})
        out[style] = {kind: _parity(model, make_batch(kind), path, attn, 2) for kind in ("plain", "packed")}
        out[style]["facts"] = _tie_facts(model)
    return out


def parallelize_worker(family: str, path: str, attn: str, styles: list[str]) -> dict:
    """`path` holds the same seeded weights, saved for the unsharded reference."""
    out = {}
    for style in styles:
        torch.manual_seed(0)
        config = tiny_config(family, tie_word_embeddings=True)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)
        model = cpbench.parallelize(
            model, cpbench.DistributedConfig(cp_size=2, cp_plan={"model.layers.*.self_attn": style})
        )
        out[style] = {"plain": _parity(model, make_batch("plain"), path, attn, 2), "facts": _tie_facts(model)}
    return out


def tied_worker(path: str, gemma_path: str, styles: list[str]) -> dict:
    return {"from_pretrained": from_pretrained_worker(path, "sdpa", styles),
            "qwen3": parallelize_worker("qwen3", path, "sdpa", ["cp_ulysses", "cp_ring_zigzag"]),
            "gemma3": parallelize_worker("gemma3", gemma_path, "eager", ["cp_ulysses", "cp_ring_zigzag"])}
