"""What the op trace counts for one kernel call (flops.py, work.py, trace.py): the causal flag read where each kernel's
schema has it, each kernel's causal alignment, grouped and MLA shapes, and the bytes an op really moves."""

from __future__ import annotations

import warnings

import pytest
import torch

from cpbench.harness.project import flops as kernel_flops
from cpbench.harness.project import work
from cpbench.harness.project.trace import StepTrace


def test_every_aten_attention_kernel_reads_its_causal_flag_where_its_schema_puts_it():
    # the cuDNN backward's is_causal is argument 14 (its cum_seq / max_q / max_k arguments come before it), not 9
    for name, spec in kernel_flops.ATTENTION.items():
        if not name.startswith("aten."):
            continue  # flash-attn's ops: not installed here; their positions are cpbench/cp/ring/flash.py's calls
        schema = getattr(torch.ops.aten, name.split(".", 1)[1]).default._schema
        arg_name, at = spec.causal
        assert schema.arguments[at].name == arg_name, (name, at, schema.arguments[at].name)
        if spec.offsets_at is not None:
            assert schema.arguments[spec.offsets_at].name in ("cum_seq_q", "cu_seqlens_q"), name


def _bhsd(batch=1, heads=2, seq=4, dim=8):
    return torch.empty(batch, heads, seq, dim, device="meta")


def test_the_cudnn_backward_counts_causal_pairs_from_its_own_flag():
    q = _bhsd()
    args = [q, q, q, q, q, q, None, None, None, None, None, 4, 4, 0.0, True]  # grad_out, q, k, v, out, lse, ...
    causal, _ = kernel_flops.attention("aten._scaled_dot_product_cudnn_attention_backward", tuple(args))
    args[14] = False
    full, _ = kernel_flops.attention("aten._scaled_dot_product_cudnn_attention_backward", tuple(args))
    assert causal == 2.5 * 4 * 10 * 2 * 8 and full == 2.5 * 4 * 16 * 2 * 8


def test_the_memory_efficient_kernel_counts_its_causal_mask_types():
    t = torch.empty(1, 4, 2, 8, device="meta")  # [batch, seq, heads, dim]
    args = [t, t, t, None, None, None, None, None, 0.0, 0]
    none = kernel_flops.attention("aten._efficient_attention_forward", tuple(args))[0]
    args[9] = 1  # causal from the top left
    top_left = kernel_flops.attention("aten._efficient_attention_forward", tuple(args))[0]
    assert none == 4 * 16 * 2 * 8 and top_left == 4 * 10 * 2 * 8
    q = torch.empty(1, 2, 2, 8, device="meta")  # 2 queries over 4 keys from the bottom right: 3 + 4 pairs
    args = [q, t, t, None, None, None, None, None, 0.0, 2]
    assert kernel_flops.attention("aten._efficient_attention_forward", tuple(args))[0] == 4 * 7 * 2 * 8
    # its varlen form keeps q 4-D ([1, tokens, heads, dim]) beside cu_seqlens: documents of 3 and 1 tokens, causal
    offsets = torch.tensor([0, 3, 4])
    args = [t, t, t, None, offsets, offsets, 3, 3, 0.0, 1]
    assert kernel_flops.attention("aten._efficient_attention_forward", tuple(args))[0] == 4 * (6 + 1) * 2 * 8


def test_flash_kernels_count_non_square_causal_calls_from_the_bottom_right():
    q, k = torch.empty(1, 2, 2, 8, device="meta"), torch.empty(1, 4, 2, 8, device="meta")
    args = (q, k, k, None, None, 2, 4, 0.0, True)
    assert kernel_flops.attention("aten._flash_attention_forward", args)[0] == 4 * (3 + 4) * 2 * 8
    fa = (q, k, k, 0.0, 1.0, True)  # flash-attn's _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal)
    assert kernel_flops.attention("flash_attn._flash_attn_forward", fa)[0] == 4 * 7 * 2 * 8
    # flash-attn's backward: causal is argument 11 (after dq, dk, dv, dropout_p, softmax_scale)
    bwd = (q, q, k, k, q, None, q, k, k, 0.0, 1.0, True)
    assert kernel_flops.attention("flash_attn._flash_attn_backward", bwd)[0] == 2.5 * 4 * 7 * 2 * 8


