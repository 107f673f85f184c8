"""Rank functions for the CP core's multi-rank tests. Each runs several cases in one process group (a spawn
costs seconds on this machine) and returns plain numbers; the tests assert on them in the parent."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import cpbench
from tests.dist.models import embeds_batch, full_grads, make_batch, reference, worst_grad_error


def _parity(model, batch: dict, path: str, attn: str, cp: int, embeds: bool = False, refs=None) -> dict:
    """One forward/backward of the CP model against the unsharded run(s) of the same weights.

    `refs`: the references whose mean gradient FSDP should produce (dp ranks see different batches); by default
    the reference of `batch` alone.
    """
    model.zero_grad(set_to_none=True)
    run_batch = embeds_batch(model, batch) if embeds else batch
    out = model(**run_batch)
    out.loss.backward()
    grads = full_grads(model)
    own_ref = reference(path, batch, attn, embeds=embeds)
    refs = refs or [own_ref]
    mean_grads = {n: sum(r["grads"][n] for r in refs) / len(refs) for n in refs[0]["grads"]}
    seq_len = batch["input_ids"].shape[1]
    layout = model.cp_layout(seq_len)
    assert layout.cp_size == cp and layout.rank == dist.get_rank(model.cp_group)
    logits = cpbench.gather_sequence(out.logits.detach(), layout, model.cp_group)
    grad_err, grad_param = worst_grad_error(grads, mean_grads)
    return {
        "loss": out.loss.item(),
        "ref_loss": own_ref["loss"].item(),
        "logits_shape": tuple(out.logits.shape),
        "logits_err": (logits - own_ref["logits"]).abs().max().item(),
        "grad_err": grad_err,
        "grad_param": grad_param,
    }


def _load(path: str, attn: str, **dist_kwargs):
    return AutoModelForCausalLM.from_pretrained(
        path, attn_implementation=attn, dtype=torch.float32,
        distributed_config=cpbench.DistributedConfig(**dist_kwargs),
    )


def batch_kinds_worker(path: str, attn: str, kinds: list[str]) -> dict:
    """cp=2: every batch kind of the core issue, plus inputs_embeds and an odd sequence length."""
    model = _load(path, attn, cp_size=2)
    results = {"cp_plan": dict(model.cp_plan)}
    for kind in kinds:
        results[kind] = _parity(model, make_batch(kind), path, attn, 2)
    results["odd_length"] = _parity(model, make_batch("plain", seq_len=15), path, attn, 2)
    results["inputs_embeds"] = _parity(model, make_batch("plain"), path, attn, 2, embeds=True)
    results["refusals"] = _refusals(model)
    return results


def _refusals(model) -> dict:
    batch = make_batch("plain")
    messages = {}
    for name, call in {
        "use_cache": lambda: model(**batch, use_cache=True),
        "past_key_values": lambda: model(**batch, past_key_values=object()),
        "generate": lambda: model.generate(batch["input_ids"], max_new_tokens=2),
    }.items():
        try:
            call()
            messages[name] = None
        except ValueError as e:
            messages[name] = str(e)
    return messages


def gqa_worker(path: str, attn: str) -> dict:
    """cp=4 on a model with fewer kv heads than ranks (kv heads are replicated, not refused)."""
    model = _load(path, attn, cp_size=4)
    return {kind: _parity(model, make_batch(kind, seq_len=16), path, attn, 4) for kind in ("plain", "packed")}


def _dp_parity(path: str, attn: str, dp_index: int, dp_size: int, **dist_kwargs) -> dict:
    """Each dp rank gets its own batch; FSDP must average the dp batches' gradients."""
    model = _load(path, attn, **dist_kwargs)
    batches = [make_batch("plain", seed=10 + i) for i in range(dp_size)]
    refs = [reference(path, b, attn) for b in batches]
    return _parity(model, batches[dp_index], path, attn, dist_kwargs["cp_size"], refs=refs)


def fsdp_cp_worker(path: str, attn: str) -> dict:
    """4 ranks: cp=2 x fsdp=2, then dp_replicate=2 x cp=2 (rank = dp_index * 2 + cp_index in both)."""
    dp_index = int(os.environ["RANK"]) // 2
    return {
        "fsdp2_cp2": _dp_parity(path, attn, dp_index, 2, fsdp_size=2, cp_size=2),
        "replicate2_cp2": _dp_parity(path, attn, dp_index, 2, dp_replicate_size=2, cp_size=2),
    }


def usp_fsdp_worker(path: str, attn: str) -> dict:
    """8 ranks: fsdp=2 x cp=4, the cp group as 2 ring groups x 2 Ulysses ranks (cp_usp)."""
    dp_index = int(os.environ["RANK"]) // 4
    return _dp_parity(path, attn, dp_index, 2, fsdp_size=2, cp_size=4, cp_ulysses_degree=2,
                      cp_plan={"model.layers.*.self_attn": "cp_usp"})


