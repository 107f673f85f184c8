#!/usr/bin/env bash
# Projects every published measurement of results/published/measurements.toml on its GPU profile (the shipped
# one: its efficiencies come from kernel papers, never from these runs), then writes table.md beside it.
# From the repository root: bash results/published/run.sh   (about 25 minutes on 2 cores; ONLY=<name> runs one)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
OUT=results/published/runs
est() {
  name=$1; shift
  if [ -n "${ONLY:-}" ] && [ "$ONLY" != "$name" ]; then return; fi
  rm -rf "$OUT"/*/"$name"
  "$PY" -m cpbench estimate --out "$OUT" --run-name "$name" --jobs 2 --mixed-precision "$@"
}
# TRL, Qwen3-8B and Qwen3-0.6B at 1,048,576 tokens on 8 x H100: FSDP2 + CP 8 (torch's ring, its tiles through SDPA:
# cuDNN on H100 with torch 2.11), recompute with offload, chunked NLL. cpbench's Ulysses runs the same SDPA kernel
# (its communication is under 1 % of the step); cpbench's zigzag ring, whose tiles call the flash kernel, beside it.
TRL="--override max_position_embeddings=1048576 --seq 1048576 --cp 8 --world-size 8 --recompute --offload-activations"
est trl-qwen3-8b-1m --model qwen3-8b $TRL --styles cp_ulysses --loss chunked --gpu h100-sxm
est trl-qwen3-8b-1m-ring --model qwen3-8b $TRL --styles cp_ring_zigzag --loss chunked --gpu h100-sxm
est trl-qwen3-0.6b-1m --model qwen3-0.6b $TRL --styles cp_ulysses --loss chunked --gpu h100-sxm
# ALST (Snowflake), Llama-3.1-8B, Ulysses over 8 H100s: 1.1M with recompute, tiled loss, optimizer offload; 3.7M with
# everything (tiled MLP, checkpoint offload); 15M on 4 nodes. Their attention is flash-attn 2: --sdpa-kernel flash
est alst-llama-1.1m --model llama-3-8b --override max_position_embeddings=16777216 --seq 1100000 --cp 8 \
  --world-size 8 --styles cp_ulysses --recompute --loss chunked --offload-params --gpu h100-sxm --sdpa-kernel flash
est alst-llama-3.7m --model llama-3-8b --override max_position_embeddings=16777216 --seq 3700000 --cp 8 \
  --world-size 8 --styles cp_ulysses --recompute --loss chunked --offload-params --offload-activations --tiled-mlp \
  --gpu h100-sxm --sdpa-kernel flash
est alst-llama-15m --model llama-3-8b --override max_position_embeddings=16777216 --seq 15000000 --cp 32 \
  --world-size 32 --styles cp_ulysses --recompute --loss chunked --offload-params --offload-activations --tiled-mlp \
  --gpu h100-sxm --sdpa-kernel flash
# torchtitan, Llama 3.1 8B, FSDP over 8 H100s, 8192 tokens, local batch 2 (selective AC: recompute every 2nd layer);
# torch of December 2024, whose SDPA took the flash kernel (cuDNN was opt-in); their cards hold 95 GiB
est titan-llama-8b-h100 --model llama-3-8b --seq 8192 --cp 1 --world-size 8 --recompute --recompute-every 2 \
  --batch-size 2 --gpu h100-sxm --sdpa-kernel flash --device-memory 95GiB
# torchtitan, Llama 3 8B, FSDP over 64 A100s (8 nodes), 8192 tokens, local batch 1, selective layer AC
est titan-llama-8b-a100 --model llama-3-8b --seq 8192 --cp 1 --world-size 64 --recompute --recompute-every 2 \
  --gpu a100-sxm
"$PY" results/published/table.py
