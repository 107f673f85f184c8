"""Forward-only parity of `cp_ulysses` with attn_implementation="flex_attention" at cp=2 (fp32, gloo, CPU).

torch has no CPU backward for flex_attention ("FlexAttention does not support backward on CPU"), so the
gradient-parity tests cannot cover this backend. Its forward runs on CPU under `torch.no_grad()`, and is compared
here with the unsharded flex model of the same weights: the whole-sequence loss and this rank's slice of the
logits, for Qwen3, Llama and Mistral (sliding_window=5) on a plain causal batch, a packed batch (position_ids
restarting at 0), left- and right-padded batches (a 2-D attention_mask) and 15 tokens (cp=2 does not divide).
Each case also checks that Ulysses really handed flex the model-built `BlockMask` with this rank's heads over
the whole sequence.

Compilation: transformers always wraps flex_attention (and create_block_mask) in `torch.compile`; on CPU every
new mask function or shape costs inductor seconds of C++ compilation, so compiling all 15 cases would take over
a minute on a cold cache (and inductor 2.13's CPU flex template then fails to compile Mistral's packed
sliding-window mask when it comes after the plain one: "'cur_kvSplitSize2' was not declared", with or without
CP). The matrix therefore runs under `torch.compiler.set_stance("force_eager")`: flex's own
unfused implementation with the same `BlockMask`, the same GQA and scale arguments, i.e. the same contract
between Ulysses and flex (at these lengths a single 128-token block, so block sparsity plays no part). One case
then runs the compiled kernel, as a user gets it, against the eager reference.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.dist.models import LOGITS_ATOL, LOSS_RTOL

FAMILIES = ("qwen3", "llama", "mistral")
KINDS = ("plain", "packed", "left_pad", "right_pad", "odd")
COMPILED = ("qwen3", "packed")  # the richest mask (causal within documents), with the compiled flex kernel
ATTN = "flex_attention"
CP = 2
HEAD_DIM = 8  # tests/dist/models.py: hidden 32 / 4 heads (Qwen3 sets head_dim=8 itself)


def batch_for(kind: str) -> dict:
    from tests.dist.models import make_batch

    return make_batch("plain", seq_len=15) if kind == "odd" else make_batch(kind)


def _record_inner_calls(seen: list) -> None:
    """Wraps the model's flex attention function so that each call records what Ulysses handed it."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    flex = ALL_ATTENTION_FUNCTIONS[ATTN]

    def recording(module, query, key, value, attention_mask, **kwargs):
        seen.append((type(attention_mask).__name__, tuple(query.shape), tuple(key.shape)))
        return flex(module, query, key, value, attention_mask, **kwargs)

    ALL_ATTENTION_FUNCTIONS.register(ATTN, recording)


def compare(model, ref_model, batch: dict, seen: list, stance: str) -> dict:
    """The CP forward against the unsharded one: loss relative error, worst error of this rank's logits."""
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    import cpbench

    frames_before = counters["frames"]["ok"]
    with torch.no_grad():
        with torch.compiler.set_stance("force_eager"):
            ref = ref_model(**batch, use_cache=False)
        seen.clear()
        with torch.compiler.set_stance(stance):
            out = model(**batch)
    layout = cpbench.SequenceLayout(batch["input_ids"].shape[1], CP, dist.get_rank(model.cp_group))
    # This rank's positions of the reference; a rank whose tail is padding returns only its real tokens.
    ref_logits = layout.cut(ref.logits, dim=1)[:, : layout.valid_len]
    same_shape = out.logits.shape == ref_logits.shape
    return {
        "loss": abs(out.loss.item() - ref.loss.item()) / abs(ref.loss.item()),
        # Every position, padded queries included: both runs use flex, which gives a fully masked row 0.
        "logits": (out.logits - ref_logits).abs().max().item() if same_shape else float("inf"),
        "logits_shape": tuple(out.logits.shape),
        "ref_logits_shape": tuple(ref_logits.shape),
        "inner_calls": list(seen),
        "compiled_frames": counters["frames"]["ok"] - frames_before,  # graphs dynamo compiled for this case
    }


