"""Projected parity at cp_size 2 (2 gloo ranks): each rank contributes only the compared logit positions it
holds, and the result matches the unsharded reference — also when the sequence is padded to the layout."""

from __future__ import annotations

import pytest
import torch

from cpbench.harness import worker
from cpbench.harness.spec import load_suite

SUITE = """
name = "t"
model = "tiny-qwen3"
seq_lens = [250]
cp_sizes = [2]
attn_implementations = ["sdpa"]
warmup_steps = 1
measured_steps = 1
parity = "projected"
"""


def _cp2_projected_parity(text: str, cache: str) -> dict | None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    point = load_suite("t.toml", text=text).points()[-1]
    record = worker.run_point(point, rank=dist.get_rank(), device=torch.device("cpu"), budget=None,
                              cache_dir=cache)
    return record.get("parity")


@pytest.mark.parametrize("style", ["cp_ring_zigzag", "cp_ulysses"])
def test_projected_cp2_gathers_only_the_selected_positions_and_matches(spawn, tmp_path, style):
    # 250 tokens: zigzag pads to 252, so the last rank's slice is short; 64 of the 250 positions are compared
    text = SUITE + f'cp_styles = ["{style}"]\n'
    rank0, rank1 = spawn(_cp2_projected_parity, 2, text, str(tmp_path))
    assert rank1 is None and rank0["parity_status"] == "pass", rank0
    assert rank0["logits_max_err"] < rank0["logits_atol"]
