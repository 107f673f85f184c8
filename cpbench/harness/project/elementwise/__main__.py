"""python -m cpbench.harness.project.elementwise: the fit and its report (fit.py) for rows of one GPU."""

import argparse
from pathlib import Path

from cpbench.harness.project.elementwise.fit import DATA, PROFILE, report
from cpbench.harness.project.hardware import load

parser = argparse.ArgumentParser(prog="python -m cpbench.harness.project.elementwise",
                                 description="Fit the element-wise kernels' HBM figures to eager timings.")
parser.add_argument("--data", default=str(DATA), help="rows as results/published/elementwise holds them")
parser.add_argument("--gpu", default=PROFILE, help="the profile of the GPU the rows were timed on")
parser.add_argument("--keep-ramp", action="store_true",
                    help="keep the profile's memory_ramp_s (rows whose kernels are all too large to set it)")
args = parser.parse_args()
print(report(load(args.gpu), Path(args.data), args.keep_ramp), flush=True)
