"""A projection prices the zigzag ring's work where the point's placement puts it (`balance`, cp/balance.py): with the
per-document placement every rank's attention costs the same; with the plain zigzag (`balance = "sequence"`) each
rank's priced attention FLOPs follow the attention pairs its row reports for it (rows.attention_work), so a packed
point's slowest projected rank is the one the row's imbalance names."""

from __future__ import annotations

import pytest

from cpbench.harness.project.hardware import load
from cpbench.harness.project.projection import project_rank
from cpbench.harness.run.rows import attention_work
from cpbench.harness.suite.spec import load_suite

# One long document among short ones (the worst case for the plain zigzag), and a length that is no multiple of 2R.
SUITE = """
name = "t"
model = "tiny-qwen3"
seq_lens = [2048]
cp_sizes = [4]
world_size = 4
attn_implementations = ["sdpa"]
cp_styles = ["cp_ring_zigzag"]
dtype = "bfloat16"
device = "cuda"
documents = [[1500, 300, 181, 67]]
balance = "{balance}"
"""


def _point(balance: str):
    return load_suite("t.toml", text=SUITE.format(balance=balance)).points()[0]


def _attention_flops(point) -> list[float]:
    """Each cp rank's priced attention forward FLOPs in the projected step."""
    flops = []
    for rank in range(point.cp_size):
        ops = project_rank(point, rank, load("h100-sxm"), gpus_per_node=8, keep_trace=True)["trace"]
        flops.append(sum(op.flops for op in ops if op.kind.startswith("attention") and op.kind.endswith("forward")))
    return flops


def test_the_balance_field_reaches_the_point_and_its_key():
    plain, placed = _point("sequence"), _point("documents")
    assert plain.balance == "sequence" and "sequence-balance" in plain.point_id
    assert plain.point_key != placed.point_key  # two points, two rows in one run
    # the default keeps the key a point had before the field existed (its reference cache, its baseline rows)
    assert "balance" not in placed._key_values()
    # a style without a zigzag ring has no placement to turn off: its point keeps the default
    ulysses = load_suite("t.toml", text=SUITE.format(balance="sequence").replace("cp_ring_zigzag", "cp_ulysses"))
    assert ulysses.points()[0].balance == "documents"


@pytest.fixture(scope="module")
def priced():
    return {b: (_attention_flops(_point(b)), attention_work(_point(b))) for b in ("sequence", "documents")}


def test_the_plain_zigzag_is_priced_where_the_row_says_its_work_is(priced):
    flops, work = priced["sequence"]
    pairs = work["attention_pairs_per_rank"]
    assert work["attention_imbalance"] > 1.3  # the mix above leaves the plain zigzag far from balanced
    # the priced FLOPs are pairs x (2 x heads x (d_qk + d_v)) x layers: the same factor on every rank (a ratio of
    # exact integer sums, so equal to float rounding)
    ratios = [f / p for f, p in zip(flops, pairs)]
    assert max(ratios) == pytest.approx(min(ratios), rel=1e-9), ratios
    assert flops.index(max(flops)) == pairs.index(max(pairs))


def test_the_placed_ring_prices_every_rank_the_same_attention(priced):
    flops, work = priced["documents"]
    assert work["attention_imbalance"] <= 1.05
    assert max(flops) / (sum(flops) / len(flops)) <= 1.05, flops
    assert max(flops) < max(priced["sequence"][0])


def test_a_tiles_packed_indices_are_built_once_a_step_whatever_the_layers(monkeypatch):
    """The varlen tiles' (row, position) indices come from the batch's documents, the same for every layer: they are
    built once a forward (segments._packed) and reused by each layer, the recompute and the backward."""
    from cpbench.cp.ring import segments

    built, real = [], segments._Packed.__init__

    def counted(self, *args, **kwargs):
        built.append(1)
        real(self, *args, **kwargs)

    monkeypatch.setattr(segments._Packed, "__init__", counted)
    counts = {}
    for layers in (1, 3):
        built.clear()
        text = SUITE.format(balance="documents") + f"model_overrides = {{num_hidden_layers = {layers}}}\n"
        project_rank(load_suite("t.toml", text=text).points()[0], 1, load("h100-sxm"), gpus_per_node=8)
        counts[layers] = len(built)
    assert counts[1] > 0 and counts[3] == counts[1], counts
