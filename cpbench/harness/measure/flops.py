"""Model FLOPs of a training step, and the peak-FLOPs table for MFU.

Model FLOPs are the work the batch's mask keeps on real tokens, counted from the config (not the model), so they
are unit-testable and the same for every backend and CP style:
- a multiply-add is 2 FLOPs; backward costs twice the forward (gradients w.r.t. inputs and weights), so a step is
  3x the forward;
- dense work (q/k/v/o projections, MLP, output projection) counts the real tokens only: a padded token is
  neither a query nor a key, and its logits feed no loss;
- attention (QK^T and PV) counts the query-key pairs the model's mask keeps: per row, per document (a packed row's
  documents start wherever `position_ids` do not step by exactly one, transformers' `find_packed_sequence_indices`
  rule, which it applies only when no 2-D `attention_mask` is given), causal, within each layer's sliding window
  (a query sees at most `window` keys, itself included), padded tokens excluded as queries and as keys.
Without a batch (the config-only call) every row is one unpadded document of `seq_len` tokens.
The dense work per token is read from the model's own modules, built once per config on the meta device (no memory,
no weights), so that every family counts what it computes (`MatmulWork`): each nn.Linear (and GPT-2's Conv1D) once,
the LM head included; a mixture of experts' stacked weights ([experts, ...]) at the share of the experts a token is
routed to (its router's `top_k` over their number), the router and shared experts whole. Attention's width per kept
pair is each layer's query heads times its query-key head dim (QK^T) plus times its value head dim (PV): multi-head
latent attention's differ, and a heterogeneous config gives them per layer.
CP's extra work (padding to a multiple of the chunks, recomputation, a ring's fully masked tiles) is overhead, not
model FLOPs. Norms, rotary embeddings and softmax are ignored (< 1% at these sizes).
"""

from __future__ import annotations

from dataclasses import dataclass

from cpbench.harness.suite.presets import window_per_layer


@dataclass(frozen=True)
class DevicePeak:
    """Dense (no 2:4 sparsity) peaks in FLOP/s: bf16/fp16 on the tensor cores; fp32 the non-tensor-core peak
    (TF32 is used only when enabled, so fp32 MFU is against plain FP32). `source`: where the figures come from;
    a data sheet that quotes "with sparsity" figures is halved."""

    bfloat16: float
    float16: float
    float32: float
    source: str


def _peak(bf16_tflops: float, fp32_tflops: float, source: str) -> DevicePeak:
    return DevicePeak(bf16_tflops * 1e12, bf16_tflops * 1e12, fp32_tflops * 1e12, source)


_H100_SXM = _peak(989, 67, "NVIDIA H100 Tensor Core GPU data sheet, H100 SXM column (1,979 TFLOPS BF16 sparse)")
_H100_NVL = _peak(835, 60, "NVIDIA H100 Tensor Core GPU data sheet, H100 NVL column (1,671 TFLOPS BF16 sparse)")
_A100 = _peak(312, 19.5, "NVIDIA A100 Tensor Core GPU data sheet (SXM and PCIe, 40 and 80 GB alike)")

# Keyed by the exact name torch.cuda.get_device_name / NVML report. No prefix matching: "NVIDIA H200 NVL" starts
# with "NVIDIA H200" but its peak is lower, and a MIG slice ("... MIG 3g.40gb") has a fraction of its GPU's.
PEAK_FLOPS: dict[str, DevicePeak] = {
    "NVIDIA H100 80GB HBM3": _H100_SXM,
    "NVIDIA H100 PCIe": _peak(756, 51, "NVIDIA H100 Tensor Core GPU data sheet, H100 PCIe (1,513 TFLOPS BF16 sparse)"),
    "NVIDIA H100 NVL": _H100_NVL,
    "NVIDIA H200": _peak(989, 67, "NVIDIA H200 Tensor Core GPU data sheet, H200 SXM column (1,979 TFLOPS BF16 "
                         "sparse)"),
    "NVIDIA H200 NVL": _peak(835, 60, "NVIDIA H200 Tensor Core GPU data sheet, H200 NVL column (1,671 TFLOPS BF16 "
                             "sparse)"),
    "NVIDIA A100-SXM4-40GB": _A100,
    "NVIDIA A100-SXM4-80GB": _A100,
    "NVIDIA A100-PCIE-40GB": _A100,
    "NVIDIA A100 80GB PCIe": _A100,
    "NVIDIA B200": _peak(2250, 75, "NVIDIA Blackwell data sheet, HGX B200 per-GPU column (4.5 PFLOPS FP16/BF16 "
                         "sparse)"),
    "NVIDIA L40S": _peak(362.05, 91.6, "NVIDIA L40S data sheet (733 TFLOPS BF16 sparse)"),
    "NVIDIA L4": _peak(121, 30.3, "NVIDIA L4 Tensor Core GPU data sheet (242 TFLOPS BF16 sparse)"),
    "NVIDIA A10": _peak(125, 31.2, "NVIDIA A10 Tensor Core GPU data sheet (250 TFLOPS BF16 sparse)"),
    "NVIDIA A10G": _peak(70, 35, "no NVIDIA data sheet (an AWS part): Baseten's 'NVIDIA A10 vs A10G' spec table"),
}


