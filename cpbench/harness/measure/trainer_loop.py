"""A point's tracked and timed steps driven by transformers' Trainer (`loop = "trainer"`), so that what Trainer adds
to a step (its input preparation, loss scaling, accelerate's backward and optimizer wrapper, gradient clipping, the
scheduler) is a row beside cpbench's own loop (`loop = "own"`, step.train_step).

The point's model (sharded as usual, its levers on), its optimizer and its batch: `Trainer.train()` runs the warmup
steps, each a memory segment (as step.tracked_steps: the smallest peak of identical steps counts), then the measured
steps, each timed; a callback opens and closes them at Trainer's own step boundaries (`on_step_begin`, `on_step_end`,
after the optimizer step and `zero_grad`). Every data-parallel rank gets the point's batch each step, as in cpbench's
own loop: the data set is that batch, repeated once per data-parallel rank, read in order. What Trainer does before a
step begins (fetching the batch, counting `num_items_in_batch` over the ranks) is outside the segments, as the own
loop has no data loading. Parity stays the first step's, run as in the own loop before Trainer starts.
"""

from __future__ import annotations

import contextlib
import tempfile

import torch
import torch.distributed as dist

from cpbench.harness.measure.collectives import CollectiveCounter


class _Rows(torch.utils.data.Dataset):
    """The point's batch, row by row, `copies` times (one per data-parallel rank)."""

    def __init__(self, batch: dict, copies: int):
        self.rows = {k: v.detach().cpu() for k, v in batch.items()}
        self.n = next(iter(self.rows.values())).shape[0]
        self.copies = copies

    def __len__(self) -> int:
        return self.n * self.copies

    def __getitem__(self, i: int) -> dict:
        return {k: v[i % self.n] for k, v in self.rows.items()}


def _callback(point, probe, timer, counter):
    from transformers import TrainerCallback

    class Segments(TrainerCallback):
        """Step i < warmup: a memory segment (the last one's collectives counted); after: a timed step."""

        def __init__(self):
            self.open = contextlib.ExitStack()

        def on_step_begin(self, args, state, control, **kwargs):
            i = state.global_step
            if i == 0:  # accelerate's optimizer wrapper re-made the state (load_state_dict) as Trainer prepared it
                probe.track_state()
            if i < point.warmup_steps:
                self.open.enter_context(probe.segment(repeat="step"))
                if i == point.warmup_steps - 1:
                    self.open.enter_context(counter)
            else:
                if point.world_size > 1:
                    dist.barrier()  # the step times of the ranks start together
                self.open.enter_context(timer.step())

        def on_step_end(self, args, state, control, **kwargs):
            self.open.close()

    return Segments()


def trainer_steps(point, model, optimizer, batch: dict, probe, timer) -> dict:
    """Runs the point's warmup (tracked) and measured (timed) steps through `Trainer.train()`; returns the counted
    collectives of the last tracked step, as step.tracked_steps does."""
    from transformers import Trainer, TrainingArguments, default_data_collator

    dp = point.world_size // point.cp_size
    model.config.use_cache = False  # as step.forward: no KV cache (CP refuses one; a cp 1 point would build it)
    counter = CollectiveCounter()
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    with tempfile.TemporaryDirectory(prefix="cpbench-trainer-") as out:
        args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=point.batch_size,
            max_steps=point.warmup_steps + point.measured_steps, max_grad_norm=point.max_grad_norm,
            train_sampling_strategy="sequential", logging_strategy="no", save_strategy="no", report_to=[],
            disable_tqdm=True, use_cpu=point.device != "cuda", dataloader_pin_memory=point.device == "cuda",
            seed=point.seed)
        trainer = Trainer(model=model, args=args, train_dataset=_Rows(batch, dp), data_collator=default_data_collator,
                          optimizers=(optimizer, schedule), callbacks=[_callback(point, probe, timer, counter)])
        with probe.host.levers(point, model, optimizer):
            trainer.train()
    return counter.columns()
