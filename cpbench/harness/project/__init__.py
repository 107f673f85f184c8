"""Projecting points: the same step on fake tensors and a fake process group, for models and lengths that do not
fit here, and what that step would take on a GPU.

Owns the projection of one point (projection.py), `cpbench estimate` and its search of the largest length that fits
(estimate.py), the time model (trace.py: the step's ops and collectives; flops.py and work.py: what each kernel call
computes and moves; timing.py: priced on a GPU; hardware.py and gpus.toml: the GPU profiles; figures.py: its
figures as the docs show them; record.py: its record against published steps), `cpbench calibrate`
(calibrate.py), `cpbench plan` (plan.py) and the CLI of the last two (commands.py), and a step's kernel time by
class, measured on a GPU beside its price (decompose.py). May import the suite, measure and run rooms (a projected
row is assembled as a measured one is), cpbench.cp and cpbench.report; nothing imports it but the CLI's commands.
"""
