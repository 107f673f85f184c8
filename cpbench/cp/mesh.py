"""The device mesh `(pp, dp_replicate, fsdp, cp, tp)` and the views transformers asks for.

FSDP2 shards over one flattened axis `fsdp_cp`: the ranks of a cp group hold different tokens of the same
batch, so their gradients must be reduced together with the fsdp ranks'. transformers asks its mesh manager for
an axis named `fsdp`; `CPDeviceMesh` answers with `fsdp_cp`, so transformers' own FSDP2 code shards over it.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from cpbench.cp.config import DistributedConfig

MESH_DIMS = ("pp", "dp_replicate", "fsdp", "cp", "tp")


class CPDeviceMesh:
    """Duck-types transformers' `TransformersDeviceMesh` (only `get_mesh`), with `fsdp` read as `fsdp x cp`.

    `flat` is the 4-D mesh `(pp, dp_replicate, fsdp_cp, tp)` that FSDP2 shards over; `root` is the same ranks
    unflattened to `(pp, dp_replicate, fsdp, cp, tp)`, for the cp group and the fsdp view.
    """

    def __init__(self, flat: DeviceMesh, fsdp_size: int, cp_size: int, ulysses_degree: int = 1):
        self.flat = flat
        self.root = flat._unflatten(_axis(flat, "fsdp_cp"), (fsdp_size, cp_size), ("fsdp", "cp"))
        # cp_usp's two views of the cp axis: `cp_ulysses` (inner: consecutive ranks, inside a node) and `cp_ring`
        # (outer), as `fsdp` and `cp` are views of `fsdp_cp`.
        self.usp = self.root._unflatten(
            _axis(self.root, "cp"), (cp_size // ulysses_degree, ulysses_degree), ("cp_ring", "cp_ulysses")
        )

    def get_mesh(self, dims: str | tuple[str, ...]) -> DeviceMesh:
        dims = (dims,) if isinstance(dims, str) else tuple(dims)
        if "cp" in dims:
            return self.root[dims]
        return self.flat[tuple("fsdp_cp" if d == "fsdp" else d for d in dims)]

    @property
    def cp_group(self) -> torch.distributed.ProcessGroup:
        return self.root["cp"].get_group()

    @property
    def usp_groups(self) -> "UspGroups":
        return UspGroups(self.usp["cp_ulysses"].get_group(), self.usp["cp_ring"].get_group(), self.cp_group)


def _axis(mesh: DeviceMesh, name: str) -> int:
    """The index of the axis `name`: `_unflatten` is given an index, never a name, because torch 2.11 inverted
    its name check and refuses every axis the mesh has (pytorch/pytorch#176443); an index passes on every torch
    cpbench accepts."""
    return mesh.mesh_dim_names.index(name)


class UspGroups:
    """The process groups `cp_usp` runs over: its Ulysses group, its ring group, and the whole cp group."""

    def __init__(self, ulysses, ring, cp):
        self.ulysses, self.ring, self.cp = ulysses, ring, cp
        self.ulysses_size = torch.distributed.get_world_size(ulysses)
        self.ring_size = torch.distributed.get_world_size(ring)


def check_world_size(config: DistributedConfig, world_size: int) -> None:
    if config.world_size != world_size:
        sizes = " x ".join(f"{n}={s}" for n, s in zip(MESH_DIMS, config.mesh_shape))
        raise ValueError(
            f"The mesh ({sizes}) needs {config.world_size} processes, but the world has {world_size}. "
            f"Launch {config.world_size} processes (e.g. `torchrun --nproc-per-node {config.world_size}`) "
            "or change the sizes in DistributedConfig."
        )


def build_mesh(config: DistributedConfig, device_type: str) -> CPDeviceMesh:
    """Builds the 5-D root mesh; torch.distributed must be initialised."""
    check_world_size(config, torch.distributed.get_world_size())
    pp, dp_replicate, fsdp, cp, tp = config.mesh_shape
    flat = init_device_mesh(
        device_type, (pp, dp_replicate, fsdp * cp, tp), mesh_dim_names=("pp", "dp_replicate", "fsdp_cp", "tp")
    )
    return CPDeviceMesh(flat, fsdp, cp, config.cp_ulysses_degree)