def test_a_sliding_window_counts_the_pairs_its_window_keeps_as_the_flash_kernels_read_it():
    # 256 queries, causal, a window of 63 keys back (flash's window_size_left): query i sees min(i + 1, 64) keys
    windowed = 64 * 65 // 2 + (256 - 64) * 64
    assert kernel_flops.pairs_within(256, 256, True, "bottom_right", 63, -1) == windowed
    t = torch.empty(1, 256, 2, 8, device="meta")  # [batch, seq, heads, dim]
    aten = (t, t, t, None, None, 256, 256, 0.0, True, False)  # aten's flash kernel: the window by keyword only
    flops, shape = kernel_flops.attention("aten._flash_attention_forward", aten,
                                          {"window_size_left": 63, "window_size_right": None})
    assert flops == 4 * windowed * 2 * 8 and shape[1] == 64  # the keys its kernel loops over: the window's
    full = kernel_flops.attention("aten._flash_attention_forward", aten)[0]
    assert full == 4 * (256 * 257 // 2) * 2 * 8
    # flash-attn's varlen call, per document (100 and 156 tokens), window (63, 0) at 10 and 11
    tokens, offsets = torch.empty(256, 2, 8, device="meta"), torch.tensor([0, 100, 256])
    varlen = (tokens, tokens, tokens, offsets, offsets, 156, 156, 0.0, 1.0, True, 63, 0)
    per_doc = sum(kernel_flops.pairs_within(n, n, True, "bottom_right", 63, 0) for n in (100, 156))
    assert kernel_flops.attention("flash_attn._flash_attn_varlen_forward", varlen)[0] == 4 * per_doc * 2 * 8
    # not causal, 20 keys back and none bounding it forward (a ring tile's (left, -1)): query i sees keys
    # max(0, i - 20) .. 255; FlashAttention-3's backward reads its window at 17 and 18
    grad = [t, t, t, t, t, None, None, None, None, None, 256, 256, None, None, None, 1.0, False, 20, -1]
    got = kernel_flops.attention("flash_attn_3._flash_attn_backward", tuple(grad))[0]
    assert got == 2 * kernel_flops.pairs_within(256, 256, False, "bottom_right", 20, -1) * 2 * (3 * 8 + 2 * 8)
    assert kernel_flops.pairs_within(256, 256, False, "bottom_right", 20, -1) == sum(256 - max(0, i - 20)
                                                                                     for i in range(256))


def test_attention_with_a_value_head_unlike_the_query_head_counts_both():
    q, v = _bhsd(dim=192), _bhsd(dim=128)  # multi-head latent attention: qk 192, v 128
    call = (q, q, v, None, False, 0.0, False)
    flops, shape = kernel_flops.attention("aten._scaled_dot_product_cudnn_attention", call)
    assert flops == 2 * 16 * 2 * (192 + 128) and shape == (4, 4, 192, False, 2)
    # its backward: QK^T again, dQ and dK over the qk dim, dV and dP over v's: 2 x pairs x heads x (3 x 192 + 2 x 128)
    grad = (v, q, q, v, v, None, None, None, 4, 4, 0.0, False)
    flops = kernel_flops.attention("aten._scaled_dot_product_cudnn_attention_backward", grad)[0]
    assert flops == 2 * 16 * 2 * (3 * 192 + 2 * 128)


def test_grouped_gemms_count_every_group_once():
    x, w, offs = torch.empty(96, 16, device="meta"), torch.empty(8, 16, 32, device="meta"), torch.empty(8)
    flops, shape = kernel_flops.gemm("aten._grouped_mm", (x, w, offs))
    assert flops == 2 * 96 * 16 * 32 and shape == (12, 32, 16, 8)  # 96 token rows over 8 experts
    # the weight gradient: x^T [16, 96] with grad [96, 32], the contraction grouped: 8 outputs of [16, 32]
    flops, shape = kernel_flops.gemm("aten._grouped_mm", (torch.empty(16, 96, device="meta"),
                                                  torch.empty(96, 32, device="meta"), offs))
    assert flops == 2 * 16 * 96 * 32 and shape == (16, 32, 12, 8)


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


def test_a_flash_backends_masked_call_counts_what_its_flash_path_computes():
    # A flash_attention_2 point runs as sdpa (projection.runs_as); where its model hands SDPA a mask (a sliding
    # window, packed documents) transformers' flash path calls the kernel causal with a window, or varlen per
    # document (_flash_attention_forward): counted so, forward and backward, not as the mask's whole square.
    from cpbench.harness.project.projection import project_rank
    from cpbench.harness.suite.spec import load_suite

    def attention_ops(model, attn, extra=""):
        text = (f'name = "t"\nmodel = "{model}"\nseq_lens = [512]\ncp_sizes = [1]\nworld_size = 1\n'
                f'dtype = "bfloat16"\ndevice = "cuda"\nattn_implementations = ["{attn}"]\n'
                'model_overrides = {num_hidden_layers = 1}\n' + extra)
        ops = project_rank(load_suite("t.toml", text=text).points()[0], 0, keep_trace=True)["trace"]
        return [o for o in ops if o.kind.startswith("attention")]

    heads, dim = 4, 16  # the tiny models'
    window = kernel_flops.pairs_within(512, 512, True, "bottom_right", 63, -1)  # tiny-mistral's sliding window, 64
    documents = sum(n * (n + 1) // 2 for n in (128, 128, 256))
    for model, extra, pairs in (("tiny-mistral", "", window),
                                ("tiny-llama", "documents = [128, 128, 256]\n", documents)):
        forward, backward = attention_ops(model, "flash_attention_2", extra)
        assert forward.kind == "attention_forward" and forward.flops == 2 * pairs * heads * 2 * dim, model
        assert backward.kind == "attention_backward" and backward.flops == 2 * pairs * heads * 5 * dim, model
    # a padded batch: the flash path unpads its rows (_upad_input) and runs varlen over each row's own tokens; the
    # batch pads every other row by a quarter (step.make_batch), none of which a kernel computes
    for size, rows in ((2, 512 * 513 // 2 + 384 * 385 // 2), (1, 384 * 385 // 2)):
        forward, backward = attention_ops("tiny-llama", "flash_attention_2",
                                          f'batch_size = {size}\nbatch_kind = "padded"\n')
        assert forward.flops == 2 * rows * heads * 2 * dim and backward.flops == 2 * rows * heads * 5 * dim
    # SDPA itself runs a masked call on the memory-efficient kernel, which computes the whole square
    forward = attention_ops("tiny-mistral", "sdpa")[0]
    assert forward.kind == "attention_efficient_forward" and forward.flops == 2 * 512 * 512 * heads * 2 * dim


def test_the_flash_paths_view_of_a_call_is_transformers_own():
    # transformers' flash path: the call's is_causal before the module's, a window of sliding_window - 1 on each
    # side where the keys outrun it (the right one hidden by causality), varlen per document where a batch of
    # one's positions restart
    class Attention:
        is_causal = True

    view = kernel_flops.flash_as_called
    assert view(Attention(), 512, 64, None) == (True, 63, -1, None)
    assert view(Attention(), 512, 64, None, is_causal=False) == (False, 63, 63, None)
    assert view(Attention(), 64, 64, None) == (True, -1, -1, None)  # the keys within the window: no window
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    assert view(Attention(), 9, None, positions)[3] == [3, 2, 4]
    assert view(Attention(), 9, None, torch.arange(9)[None])[3] is None  # one document
    assert view(Attention(), 9, None, positions.expand(2, 9))[3] is None  # a batch of two is not varlen
    # a window on a call that is not causal reaches both ways: query i sees keys i - 63 .. i + 63
    q = torch.empty(1, 2, 512, 8, device="meta")
    call = (q, q, q, 0.0, False)
    flops = kernel_flops.attention("aten._scaled_dot_product_flash_attention_for_cpu", call, None,
                                   view(Attention(), 512, 64, None, is_causal=False))[0]
    both = sum(min(511, i + 63) - max(0, i - 63) + 1 for i in range(512))
    assert flops == 2 * both * 2 * 16


def test_values_of_another_head_dim_run_a_fused_kernel_in_a_cuda_projection(tmp_path):
    # multi-head latent attention (DeepSeek: q/k 192, v 128): CUDA's SDPA runs a fused kernel; torch's CPU flash
    # kernel wants one head dim, and the math path would count S x S GEMMs and hold the scores. A CUDA point's values
    # are padded to the queries' head dim for the call (projection.values_padded), as transformers' flash path pads
    from transformers import DeepseekV3Config

    from cpbench.harness.project.projection import project_rank
    from cpbench.harness.suite.spec import load_suite

    DeepseekV3Config(vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                     num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32,
                     qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, max_position_embeddings=1024,
                     n_group=1, topk_group=1).save_pretrained(tmp_path)

    def trace(device):
        text = (f'name = "t"\nmodel = "{tmp_path}"\nseq_lens = [512]\ncp_sizes = [1]\nworld_size = 1\n'
                f'dtype = "bfloat16"\ndevice = "{device}"\n')
        return project_rank(load_suite("t.toml", text=text).points()[0], 0, keep_trace=True)["trace"]

    ops = trace("cuda")
    attention = [o for o in ops if o.kind.startswith("attention")]
    square = [o for o in ops if o.kind == "gemm" and o.shape[:2] == (512, 512)]
    assert len(attention) == 4 and not square  # two layers' forward and backward, no S x S product
    forward = next(o for o in attention if o.kind.endswith("_forward"))
    assert forward.flops == 2 * (512 * 513 // 2) * 4 * (16 + 16)  # causal, at the padded head dim
    # a CPU point runs what the CPU runs: SDPA's math path, its S x S products
    assert any(o.kind == "gemm" and o.shape[:2] == (512, 512) for o in trace("cpu"))
