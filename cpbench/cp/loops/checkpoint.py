"""A training checkpoint of a CP model that resumes at any mesh: the sharded weights and optimizer state, written with
torch's distributed checkpoint (DCP) by every rank.

FSDP2 keeps each parameter, and its optimizer state, as a DTensor sharded over `fsdp x cp`. DCP writes each shard
with its place in the whole tensor, and reads into whatever sharding the loading model has, so a checkpoint written at
cp 2 resumes at cp 4, or at fsdp 2 x cp 2. The gathered weights that `save_pretrained` writes (which load without
cpbench) are the model's export, not its training state: transformers' Trainer writes them beside this. The model
and optimizer are handed in.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

FOLDER = "cpbench_state"  # inside a checkpoint directory


def _unwrapped(optimizer) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer keeps the torch one


def has_state(checkpoint: str | Path) -> bool:
    return (Path(checkpoint) / FOLDER / ".metadata").is_file()


def save_state(model: torch.nn.Module, optimizer, checkpoint: str | Path) -> None:
    """Every rank writes its shards of the weights and the optimizer state (a collective)."""
    optimizer = _unwrapped(optimizer)
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.save(state, checkpoint_id=str(Path(checkpoint) / FOLDER))


def load_state(model: torch.nn.Module, optimizer, checkpoint: str | Path) -> None:
    """Reads a checkpoint written by `save_state` at any mesh into this rank's shards (a collective). `optimizer` None:
    the weights only."""
    if not has_state(checkpoint):
        raise ValueError(
            f"{checkpoint} holds no cpbench training state ({FOLDER}/): it was not written by a Trainer whose model "
            "ran CP. Load its weights with from_pretrained(..., distributed_config=...) and start a new run instead.")
    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, _unwrapped(optimizer))
    dcp.load(state, checkpoint_id=str(Path(checkpoint) / FOLDER))
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, _unwrapped(optimizer), state["optimizer"])
