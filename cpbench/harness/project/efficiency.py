"""How fast one kernel call runs for its shape: the fraction of a kernel class's efficiency (the GPU profile's, at
the class's reference shape) that a call of another shape reaches. Shapes come from the trace (flops.py).

GEMM: on Hopper and Blackwell, a measured table by shape (gemm_tables.json: OpenXLA's matmul performance tables,
bf16 GEMM throughput on an H100 and a B200 for b in {1, 2, 4} and m, n, k from 256 to 4096), read in log space
between its points; a dimension past 4096 takes the 4096 value (the kernels are saturated there), one under 256
costs as 256 (a tile is that wide). The table gives the shape's share of its best single GEMM (b = 1: its 4096^3
point), whose level the profile's `gemm` sets: the best rate one GEMM sustains under full load (ml-engineering's
MSMF), as a step runs its GEMMs back to back for seconds. A batched call the table has faster than its best single
one (b = 4: 1.03 x on the H100, 1.18 x on the B200, a burst table's) is priced at that level too: a sustained rate is
the power limit's, which a batch of the same products meets alike (1.18 x MSMF on the B200 is its boost burst, MAMF).

Elsewhere (Ampere) a call costs its FLOPs over the core efficiency times its wave efficiency, plus the write of its
output, both arithmetic on published facts, not fits:
- waves: a GEMM runs as output tiles of 128 x 256 (either way round) spread over the SMs; the last wave of a
  problem whose tile count is not a multiple of the SMs runs partly empty (wave quantization: NVIDIA's "Matrix
  Multiplication Background User's Guide"; ml-engineering training/performance works the Llama-8B MLP through);
- the epilogue: a tile writes its output after its main loop, at HBM speed. This alone accounts for a published
  K sweep (TileLang's 8192 x 8192 x K fp16 GEMM on an H800 SXM, whose SMs and clocks are an H100 SXM's: 386, 520,
  628, 705, 736, 758, 766 TFLOP/s at K = 256 ... 16384) to 2 % at every K with one core efficiency;
- the core efficiency is solved from the profile's best-shape figure (the A100's: the sustained rate, MSMF, of an
  A100 PCIe in ml-engineering's table, 258 TFLOP/s; the shape it was measured at, with its waves and epilogue, is in
  the profile);
- and no shape runs faster than that figure: it is the fastest of the shapes its search measured (the A100's core
  efficiency, 0.854, would put a long-K, full-wave GEMM at 267 TFLOP/s, 3 % past the 258 the search's best sustained).

Which efficiency an op is priced at (`efficiency_key`: a model's own SDPA call runs the kernel the profile names).

Attention: the class's efficiency times the shape of its published curve (kernels.toml: by length, head dim and
causal mask), times the SMs a call with few thread blocks (batch x heads x query blocks of 128) can fill.
"""

from __future__ import annotations

import math
import tomllib
from functools import lru_cache
from pathlib import Path

CURVES_FILE = Path(__file__).with_name("kernels.toml")
GEMM_TABLES_FILE = Path(__file__).with_name("gemm_tables.json")
GEMM_TABLES = {9: "sm_90", 10: "sm_100"}  # capability major -> the measured table
TILES = ((128, 256), (256, 128))
QUERY_BLOCK = 128  # the flash kernels' query tile: one thread block per (batch, head, 128 queries)
REFERENCE = (16384, 128)  # a profile's attention efficiencies are at 16k tokens, head dim 128, causal
# (architecture, kernel class) -> (the curves whose shape it takes: architecture, kernel). Where a class has no
# published curve of its own it borrows the nearest one, said here: FlashAttention-4 the shape of FlashAttention-3's,
# cuDNN on Ampere FlashAttention-2's, the memory-efficient kernel on Hopper its Ampere curve; Blackwell Hopper's.
SOURCES = {
    ("hopper", "flash"): ("hopper", "flash"), ("hopper", "cudnn"): ("hopper", "cudnn"),
    ("hopper", "fa3"): ("hopper", "fa3"), ("hopper", "fa4"): ("hopper", "fa3"),
    ("hopper", "efficient"): ("ampere", "efficient"),
    ("ampere", "flash"): ("ampere", "flash"), ("ampere", "cudnn"): ("ampere", "flash"),
    ("ampere", "efficient"): ("ampere", "efficient"),
}
ARCHITECTURES = {8: "ampere", 9: "hopper", 10: "hopper"}  # capability major -> the curves it reads


