"""A projection's optimizer steps on the parameters' local shards (projection.steps_on_local_shards) give the record
the DTensor steps give: every memory column byte for byte, the collectives, and the priced time and op trace, for the
optimizers and levers that change the step (foreach and fused AdamW, gradient clipping, parameter offload) under
FSDP2 over fsdp x cp."""

from __future__ import annotations

import pytest

from cpbench.harness.project import projection

def _record(extra: str, monkeypatch, on_shards: bool) -> dict:
    from cpbench.harness.project.hardware import load
    from cpbench.harness.suite.spec import load_suite

    if not on_shards:
        monkeypatch.setattr(projection, "steps_on_local_shards", lambda optimizer: [])
    text = ('name = "t"\nmodel = "tiny-llama"\nseq_lens = [32]\ncp_sizes = [2]\nworld_size = 4\n'
            'dtype = "bfloat16"\ndevice = "cuda"\nwarmup_steps = 1\nmeasured_steps = 1\n' + extra)
    point = load_suite("t.toml", text=text).points()[0]
    record = projection.project_rank(point, 0, hardware=load("h100-sxm"), keep_trace=True)
    monkeypatch.undo()
    return record


@pytest.mark.parametrize("extra", [
    'cp_styles = ["cp_ulysses"]\n',
    'cp_styles = ["cp_ring_zigzag"]\nmax_grad_norm = 1.0\n',
    'cp_styles = ["cp_ring_zigzag"]\noptimizer = "fused"\n',
    'cp_styles = ["cp_ulysses"]\noffload_params = true\n',
], ids=["foreach", "clipped", "fused", "offload-params"])
def test_steps_on_local_shards_change_nothing_a_row_records(extra, monkeypatch):
    fast, full = _record(extra, monkeypatch, True), _record(extra, monkeypatch, False)
    assert fast["status"] == full["status"] == "ok"
    same = {k: v for k, v in full.items() if k not in ("run_s", "time", "trace")}
    assert {k: fast[k] for k in same} == same
    # the ops in order with what they do (their buffer keys are storage ids, another run's)
    assert [o._replace(reads=(), writes=()) for o in fast["trace"]] == \
        [o._replace(reads=(), writes=()) for o in full["trace"]]
    assert fast["time"] == full["time"]


def test_the_state_stays_keyed_by_the_parameters_between_steps():
    import torch

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
    handles = projection.steps_on_local_shards(optimizer)
    try:
        for _ in range(2):
            model(torch.ones(2, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    finally:
        for h in handles:
            h.remove()
    params = list(model.parameters())
    assert list(optimizer.param_groups[0]["params"]) == params
    assert set(optimizer.state) == set(params) and all(optimizer.state[p]["step"] == 2 for p in params)
