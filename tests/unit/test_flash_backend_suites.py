"""flash_attention_3 and flash_attention_4 everywhere a backend is named: suites accept them with every CP style (on
CUDA, in fp16/bf16), the reference suite carries FlashAttention-3 (its GPU table's configuration), and a point whose
package is not installed is `skipped` with the install that fixes it, where a projection runs it (as sdpa on fake
tensors, its attention priced as the backend's kernel)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cpbench.harness.run.skips import SkipRules, kernel_package_missing
from cpbench.harness.suite.spec import load_suite

ROOT = Path(__file__).parents[2]
SUITE = """
name = "t"
model = "tiny-qwen3"
seq_lens = [64]
cp_sizes = [1, 2]
attn_implementations = ["flash_attention_3", "flash_attention_4"]
cp_styles = ["cp_ulysses", "cp_ring", "cp_ring_zigzag", "cp_usp"]
dtype = "bfloat16"
device = "cuda"
"""


def test_suites_take_both_backends_with_every_style():
    points = load_suite("t.toml", text=SUITE).points()
    styles = {(p.attn_implementation, p.cp_style) for p in points if p.cp_size == 2}
    assert styles == {(impl, style) for impl in ("flash_attention_3", "flash_attention_4")
                      for style in ("cp_ulysses", "cp_ring", "cp_ring_zigzag", "cp_usp")}
    with pytest.raises(ValueError, match=r"flash_attention_4.*device = \"cuda\""):
        load_suite("t.toml", text=SUITE.replace('device = "cuda"', 'device = "cpu"'))


@pytest.mark.parametrize("backend,install", [("flash_attention_3", "cpbench[fa3]"), ("flash_attention_4",
                                                                                     "cpbench[fa4]")])
def test_a_missing_package_is_a_clean_skip_with_the_install(backend, install):
    assert install in kernel_package_missing(backend)  # neither is installed on CPU CI
    point = next(p for p in load_suite("t.toml", text=SUITE).points() if p.attn_implementation == backend)
    why = SkipRules().why_skip(point)
    assert why is not None and install in why and backend in why
    assert SkipRules().why_skip(point, projection=True) is None  # projected as sdpa, priced as its kernel
    assert kernel_package_missing("sdpa") is None


def test_the_reference_suite_carries_flash_attention_3():
    suite = load_suite(str(ROOT / "suites" / "qwen3-0.6b-long.toml"))
    assert "flash_attention_3" in suite.attn_implementations
