"""table.md: each published measurement beside cpbench's projection of the same configuration, and the error."""

import tomllib
from pathlib import Path

from cpbench.report.runs import store

HERE = Path(__file__).parent


def projected(name: str, unit: str):
    runs = list((HERE / "runs").glob(f"*/{name}/runs.parquet"))
    if not runs:
        return None, "not projected"
    row = store.read_run(runs[0]).iloc[0]
    if row["status"] != "ok" or row["projected_step_s"] != row["projected_step_s"]:
        return None, f"{row['status']}: {row['status_detail']}"
    value = row["projected_step_s"] if unit == "s" else row["projected_tokens_per_s"] / row["world_size"]
    return value, f"peak {row['peak_bytes'] / 2**30:.1f} GiB, MFU {100 * row['projected_mfu']:.1f} %"


def main() -> None:
    lines = ["| measurement | configuration | measured | projected | error | notes |", "|---|---|---|---|---|---|"]
    errors = []
    for name, m in tomllib.loads((HERE / "measurements.toml").read_text()).items():
        value, note = projected(name, m["unit"])
        cell = f"{value:,.0f} {m['unit']}" if value is not None else "-"
        error = f"{100 * (value / m['measured'] - 1):+.0f} %" if value is not None else "-"
        if value is not None and m.get("judged", True):
            errors.append(abs(value / m["measured"] - 1))
        if not m.get("judged", True):
            error += " (not judged)"
        notes = "; ".join(filter(None, [note, m.get("differs")]))
        lines.append(f"| {m['source']} | {m['config']} | {m['measured']:,} {m['unit']} | {cell} | {error} | {notes} |")
    if errors:
        lines.append(f"\nMean absolute error {100 * sum(errors) / len(errors):.0f} % over the {len(errors)} like-for-like "
                     "measurements.")
    (HERE / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
