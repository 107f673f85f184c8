"""The guide's two complete scripts (docs/training-loop.md, "transformers' Trainer and TRL's SFTTrainer"), run as a user
runs them: unsharded as `python script.py MODEL OUT 1`, and at cp 2 under `torchrun --nproc-per-node 2`. The blocks
are read from the guide itself, so what it shows is what runs. Every logged step of the cp 2 run is the unsharded
run's (the bounds of tests/dist/test_trainer.py), and the saved model loads with plain from_pretrained. The guide's
table of those errors is rerun by `results/trainer-cpu/run.py --check` (heavy)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist import trainer_workers as w
from tests.dist.models import save_tiny
from tests.dist.test_trainer import check_same_run

ROOT = Path(__file__).parents[2]


def guide_script(name: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "training-loop.md").read_text(), re.S)
    found = [b for b in blocks if b.startswith(f"# {name}:")]
    assert len(found) == 1, f"docs/training-loop.md shows {len(found)} blocks for {name}"
    return found[0]


def _run(script: Path, model: Path, out: Path, cp: int) -> dict:
    launcher = [sys.executable] if cp == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                 "--nproc-per-node", str(cp)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*launcher, str(script), str(model), str(out), str(cp)], capture_output=True, text=True,
                          timeout=600, env=env, cwd=script.parent)
    assert proc.returncode == 0, proc.stderr[-4000:]
    state = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
    return {"log": state["log_history"], "tokens": state.get("num_input_tokens_seen")}


def _loop(name: str, tmp_path: Path) -> tuple[dict, dict]:
    model = tmp_path / "model"
    save_tiny("llama", model)
    w.save_tokenizer(model)
    script = tmp_path / name
    script.write_text(guide_script(name))
    return _run(script, model, tmp_path / "cp", 2), _run(script, model, tmp_path / "ref", 1)


@pytest.mark.heavy  # the same loop as tests/dist/test_trainer.py's light cases, through torchrun and the guide's text
def test_the_guides_trainer_script(tmp_path):
    cp, ref = _loop("trainer_cp.py", tmp_path)
    check_same_run(cp, ref)
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(tmp_path / "cp" / "final").config.model_type == "llama"


@pytest.mark.heavy
def test_the_guides_sft_script(tmp_path):
    cp, ref = _loop("sft_cp.py", tmp_path)
    check_same_run(cp, ref)


@pytest.mark.heavy
def test_the_guides_trainer_table_is_what_runs_now():
    proc = subprocess.run([sys.executable, str(ROOT / "results" / "trainer-cpu" / "run.py"), "--check"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
