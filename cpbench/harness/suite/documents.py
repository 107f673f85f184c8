"""Packed documents: the suite field `documents` (lengths given, or a shipped mix) and the rows it makes.

A row of `seq_len` tokens holds documents one after the other; `position_ids` restart at each (transformers' packed
rule, step.make_batch). A shipped mix draws document lengths from published length statistics of real long-context
training data, with the point's seed: documents fill the rows in turn, and one that passes a row's end is cut there,
its tail starting the next row as a new document (sequential packing). Each mix names its source and what was assumed
where the source gives no number (the research notes behind them: docs/training-loop.md, "Packed documents").

A pad segment (`pad:N` among given lengths, or a padded batch's tail) is a run of padding in a packed row: token 0,
label -100, positions restarting at 0, as a packing collator that pads each row to its length writes it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

NONE = "none"
PAD = "pad"


@dataclass(frozen=True)
class Mix:
    name: str
    source: str  # where the length statistics come from, and what was assumed
    draw: Callable[[random.Random], int]  # one document's length in tokens


def _quantiles(table: list[tuple[float, float]]) -> Callable[[random.Random], int]:
    """An inverse CDF through published quantiles, linear between them (a piecewise-uniform density)."""
    ps = [p for p, _ in table]

    def draw(rng: random.Random) -> int:
        u = rng.random()
        i = max(1, next(k for k, p in enumerate(ps) if p >= u) if u <= ps[-1] else len(ps) - 1)
        (p0, l0), (p1, l1) = table[i - 1], table[i]
        return max(1, round(l0 + (l1 - l0) * (u - p0) / (p1 - p0)))

    return draw


def _lognormal(mean: float, sigma: float = 1.0) -> Callable[[random.Random], int]:
    """Lengths with mean `mean` and log-sd `sigma` (ln L ~ N(ln mean - sigma^2 / 2, sigma))."""
    mu = math.log(mean) - sigma**2 / 2
    return lambda rng: max(1, round(rng.lognormvariate(mu, sigma)))


def _mixture(parts: list[tuple[float, Callable[[random.Random], int]]]) -> Callable[[random.Random], int]:
    """A document of component i with probability proportional to its weight (document shares)."""
    weights = [w for w, _ in parts]

    def draw(rng: random.Random) -> int:
        return rng.choices(parts, weights)[0][1](rng)

    return draw


def _token_weighted(parts: list[tuple[float, float, Callable[[random.Random], int]]]):
    """A mixture given by token shares: (token share, mean length, draw) -> document shares share / mean."""
    return _mixture([(share / mean, draw) for share, mean, draw in parts])


def _bounded_pareto(low: int, high: int, alpha: float) -> Callable[[random.Random], int]:
    """ln(L / low) exponential with rate `alpha`, truncated at `high`."""
    tail = (low / high) ** alpha
    return lambda rng: min(high, round(low * (1 - rng.random() * (1 - tail)) ** (-1 / alpha)))


# Meta's 128K pretraining data: WLB-LLM (Wang et al., OSDI '25, arXiv 2503.17924) Fig. 3, as digitised by
# hao-ai-lab/DistCA (distca/simulator/data/dist_wlbllm.json, 99,519 lengths; quantiles of that sample). Mean 3,962;
# 17 % of tokens in documents >= 32K, as the paper's "documents shorter than half the window hold > 75 %".
_META_128K = [(0.0, 1), (0.01, 63), (0.05, 324), (0.10, 646), (0.25, 1606), (0.50, 3227), (0.75, 4832), (0.90, 5784),
              (0.95, 6110), (0.975, 7482), (0.99, 26058), (0.995, 69097), (0.999, 119793), (1.0, 124913)]
# ProLong's short sources (Gao et al. 2024, arXiv 2410.02660): the quantiles of DistCA's ProLong sample
# (distca/simulator/data/dist_prolong.json, 77,932 lengths, provenance undocumented), mean 3,052.
_PROLONG_SHORT = [(0.0, 575), (0.01, 678), (0.05, 801), (0.10, 919), (0.25, 1237), (0.50, 1913), (0.75, 3467),
                  (0.90, 6051), (0.95, 8378), (0.99, 16269), (0.999, 47397), (1.0, 340149)]
# Llama 3's SFT mix (arXiv 2407.21783, Table 7): share of examples and mean tokens per category. The log-sd (1.0) and
# the long category's buckets over {16K, 32K, 64K, 128K} (0.45, 0.30, 0.17, 0.08: mean 38.8K against the published
# 38.1K) are assumed: the paper gives neither.
_LLAMA3_SFT = [(52.66, 974.0), (14.89, 753.3), (3.01, 520.5), (8.14, 297.8), (21.19, 661.6)]
_LLAMA3_LONG = [(0.45, 16384), (0.30, 32768), (0.17, 65536), (0.08, 131072)]
# The Pile (Gao et al. 2020, arXiv 2101.00027, Table 1 / EleutherAI/the-pile README): each source's token share and
# mean document size in tokens (KiB per document over Dolma's bytes per Llama-2 token for the source's kind). The
# log-sd of every source (1.0) is assumed: the table gives means only.
_PILE = [(18.11, 1120), (14.40, 8170), (12.07, 162000), (10.01, 1000), (8.96, 12500), (7.59, 2120), (6.12, 3900),
         (5.13, 580), (3.65, 1090), (3.07, 350), (2.17, 120000), (1.55, 7900), (1.53, 300), (1.24, 2070),
         (0.88, 141000), (0.75, 111000), (0.73, 17800), (0.62, 1270), (0.60, 5840), (0.38, 19600), (0.30, 560),
         (0.14, 460)]

MIXES: dict[str, Mix] = {m.name: m for m in (
    Mix("meta-128k", "Meta's 128K pretraining data: WLB-LLM (OSDI '25, arXiv 2503.17924) Fig. 3, digitised by "
        "hao-ai-lab/DistCA (dist_wlbllm.json); the sample's quantiles, linear between them", _quantiles(_META_128K)),
    Mix("prolong-64k", "ProLong's 64K stage (arXiv 2410.02660; princeton-nlp/ProLong train_64K.sh): 60 % of tokens "
        "in 65,536-token documents (code repositories and books cut to 64K), 40 % short documents at the quantiles of "
        "DistCA's ProLong sample (dist_prolong.json)",
        _token_weighted([(0.6, 65536, lambda rng: 65536), (0.4, 3052, _quantiles(_PROLONG_SHORT))])),
    Mix("llama3-sft", "Llama 3's SFT mix (arXiv 2407.21783, Table 7): 99.89 % of examples short (five categories, "
        "lognormal at the published means, log-sd 1.0 assumed), 0.11 % long at 16K-128K (bucket weights assumed)",
        _mixture([*((share, _lognormal(mean)) for share, mean in _LLAMA3_SFT),
                  (0.11, _mixture([(w, lambda rng, n=n: n) for w, n in _LLAMA3_LONG]))])),
    Mix("longalign", "LongAlign-10k (arXiv 2401.18058; THUDM/LongAlign README: 8K-64K): a bounded Pareto on "
        "[8,000, 65,510], alpha 1.27 (median 13.1K, p90 33.5K, against a measured 12.6K and 36K)",
        _bounded_pareto(8000, 65510, 1.27)),
    Mix("pile", "The Pile (arXiv 2101.00027, Table 1): 22 sources by token share and mean document size, each "
        "lognormal (log-sd 1.0 assumed); books and IRC logs run past a 128K row", 
        _token_weighted([(share, mean, _lognormal(mean)) for share, mean in _PILE])),
)}


@dataclass(frozen=True)
class Segment:
    length: int
    pad: bool = False


def parse(text: str) -> str | list[list[str | int]]:
    """The command line's `--documents`: a mix's name, or lengths (`50000,30000,pad:1072`, rows separated by `;`)."""
    text = text.strip()
    if text in MIXES or text == NONE:
        return text
    rows = [[_entry(x) for x in row.split(",") if x.strip()] for row in text.split(";") if row.strip()]
    return rows[0] if len(rows) == 1 else rows


def _entry(text: str) -> int | str:
    text = text.strip()
    return text if text.startswith(f"{PAD}:") else int(text) if text.lstrip("-").isdigit() else text


def given_rows(value) -> list[list[Segment]]:
    """A suite's given lengths (a list of one row's lengths, or a list of rows) as rows of segments; raises a
    ValueError naming the entry and the fix."""
    out = []
    for row in as_rows(value):
        if not row:
            raise ValueError("a row of documents is empty: give its lengths, e.g. [65536, 32768, 32768]")
        out.append([_segment(x) for x in row])
    return out


def _segment(x) -> Segment:
    if isinstance(x, bool) or not isinstance(x, (int, str)):
        raise ValueError(f"document length {x!r}: give a positive integer or \"{PAD}:N\" (N padded tokens)")
    if isinstance(x, str):
        if not x.startswith(f"{PAD}:") or not x[4:].isdigit() or int(x[4:]) < 1:
            raise ValueError(f"document entry {x!r}: give a positive integer or \"{PAD}:N\" (N padded tokens)")
        return Segment(int(x[4:]), pad=True)
    if x < 1:
        raise ValueError(f"document length {x}: every document needs at least one token")
    return Segment(x)


def key(value) -> str:
    """The point's `documents` column: none, the mix's name, or lengths:<hash> of the given lengths."""
    if isinstance(value, str):
        return value
    return "lengths:" + hashlib.sha256(json.dumps(as_rows(value)).encode()).hexdigest()[:12]


def as_rows(value) -> tuple:
    """The given lengths as a tuple of rows (one row given: one row); a mix's name: ()."""
    if isinstance(value, str):
        return ()
    rows = value if value and all(isinstance(r, (list, tuple)) for r in value) else [value]
    return tuple(tuple(row) for row in rows)


