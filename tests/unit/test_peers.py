"""The peers registry and adapters on CPU (peers.py, peer_adapters.py, attention_level.py): which points a suite
makes, what is refused or skipped and why, how each adapter calls its package (fake packages stand in for the
CUDA-only ones), the layouts the peers expect, and the attention-level parity verdict."""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch

from cpbench.cp.layout import SequenceLayout
from cpbench.harness.peers import adapters as peer_adapters
from cpbench.harness.peers import attention_level
from cpbench.harness.peers.registry import PEERS, AttentionContext, get_peer
from cpbench.harness.run.skips import SkipRules
from cpbench.harness.suite.checks import SuiteErrors
from cpbench.harness.suite.spec import load_suite

SUITE = """
name = "p"
model = "attention-h8-d64"
level = "attention"
implementations = ["cpbench", "deepspeed", "torch_cp", "ring_flash_attn", "yunchang"]
seq_lens = [256]
cp_sizes = [1, 2]
cp_styles = ["cp_ulysses", "cp_ring", "cp_ring_zigzag"]
"""


def _load(text: str):
    return load_suite("p.toml", text=text)


def test_a_suite_makes_one_unsharded_point_and_each_peer_with_the_styles_it_has():
    points = _load(SUITE).points()
    pairs = {(p.cp_size, p.implementation, p.cp_style) for p in points}
    assert (1, "cpbench", "none") in pairs and sum(p.cp_size == 1 for p in points) == 1
    assert {s for c, i, s in pairs if i == "deepspeed"} == {"cp_ulysses"}
    assert {s for c, i, s in pairs if i == "torch_cp"} == {"cp_ring", "cp_ring_zigzag"}
    assert {s for c, i, s in pairs if i == "yunchang"} == {"cp_ulysses", "cp_ring", "cp_ring_zigzag"}
    ids = {p.point_id for p in points}
    assert "attention-h8-d64/s256/cp2/sdpa/cp_ulysses/attention/deepspeed" in ids
    assert "attention-h8-d64/s256/cp2/sdpa/cp_ulysses/attention" in ids  # cpbench's own: no suffix
    assert len({p.point_key for p in points}) == len(points)


@pytest.mark.parametrize("extra,field", [
    ('implementations = ["deepspeed"]\nlevel = "model"', "implementations"),
    ('implementations = ["megatron"]', "implementations"),
    ('level = "layer"', "level"),
    ('batch_kind = "packed"', "batch_kind"),
    ("activation_checkpointing = true", "activation_checkpointing"),
    ("world_size = 4", "world_size"),
])
def test_wrong_peer_settings_name_the_field_and_the_fix(extra, field):
    keys = {line.split(" =")[0] for line in extra.splitlines()}
    text = "\n".join(line for line in SUITE.splitlines() if line.split(" =")[0] not in keys)
    with pytest.raises(SuiteErrors) as e:
        _load(text + "\n" + extra + "\n")
    assert f"`{field}`" in str(e.value) and ("use one of" in str(e.value) or "attention" in str(e.value))


def test_peers_that_cannot_run_on_cpu_say_why_and_a_missing_package_says_how_to_install(monkeypatch):
    points = {(p.implementation, p.cp_style): p for p in _load(SUITE).points() if p.cp_size == 2}
    rules = SkipRules()
    for name in ("torch_cp", "ring_flash_attn", "yunchang"):
        why = rules.why_skip(points[(name, "cp_ring")])
        assert why and "runs on ['cuda'], not 'cpu'" in why, why
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "deepspeed" else real(n, *a))
    why = rules.why_skip(points[("deepspeed", "cp_ulysses")])
    assert "needs ['deepspeed'], not installed here: pip install 'cpbench[peers]'" in why
    assert rules.why_skip(points[("cpbench", "cp_ulysses")]) is None
    assert "measured only" in rules.why_skip(points[("cpbench", "cp_ulysses")], projection=True)
    assert get_peer("ring_flash_attn").why_unavailable("cuda") is not None  # flash-attn is not installed here


def test_the_peers_zigzag_is_cpbench_zigzag_layout():
    """ring-flash-attn, PyTorch CP (head-tail) and yunchang all cut 2cp chunks and give rank r chunks r and 2cp-1-r."""
    x = torch.arange(24)[None, :, None]
    for rank in range(3):
        chunks = x.chunk(6, dim=1)
        want = torch.cat([chunks[rank], chunks[5 - rank]], dim=1)
        assert torch.equal(SequenceLayout(24, 3, rank, "zigzag").cut(x, dim=1), want)
        assert torch.equal(SequenceLayout(24, 3, rank, "contiguous").cut(x, dim=1), x.chunk(3, dim=1)[rank])
    assert all(layout in ("contiguous", "zigzag") for peer in PEERS.values() for layout in peer.styles.values())
    assert PEERS["cpbench"].styles["cp_ring_zigzag"] == "zigzag" == PEERS["torch_cp"].styles["cp_ring_zigzag"]


