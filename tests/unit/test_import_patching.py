"""Importing cpbench patches transformers for the whole process (hf_compat.install): minimal, idempotent, and a
model loaded without `cp_size` is exactly the model transformers gives without cpbench imported."""

from __future__ import annotations

import subprocess
import sys

import torch

SCRIPT = """
import sys, torch
from transformers import AutoModelForCausalLM

def step(path):
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32)
    ids = torch.arange(24).reshape(2, 12) % 96
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return {"logits": out.logits.detach(), "loss": out.loss.detach(),
            "grads": {n: p.grad for n, p in model.named_parameters()}}

if __name__ == "__main__":
    assert "cpbench" not in sys.modules
    torch.save(step(sys.argv[1]), sys.argv[2])
"""


def test_a_model_without_cp_is_bit_for_bit_the_same_with_cpbench_imported(tmp_path):
    import cpbench.cp  # noqa: F401  (installs the patches in this process)
    from tests.dist.models import save_tiny

    path = save_tiny("qwen3", tmp_path / "model", tie_word_embeddings=True)
    subprocess.run([sys.executable, "-c", SCRIPT, path, str(tmp_path / "without.pt")], check=True,
                   capture_output=True)
    without = torch.load(tmp_path / "without.pt")
    namespace: dict = {}
    exec(SCRIPT, namespace)  # the same step, in this process, where cpbench is imported
    with_ = namespace["step"](path)
    assert torch.equal(without["logits"], with_["logits"]) and torch.equal(without["loss"], with_["loss"])
    assert without["grads"].keys() == with_["grads"].keys()
    assert all(torch.equal(g, with_["grads"][n]) for n, g in without["grads"].items())


def test_no_wrapper_is_left_on_a_model_loaded_without_cp(tmp_path):
    from transformers import AutoModelForCausalLM

    import cpbench  # noqa: F401
    from cpbench.cp.hf_compat import AttentionConfigView
    from tests.dist.models import save_tiny

    model = AutoModelForCausalLM.from_pretrained(save_tiny("llama", tmp_path / "m"), attn_implementation="sdpa")
    assert model.forward.__func__ is type(model).forward  # the class's own forward, not a wrapper
    assert not hasattr(model, "cp_state") and not hasattr(model, "cp_group")
    for module in model.modules():
        assert not hasattr(module, "_cpbench_attention")
        assert not isinstance(getattr(module, "config", None), AttentionConfigView)


def test_installing_twice_wraps_once():
    from transformers.distributed.mixin import DistributedMixin

    from cpbench.cp import apply, hf_compat

    before = (DistributedMixin.prepare_distribute_model.__func__, DistributedMixin.maybe_distribute_model.__func__)
    hf_compat.install(apply)
    hf_compat.install(apply)
    after = (DistributedMixin.prepare_distribute_model.__func__, DistributedMixin.maybe_distribute_model.__func__)
    assert before == after
