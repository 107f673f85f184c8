"""The trace's streams and marks (trace.py): FSDP2's copy-in for its all-gathers, the layers recompute checkpoints
and replays, and the buffers an op waits for."""

from __future__ import annotations

import warnings

import pytest
import torch

from cpbench.harness.project.trace import StepTrace


def test_fsdp2_casts_each_shard_for_its_all_gather_on_the_copy_in_stream():
    # FSDP2 casts the fp32 shards to bf16 (a _foreach_copy_) under its all-gather copy-in stream, so the next layer's
    # all-gather is prepared while this one computes; priced on the compute stream, it waited for the whole layer.
    from cpbench.harness.project.projection import project_rank
    from cpbench.harness.suite.spec import load_suite

    text = ('name = "t"\nmodel = "tiny-llama"\nseq_lens = [64]\ncp_sizes = [1]\nworld_size = 2\ndtype = "bfloat16"\n'
            'device = "cuda"\nmixed_precision = true\nwarmup_steps = 1\nmeasured_steps = 1\n')
    ops = project_rank(load_suite("t.toml", text=text).points()[0], 0, keep_trace=True)["trace"]
    copy_ins = [i for i, o in enumerate(ops) if o.name == "fsdp.all_gather_copy_in"]
    assert copy_ins
    for i in copy_ins:  # the cast just before each copy-in, into the buffer the copy-in reads
        cast = ops[i - 1]
        assert cast.name == "aten._foreach_copy_" and cast.stream == "ag" and set(cast.writes) & set(ops[i].reads)
    # nothing else leaves the compute stream: the copy-in's output buffer may reuse a freed tensor's storage
    assert {o.name for o in ops if o.stream == "ag" and o.kind == "memory"} == {"aten._foreach_copy_",
                                                                              "fsdp.all_gather_copy_in"}


def test_fsdp2s_all_gather_copy_in_moves_its_inputs_into_its_slice_whatever_the_world():
    # all_gather_copy_in copies the shards into this rank's slice of the buffer it is handed (FSDP2's
    # all_gather_copy_in_cuda: one _foreach_copy_): it read the whole buffer and wrote it and the slice, (world + 2)
    # times its work
    from cpbench.harness.project.projection import project_rank
    from cpbench.harness.suite.spec import load_suite

    for world in (2, 8):
        text = (f'name = "t"\nmodel = "tiny-llama"\nseq_lens = [64]\ncp_sizes = [1]\nworld_size = {world}\n'
                'dtype = "bfloat16"\ndevice = "cuda"\nwarmup_steps = 1\nmeasured_steps = 1\n')
        ops = project_rank(load_suite("t.toml", text=text).points()[0], 0, keep_trace=True)["trace"]
        pairs = [(o, next(g for g in ops[i + 1:] if g.kind == "all_gather"))
                 for i, o in enumerate(ops) if o.name == "fsdp.all_gather_copy_in"]
        assert pairs
        for copy_in, gather in pairs:  # the all-gather sends this rank's shard: what the copy-in copied
            assert copy_in.bytes == 2 * gather.bytes > 0


def _projected_trace(extra: str) -> list:
    from cpbench.harness.project.projection import project_rank
    from cpbench.harness.suite.spec import load_suite

    text = ('name = "t"\nmodel = "tiny-llama"\nseq_lens = [64]\ncp_sizes = [1]\nworld_size = 1\ndtype = "bfloat16"\n'
            'device = "cuda"\nwarmup_steps = 1\nmeasured_steps = 1\nmodel_overrides = {num_hidden_layers = 4}\n'
            + extra)
    return project_rank(load_suite("t.toml", text=text).points()[0], 0, keep_trace=True)["trace"]


