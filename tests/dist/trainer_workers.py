"""transformers' Trainer and TRL's SFTTrainer as a user runs them, on spawned ranks (tests/dist/test_trainer.py).

`train(path, spec)` runs one script: the model from `path`, with `DistributedConfig(cp_size, fsdp_size, cp_plan)` when
`spec["cp"] > 1` (else plain, one process: the unsharded reference), the plain Trainer or SFTTrainer classes, a few
steps, then what the spec asks for (evaluate, predict, save_model). It returns what the loop logged and computed, the
same on every rank that reports it. The unsharded reference gets the same global batch: `dp` times the per-device
batch of the sharded run.
"""

from __future__ import annotations

import os

import torch

from tests.dist.models import VOCAB

STYLE_PLANS = {s: {"model.layers.*.self_attn": s} for s in ("cp_ulysses", "cp_ring", "cp_ring_zigzag", "cp_usp")}


def lm_dataset(rows: int = 16, seq_len: int = 32, seed: int = 0):
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, seq_len), generator=g).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def sft_dataset(rows: int = 24, seed: int = 0):
    """Documents of 5 to 39 tokens (ids >= 2: 0 pads, 1 ends), for TRL to pack."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 40, (rows,), generator=g).tolist()
    return Dataset.from_dict({"input_ids": [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in lengths]})


def _model(path: str, spec: dict):
    from transformers import AutoModelForCausalLM

    import cpbench

    kwargs = {}
    if spec["cp"] > 1:
        kwargs["distributed_config"] = cpbench.DistributedConfig(
            cp_size=spec["cp"], fsdp_size=spec.get("fsdp", 1), cp_plan=STYLE_PLANS[spec.get("style", "cp_ulysses")],
            cp_ulysses_degree=spec.get("ulysses_degree"))
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32, **kwargs)


def _args(spec: dict, out: str) -> dict:
    per_device = spec.get("batch", 2) * (spec.get("dp", 1) if spec["cp"] == 1 else 1)
    return dict(output_dir=out, per_device_train_batch_size=per_device, per_device_eval_batch_size=per_device,
                gradient_accumulation_steps=spec.get("ga", 1), max_steps=spec.get("steps", 3), logging_steps=1,
                learning_rate=1e-2, lr_scheduler_type="constant", report_to=[], use_cpu=True,
                save_strategy="steps" if spec.get("save_steps") else "no", save_steps=spec.get("save_steps") or 500,
                seed=0, include_num_input_tokens_seen="all", dataloader_drop_last=True, bf16=False,
                accelerator_config={"dispatch_batches": spec.get("dispatch")})


def train(path: str, spec: dict, out: str) -> dict:
    model = _model(path, spec)
    if spec.get("loop") == "sft":
        from transformers import AutoTokenizer
        from trl import SFTConfig, SFTTrainer

        args = SFTConfig(**_args(spec, out), packing=spec.get("packing", True), padding_free=spec.get("packing", True),
                         max_length=64)
        trainer = SFTTrainer(model=model, args=args, train_dataset=sft_dataset(),
                             processing_class=AutoTokenizer.from_pretrained(path))
    else:
        from transformers import Trainer, TrainingArguments

        data = lm_dataset().to_iterable_dataset() if spec.get("iterable") else lm_dataset()
        trainer = Trainer(model=model, args=TrainingArguments(**_args(spec, out)), train_dataset=data)
    steps_run = _StepCounter()
    trainer.add_callback(steps_run)
    trainer.train(resume_from_checkpoint=spec.get("resume"))
    result = {"log": trainer.state.log_history, "tokens": trainer.state.num_input_tokens_seen, "steps_run": steps_run.n}
    if spec.get("evaluate"):
        result["eval"] = trainer.evaluate(lm_dataset(rows=6, seq_len=24, seed=1))
    if spec.get("predict"):
        predicted = trainer.predict(lm_dataset(rows=4, seq_len=24, seed=2))
        result["predictions"] = torch.as_tensor(predicted.predictions)
    if spec.get("save"):
        trainer.save_model(spec["save"])
    result["rank"] = int(os.environ.get("RANK", 0))
    return result


class _StepCounter:
    """A TrainerCallback (duck-typed: transformers calls the events it has) counting this process's optimizer steps."""

    def __init__(self):
        self.n = 0

    def __getattr__(self, event):
        if not event.startswith("on_"):
            raise AttributeError(event)
        return lambda *args, **kwargs: None

    def on_step_end(self, *args, **kwargs):
        self.n += 1


def save_tokenizer(path) -> None:
    """A word-level tokenizer over the tiny vocabulary ("t0" ... "t95"): TRL needs one, and no hub is reachable."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", eos_token="t1", unk_token="t0").save_pretrained(path)
