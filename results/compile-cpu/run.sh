#!/usr/bin/env bash
# torch.compile of each decoder layer against eager, measured on CPU (gloo, 2 ranks, inductor): the tiny Qwen3 of
# suites/compile-cpu.toml (cp 1 and cp 2 x cp_ulysses / cp_ring / cp_ring_zigzag, 2,048 tokens) and Qwen3-0.6B's
# widths (hidden 1024, 16 query / 8 kv heads of 128, MLP 3072) with 2 layers and a 16k vocabulary, 2,048 tokens, cp 2.
# Each suite runs twice, `--compile` and eager; rows land in results/compile-cpu/<suite>-<mode>/runs.parquet.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
tmp=$(mktemp -d)
cat > "$tmp/compile-cpu-wide.toml" <<'TOML'
name = "compile-cpu-wide"
model = "qwen3-0.6b"
model_overrides = {num_hidden_layers = 2, vocab_size = 16384}
seq_lens = [2048]
cp_sizes = [2]
cp_styles = ["cp_ulysses", "cp_ring"]
attn_implementations = ["sdpa"]
warmup_steps = 3
measured_steps = 4
parity = "full"
timeout_s = 1200
TOML
for suite in suites/compile-cpu.toml "$tmp/compile-cpu-wide.toml"; do
  name=$(basename "$suite" .toml)
  for mode in compiled eager; do
    flag=(); [ "$mode" = compiled ] && flag=(--compile)
    "$PY" -m cpbench sweep "$suite" "${flag[@]}" --out "$tmp/out" --run-name "$mode" --no-progress || true
    mkdir -p "results/compile-cpu/$name-$mode"
    cp "$tmp/out/$name/$mode/runs.parquet" "results/compile-cpu/$name-$mode/runs.parquet"
  done
done
