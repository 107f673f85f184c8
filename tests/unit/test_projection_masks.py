"""A projection builds a packed row's mask as transformers does (the same shape, dtype and so the same tracked memory)
without computing its values: on known positions torch would compute the S x S mask for real and then drop it
(hf_compat.known_values_are_not_tracing). At 131k tokens that was most of a projection's time and 17 GB of host memory.
"""

import pytest
import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from transformers import Qwen3Config, masking_utils

from cpbench.harness.project.projection import fake_tensors, known

SEQ = 48  # S x S = 2304 elements: small enough that torch would keep the mask's values if it computed them


def _config(attn: str, window: int | None = None) -> Qwen3Config:
    config = Qwen3Config(hidden_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                         num_hidden_layers=1, intermediate_size=32, vocab_size=64)
    config.sliding_window = window  # Qwen3's config keeps one only with use_sliding_window; the mask reads this field
    config._attn_implementation = attn
    return config


def _packed_positions() -> torch.Tensor:
    with unset_fake_temporarily():  # real values, as the projection makes its batch
        return torch.cat([torch.arange(n) for n in (20, 17, 11)])[None]


def _known_positions(mode, positions: torch.Tensor) -> torch.Tensor:
    return known(mode, {"position_ids": positions})["position_ids"]


@pytest.fixture
def computed_with_values(monkeypatch) -> list[bool]:
    """Per call of a mask function that transformers combines (`and_masks`): whether its result carries values, i.e.
    whether torch computed it for real."""
    seen, combine = [], masking_utils.and_masks

    def watched(fn):
        def mask(*indices):
            out = fn(*indices)
            seen.append(getattr(out, "constant", None) is not None)
            return out
        return mask

    monkeypatch.setattr(masking_utils, "and_masks", lambda *fns: combine(*map(watched, fns)))
    return seen


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("builder", ["create_causal_mask", "create_sliding_window_causal_mask"])
def test_a_packed_rows_mask_is_built_fake_and_the_positions_keep_their_values(attn, builder, computed_with_values):
    config = _config(attn, window=8 if builder != "create_causal_mask" else None)
    real = getattr(masking_utils, builder)(config=config, inputs_embeds=torch.zeros(1, SEQ, 16), attention_mask=None,
                                           past_key_values=None, position_ids=_packed_positions())
    computed_with_values.clear()
    with fake_tensors() as mode:
        positions = _known_positions(mode, _packed_positions())
        mask = getattr(masking_utils, builder)(config=config, inputs_embeds=torch.empty(1, SEQ, 16),
                                               attention_mask=None, past_key_values=None, position_ids=positions)
        assert (mask.shape, mask.dtype) == (real.shape, real.dtype)  # what a real run allocates
        values = positions.constant
    assert computed_with_values and not any(computed_with_values)  # the document and causal masks: no real compute
    assert values is not None and torch.equal(values, _packed_positions())  # still known to what reads them
    assert masking_utils.packed_sequence_compatibility_function.__name__ == "packed_sequence_compatibility_function"


def test_one_document_per_row_still_skips_the_mask():
    """Known positions that do not restart: transformers skips the mask (sdpa's is_causal), as on real tensors."""
    with fake_tensors() as mode:
        with unset_fake_temporarily():
            plain = torch.arange(SEQ)[None]
        mask = masking_utils.create_causal_mask(config=_config("sdpa"), inputs_embeds=torch.empty(1, SEQ, 16),
                                                attention_mask=None, past_key_values=None,
                                                position_ids=_known_positions(mode, plain))
    assert mask is None


POINT = """
name = "t"
model = "tiny-qwen3"
seq_lens = [256]
cp_sizes = [2]
world_size = 2
attn_implementations = ["sdpa"]
cp_styles = ["{style}"]
documents = [[150, 70, 36]]
"""


@pytest.mark.parametrize("style, builds", [("cp_ring_zigzag", False), ("cp_ring", False), ("cp_usp", False),
                                           ("cp_ulysses", True)])
def test_a_model_whose_every_cp_layer_is_a_ring_builds_no_mask(monkeypatch, style, builds):
    """The ring styles work every tile's mask out of the batch's inputs (cp/batch_mask.py): the model's own S x S mask
    of a packed row (16 GiB at 131k tokens) would be built for nothing (hf_compat.builds_no_mask). Ulysses runs the
    model's attention on the whole sequence and needs it."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    from cpbench.harness.project.projection import project_rank
    from cpbench.harness.suite.spec import load_suite

    calls, sdpa_mask = [], ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]
    monkeypatch.setitem(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, "sdpa",
                        lambda *a, **k: calls.append(1) or sdpa_mask(*a, **k))
    point = load_suite("t.toml", text=POINT.format(style=style)).points()[0]
    assert project_rank(point, 0)["status"] == "ok"
    assert bool(calls) == builds, (style, len(calls))
