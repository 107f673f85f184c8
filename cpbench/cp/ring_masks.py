"""The exact mask of every (query chunk, key chunk) tile of ring attention, from global positions.

Ring attention never holds the whole score matrix, so it needs the mask of one tile at a time: the queries of
one layout chunk of this rank against the keys of one chunk of another rank. Both are contiguous ranges of
global (padded) positions, so a tile is named by its two start positions and its length.

Where the mask comes from, in order of preference:
- the model-built whole mask when it is a dense 4-D tensor (sdpa: bool, True = attend; eager: additive float,
  0 = attend): slicing its rows and columns by global position is exact by construction, and it already holds
  causality, padding, packed documents and the layer's sliding window;
- otherwise (no mask, or a 2-D padding mask as flash_attention_2 gets) from positions: causal order, the
  layer's `sliding_window` (key k is visible from query q when q - k < window, transformers' definition),
  packed documents from `position_ids` restarting at 0, and the 2-D mask's padded keys.

A query row that an additive (eager) mask blocks entirely is one eager attention turns into a uniform average
over all seq_len keys: adding the dtype's minimum absorbs the scores, so its softmax sees a constant row, while
its backward still passes the score gradient through. The ring marks such rows `uniform` (all keys, scores taken
as 0 forward, the gradient kept) so that a padded query's output, and the loss HF computes from it (the last
left-pad position predicts the first real token), match the unsharded eager run. sdpa's bool masks give such rows
no key and output 0, as torch's sdpa does.

Positions >= seq_len are the layout's padding: no query attends to them and their own rows attend to nothing.
A tile is SKIP (nothing visible: not computed), FULL (everything visible: no mask needed), CAUSAL (the
diagonal tile of a plain causal mask: the kernel's own causal flag) or DENSE (an explicit bool mask).
A mask the ring cannot express is refused with a ValueError, never dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SKIP, FULL, CAUSAL, DENSE = "skip", "full", "causal", "dense"


@dataclass(frozen=True)
class TileMask:
    kind: str
    allowed: torch.Tensor | None = None  # bool [B or 1, H or 1, q, k], True = attend; only for DENSE
    uniform: torch.Tensor | None = None  # bool [B or 1, H or 1, q]: rows that see every key with score 0 (eager)


@dataclass(frozen=True)
class RingMasks:
    """Everything needed to build any tile's mask. Holds the whole model mask by reference (no copy)."""

    seq_len: int
    padded_len: int
    causal: bool
    device: torch.device
    window: int | None = None
    dense: torch.Tensor | None = None  # whole 4-D model mask [B or 1, H or 1, S, S]
    uniform_rows: torch.Tensor | None = None  # bool [B or 1, H or 1, S]: rows an additive mask blocks entirely
    key_valid: torch.Tensor | None = None  # bool [B, padded_len]: False for padded keys (2-D mask)
    doc_ids: torch.Tensor | None = None  # long [B or 1, padded_len]: packed document index, -1 for padding

    def tile(self, q_start: int, k_start: int, length: int) -> TileMask:
        if q_start >= self.seq_len or k_start >= self.seq_len:
            return TileMask(SKIP)  # an all-padding query chunk has no output to keep; padding keys are never seen
        if self.dense is not None:
            allowed = _dense_tile(self.dense, q_start, k_start, length, self.seq_len)
            return self._with_uniform_rows(allowed, q_start, k_start, length)
        return self._positions_tile(q_start, k_start, length)

    def _with_uniform_rows(self, allowed: torch.Tensor, q0: int, k0: int, n: int) -> TileMask:
        rows = None if self.uniform_rows is None else self.uniform_rows[..., q0 : q0 + n]
        if rows is None or not bool(rows.any()):
            return _classify(allowed)
        rows = torch.cat([rows, rows.new_zeros(*rows.shape[:2], n - rows.shape[-1])], -1)  # layout padding rows
        keys = torch.arange(k0, k0 + n, device=allowed.device) < self.seq_len
        return TileMask(DENSE, allowed | (rows[..., :, None] & keys), uniform=rows)

    def _positions_tile(self, q0: int, k0: int, n: int) -> TileMask:
        q_last, k_last = q0 + n - 1, k0 + n - 1
        if self.causal and k0 > q_last:
            return TileMask(SKIP)
        if self.causal and self.window is not None and q0 - k_last >= self.window:
            return TileMask(SKIP)
        plain = (
            self.key_valid is None
            and self.doc_ids is None
            and max(q_last, k_last) < self.seq_len
            and (self.window is None or q_last - k0 < self.window)
        )
        if plain and (not self.causal or k_last <= q0):
            return TileMask(FULL)
        if plain and q0 == k0:
            return TileMask(CAUSAL)
        return _classify(self._positions_allowed(q0, k0, n))

    def _positions_allowed(self, q0: int, k0: int, n: int) -> torch.Tensor:
        q = torch.arange(q0, q0 + n, device=self.device)[:, None]
        k = torch.arange(k0, k0 + n, device=self.device)[None, :]
        allowed = (q < self.seq_len) & (k < self.seq_len)
        if self.causal:
            allowed &= k <= q
        if self.window is not None:
            allowed &= q - k < self.window
        allowed = allowed[None, None]  # [1, 1, q, k]
        if self.doc_ids is not None:
            docs_q = self.doc_ids[:, q0 : q0 + n]
            docs_k = self.doc_ids[:, k0 : k0 + n]
            allowed = allowed & (docs_q[:, None, :, None] == docs_k[:, None, None, :])
        if self.key_valid is not None:
            allowed = allowed & self.key_valid[:, None, None, k0 : k0 + n]
        return allowed


