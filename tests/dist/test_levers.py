"""The long-context levers with every CP style, against the unsharded run of the same weights (fp32, gloo):

- the sequence-tiled MLP (`cpbench.use_tiled_mlp(model, tiles)`);
- selective recompute with activation offload (`model.activation_checkpointing_enable(every_n_layers=2,
  offload=True)`, transformers' own: torch's save_on_cpu around checkpoint);
- op-level selective recompute (`cpbench.use_recompute(model, "op")`: each layer keeps its attention kernels' and
  every other matmul's outputs; the ring's and the tiled MLP's tiles recomputed whole);
- parameter and optimizer offload (`DistributedConfig(fsdp_cpu_offload=True)`, FSDP2's CPUOffloadPolicy; on CPU it
  pins nothing, see cpbench/cp/hf_compat/__init__.py), with an optimizer step;
- gradient clipping (cpbench's step clips with `torch.nn.utils.clip_grad_norm_` on the sharded gradients: the
  unsharded global norm, every gradient halved), then an AdamW step (the fused kernel, run over the shards, with all
  levers; its values are torch's);
- all of them together with the chunked loss and the fused RMSNorm (`cpbench.use_fused_norm`: one op each way,
  inside the tiled MLP's tiles where the norm joins them), with whole-layer recompute ("all") and with op recompute
  ("all_op").

Each alone and all together, with cp_ulysses, cp_ring and cp_ring_zigzag at cp 2 (a 4-layer tiny Qwen3, and all
levers on a realistic-width Llama: hidden 512, head dim 64, intermediate 2048), and cp_usp (2 x 2) on 4 ranks: the
loss, the logits where the loss keeps them, and every gradient. On CPU an offload moves nothing (host memory is
where everything lives), so these hold the levers' composition with CP exact, not their memory.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist.models import GRAD_RTOL, LOGITS_ATOL, LOSS_RTOL

LEVERS = ("tiled_mlp", "offload_activations", "recompute_op", "offload_params", "all", "all_op")
ALL = ("all", "all_op")
STYLES = ("cp_ulysses", "cp_ring", "cp_ring_zigzag")


def _load(path: str, style: str, lever: str, cp: int):
    from transformers import AutoModelForCausalLM

    import cpbench

    config = cpbench.DistributedConfig(
        cp_size=cp, cp_plan={"model.layers.*.self_attn": style}, fsdp_cpu_offload=lever in ("offload_params", *ALL),
        cp_ulysses_degree=2 if style == "cp_usp" else None)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32,
                                                 distributed_config=config)
    if lever in ALL:  # before the tiled MLP, which moves the norm feeding the MLP into its tiles
        cpbench.use_fused_norm(model)
    if lever in ("offload_activations", "all"):
        model.activation_checkpointing_enable(every_n_layers=2, offload=True)
    if lever in ("recompute_op", "all_op"):
        cpbench.use_recompute(model, "op", every_n_layers=2 if lever == "all_op" else 1, offload=lever == "all_op")
    if lever in ("tiled_mlp", *ALL):
        cpbench.use_tiled_mlp(model, 3)
    if lever in ALL:
        cpbench.use_loss(model, "chunked")
    return model


def _errors(model, batch: dict, ref: dict, lever: str) -> dict:
    import cpbench
    from tests.dist.models import full_grads, worst_grad_error

    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert norms and all(getattr(m, "_cpbench_fused_norm", False) == (lever in ALL) for m in norms), lever
    model.train()
    out = model(**batch)
    out.loss.backward()
    grad, where = worst_grad_error(full_grads(model), ref["grads"])
    logits = None
    if out.logits is not None:
        layout = model.cp_layout(batch["input_ids"].shape[1])
        logits = (cpbench.gather_sequence(out.logits.detach(), layout, model.cp_group) - ref["logits"]).abs().max()
    # clip_grad_norm_ over the shards (each rank's DTensor norms summed over the ranks) meets the unsharded
    # gradients' global norm and halves them all; then a fused AdamW (all levers) or the per-tensor loop steps the
    # shards, offloaded ones on the host
    from cpbench.harness.measure.step import clip_gradients

    ref_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in ref["grads"].values()])).item()
    total = clip_gradients(list(model.parameters()), ref_norm / 2, foreach=lever not in ALL)  # both of torch's paths
    total = (total.full_tensor() if hasattr(total, "full_tensor") else total).item()
    clipped, _ = worst_grad_error(full_grads(model), {n: g / 2 for n, g in ref["grads"].items()})
    torch.optim.AdamW(model.parameters(), lr=1e-3, fused=lever in ALL).step()
    return {"loss": abs(out.loss.item() - ref["loss"].item()) / abs(ref["loss"].item()),
            "logits": None if logits is None else logits.item(), "grad": grad, "grad_where": where,
            "norm": abs(total - ref_norm) / ref_norm, "clipped": clipped,
            "param_device": next(model.parameters()).device.type}


def levers_worker(paths: dict, cases: list[tuple[str, str, str]], cp: int) -> dict:
    from tests.dist.models import make_batch, reference

    results, refs = {}, {}
    for name, style, lever in cases:
        batch = make_batch("packed", seq_len=24)
        if name not in refs:
            refs[name] = reference(paths[name], batch, "sdpa")
        results[(name, style, lever)] = _errors(_load(paths[name], style, lever, cp), batch, refs[name], lever)
    return results


CASES = {2: [("tiny", style, lever) for style in STYLES for lever in LEVERS]
         + [("wide", style, "all") for style in ("cp_ulysses", "cp_ring_zigzag")],
         4: [("tiny", "cp_usp", lever) for lever in ("tiled_mlp", "recompute_op", "all_op")]}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from tests.dist.models import save_tiny
    from tests.spawn import run_ranks

    root = tmp_path_factory.mktemp("levers")
    paths = {"tiny": save_tiny("qwen3", root / "tiny", num_hidden_layers=4),
             "wide": save_tiny("llama", root / "wide", hidden_size=512, intermediate_size=2048,
                               num_attention_heads=8, num_key_value_heads=2)}
    return {cp: run_ranks(levers_worker, cp, paths, cases, cp, timeout=300) for cp, cases in CASES.items()}


@pytest.mark.parametrize("cp,name,style,lever", [(cp, *case) for cp, cases in CASES.items() for case in cases])
def test_a_lever_keeps_the_unsharded_loss_and_gradients(results, cp, name, style, lever):
    for rank, per_rank in enumerate(results[cp]):
        errs = per_rank[(name, style, lever)]
        assert errs["loss"] <= LOSS_RTOL, f"rank {rank}: loss relative error {errs['loss']:.3g}"
        assert errs["grad"] <= GRAD_RTOL, f"rank {rank}: gradient error {errs['grad']:.3g} in {errs['grad_where']}"
        assert errs["norm"] <= GRAD_RTOL and errs["clipped"] <= GRAD_RTOL, f"rank {rank}: clipping {errs}"
        if lever in ALL:
            assert errs["logits"] is None  # the chunked loss never makes the logits
        else:
            assert errs["logits"] <= LOGITS_ATOL, f"rank {rank}: logits error {errs['logits']:.3g}"