def peak_flops(device_name: str | None, dtype: str) -> float | None:
    """The device's dense peak for `dtype`, or None when it is not known (MFU is then null: see `no_peak_reason`)."""
    peak = PEAK_FLOPS.get((device_name or "").strip())
    return getattr(peak, dtype, None) if peak is not None and dtype in ("bfloat16", "float16", "float32") else None


def no_peak_reason(device_name: str | None, dtype: str) -> str | None:
    """Why `peak_flops` is None (the row's note beside a null MFU), or None when there is a peak."""
    if peak_flops(device_name, dtype) is not None:
        return None
    if (device_name or "").strip() in PEAK_FLOPS:
        return f"mfu is null: no {dtype} peak for {device_name!r} in cpbench.harness.measure.flops.PEAK_FLOPS"
    return (f"mfu is null: device {device_name!r} is not in cpbench.harness.measure.flops.PEAK_FLOPS (exact names "
            f"only; a MIG slice has a fraction of its GPU's peak): add its data-sheet figures there")


def causal_pairs(seq_len: int, window: int | None = None) -> int:
    """Query-key pairs a causal mask keeps in one sequence; with a window each query sees <= `window` keys."""
    if window is None or window >= seq_len:
        return seq_len * (seq_len + 1) // 2
    # queries 0..window-1 see i+1 keys; the rest see `window`
    return window * (window + 1) // 2 + (seq_len - window) * window


class BatchMaskCount:
    """The real tokens and the kept query-key pairs of a [B, S] batch, from its `position_ids` (documents) and
    2-D `attention_mask` (padding), in O(B x S) on the host (the batch's tensors are moved to CPU once)."""

    def __init__(self, seq_len: int, batch_size: int, position_ids=None, attention_mask=None):
        import torch

        shape = (batch_size, seq_len)
        self.valid = _rows(attention_mask, shape, "attention_mask")
        positions = _rows(position_ids, shape, "position_ids")
        index = torch.arange(seq_len).expand(shape)
        starts = torch.zeros(shape, dtype=torch.bool)
        starts[:, 0] = True
        if positions is not None and attention_mask is None:  # transformers' packed rule (see module docstring)
            starts |= torch.diff(positions.long(), dim=-1, prepend=positions[:, :1].long() - 1) != 1
        self.doc_start = torch.where(starts, index, 0).cummax(dim=-1).values  # first token of each token's document
        self.index = index
        valid = self.valid if self.valid is not None else torch.ones(shape, dtype=torch.bool)
        self._valid_long = valid.long()
        # before[:, t] = real tokens in [0, t)
        self._before = torch.cat([torch.zeros(batch_size, 1, dtype=torch.long), valid.long().cumsum(-1)], dim=-1)
        self.tokens = int(self._valid_long.sum())
        self._pairs: dict[int | None, int] = {}

    def pairs(self, window: int | None = None) -> int:
        """Kept (query, key) pairs: both real, same document, key <= query, query - key < window."""
        if window not in self._pairs:
            self._pairs[window] = int((self.keys(window) * self._valid_long).sum())
        return self._pairs[window]

    def keys(self, window: int | None = None):
        """[B, S]: the real keys each query sees (same document, key <= query, within the window); a padded query
        sees the real keys before it, as the mask lets it (kernels compute it, the model's FLOPs do not count it)."""
        low = self.doc_start if window is None else self.doc_start.clamp(min=self.index - window + 1)
        return self._before.gather(-1, self.index + 1) - self._before.gather(-1, low)


def _rows(t, shape: tuple[int, int], name: str):
    """`t` as a CPU tensor of `shape` ([S] and [1, S] broadcast over the rows), or None."""
    if t is None:
        return None
    t = t.detach().to("cpu")
    if t.dim() == 1:
        t = t[None]
    if t.dim() != 2 or t.shape[-1] != shape[1] or t.shape[0] not in (1, shape[0]):
        raise ValueError(f"{name} has shape {tuple(t.shape)}; the FLOP count needs [batch_size, seq_len] = "
                         f"{list(shape)} (or [seq_len] for every row): pass the batch's own tensor.")
    return t.expand(shape).bool() if name == "attention_mask" else t.expand(shape)


def forward_flops(config, seq_len: int, batch_size: int = 1, *, position_ids=None, attention_mask=None) -> int:
    """FLOPs of one forward pass over `batch_size` rows of `seq_len` tokens. Pass the batch's `position_ids` and
    2-D `attention_mask` (either may be None) to count packed documents and padding exactly; without them every
    row is one unpadded causal sequence."""
    work = matmul_work(config)
    windows = window_per_layer(config)
    if position_ids is None and attention_mask is None:
        tokens = batch_size * seq_len
        pairs = [batch_size * causal_pairs(seq_len, w) for w in windows]
    else:
        count = BatchMaskCount(seq_len, batch_size, position_ids, attention_mask)
        tokens = count.tokens
        pairs = [count.pairs(w) for w in windows]
    # QK^T and PV: 2 FLOPs per multiply-add, per kept pair, per query head's width
    attention = sum(2 * p * width for p, width in zip(pairs, work.attention_width, strict=True))
    return 2 * tokens * work.per_token + attention


