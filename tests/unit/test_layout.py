"""Which tokens each rank holds, with no process group."""

import pytest
import torch

from cpbench.cp.layout import SequenceLayout
from cpbench.cp.loss.causal_lm import shift_and_cut_labels


def test_contiguous_padding_and_slices():
    layouts = [SequenceLayout(10, 4, r) for r in range(4)]
    assert layouts[0].padded_len == 12 and layouts[0].local_len == 3
    assert [l.positions for l in layouts] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert [l.valid_len for l in layouts] == [3, 3, 3, 1]


def test_zigzag_gives_rank_r_chunks_r_and_2cp_minus_1_minus_r():
    layouts = [SequenceLayout(16, 2, r, "zigzag") for r in range(2)]
    assert layouts[0].positions == [0, 1, 2, 3, 12, 13, 14, 15]
    assert layouts[1].positions == [4, 5, 6, 7, 8, 9, 10, 11]
    # Padding sits at the global end: in zigzag it is the tail of rank 0's second chunk.
    assert [SequenceLayout(13, 2, r, "zigzag").valid_len for r in range(2)] == [5, 8]


@pytest.mark.parametrize("kind", ["contiguous", "zigzag"])
@pytest.mark.parametrize("seq_len,cp", [(16, 2), (15, 2), (13, 4), (7, 4)])
def test_cut_then_restore_is_the_identity(kind, seq_len, cp):
    x = torch.arange(2 * seq_len).reshape(2, seq_len)
    slices = [SequenceLayout(seq_len, cp, r, kind).cut(x, dim=1) for r in range(cp)]
    assert all(s.shape[1] == slices[0].shape[1] for s in slices)
    assert torch.equal(SequenceLayout(seq_len, cp, 0, kind).restore(slices, dim=1), x)


def test_labels_are_shifted_on_the_full_sequence_before_the_cut():
    labels = torch.arange(10, 18).unsqueeze(0)  # 8 tokens
    first, second = (shift_and_cut_labels(labels, SequenceLayout(8, 2, r)) for r in range(2))
    # rank 0's last token predicts rank 1's first token; the very last token predicts nothing.
    assert first.tolist() == [[11, 12, 13, 14]]
    assert second.tolist() == [[15, 16, 17, -100]]


def test_unknown_layout_kind():
    with pytest.raises(ValueError, match="Unknown sequence layout 'spiral'"):
        SequenceLayout(8, 2, 0, "spiral")
