"""`cpbench estimate`: a projection is the measured step minus the memory, held to real runs.

The same small points are measured (gloo, real tensors, the sweep worker's `run_point`) and projected (fake
tensors, fake process group): every rank's peak, its breakdown and the step's collectives must be equal to the
byte. No tolerance: both sides run the same code and count the same live tensors with the same tracker, and on
CPU the projection's kernels are the measured run's. One thing of the CPU backend is not projected, since no GPU
backend does it: gloo reduce-scatters through a staging copy of the whole input. A measured peak that falls on
a reduce-scatter is higher by up to that copy (the opt-in test at real widths meets one); the peaks of these
points fall elsewhere, deterministically.
"""

from __future__ import annotations

import pytest

from cpbench.harness.suite.spec import load_suite
from tests.e2e.estimate_workers import measure_then_project

# The measured side counts the smallest peak of 3 identical steps, as sweeps do (probes.py: gloo's worker thread
# can hold a finished collective's buffer a moment longer); the projection's steps are identical, it runs one.
COMMON = 'warmup_steps = 3\nmeasured_steps = 1\nparity = "off"\n'


def _points(text: str):
    return load_suite("t.toml", text=text + COMMON).points()


def matrix():
    points = []
    for kind, cp, styles, attn in (  # tiny-qwen3 ties its embeddings
        ("plain", "1, 2", "cp_ulysses\", \"cp_ring_zigzag", "sdpa"),
        ("packed", "2", "cp_ring_zigzag", "sdpa"),
        ("padded", "2", "cp_ring", "sdpa"),
        ("padded", "2", "cp_ring", "eager"),  # eager: fully masked rows are uniform (ring_masks)
    ):
        points += _points(f'model = "tiny-qwen3"\nseq_lens = [256]\ncp_sizes = [{cp}]\nbatch_kind = "{kind}"\n'
                          f'attn_implementations = ["{attn}"]\ncp_styles = ["{styles}"]\n')
    points += _points('model = "tiny-llama"\nseq_lens = [256]\ncp_sizes = [2]\n'  # untied
                      'attn_implementations = ["sdpa"]\ncp_styles = ["cp_ring_zigzag"]\n')
    points += _points('model = "tiny-mistral"\nseq_lens = [250]\ncp_sizes = [2]\nbatch_kind = "padded"\n'
                      'dtype = "bfloat16"\nattn_implementations = ["sdpa"]\ncp_styles = ["cp_ring_zigzag"]\n')
    # two options a point (each pair shares nothing of what it changes): fewer launches, every option still held
    points += _points('model = "tiny-qwen3"\nseq_lens = [256]\ncp_sizes = [2]\nactivation_checkpointing = true\n'
                      'loss = "chunked"\nbatch_kind = "packed"\nattn_implementations = ["sdpa"]\n'
                      'cp_styles = ["cp_ring_zigzag"]\n')
    points += _points('model = "tiny-llama"\nseq_lens = [256]\ncp_sizes = [2]\nactivation_checkpointing = true\n'
                      'recompute_every_n_layers = 1\noffload_activations = true\noffload_params = true\n'  # host.py
                      'max_grad_norm = 1.0\n'  # clip_grad_norm_ of the host's gradients, in the optimizer's host phase
                      'attn_implementations = ["sdpa"]\ncp_styles = ["cp_ring"]\n')
    points += _points('model = "tiny-qwen3"\nseq_lens = [256]\ncp_sizes = [2]\nmixed_precision = true\n'  # fp32 masters
                      'activation_checkpointing = true\nrecompute_policy = "op"\n'  # kept outputs: checkpoint's own
                      'norm = "fused"\n'  # the fused norm's own ops: their outputs and what they keep
                      'optimizer = "fused"\n'  # AdamW(fused=True): the CPU's fused kernel, no temporaries
                      'keep_outputs = true\ndtype = "bfloat16"\nattn_implementations = ["sdpa"]\n'
                      'cp_styles = ["cp_ulysses"]\n')
    return points


@pytest.fixture(scope="module")
def both():
    from tests.spawn import run_ranks

    points = matrix()
    cp1 = [p.to_dict() for p in points if p.world_size == 1]
    cp2 = [p.to_dict() for p in points if p.world_size == 2]
    results = {pid: {"measured": {}, "projected": {}} for pid in (p.point_id for p in points)}
    for rank, part in enumerate(run_ranks(measure_then_project, 2, cp2, 2, solo=cp1, timeout=400)):
        for pid, r in part.items():
            if r["measured"]:
                results[pid]["measured"][rank] = r["measured"]
            results[pid]["projected"].update(r["projected"])
    return results


