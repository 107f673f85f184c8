"""Rank functions for the compiled CP tests: each decoder layer under `torch.compile`, dynamo's own counters read
around the steps (graph breaks, graphs compiled), and the first step's parity against the unsharded eager run."""

from __future__ import annotations

import torch

from tests.dist.cp_workers import _load, _parity
from tests.dist.models import make_batch


def compiled_worker(path: str, style: str, kinds: list[str], steps: int = 2, whole: bool = False) -> dict:
    """cp=2, `style` on every attention module, sdpa, each decoder layer compiled (`whole`: the whole model, as
    `model.compile()`): per batch kind, the parity of the first (compiling) step, the graph breaks over all `steps`
    (`reasons`: each break's first line and count), and the graphs compiled after the first step."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = _load(path, "sdpa", cp_size=2, cp_plan={"model.layers.*.self_attn": style})
    for module in [model] if whole else model.model.layers:
        module.compile()
    results = {}
    for kind in kinds:
        batch = make_batch(kind)
        before = dict(counters["graph_break"])
        graphs0 = counters["stats"]["unique_graphs"]
        result = _parity(model, batch, path, "sdpa", 2)
        graphs1 = counters["stats"]["unique_graphs"]
        for _ in range(steps - 1):
            model.zero_grad(set_to_none=True)
            model(**batch).loss.backward()
        breaks = {k: v - before.get(k, 0) for k, v in counters["graph_break"].items() if v > before.get(k, 0)}
        result.update(graph_breaks=sum(breaks.values()), reasons={k: v for k, v in breaks.items()},
                      graphs=graphs1 - graphs0, recompiles=counters["stats"]["unique_graphs"] - graphs1)
        results[kind] = result
    return results
