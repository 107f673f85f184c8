"""Trainer and SFTTrainer with a CP model against the same script unsharded, on CPU (gloo, fp32, the tiny Llama of the
tests, 3 logged steps each, AdamW at lr 1e-2): the worst relative error of any step's logged loss and gradient norm,
and whether the rest of the log (learning rate, epoch, tokens seen, TRL's token count and accuracy) is identical.

    .venv/bin/python results/trainer-cpu/run.py           # writes table.md beside this file and the guide's copy
    .venv/bin/python results/trainer-cpu/run.py --check   # fails where the guide's table is not what this computes

The runs are tests/dist/trainer_workers.py's (the plain classes, as a user's script); about a minute here.
"""

from __future__ import annotations

import math
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.dist import trainer_workers as w  # noqa: E402
from tests.dist.models import save_tiny  # noqa: E402
from tests.spawn import run_ranks  # noqa: E402

GUIDE = ROOT / "docs" / "training-loop.md"
TABLE = Path(__file__).with_name("table.md")
START, END = "<!-- trainer-cpu table: results/trainer-cpu/run.py -->", "<!-- end of the trainer-cpu table -->"
CASES = [  # (loop, what runs, spec, ranks)
    ("Trainer", "cp 2 · cp_ulysses", {"cp": 2}, 2),
    ("Trainer", "fsdp 2 x cp 2 · cp_ring_zigzag · accumulation 2", {"cp": 2, "fsdp": 2, "dp": 2, "ga": 2,
                                                                    "style": "cp_ring_zigzag"}, 4),
    ("SFTTrainer, packed padding-free", "cp 2 · cp_ulysses", {"cp": 2, "loop": "sft"}, 2),
    ("SFTTrainer, packed padding-free", "cp 2 · cp_ring_zigzag", {"cp": 2, "loop": "sft", "style": "cp_ring_zigzag"},
     2),
    ("SFTTrainer, packed padding-free", "cp 4 · cp_usp (degree 2)", {"cp": 4, "loop": "sft", "style": "cp_usp",
                                                                      "ulysses_degree": 2}, 4),
]
SAME = ("learning_rate", "epoch", "num_input_tokens_seen", "num_tokens", "mean_token_accuracy")


def _steps(log):
    return [h for h in log if "grad_norm" in h]


def measure() -> list[tuple[str, str, float, bool]]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        save_tiny("llama", tmp)
        w.save_tokenizer(tmp)
        for loop, what, spec, ranks in CASES:
            ref = run_ranks(w.train, 1, tmp, {**spec, "cp": 1}, f"{tmp}/ref")[0]
            runs = run_ranks(w.train, ranks, tmp, spec, f"{tmp}/cp")
            pairs = [(got, want) for run in runs for got, want in zip(_steps(run["log"]), _steps(ref["log"]))]
            worst = max(abs(g[k] - r[k]) / abs(r[k]) for g, r in pairs for k in ("loss", "grad_norm"))
            same = all(g.get(k) == r[k] for g, r in pairs for k in SAME if k in r)
            rows.append((loop, what, worst, same))
    return rows


def render(rows) -> str:
    lines = ["| loop | what runs | worst relative error, loss and grad norm (3 steps) | the rest of the log |",
             "|---|---|---|---|"]
    lines += [f"| {loop} | {what} | {worst:.1e} | {'identical' if same else 'differs'} |"
              for loop, what, worst, same in rows]
    return "\n".join(lines) + "\n"


def _cells(table: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in table.strip().splitlines()[2:]]


def check(table: str) -> None:
    """The guide's table is this one: the same rows, the same verdicts, and each error within a factor of 10 of what
    runs now (rounding's order: the sums are the same, their order is not) and under the tests' bound, 2e-4."""
    guide = GUIDE.read_text()
    shown = guide[guide.index(START) + len(START):guide.index(END)]
    for old, new in zip(_cells(shown), _cells(table), strict=True):
        assert old[:2] == new[:2] and old[3] == new[3], (old, new)
        was, now = float(old[2]), float(new[2])
        assert now <= 2e-4 and (was == now or abs(math.log10(max(was, 1e-12) / max(now, 1e-12))) <= 1), (old, new)


def main() -> None:
    table = render(measure())
    if "--check" in sys.argv:
        check(table)
        print("the guide's trainer-cpu table holds")
        return
    TABLE.write_text(table)
    guide = GUIDE.read_text()
    GUIDE.write_text(re.sub(re.escape(START) + ".*?" + re.escape(END), lambda _: f"{START}\n{table}{END}", guide,
                            flags=re.S))
    print(table)


if __name__ == "__main__":
    main()