def _classify(allowed: torch.Tensor) -> TileMask:
    if not bool(allowed.any()):
        return TileMask(SKIP)
    if bool(allowed.all()):
        return TileMask(FULL)
    return TileMask(DENSE, allowed)


def _dense_tile(mask: torch.Tensor, q0: int, k0: int, n: int, seq_len: int) -> torch.Tensor:
    """The tile's bool mask sliced from the whole model mask; rows/columns past seq_len stay False."""
    q1, k1 = min(q0 + n, seq_len), min(k0 + n, seq_len)
    block = _as_allowed(mask[..., q0:q1, k0:k1])
    if (q1 - q0, k1 - k0) == (n, n):
        return block
    out = torch.zeros(*block.shape[:2], n, n, dtype=torch.bool, device=block.device)
    out[..., : q1 - q0, : k1 - k0] = block
    return out


def _as_allowed(block: torch.Tensor) -> torch.Tensor:
    if block.dtype == torch.bool:
        return block
    # An additive mask (eager): 0 attends, a very negative value (-inf or the dtype's minimum) blocks.
    allowed = block == 0
    blocked = block <= torch.finfo(block.dtype).min / 2
    if not bool((allowed | blocked).all()):
        raise ValueError(
            "cp_ring: the model's additive attention mask holds values other than 0 and -inf (an attention bias, "
            "e.g. ALiBi). The ring builds a boolean mask per block and cannot carry a bias; use cp_ulysses for "
            "this model."
        )
    return allowed


