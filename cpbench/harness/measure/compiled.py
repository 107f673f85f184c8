"""A compiled point's step: each decoder layer under `torch.compile` (as torchtitan compiles its layers), and what
dynamo's own counters say of it — graph breaks, graphs compiled after the first step (recompiles) — and the first
step's compile time, which is kept out of the timed steps.

Only the decoder layers are compiled: the model-level forward (embedding, the mask transformers builds, the CP
forward wrapper that works out the batch's layout, the loss) stays eager, as it runs once per step.
"""

from __future__ import annotations

import contextlib
import re

import torch

LAYER_NAME = re.compile(r"(^|\.)layers\.\d+$")


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers: the modules named `...layers.<i>` that are not inside another such module."""
    names = [name for name, _ in model.named_modules() if LAYER_NAME.search(name)]
    outer = [n for n in names if not any(n.startswith(o + ".") for o in names)]
    return [model.get_submodule(n) for n in outer]


def compile_layers(model: torch.nn.Module, mode: str) -> int:
    """Compiles every decoder layer of `model` in place (`nn.Module.compile`: the layer's hooks, CP's cut
    included, are traced with it) with torch.compile's `mode` ("default" is torch's default). Returns how many."""
    import torch._dynamo

    torch._dynamo.reset()  # a fresh cache and fresh counters for this point
    torch._dynamo.utils.counters.clear()
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"compile: `{type(model).__name__}` has no decoder layers named `layers.<i>` to compile.")
    for layer in layers:
        layer.compile(mode=None if mode == "default" else mode)
    return len(layers)


class CompileCounters:
    """Dynamo's counters of this process: graph breaks since `compile_layers`, and graphs compiled after `mark`
    (the end of the first step)."""

    def __init__(self):
        self.graphs_at_mark: int | None = None

    @staticmethod
    def _graphs() -> int:
        return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])

    def mark(self) -> None:
        self.graphs_at_mark = self._graphs()

    def add_to(self, record: dict, first_step_s: float, step_times_s: list[float]) -> None:
        """The record's columns: `compile_s` is the first step's time beyond a timed step's (its compile); a graph
        break is named in the record's notes (the row's status_detail)."""
        import statistics

        breaks = torch._dynamo.utils.counters["graph_break"]
        typical = statistics.median(step_times_s) if step_times_s else 0.0
        record.update(graph_breaks=int(sum(breaks.values())), recompiles=self._graphs() - (self.graphs_at_mark or 0),
                      compile_s=max(0.0, first_step_s - typical))
        if breaks:
            why = "; ".join(reason[:160] for reason in sorted(breaks, key=breaks.get, reverse=True)[:3])
            record["notes"] = [*record.get("notes", []), f"{record['graph_breaks']} graph breaks ({why})"]

@contextlib.contextmanager
def first_step(mode: str):
    """Around a compiled point's first step: a compile that fails says so (the point's error row says why)."""
    try:
        yield
    except torch.OutOfMemoryError:
        raise
    except Exception as e:
        if mode == "off":
            raise
        raise RuntimeError(f"torch.compile (mode {mode!r}) failed in the first step: {type(e).__name__}: {e}") from e
