"""The fused AdamW lever as a projection sees it (suite `optimizer = "fused"`, trace.py): one kernel over every
parameter that moves each one's four fp32 values in and three out, its gradients written only when it unscales them
(ATen's FusedAdamMathFunctor), against the nine multi-tensor kernels and the temporaries of torch's foreach AdamW."""

from __future__ import annotations

import torch

from cpbench.harness.project.trace import StepTrace


def _optimizer_ops(fused: bool, grad_scale: torch.Tensor | None = None) -> tuple[list, int]:
    """The trace of a second AdamW step (the first makes the state) on a Linear(64, 32), and its parameter count."""
    model = torch.nn.Linear(64, 32)
    optimizer = torch.optim.AdamW(model.parameters(), fused=fused, foreach=None if fused else True)
    for _ in range(2):
        model(torch.ones(2, 64)).sum().backward()
        if _ == 0:
            optimizer.step()
    if grad_scale is not None:  # what GradScaler.step hands a fused optimizer (torch/amp/grad_scaler.py)
        optimizer.grad_scale, optimizer.found_inf = grad_scale, torch.zeros(())
    trace = StepTrace()
    hooks = trace.optimizer_hooks(optimizer)
    with trace:
        optimizer.step()
    for h in hooks:
        h.remove()
    return [o for o in trace.ops if o.phase == "optimizer"], sum(p.numel() for p in model.parameters())


def test_the_fused_kernel_moves_each_parameters_state_once_and_leaves_its_gradient_alone():
    ops, n = _optimizer_ops(fused=True)
    fused = [o for o in ops if o.name == "aten._fused_adamw_"]
    assert len(fused) == 1 and fused[0].kind == "memory"
    steps = 2 * 4  # two parameters' fp32 `step` counts, on the device when fused (torch/optim/adam.py)
    # read: parameter, gradient, two averages (16 B); written: parameter and two averages (12 B)
    assert fused[0].bytes == 28 * n + steps
    assert len(fused[0].writes) == 3 * 2 + 0  # no gradient written: it is given no grad_scale
    assert [o.name for o in ops] == ["aten._foreach_add_", "aten._fused_adamw_"]  # the step count, then the update


def test_a_fused_step_that_unscales_writes_its_gradients_back():
    ops, n = _optimizer_ops(fused=True, grad_scale=torch.tensor(2.0))
    (fused,) = [o for o in ops if o.name == "aten._fused_adamw_"]
    assert fused.bytes == 32 * n + 2 * 4 + 4 + 4  # its gradients written too; the scale and the found_inf flag read
    assert len(fused.writes) == 4 * 2


def test_the_fused_step_moves_a_third_of_the_foreach_steps_bytes():
    fused, n = _optimizer_ops(fused=True)
    foreach, _ = _optimizer_ops(fused=False)
    assert len(foreach) == 9 and len(fused) == 2
    moved = {name: sum(o.bytes for o in ops) for name, ops in (("fused", fused), ("foreach", foreach))}
    # foreach: nine passes, each reading and writing whole lists (a square root into a temporary among them)
    assert 75 * n < moved["foreach"] < 85 * n and moved["fused"] < 29 * n


def _project(optimizer: str) -> dict:
    from cpbench.harness.project.hardware import load
    from cpbench.harness.project.projection import project_rank
    from cpbench.harness.suite.spec import load_suite

    text = ('name = "t"\nmodel = "tiny-llama"\nseq_lens = [16]\ncp_sizes = [1]\nworld_size = 1\ndtype = "bfloat16"\n'
            f'device = "cuda"\nwarmup_steps = 1\nmeasured_steps = 1\noptimizer = "{optimizer}"\n')
    return project_rank(load_suite("t.toml", text=text).points()[0], 0, hardware=load("a100-sxm"))


def test_a_projection_prices_the_fused_step_faster_and_holds_no_foreach_temporaries():
    foreach, fused = _project("foreach"), _project("fused")
    assert fused["status"] == foreach["status"] == "ok"
    assert fused["time"]["optimizer_s"] < foreach["time"]["optimizer_s"]
    assert fused["time"]["step_s"] < foreach["time"]["step_s"]
    # 16 tokens: the step's peak falls in the optimizer step, where foreach holds a parameter-sized list of square
    # roots (`_foreach_sqrt` of the second averages) beside the state; the fused kernel holds nothing more
    assert foreach["peak_bytes"] - fused["peak_bytes"] >= 0.95 * fused["params_bytes"]
