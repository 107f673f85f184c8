"""What a family's head does to the logits after its output projection, redone chunk by chunk by the chunked and
Liger losses (which never build the full logits, so never run the family's own code after the projection).

Read from the family's forward (family.py) as a sequence of elementwise ops, each exact per token and so per chunk:
a scale (cohere and cohere2: `logits * logit_scale`; falcon_h1: `* lm_head_multiplier`; hyperclovax:
`* config.logits_scaling`), a division (granite, granitemoe*: `/ config.logits_scaling`), a soft-cap (gemma2, gemma3,
gemma3n, gemma4, vaultgemma, nanochat, beam: `tanh(x / c) * c`; recurrent_gemma: the same on `logits_soft_cap`), and
a bias of the projection itself (phi, ctrl, codegen, gptj, modernbert-decoder, ernie4_5_moe with `use_bias`: read
from the module, whatever the forward). Anything else between the projection and the loss is refused for these
losses with the statement in the message (in transformers 5.23: inkling's vocabulary cut, inkling2's soft-cap module,
xlstm's, gemma4's assistants, musicgen's several heads, and the bert/roberta-style heads whose projection runs inside
a module with more layers); the full loss ("full") computes the family's own logits and needs none of this.
"""

from __future__ import annotations

import torch

from cpbench.cp.loss.family import head_form

Ops = tuple[tuple[str, object], ...]  # ("mul", v) | ("div", v) | ("tanh", None), applied in order


def softcap_ops(cap: float | None) -> Ops:
    """The soft-cap `tanh(x / cap) * cap` as gemma's forward writes it; none for a cap of None or 0."""
    return (("div", cap), ("tanh", None), ("mul", cap)) if cap else ()


def apply_ops(logits: torch.Tensor, ops: Ops) -> torch.Tensor:
    for kind, value in ops:
        if kind == "mul":
            logits = logits * value
        elif kind == "div":
            logits = logits / value
        else:
            logits = torch.tanh(logits)
    return logits


def logit_ops(model: torch.nn.Module, loss: str) -> Ops:
    """The ops `model`'s forward applies to its projection's output before its loss; refuses what it cannot redo."""
    head = model.get_output_embeddings()
    family = getattr(model.config, "model_type", None) or type(model).__name__
    fix = (f"Use the full loss (cpbench.use_loss(model, 'full')), which keeps {type(model).__name__}'s own logits.")
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"loss={loss!r}: {family}'s output projection is a {type(head).__name__}, not an nn.Linear "
                         f"(weight and optional bias) that cpbench can apply chunk by chunk. {fix}")
    path = next(name for name, module in model.named_modules() if module is head)
    if "." in path:  # e.g. roberta's lm_head.decoder: the forward calls lm_head, whose other layers are not read
        raise ValueError(f"loss={loss!r}: {family}'s output projection `{path}` runs inside "
                         f"`self.{path.split('.')[0]}`, whose other work cpbench cannot see. {fix}")
    form = head_form(type(model), path)
    if form.unknown is not None:
        raise ValueError(f"loss={loss!r}: {family} ({type(model).__name__}.forward) computes its logits with "
                         f"`{form.unknown}`, which cpbench's chunked losses do not reproduce. {fix}")
    return form.ops(model)
