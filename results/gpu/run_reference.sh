#!/usr/bin/env bash
# GPU check: the Qwen3-0.6B reference suite (suites/qwen3-0.6b-long.toml: bf16, 16k and 32k tokens, cp 1 and 2,
# sdpa and flash_attention_2, cp_ulysses and cp_ring) on a machine with CUDA, then its report.
#
# On a machine with ONE GPU the cp=2 points are SKIPPED, not run: their rows say `skipped` with why. Each rank
# needs a GPU of its own: NCCL refuses two ranks on one device, and gloo (CPU-staged) has no all-to-all for
# CUDA tensors (Ulysses) and would time PCIe copies rather than context parallelism. The cp=1 points run for
# real (allocator peaks, NVML device peak, step times, TFLOP/s and MFU, projected parity against the unsharded
# reference). flash_attention_2 points run only where the flash-attn package is installed, else `skipped`.
# With two or more GPUs the same command runs the cp=2 points too (one GPU per rank, NCCL).
#
# Usage (repository root, an environment with cpbench installed):  bash results/gpu/run_reference.sh [--memory-budget 80GiB]
# Output: results/gpu/qwen3-0.6b-long/<run>/runs.parquet (+ report.md/html, plots), the environment in every row.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python}
"$PY" - <<'PYEOF'
import sys
import torch
if not torch.cuda.is_available():
    sys.exit("no CUDA device: run this on a GPU machine")
print(f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
PYEOF
# 540 s leaves room in a 10-minute device window; finished points are kept if it is cut (rerun with --resume).
status=0
timeout 540 "$PY" -m cpbench sweep suites/qwen3-0.6b-long.toml --out results/gpu --no-progress "$@" || status=$?
run=$(ls -d results/gpu/qwen3-0.6b-long/2* | tail -1)
"$PY" -m cpbench report "$run"
exit "$status"
