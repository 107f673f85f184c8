"""The host's time to dispatch cpbench's own eager step, measured here: the profiles' `cpu_op_s`,
`cpu_fsdp_collective_s`, `cpu_optimizer_tensor_s`, `cpu_recompute_layer_s`, `cpu_recompute_replay_s` and
`cpu_selective_op_s`.

An eager step costs the host time whatever its kernels compute: Python, autograd's graph, torch's dispatcher and
allocator for every op; FSDP2's hooks around every unshard and reduce-scatter (DTensor bookkeeping, streams, copy-in
and copy-out); the optimizer's foreach ops over every parameter. A GPU runs the kernels; the host only has to keep
ahead of them, and at short lengths it cannot. This measures those times the way `timing.simulate` charges them, per
op the step's trace prices (trace.py: views and other free ops are not priced, so their host time is folded into the
ops that are), per FSDP2 collective, and per tensor of the optimizer's ops.

How, so that the kernels' own time is removed: the point's real step (a deep, narrow model: a real model's layers
and ops, a few elements each) runs on CPU tensors against a fake process group (FSDP2's hooks run and its
collectives are called; no bytes move), on one thread, in fp32 (CPU kernels of bf16 cost more than the dispatch
being measured); its process CPU time (not wall time: a busy machine does not inflate it) is taken at two tiny
lengths and extrapolated to no tokens. Without FSDP that gives the time per op; with it, what FSDP2 adds, per
collective; with every layer recomputed (activation checkpointing), what a recomputed layer adds beyond the ops it
replays (each priced at the time per op), per layer, at its forward (the forward timed apart, against the plain
step's) and the rest at its replay in backward; with op recompute (cp/recompute.py), what its selective-checkpoint
modes add per op they see, beyond the same checkpoints' and ops' prices; the optimizer step is timed apart. What a
CUDA step adds (the driver's launch of each kernel) and what it saves (the CPU kernel of a few elements) are not in
it: both are a few microseconds.

    python -m cpbench.harness.project.dispatch            # prints the measurement (a few minutes)
"""

from __future__ import annotations

import time

import torch

from cpbench.harness.project.timing import HOST_ONLY

LENGTHS = (8, 32)  # tokens per sequence: both tiny, so the extrapolation removes what the kernels cost
FSDP_COLLECTIVES = ("all_gather", "reduce_scatter")


def _suite_text(model: str, world_size: int, layers: int, recompute: bool = False, policy: str = "full") -> str:
    # a CUDA point (its kernel choices, the foreach optimizer), run on CPU tensors
    return (f'name = "dispatch"\nmodel = "{model}"\nseq_lens = [{", ".join(map(str, LENGTHS))}]\n'
            f'cp_sizes = [1]\nworld_size = {world_size}\ndtype = "float32"\ndevice = "cuda"\n'
            f'warmup_steps = 1\nmeasured_steps = 1\nmodel_overrides = {{num_hidden_layers = {layers}}}\n'
            f'activation_checkpointing = {str(recompute).lower()}\n'
            + (f'recompute_policy = "{policy}"\n' if recompute else ""))


