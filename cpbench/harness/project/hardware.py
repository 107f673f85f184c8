"""Hardware profiles for the time model: a GPU's peaks, its links, and the efficiencies it reaches, as data.

A profile is one table of `gpus.toml` (shipped with cpbench, every figure with its source) or a TOML file that
`cpbench calibrate` writes (the same fields; `--gpu FILE`). Peaks are data-sheet figures; efficiencies are the
fraction of a peak a class of kernel reaches, taken from published kernel measurements (never from the end-to-end
runs the model is judged on) or fitted by `cpbench calibrate` to a measured sweep.
"""

from __future__ import annotations

import functools
import math
import tomllib
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from cpbench.report.units import parse_bytes

GPUS_FILE = Path(__file__).with_name("gpus.toml")
# The kernels a model's own SDPA call may be priced as: torch's choices on the GPU, and FlashAttention-3 / -4 for a
# run whose model called them (transformers' flash_attention_3 / _4, which a projection runs as SDPA)
SDPA_KERNELS = ("flash", "cudnn", "efficient", "fa3", "fa4")

# What each efficiency is the fraction of (timing.py reads them by these names).
EFFICIENCIES = {
    "gemm": "dense peak, for matrix multiplications (cuBLAS)",
    "attention_forward": "dense peak, for the flash-class attention forward (torch's flash kernel, flash-attn 2)",
    "attention_backward": "dense peak, for the flash-class attention backward",
    "attention_cudnn_forward": "dense peak, for cuDNN's fused attention forward",
    "attention_cudnn_backward": "dense peak, for cuDNN's fused attention backward",
    "attention_efficient_forward": "dense peak, for the memory-efficient (cutlass) attention forward",
    "attention_efficient_backward": "dense peak, for the memory-efficient attention backward",
    "attention_fa3_forward": "dense peak, for FlashAttention-3's forward (Hopper only)",
    "attention_fa3_backward": "dense peak, for FlashAttention-3's backward",
    "attention_fa4_forward": "dense peak, for FlashAttention-4's forward (Hopper and Blackwell)",
    "attention_fa4_backward": "dense peak, for FlashAttention-4's backward",
    "memory": "HBM bandwidth, for element-wise ops, reductions and copies",
    "memory_strided": "HBM bandwidth, for element-wise ops with a strided input or output (a view that is neither "
                      "contiguous nor broadcast), which torch runs unvectorized (default: `memory`)",
    "intra_node": "the per-GPU link inside a node (NVLink), as NCCL's bus bandwidth",
    "inter_node": "the per-GPU network link across nodes (InfiniBand), as NCCL's bus bandwidth",
    "pcie": "the host link, for offload copies",
    "host": "host memory bandwidth per GPU, for an optimizer step on the host",
}
# Attention efficiencies are at causal, head dim 128, 16k tokens (efficiency.py takes other shapes from the kernels'
# published curves). A kernel that does not run on a GPU has none there; pricing one of its calls says so.
OPTIONAL = {"attention_fa3_forward", "attention_fa3_backward", "attention_fa4_forward", "attention_fa4_backward",
            "memory_strided"}


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """One GPU type in its usual node. Rates in bytes or FLOPs per second, times in seconds."""

    name: str
    title: str
    memory_bytes: int
    peak_flops: dict  # dtype name -> dense FLOP/s
    hbm_bytes_per_s: float
    intra_node_bytes_per_s: float  # per GPU, one direction
    inter_node_bytes_per_s: float  # per GPU, one direction
    pcie_bytes_per_s: float  # per GPU, one direction
    host_bytes_per_s: float  # host memory bandwidth a GPU's optimizer step gets on the host
    efficiency: dict  # EFFICIENCIES -> fraction
    kernel_s: float  # the shortest a kernel takes on the GPU (launch and tail)
    cpu_op_s: float  # host time to dispatch one op of the forward and backward (the eager framework's overhead)
    cuda_launch_s: float  # host time the CUDA driver takes to launch one kernel (what a CPU measurement lacks)
    cpu_fsdp_collective_s: float  # host time FSDP2's hooks add to each all-gather and reduce-scatter
    cpu_optimizer_tensor_s: float  # host time of the optimizer step per tensor its foreach ops take (DTensor's)
    intra_node_latency_s: float
    inter_node_latency_s: float
    sms: int  # streaming multiprocessors: what a kernel's thread blocks fill (efficiency.py)
    gemm_best_shape: tuple | None  # (m, n, k) the `gemm` efficiency was measured at (None: at full waves)
    # message size (bytes) at which NCCL reaches half its large-message bus bandwidth, inside a node and across nodes
    intra_node_half_bytes: float
    inter_node_half_bytes: float
    nccl_sm_fraction: float  # the share of the SMs NCCL's kernels take from compute they overlap
    sources: dict = field(default_factory=dict)  # field -> where the figure comes from
    device_names: tuple = ()  # the names torch / NVML report for this GPU (a measured run's `device_name`)
    # The kernel torch's SDPA runs for a model's causal bf16 attention on this GPU: cuDNN on Hopper and Blackwell
    # from torch 2.10 with cuDNN >= 9.15.1 (sdp_utils.cpp check_prefer_cudnn_attention), else flash.
    sdpa_kernel: str = "flash"
    # What a projection of this GPU picks its kernels by, as torch does on the real one: the CUDA compute capability
    # (torch.cuda.get_device_capability) and the cuDNN of the torch build the profile stands for, as
    # (major, minor, patch); `cudnn_version_number` is torch.backends.cudnn.version()'s encoding of it. None: not a
    # CUDA device (a profile of a CPU fitted by `cpbench calibrate`), or no cuDNN.
    capability: tuple | None = None
    cudnn_version: tuple | None = None
    # host time a recomputed (activation-checkpointed) layer costs beyond the ops it dispatches, torch.utils.checkpoint's
    # frames and saved-tensor hooks: at its forward, and at its replay in backward (dispatch.py). A profile written
    # before the replay's figure gives the whole at the forward.
    cpu_recompute_layer_s: float = 0.0
    cpu_recompute_replay_s: float = 0.0
    # host time op recompute's selective-checkpoint modes add to each op they see, at a layer's forward and its replay
    # (cp/recompute.py; dispatch.py)
    cpu_selective_op_s: float = 0.0
    # an element-wise kernel's fixed time beyond its bytes at the efficient HBM bandwidth: its first wave's DRAM
    # latency and its tail, a time that does not shrink with a faster memory (elementwise/)
    memory_ramp_s: float = 0.0
    # Chips of one GPU differ: the relative standard deviation of a chip's sustained compute rate across chips, and
    # how many GPUs the `gemm` figure is the slowest of (1: one chip's; 8: the slowest GPU of a node measured whole).
    # A synchronous step runs at its slowest GPU's pace (`at_scale`). 0: every chip alike, as before the figure.
    chip_spread: float = 0.0
    gemm_pace_gpus: int = 1

    def at_scale(self, gpus: int) -> Hardware:
        """The profile as a step synchronized over `gpus` GPUs runs it: at the pace of the slowest of them. Its
        compute-bound kernels' efficiencies (GEMMs, attention) are taken from the chip their figures stand for (the
        slowest of `gemm_pace_gpus` for GEMMs, one chip for the attention kernels' benchmarks) to the expected slowest
        of `gpus`, each chip's rate a normal draw of relative spread `chip_spread` (a chip's clock under the power
        limit; memory-bound kernels, links and the host keep theirs)."""
        if gpus < 1:
            raise ValueError(f"at_scale({gpus}): a step runs on 1 GPU or more")
        if not self.chip_spread:
            return self
        pace, gemm_figure = (1 - self.chip_spread * expected_slowest(n) for n in (gpus, self.gemm_pace_gpus))
        return self.with_efficiency(gemm=min(1.0, self.efficiency["gemm"] * pace / gemm_figure), **{
            k: min(1.0, v * pace) for k, v in self.efficiency.items() if k.startswith("attention")})

    def memory_efficiency(self, strided: bool = False) -> float:
        """An element-wise kernel's fraction of the HBM peak; a strided one's (`memory_strided`), where the profile
        gives it, else the same."""
        memory = self.efficiency["memory"]
        return self.efficiency.get("memory_strided", memory) if strided else memory

    @property
    def cudnn_version_number(self) -> int | None:
        """cuDNN's version as torch.backends.cudnn.version() and torch's CUDNN_VERSION give it (9.20.0 -> 92000)."""
        if self.cudnn_version is None:
            return None
        major, minor, patch = self.cudnn_version
        return major * 10000 + minor * 100 + patch

    def peak(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise ValueError(f"GPU profile {self.name!r} has no peak for dtype {dtype!r}: it has "
                             f"{sorted(self.peak_flops)}; add `{dtype}_tflops` to the profile.")
        return self.peak_flops[dtype]

    def with_efficiency(self, **changes: float) -> Hardware:
        return replace(self, efficiency={**self.efficiency, **changes})

    def to_toml(self) -> str:
        """The profile as a TOML table that `load` reads back (what `cpbench calibrate` writes)."""
        d = asdict(self)
        lines = [f"[{self.name}]", f"title = {_q(self.title)}", f"memory = {_q(str(self.memory_bytes))}",
                 f"sdpa_kernel = {_q(self.sdpa_kernel)}",
                 *([f"capability = [{self.capability[0]}, {self.capability[1]}]"] if self.capability else []),
                 *([f"cudnn_version = {_q('.'.join(map(str, self.cudnn_version)))}"] if self.cudnn_version else []),
                 "device_names = [" + ", ".join(_q(n) for n in self.device_names) + "]"]
        lines += [f"{dt}_tflops = {v / 1e12!r}" for dt, v in d["peak_flops"].items()]
        for key, unit in _RATES.items():
            lines.append(f"{key} = {d[_RATE_FIELDS[key]] / unit!r}")
        lines += [f"{k} = {d[k]!r}" for k in _SCALARS]
        lines += [f"sms = {self.sms}", f"gemm_pace_gpus = {self.gemm_pace_gpus}"]
        lines += [f"gemm_best_shape = {list(self.gemm_best_shape)}"] if self.gemm_best_shape else []
        lines += [f"{k} = {d[f] / 2**20!r}" for k, f in _HALF.items()]
        lines.append(f"\n[{self.name}.efficiency]")
        lines += [f"{k} = {v!r}" for k, v in d["efficiency"].items()]
        if self.sources:
            lines.append(f"\n[{self.name}.sources]")
            lines += [f"{k} = {_q(v)}" for k, v in self.sources.items()]
        return "\n".join(lines) + "\n"


_RATES = {"hbm_tb_s": 1e12, "nvlink_gb_s": 1e9, "network_gb_s": 1e9, "pcie_gb_s": 1e9, "host_gb_s": 1e9}
_RATE_FIELDS = {"hbm_tb_s": "hbm_bytes_per_s", "nvlink_gb_s": "intra_node_bytes_per_s",
                "network_gb_s": "inter_node_bytes_per_s", "pcie_gb_s": "pcie_bytes_per_s",
                "host_gb_s": "host_bytes_per_s"}
_SCALARS = ("kernel_s", "cpu_op_s", "cuda_launch_s", "cpu_fsdp_collective_s", "cpu_optimizer_tensor_s",
            "cpu_recompute_layer_s", "cpu_recompute_replay_s", "cpu_selective_op_s", "memory_ramp_s",
            "intra_node_latency_s", "inter_node_latency_s", "nccl_sm_fraction", "chip_spread")
# Figures later stages added, which a profile file written before them lacks: 0, what the model then assumed
_SCALARS_SINCE = ("cpu_recompute_layer_s", "cpu_recompute_replay_s", "cpu_selective_op_s", "memory_ramp_s",
                  "chip_spread")
_HALF = {"intra_node_half_mib": "intra_node_half_bytes", "inter_node_half_mib": "inter_node_half_bytes"}
_DTYPES = {"bf16_tflops": "bfloat16", "fp16_tflops": "float16", "fp32_tflops": "float32",
           "bfloat16_tflops": "bfloat16", "float16_tflops": "float16", "float32_tflops": "float32"}


@functools.cache
def expected_slowest(gpus: int) -> float:
    """The expected largest of `gpus` independent standard normal draws (0 for one GPU; 1.42 for 8, 2.59 for
    128): how many spreads the slowest of that many chips falls below the median chip. The order statistic's
    integral, x n phi(x) Phi(x)^(n-1) over x, by the midpoint rule (exact to 1e-6 here)."""
    xs = [(i + 0.5) / 1000 for i in range(-10_000, 10_000)] if gpus > 1 else []
    return float(sum(x * gpus * math.exp(-x * x / 2) / math.sqrt(2 * math.pi) / 1000
                     * (0.5 + 0.5 * math.erf(x / math.sqrt(2))) ** (gpus - 1) for x in xs))


def _q(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _parse(name: str, table: dict, defaults: dict, origin: str) -> Hardware:
    merged = {**dict.fromkeys(_SCALARS_SINCE, 0.0), **defaults,
              **{k: v for k, v in table.items() if not isinstance(v, dict)}}
    efficiency = {**defaults.get("efficiency", {}), **table.get("efficiency", {})}
    sources = {**defaults.get("sources", {}), **table.get("sources", {})}
    where = f"GPU profile {name!r} ({origin})"
    unknown = set(efficiency) - set(EFFICIENCIES)
    if unknown:
        raise ValueError(f"{where}: unknown efficiency {sorted(unknown)}; known: {sorted(EFFICIENCIES)}.")
    missing = [k for k in (*_RATES, *_SCALARS, *_HALF, "memory", "sms") if k not in merged] + \
        [f"efficiency.{k}" for k in EFFICIENCIES if k not in efficiency and k not in OPTIONAL]
    if missing:
        raise ValueError(f"{where}: missing {missing}; give each (see cpbench/harness/project/gpus.toml).")
    sdpa = merged.get("sdpa_kernel", "flash")
    if sdpa not in SDPA_KERNELS:
        raise ValueError(f"{where}: sdpa_kernel = {sdpa!r}: give one of {list(SDPA_KERNELS)}.")
    capability, cudnn = _capability(merged, where), _cudnn_version(merged, where)
    shape = merged.get("gemm_best_shape")
    if shape is not None and not (isinstance(shape, list) and len(shape) == 3
                                  and all(isinstance(v, int) and v > 0 for v in shape)):
        raise ValueError(f"{where}: gemm_best_shape = {shape!r}: give the [m, n, k] the gemm efficiency was measured "
                         "at, e.g. [2048, 2048, 13312].")
    unread = [k for k in _SCALARS if type(merged[k]) not in (int, float)]
    if unread:
        raise ValueError(f"{where}: {', '.join(f'{k} = {merged[k]!r}' for k in unread)}: give a number.")
    if not 0 <= float(merged["chip_spread"]) < 0.05:
        raise ValueError(f"{where}: chip_spread = {merged['chip_spread']}: give the relative standard deviation of a "
                         "chip's sustained compute rate across chips, in [0, 0.05) (0.009: 0.9 %).")
    negative = [k for k in _SCALARS if float(merged[k]) < 0]
    if negative:
        raise ValueError(f"{where}: {', '.join(f'{k} = {merged[k]}' for k in negative)}: give a time of 0 or more.")
    pace_gpus = merged.get("gemm_pace_gpus", 1)
    if type(pace_gpus) is not int or pace_gpus < 1:
        raise ValueError(f"{where}: gemm_pace_gpus = {pace_gpus!r}: give how many GPUs the gemm figure is the slowest "
                         "of, a whole number from 1 (one chip's figure).")
    if not 0 <= float(merged["nccl_sm_fraction"]) < 1:
        raise ValueError(f"{where}: nccl_sm_fraction = {merged['nccl_sm_fraction']}: give the share of the SMs NCCL "
                         "takes, in [0, 1).")
    for k, v in efficiency.items():
        if not 0 < v <= 1:
            raise ValueError(f"{where}: efficiency.{k} = {v}: give a fraction of the peak in (0, 1].")
    peaks = {dt: float(merged[k]) * 1e12 for k, dt in _DTYPES.items() if k in merged}
    peaks.setdefault("float16", peaks.get("bfloat16", 0.0))
    if not peaks.get("bfloat16"):
        raise ValueError(f"{where}: give bf16_tflops (the dense bf16 peak, TFLOP/s).")
    return Hardware(
        name=name, title=merged.get("title", name), memory_bytes=parse_bytes(str(merged["memory"]),
                                                                            field_name=f"{where} memory"),
        peak_flops=peaks, **{_RATE_FIELDS[k]: float(merged[k]) * u for k, u in _RATES.items()},
        efficiency=efficiency, sources=sources, device_names=tuple(merged.get("device_names", ())), sdpa_kernel=sdpa,
        capability=capability, cudnn_version=cudnn, sms=int(merged["sms"]), gemm_pace_gpus=pace_gpus,
        gemm_best_shape=tuple(shape) if shape else None,
        **{k: float(merged[k]) for k in _SCALARS}, **{f: float(merged[k]) * 2**20 for k, f in _HALF.items()},
    )


def _capability(merged: dict, where: str) -> tuple | None:
    value = merged.get("capability")
    if value is None:
        return None
    if (not isinstance(value, list) or len(value) != 2 or not all(isinstance(v, int) and v >= 0 for v in value)):
        raise ValueError(f"{where}: capability = {value!r}: give the CUDA compute capability as [major, minor], "
                         "e.g. capability = [9, 0] for an H100.")
    return tuple(value)


def _cudnn_version(merged: dict, where: str) -> tuple | None:
    value = merged.get("cudnn_version")
    if value is None:
        return None
    parts = str(value).split(".") if isinstance(value, str) else []
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"{where}: cudnn_version = {value!r}: give the cuDNN of the torch build the profile stands "
                         "for as \"major.minor.patch\", e.g. cudnn_version = \"9.20.0\" (torch 2.13's wheels).")
    return tuple(int(p) for p in parts)


def builtin() -> dict[str, Hardware]:
    """The shipped profiles, by name."""
    data = tomllib.loads(GPUS_FILE.read_text())
    defaults = data.pop("defaults", {})
    return {name: _parse(name, table, defaults, str(GPUS_FILE.name)) for name, table in data.items()}


def load(spec: str) -> Hardware:
    """A shipped profile by name (`h100-sxm`), or a profile file (`cpbench calibrate`'s output)."""
    profiles = builtin()
    if spec in profiles:
        return profiles[spec]
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"--gpu {spec!r}: not a known GPU ({', '.join(profiles)}) and not a profile file.")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"--gpu {spec!r}: not a TOML profile ({e}).") from None
    if len(data) != 1:
        raise ValueError(f"--gpu {spec!r}: a profile file holds one table (one GPU); it has {sorted(data)}.")
    (name, table), = data.items()
    return _parse(name, table, {}, str(path))  # a file is whole: no figure silently taken from another GPU


def for_device(device_name: str | None) -> Hardware | None:
    """The shipped profile of a measured run's GPU (its `device_name`), or None."""
    return next((h for h in builtin().values() if (device_name or "").strip() in h.device_names), None)
