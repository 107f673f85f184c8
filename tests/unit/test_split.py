"""The split hook's rotary cut: one copy per forward, shared by the layers, owning its memory."""

import gc

import pytest
import torch

from cpbench.cp.forward import ForwardState
from cpbench.cp.hf_compat import LAYOUT_KWARG, POSITION_EMBEDDINGS
from cpbench.cp.layout import SequenceLayout
from cpbench.cp.split import RotaryCuts, make_split_hook


def _tables(seq: int = 12, dim: int = 4):
    cos = torch.arange(seq * dim, dtype=torch.float32).reshape(1, seq, dim)
    return cos, cos + 1000.0


@pytest.mark.parametrize("kind", ["contiguous", "zigzag"])
def test_layers_share_one_cut_that_owns_its_memory(kind):
    layout = SequenceLayout(12, cp_size=2, rank=1, kind=kind)
    cuts, rotary = RotaryCuts(), _tables()
    first = cuts.cut(rotary, layout)
    assert cuts.cut(rotary, layout) is first  # the second layer of the same forward reuses the cut
    for got, full in zip(first, rotary):
        torch.testing.assert_close(got, layout.cut(full, dim=-2), rtol=0, atol=0)
        # A copy, not a view: a view would keep the whole table alive while layers save the cut for backward.
        assert got.untyped_storage().data_ptr() != full.untyped_storage().data_ptr()
        assert got.untyped_storage().nbytes() == got.numel() * got.element_size()


def test_new_tables_or_another_layout_are_cut_afresh():
    layout = SequenceLayout(12, cp_size=2, rank=0, kind="contiguous")
    cuts, rotary = RotaryCuts(), _tables()
    first = cuts.cut(rotary, layout)
    other_rank = cuts.cut(rotary, SequenceLayout(12, cp_size=2, rank=1, kind="contiguous"))
    assert other_rank is not first and not torch.equal(other_rank[0], first[0])
    cos, _ = rotary
    new_sin = rotary[1] * 2  # same cos object, another sin: not the same tables
    assert cuts.cut((cos, new_sin), layout) is not first
    cos.mul_(2)  # the same tensors changed in place: cut again, never the stale slice
    torch.testing.assert_close(cuts.cut(rotary, layout)[0], layout.cut(cos, dim=-2), rtol=0, atol=0)


def test_the_cache_lets_go_when_the_forward_drops_its_tables():
    layout = SequenceLayout(12, cp_size=2, rank=0, kind="zigzag")
    cuts = RotaryCuts()
    rotary = _tables()
    cuts.cut(rotary, layout)
    assert len(cuts._cuts) == 1
    del rotary
    gc.collect()
    assert len(cuts._cuts) == 0


def test_the_hook_cuts_hidden_states_and_rotary_and_passes_the_layout():
    cuts = RotaryCuts()
    make = lambda n: SequenceLayout(n, cp_size=2, rank=1, kind="contiguous")  # noqa: E731
    state = ForwardState(make)  # no forward in flight: the hook makes the layout from the length
    first, later = make_split_hook(True, state, cuts), make_split_hook(False, state, cuts)
    hidden, rotary = torch.randn(1, 12, 4), _tables()
    args, kwargs = first(None, (hidden,), {POSITION_EMBEDDINGS: rotary})
    torch.testing.assert_close(args[0], hidden[:, 6:], rtol=0, atol=0)
    assert kwargs[LAYOUT_KWARG] == make(12)
    _, later_kwargs = later(None, (args[0],), {POSITION_EMBEDDINGS: rotary})
    assert later_kwargs[POSITION_EMBEDDINGS] is kwargs[POSITION_EMBEDDINGS]  # one cut for both layers
    torch.testing.assert_close(later_kwargs[POSITION_EMBEDDINGS][0], rotary[0][:, 6:], rtol=0, atol=0)
