#!/usr/bin/env bash
# The GPU checks in one command, on a machine with CUDA (one GPU is enough), in under 10 minutes:
#   1. the opt-in GPU tests (`pytest -m gpu tests/gpu`): the ring's CUDA kernels on the real aten ops where their
#      contracts bite (tests/gpu/test_ring_cuda_contracts.py: the efficient backward with the ring's saved output and
#      GQA, a batch-1 mask at batch 2, an off-diagonal sliding-window varlen tile, head dims flash pads), every tile
#      kind against the exact kernel, allocator/NVML probes and a CUDA sweep point; the new tiles
#      (tests/gpu/test_ring_hopper_kernels.py): cuDNN's attention (the sdpa kernel on Hopper/Blackwell, forced on any
#      sm80+ GPU), FlashAttention-3 and FlashAttention-4 where their packages are installed, each tile kind against
#      the exact kernel; the fused RMSNorm on torch's CUDA kernels against the eager norm
#      (tests/gpu/test_fused_norm_cuda.py); what was skipped, and why (a package not installed: the pip install), is
#      printed (-rs);
#      -> results/gpu/gpu-tests.xml (JUnit: each test's outcome and time), and the console log beside it;
#   1a. the 8B's kernels by class (suites/decompose-llama3-8b.toml: its widths at 16 layers, 8192 tokens, recompute):
#      GEMMs, attention, element-wise, optimizer, each measured (torch.profiler) beside the time model's price on
#      this GPU's profile (cpbench/harness/project/decompose.py): -> results/gpu/decompose.csv and decompose.log;
#   1b. the same step's GEMMs shape by shape (results/gpu/gemm_bench.py): each timed as a burst (mamf-finder.py's
#      benchmark_mm) and all of them replayed for 10 s (a step's sustained load, as the profiles' `gemm` figures,
#      ml-engineering's MSMF, are sustained rates) with the SM clock and power sampled, beside their price, and the
#      same stretch's spread from replay to replay (`jitter`: what a step synchronized once a layer waits out on its
#      slowest GPU): -> results/gpu/gemm.csv, gemm.csv.json and gemm.log;
#   1c. the element-wise kernels' figures on this GPU (results/gpu/elementwise_bench.py, then the fit of
#      cpbench.harness.project.elementwise): -> results/gpu/elementwise.csv and elementwise.log;
#   2. the Qwen3-0.6B reference suite (suites/qwen3-0.6b-long.toml: bf16, 16k and 32k tokens, cp 1 and 2, sdpa,
#      flash_attention_2 and flash_attention_3, cp_ulysses and cp_ring), then its report;
#      -> results/gpu/qwen3-0.6b-long/<run>/runs.parquet (+ report.md/html, plots), the environment in every row.
#
# On a machine with ONE GPU the cp=2 points are SKIPPED, not run: their rows say `skipped` with why. Each rank
# needs a GPU of its own: NCCL refuses two ranks on one device, and gloo (CPU-staged) has no all-to-all for
# CUDA tensors (Ulysses) and would time PCIe copies rather than context parallelism. The cp=1 points run for
# real (allocator peaks, NVML device peak, step times, TFLOP/s and MFU, projected parity against the unsharded
# reference). flash_attention_2/3 points and tests run only where their packages are installed, else `skipped`
# with the install that brings them.
# With two or more GPUs the same command runs the cp=2 points too (one GPU per rank, NCCL).
#
# Usage (repository root, an environment with cpbench installed):  bash results/gpu/run_gpu_checks.sh [--memory-budget 80GiB]
# The arguments go to the sweep. Exit status: the tests' if they failed, else the element-wise bench's, else
# decompose's, else the GEMM bench's, else the sweep's. Every step has its own time limit, together about 8.5 minutes
# (a lent GPU machine allows 10 a command). Where $OUT is set (the device machine's folder of files that come back),
# results/gpu is packed into $OUT/gpu.tgz after every step, so a run cut short still brings back what it measured.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-$(command -v python || command -v python3)}
pack() { if [ -n "${OUT:-}" ]; then tar czf "$OUT/gpu.tgz" results/gpu 2>/dev/null || true; fi; }
trap pack EXIT
"$PY" - <<'PYEOF' || exit 1
import sys
import torch
if not torch.cuda.is_available():
    sys.exit("no CUDA device: run this on a GPU machine")
