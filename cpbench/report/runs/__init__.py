"""A run on disk, as data: the versioned row schema (schema.py), the run folder's table and its per-point journal
(store.py), reading a run for the report and recovering what a damaged table still holds (load.py), matching the
points of two runs (match.py), the lock that keeps one writer per run folder (lock.py), and example runs drawn as the
writers write them, for property-based tests (examples.py, which alone needs `hypothesis`: the `test` extra).

May import pyarrow, pandas and filelock only; never the rest of cpbench.report (tables, figures, the page, compare,
gate), which read runs through this room (tests/unit/test_import_rules.py).
"""