def test_each_layer_that_recompute_checkpoints_is_marked_at_its_forward_and_at_its_replay():
    # the host's work around a checkpointed layer (torch.utils.checkpoint's frames and hooks) is priced once per
    # recomputed layer at its forward and once where backward replays it: the base model, which transformers flags
    # too, checkpoints nothing
    def marks(extra):
        ops = _projected_trace(extra)
        at = {kind: [i for i, o in enumerate(ops) if o.kind == kind] for kind in ("checkpoint", "replay")}
        loss = next(i for i, o in enumerate(ops) if o.name == "aten.nll_loss_forward")  # the forward's end
        return ops, at, loss

    recompute = "activation_checkpointing = true\n"
    (plain, none, _), (every, at, loss), (_, half, _) = (
        marks(""), marks(recompute), marks(recompute + "recompute_every_n_layers = 2\n"))
    assert none == {"checkpoint": [], "replay": []}
    assert (len(at["checkpoint"]), len(at["replay"]), len(half["checkpoint"]), len(half["replay"])) == (4, 4, 2, 2)
    assert max(at["checkpoint"]) < loss < min(at["replay"])  # the forward's marks, then the replays in backward
    marked = [every[i] for i in at["checkpoint"] + at["replay"]]
    assert {o.name for o in marked} == {"LlamaDecoderLayer"} and all(o.bytes == o.flops == 0 for o in marked)
    # each layer's replay is marked as backward reaches it: before its replayed attention, which comes before that
    # layer's attention backward, which comes before the next layer's replay
    attention = [(i, o.kind.endswith("_backward")) for i, o in enumerate(every) if o.kind.startswith("attention")]
    again = [i for i, back in attention if i > loss and not back]
    back = [i for i, is_back in attention if is_back]
    assert len(again) == len(back) == 4
    assert all(r < a < b for r, a, b in zip(at["replay"], again, back))
    assert all(b < r for b, r in zip(back, at["replay"][1:]))
    assert sum(o.kind == "memory" for o in every) > sum(o.kind == "memory" for o in plain)  # replayed ops priced


def test_a_put_a_checkpointed_forward_replays_in_backward_is_priced_as_its_forward():
    # an out-of-place put in a model's forward (JetMoE's zeros.index_add) is a clone and a put; replayed in backward
    # by a checkpoint it is the same op, not one of autograd's backward formulas put in place into fresh zeros
    from torch.utils.checkpoint import checkpoint

    x, ids = torch.ones(3, 8, requires_grad=True), torch.tensor([3, 5, 7])

    def layer(t):
        z = torch.zeros(1000, 8).index_add(0, ids, t)
        return (z * z).sum()  # the product saves z: the replay recomputes the put

    with StepTrace() as trace:
        checkpoint(layer, x, use_reentrant=False).backward()
    puts = [o for o in trace.ops if o.name == "aten.index_add"]
    assert len(puts) == 2 and puts[1].backward and puts[0].bytes == puts[1].bytes
    assert puts[0].bytes == 2 * 1000 * 8 * 4 + 3 * 8 * 4 + 3 * 8  # the zeros read, the result written: the clone


def test_a_checkpointed_layer_whose_replay_is_not_seen_is_said():
    from cpbench.harness.project.trace import Op

    def closed(kinds):
        trace = StepTrace()
        trace.ops = [Op("compute", kind, "step", 0.0, 0.0, (), ()) for kind in kinds]
        trace.close()

    with pytest.warns(UserWarning, match="2 checkpointed layer calls, 1 replays seen"):
        closed(["checkpoint", "checkpoint", "attention_backward", "replay"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        closed(["checkpoint", "replay", "attention_backward"])  # each replayed: nothing said
        closed(["checkpoint", "attention_forward"])  # no backward traced: nothing to replay


def _dependencies(ops) -> list[tuple]:
    """For each op, the indices of the ops that last wrote what it reads (-1: written before the step)."""
    last, out = {}, []
    for i, o in enumerate(ops):
        out.append(tuple(sorted(last.get(k, -1) for k in o.reads)))
        last.update(dict.fromkeys(o.writes, i))
    return out


def test_a_buffer_allocated_where_a_freed_one_was_does_not_wait_for_its_writer():
    # a storage's address is reused once it is freed: the new buffer (torch.empty, or any op's fresh output) is a new
    # generation, so what reads it never waits for the freed buffer's last writer
    trace, x = StepTrace(), torch.ones(4)
    with trace:
        y = x * 2
    written = trace._key(y)
    assert trace.ops[-1].writes == (written,)
    trace._allocated((), {}, y)  # as when the allocator hands y's storage to a new tensor
    assert trace._key(y) != written
    with trace:
        y.add_(1)  # reads the new generation: no writer of it in the trace
    assert _dependencies(trace.ops)[-1] == (-1,)
    with trace:
        y.view(2, 2).add_(1)  # a view shares its storage: the same generation, the write before it
    assert _dependencies(trace.ops)[-1] == (1,)


def test_the_same_step_traced_twice_has_the_same_dependencies():
    # the schedule must not depend on which addresses earlier projections in the process left free
    first, again = (_dependencies(_projected_trace("activation_checkpointing = true\n")) for _ in range(2))
    assert first == again
