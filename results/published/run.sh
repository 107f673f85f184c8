#!/usr/bin/env bash
# Projects every published measurement of results/published/measurements.toml, and every side-by-side comparison of
# orderings.toml, on its GPU profile (a shipped one: its efficiencies come from kernel papers and tables, never from
# these runs), then writes table.md beside it.
# From the repository root: bash results/published/run.sh   (about an hour on 2 cores; ONLY=<name> runs one;
# KEEP=1 keeps the runs already there)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
OUT=results/published/runs
MODELS=results/published/models
est() {
  name=$1; shift
  if [ -n "${ONLY:-}" ] && [ "$ONLY" != "$name" ]; then return; fi
  if [ -n "${KEEP:-}" ] && ls "$OUT"/*/"$name"/runs.parquet >/dev/null 2>&1; then return; fi
  rm -rf "$OUT"/*/"$name"
  echo "== $name" >&2
  "$PY" -m cpbench estimate --out "$OUT" --run-name "$name" --jobs 2 "$@" >/dev/null
}
# A model calling FlashAttention-3 or -4 itself (transformers' flash_attention_3, flash-attn-4) runs as SDPA in a projection
# and is priced as that kernel: the H200 and B200 profiles with it (`estimate --sdpa-kernel` names torch's kernels only).
mkdir -p results/published/profiles
"$PY" -c "import dataclasses; from cpbench.harness.project.hardware import load
print(dataclasses.replace(load('h200'), name='h200-fa3', title='NVIDIA H200 SXM 141GB, a model calling FlashAttention-3',
                          sdpa_kernel='fa3').to_toml())" > results/published/profiles/h200-fa3.toml
H200_FA3=results/published/profiles/h200-fa3.toml
"$PY" -c "import dataclasses; from cpbench.harness.project.hardware import load
print(dataclasses.replace(load('b200'), name='b200-fa4', title='NVIDIA B200 180GB, a model calling FlashAttention-4',
                          sdpa_kernel='fa4').to_toml())" > results/published/profiles/b200-fa4.toml
B200_FA4=results/published/profiles/b200-fa4.toml

# --- TRL (PR #6845 / #6846), FSDP2 + CP over every GPU (torch's ring, its tiles through SDPA: cuDNN on H100 with
# torch 2.11), recompute with the checkpoints offloaded, chunked NLL. cpbench's Ulysses runs the same SDPA kernel on the
# whole sequence (its communication is a few % of these steps); cpbench's zigzag ring beside it at Qwen3-8B 1M.
# Precision: accelerate's FSDP2 with mixed_precision bf16 upcasts the bf16-loaded model to fp32 master weights
# (huggingface/accelerate, src/accelerate/utils/fsdp_utils.py, fsdp2_prepare_model: "FSDP upcast of low precision
# parameters to fp32") and computes in bf16: cpbench's --mixed-precision (which reduces gradients in fp32 where
# accelerate reduces them in bf16: the reduce-scatter's buffers, not the state). The example's accelerate config
# (examples/accelerate_configs/context_parallel_8gpu.yaml) offloads the checkpoints, not the parameters; the 30B-A3B and
# 32B rows were not run with it as shipped: PR #6846's review says the 32B result needs the parameters offloaded and the
# MLP tiled over the sequence (its author: "lever 5 in the guide", 16,384-token tiles: 8 tiles of 131,072), and fp32
# state of 30.5B parameters on 8 GPUs (61 GB) cannot be the 30B-A3B's 46.0 GB: both with --offload-params.
# Gradients clipped at 1.0 before each step and stepped by torch's fused AdamW: transformers' TrainingArguments'
# max_grad_norm = 1.0 and, with torch >= 2.8, optim = "adamw_torch_fused" (default_optim), which TRL's SFTConfig and the
# example (which sets no optim) keep; with the parameters offloaded, the fused kernel runs on the host's copies.
TRL="--recompute --offload-activations --loss chunked --gpu h100-sxm --mixed-precision --max-grad-norm 1.0"
TRL="$TRL --optimizer fused"
est trl-qwen3-8b-1m --model qwen3-8b --override max_position_embeddings=1048576 --seq 1048576 --cp 8 --world-size 8 \
  --styles cp_ulysses $TRL
est trl-qwen3-8b-1m-ring --model qwen3-8b --override max_position_embeddings=1048576 --seq 1048576 --cp 8 \
  --world-size 8 --styles cp_ring_zigzag $TRL
est trl-qwen3-0.6b-1m --model qwen3-0.6b --override max_position_embeddings=1048576 --seq 1048576 --cp 8 \
  --world-size 8 --styles cp_ulysses $TRL
