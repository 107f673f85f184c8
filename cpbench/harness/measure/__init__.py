"""One training step and everything measured of it, shared by measured runs and projections.

Owns the step itself (step.py: the model, the batch, CP, FSDP, the optimizer), the probes (probes.py: memory and
time; nvml.py: the device's own figure), what a step's collectives move (collectives.py), capturing a step's results
(capture.py), parity against the unsharded reference (parity.py, reference.py), model FLOPs and peaks (flops.py)
and the environment's fingerprint (env.py). A measured point (the run room) and a projection (the project room)
run this room's step and differ only in the room that drives them. May import the suite room and cpbench.cp; never
the run, project or peers rooms.
"""