def flex_worker(paths: dict) -> dict:
    from transformers import AutoModelForCausalLM

    import cpbench

    # The unfused path warns once per process that it is unfused; that is the point of the eager stance here.
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    seen: list = []
    _record_inner_calls(seen)
    load = dict(attn_implementation=ATTN, dtype=torch.float32)
    results = {}
    for family in FAMILIES:
        ref_model = AutoModelForCausalLM.from_pretrained(paths[family], **load).eval()
        model = AutoModelForCausalLM.from_pretrained(
            paths[family], **load, distributed_config=cpbench.DistributedConfig(cp_size=CP)
        ).eval()
        results[family, "plan"] = dict(model.cp_plan)
        for kind in KINDS:
            results[family, kind] = compare(model, ref_model, batch_for(kind), seen, "force_eager")
        if family == COMPILED[0]:
            results["compiled"] = compare(model, ref_model, batch_for(COMPILED[1]), seen, "default")
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from tests.dist.models import save_tiny
    from tests.spawn import run_ranks

    root = tmp_path_factory.mktemp("flex_forward")
    paths = {f: save_tiny(f, root / f) for f in FAMILIES}
    return run_ranks(flex_worker, CP, paths, timeout=300)


def check(errs: dict, rank: int) -> None:
    assert errs["logits_shape"] == errs["ref_logits_shape"], f"rank {rank}: {errs}"
    assert errs["loss"] <= LOSS_RTOL, f"rank {rank}: loss relative error {errs['loss']:.3g}"
    assert errs["logits"] <= LOGITS_ATOL, f"rank {rank}: logits error {errs['logits']:.3g}"


def expected_inner_calls(kind: str) -> list:
    # Per layer (2): the model's BlockMask, query [B, heads/cp, S, D], key [B, kv_heads/cp, S, D] over the whole
    # sequence (15 real tokens for `odd`: Ulysses drops the layout's padding before calling flex).
    seq = batch_for(kind)["input_ids"].shape[1]
    return [("BlockMask", (2, 4 // CP, seq, HEAD_DIM), (2, 2 // CP, seq, HEAD_DIM))] * 2


@pytest.mark.parametrize("family,kind", [(f, k) for f in FAMILIES for k in KINDS])
def test_ulysses_flex_forward_matches_unsharded(results, family, kind):
    for rank, per_rank in enumerate(results):
        check(per_rank[family, kind], rank)
        assert per_rank[family, kind]["inner_calls"] == expected_inner_calls(kind), f"rank {rank}"
        assert per_rank[family, kind]["compiled_frames"] == 0, f"rank {rank}: the eager stance did not hold"


def test_ulysses_flex_compiled_kernel(results):
    # The compiled CPU flex kernel against the eager unsharded reference: a different kernel computes the same
    # sums in another order, which LOGITS_ATOL's headroom (see models.py) covers.
    for rank, per_rank in enumerate(results):
        check(per_rank["compiled"], rank)
        assert per_rank["compiled"]["inner_calls"] == expected_inner_calls(COMPILED[1]), f"rank {rank}"
        assert per_rank["compiled"]["compiled_frames"] > 0, f"rank {rank}: nothing was compiled"


@pytest.mark.parametrize("family", FAMILIES)
def test_flex_runs_under_default_ulysses_plan(results, family):
    assert results[0][family, "plan"]["model.layers.*.self_attn"] == "cp_ulysses"
    # 16 tokens: 8 per rank; 15 tokens: padded to 16, the last rank returns only its 7 real tokens.
    assert [r[family, "plain"]["logits_shape"][1] for r in results] == [8, 8]
    assert [r[family, "odd"]["logits_shape"][1] for r in results] == [8, 7]
