"""Model FLOPs of a training step, causal- and sliding-window-aware, and the peak-FLOPs table for MFU.

Counted from the config (not the model), so it is unit-testable and the same for every backend and CP style:
a multiply-add is 2 FLOPs; backward costs twice the forward (gradients w.r.t. inputs and weights), so a step is
3x the forward. Only the token pairs a causal (or sliding-window) mask keeps are counted: CP's extra work
(e.g. padding, recomputation) is overhead, not model FLOPs. Norms, rotary embeddings and softmax are ignored
(< 1% at these sizes).
"""

from __future__ import annotations

from .presets import window_per_layer

# Dense bf16/fp16 tensor-core peaks (no sparsity), FLOP/s, from the vendors' data sheets. fp32 uses TF32 on
# Ampere and later only when enabled, so fp32 MFU is against the fp32 (non-tensor-core) peak.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "NVIDIA H100 80GB HBM3": {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12},
    "NVIDIA H100 PCIe": {"bfloat16": 756e12, "float16": 756e12, "float32": 51e12},
    "NVIDIA H200": {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12},
    "NVIDIA A100-SXM4-80GB": {"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12},
    "NVIDIA A100-SXM4-40GB": {"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12},
    "NVIDIA L4": {"bfloat16": 121e12, "float16": 121e12, "float32": 30e12},
    "NVIDIA A10G": {"bfloat16": 70e12, "float16": 70e12, "float32": 31.2e12},
}


def causal_pairs(seq_len: int, window: int | None = None) -> int:
    """Query-key pairs a causal mask keeps in one sequence; with a window each query sees <= `window` keys."""
    if window is None or window >= seq_len:
        return seq_len * (seq_len + 1) // 2
    # queries 0..window-1 see i+1 keys; the rest see `window`
    return window * (window + 1) // 2 + (seq_len - window) * window


def forward_flops(config, seq_len: int, batch_size: int = 1) -> int:
    """FLOPs of one forward pass over `batch_size` sequences of `seq_len` tokens."""
    h = config.hidden_size
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q_dim = config.num_attention_heads * head_dim
    kv_dim = config.num_key_value_heads * head_dim
    projections = h * q_dim + 2 * h * kv_dim + q_dim * h  # q, k, v, o
    mlp = 3 * h * config.intermediate_size  # gate, up, down
    tokens = batch_size * seq_len
    dense = 2 * tokens * config.num_hidden_layers * (projections + mlp)
    lm_head = 2 * tokens * h * config.vocab_size
    # QK^T and PV: 2 matmuls x 2 FLOPs per multiply-add, per kept pair, per head
    attention = sum(
        4 * batch_size * causal_pairs(seq_len, w) * q_dim for w in window_per_layer(config)
    )
    return dense + lm_head + attention


def train_step_flops(config, seq_len: int, batch_size: int = 1) -> int:
    return 3 * forward_flops(config, seq_len, batch_size)


def peak_flops(device_name: str | None, dtype: str) -> float | None:
    """The device's dense peak for `dtype`, or None when the device is not in the table (MFU is then null)."""
    if not device_name:
        return None
    for name, peaks in PEAK_FLOPS.items():
        if device_name == name or device_name.startswith(name):
            return peaks.get(dtype)
    return None
