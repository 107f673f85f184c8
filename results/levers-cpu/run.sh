#!/usr/bin/env bash
# Each long-context lever alone and all together, measured on CPU (gloo, 2 ranks): Qwen3-0.6B's widths (hidden
# 1024, 16 query / 8 kv heads of 128, MLP 3072) with 2 layers and a 16k vocabulary at 2,048 tokens, cp 2 (Ulysses),
# fp32, parity against the unsharded run of the same weights. One sweep per lever set (levers are suite-wide
# fields); their rows land in results/levers-cpu/<set>/runs.parquet and the table in results/levers-cpu/table.md.
# ONLY="<set> ..." reruns those sets alone (the table is rebuilt from every set's rows).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
tmp=$(mktemp -d)
base='model = "qwen3-0.6b"
model_overrides = {num_hidden_layers = 2, vocab_size = 16384}
seq_lens = [2048]
cp_sizes = [2]
cp_styles = ["cp_ulysses"]
attn_implementations = ["sdpa"]
warmup_steps = 2
measured_steps = 1
parity = "full"
timeout_s = 900'
declare -A SETS=(
  [none]=''
  [recompute]='activation_checkpointing = true'
  [recompute-op]=$'activation_checkpointing = true\nrecompute_policy = "op"'
  [offload-activations]=$'activation_checkpointing = true\noffload_activations = true'
  [offload-params]='offload_params = true'
  [tiled-mlp]='tiled_mlp = 8'
  [all]=$'activation_checkpointing = true\noffload_activations = true\noffload_params = true\ntiled_mlp = 8\nloss = "chunked"'
)
for set in ${ONLY:-none recompute recompute-op offload-activations offload-params tiled-mlp all}; do
  printf 'name = "levers-cpu-%s"\n%s\n%s\n' "$set" "$base" "${SETS[$set]}" > "$tmp/$set.toml"
  rm -rf "results/levers-cpu/$set"
  $PY -m cpbench sweep "$tmp/$set.toml" --out "$tmp/out" --run-name run --no-progress
  mkdir -p "results/levers-cpu/$set" && cp "$tmp/out/levers-cpu-$set/run/runs.parquet" "results/levers-cpu/$set/"
done
$PY - <<'PY'
import pandas as pd
from pathlib import Path
rows = []
for d in sorted(Path("results/levers-cpu").glob("*/runs.parquet")):
    r = pd.read_parquet(d).iloc[0]
    rows.append((d.parent.name, r))
order = ["none", "recompute", "recompute-op", "offload-activations", "offload-params", "tiled-mlp", "all"]
rows.sort(key=lambda x: order.index(x[0]))
mib = lambda v: "–" if pd.isna(v) else f"{v / 2**20:.1f} MiB"
lines = ["| lever set | parity | tracked device peak per rank | host per rank | host<->device per step | grad max rel err |",
         "|---|---|---|---|---|---|"]
for name, r in rows:
    moved = (r["d2h_bytes"] or 0) + (r["h2d_bytes"] or 0)
    lines.append(f"| {name} | {r['parity_status']} | {mib(r['peak_bytes'])} | {mib(r['host_peak_bytes'])} | "
                 f"{mib(moved)} | {r['grad_max_rel_err']:.2g} |")
Path("results/levers-cpu/table.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY
