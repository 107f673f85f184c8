"""Touch points with the training loops people run: transformers' `Trainer` (tested on 5.23) and TRL's `SFTTrainer`
(a Trainer; tested on TRL 1.16), with accelerate (>= 1.10) under them. Trainer already trains a model sharded at load
time by `from_pretrained(distributed_config=...)`: it neither wraps nor re-shards it. What it does not know is that
the ranks of a cp group share one batch. It knows ranks that do: tensor-parallel ranks, whose count its arithmetic
reads from `get_tp_size()` (the loss scale under `average_tokens_across_devices`, the divisor of the token count
`num_items_in_batch`, the total batch size). cpbench's CP model holds, on every rank of a cp group, the loss of the
whole sequences, as a tensor-parallel model does, so a cp group is such a group. What cpbench changes, on the one
Trainer whose model runs CP (every other Trainer is untouched):

1. `Trainer.__init__` (wrapped, the only class-level change): settings that cannot be right with cpbench's CP are
   refused before anything runs: accelerate's own context or sequence parallelism (`ParallelismConfig(cp_size=...,
   sp_size=...)`, torch's ring CP and DeepSpeed's Ulysses: a second split of a sequence cpbench already splits),
   DeepSpeed and Trainer's `fsdp` (a second sharding of a model `DistributedConfig` sharded at load time), the
   `batch_rebalance` sampler (which deals batches by world rank), `load_best_model_at_end` (it loads gathered weights
   into unsharded parameters). Trainer's own refusal of checkpoints that hold more than the weights (it cannot write
   the optimizer state of a model sharded at load time) is passed by (`save_only_model` set for its __init__ only),
   since point 8 writes it. Then the instance is adapted (`adapt`):
2. `get_tp_size()` counts the ranks that share a batch: tp x cp.
3. Data loaders: accelerate's `prepare_data_loader` shards by its `torch_device_mesh` when it has one, dealing the
   same batch to the ranks of its `tp` and `cp` axes (`process_index // (tp * cp)` of `dp_replicate x dp_shard`
   loaders: accelerate/data_loader.py). While the Trainer's accelerator prepares a data loader, it is handed a view
   of cpbench's mesh under those names (`MeshSizes`); the view carries sizes only, no process groups.
4. `Accelerator.gather_for_metrics` (Trainer's eval losses, logits and labels, TRL's metrics and token counts) keeps
   one copy of what a cp group gathered (the first cp rank's), before accelerate drops the last batch's padding.
5. `prediction_step` returns the logits of the whole sequences (`cpbench.gather_sequence`), where the model returns
   this rank's slice.
6. `_track_num_input_tokens` and `store_flos` count each token, and each FLOP, once per cp group.
7. TRL: `trl.trainer.sft_trainer.add_fused_lm_head` (the module's name for it, found once TRL is imported) is wrapped:
   on a CP model, the fused head's forward goes through `loop.fused_head_forward`, which hands it this rank's labels
   and returns its per-token outputs in the whole sequence's order.
8. Checkpoints: `_save_optimizer_and_scheduler`, `_load_from_checkpoint` and `_load_optimizer_and_scheduler` write and
   read the sharded weights and optimizer state with torch's distributed checkpoint (`loop.save_state`, at any mesh)
   and the scheduler as Trainer does (`SCHEDULER_NAME`); `save_model` writes the gathered weights as before.
   Accelerate's dispatched data loaders (`dispatch_batches`, its default for iterable datasets) are refused with the
   fix: they slice batches over every process.

`install_loops(loop)`: `loop` is the package cpbench.cp.loops, handed in (it imports the CP core, which imports this
package).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import inspect
import os
import sys

import torch

_ORIGINAL = {}


class MeshSizes:
    """What accelerate's `prepare_data_loader` reads of a device mesh: its axis names and each axis's `size()`."""

    class _Axis:
        def __init__(self, size: int):
            self._size = size

        def size(self) -> int:
            return self._size

    def __init__(self, **sizes: int):
        self._sizes = sizes
        self.mesh_dim_names = tuple(sizes)

    def __getitem__(self, name: str):
        return self._Axis(self._sizes[name])


def refuse_settings(args, accelerator=None) -> None:
    """Refuses what cannot be right together with cpbench's CP, naming both settings and the fix."""
    pc = getattr(args, "parallelism_config", None)
    if accelerator is not None and getattr(accelerator, "parallelism_config", None) is not None:
        pc = accelerator.parallelism_config  # an accelerate config file sets it there, not on `args`
    for name, what in (("cp_size", "torch's ring context parallelism"), ("sp_size", "DeepSpeed's Ulysses")):
        size = getattr(pc, name, None) or 1
        if size > 1:
            raise ValueError(
                f"accelerate's ParallelismConfig({name}={size}) ({what}) would split sequences that cpbench's "
                f"DistributedConfig(cp_size=...) already splits. Keep one: drop `{name}` from TrainingArguments' "
                "`parallelism_config` (or the accelerate config file), or load the model without cpbench's cp_size.")
    if getattr(args, "deepspeed", None) or getattr(args, "fsdp", None):
        which = "deepspeed" if getattr(args, "deepspeed", None) else "fsdp"
        raise ValueError(
            f"TrainingArguments({which}=...) would shard a model that cpbench's DistributedConfig sharded at load time "
            f"(FSDP2 over fsdp x cp). Drop `{which}` and set DistributedConfig(fsdp_size=...) for parameter sharding.")
    if getattr(args, "load_best_model_at_end", False):
        raise ValueError(
            "load_best_model_at_end=True reloads the best checkpoint's gathered weights into one process's "
            "parameters, which cpbench's FSDP2 shards over fsdp x cp. Leave it off and load the best checkpoint "
            "(trainer.state.best_model_checkpoint) with from_pretrained(..., distributed_config=...) after training.")
    if getattr(args, "train_sampling_strategy", None) == "batch_rebalance":
        raise ValueError(
            "train_sampling_strategy='batch_rebalance' deals batches by world rank, which would give the ranks of a "
            "cp group different sequences. Use 'random', 'sequential' or 'group_by_length' with cpbench's cp_size.")


