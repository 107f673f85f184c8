"""Reading what a launch's ranks wrote (see `worker.py`): which points finished, failed, or are in flight."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from cpbench.harness.suite.spec import Point


class LaunchRecords:
    def __init__(self, folder: Path, points: list[Point]):
        self.folder = folder
        self.points = list(points)
        self.done: set[str] = set()
        self.progressed = False  # a point started or finished in this launch

    def pending(self) -> list[Point]:
        return [p for p in self.points if p.point_key not in self.done]

    def mark_done(self, point: Point) -> None:
        self.done.add(point.point_key)

    def _started(self, point: Point) -> float | None:
        path = self.folder / f"{point.point_key}.started"
        if not path.exists():
            return None
        self.progressed = True
        return json.loads(path.read_text())["t"]

    def in_flight(self) -> tuple[Point, float] | None:
        """The point that has started and not finished (a launch runs one at a time), with its start time."""
        for p in self.pending():
            t = self._started(p)
            if t is not None:
                return p, t
        return None

    def harvest(self, exited: bool = False) -> list[tuple[Point, dict]]:
        """Points that finished since the last call: ("records", every rank's record) or ("outcome", status). A
        point some ranks failed is final once every rank wrote its error or the launch `exited`: a rank killed by a
        signal writes nothing, and its peers' errors (a connection reset) are only what followed."""
        out = []
        for p in self.pending():
            started = self._started(p)
            if started is None:
                continue
            result = self._result(p, time.time() - started, exited)
            if result is not None:
                self.mark_done(p)
                out.append((p, result))
        return out

    def _result(self, point: Point, wall_s: float, exited: bool) -> dict | None:
        path = self.folder / f"{point.point_key}.json"
        if path.exists():
            return {"kind": "records", "records": json.loads(path.read_text()), "wall_s": wall_s}
        errors = sorted(self.folder.glob(f"{point.point_key}.rank*.error.json"))
        if not errors or (len(errors) < point.world_size and not exited):
            return None
        failed = failure([json.loads(e.read_text()) for e in errors], point.world_size)
        measured = self.folder / f"{point.point_key}.measured.json"
        if measured.exists():  # the step was measured; its parity reference failed: keep the measurements
            records = json.loads(measured.read_text())
            status = "reference_oom" if failed["status"] == "oom" else "error"
            records[0]["parity"] = {"parity_status": status, "parity_detail": f"the reference failed: {failed['message']}"}
            return {"kind": "records", "records": records, "wall_s": wall_s}
        return {"kind": "outcome", "wall_s": wall_s, **failed}


def failure(records: list[dict], world_size: int | None = None) -> dict:
    """Status and detail of a point some ranks failed: the first rank to fail leads (its peers' errors, a closed
    connection in the collective they were waiting in, follow it); `oom` when any rank ran out of memory. Ranks that
    left no record (of `world_size`) died without raising: they lead where every recorded error is only a peer's
    symptom (a signal or the OS killed them, and the others lost their connection); where a rank raised, the launcher
    stopping its peers is what left them silent, and they follow."""
    records = sorted(records, key=lambda r: (r.get("t", 0.0), r["rank"]))
    status = "oom" if any(r["status"] == "oom" for r in records) else "error"
    silent = sorted(set(range(world_size or 0)) - {r["rank"] for r in records})
    causes = [r for r in records if not PEER_SYMPTOM.search(r["message"])]
    parts = [f"rank {r['rank']}: {r['message']}" for r in causes + [r for r in records if r not in causes]]
    if silent:
        note = (f"rank {', '.join(map(str, silent))} died without a record (killed by a signal or by the OS, e.g. its "
                "out-of-memory killer; the launch log says which)" if not causes else
                f"rank {', '.join(map(str, silent))} left no record (stopped by the launcher)")
        parts.insert(0 if not causes else len(parts), note)
    message = parts[0] + (" (failed first); then " + "; ".join(parts[1:]) if len(parts) > 1 else "")
    return {"status": status, "message": message}


# What a rank raises when a peer died under it: its collective's connection closed. A symptom, never the cause.
PEER_SYMPTOM = re.compile(r"Connection reset by peer|Connection closed by peer|Broken pipe|gloo.*(Read|Write) error|"
                          r"remote process exited|socket closed", re.IGNORECASE)
