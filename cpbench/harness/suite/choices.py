"""The allowed values of a suite's enumerated fields, in a module that imports nothing: the command line offers them
as its flags' choices and refuses a wrong one before torch or transformers is imported (checks.py checks a suite
file's against the same tuples)."""

DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("cpu", "cuda")
BATCH_KINDS = ("plain", "packed", "padded")
PARITY_MODES = ("auto", "full", "projected", "off")
REFERENCES = ("auto", "unsharded", "sharded")  # where the parity reference runs (see `Suite.reference`)
# What a point runs: the model's training step, or one attention op (peers/attention_level.py).
LEVELS = ("model", "attention")
LOSSES = ("full", "chunked", "liger")  # cpbench.cp.loss.chunked.LOSSES