def adapt(trainer, loop) -> None:
    """Points 2-6 above, on this Trainer instance."""
    model = trainer.model
    share = loop.sharing(model)
    accelerator = trainer.accelerator
    refuse_settings(trainer.args, accelerator)
    trainer.get_tp_size = lambda: share.share
    mesh = MeshSizes(dp_replicate=share.dp_replicate, dp_shard=share.fsdp, cp=share.cp, tp=share.tp)
    accelerator.prepare_data_loader = _with_mesh(accelerator, accelerator.prepare_data_loader, mesh)
    accelerator.gather_for_metrics = _one_copy(accelerator, accelerator.gather_for_metrics, share)
    prediction_step = trainer.prediction_step

    @functools.wraps(prediction_step)
    def whole_prediction_step(model_, inputs, *args, **kwargs):
        loss, logits, labels = prediction_step(model_, inputs, *args, **kwargs)
        ids = inputs.get("input_ids") if isinstance(inputs, dict) else None
        seq_len = ids.shape[1] if ids is not None else None
        return loss, (loop.whole_logits(model, logits, seq_len) if seq_len else logits), labels

    trainer.prediction_step = whole_prediction_step
    for name, counter in (("_track_num_input_tokens", "num_input_tokens_seen"), ("store_flos", "total_flos")):
        setattr(trainer, name, _once_per_group(trainer, getattr(trainer, name), counter, share.share))
    _resumable(trainer, loop)