def check(suite) -> None:
    """The suite's `documents` and `balance` fields (every error names the field, the value and the fix)."""
    from cpbench.harness.suite.suite_errors import Collector, err

    found, value = Collector(), suite.documents
    if suite.balance not in ("documents", "sequence"):
        found.errors.append(str(err("balance", suite.balance, 'use "documents" (the zigzag ring placed by the '
                                    'batch\'s documents) or "sequence" (the plain zigzag: the balance off).')))
    if isinstance(value, str):
        if value != NONE and value not in MIXES:
            found.errors.append(str(err("documents", value, f"use \"none\", a shipped mix ({', '.join(MIXES)}) or "
                                        "the lengths of a row, e.g. [65536, 32768, 32768].")))
    elif not isinstance(value, (list, tuple)) or not value:
        found.errors.append(str(err("documents", value, "give a mix's name or a non-empty list of lengths.")))
    else:
        try:
            given = given_rows(value)
        except ValueError as e:
            found.errors.append(str(err("documents", value, str(e))))
        else:
            for i, row in enumerate(given):
                total = sum(s.length for s in row)
                for seq_len in sorted(set(suite.seq_lens)):
                    if total != seq_len:
                        found.errors.append(str(err(
                            "documents", value, f"row {i} holds {total} tokens but seq_lens has {seq_len}: give "
                            "lengths that sum to the sequence length (one length per suite), or a mix's name.")))
    if value != NONE and suite.level != "model":
        found.errors.append(str(err("documents", value, 'packed documents are a model-level batch: drop them for '
                                    'level = "attention".')))
    found.raise_any()


