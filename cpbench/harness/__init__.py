"""The harness: runs sweep points and writes their rows. Uses cpbench.cp to build a point's model and
cpbench.report's schema and store to write its rows; neither of those imports it.

Its rooms, one concept each (each sub-package's docstring says what it owns and what it may import):
- suite/    what a sweep is asked to run: the suite's data model, its checks, the presets, the suite files;
- measure/  one training step and what is measured of it (memory, time, collectives, parity, FLOPs), shared by
            measured runs and projections;
- run/      the driver of measured points: the sweep, launchers, the worker, records, rows, skips, progress;
- project/  the driver of projected points: the same step on fake tensors and a fake process group (`estimate`,
            `--max-seq`), its time on a GPU profile, `calibrate` and `plan`;
- peers/    other CP implementations side by side on one attention op.
commands.py (sweep, run) and estimate_cli.py (estimate) are the CLI's harness half: argument parsing that calls into
run/ and project/.
"""