@lru_cache(maxsize=1)
def curves() -> dict:
    return tomllib.loads(CURVES_FILE.read_text())


@lru_cache(maxsize=1)
def gemm_tables() -> dict:
    """arch -> ({(b, m, n, k): TFLOP/s}, the table's best single GEMM: where the profile's `gemm` figure sits)."""
    import json

    data = json.loads(GEMM_TABLES_FILE.read_text())
    out = {}
    for arch in GEMM_TABLES.values():
        table = {tuple(row[:4]): row[4] for row in data[arch]}
        out[arch] = (table, max(v for key, v in table.items() if key[0] == 1))
    return out


_SDPA_FAMILY = {"flash": "", "cudnn": "_cudnn", "efficient": "_efficient", "fa3": "_fa3", "fa4": "_fa4"}


def efficiency_key(kind: str, hw) -> str:
    """The efficiency an op's kind is priced at: a model's own SDPA call runs the kernel SDPA picks on the GPU."""
    if kind.startswith("attention_sdpa_"):
        return kind.replace("_sdpa", _SDPA_FAMILY[hw.sdpa_kernel])
    return kind


def kernel_class(key: str) -> tuple[str, str]:
    """(kernel class, direction) of an attention efficiency key: attention_cudnn_forward -> (cudnn, forward)."""
    parts = key.split("_")
    return (parts[1] if len(parts) == 3 else "flash"), parts[-1]


