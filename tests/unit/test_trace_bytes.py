"""The bytes an op of the trace moves (work.py, trace.py): each tensor it reads and writes once, in place or not, the
rows a gather, scatter, softmax or loss really touches, and what the host reads without syncing the device."""

from __future__ import annotations

import pytest
import torch

from cpbench.harness.project import flops as kernel_flops
from cpbench.harness.project import work
from cpbench.harness.project.trace import StepTrace


def _bytes_of(fn) -> float:
    with StepTrace() as trace:
        fn()
    return sum(o.bytes for o in trace.ops)


def test_an_op_moves_what_it_reads_and_writes_each_tensor_once():
    a, b = torch.ones(1000), torch.ones(1000)  # 4000 bytes each
    assert _bytes_of(lambda: a.copy_(b)) == 8000  # reads b, writes a: a is not read
    assert _bytes_of(lambda: a.fill_(2.0)) == 4000
    assert _bytes_of(lambda: a.add_(b)) == 12000  # reads a and b, writes a
    assert _bytes_of(lambda: torch.add(a, b, out=torch.empty(1000))) == 12000  # `out=` is written, not read
    rows, row = torch.ones(64, 1000), torch.ones(1, 1000)
    # an expanded input is read at its stored size: 4000 bytes, not 64 x 4000
    assert _bytes_of(lambda: rows + row.expand(64, 1000)) == 64 * 4000 * 2 + 4000
    # a factory reads nothing of the tensor it takes its dtype, device or shape from: its output only
    assert _bytes_of(lambda: rows.new_zeros(())) == 4
    assert _bytes_of(lambda: rows.new_zeros(rows.shape)) == _bytes_of(lambda: torch.zeros_like(rows)) == 64 * 4000
    assert _bytes_of(lambda: torch.full_like(a, 3.0)) == _bytes_of(lambda: torch.randn_like(a)) == 4000


def test_what_an_op_writes_in_place_is_written_even_when_it_returns_nothing():
    # In-place foreach ops (AdamW's whole step) and `out=` lists return nothing: their schema says what they write.
    a, b = torch.ones(1000), torch.ones(1000)  # 4000 bytes each
    assert _bytes_of(lambda: torch._foreach_mul_([a, b], 2.0)) == 16000  # reads and writes both
    assert _bytes_of(lambda: torch._foreach_lerp_([a], [b], 0.1)) == 12000  # reads a and b, writes a
    assert _bytes_of(lambda: torch._foreach_addcdiv_([a], [b], [b], 0.1)) == 12000  # b once
    assert _bytes_of(lambda: torch._foreach_copy_([a], [b])) == 8000  # a is overwritten, not read
    whole = torch.ones(2000)
    assert _bytes_of(lambda: torch.split_with_sizes_copy(whole, [1000, 1000], out=[a, b])) == 16000
    with StepTrace() as trace:
        torch._foreach_add_([a], 1.0)
    assert trace.ops[0].writes == trace.ops[0].reads  # what reads `a` next waits for this op


def test_a_gather_reads_the_rows_it_picks_not_its_whole_table():
    table, ids = torch.ones(1000, 8), torch.tensor([3, 3, 7])  # 32,000 bytes of table, 3 rows of 32 picked
    rows = 3 * 8 * 4
    assert _bytes_of(lambda: torch.nn.functional.embedding(ids, table)) == rows + ids.numel() * 8 + rows
    assert _bytes_of(lambda: table.index_select(0, ids)) == rows + ids.numel() * 8 + rows
    small, again = torch.ones(2, 8), ids.clamp(max=1)  # picking more rows than its source has reads it once
    assert _bytes_of(lambda: small.index_select(0, again)) == 2 * 8 * 4 + 24 + rows


def test_a_host_scalar_read_in_the_optimizer_step_is_not_a_device_sync():
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
    model(torch.ones(2, 4)).sum().backward()
    trace = StepTrace()
    hooks = trace.optimizer_hooks(optimizer)  # torch's global hooks: removed whatever happens
    try:
        with trace:
            optimizer.step()  # reads each parameter's `step` count, a 0-dim host tensor on CUDA too
            torch.ones(3).sum().item()  # a real read-back of a device value
    finally:
        for h in hooks:
            h.remove()
    syncs = [o for o in trace.ops if o.kind == "sync"]
    assert len(syncs) == 1 and syncs[0].phase == "step"
    assert any(o.phase == "optimizer" and o.tensors > 1 for o in trace.ops)  # foreach ops take lists


