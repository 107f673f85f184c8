"""Projected parity at cp_size 2 (2 gloo ranks): each rank contributes only the compared logit positions it
holds, and the result matches the unsharded reference — also when the sequence is padded to the layout."""

from __future__ import annotations

import pytest
import torch

from cpbench.harness.run import worker
from cpbench.harness.suite.spec import load_suite

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


def _cp2_projected_parity(texts: list[str], cache: str) -> list[dict | None]:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    out = []
    for text in texts:
        point = load_suite("t.toml", text=text).points()[-1]
        record = worker.run_point(point, rank=dist.get_rank(), device=torch.device("cpu"), budget=None,
                                  cache_dir=cache)
        out.append(record.get("parity"))
    return out


# Both points in one launch. Zigzag takes the default reference (`auto`: sharded, as for a large model in
# projected mode); Ulysses the unsharded one on rank 0.
CASES = {"cp_ring_zigzag": "auto", "cp_ulysses": "unsharded"}


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    from tests.spawn import run_ranks

    texts = [SUITE + f'cp_styles = ["{style}"]\nreference = "{ref}"\n' for style, ref in CASES.items()]
    rank0, rank1 = run_ranks(_cp2_projected_parity, 2, texts, str(tmp_path_factory.mktemp("cache")))
    assert rank1 == [None, None]
    return dict(zip(CASES, rank0))


@pytest.mark.parametrize("style", list(CASES))
def test_projected_cp2_gathers_only_the_selected_positions_and_matches(verdicts, style):
    # 250 tokens: zigzag pads to 252, so the last rank's slice is short; 64 of the 250 positions are compared
    r = verdicts[style]
    assert r["parity_status"] == "pass", r
    assert r["logits_max_err"] < r["logits_atol"]
    assert r["parity_reference"] == ("sharded" if CASES[style] == "auto" else "unsharded")
