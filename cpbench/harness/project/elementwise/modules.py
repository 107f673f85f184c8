"""The eager modules Liger-Kernel's benchmark scripts time, rebuilt as each script stood at its rows (fit.py traces
them on fake tensors; results/gpu/elementwise_bench.py times them on a GPU)."""

from __future__ import annotations

import torch


# Each module: its inputs made, then (forward, backward, the leaves whose gradients a benchmark clears between runs) as
# its benchmark runs them in "forward" and "full" mode.
def _relu_squared(row: dict, cfg: dict):
    x = torch.randn(cfg["M"], int(row["x_value"]), dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)  # made once, outside the timed function
    return (lambda: torch.square(torch.relu(x))), (lambda y: y.backward(dy)), [x]


def _swiglu(row: dict, cfg: dict):
    y = torch.randn(cfg["S"], cfg["B"], 2 * int(row["x_value"]), dtype=torch.bfloat16, requires_grad=True)

    def forward():
        gate, up = torch.chunk(y, 2, -1)
        return torch.nn.functional.silu(gate) * up
    return forward, (lambda out: out.sum().backward()), [y]


def _add_rms_norm(row: dict, cfg: dict, eps: float = 1e-6):
    """benchmark_fused_add_rms_norm.py's naive module: the residual add and an RMSNorm. Its H100 rows (keyed `M`): fp32
    inputs, both outputs backpropagated. Its B200 rows (ace042ec, keyed `hidden_size`): inputs of the config's dtype
    upcast to fp32, the fp32 weight times the normed rows cast back (an fp32 output), the sum cast back too; only the
    normed output is backpropagated, a gradient drawn inside the timed call, and only x's gradient is cleared."""
    if "hidden_size" in cfg:
        dtype, shape = _dtype(cfg), (int(row["x_value"]), cfg["hidden_size"])
        x, r, weight = (torch.randn(n, dtype=d, requires_grad=True) for n, d in ((shape, dtype), (shape, dtype),
                                                                                 (shape[1], torch.float32)))
        r.grad, weight.grad = torch.zeros_like(r), torch.zeros_like(weight)

        def naive():
            h = x.to(torch.float32) + r.to(torch.float32)
            return (weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + cfg["eps"])).to(dtype), h.to(dtype))[0]
        return naive, (lambda y: y.backward(torch.randn_like(y))), [x]
    shape = (cfg["M"], int(row["x_value"]))
    x, residual, dy, ds = (torch.randn(shape, dtype=torch.float32, requires_grad=i < 2) for i in range(4))
    weight = torch.ones(shape[1], requires_grad=True)

    def forward():  # returns the normed output and the new residual (the sum), as the naive module does
        h = x + residual
        return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)), h
    return forward, (lambda out: torch.autograd.backward(out, (dy, ds))), [x, residual, weight]


def _llama_rms_norm(row: dict, cfg: dict):
    """benchmark_rms_norm.py's `huggingface` provider as of its A100 rows (Liger-Kernel b5672a15): transformers'
    LlamaRMSNorm on a bf16 (M, H) input, its weight an fp32 parameter (so its output is fp32); `full` backpropagates a
    bf16 gradient, which autograd casts to the output's dtype. The benchmark clears the input's gradient between runs,
    not the weight's, so each timed run adds into it."""
    shape = (cfg["M"], int(row["x_value"]))
    x = torch.randn(shape, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.ones(shape[1], requires_grad=True)
    weight.grad = torch.zeros_like(weight)
    dy = torch.randn(shape, dtype=torch.bfloat16)

    def forward():
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + cfg["eps"])
        return weight * h.to(torch.bfloat16)
    return forward, (lambda out: out.backward(dy)), [x]


