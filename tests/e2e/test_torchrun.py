"""The user-facing API under a real `torchrun` launch (not the test spawner)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.dist.models import save_tiny


def test_training_loop_under_torchrun(tmp_path):
    path = save_tiny("qwen3", tmp_path / "model")
    script = Path(__file__).with_name("torchrun_train.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script), path, str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    assert sorted(r["rank"] for r in records) == [0, 1]
    # Both ranks of the cp group hold the same whole-sequence loss, and it falls as AdamW trains.
    assert records[0]["losses"] == records[1]["losses"]
    assert records[0]["losses"][-1] < records[0]["losses"][0]
    assert all(r["logits_shape"] == [2, 16, 96] for r in records)
