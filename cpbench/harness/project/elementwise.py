"""The element-wise kernels' HBM figures, `efficiency.memory`, `efficiency.memory_strided` and `memory_ramp_s`, fitted
to published timings of eager PyTorch modules, priced the way a projection prices a model's element-wise ops.

A model's element-wise kernels (fp32 norms, activations, residual adds, rotary embeddings, casts) each pay a fixed
time (a first wave's DRAM latency, a tail) besides their bytes, and one torch cannot vectorize (a strided view) runs
its index arithmetic per element: priced as bytes over the efficient HBM bandwidth plus `memory_ramp_s`, never under
a kernel's floor (`kernel_s`).

The data: Liger-Kernel's benchmark rows (github.com/linkedin/Liger-Kernel at ead96b61, benchmark/data/*.csv: the
one a row's `file` column names, else all_benchmark_data.csv), kept in results/published/elementwise with their line
numbers, time eager reference modules with triton's do_bench (CUDA events, the L2 cleared between runs). Each module
is rebuilt from its benchmark script as of the row, traced on fake tensors of the row's shape (trace.py) and priced
op by op, back to back (the benchmark times the GPU alone). The fit minimises the squared log error over the forward
rows (contiguous ones set `memory` and the ramp, strided ones `memory_strided`); the "full" rows are held out.

    python -m cpbench.harness.project.elementwise        # the H100 SXM's rows: every row, the fit and its error

H100 SXM (liger_h100_eager.csv): ReLU squared, Megatron's SwiGLU reference (a chunked input: strided) and the naive
add + RMSNorm in fp32. A100 SXM4 80GB (liger_a100_eager.csv, `--gpu a100-sxm`): transformers' LlamaRMSNorm and RoPE
(strided). B200 (liger_b200_eager.csv, `--gpu b200 --keep-ramp`): the torch Jensen-Shannon divergence (kernels of
0.5-12.6 GB, too large to set a ramp: the profile's is kept) and the Llama-3-8B's RoPE. Rows priced, never fitted:
Liger's fused (Triton) RMSNorm forward on the A100 (liger_a100_fused.csv), against cpbench's fused norm; transformers'
LlamaMLP (liger_{a100,b200}_mlp.csv), GEMMs and element-wise ops together; the 8B's residual add + RMSNorm on the B200
(liger_b200_add_rms_norm.csv), which the B200's figure, fitted to the JSD's gigabyte kernels, prices fast; torch's
cross-entropy on the A100 (liger_a100_cross_entropy.csv), whose softmax reads wide rows three times (work.py).

On another GPU, `python results/gpu/elementwise_bench.py OUT.csv` times the same modules at the same sizes there and
writes rows of the same form; `python -m cpbench.harness.project.elementwise --data OUT.csv --gpu h200` fits them.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from pathlib import Path

import torch

from cpbench.harness.project.hardware import Hardware, builtin

DATA = Path(__file__).resolve().parents[3] / "results" / "published" / "elementwise" / "liger_h100_eager.csv"
PROFILE = "h100-sxm"  # the benchmark's GPU ("NVIDIA H100 80GB HBM3")


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
           "rope": _hf_rope, "swiglu": _llama_mlp, "geglu": _llama_mlp, "cross_entropy": _torch_cross_entropy}
FUSED_DATA = DATA.with_name("liger_a100_fused.csv")  # a fused kernel's rows: priced, never fitted
MLP_DATA = {"a100-sxm": DATA.with_name("liger_a100_mlp.csv"),  # transformers' LlamaMLP: GEMMs and the activation,
            "b200": DATA.with_name("liger_b200_mlp.csv")}        # priced, never fitted
ADD_NORM_DATA = DATA.with_name("liger_b200_add_rms_norm.csv")  # the 8B's residual add + RMSNorm on a B200: priced only
CE_DATA = DATA.with_name("liger_a100_cross_entropy.csv")  # torch's cross-entropy, 16k rows of 4k-131k: priced only


def module(row: dict):
    """The module a row times: its provider's where this file rebuilds that one (Liger's fused kernel), else the
    eager reference of its name."""
    return MODULES.get(f"{row['kernel_name']}/{row['kernel_provider']}") or MODULES[row["kernel_name"]]


def rows(mode: str = "forward", path: Path = DATA) -> list[dict]:
    """The published rows of one mode: "forward" (fitted) or "full", forward and backward (held out)."""
    with open(path) as f:
        found = [r for r in csv.DictReader(f) if r.get("kernel_operation_mode") == mode]
    unknown = sorted({r.get("kernel_name") for r in found} - {name.split("/")[0] for name in MODULES})
    if unknown:
        raise ValueError(f"{path}: kernel_name {unknown}: this fit rebuilds only {sorted(MODULES)}; drop those rows "
                         "or time these modules (results/gpu/elementwise_bench.py).")
    return found


def trace(row: dict) -> list:
    """The ops a projection would price for the row's eager module (fake tensors, so any size is free)."""
    from cpbench.harness.project.projection import fake_tensors
    from cpbench.harness.project.trace import StepTrace

    cfg = json.loads(row["extra_benchmark_config_str"])
    with fake_tensors():
        forward, backward, _ = module(row)(row, cfg)
        with StepTrace() as t:
            out = forward()
            if row["kernel_operation_mode"] == "full":
                backward(out)
    return t.ops


def predicted(ops: list, hw: Hardware) -> float:
    """The kernels back to back on one stream, the host ahead of them (as the benchmark times them): the sum of the
    time model's price of each op (timing.op_seconds), which is what timing.simulate plays out for such a trace."""
    from cpbench.harness.project.timing import op_seconds

    return sum(op_seconds(o, hw, "bfloat16") for o in ops)


def _log_error(traced: list[tuple[dict, list]], hw: Hardware) -> float:
    return sum(math.log(predicted(ops, hw) / (float(r["y_value_50_ms"]) * 1e-3)) ** 2 for r, ops in traced)


def fit(traced: list[tuple[dict, list]], hw: Hardware, keep_ramp: bool = False) -> dict:
    """The figures minimising the squared log error, on a grid no finer than their data (1 % of efficiency, 0.1 us):
    `memory` and `memory_ramp_s` over the rows whose kernels are all contiguous, then `memory_strided` (the same
    ramp) over those with a strided kernel. Each with its RMS log error; a figure at the grid's edge says so.
    `keep_ramp`: the profile's ramp is kept, where every kernel of the rows is too large for them to set one."""
    def strided(ops):
        return any(o.strided for o in ops)

    plain, views = [t for t in traced if not strided(t[1])], [t for t in traced if strided(t[1])]
    efficiencies, ramps = [x / 100 for x in range(5, 101)], [round(x * 1e-7, 12) for x in range(0, 201)]
    if keep_ramp:
        ramps = [hw.memory_ramp_s]
    best = (math.inf, 0.0, 0.0)
    for e in efficiencies:
        for ramp in ramps:
            err = _log_error(plain, dataclasses.replace(hw, memory_ramp_s=ramp).with_efficiency(memory=e))
            best = min(best, (err, e, ramp))
    _, e, ramp = best
    at = dataclasses.replace(hw, memory_ramp_s=ramp).with_efficiency(memory=e)
    strided_grid = efficiencies if views else [hw.efficiency["memory_strided"]]  # no strided rows: the profile's
    err_s, e_s = min((_log_error(views, at.with_efficiency(memory_strided=x)), x) for x in strided_grid)
    edges = [name for name, v, grid in (("memory", e, efficiencies), ("memory_ramp_s", ramp, ramps),
                                        ("memory_strided", e_s, strided_grid))
             if len(grid) > 1 and v in (grid[0], grid[-1])]
    return {"memory": e, "memory_ramp_s": ramp, "memory_strided": e_s, "at_grid_edge": edges,
            "rms_log_error": math.sqrt(best[0] / max(len(plain), 1)),
            "rms_log_error_strided": math.sqrt(err_s / max(len(views), 1)), "rows": (len(plain), len(views))}


def fitted_profile(hw: Hardware, figures: dict) -> Hardware:
    return dataclasses.replace(hw, memory_ramp_s=figures["memory_ramp_s"]).with_efficiency(
        memory=figures["memory"], memory_strided=figures["memory_strided"])


def report(hw: Hardware | None = None, path: Path = DATA, keep_ramp: bool = False) -> str:
    hw = hw or builtin()[PROFILE]
    traced = [(r, trace(r)) for r in rows("forward", path)]
    f = fit(traced, hw, keep_ramp)
    fitted = fitted_profile(hw, f)
    kept = " (kept: the profile's)"
    strided_error = f"{f['rms_log_error_strided']:.3f}" if f["rows"][1] else "n/a"
    lines = [f"fit over {f['rows'][0]} rows of contiguous kernels: efficiency.memory = {f['memory']:.2f}, "
             f"memory_ramp_s = {f['memory_ramp_s'] * 1e6:.1f} us{kept if keep_ramp else ''} (RMS log error "
             f"{f['rms_log_error']:.3f}); over {f['rows'][1]} rows with a strided kernel: efficiency.memory_strided = "
             f"{f['memory_strided']:.2f}{kept if not f['rows'][1] else ''} (RMS log error {strided_error})",
             *([f"at the edge of the fit's grid (not a figure to trust): {', '.join(f['at_grid_edge'])}"]
               if f["at_grid_edge"] else []),
             "line  kernel               size    ops  MB moved  measured  fitted  shipped"]
    held_out = [(r, trace(r)) for r in rows("full", path)]
    for r, ops in traced + held_out:
        if held_out and r is held_out[0][0]:
            err = math.sqrt(_log_error(held_out, fitted) / len(held_out))
            lines.append(f"held out, forward and backward (not fitted): RMS log error {err:.3f}")
        moved = sum(o.bytes for o in ops) / 1e6
        lines.append(f"{r['line']:>4}  {r['kernel_name']:<19} {r['x_value']:>6} {len(ops):>5} {moved:>9.1f} "
                     f"{float(r['y_value_50_ms']) * 1e3:>7.1f}us {predicted(ops, fitted) * 1e6:>6.1f}us "
                     f"{predicted(ops, hw) * 1e6:>6.1f}us")
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse

    from cpbench.harness.project.hardware import load

    parser = argparse.ArgumentParser(description="Fit the element-wise kernels' HBM figures to eager timings.")
    parser.add_argument("--data", default=str(DATA), help="rows as results/published/elementwise holds them")
    parser.add_argument("--gpu", default=PROFILE, help="the profile of the GPU the rows were timed on")
    parser.add_argument("--keep-ramp", action="store_true",
                        help="keep the profile's memory_ramp_s (rows whose kernels are all too large to set it)")
    args = parser.parse_args()
    print(report(load(args.gpu), Path(args.data), args.keep_ramp), flush=True)