est trl-qwen3-30b-a3b-1m --model qwen3-30b-a3b --override max_position_embeddings=1048576 --seq 1048576 --cp 8 \
  --world-size 8 --styles cp_ulysses $TRL --offload-params
est trl-qwen3-32b-1m --model $MODELS/qwen3-32b --override max_position_embeddings=1048576 --seq 1048576 --cp 8 \
  --world-size 8 --styles cp_ulysses $TRL --offload-params --tiled-mlp 8
est trl-qwen3-0.6b-4m --model qwen3-0.6b --override max_position_embeddings=4194304 --seq 4194304 --cp 8 \
  --world-size 8 --styles cp_ulysses $TRL
est trl-qwen3-8b-2m --model qwen3-8b --override max_position_embeddings=2097152 --seq 2097152 --cp 16 \
  --world-size 16 --gpus-per-node 8 --styles cp_ulysses $TRL
est trl-qwen3-8b-4m --model qwen3-8b --override max_position_embeddings=4194304 --seq 4194304 --cp 32 \
  --world-size 32 --gpus-per-node 8 --styles cp_ulysses $TRL

# --- ALST (Snowflake), Llama-3.1-8B, Ulysses over 8 H100s: 1.1M with recompute, tiled loss, optimizer offload; 3.7M
# with everything (tiled MLP, checkpoint offload); 15M on 4 nodes. Their attention is flash-attn 2: --sdpa-kernel flash
ALST="--model llama-3-8b --override max_position_embeddings=16777216 --styles cp_ulysses --recompute --loss chunked"
ALST="$ALST --offload-params --gpu h100-sxm --sdpa-kernel flash"
est alst-llama-1.1m $ALST --seq 1100000 --cp 8 --world-size 8
est alst-llama-3.7m $ALST --seq 3700000 --cp 8 --world-size 8 --offload-activations --tiled-mlp
est alst-llama-15m $ALST --seq 15000000 --cp 32 --world-size 32 --offload-activations --tiled-mlp

# --- torchtitan, Llama 3.1 8B, FSDP, 8192 tokens, local batch 2, selective op AC (every layer keeps its SDPA output
# and every other mm's: cpbench's --recompute-policy op, cpbench/cp/recompute.py). Torch of December 2024: SDPA took
# the flash kernel (cuDNN was opt-in). Their H100s: 96 GB HBM2e at 500 W.
# Every torchtitan row clips its gradients at 1.0 (train_configs/*.toml: max_norm = 1.0; train.py: clip_grad_norm_
# with foreach=True), at each of the commits below.
TITAN="--model llama-3-8b --seq 8192 --cp 1 --recompute --recompute-policy op --batch-size 2 --mixed-precision"
TITAN="$TITAN --max-grad-norm 1.0"
est titan-llama-8b-h100 $TITAN --world-size 8 --gpu h100-hbm2e-500w --sdpa-kernel flash
est titan-llama-8b-h100-128 $TITAN --world-size 128 --gpu h100-hbm2e-500w --sdpa-kernel flash
# torchtitan, Llama 3 8B and 70B on 64 A100s (8 nodes), 8192 tokens, local batch 1; and the 8B on one 8 x A100 node
# (PR #355's logs, foreach AdamW, selective op AC); the 64-GPU rows with selective layer AC (every 2nd layer) and op AC
# April 2024's torchtitan ran its fused (Triton) RMSNorm (train_configs/*.toml at 1ea476e9f: norm_type =
# 'fused_rmsnorm'): cpbench's --norm fused, one kernel each way; June 2024's (PR #355) the eager one, as HF's.
A100="--seq 8192 --cp 1 --mixed-precision --gpu a100-sxm --max-grad-norm 1.0"
APRIL="$A100 --norm fused"
est titan-llama-8b-a100 --model llama-3-8b $APRIL --world-size 64 --recompute --recompute-every 2
est titan-llama-70b-a100 --model llama-3.1-70b $APRIL --world-size 64 --recompute
est titan-llama-8b-a100-op --model llama-3-8b $APRIL --world-size 64 --recompute --recompute-policy op
est titan-pr355-llama-8b-a100 --model llama-3-8b $A100 --world-size 8 --recompute --recompute-policy op
# PR #355 measured fused AdamW beside it on the same box: 'wps is + ~100' (orderings.toml, titan-optim)
est titan-pr355-llama-8b-a100-fused --model llama-3-8b $A100 --world-size 8 --recompute --recompute-policy op \
  --optimizer fused
