"""The results' data model and everything that reads it: it must work on a laptop that holds only a Parquet file.

Owns a run on disk as data (runs/: the versioned row schema, the run folder's store, its lock and recovery, matching
points across runs, example runs for property tests), derived columns and units (derive.py, units.py, stats.py),
tables, plots and the report page (tables.py, plots.py, peers.py, page.py; balance.py: how the attention work spreads
over the cp ranks), comparing runs (compare.py), the CI gate and its rules (gate.py, gate_rules.py) and the CLI's
report half (commands.py). May import pandas, pyarrow, matplotlib, scipy and filelock only: never torch, cpbench.cp,
cpbench.harness or the CLI (tests/unit/test_report_boundary.py).
"""