def _ctx(style: str, heads=8, kv_heads=8) -> AttentionContext:
    return AttentionContext("GROUP", 1, 2, 256, heads, kv_heads, 64, style, torch.device("cpu"))


def test_ring_flash_attn_is_called_causal_on_its_group_with_the_styles_function(monkeypatch):
    calls = []
    fake = types.ModuleType("ring_flash_attn")
    fake.ring_flash_attn_func = lambda *a, **kw: calls.append(("ring", a, kw)) or a[0]
    fake.zigzag_ring_flash_attn_func = lambda *a, **kw: calls.append(("zigzag", a, kw)) or a[0]
    monkeypatch.setitem(sys.modules, "ring_flash_attn", fake)
    import transformers.modeling_flash_attention_utils as flash_utils

    monkeypatch.delattr(flash_utils, "is_flash_attn_greater_or_equal_2_10", raising=False)
    q = torch.zeros(1, 128, 8, 64)
    for style, name in (("cp_ring", "ring"), ("cp_ring_zigzag", "zigzag")):
        assert peer_adapters.ring_flash_attention(_ctx(style))(q, q, q) is q
        got, args, kwargs = calls[-1]
        assert got == name and len(args) == 3 and kwargs == {"causal": True, "softmax_scale": 64**-0.5,
                                                              "group": "GROUP"}
    assert callable(flash_utils.is_flash_attn_greater_or_equal_2_10)  # the shim for ring-flash-attn 0.1.8


def test_yunchang_gets_its_degrees_and_ring_layout(monkeypatch):
    calls = {}
    fake = types.ModuleType("yunchang")
    fake.set_seq_parallel_pg = lambda *a: calls.setdefault("groups", []).append(a)

    class LongContextAttention:
        def __init__(self, **kw):
            calls.setdefault("init", []).append(kw)

        def __call__(self, q, k, v, **kw):
            calls.setdefault("call", []).append(kw)
            return q

    fake.LongContextAttention = LongContextAttention
    monkeypatch.setitem(sys.modules, "yunchang", fake)
    q = torch.zeros(1, 128, 8, 64)
    for style in ("cp_ulysses", "cp_ring", "cp_ring_zigzag"):
        peer_adapters.yunchang_attention(_ctx(style))(q, q, q)
    assert calls["groups"] == [(2, 1, 1, 2), (1, 2, 1, 2), (1, 2, 1, 2)]  # (ulysses, ring, rank, world)
    assert [kw["ring_impl_type"] for kw in calls["init"]] == ["basic", "basic", "zigzag"]
    assert all(kw == {"causal": True, "softmax_scale": 64**-0.5} for kw in calls["call"])


def test_torch_cp_load_balancing_follows_the_style_and_gqa_is_expanded_for_it():
    assert peer_adapters.torch_cp_options("cp_ring_zigzag") == {"enable_load_balance": True}
    assert peer_adapters.torch_cp_options("cp_ring") == {"enable_load_balance": False}
    seen = []
    fn = peer_adapters._gqa_expanded(lambda q, k, v: seen.append((k, v)) or q, heads=8, kv_heads=2)
    k = torch.arange(2.0)[None, None, :, None].expand(1, 3, 2, 4)
    fn(torch.zeros(1, 3, 8, 4), k, k)
    assert seen[0][0].shape == (1, 3, 8, 4) and torch.equal(seen[0][0][0, 0, :, 0], torch.tensor([0.0] * 4 + [1.0] * 4))


def _full(seed=0):
    point = [p for p in _load(SUITE).points() if p.cp_size == 1][0]
    return point, attention_level.full_inputs(point, torch.device("cpu"))


def test_the_attention_parity_passes_the_exact_op_and_fails_a_wrong_one():
    point, full = _full()
    attention_level._REFERENCES.clear()
    q, k, v, dout = (x.clone().requires_grad_(i < 3) for i, x in enumerate(full))
    out = attention_level.unsharded(q, k, v)
    out.backward(dout)
    exact = [out.detach(), q.grad, k.grad, v.grad]
    assert attention_level._parity(point, full, exact, None, 0)["parity_status"] == "pass"
    wrong = [exact[0], exact[1], exact[2] * 1.01, exact[3]]  # a dk off by 1 %
    verdict = attention_level._parity(point, full, wrong, None, 0)
    assert verdict["parity_status"] == "fail" and verdict["grad_worst_param"] == "dk", verdict
    shifted = [exact[0].roll(1, dims=1), *exact[1:]]  # an output one token off
    assert "logits error" in attention_level._parity(point, full, shifted, None, 0)["parity_detail"]


def test_the_attention_shape_and_flops_come_from_the_model():
    point, full = _full()
    assert attention_level.attention_shape(point) == (8, 8, 64)
    assert [tuple(x.shape) for x in full] == [(1, 256, 8, 64)] * 4
    assert attention_level.attention_flops(point) == 3.5 * 4 * 8 * 256**2 * 64 / 2
