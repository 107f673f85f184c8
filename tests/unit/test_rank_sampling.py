"""Rank sampling in projections (projection.projected_ranks / stand_in): a projection of a large world runs only the
ranks whose work differs. On small worlds every cp rank is projected here too, and the row built from the sampled
ranks must equal the row built from all of them: every memory column of its worst rank, the host columns, the
collectives."""

from __future__ import annotations

import pytest

from cpbench.harness.project import projection
from cpbench.harness.suite.spec import load_suite

COLUMNS = ("peak_bytes", "params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "temporaries_bytes",
           "host_peak_bytes", "d2h_bytes", "h2d_bytes")


def _point(extra: str):
    text = ('model = "tiny-qwen3"\nattn_implementations = ["sdpa"]\ndevice = "cuda"\nwarmup_steps = 1\n'
            'measured_steps = 1\nparity = "off"\n' + extra)
    (point,) = load_suite("t.toml", text=text).points()
    return point


CASES = {
    # the contiguous ring (rank r computes r + 1 tiles of its causal row), with the host side of both offloads
    "ring-cp4-offload": 'seq_lens = [256]\ncp_sizes = [4]\ncp_styles = ["cp_ring"]\nactivation_checkpointing = true\n'
                        'offload_activations = true\noffload_params = true\n',
    # a length the layout pads: the last rank's slice is short
    "ulysses-padded-length": 'seq_lens = [250]\ncp_sizes = [4]\ncp_styles = ["cp_ulysses"]\n',
    "usp-cp4": 'seq_lens = [256]\ncp_sizes = [4]\ncp_styles = ["cp_usp"]\ncp_ulysses_degree = 2\n',
}


def _worst(records: dict[int, dict], ranks) -> dict:
    top = max((records[r] for r in ranks), key=lambda r: r["peak_bytes"])
    return {c: top[c] for c in COLUMNS} | {
        "host_max": max(records[r]["host_peak_bytes"] for r in ranks),
        **{k: max(records[r][k] for r in ranks) for k in top if k.startswith("comm_")}}


# Opt-in (`-m heavy`, about 50 s: every rank of four cp 4 worlds); the default suite keeps the sampling rules below.
@pytest.mark.heavy
@pytest.mark.parametrize("case", sorted(CASES))
def test_sampled_ranks_give_the_full_projections_row(case):
    point = _point(CASES[case])
    sampled = projection.projected_ranks(point)
    assert 1 < len(sampled) < point.cp_size and sampled[0] == 0 and sampled[-1] == point.cp_size - 1
    records = {r: projection.project_rank(point, r) for r in range(point.cp_size)}
    assert _worst(records, sampled) == _worst(records, range(point.cp_size))
    # every rank repeats its stand-in's record where the two hold the same work (the middle of the ring here)
    stand = {r: projection.stand_in(point, r) for r in range(point.world_size)}
    assert set(stand.values()) == set(sampled)


def test_symmetric_and_masked_batches():
    zigzag = _point('seq_lens = [256]\ncp_sizes = [4]\ncp_styles = ["cp_ring_zigzag"]\n')
    assert projection.projected_ranks(zigzag) == [0]
    packed = _point('seq_lens = [256]\ncp_sizes = [4]\ncp_styles = ["cp_ring_zigzag"]\nbatch_kind = "packed"\n')
    assert projection.projected_ranks(packed) == [0, 1, 2, 3]  # each rank's document masks differ
    fsdp = _point('seq_lens = [256]\ncp_sizes = [4]\ncp_styles = ["cp_ring"]\nworld_size = 8\n')
    assert [projection.stand_in(fsdp, r) for r in range(8)] == [0, 0, 2, 3, 0, 0, 2, 3]