def rows(documents, lengths, seq_len: int, batch_size: int, seed: int, padded: bool = False) -> list[list[Segment]]:
    """Each row's segments. `documents`: the point's column (a mix's name or lengths:<hash>); `lengths`: the given
    rows (repeated over the batch); `padded`: every other row ends in a pad segment of a quarter of the row."""
    if documents in MIXES:
        out = _drawn(MIXES[documents], seq_len, batch_size, seed, padded)
    else:
        given = given_rows(lengths)
        out = [given[i % len(given)] for i in range(batch_size)]
    for i, row in enumerate(out):
        total = sum(s.length for s in row)
        if total != seq_len:
            raise ValueError(f"documents: row {i} holds {total} tokens, but the point's sequence is {seq_len}: give "
                             f"lengths that sum to the sequence length (or a mix's name, {sorted(MIXES)})")
    return out


def _drawn(mix: Mix, seq_len: int, batch_size: int, seed: int, padded: bool) -> list[list[Segment]]:
    rng = random.Random(f"{mix.name}:{seed}")  # the point's seed: the same rows on every rank and in the reference
    carry = 0
    out = []
    for row in range(batch_size):
        pad = seq_len // 4 if padded and row % 2 == 0 else 0
        room, segs = seq_len - pad, []
        while room:
            length = carry or mix.draw(rng)
            take = min(length, room)
            segs.append(Segment(take))
            room -= take
            carry = length - take
        out.append(segs + ([Segment(pad, pad=True)] if pad else []))
    return out


def suite_text_with(text: str, stem: str, fields: dict) -> str:
    """A suite file's text with `fields` set (its `documents`, its `compile`): what `sweep --documents` hands its
    ranks, which read the suite from a file (the name kept: the results go where the suite's own would)."""
    raw = tomllib.loads(text)
    raw.setdefault("name", stem)
    raw.update(fields)
    return "".join(f"{k} = {_toml(v)}\n" for k, v in raw.items())


def suite_file_with(text: str, stem: str, fields: dict, folder) -> Path:
    """`suite_text_with` written to `folder` (beside the results), whole each time, so that every rank of an external
    launch reads the same file."""
    text = suite_text_with(text, stem, fields)
    path = Path(folder) / f"{stem}.{hashlib.sha256(text.encode()).hexdigest()[:8]}.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def _toml(value) -> str:
    """A TOML value: JSON's scalars and arrays are TOML's; tables become inline tables."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(value)