def step_costs(point, steps: int = 10) -> dict:
    """The point's real step on this host: what its trace prices (`ops` of the forward and backward, `forward_ops`
    of the forward, its FSDP2 `collectives`, the `tensors` the optimizer's ops take) and the process CPU seconds of
    the forward and backward (`step_s`), of the forward alone (`forward_s`) and of the optimizer step
    (`optimizer_s`), each the least of three runs."""
    from cpbench.harness.measure import step
    from cpbench.harness.project.projection import _mesh, fake_world
    from cpbench.harness.project.trace import StepTrace

    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the host thread that dispatches; its CPU time is then the process's
    try:
        with fake_world(point.world_size, 0):
            mesh = _mesh(point)
            model = step.distribute(step.build_model(point, "cpu"), point, mesh=mesh, kernel_device=point.device)
            batch = step.make_batch(point, model.config.vocab_size, "cpu")
            optimizer = step.make_optimizer(model, point)  # a CUDA point: the foreach kernels, as on the GPU
            for _ in range(3):  # warm up: the optimizer state, the allocator, the first calls' caches
                step.train_step(model, optimizer, batch)
            trace = StepTrace()
            hooks = trace.optimizer_hooks(optimizer) + trace.checkpoint_hooks(model)
            try:  # the optimizer's are torch's global hooks: removed whatever the step does
                with trace:  # step.train_step, its forward's ops counted apart
                    loss = step.forward(model, batch).loss
                    forward_ops = sum(o.kind not in HOST_ONLY for o in trace.ops)
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
            finally:
                for h in hooks:
                    h.remove()
            priced = [o for o in trace.ops if o.kind not in HOST_ONLY]
            costs = {"ops": sum(o.phase == "step" for o in priced), "forward_ops": forward_ops,
                     "checkpoints": sum(o.kind == "checkpoint" for o in trace.ops),
                     "replays": sum(o.kind == "replay" for o in trace.ops),
                     "selective_ops": sum(o.selective for o in priced if o.phase == "step"),
                     "collectives": sum(o.phase == "step" and o.kind in FSDP_COLLECTIVES for o in priced),
                     "tensors": sum(o.tensors for o in priced if o.phase == "optimizer"),
                     **dict.fromkeys(("step_s", "forward_s", "optimizer_s"), float("inf"))}
            for _ in range(3):  # interference only ever adds: the least of three
                spent = {"step_s": 0.0, "forward_s": 0.0, "optimizer_s": 0.0}
                for _ in range(steps):
                    t0 = time.process_time()
                    loss = step.forward(model, batch).loss
                    t1 = time.process_time()
                    loss.backward()
                    del loss  # its graph's teardown is the step's, as when the loss goes out of scope
                    t2 = time.process_time()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    t3 = time.process_time()
                    spent["forward_s"] += t1 - t0
                    spent["step_s"] += t2 - t0
                    spent["optimizer_s"] += t3 - t2
                costs.update({k: min(costs[k], v / steps) for k, v in spent.items()})
            return costs
    finally:
        torch.set_num_threads(threads)


def _at_no_tokens(model: str, world_size: int, layers: int, steps: int, recompute: bool = False,
                  policy: str = "full") -> dict:
    """step_costs at the two lengths, the step's time and its forward's extrapolated to no tokens (`host_s`,
    `forward_host_s`)."""
    from cpbench.harness.suite.spec import load_suite

    text = _suite_text(model, world_size, layers, recompute, policy)
    points = sorted(load_suite("dispatch.toml", text=text).points(), key=lambda p: p.seq_len)
    a, b = (step_costs(p, steps) | {"tokens": p.seq_len * p.batch_size} for p in points)
    if (a["ops"], a["forward_ops"], a["collectives"]) != (b["ops"], b["forward_ops"], b["collectives"]):
        raise RuntimeError(f"the step dispatched {a['ops']} ops at {a['tokens']} tokens and {b['ops']} at "
                           f"{b['tokens']}: the extrapolation needs the same ops at both lengths")
    def at_no_tokens(key: str) -> float:
        return a[key] - (b[key] - a[key]) / (b["tokens"] - a["tokens"]) * a["tokens"]

    return {**a, "host_s": at_no_tokens("step_s"), "forward_host_s": at_no_tokens("forward_s"),
            "per_token_s": (b["step_s"] - a["step_s"]) / (b["tokens"] - a["tokens"]), "runs": [a, b]}


