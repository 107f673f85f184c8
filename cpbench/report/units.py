"""Rendering base units for people: bytes -> GiB/MiB, seconds -> ms. Storage never holds these strings."""

from __future__ import annotations

import math
import re
import sys

GIB = 1024**3
MIB = 1024**2
KIB = 1024


def _missing(value) -> bool:
    """None, NaN, or pandas' NA (a nullable integer column's empty cell). pandas is not imported here (the command
    line parses its arguments without it): a value can only be its NA once pandas is loaded."""
    pandas = sys.modules.get("pandas")
    return value is None or (pandas is not None and value is pandas.NA) or (isinstance(value, float)
                                                                          and math.isnan(value))


def sig(value: float, digits: int = 3) -> str:
    """`value` with about `digits` significant digits, without scientific notation for everyday magnitudes."""
    if _missing(value):
        return "–"
    if value == 0:
        return "0"
    if math.isinf(value):
        return "∞" if value > 0 else "-∞"
    magnitude = math.floor(math.log10(abs(value)))
    if magnitude >= digits - 1:
        return f"{value:.0f}"
    if magnitude < -4:
        return f"{value:.{digits - 1}e}"
    return f"{value:.{digits - 1 - magnitude}f}"


def gib(num_bytes) -> str:
    """`1.23 GiB` (the unit of the comparison table)."""
    return "–" if _missing(num_bytes) else f"{sig(num_bytes / GIB)} GiB"


BYTE_UNITS = ((GIB, "GiB"), (MIB, "MiB"), (KIB, "KiB"), (1, "B"))


def byte_unit(values) -> tuple[int, str]:
    """One unit for a table (or a column): the largest that keeps its largest value >= 1, so that a table reads in
    one unit family (`4.20 MiB` beside `15.1 MiB`, not `0.00410 GiB`)."""
    present = [abs(v) for v in values if not _missing(v)]
    largest = max(present, default=0)
    return next(((size, name) for size, name in BYTE_UNITS if largest >= size), (1, "B"))


def in_unit(num_bytes, unit: tuple[int, str]) -> str:
    """`num_bytes` in a table's unit (see `byte_unit`)."""
    return "–" if _missing(num_bytes) else f"{sig(num_bytes / unit[0])} {unit[1]}"


def human_bytes(num_bytes) -> str:
    """The largest of GiB, MiB, KiB, B that keeps the number >= 1: for messages about small CPU models."""
    if _missing(num_bytes):
        return "–"
    if math.isinf(num_bytes):
        return sig(num_bytes)
    for unit, name in ((GIB, "GiB"), (MIB, "MiB"), (KIB, "KiB")):
        if abs(num_bytes) >= unit:
            return f"{sig(num_bytes / unit)} {name}"
    return f"{num_bytes:.0f} B"


def seq_label(tokens: float) -> str:
    """16384 -> '16k', 1048576 -> '1M', 1536 -> '1.5k', 512 -> '512' (binary k and M, as lengths are given)."""
    for size, suffix in ((1 << 20, "M"), (1 << 10, "k")):
        if tokens >= size:
            return f"{tokens / size:g}{suffix}"
    return f"{tokens:g}"


def ms(seconds) -> str:
    """`45.6 ms`."""
    return "–" if _missing(seconds) else f"{sig(seconds * 1e3)} ms"


def seconds(value) -> str:
    """A duration in the unit its size reads best in: 850 ms, 12.3 s, 6.3 min, 1.8 h; '' when missing."""
    if _missing(value):
        return ""
    if value < 1:
        return f"{sig(value * 1e3)} ms"
    if value < 120:
        return f"{sig(value)} s"
    if value < 7200:
        return f"{sig(value / 60)} min"
    return f"{sig(value / 3600)} h"


def change(old, new) -> str:
    """Relative change `+12.3%`, or `new` when there is no old value to divide by."""
    if _missing(old) or _missing(new):
        return "–"
    if old == 0:
        return "±0%" if new == 0 else "new"
    if math.isinf(old) or math.isinf(new):
        return "new" if math.isinf(old) else sig(new - old)
    percent = (new - old) / abs(old) * 100
    return ("+" if percent > 0 else "") + f"{sig(percent)}%"


_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int, *, field_name: str = "--memory-budget") -> int:
    """'80GiB' -> 85899345920, '1.5GB' -> 1500000000 (SI and binary units as written). Plain integers are bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"`{field_name}` = {text!r}: write a size like 80GiB, 512MiB, 1.5GB or a number of bytes.")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
