"""The suite: what a sweep is asked to run, before anything runs.

Owns the suite file's data model (spec.py) and its points (point.py), every check that can be made before a process is
launched, all errors reported at once (checks.py, grid_checks.py, suite_errors.py), the model presets (presets.py)
and the suite files shipped with cpbench (suites.py). May import cpbench.cp (the registered styles),
cpbench.report's schema and units, and the peers registry; never the rooms that run, measure or project points.
"""
