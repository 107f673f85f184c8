"""cp_usp's configuration on one process: the degree's validation, the layout that makes a Ulysses group's tokens
the ring's zigzag slice, the mesh's two views of the cp axis, and the suite field."""

from __future__ import annotations

import pytest
import torch

import cpbench
from cpbench.cp.layout import SequenceLayout
from cpbench.harness.suite.checks import SuiteErrors
from cpbench.harness.suite.spec import load_suite


@pytest.mark.parametrize("degree", [0, 3, 2.0, True])
def test_a_degree_that_does_not_divide_cp_size_is_refused_with_the_fix(degree):
    with pytest.raises(ValueError, match=r"cp_ulysses_degree.*divides cp_size=4"):
        cpbench.DistributedConfig(cp_size=4, cp_ulysses_degree=degree)
    assert cpbench.DistributedConfig(cp_size=4).cp_ulysses_degree == 1


@pytest.mark.parametrize("cp,u", [(4, 2), (8, 2), (8, 4), (4, 4), (6, 3)])
def test_a_ulysses_group_holds_the_rings_zigzag_slice_in_member_order(cp, u):
    seq = 2 * cp * 3
    ring = cp // u
    x = torch.arange(seq)
    for g in range(ring):
        group = torch.cat([SequenceLayout(seq, cp, g * u + m, "zigzag", ulysses=u).cut(x, 0) for m in range(u)])
        want = SequenceLayout(seq, ring, g, "zigzag", pad_multiple=u).cut(x, 0)
        assert torch.equal(group, want), (cp, u, g)
    held = sorted(p for r in range(cp) for p in SequenceLayout(seq, cp, r, "zigzag", ulysses=u).positions)
    assert held == list(range(seq))  # every token once


def test_the_rings_view_pads_like_the_whole_layout():
    whole = SequenceLayout(10, 4, 0, "zigzag", ulysses=2)
    ring = SequenceLayout(10, 2, 0, "zigzag", pad_multiple=2)
    assert whole.padded_len == ring.padded_len == 16 and ring.local_len == 2 * whole.local_len


def test_the_mesh_has_ulysses_inside_and_the_ring_across(monkeypatch):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from cpbench.cp.mesh import build_mesh

    dist.init_process_group("fake", rank=5, world_size=8, store=FakeStore())
    try:
        mesh = build_mesh(cpbench.DistributedConfig(fsdp_size=2, cp_size=4, cp_ulysses_degree=2), "cpu")
        groups = mesh.usp_groups
        assert dist.get_process_group_ranks(groups.ulysses) == [4, 5]
        assert dist.get_process_group_ranks(groups.ring) == [5, 7]
        assert dist.get_process_group_ranks(groups.cp) == [4, 5, 6, 7]
        assert (groups.ulysses_size, groups.ring_size) == (2, 2)
    finally:
        dist.destroy_process_group()


BASE = """
name = "u"
model = "tiny-qwen3"
seq_lens = [64]
cp_sizes = [1, 2, 4]
cp_styles = ["cp_usp", "cp_ring"]
"""


def test_the_suite_field_reaches_the_usp_points_only():
    points = load_suite("u.toml", text=BASE + "cp_ulysses_degree = 2\n").points()
    usp = [p for p in points if p.cp_style == "cp_usp"]
    assert {p.cp_size for p in usp} == {2, 4} and all(p.cp_ulysses_degree == 2 for p in usp)
    assert all(p.cp_ulysses_degree == 1 for p in points if p.cp_style != "cp_usp")
    assert "tiny-qwen3/s64/cp4/sdpa/cp_usp-u2" in {p.point_id for p in points}


@pytest.mark.parametrize("degree,why", [(4, "must divide every cp size"), (3, "must divide every cp size")])
def test_a_suite_degree_that_does_not_fit_names_the_field(degree, why):
    with pytest.raises(SuiteErrors, match=rf"`cp_ulysses_degree`.*{why}"):
        load_suite("u.toml", text=BASE + f"cp_ulysses_degree = {degree}\n")


def test_the_mesh_builds_under_torch_2_11s_inverted_axis_check(monkeypatch):
    """torch 2.11's `DeviceMesh._unflatten` raises for a named axis the mesh *has* (its check reads `in` where it
    means `not in`: pytorch/pytorch#176443), so every fsdp x cp mesh failed there. The emulation refuses what
    2.11 refuses; the mesh must still build, by axis index."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from cpbench.cp.mesh import build_mesh

    unflatten = DeviceMesh._unflatten

    def torch_2_11_unflatten(self, dim, mesh_sizes, mesh_dim_names, *args, **kwargs):
        if isinstance(dim, str) and dim in self.mesh_dim_names:
            raise ValueError(f"dim {dim} specified in `_unflatten` is not in {self.mesh_dim_names}")
        return unflatten(self, dim, mesh_sizes, mesh_dim_names, *args, **kwargs)

    monkeypatch.setattr(DeviceMesh, "_unflatten", torch_2_11_unflatten)
    dist.init_process_group("fake", rank=6, world_size=8, store=FakeStore())
    try:
        mesh = build_mesh(cpbench.DistributedConfig(fsdp_size=2, cp_size=4, cp_ulysses_degree=2), "cpu")
        assert dist.get_process_group_ranks(mesh.cp_group) == [4, 5, 6, 7]
        assert dist.get_process_group_ranks(mesh.get_mesh("fsdp").get_group()) == list(range(8))
        assert dist.get_process_group_ranks(mesh.usp_groups.ring) == [4, 6]
    finally:
        dist.destroy_process_group()