@pytest.mark.parametrize("point_id", [p.point_id for p in matrix()])
def test_projected_equals_measured_on_every_rank(both, point_id):
    result = both[point_id]
    assert sorted(result["measured"]) == sorted(result["projected"])
    for rank, measured in result["measured"].items():
        assert result["projected"][rank] == measured, (rank, measured, result["projected"][rank])
    assert all(r["peak_bytes"] > 0 for r in result["measured"].values())
    offloads = "offload-act" in point_id or "offload-params" in point_id
    assert all((r["host_peak_bytes"] > 0) == offloads for r in result["measured"].values())


def test_the_matrix_covers_every_style_batch_kind_and_tie():
    points = matrix()
    assert {p.cp_style for p in points} == {"none", "cp_ulysses", "cp_ring", "cp_ring_zigzag"}
    assert {p.batch_kind for p in points} == {"plain", "packed", "padded"}
    assert {p.preset for p in points} >= {"tiny-qwen3", "tiny-llama"}  # tied and untied
    assert {p.loss_mode for p in points} == {"full", "chunked"}
    assert any(p.offload_activations and p.offload_params for p in points)  # the host side held equal too


# Qwen3-0.6B's widths (hidden 1024, 16 query / 8 kv heads of 128, MLP 3072) with 2 layers at 2k tokens. The
# vocabulary is cut to 16k: at 152k the output projection alone costs minutes per step on one CPU core, and its
# memory is one matmul's, which the tiny matrix already holds equal.
WIDTHS = 'model = "qwen3-0.6b"\nseq_lens = [2048]\nattn_implementations = ["sdpa"]\n'
OVERRIDES = "model_overrides = {{num_hidden_layers = 2, vocab_size = 16384, tie_word_embeddings = {tie}}}\n"


def widths_matrix():
    points = []
    points += _points(WIDTHS + OVERRIDES.format(tie="true") + 'cp_sizes = [1, 2]\n'
                      'cp_styles = ["cp_ulysses", "cp_ring", "cp_ring_zigzag"]\n')
    # untied: a head group of its own beside the embedding's; what that changes is the tail's FSDP group, the same
    # under every style, so one style at cp 2 (the whole matrix took 14 of CI's 90 minutes)
    points += _points(WIDTHS + OVERRIDES.format(tie="false") + 'cp_sizes = [2]\ncp_styles = ["cp_ring_zigzag"]\n')
    for kind in ("packed", "padded"):
        points += _points(WIDTHS + OVERRIDES.format(tie="true") + f'cp_sizes = [2]\nbatch_kind = "{kind}"\n'
                          'cp_styles = ["cp_ring_zigzag", "cp_ulysses"]\n')
    return points


def largest_group_bytes(point) -> int:
    """The largest FSDP group's unsharded bytes (a decoder layer, or the head or embedding with the final norm)."""
    from cpbench.harness.measure import step
    model = step.build_model(point, "meta")
    groups = [sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in model.model.layers]
    tail = [model.get_output_embeddings().weight, model.get_input_embeddings().weight, model.model.norm.weight]
    groups.append(sum(t.numel() * t.element_size() for t in dict.fromkeys(tail)))  # tied: one tensor
    return max(groups)


@pytest.mark.heavy
def test_projected_equals_measured_at_qwen3_widths():
    """Opt-in (`-m heavy`, about 11 minutes on 2 cores): the same comparison at real widths. One thing differs
    there by design: gloo reduce-scatters through a staging copy of the whole input, which NCCL (and a
    projection) does not make; where a measured peak falls on a reduce-scatter it is higher by up to that copy.
    So the projected peak must be at most the measured one and at least the measured one less the largest
    group's unsharded bytes; the collectives are exact."""
    from tests.spawn import run_ranks

    points = {p.point_id: p for p in widths_matrix()}
    cp1 = [p.to_dict() for p in points.values() if p.world_size == 1]
    cp2 = [p.to_dict() for p in points.values() if p.world_size == 2]
    results: dict = {}
    for world, part in ((2, cp2), (1, cp1)):
        for rank, out in enumerate(run_ranks(measure_then_project, world, part, world, 0, timeout=3000)):
            for pid, r in out.items():
                results.setdefault(pid, {"measured": {}, "projected": {}})
                results[pid]["measured"][rank] = r["measured"]
                results[pid]["projected"].update(r["projected"])
    assert sorted(results) == sorted(points)
    for pid, result in results.items():
        staging = largest_group_bytes(points[pid]) if points[pid].world_size > 1 else 0
        for rank, measured in result["measured"].items():
            projected = result["projected"][rank]
            comm = {k: v for k, v in measured.items() if k.startswith("comm_")}
            assert comm == {k: v for k, v in projected.items() if k.startswith("comm_")}, (pid, rank)
            gap = measured["peak_bytes"] - projected["peak_bytes"]
            assert 0 <= gap <= staging, (pid, rank, gap, staging, measured, projected)
            if gap == 0:
                assert projected == measured, (pid, rank)