def measure(model: str = "tiny-llama", layers: int = 16, steps: int = 10, rounds: int = 3) -> dict:
    """The host's dispatch costs (see the module docstring). `layers`: a real model's depth, so that a step's
    once-per-step work weighs against as many layers' ops as it does there. The step with and without recompute is
    measured in alternating `rounds`, each keeping its least: the recompute figure is their difference, which a
    machine that slows between two separate measurements would distort."""
    plain, again, selective = [], [], []
    for _ in range(rounds):
        plain.append(_at_no_tokens(model, 1, layers, steps))
        again.append(_at_no_tokens(model, 1, layers, steps, recompute=True))
        selective.append(_at_no_tokens(model, 1, layers, steps, recompute=True, policy="op"))
    alone, recomputed, by_op = (min(runs, key=lambda r: r["host_s"]) for runs in (plain, again, selective))
    sharded = _at_no_tokens(model, 2, layers, steps)
    per_op = alone["host_s"] / alone["ops"]
    per_collective = (sharded["host_s"] - per_op * sharded["ops"]) / sharded["collectives"]
    per_tensor = sharded["optimizer_s"] / sharded["tensors"]  # FSDP2's parameters are DTensors, as on the GPUs
    # the replayed forward's ops are priced per op like any other; what is left is the checkpoints' own: at the
    # forward, what the recomputed forward costs beyond the plain one's (its ops' difference priced per op); the rest
    # at the replay
    layers_marked = recomputed["checkpoints"]
    per_layer = (recomputed["host_s"] - per_op * recomputed["ops"]) / layers_marked
    forward = (recomputed["forward_host_s"] - alone["forward_host_s"]
               - per_op * (recomputed["forward_ops"] - alone["forward_ops"])) / layers_marked
    # op recompute: the same checkpoints and replays, its own ops priced per op; what is left, per op its
    # selective-checkpoint modes saw
    per_selective = ((by_op["host_s"] - per_op * by_op["ops"] - per_layer * by_op["checkpoints"])
                     / by_op["selective_ops"])
    return {"model": model, "layers": layers, "cpu_op_s": per_op, "cpu_fsdp_collective_s": per_collective,
            "cpu_optimizer_tensor_s": per_tensor, "cpu_recompute_layer_s": forward,
            "cpu_recompute_replay_s": per_layer - forward, "recompute_total_s": per_layer, "alone": alone,
            "cpu_selective_op_s": per_selective, "selective": by_op,
            "sharded": sharded, "recomputed": recomputed, "torch": torch.__version__, "cpu": _cpu_name()}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    except OSError:
        return "unknown"


if __name__ == "__main__":
    r = measure()
    a, s, c = r["alone"], r["sharded"], r["recomputed"]
    print(f"{r['model']}, {r['layers']} layers, on {r['cpu']} with torch {r['torch']}:\n"
          f"  one rank: {a['ops']} ops in forward and backward, {1e3 * a['host_s']:.2f} ms at no tokens: "
          f"cpu_op_s = {1e6 * r['cpu_op_s']:.1f} us\n"
          f"  FSDP2 over 2 ranks: {s['ops']} ops and {s['collectives']} collectives, {1e3 * s['host_s']:.2f} ms: "
          f"cpu_fsdp_collective_s = {1e6 * r['cpu_fsdp_collective_s']:.0f} us\n"
          f"  its optimizer step: {s['tensors']} tensors in its ops, {1e3 * s['optimizer_s']:.2f} ms: "
          f"cpu_optimizer_tensor_s = {1e6 * r['cpu_optimizer_tensor_s']:.2f} us\n"
          f"  every layer recomputed: {c['ops']} ops and {c['checkpoints']} checkpointed layers "
          f"({c['replays']} replayed), {1e3 * c['host_s']:.2f} ms: {1e6 * r['recompute_total_s']:.0f} us a layer, "
          f"its forward {1e3 * c['forward_host_s']:.2f} ms against {1e3 * a['forward_host_s']:.2f} plain "
          f"({c['forward_ops']} and {a['forward_ops']} ops): cpu_recompute_layer_s = "
          f"{1e6 * r['cpu_recompute_layer_s']:.0f} us, cpu_recompute_replay_s = "
          f"{1e6 * r['cpu_recompute_replay_s']:.0f} us\n"
          f"  op recompute: {r['selective']['ops']} ops, {r['selective']['selective_ops']} of them under its "
          f"selective-checkpoint modes, {1e3 * r['selective']['host_s']:.2f} ms: "
          f"cpu_selective_op_s = {1e6 * r['cpu_selective_op_s']:.1f} us", flush=True)