def _fused_rms_norm(row: dict, cfg: dict):
    """benchmark_rms_norm.py's `liger` provider as cpbench's fused norm runs it: one op reading the bf16 (M, H) input
    and writing the bf16 output and an fp32 statistic a row (Liger's kernel reads an fp32 weight and writes the input's
    dtype: the weight given the input's dtype here moves the same bytes but for its H x 2)."""
    from cpbench.cp.fused.norm import rms_norm

    shape = (cfg["M"], int(row["x_value"]))
    x = torch.randn(shape, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.ones(shape[1], dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(shape, dtype=torch.bfloat16)
    return (lambda: rms_norm(x, weight, cfg["eps"])[0]), (lambda out: out.backward(dy)), [x]


def _torch_jsd(row: dict, cfg: dict, beta: float = 0.5):
    """benchmark_jsd.py's `torch` provider as of its B200 rows (Liger-Kernel ace042ec): the Jensen-Shannon divergence
    of two fp32 log-distributions of (BT, V) through KLDivLoss(reduction="none", log_target=True), summed per row;
    the input is a log_softmax made before the timed call, whose backward `full` runs too. The benchmark clears that
    input's gradient between runs (`grad_to_none=[_input]`, not a leaf), never the leaf's under it, so each timed run
    adds its gradient into the leaf's (a (BT, V) fp32 add)."""
    tokens, vocab = int(row["x_value"]), cfg["vocab_size"]
    leaf = torch.randn(tokens, vocab, requires_grad=True)
    leaf.grad = torch.zeros_like(leaf)
    log_q, log_p = leaf.log_softmax(-1), torch.randn(tokens, vocab).log_softmax(-1)
    kl = torch.nn.KLDivLoss(reduction="none", log_target=True)

    def forward():
        m = torch.lerp(torch.exp(log_q), torch.exp(log_p), beta)
        loss = beta * kl(torch.log(m), log_p).sum(dim=-1) + (1 - beta) * kl(torch.log(m), log_q).sum(dim=-1)
        return (loss / log_q.shape[0]).sum()
    return forward, (lambda out: out.backward(torch.randn_like(out))), [log_q]


def _dtype(cfg: dict) -> torch.dtype:
    return getattr(torch, cfg.get("dtype", "torch.bfloat16").removeprefix("torch."))


def _hf_rope(row: dict, cfg: dict):
    """benchmark_rope.py's `huggingface` provider: transformers' apply_rotary_pos_emb on q and k made (1, T, heads, dim)
    and transposed, cos and sin made before the timed call. The 2024 script (the A100's rows, keyed `num_q_heads`) takes
    both outputs' gradients with autograd.grad; the 2026 one (the B200's) backpropagates the query's output only, a
    gradient drawn in the timed call, into the leaf under the view it clears (so each run adds into the leaf's)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    old, x = "num_q_heads" in cfg, int(row["x_value"])
    names = ("num_q_heads", "num_kv_heads") if old else ("num_attention_heads", "num_key_value_heads")
    heads = [cfg[n] for n in names]
    hidden, tokens = (x, cfg["seq_len"]) if row["x_name"] == "H" else (cfg["hidden_size"], x)
    dim, dtype = hidden // heads[0], _dtype(cfg)
    leaves = [torch.randn(1, tokens, n, dim, dtype=dtype, requires_grad=True) for n in heads]
    (q, k), (cos, sin) = (t.transpose(1, 2) for t in leaves), torch.randn(2, 1, tokens, dim, dtype=dtype)
    if old:
        grads = torch.randn_like(q), torch.randn_like(k)
        return (lambda: apply_rotary_pos_emb(q, k, cos, sin)), (lambda o: torch.autograd.grad(o, (q, k), grads)), [q, k]
    leaves[0].grad = torch.zeros_like(leaves[0])
    return (lambda: apply_rotary_pos_emb(q, k, cos, sin)[0]), (lambda y: y.backward(torch.randn_like(y))), [q]


def _llama4_rope(row: dict, cfg: dict):
    """benchmark_llama4_rope.py's `huggingface` provider as of its H100 rows (Liger-Kernel 10b6cdec, August 2025):
    transformers' Llama 4 apply_rotary_emb, the complex RoPE torchtitan's Llama runs (q and k cast to fp32 and viewed
    as complex, times the complex frequencies broadcast over the heads, cast back), on q and k made (1, T, heads,
    dim); `full` takes both inputs' gradients with autograd.grad of both outputs. Priced, never fitted."""
    from transformers.models.llama4.modeling_llama4 import apply_rotary_emb

    x = int(row["x_value"])
    hidden, tokens = (x, cfg["seq_len"]) if row["x_name"] == "H" else (cfg["hidden_size"], x)
    heads, dtype = (cfg["num_q_heads"], cfg["num_kv_heads"]), _dtype(cfg)
    q, k = (torch.randn(1, tokens, n, hidden // heads[0], dtype=dtype, requires_grad=True) for n in heads)
    freqs = torch.randn(1, tokens, hidden // heads[0] // 2, dtype=torch.complex64)  # Llama4TextRotaryEmbedding's
    grads = torch.randn_like(q), torch.randn_like(k)
    return (lambda: apply_rotary_emb(q, k, freqs)), (lambda o: torch.autograd.grad(o, (q, k), grads)), [q, k]


def _llama_mlp(row: dict, cfg: dict):
    """benchmark_swiglu.py's and benchmark_geglu.py's `huggingface` provider: transformers' LlamaMLP on a (batch, T,
    hidden) input; `full` backpropagates a gradient drawn in the timed call; only the input's gradient is cleared, so
    each run adds into the weights'. Priced, never fitted (MLP_DATA)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    dtype, default = _dtype(cfg), torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        layer = LlamaMLP(LlamaConfig(hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
                                     hidden_act=cfg["hidden_act"]))
    finally:
        torch.set_default_dtype(default)
    for p in layer.parameters():
        p.grad = torch.zeros_like(p)
    x = torch.randn(cfg.get("bsz", cfg.get("B")), int(row["x_value"]), cfg["hidden_size"], requires_grad=True,
                    dtype=dtype)
    return (lambda: layer(x)), (lambda y: y.backward(torch.randn_like(y))), [x]


def _torch_cross_entropy(row: dict, cfg: dict):
    """benchmark_cross_entropy.py's `huggingface` provider as of its A100 rows (Liger-Kernel b5672a15): torch's
    CrossEntropyLoss on fp32 logits (B x T, V); `full` backpropagates without clearing the input's gradient, so each
    run adds into it. Priced, never fitted (CE_DATA)."""
    x = torch.randn(cfg["B"] * cfg["T"], int(row["x_value"]), requires_grad=True)
    x.grad, target = torch.zeros_like(x), torch.randint(int(row["x_value"]), (cfg["B"] * cfg["T"],))
    return (lambda: torch.nn.functional.cross_entropy(x, target)), (lambda y: y.backward()), []


MODULES = {"relu_squared": _relu_squared, "megatron_swiglu": _swiglu, "fused_add_rms_norm": _add_rms_norm,
           "rms_norm": _llama_rms_norm, "jsd": _torch_jsd, "rms_norm/liger": _fused_rms_norm,
           "rope": _hf_rope, "swiglu": _llama_mlp, "geglu": _llama_mlp, "cross_entropy": _torch_cross_entropy,
           "llama4_rope": _llama4_rope}
