"""Tiny model configs, batches and the unsharded reference that the multi-rank parity tests compare against."""

from __future__ import annotations

import math

import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen3Config

VOCAB = 96

# fp32 tolerances. The CP run and the unsharded run compute the same sums in a different order (per-block
# softmax, per-rank partial sums, all-reduces), so they differ by accumulated rounding: a few ulp (fp32 eps is
# 1.2e-7) times the reduction depth. 1e-4 relative on gradients and 1e-5 on the loss leave ~100x headroom over
# what we observe (~1e-6) while still catching any real error (a dropped mask or a wrong slice gives >1e-2).
LOSS_RTOL = 1e-5
LOGITS_ATOL = 1e-4
GRAD_RTOL = 1e-4


def tiny_config(family: str, **overrides):
    common = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
    )
    if family == "qwen3":
        cfg = Qwen3Config(**{**common, "head_dim": 8, **overrides})
    elif family == "llama":
        cfg = LlamaConfig(**{**common, **overrides})
    elif family == "mistral":
        cfg = MistralConfig(**{**common, "sliding_window": 5, **overrides})
    elif family == "gemma3":
        cfg = Gemma3TextConfig(
            **{**common, "head_dim": 8, "sliding_window": 5, "layer_types": ["sliding_attention", "full_attention"],
               **overrides}
        )
    else:
        raise ValueError(family)
    return cfg


def save_tiny(family: str, path, seed: int = 0, **overrides) -> str:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides), dtype=torch.float32)
    model.save_pretrained(path)
    return str(path)


def make_batch(kind: str, seq_len: int = 16, batch: int = 2, seed: int = 1) -> dict:
    """A batch dict as a user would pass it: `input_ids`, `labels` and whatever `kind` adds."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq_len), generator=g)
    out = {"input_ids": ids, "labels": ids.clone()}
    if kind == "plain":
        pass
    elif kind == "packed":
        # Several documents per row; position_ids restart at 0 where a document starts.
        bounds = [0, seq_len // 3, seq_len // 3 + seq_len // 4, seq_len]
        pos = torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])])
        out["position_ids"] = pos.unsqueeze(0).expand(batch, -1).clone()
    elif kind in ("left_pad", "right_pad"):
        mask = torch.ones(batch, seq_len, dtype=torch.long)
        pads = [3, 0] if batch == 2 else [3] * batch
        for row, n in enumerate(pads):
            if n:
                if kind == "left_pad":
                    mask[row, :n] = 0
                else:
                    mask[row, -n:] = 0
        out["attention_mask"] = mask
        out["labels"] = ids.masked_fill(mask == 0, -100)
    elif kind == "ignore_labels":
        labels = ids.clone()
        labels[:, seq_len // 4 : seq_len // 2] = -100
        labels[0, -2] = -100
        out["labels"] = labels
    else:
        raise ValueError(kind)
    return out


def reference(path: str, batch: dict, attn: str, embeds: bool = False) -> dict:
    """The unsharded run of the same weights on the full batch: loss, logits, every parameter's gradient."""
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn, dtype=torch.float32)
    batch = embeds_batch(model, batch) if embeds else batch
    out = model(**batch, use_cache=False)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": out.loss.detach(), "logits": out.logits.detach(), "grads": grads}


def embeds_batch(model, batch: dict) -> dict:
    b = dict(batch)
    with torch.no_grad():
        b["inputs_embeds"] = model.get_input_embeddings()(b.pop("input_ids"))
    return b


def full_grads(model) -> dict:
    """Every parameter's gradient, gathered to full from FSDP shards (a collective: call on every rank)."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is not None:  # e.g. the embedding when inputs_embeds were passed
            out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out


def worst_grad_error(grads: dict, ref: dict) -> tuple[float, str]:
    if set(grads) != set(ref):
        return float("inf"), f"different parameters have gradients: {sorted(set(grads) ^ set(ref))}"
    worst, where = 0.0, ""
    for name, g in grads.items():
        r = ref[name]
        err = ((g - r).norm() / r.norm().clamp(min=1e-30)).item()
        if math.isnan(err):  # NaN compares false with everything: report it as the worst possible error
            return math.inf, f"{name} (NaN)"
        if err > worst:
            worst, where = err, name
    return worst, where