def fsdp_cp_workers(paths: list[str], attn: str) -> list[dict]:
    return [fsdp_cp_worker(path, attn) for path in paths]


CALLS = {"n": 0, "inner_sees": set()}


def counting_ulysses(module, query, key, value, attention_mask, *, inner, **kwargs):
    """A custom style: Ulysses that counts its calls (to show the plan routes attention through it) and records
    which attention implementation the model's inner attention function sees on the module it is handed."""
    from cpbench.cp.ulysses import ulysses_attention

    def recording_inner(mod, *args, **kw):
        CALLS["inner_sees"].add(mod.config._attn_implementation)
        return inner(mod, *args, **kw)

    CALLS["n"] += 1
    return ulysses_attention(module, query, key, value, attention_mask, inner=recording_inner, **kwargs)


def custom_style_worker(path: str, attn: str) -> dict:
    cpbench.register_attention_style("test_counting_ulysses", counting_ulysses, replace=True)
    model = _load(path, attn, cp_size=2, cp_plan={"model.layers.*.self_attn": "test_counting_ulysses"})
    CALLS["n"], CALLS["inner_sees"] = 0, set()
    result = _parity(model, make_batch("packed"), path, attn, 2)
    return {"calls": CALLS["n"], "inner_sees": CALLS["inner_sees"], "plan": dict(model.cp_plan), **result}


def save_worker(path: str, attn: str, out_dir: str) -> dict:
    """save_pretrained gathered and as a distributed checkpoint, each reloaded and compared."""
    model = _load(path, attn, cp_size=2)
    with torch.no_grad():  # make the weights differ from the file we loaded, so a no-op save cannot pass
        for p in model.parameters():
            p.add_(0.01)
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}
    gathered, dcp = f"{out_dir}/gathered", f"{out_dir}/dcp"
    model.save_pretrained(gathered)
    model.save_pretrained(dcp, distributed_checkpoint=True)
    dist.barrier()
    plain = AutoModelForCausalLM.from_pretrained(gathered, dtype=torch.float32)  # no cpbench involved
    reloaded = _load(dcp, attn, cp_size=2)
    back = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in reloaded.state_dict().items()}
    plain_sd = plain.state_dict()
    return {
        "gathered_max_diff": max((plain_sd[k] - v).abs().max().item() for k, v in full.items()),
        "dcp_max_diff": max((back[k] - v).abs().max().item() for k, v in full.items()),
        "gathered_keys_match": set(plain_sd) == set(full),
    }


def parallelize_worker(family: str, attn: str) -> dict:
    """`cpbench.parallelize` on a `from_config` model, seeded identically on every rank."""
    import tempfile

    from tests.dist.models import save_tiny, tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family), attn_implementation=attn, dtype=torch.float32)
    path = save_tiny(family, tempfile.mkdtemp(), seed=0)  # the same seeded weights, for the reference
    model = cpbench.parallelize(model, cpbench.DistributedConfig(cp_size=2))
    return _parity(model, make_batch("plain"), path, attn, 2)


def heads_worker(path: str, attn: str) -> dict:
    """A base model under CP (this rank's hidden states), return_dict=False, and parallelize() twice."""
    from transformers import AutoModel

    batch = make_batch("plain", seq_len=15)
    base = AutoModel.from_pretrained(
        path, attn_implementation=attn, dtype=torch.float32, distributed_config=cpbench.DistributedConfig(cp_size=2)
    )
    hidden = base(input_ids=batch["input_ids"]).last_hidden_state.detach()
    layout = cpbench.SequenceLayout(15, 2, dist.get_rank(base.cp_group))
    ref = AutoModel.from_pretrained(path, attn_implementation=attn, dtype=torch.float32)
    ref_hidden = ref(input_ids=batch["input_ids"], use_cache=False).last_hidden_state.detach()
    results = {
        "hidden_shape": tuple(hidden.shape),
        "hidden_err": (cpbench.gather_sequence(hidden, layout, base.cp_group) - ref_hidden).abs().max().item(),
        "plan": dict(base.cp_plan),
    }
    try:
        base(input_ids=batch["input_ids"], use_cache=True)
        results["base_cache_refused"] = None
    except ValueError as e:
        results["base_cache_refused"] = str(e)
    lm = _load(path, attn, cp_size=2)
    as_tuple = lm(**batch, return_dict=False)
    results["tuple_loss"] = as_tuple[0].item()
    results["dict_loss"] = lm(**batch).loss.item()
    try:
        cpbench.parallelize(lm, cpbench.DistributedConfig(cp_size=2))
        results["parallelize_twice"] = None
    except ValueError as e:
        results["parallelize_twice"] = str(e)
    return results
