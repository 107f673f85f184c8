"""What cpbench refuses when a CP model meets transformers' Trainer, before anything runs (no process group: a stand-in
model that carries what cpbench reads of a CP model), and that the Trainer hook is in place whatever the import
order. The loops themselves run in tests/dist/test_trainer.py."""

import subprocess
import sys
import types

import pytest
import torch


class _CPStandIn(torch.nn.Linear):
    """What cpbench.cp.loops reads of a CP model: its cp group and its DistributedConfig's cp_size."""

    def __init__(self):
        super().__init__(2, 2)
        self.cp_group = object()
        self.config = types.SimpleNamespace(distributed_config=types.SimpleNamespace(cp_size=2))


def _args(**kwargs):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir="unused", use_cpu=True, report_to=[], **kwargs)


def _parallelism(**kwargs):
    from accelerate import ParallelismConfig

    return ParallelismConfig(**kwargs)


@pytest.mark.parametrize("settings, names", [
    (lambda: {"parallelism_config": _parallelism(cp_size=2)}, ["ParallelismConfig(cp_size=2)", "DistributedConfig"]),
    (lambda: {"parallelism_config": _parallelism(sp_size=2, sp_backend="deepspeed")}, ["sp_size=2", "DistributedConfig"]),
    (lambda: {"fsdp": True}, ["fsdp", "fsdp_size"]),
    (lambda: {"deepspeed": {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto"}},
     ["deepspeed", "fsdp_size"]),
    (lambda: {"train_sampling_strategy": "batch_rebalance"}, ["batch_rebalance", "'random'"]),
], ids=["accelerate-cp", "deepspeed-sp", "trainer-fsdp", "deepspeed", "batch-rebalance"])
def test_trainer_refuses_what_cannot_be_right_with_cp(settings, names):
    import cpbench.cp  # noqa: F401 - installs the Trainer hook
    from transformers import Trainer

    with pytest.raises(ValueError) as refused:
        Trainer(model=_CPStandIn(), args=_args(**settings()))
    for name in names:  # the setting, and the fix
        assert name in str(refused.value)


def test_a_model_without_cp_is_left_to_trainer():
    import cpbench.cp  # noqa: F401
    from transformers import Trainer

    trainer = Trainer(model=torch.nn.Linear(2, 2), args=_args(train_sampling_strategy="batch_rebalance"))
    assert "get_tp_size" not in vars(trainer) and "prediction_step" not in vars(trainer)


@pytest.mark.parametrize("order", ["cpbench first", "trainer first"])
def test_the_trainer_hook_is_installed_whatever_the_import_order(order):
    imports = ["import cpbench.cp", "from transformers import Trainer"]
    code = "; ".join(imports if order == "cpbench first" else imports[::-1]) + \
        "; from cpbench.cp.hf_compat.trainer import _ORIGINAL; assert Trainer.__init__ is not _ORIGINAL['init']"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