def _resumable(trainer, loop) -> None:
    """Point 8: checkpoints that resume. Trainer writes the gathered weights (`save_model`) and, here, the sharded
    weights and optimizer state (`loop.save_state`, which reshards on load); it reads them back into a model of any
    mesh in place of its own, which load a whole state dict into one process's parameters."""
    from transformers.trainer import SCHEDULER_NAME

    def save_optimizer_and_scheduler(output_dir):
        loop.save_state(trainer.model, trainer.optimizer, output_dir)
        if trainer.args.should_save:
            torch.save(trainer.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def load_from_checkpoint(checkpoint, model=None):
        loop.load_state(model if model is not None else trainer.model, None, checkpoint)

    def load_optimizer_and_scheduler(checkpoint):
        if checkpoint is None:
            return
        loop.load_state(trainer.model, trainer.optimizer, checkpoint)
        schedule = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(schedule):
            trainer.lr_scheduler.load_state_dict(torch.load(schedule, weights_only=True))

    trainer._save_optimizer_and_scheduler = save_optimizer_and_scheduler
    trainer._load_from_checkpoint = load_from_checkpoint
    trainer._load_optimizer_and_scheduler = load_optimizer_and_scheduler


def _with_mesh(accelerator, prepare, mesh):
    @functools.wraps(prepare)
    def prepare_data_loader(data_loader, *args, **kwargs):
        dispatch = accelerator.dispatch_batches
        if dispatch is None:  # accelerate's default: dispatch an iterable dataset's batches from the first process
            dispatch = isinstance(data_loader.dataset, torch.utils.data.IterableDataset)
        if dispatch:
            raise ValueError(
                "accelerate's dispatch_batches (the default for an iterable dataset) slices each batch over every "
                "process, which would give the ranks of a cp group different sequences. Pass "
                "TrainingArguments(accelerator_config={'dispatch_batches': False}): each data-parallel rank then "
                "reads its own share of the stream, and the ranks of a cp group the same one.")
        state = accelerator.state
        before = state.device_mesh
        state.device_mesh = mesh
        try:
            return prepare(data_loader, *args, **kwargs)
        finally:
            state.device_mesh = before

    return prepare_data_loader


def _one_copy(accelerator, gather_for_metrics, share):
    gather = accelerator.gather

    def first_of_group(data):
        def pick(x):
            x = x.reshape(share.dp, share.share, -1, *x.shape[1:])[:, 0]
            return x.reshape(-1, *x.shape[2:])

        from accelerate.utils import recursively_apply

        return recursively_apply(pick, gather(data))

    @functools.wraps(gather_for_metrics)
    def one_copy(input_data, use_gather_object=False):
        if use_gather_object:
            raise ValueError("gather_for_metrics(use_gather_object=True) (eval_use_gather_object) is not supported "
                             "with cpbench's cp_size > 1: the ranks of a cp group gather the same objects. Leave "
                             "eval_use_gather_object off.")
        accelerator.gather = first_of_group  # what gather_for_metrics gathers with, for this call only
        try:
            return gather_for_metrics(input_data)
        finally:
            del accelerator.gather

    return one_copy


def _once_per_group(trainer, count, counter: str, share: int):
    @functools.wraps(count)
    def counted(*args, **kwargs):
        before = getattr(trainer.state, counter)
        out = count(*args, **kwargs)
        added = getattr(trainer.state, counter) - before
        setattr(trainer.state, counter, before + (added // share if isinstance(added, int) else added / share))
        return out

    return counted


def _wrap_fused_head(loop) -> None:
    """Point 7: TRL's fused LM head, once `trl.trainer.sft_trainer` is imported."""
    module = sys.modules.get("trl.trainer.sft_trainer")
    add = getattr(module, "add_fused_lm_head", None)
    if add is None or getattr(add, "_cpbench", False):
        return

    @functools.wraps(add)
    def add_fused_lm_head(model, *args, **kwargs):
        add(model, *args, **kwargs)
        if loop.cp_config(model) is not None:
            model.forward = loop.fused_head_forward(model, model.forward)

    add_fused_lm_head._cpbench = True
    module.add_fused_lm_head = add_fused_lm_head


def install_loops(loop) -> None:
    """Wraps `Trainer.__init__` (idempotent): now if transformers' trainer module is imported, else as it is imported
    (importing it here would cost every CP model most of a second, with or without a Trainer)."""
    if "transformers.trainer" in sys.modules:
        _wrap_init(sys.modules["transformers.trainer"].Trainer, loop)
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport("transformers.trainer", lambda m: _wrap_init(m.Trainer, loop)))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `then(module)` once the module `name` has been executed by its own loader."""

    def __init__(self, name: str, then):
        self.name, self.then = name, then

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module, then = spec.loader.exec_module, self.then

        def exec_then(module):
            exec_module(module)
            then(module)

        spec.loader.exec_module = exec_then
        return spec


def _wrap_init(trainer_cls, loop) -> None:
    if "init" in _ORIGINAL:
        return
    init = _ORIGINAL["init"] = trainer_cls.__init__
    signature = inspect.signature(init)

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        bound = signature.bind_partial(self, *args, **kwargs).arguments
        cp = loop.cp_config(bound.get("model")) is not None
        train_args = bound.get("args")
        if not cp:
            return init(self, *args, **kwargs)
        refuse_settings(train_args)
        _wrap_fused_head(loop)
        # Trainer refuses checkpoints of a model sharded at load time unless they hold the weights only, since it
        # cannot write such a model's optimizer state; cpbench writes it (point 8).
        whole = train_args is not None and not train_args.save_only_model
        if whole:
            train_args.save_only_model = True
        try:
            init(self, *args, **kwargs)
        finally:
            if whole:
                train_args.save_only_model = False
        adapt(self, loop)

    trainer_cls.__init__ = __init__
