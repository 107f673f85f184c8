"""Model-level parity of two attention features the core families lack, under every CP attention style.

- Attention sinks: gpt_oss and mimo_v2_flash pass one learned logit per query head as `s_aux=self.sinks` (their eager
  functions read `module.sinks`); the softmax denominator gains exp(sink). Ulysses slices the sinks to each rank's
  heads; the ring adds them to its merged result and returns their gradient (cp/ring/sinks.py); USP does both.
- A value head dim other than the query's: deepseek_v3's multi-head latent attention (q/k 16 = 8 nope + 8 rope, v 8)
  and mimo_v2_flash (q/k 16, v 8, with sinks on its sliding layer, GQA with 2 and 1 kv heads). Every kernel's output
  and dV take v's head dim; on CPU the ring's flash kernel gets v zero-padded; on CUDA (here through the emulations
  of the kernels, tests/emulation/) every tile goes to the memory-efficient kernel, the only fused one whose contract
  allows dv != dqk (flash and flash-attn check v's head dim against q's: tests/emulation/_flash.py `mha_fwd`).

Loss, logits gathered with `cpbench.gather_sequence` and every parameter gradient (the sinks included) against the
unsharded run of the same weights: cp_ulysses, cp_ring and cp_ring_zigzag at cp 2, cp_usp at cp 4 (ring 2 x Ulysses
2); eager and sdpa where the family has them (the sink families have no sdpa); plain and packed batches
(position_ids restarting per document; gpt_oss and mimo_v2_flash mix a sliding window of 6 with full layers).

Tolerances. fp32: tests/dist/models.py's (the same sums in another order: a few fp32 ulp times the reduction depth;
1e-5 on the loss, 1e-4 on logits and relative gradients, ~100x over the ~1e-6 observed, while a missing sink or a
wrong head slice errs by > 1e-2). The CUDA kernel choice runs in bf16, held to
`cpbench.harness.measure.parity.tolerances("bfloat16", cp)`: every op's output is rounded to bf16's 8-bit
mantissa, which dominates (see that module). One spawn per cp size runs the default cases, another the heavy ones
(a spawn costs seconds; a tiny model's step a fraction of one).

gpt_oss builds its mask without position_ids (modeling_gpt_oss.py: `mask_kwargs` has none), so its unsharded run lets
packed documents see each other; CP follows the model's mask (hf_compat.masks_isolate_documents), so its packed cases
hold too.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist.models import GRAD_RTOL, LOGITS_ATOL, LOSS_RTOL

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=256, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
MOE = dict(moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1)
FAMILIES = ("gpt_oss", "mimo_v2_flash", "deepseek_v3")
RING_STYLES = ("cp_ring", "cp_ring_zigzag")


def tiny_config(family: str):
    from transformers import DeepseekV3Config, GptOssConfig, MiMoV2FlashConfig

    if family == "gpt_oss":
        return GptOssConfig(**COMMON, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                            sliding_window=6, layer_types=["sliding_attention", "full_attention"])
    if family == "mimo_v2_flash":  # sinks on the sliding layer only (2 kv heads there), 1 kv head on the full one
        return MiMoV2FlashConfig(**COMMON, **MOE, num_key_value_heads=1, head_dim=16, v_head_dim=8,
                                 attention_value_scale=0.5, sliding_window=6, mlp_layer_types=["dense", "sparse"],
                                 layer_types=["sliding_attention", "full_attention"])
    # kv heads = query heads: MLA expands its latent to every head (repeat_kv with num_key_value_groups = 1)
    return DeepseekV3Config(**COMMON, **MOE, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
                            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_shared_experts=1,
                            first_k_dense_replace=1)


def save_tiny(family: str, path) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".sinks"):  # initialised near 0: make the sinks differ per head and weigh like keys
                p.copy_(torch.randn(p.shape) + 1.0)
    model.save_pretrained(path)
    return str(path)


def _case(cp, family, attn, style, kind, device="cpu", heavy=False):
    marks = [pytest.mark.heavy] if heavy else []
    return pytest.param(cp, family, attn, style, kind, device, marks=marks,
                        id=f"{cp}-{family}-{attn}-{style}-{kind}-{device}")


def cases() -> list:
    """(cp, family, attn, style, batch kind, kernel device) as pytest params; `heavy` ones are opt-in (-m heavy).
    The default set (~15 s on 2 cores) runs every style on every feature (sinks, MLA, both at once in mimo_v2_flash)
    on both batch kinds, USP on mimo_v2_flash, and the CUDA choice on zigzag; heavy adds deepseek_v3's eager ring
    runs (the ring's CPU kernel is the same as for sdpa), the other USP cases (4 ranks on 2 cores cost most) and the
    rest of the CUDA choice."""
    out = []
    for style in ("cp_ulysses", *RING_STYLES):
        for kind in ("plain", "packed"):
            out += [_case(2, "gpt_oss", "eager", style, kind), _case(2, "mimo_v2_flash", "eager", style, kind),
                    _case(2, "deepseek_v3", "sdpa", style, kind),
                    _case(2, "deepseek_v3", "eager", style, kind, heavy=style != "cp_ulysses")]
    usp_default = {("mimo_v2_flash", "eager", "packed")}  # sinks and dv != dqk at once; 4 ranks cost most here
    for family, attn in (("gpt_oss", "eager"), ("mimo_v2_flash", "eager"), ("deepseek_v3", "sdpa"),
                         ("deepseek_v3", "eager")):
        for kind in ("plain", "packed"):
            out.append(_case(4, family, attn, "cp_usp", kind, heavy=(family, attn, kind) not in usp_default))
    # The CUDA kernel choice in bf16 (a flash_attention_2 model's too), through the emulations.
    for family, impl in (("deepseek_v3", "sdpa"), ("deepseek_v3", "flash_attention_2"), ("mimo_v2_flash", "eager")):
        for style in RING_STYLES:
            for kind in ("plain", "packed"):
                default = style == "cp_ring_zigzag" and (kind == "packed" or family == "mimo_v2_flash")
                out.append(_case(2, family, impl, style, kind, "cuda", heavy=not default))
    return out


CASES = cases()


def _selected(heavy: bool) -> dict:
    """{cp: [case, ...]} of the default or the heavy cases."""
    by_cp: dict = {}
    for p in CASES:
        if any(m.name == "heavy" for m in p.marks) == heavy:
            by_cp.setdefault(p.values[0], []).append(p.values[1:])
    return by_cp


def batch_for(kind: str) -> dict:
    from tests.dist.models import make_batch

    return make_batch(kind)


def reference(path: str, batch: dict, attn: str, dtype: torch.dtype) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn, dtype=dtype)
    out = model(**batch, use_cache=False)
    out.loss.backward()
    return {"loss": out.loss.detach().float(), "logits": out.logits.detach().float(),
            "grads": {n: p.grad.detach().float() for n, p in model.named_parameters() if p.grad is not None}}


def errors(model, batch: dict, ref: dict) -> dict:
    import cpbench
    from tests.dist.models import full_grads, worst_grad_error

    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    layout = model.cp_layout(batch["input_ids"].shape[1])
    logits = cpbench.gather_sequence(out.logits.detach(), layout, model.cp_group).float()
    grads = {n: g.float() for n, g in full_grads(model).items()}
    grad, where = worst_grad_error(grads, ref["grads"])
    sinks = [n for n in grads if n.endswith(".sinks")]
    return {
        "loss": abs(out.loss.item() - ref["loss"].item()) / abs(ref["loss"].item()),
        "logits": (logits - ref["logits"]).abs().max().item(),
        "grad": grad,
        "grad_where": where,
        "sinks": sinks,  # compared inside `grad`; listed to show they were
        "sink_grad_norm": min((ref["grads"][n].norm().item() for n in sinks), default=None),
    }


def _model(path: str, attn: str, style: str, cp: int, device: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    import cpbench

    config = cpbench.DistributedConfig(
        cp_size=cp, cp_plan={"model.layers.*": "cp_split_sequence", "model.layers.*.self_attn": style},
        cp_ulysses_degree=2 if style == "cp_usp" else None, cp_kernel_device="cuda" if device == "cuda" else None)
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn, dtype=dtype, distributed_config=config)


def cases_worker(paths: dict, cp: int, selected: list) -> dict:
    """Every selected case of this cp size; CUDA ones last (they stand the emulations in for the CUDA kernels)."""
    from cpbench.cp.ring import attention as ring
    from tests.dist.test_ring_cuda_models import stand_in_cuda_kernels

    refs, models, results = {}, {}, {}
    counters, own_choice = None, ring.model_attention_implementation
    for family, attn, style, kind, device in sorted(selected, key=lambda c: c[-1] == "cuda"):
        if device == "cuda" and counters is None:
            counters = stand_in_cuda_kernels()
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        # A flash_attention_2 model needs flash-attn to load: load sdpa, and let the ring choose as for flash.
        load = "sdpa" if attn == "flash_attention_2" else attn
        ring.model_attention_implementation = (lambda module: "flash_attention_2") if load != attn else own_choice
        if (family, load, kind, dtype) not in refs:
            refs[(family, load, kind, dtype)] = reference(paths[family], batch_for(kind), load, dtype)
        if (family, load, style, device) not in models:
            models[(family, load, style, device)] = _model(paths[family], load, style, cp, device, dtype)
        before = _calls(counters)
        errs = errors(models[(family, load, style, device)], batch_for(kind), refs[(family, load, kind, dtype)])
        errs["calls"] = {op: n - before[op] for op, n in _calls(counters).items()}  # this case's kernel calls
        results[(family, attn, style, kind, device)] = errs
        ring.model_attention_implementation = own_choice
    return results


def _calls(counters) -> dict:
    if counters is None:
        return {}
    return {**counters["aten"].calls, **{f"fa:{op}": n for op, n in counters["flash_attn"].calls.items()}}


def _run(paths: dict, heavy: bool) -> dict:
    from tests.spawn import run_ranks

    return {cp: run_ranks(cases_worker, cp, paths, cp, selected, timeout=300)
            for cp, selected in _selected(heavy).items()}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("sinks_and_mla")
    return {family: save_tiny(family, root / family) for family in FAMILIES}


@pytest.fixture(scope="module")
def default_results(paths):
    return _run(paths, heavy=False)


@pytest.fixture(scope="module")
def heavy_results(paths):
    return _run(paths, heavy=True)


@pytest.mark.parametrize("cp,family,attn,style,kind,device", CASES)
def test_cp_matches_unsharded(request, cp, family, attn, style, kind, device):
    from cpbench.harness.measure.parity import tolerances

    heavy = "heavy" in request.node.keywords
    results = request.getfixturevalue("heavy_results" if heavy else "default_results")
    if device == "cuda":
        tol = tolerances("bfloat16", cp)
    else:
        tol = {"loss_rtol": LOSS_RTOL, "logits_atol": LOGITS_ATOL, "grad_rtol": GRAD_RTOL}
    for rank, per_rank in enumerate(results[cp]):
        errs = per_rank[(family, attn, style, kind, device)]
        assert errs["loss"] <= tol["loss_rtol"], f"rank {rank}: loss relative error {errs['loss']:.3g}"
        assert errs["logits"] <= tol["logits_atol"], f"rank {rank}: logits error {errs['logits']:.3g}"
        assert errs["grad"] <= tol["grad_rtol"], (
            f"rank {rank}: gradient error {errs['grad']:.3g} in {errs['grad_where']}")
        if family != "deepseek_v3":  # the sinks were compared, and their reference gradient is not negligible
            assert errs["sinks"] and errs["sink_grad_norm"] > 1e-4, errs
        if device == "cuda":  # both CUDA families have dv != dqk
            _only_the_efficient_kernel(errs["calls"], family)


def _only_the_efficient_kernel(calls: dict, family: str) -> None:
    """dv != dqk: PyTorch's memory-efficient kernel serves every tile of an MLA layer, for sdpa and flash_attention_2
    models alike; the flash ops (dense and varlen) and flash-attn would refuse v's head dim."""
    assert calls["efficient"] > 0 and calls["efficient_backward"] > 0, calls
    assert all(n == 0 for op, n in calls.items() if not op.startswith("efficient")), (family, calls)
