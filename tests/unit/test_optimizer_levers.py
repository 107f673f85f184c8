"""The optimizer step's levers as a step runs them and a projection sees them (trace.py, work.py). The fused AdamW
(`optimizer = "fused"`): one kernel over every parameter that moves each one's four fp32 values in and three out, its
gradients written only when it unscales them (ATen's FusedAdamMathFunctor), against the nine multi-tensor kernels and
the temporaries of torch's foreach AdamW. Gradient clipping (`max_grad_norm`): clip_grad_norm_ before each step,
inside the step's share of the trace."""

from __future__ import annotations

import pytest
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
    hooks = trace.optimizer_hooks(optimizer)  # torch's global hooks: removed whatever happens
    try:
        with trace:
            optimizer.step()
    finally:
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


def _project(optimizer: str, extra: str = "", world: int = 1, keep_trace: bool = False) -> dict:
    from cpbench.harness.project.hardware import load
    from cpbench.harness.project.projection import project_rank
    from cpbench.harness.suite.spec import load_suite

    text = (f'name = "t"\nmodel = "tiny-llama"\nseq_lens = [16]\ncp_sizes = [1]\nworld_size = {world}\n'
            f'dtype = "bfloat16"\ndevice = "cuda"\nwarmup_steps = 1\nmeasured_steps = 1\noptimizer = "{optimizer}"\n'
            + extra)
    return project_rank(load_suite("t.toml", text=text).points()[0], 0, hardware=load("a100-sxm"),
                        keep_trace=keep_trace)


def test_a_projection_prices_the_fused_step_faster_and_holds_no_foreach_temporaries():
    foreach, fused = _project("foreach"), _project("fused")
    assert fused["status"] == foreach["status"] == "ok"
    assert fused["time"]["optimizer_s"] < foreach["time"]["optimizer_s"]
    assert fused["time"]["step_s"] < foreach["time"]["step_s"]
    # 16 tokens: the step's peak falls in the optimizer step, where foreach holds a parameter-sized list of square
    # roots (`_foreach_sqrt` of the second averages) beside the state; the fused kernel holds nothing more
    assert foreach["peak_bytes"] - fused["peak_bytes"] >= 0.95 * fused["params_bytes"]


def test_a_clipped_step_clips_before_the_optimizer_steps():
    from cpbench.harness.suite.spec import load_suite
    from cpbench.harness.measure.step import make_optimizer

    point = load_suite("t.toml", text='model = "tiny-llama"\nseq_lens = [16]\ncp_sizes = [1]\nmax_grad_norm = 0.5\n'
                       ).points()[0]
    model = torch.nn.Linear(8, 8)
    optimizer = make_optimizer(model, point)
    (model(torch.ones(4, 8)) * 100).sum().backward()
    assert torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()])) > 1
    optimizer.step()
    clipped = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert clipped == pytest.approx(0.5, rel=1e-4)  # clip_grad_norm_'s 1e-6 in the coefficient's denominator
    beta1 = optimizer.defaults["betas"][0]
    for p in model.parameters():  # the step took the clipped gradients: its first average is (1 - beta1) of them
        torch.testing.assert_close(optimizer.state[p]["exp_avg"], (1 - beta1) * p.grad)


def test_the_estimate_flags_reach_the_points_and_bad_norms_are_refused_naming_the_flag(capsys):
    from cpbench.cli import build_parser
    from cpbench.harness.estimate_cli import _quick_suite

    parser = build_parser()
    base = ["estimate", "--model", "tiny-llama", "--seq", "256", "--cp", "1"]
    (point,) = _quick_suite(parser.parse_args([*base, "--optimizer", "fused", "--max-grad-norm", "1"])).points()
    assert (point.optimizer, point.max_grad_norm) == ("fused", 1.0)
    (plain,) = _quick_suite(parser.parse_args(base)).points()
    assert (plain.optimizer, plain.max_grad_norm) == ("foreach", 0.0)
    for bad in ("-1", "inf", "nan", "x"):
        with pytest.raises(SystemExit):
            parser.parse_args([*base, "--max-grad-norm", bad])
        assert f"argument --max-grad-norm: {bad!r}: give a finite number >= 0" in capsys.readouterr().err


def test_a_projection_prices_the_clipping_in_the_optimizer_step():
    plain = _project("foreach", world=2, extra="mixed_precision = true\n", keep_trace=True)
    clipped = _project("foreach", world=2, extra="mixed_precision = true\nmax_grad_norm = 1.0\n", keep_trace=True)
    added = [o for o in clipped["trace"] if o.phase == "optimizer"][: -len([o for o in plain["trace"]
                                                                             if o.phase == "optimizer"])]
    names = [o.name or o.kind for o in added]
    # the gradients' norms (each read once), their sum over the ranks' shards, the coefficient, the gradients scaled
    assert names[0] == "aten._foreach_norm" and "all_reduce" in names and names[-1] == "aten._foreach_mul_"
    grads = clipped["optimizer_bytes"] / 2  # the rank's fp32 gradient shards: the size of each of AdamW's averages
    assert added[0].bytes == pytest.approx(grads, rel=0.01) and added[-1].bytes == pytest.approx(2 * grads, rel=0.01)
    assert clipped["time"]["optimizer_s"] > plain["time"]["optimizer_s"]


def test_a_gpu_sweep_that_clips_offloaded_gradients_gives_the_host_a_backend():
    from cpbench.harness.run.worker import backend_for
    from cpbench.harness.suite.spec import load_suite

    def points(extra: str):
        return load_suite("t.toml", text='model = "tiny-llama"\nseq_lens = [64]\ncp_sizes = [1]\nworld_size = 2\n'
                          'device = "cuda"\n' + extra).points()

    assert backend_for("cpu", points("offload_params = true\nmax_grad_norm = 1.0\n")) == "gloo"
    assert backend_for("cuda", points("offload_params = true\n")) == "nccl"
    assert backend_for("cuda", points("max_grad_norm = 1.0\n")) == "nccl"
    # clip_grad_norm_ all-reduces the norm of the host's gradients: NCCL takes CUDA tensors only
    assert backend_for("cuda", points("offload_params = true\nmax_grad_norm = 1.0\n")) == "cuda:nccl,cpu:gloo"


def test_with_the_parameters_offloaded_the_clip_runs_in_the_host_phase():
    # the host's phase (host.py) opens at torch's global pre-hook, before make_optimizer's clip: the gradients' norms
    # and their scaling are host work, priced at host memory, not kernels (a clip outside the phase would be kernels)
    r = _project("foreach", world=2, keep_trace=True,
                 extra="mixed_precision = true\noffload_params = true\nmax_grad_norm = 1.0\n")
    clip = [o for o in r["trace"] if o.name in ("aten.linalg_vector_norm", "aten._foreach_norm", "aten.mul_",
                                               "aten._foreach_mul_") and o.phase == "optimizer"]
    assert len(clip) > 20 and all(o.stream == "host" for o in clip)
    assert not any(o.phase == "step" and o.name == "aten.linalg_vector_norm" for o in r["trace"])