print(f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
from cpbench.cp.ring.target import resolve_target, sdpa_prefers_cudnn
from cpbench.harness.run.skips import kernel_package_missing
target = resolve_target(None, torch.empty(0, device="cuda"))
print(f"{target.sm}, cuDNN {target.cudnn_version}: an sdpa model's ring tiles run "
      f"{'cuDNN (SDPA prefers it here)' if sdpa_prefers_cudnn(target) else 'the flash kernel'}")
for backend in ("flash_attention_2", "flash_attention_3", "flash_attention_4"):
    print(f"{backend}: {kernel_package_missing(backend) or 'installed'}")
PYEOF
mkdir -p results/gpu
tests=0
# -v names each test as it runs, and pytest-timeout (where installed) fails a hung one alone: the JUnit file is
# written at the session's end only
per_test=$("$PY" -c "import pytest_timeout" 2>/dev/null && echo --timeout=120)
timeout 180 "$PY" -m pytest -m gpu tests/gpu -v -rs -p no:cacheprovider $per_test \
    --junitxml results/gpu/gpu-tests.xml 2>&1 | tee results/gpu/gpu-tests.log || tests=$?
pack
# the 8B's kernel time by class against its price (not yet timed on a GPU: 90 s allowed); it needs ~50 GB, so a
# smaller GPU skips it, said in the log; a GPU with no shipped profile is priced as an H100 SXM
gpu=$("$PY" -c "from cpbench.harness.project.hardware import for_device; import torch
h = for_device(torch.cuda.get_device_name(0)); print(h.name if h else '')")
rm -f results/gpu/decompose.csv
decomp=0
if "$PY" -c "import sys, torch; sys.exit(torch.cuda.mem_get_info()[1] < 60 * 2**30)"; then
  timeout 90 "$PY" -m cpbench.harness.project.decompose suites/decompose-llama3-8b.toml --gpu "${gpu:-h100-sxm}" \
      --out results/gpu/decompose.csv > results/gpu/decompose.log 2>&1 || decomp=$?
  cat results/gpu/decompose.log
  if [ "$decomp" -ne 0 ]; then echo "decompose failed or timed out (exit $decomp): results/gpu/decompose.log"; fi
else
  echo "decompose skipped: the GPU has under 60 GiB (suites/decompose-llama3-8b.toml needs ~50 GB)" \
    | tee results/gpu/decompose.log
fi
pack
# the step's GEMMs: bursts and a 10 s sustained replay beside their price (~30 s; the largest operands take 2 GB)
gemm=0
timeout 60 "$PY" results/gpu/gemm_bench.py results/gpu/gemm.csv --gpu "${gpu:-h100-sxm}" --seconds 10 \
    > results/gpu/gemm.log 2>&1 || gemm=$?
tail -3 results/gpu/gemm.log
if [ "$gemm" -ne 0 ]; then echo "gemm_bench failed or timed out (exit $gemm): results/gpu/gemm.log"; fi
pack
# the element-wise figures of this GPU: the eager modules the H100's were fitted to, timed here, then fitted (~1 min)
bench=0
timeout 60 "$PY" results/gpu/elementwise_bench.py results/gpu/elementwise.csv --reps 50 > results/gpu/elementwise.log 2>&1 \
    || bench=$?
if [ "$bench" -ne 0 ]; then
  echo "elementwise_bench failed or timed out (exit $bench): no fit on partial rows (results/gpu/elementwise.log)"
elif [ -z "$gpu" ]; then
  echo "no shipped profile names this GPU: fit results/gpu/elementwise.csv with --gpu on a profile of it" \
    | tee -a results/gpu/elementwise.log
else
  "$PY" -m cpbench.harness.project.elementwise --data results/gpu/elementwise.csv --gpu "$gpu" 2>&1 \
    | tee -a results/gpu/elementwise.log
fi
pack
# 100 s for the sweep keeps the whole script within 10 minutes; finished points are kept if it is cut (--resume).
sweep=0
timeout 100 "$PY" -m cpbench sweep suites/qwen3-0.6b-long.toml --out results/gpu --no-progress "$@" || sweep=$?
run=$(ls -d results/gpu/qwen3-0.6b-long/2* 2>/dev/null | tail -1)
if [ -n "$run" ]; then "$PY" -m cpbench report "$run"; fi
if [ "$tests" -ne 0 ]; then exit "$tests"; fi
if [ "$bench" -ne 0 ]; then exit "$bench"; fi
if [ "$decomp" -ne 0 ]; then exit "$decomp"; fi
if [ "$gemm" -ne 0 ]; then exit "$gemm"; fi
exit "$sweep"
