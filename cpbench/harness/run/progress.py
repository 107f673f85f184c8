"""The sweep's progress bar (tqdm, on stderr): points done out of the suite, by status, and the one running."""

from __future__ import annotations

from collections import Counter

from tqdm import tqdm


class SweepProgress:
    def __init__(self, total: int, done: int, name: str, *, enabled: bool = True):
        self.bar = tqdm(total=total, initial=done, desc=name, unit="point", disable=not enabled, dynamic_ncols=True)
        self.counts: Counter[str] = Counter()

    def __enter__(self) -> "SweepProgress":
        return self

    def __exit__(self, *exc) -> bool:
        self.bar.close()
        return False

    def running(self, point) -> None:
        self.bar.set_postfix_str(f"{dict(self.counts)} now {point.point_id}", refresh=False)

    def finished(self, point, status: str) -> None:
        self.counts[status] += 1
        self.bar.set_postfix_str(f"{dict(self.counts)}", refresh=False)
        self.bar.update(1)