@dataclass(frozen=True)
class MatmulWork:
    """A model's matmuls, from its modules: `per_token`, the multiply-adds one token's dense work takes (every
    weight it is multiplied by, experts at their routed share, the LM head in); `attention_width`, per layer, the
    multiply-adds of QK^T and PV per kept query-key pair (query heads x (query-key + value head dim))."""

    per_token: int
    attention_width: tuple[int, ...]


_WORK: dict[str, MatmulWork] = {}
TOP_K = ("top_k", "num_experts_per_tok", "moe_topk", "moe_k")  # where routers and configs keep experts per token


def matmul_work(config) -> MatmulWork:
    """The config's `MatmulWork`, its model built once on the meta device (cached by the config's JSON)."""
    key = config.to_json_string()
    if key not in _WORK:
        import torch
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        _WORK[key] = MatmulWork(_per_token(model, config), tuple(_attention_widths(config)))
    return _WORK[key]


def _per_token(model, config) -> int:
    import torch
    from transformers.pytorch_utils import Conv1D

    parents = {child: parent for parent in model.modules() for child in parent.children()}
    total = 0
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, Conv1D)):
            total += module.weight.numel()
        stacked = [p for p in module.parameters(recurse=False) if p.dim() == 3 and p.shape[0] > 1]  # [experts, ...]
        if stacked:
            routed = _routed(parents.get(module), config)
            total += sum(p.numel() * routed // p.shape[0] for p in stacked)
    return total


def _routed(block, config) -> int:
    """How many of a block's stacked experts a token runs: the block's or its router's `top_k` (the MoE block holds
    both), else the config's; a model that says neither is refused rather than counted at every expert."""
    for part in (block, *block.children()) if block is not None else ():
        for name in TOP_K:
            if isinstance(getattr(part, name, None), int):
                return getattr(part, name)
    for name in TOP_K:
        if isinstance(getattr(config, name, None), int):
            return getattr(config, name)
    raise ValueError(f"{type(block).__name__}: no router `top_k` nor config {list(TOP_K)} says how many experts a "
                     "token runs, so its model FLOPs are not counted")


def _attention_widths(config) -> list[int]:
    layers = config.per_layer_config if getattr(config, "is_heterogeneous", False) else \
        [config] * config.num_hidden_layers
    widths = []
    for c in layers:
        heads = c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        nope, rope = getattr(c, "qk_nope_head_dim", None), getattr(c, "qk_rope_head_dim", None)
        qk = nope + rope if nope and rope else head_dim  # multi-head latent attention: its own query-key width
        widths.append(heads * (qk + (getattr(c, "v_head_dim", None) or qk)))
    return widths


def train_step_flops(config, seq_len: int, batch_size: int = 1, *, position_ids=None, attention_mask=None) -> int:
    """3x `forward_flops` (see the module docstring); the same keyword arguments."""
    return 3 * forward_flops(config, seq_len, batch_size, position_ids=position_ids, attention_mask=attention_mask)


def attention_pairs_per_rank(point, config, batch: dict) -> list[int]:
    """The query-key pairs each cp rank's attention computes in one forward of one layer (the mean over the model's
    layers, whose windows may differ), on the point's batch and the layout its style makes of it (a zigzag ring's
    per-document placement: cpbench/cp/balance.py). Ulysses gives each rank every query of 1/cp of the heads, USP
    each member of a ring group 1/degree of the group's: their share counts as that fraction of the pairs."""
    import torch

    from cpbench.cp import STYLES
    from cpbench.cp.batch_mask import BatchFacts
    from cpbench.cp.layout import SequenceLayout

    seq_len, cp = point.seq_len, point.cp_size
    positions, mask = batch.get("position_ids"), batch.get("attention_mask")
    count = BatchMaskCount(seq_len, point.batch_size, positions, mask)
    windows = window_per_layer(config)
    keys = sum(count.keys(w).sum(0).double() for w in windows) / len(windows)  # [S]: one layer's mean
    prefix = torch.cat([keys.new_zeros(1), keys.cumsum(0)]).tolist()
    total = prefix[-1]
    style = STYLES.get(point.cp_style) if cp > 1 and point.cp_style in STYLES else None
    if style is None or style.name == "cp_ulysses" or point.level != "model":
        return [round(total / cp)] * cp
    u = point.cp_ulysses_degree if style.name == "cp_usp" else 1
    facts = BatchFacts(seq_len, mask, positions)
    layout = SequenceLayout(seq_len, cp, 0, style.layout, ulysses=u, facts=facts).balanced(point.balance)
    ring = layout.ring_view()

    def pairs(runs) -> float:
        return sum(prefix[min(b, seq_len)] - prefix[min(a, seq_len)] for a, b in runs)

    per_ring = [pairs(ring.runs_of(g)) for g in range(ring.cp_size)]
    return [round(per_ring[r // u] / u) for r in range(cp)]
