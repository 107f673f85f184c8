"""Running measured points: the driver of a sweep.

Owns the sweep (sweep.py), launching ranks (launch.py) and cluster jobs (cluster.py), the worker that runs one
point on every rank (worker.py), the records a worker returns and the rows they become (records.py, rows.py),
what is skipped and why (skips.py), progress and the console summary (progress.py, summary.py) and rows measured
outside cpbench (external.py). May import the suite, measure and peers rooms, cpbench.cp and cpbench.report's store
and schema; never the project room (a projection reuses this room's rows and skips, not the other way round).
"""
