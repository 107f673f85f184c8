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


def flex_compiled_worker(path: str, kinds: list[str]) -> dict:
    """cp=2, the default plan (cp_ulysses) over attn_implementation="flex_attention", each decoder layer compiled
    with inductor, forward only (torch has no CPU backward for flex): per batch kind, test_flex_forward's comparison
    with the unsharded model of the same weights run eagerly, and dynamo's counters over two forwards."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM

    import cpbench
    from tests.dist.test_flex_forward import ATTN, compare

    torch._dynamo.reset()
    counters.clear()
    load = dict(attn_implementation=ATTN, dtype=torch.float32)
    ref_model = AutoModelForCausalLM.from_pretrained(path, **load).eval()
    model = AutoModelForCausalLM.from_pretrained(
        path, **load, distributed_config=cpbench.DistributedConfig(cp_size=2)).eval()
    for layer in model.model.layers:
        layer.compile()
    results = {}
    for kind in kinds:
        batch = make_batch(kind)
        before = dict(counters["graph_break"])
        result = compare(model, ref_model, batch, [], "default")
        graphs = counters["stats"]["unique_graphs"]
        with torch.no_grad():
            model(**batch)
        breaks = {k: v - before.get(k, 0) for k, v in counters["graph_break"].items() if v > before.get(k, 0)}
        result.update(reasons=breaks, recompiles=counters["stats"]["unique_graphs"] - graphs)
        results[kind] = result
    return results
