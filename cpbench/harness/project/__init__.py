"""Projecting points: the same step on fake tensors and a fake process group, for models and lengths that do not
fit here.

Owns the projection of one point (projection.py), `cpbench estimate` (estimate.py) and the largest length that fits
(max_seq.py). May import the suite, measure and run rooms (a projected row is assembled as a measured one is),
cpbench.cp and cpbench.report; nothing imports it but the CLI's commands.
"""
