"""`cpbench estimate --max-seq`: per configuration (cp size, style, backend, ...), the largest sequence length
whose projected per-rank peak fits the capacity, to a granularity of `granularity` tokens.

From the suite's shortest length (rounded up to the granularity) the length doubles until a projection runs out
of memory or reaches the model's max_position_embeddings; then bisection between the longest length that fit
and the shortest that did not, over multiples of the granularity. Every length tried is a row of the run, so the
table and the largest-fit plot show the search; `report.derive.largest_fit` reads the answer off them.
"""

from __future__ import annotations

from dataclasses import replace

from cpbench.harness.suite.presets import get_preset
from cpbench.harness.suite.spec import Point


def families(points: list[Point]) -> list[Point]:
    """One point per configuration (its shortest length), in suite order."""
    seen: dict[str, Point] = {}
    for p in points:
        if p.family_key not in seen or p.seq_len < seen[p.family_key].seq_len:
            seen[p.family_key] = p
    return list(seen.values())


def chains(suite, granularity: int) -> list:
    """One search per configuration of the suite (see estimate.run_chains for how chains run)."""
    if not isinstance(granularity, int) or granularity < 1:
        raise ValueError(f"--granularity {granularity}: give a positive number of tokens, e.g. 1024.")
    out = []
    for template in families(suite.points()):
        config = get_preset(template.preset).config(template.model_overrides)
        limit = config.max_position_embeddings // granularity * granularity
        if limit < granularity:
            raise ValueError(f"--granularity {granularity} is longer than {template.model}'s "
                             f"max_position_embeddings ({config.max_position_embeddings}).")
        out.append(search(template, granularity, limit))
    return out


def search(template: Point, g: int, limit: int):
    """Yields the lengths to project (as points), is sent each one's row; ends with the largest that fits."""

    def fits(row: dict) -> bool | None:
        return {"ok": True, "oom": False}.get(row["status"])  # None: skipped or error, the search stops

    fit, over = 0, None
    length = min(max(g, -(-template.seq_len // g) * g), limit)
    while True:
        verdict = fits((yield replace(template, seq_len=length)))
        if verdict is None:
            return fit or None
        if not verdict:
            over = length
            break
        fit = length
        if length == limit:
            return fit
        length = min(2 * length, limit)
    while over - fit > g:
        middle = (fit + over) // 2 // g * g
        verdict = fits((yield replace(template, seq_len=middle)))
        if verdict is None:
            break
        fit, over = (middle, over) if verdict else (fit, middle)
    return fit or None
