"""The host ledger of the offload levers (cpbench/harness/measure/host.py), on hand-computed cases: a stack of
checkpointed layers whose saved inputs are packed by the ledger's `save_on_cpu`, tracked (the CPU probe's
MemTracker: the packed copies count as host memory, the device peak drops by them) and counted (the CUDA probe's
way: bytes and live host memory from the hooks alone); and the rows' host columns and capacity verdicts."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from cpbench.harness.measure.host import HOST, HostLedger
from cpbench.harness.measure.probes import CpuMemoryProbe
from cpbench.harness.run import rows

N, D, LAYERS = 64, 32, 4
X_BYTES = N * D * 4  # one checkpointed layer's saved input, fp32


class Stack(torch.nn.Module):
    def __init__(self, offload_with=None):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(D, D) for _ in range(LAYERS))
        self.offload_with = offload_with

    def forward(self, x):
        for layer in self.layers:
            fn = lambda t, layer=layer: torch.relu(layer(t)) * 2  # noqa: E731 - one checkpointed layer
            if self.offload_with is not None:
                with self.offload_with(pin_memory=True):
                    x = checkpoint(fn, x, use_reentrant=False)
            else:
                x = checkpoint(fn, x, use_reentrant=False)
        return x.sum()


def _tracked_step(offload: bool) -> tuple[dict, HostLedger]:
    model = Stack()
    probe = CpuMemoryProbe(model, None, None)
    if offload:
        model.offload_with = probe.host.save_on_cpu
    x = torch.randn(N, D, requires_grad=True)
    probe.tracker.track_external(x)
    with probe.segment():
        model(x).backward()
    return probe.result(), probe.host


def test_tracked_offload_moves_every_checkpoint_to_the_host():
    plain, _ = _tracked_step(offload=False)
    moved, ledger = _tracked_step(offload=True)
    # Each layer's checkpoint is its input (the first layer's is x itself, held by the caller anyway): the
    # ledger packs a copy of each, so LAYERS inputs live on the host at the end of forward.
    assert moved["host_peak_bytes"] == LAYERS * X_BYTES
    assert moved["host_activations_bytes"] == LAYERS * X_BYTES
    assert moved["d2h_bytes"] == LAYERS * X_BYTES and moved["h2d_bytes"] == LAYERS * X_BYTES
    # On the device, the inputs of layers 2..LAYERS no longer wait for backward: LAYERS - 1 of them fewer at the
    # end of forward, less what backward's unpacked copies and gradients hold at its own peak.
    assert moved["peak_bytes"] < plain["peak_bytes"]
    assert plain["host_peak_bytes"] == 0 and plain["d2h_bytes"] == 0
    assert HOST not in ledger.tracker.get_tracker_snapshot("current")  # every packed copy freed after backward


def test_counted_offload_holds_and_frees_its_host_copies():
    ledger = HostLedger()  # the CUDA probe's way: no tracker
    model = Stack(ledger.save_on_cpu)
    x = torch.randn(N, D, requires_grad=True)
    loss = model(x)
    assert ledger.live == LAYERS * X_BYTES and ledger.d2h_bytes == LAYERS * X_BYTES
    loss.backward()
    del loss
    assert ledger.h2d_bytes == LAYERS * X_BYTES
    assert ledger.live == 0  # the graph freed its saved tensors
    cols = ledger.columns(None)
    assert cols["host_peak_bytes"] == LAYERS * X_BYTES and cols["host_activations_bytes"] == LAYERS * X_BYTES


def test_counted_and_tracked_offload_give_the_same_gradients():
    x = torch.randn(N, D, requires_grad=True)
    grads = []
    for offload_with in (None, HostLedger().save_on_cpu):
        model = Stack(offload_with)
        model(x).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same values move, bit for bit


def test_a_host_phase_counts_only_new_storages_as_host():
    probe = CpuMemoryProbe(torch.nn.Linear(2, 2), None, None)
    a = torch.randn(1024)
    probe.tracker.track_external(a)
    with probe.segment():
        with probe.tracker.host_phase():
            view = a[:512]  # a view allocates nothing: `a` stays on the device
            b = a * 2  # a new storage: on the host
        peaks = probe.tracker.get_tracker_snapshot("current")
    assert peaks[HOST]["Total"] == b.numel() * 4
    assert view.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()


def _records(host_peaks: list[int]) -> list[dict]:
    parts = {k: 0 for k in rows.HOST_PARTS}
    return [{"host_peak_bytes": h, "d2h_bytes": 10 * i, "h2d_bytes": 20 * i, **parts,
             "host_optimizer_bytes": h} for i, h in enumerate(host_peaks)]


def test_host_columns_sum_a_nodes_ranks():
    cols = rows._host_columns(_records([1, 2, 3, 4, 5, 6]), per_node=4)
    assert cols["host_peak_bytes"] == 6
    assert cols["host_node_peak_bytes"] == max(1 + 2 + 3 + 4, 5 + 6)
    assert cols["host_optimizer_bytes"] == 6  # the breakdown of the rank with the highest host peak
    assert cols["d2h_bytes"] == 50 and cols["h2d_bytes"] == 100  # max over ranks
    assert rows._host_columns([{"host_peak_bytes": None}], per_node=8) == {}  # a record without host accounting


@pytest.mark.parametrize("peak, node, budget, host_budget, sides", [
    (10, 5, 20, 20, []), (30, 5, 20, 20, ["device"]), (10, 25, 20, 20, ["host"]), (30, 25, 20, 20, ["device", "host"]),
    (30, 25, None, None, []),
])
def test_over_capacity_names_the_side(peak, node, budget, host_budget, sides):
    why = rows.over_capacity({"peak_bytes": peak, "host_node_peak_bytes": node}, budget, host_budget)
    assert (why is None) == (not sides)
    for side in ("device", "host"):
        assert (f"{side}:" in (why or "")) == (side in sides)


def test_counted_and_tracked_ledgers_move_the_same_bytes_under_fsdp_offload():
    """Parameter and activation offload under FSDP2 (cp 2, a fake process group, real CPU tensors): the CUDA probe's
    counted ledger and the CPU probe's tracked one count the same bytes up and down per step, and the counted one's
    host peak holds at least the sharded parameters and the optimizer state."""
    from cpbench.harness.measure import step
    from cpbench.harness.project.projection import _mesh, fake_world
    from cpbench.harness.suite.spec import load_suite

    (point,) = load_suite("t.toml", text='model = "tiny-qwen3"\nseq_lens = [64]\ncp_sizes = [2]\nwarmup_steps = 1\n'
                          'activation_checkpointing = true\noffload_activations = true\noffload_params = true\n'
                          'parity = "off"\n').points()
    moved = {}
    for mode in ("counted", "tracked"):
        with fake_world(2, 0):
            model = step.distribute(step.build_model(point, "cpu"), point, mesh=_mesh(point))
            batch = step.make_batch(point, model.config.vocab_size, "cpu")
            optimizer = step.make_optimizer(model, point)
            step.train_step(model, optimizer, batch)  # step 0: the optimizer state
            probe = CpuMemoryProbe(model, optimizer, None)
            ledger = HostLedger() if mode == "counted" else probe.host
            with ledger.levers(point, model, optimizer), probe.segment():
                step.train_step(model, optimizer, batch)
            moved[mode] = (ledger.d2h_bytes, ledger.h2d_bytes)
            if mode == "counted":
                local = [getattr(t, "_local_tensor", t) for t in (*model.parameters(),
                                                                   *(t for s in optimizer.state.values() for t in s.values()))]
                at_rest = sum(t.numel() * t.element_size() for t in local)  # this rank's shards and AdamW state
                assert ledger.peak >= at_rest and ledger.peak_by_kind["grads"] > 0
    assert moved["counted"] == moved["tracked"] and min(moved["counted"]) > 0