def test_a_varlen_calls_known_offsets_are_read_without_an_op_per_document():
    # In a projection the offsets are fake tensors carrying their values; a fake tensor's own tolist() dispatches an
    # op per element (hundreds of documents, in every tile's call: a third of a packed projection's time).
    from torch.utils._python_dispatch import TorchDispatchMode

    from cpbench.harness.project.projection import fake_tensors

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    lengths = [3, 1, 4, 1, 5, 9, 2, 6]
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    with fake_tensors():
        cu = torch.tensor(offsets + offsets, dtype=torch.int32)  # as segments._Packed builds them: one tensor, sliced
        cu_q, cu_k = cu[: len(offsets)], cu[len(offsets):]
        t = torch.empty(offsets[-1], 2, 8)  # [tokens, heads, dim]
        args = (t, t, t, cu_q, cu_k, 9, 9, 0.0, 1.0, True)  # flash-attn's varlen forward: causal is argument 9
        with Count():
            flops, _ = kernel_flops.attention("flash_attn._flash_attn_varlen_forward", args)
    assert flops == 4 * sum(n * (n + 1) // 2 for n in lengths) * 2 * 8  # each document causal on its own
    assert Count.n == 0


def test_advanced_indexing_and_scatters_touch_the_rows_they_pick_or_put():
    # `x[ids]` (aten.index) is a gather; `x[ids] = v` and index_add_ write (and accumulate: read) only the rows they
    # put, not their whole target: 3 rows of a 1,000-row table
    table, ids, rows = torch.ones(1000, 8), torch.tensor([3, 5, 7]), torch.ones(3, 8)
    row_bytes = 3 * 8 * 4
    assert _bytes_of(lambda: table[ids]) == row_bytes + ids.numel() * 8 + row_bytes

    def put():
        table[ids] = rows
    assert _bytes_of(put) == row_bytes + ids.numel() * 8 + row_bytes  # values and indices read, the rows written
    assert _bytes_of(lambda: table.index_put_((ids,), rows, accumulate=True)) == 2 * row_bytes + 24 + row_bytes
    assert _bytes_of(lambda: table.index_add_(0, ids, rows)) == 2 * row_bytes + 24 + row_bytes
    assert _bytes_of(lambda: table.scatter_add_(0, ids.view(3, 1).expand(3, 8), rows)) == \
        2 * row_bytes + 3 * 8 + row_bytes  # an expanded index: one element per row wide in memory, 3 x 8 put
    small, low = torch.ones(2, 8), ids.clamp(max=1)  # putting more than the target holds writes it once
    assert _bytes_of(lambda: small.index_add_(0, low, rows)) == 2 * 2 * 8 * 4 + 24 + row_bytes


def test_the_cuda_softmax_reads_rows_that_fit_no_on_chip_copy_as_its_kernels_do():
    # ATen/native/cuda/SoftMax.cu: a vocabulary-wide fp32 row (128,256) fits neither registers nor the 48 KiB of a
    # block's shared memory, so cunn_SoftMaxForward reads it three times (max, sum, output) and cunn_SoftMaxBackward
    # its gradient twice; a 10,240-wide row fits shared memory (read once), a 4,096-wide one registers
    def traced(width, fn):
        x = torch.zeros(2, width, requires_grad=True)
        with StepTrace() as trace:
            y = fn(x)
            y.backward(torch.ones_like(y))  # a whole gradient, as the loss's backward hands it (not sum's expanded one)
        return {o.name: o.bytes for o in trace.ops}, 2 * width * 4

    for width, forward_reads, backward_reads in ((128256, 3, 2), (12288, 3, 2), (10240, 1, 1), (4096, 1, 1)):
        ops, row = traced(width, lambda x: torch.log_softmax(x, -1))
        assert ops["aten._log_softmax"] == (forward_reads + 1) * row, width  # and the output written once
        assert ops["aten._log_softmax_backward_data"] == (backward_reads + 2) * row, width  # the output read, dx
    # softmax's backward multiplies the gradient by the output in a kernel of its own first, then reads the product
    ops, row = traced(128256, lambda x: torch.softmax(x, -1))
    assert ops["aten._softmax_backward_data"] == (3 + 2 + 2) * row
    ops, row = traced(4096, lambda x: torch.softmax(x, -1))
    assert ops["aten._softmax_backward_data"] == (3 + 3) * row
    # where each kernel takes over: 9,215 fp32 fit registers (9 a thread of 1,024) but not shared memory (not a
    # multiple of 4, float4 loads); 10,242 fits shared memory's size but not its float4 loads; 2,049 and 1,026 pass
    # the warp-per-row kernels' 2,048 forward and 1,024 backward
    rereads = work.softmax_rereads
    for width, forward_reads, backward_reads in ((9215, 1, 2), (10242, 3, 2), (2049, 1, 2), (1024, 1, 1),
                                                 (1026, 1, 2)):
        x = torch.zeros(2, width)
        assert rereads("aten._log_softmax", (x, -1, False)) == (forward_reads - 1) * x.nbytes, width
        assert rereads("aten._log_softmax_backward_data", (x, x, -1, x.dtype)) == (backward_reads - 1) * x.nbytes
    # half to float (CUDA's log_softmax of a half input, fp32 out): no register kernel, the 1,024 warp bound
    half = torch.zeros(2, 1032, dtype=torch.float16)
    assert rereads("aten._log_softmax", (half, -1, True)) == 0  # shared memory: 1,032 is a multiple of 8
    assert rereads("aten._log_softmax", (half[:, :1030].contiguous(), -1, True)) == 2 * 2 * 1030 * 2
    assert rereads("aten._log_softmax", (half[:, :1024].contiguous(), -1, True)) == 0  # a warp per row
    # a softmax over an inner dim runs the spatial kernels, the same passes over strided rows; an empty one nothing
    x = torch.zeros(4, 200, 3)
    assert rereads("aten._softmax", (x, 1, False)) == 2 * x.nbytes
    assert rereads("aten._softmax_backward_data", (x, x, 1, x.dtype)) == (3 + 1) * x.nbytes
    assert rereads("aten._softmax", (torch.zeros(0, 20000), 1, False)) == 0


def test_the_nll_loss_touches_one_log_probability_a_row_and_zeroes_its_whole_gradient():
    # ATen/native/cuda/Loss.cu: the forward reads each row's target element, not the 128,256 beside it; the backward
    # zeroes grad_input whole, then writes each row's element; neither reads the log-probabilities' other elements
    rows, vocab = 16, 128256
    x, target = torch.zeros(rows, vocab, requires_grad=True), torch.randint(0, vocab, (rows,))
    with StepTrace() as trace:
        torch.nn.functional.cross_entropy(x, target).backward()
    ops = {o.name: o.bytes for o in trace.ops}
    picked, indices = rows * 4, rows * 8
    assert ops["aten.nll_loss_forward"] == indices + picked + 4 + 4  # the loss and its total weight written
    assert ops["aten.nll_loss_backward"] == 4 + indices + 4 + picked + rows * vocab * 4  # the zeroed gradient


def test_a_scatter_counts_the_elements_it_puts_whatever_its_values_or_mask_hold():
    table, ids = torch.ones(1000, 8), torch.tensor([3, 5, 7])
    # one index entry from a 1,000-row source: one element read and written, the index's 8 bytes
    one, source = torch.tensor([[1]]), torch.ones(1000, 8)
    assert _bytes_of(lambda: table.scatter_(0, one, source)) == 4 + 4 + 8

    def put_scalar():
        table[ids] = 0.0  # a 0-dim value broadcast over 3 rows of 8
    assert _bytes_of(put_scalar) == 3 * 8 * 4 + 24 + 4
    index, rows = ids.view(3, 1).expand(3, 8).contiguous(), torch.ones(3, 8)
    assert _bytes_of(lambda: table.scatter_(0, index, rows)) == 96 + 192 + 96
    with pytest.warns(UserWarning):  # scatter_'s reduce= is deprecated, still an accumulating put
        assert _bytes_of(lambda: table.scatter_(0, index, rows, reduce="add")) == 2 * 96 + 192 + 96
    # a mask expanded over the target: no more put than the source holds (16 of 32 elements)
    mask = torch.tensor([True, False, True, False]).view(4, 1).expand(4, 8)
    target, source = torch.ones(4, 8), torch.ones(16)
    assert _bytes_of(lambda: target.masked_scatter_(mask, source)) == 64 + 64 + 4


def test_the_backward_of_a_gather_puts_into_its_zeros_in_place():
    # under a dispatch mode autograd runs the out-of-place index_put into fresh zeros; CUDA's eager backward puts in
    # place: the zeros are written once (new_zeros), the put touches its 3 rows (accumulating), not the whole table
    leaf, ids = torch.ones(1000, 8, requires_grad=True), torch.tensor([3, 5, 7])
    with StepTrace() as trace:
        leaf[ids].sum().backward()
    put = next(o for o in trace.ops if o.name == "aten.index_put")
    assert put.bytes == 2 * 3 * 8 * 4 + 4 + 24  # the rows read and written, the expanded gradient, the indices