def _table_share(arch: str, b: int, m: int, n: int, k: int) -> float:
    """The table's throughput at (b, m, n, k) over its best single GEMM's, read in log2 space between its points (multilinear in
    m, n and k at the batch point at or below `b`)."""
    table, best = gemm_tables()[arch]
    bs = sorted({key[0] for key in table})
    b = max(v for v in bs if v <= max(b, bs[0]))
    grid = sorted({key[1] for key in table})
    corners = []
    for dim in (m, n, k):
        x = min(max(math.log2(max(dim, 1)), math.log2(grid[0])), math.log2(grid[-1]))
        lo = max(v for v in grid if math.log2(v) <= x + 1e-9)
        hi = min(v for v in grid if math.log2(v) >= x - 1e-9)
        t = 0.0 if hi == lo else (x - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
        corners.append(((lo, 1 - t), (hi, t)))
    value = 0.0
    for (mm, wm) in corners[0]:
        for (nn, wn) in corners[1]:
            for (kk, wk) in corners[2]:
                value += wm * wn * wk * table[(b, mm, nn, kk)]
    return value / best


def waves(m: int, n: int, groups: int, sms: int) -> float:
    """The share of the SMs' time a GEMM's output tiles fill (1: every wave full)."""
    best = 0.0
    for tm, tn in TILES:
        tiles = groups * math.ceil(m / tm) * math.ceil(n / tn)
        best = max(best, tiles / (math.ceil(tiles / sms) * sms)) if tiles else 1.0  # an empty GEMM: no waves
    return best


def gemm_core(hw, dtype: str) -> float:
    """The efficiency of a GEMM's main loop with every wave full: what the profile's best-shape figure implies once
    that shape's own waves and epilogue are taken out."""
    if hw.gemm_best_shape is None:  # the figure was not measured at a shape: taken as the full-wave main loop's
        return hw.efficiency["gemm"]
    m, n, k = hw.gemm_best_shape
    flops, out_bytes = 2.0 * m * n * k, 2.0 * m * n  # a bf16 output
    # measured: flops / (best x peak) = flops / (core x waves x peak) + out_bytes / hbm, solved for core
    inverse = 1.0 / hw.efficiency["gemm"] - out_bytes * hw.peak(dtype) / (flops * _hbm(hw))
    return min(1.0, 1.0 / (waves(m, n, 1, hw.sms) * inverse))


def gemm_seconds(flops: float, nbytes: float, shape: tuple, hw, dtype: str) -> float:
    """One GEMM: its main loop, then its output written; never faster than its bytes at HBM speed, nor than the
    profile's figure (the fastest its source found: the A100's search of shapes; OpenXLA's batches, bursts, meet the
    same power limit sustained). No shape recorded: at that figure."""
    floor = max(nbytes / _hbm(hw), flops / (hw.peak(dtype) * hw.efficiency["gemm"]))
    if len(shape) < 5:
        return floor
    m, n, k, groups, out_bytes = shape[:5]
    arch = GEMM_TABLES.get((hw.capability or (0, 0))[0])
    if arch is not None:  # measured: a dimension under the table's smallest costs as that one
        lo = 256
        padded = 2.0 * max(groups, 1) * max(m, lo) * max(n, lo) * max(k, lo)
        share = _table_share(arch, groups, m, n, k)
        return max(max(flops, padded) / (hw.peak(dtype) * hw.efficiency["gemm"] * share), floor)
    math_s = flops / (hw.peak(dtype) * gemm_core(hw, dtype) * waves(m, n, groups, hw.sms))
    return max(math_s + out_bytes / _hbm(hw), floor)


def _hbm(hw) -> float:
    return hw.hbm_bytes_per_s * hw.efficiency["memory"]


def architecture(hw) -> str:
    return ARCHITECTURES.get((hw.capability or (9, 0))[0], "hopper")


def attention_factor(kernel: str, direction: str, shape: tuple, hw) -> float:
    """The fraction of the kernel class's reference efficiency a call of `shape` reaches (flops.attention's shape:
    queries, keys, head dim, causal, batch x heads)."""
    if len(shape) < 5 or hw.capability is None:  # no shape recorded, or not a GPU: the curves are GPU kernels'
        return 1.0
    q_len, k_len, head_dim, causal, batch_heads = shape
    arch, source = SOURCES.get((architecture(hw), kernel), (architecture(hw), kernel))
    value = _curve_value(arch, source, direction, bool(causal), head_dim, k_len)
    reference = _curve_value(arch, source, direction, True, REFERENCE[1], REFERENCE[0])
    blocks = batch_heads * math.ceil(max(q_len, 1) / QUERY_BLOCK)
    occupancy = min(1.0, blocks / hw.sms)
    return value / reference * occupancy


def best_factor(kernel: str, direction: str, hw) -> float:
    """The highest attention_factor any call of the kernel class reaches (its fastest published point)."""
    if hw.capability is None:
        return 1.0
    arch, source = SOURCES.get((architecture(hw), kernel), (architecture(hw), kernel))
    table = curves()[arch][source]
    rows = table.get(direction) or table["fwd_bwd"]
    reference = _curve_value(arch, source, direction, True, REFERENCE[1], REFERENCE[0])
    return max(1.0, max(max(row) for row in rows.values()) / reference)


def _curve_value(arch: str, kernel: str, direction: str, causal: bool, head_dim: float, length: float) -> float:
    table = curves()[arch][kernel]
    if direction in table:
        row = _row(table[direction], causal, head_dim)
        if row is None and direction == "backward":  # only the non-causal backward is published: FA2's ratio
            base = _row(table[direction], False, head_dim)
            return _at(base, length) * _causal_backward_ratio(head_dim, length)
        return _at(row, length)
    return _at(_row(table["fwd_bwd"], causal, head_dim), length)  # one curve for both directions


def _row(table: dict, causal: bool, head_dim: float):
    prefix = "causal" if causal else "noncausal"
    dims = sorted(int(k.rsplit("_", 1)[1]) for k in table if k.startswith(prefix + "_"))
    if not dims:
        return None
    nearest = min(dims, key=lambda d: abs(math.log2(d) - math.log2(max(head_dim, 1))))
    return table[f"{prefix}_{nearest}"]


def _at(row: list, length: float) -> float:
    """The curve at `length`: linear in log2(length) between the published points; flat past the longest (the
    kernels are saturated there); below the shortest, the slope of the first doubling continued, to a tenth."""
    xs = [math.log2(v) for v in curves()["lengths"]]
    x = math.log2(max(length, 1.0))
    if x >= xs[-1]:
        return row[-1]
    if x <= xs[0]:
        slope = (row[1] - row[0]) / (xs[1] - xs[0])
        return max(row[0] + slope * (x - xs[0]), row[0] / 10)
    i = next(j for j in range(1, len(xs)) if x <= xs[j])
    t = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
    return row[i - 1] + t * (row[i] - row[i - 1])


def _causal_backward_ratio(head_dim: float, length: float) -> float:
    """Causal over non-causal backward throughput of FlashAttention-2 on Hopper, each backward implied by its
    forward + backward and forward curves (bwd = 2.5 / (3.5 / fwd_bwd - 1 / fwd))."""
    flash = curves()["hopper"]["flash"]

    def backward(causal: bool) -> float:
        both, fwd = (_at(_row(flash[k], causal, min(head_dim, 128)), length) for k in ("fwd_bwd", "forward"))
        return 2.5 / (3.5 / both - 1.0 / fwd)

    return backward(True) / backward(False)