def build_ring_masks(
    attention_mask,
    *,
    seq_len: int,
    padded_len: int,
    device: torch.device | str = "cpu",
    is_causal: bool = True,
    position_ids: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> RingMasks:
    """Validates what the model passed to attention and returns the `RingMasks` for this layer's call."""
    if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
        raise ValueError(
            f"cp_ring cannot express an attention_mask of type {type(attention_mask).__name__} (e.g. flex "
            "attention's BlockMask): it needs a dense 4-D mask, a 2-D padding mask or None. Load the model with "
            "attn_implementation='sdpa' or 'eager', or use cp_ulysses."
        )
    if attention_mask is not None and attention_mask.dim() == 4:
        if tuple(attention_mask.shape[-2:]) != (seq_len, seq_len):
            raise ValueError(
                f"cp_ring: attention_mask has shape {tuple(attention_mask.shape)}, but a whole mask over "
                f"seq_len={seq_len} must end in ({seq_len}, {seq_len}). Pass the model-built mask unchanged "
                "(KV caches are not supported with CP)."
            )
        if not (attention_mask.dtype == torch.bool or attention_mask.is_floating_point()):
            raise ValueError(
                f"cp_ring: a 4-D attention_mask must be bool (True = attend) or additive float, got "
                f"{attention_mask.dtype}."
            )
        if attention_mask.is_floating_point():
            # Validated whole, here, where every rank holds the same mask: a per-tile refusal would raise on one
            # rank mid-ring and leave the others blocked on their next transfer. In row blocks, so the check's
            # temporaries stay small next to the mask itself.
            for rows in attention_mask.split(256, dim=-2):
                _as_allowed(rows)
        return RingMasks(
            seq_len, padded_len, is_causal, torch.device(device), dense=attention_mask,
            uniform_rows=_eager_uniform_rows(attention_mask),
        )
    window = _check_window(sliding_window, is_causal)
    device = torch.device(device)
    key_valid = _key_valid(attention_mask, seq_len, padded_len, device)
    docs = _doc_ids(position_ids, seq_len, padded_len, device)
    return RingMasks(seq_len, padded_len, is_causal, device, window, key_valid=key_valid, doc_ids=docs)


def _eager_uniform_rows(mask: torch.Tensor) -> torch.Tensor | None:
    if not mask.is_floating_point():
        return None
    rows = ~(mask == 0).any(-1)
    return rows if bool(rows.any()) else None


def _check_window(sliding_window, is_causal: bool) -> int | None:
    if sliding_window is None:
        return None
    if not isinstance(sliding_window, int) or sliding_window <= 0:
        raise ValueError(f"cp_ring: sliding_window must be a positive int or None, got {sliding_window!r}.")
    if not is_causal:
        raise ValueError(
            f"cp_ring: sliding_window={sliding_window} on a non-causal attention module is not supported without "
            "a dense mask; load the model with attn_implementation='sdpa' or 'eager'."
        )
    return sliding_window


def _key_valid(mask: torch.Tensor | None, seq_len: int, padded_len: int, device) -> torch.Tensor | None:
    if mask is None:
        return None
    if mask.dim() != 2 or mask.shape[-1] != seq_len:
        raise ValueError(
            f"cp_ring: attention_mask has shape {tuple(mask.shape)}; expected a 4-D whole mask ending in "
            f"({seq_len}, {seq_len}), a 2-D padding mask [batch, {seq_len}] or None."
        )
    valid = torch.zeros(mask.shape[0], padded_len, dtype=torch.bool, device=device)
    valid[:, :seq_len] = mask.to(device).bool()
    return valid


def _doc_ids(position_ids: torch.Tensor | None, seq_len: int, padded_len: int, device) -> torch.Tensor | None:
    """Document index per token of packed rows (position_ids restart where a document starts), or None."""
    if position_ids is None:
        return None
    if position_ids.dim() == 1:
        position_ids = position_ids[None]
    if position_ids.dim() != 2 or position_ids.shape[-1] != seq_len:
        raise ValueError(
            f"cp_ring: position_ids has shape {tuple(position_ids.shape)}; expected [batch or 1, {seq_len}] "
            "(multi-axis rotary positions need a dense attention mask: use attn_implementation='sdpa')."
        )
    # The same rule as transformers' find_packed_sequence_indices: a new document wherever positions do not
    # step by exactly one.
    step = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
    docs = (step != 1).cumsum(-1)
    if not bool(docs.any()):
        return None
    out = torch.full((docs.shape[0], padded_len), -1, dtype=docs.dtype, device=device)
    out[:, :seq_len] = docs.to(device)
    return out