# torchtitan docs/performance.md as first published (commits 395a52627, 1ea476e9f, April 2024): Llama 2 13B on 64 A100s,
# local batch 2 x 4096 tokens, without AC, with selective layer AC (every 2nd layer) and with selective op AC
T13="--model $MODELS/llama-2-13b $APRIL --seq 4096 --batch-size 2 --world-size 64"
est titan-llama2-13b-a100-none $T13
est titan-llama2-13b-a100-layer $T13 --recompute --recompute-every 2
est titan-llama2-13b-a100-op $T13 --recompute --recompute-policy op

# --- ml-engineering (stas00), HF transformers, eager, bf16, 1 sequence per GPU. DeepSpeed clips the gradients at 1.0
# (insights/when-to-upgrade-gpus, bench_decompose.py and benchmark.py, ds_config: "gradient_clipping": 1.0) and, with
# the optimizer on the GPUs, steps them with its FusedAdam (deepspeed/runtime/engine.py, _configure_basic_optimizer):
# one multi-tensor kernel, cpbench's --optimizer fused.
# 8 x H200, Llama-3.1-8B at 8k, DeepSpeed ZeRO-2, FlashAttention-3, no recompute, no offload
est mleng-h200-8b-8k --model llama-3-8b --seq 8192 --cp 1 --world-size 8 --mixed-precision --gpu "$H200_FA3" \
  --max-grad-norm 1.0 --optimizer fused
# the same on 8 x B200, FlashAttention-4
est mleng-b200-8b-8k-zero2 --model llama-3-8b --seq 8192 --cp 1 --world-size 8 --mixed-precision --gpu "$B200_FA4" \
  --max-grad-norm 1.0 --optimizer fused
# the same, ZeRO-3 with the optimizer on the host, recompute, Liger: cpbench offloads the parameters too
for seq in 8192 32768 65536 131072; do
  est "mleng-h200-8b-offload-$((seq / 1024))k" --model llama-3-8b --seq "$seq" --cp 1 --world-size 8 --mixed-precision \
    --recompute --offload-params --loss chunked --gpu "$H200_FA3" --max-grad-norm 1.0
done
# the same table on B200s (flash-attn-4): the B200 / H200 speedup by length (orderings.toml)
for seq in 8192 32768 65536 131072; do
  est "mleng-b200-8b-offload-$((seq / 1024))k" --model llama-3-8b --seq "$seq" --cp 1 --world-size 8 --mixed-precision \
    --recompute --offload-params --loss chunked --gpu "$B200_FA4" --max-grad-norm 1.0
done
# 1 x B200, torch 2.13, the model and AdamW in bf16 (no master weights), gradient checkpointing, SDPA (cuDNN there)
est mleng-b200-1b-512 --model $MODELS/llama-3.2-1b --seq 512 --cp 1 --world-size 1 --recompute --gpu b200
est mleng-b200-8b-8k --model llama-3-8b --seq 8192 --cp 1 --world-size 1 --recompute --gpu b200

# --- side by side (orderings.toml): torchtitan's CP table (32k tokens per GPU at cp 1..8; torch's ring, flash or
# memory-efficient tiles) and USP's comparison of Ulysses, the zigzag ring and the plain ring (8 x A100, 32 heads)
for cp in 1 2 4 8; do
  seq=$((32768 * cp))
  est "titan-cp-$cp" --model llama-3-8b --seq "$seq" --cp "$cp" --world-size 8 --styles cp_ring_zigzag --recompute \
    --mixed-precision --gpu h100-hbm2e-500w --sdpa-kernel flash --override max_position_embeddings=262144 \
    --max-grad-norm 1.0
done
# torchtitan benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md (Trainy, June 2025): the 8B on 4 and 8 nodes of 8 H200s
# (400 Gb/s RDMA per GPU), $TITAN's step (train_configs/llama3_8b.toml at e7c0cae: selective op AC), compiled with
# Float8 linears and Float8 all-gathers: the eager step is projected and only the order by nodes is judged. Its torch,
# 2.8, preferred the flash kernel in SDPA on an H200 (cuDNN's is preferred from torch 2.10: gpus.toml defaults.sources)
for nodes in 4 8; do
  est "trainy-h200-$nodes-nodes" $TITAN --world-size $((8 * nodes)) --gpu h200 --sdpa-kernel flash
done
for seq in 32768 131072; do
  for style in cp_ulysses cp_ring_zigzag cp_ring; do
    est "usp-$((seq / 1024))k-$style" --model llama-3-8b --seq "$seq" --cp 8 --world-size 8 --styles "$style" \
      --recompute --mixed-precision --gpu a100-sxm
  done
done
"$PY" results/published/table.py
