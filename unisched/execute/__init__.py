"""Run any schedule for real on torch.distributed: compile it into per-rank
instruction lists, interpret them with non-blocking point-to-point transfers,
and record what ran when as a measured Timeline.

    trainer = unisched.Trainer(stages, simulation, loss_fn, optimizer)
    loss = trainer.step(inputs, targets)
    state = trainer.gather_state_dict()
    save_checkpoint(trainer, "ckpt")        # load_checkpoint(trainer, "ckpt") in any layout
"""

from __future__ import annotations

import importlib

# What each public name is imported from, on first use: importing this
# package (``unisched run --help`` does) must not load torch.
_WHERE = {
    "CheckpointError": "checkpoint_files",
    "checkpoint_state_dict": "checkpoint",
    "latest_checkpoint": "checkpoint_files",
    "load_checkpoint": "checkpoint",
    "save_checkpoint": "checkpoint",
    "CommunicationError": "faults",
    "ExecutionError": "faults",
    "NonFiniteLossError": "faults",
    "calibrate_costs": "measure",
    "predict": "measure",
    "Action": "program",
    "Message": "program",
    "Program": "program",
    "ProgramError": "program",
    "compile_program": "program",
    "parse_action": "program",
    "train_one_process": "reference",
    "Trainer": "runtime",
    "build_stages": "stages",
    "stages_from_state_dict": "stages",
    "ModelStages": "split",
    "SplitError": "split",
    "split_model": "split",
    "Tie": "ties",
}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'unisched.execute' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"unisched.execute.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


__all__ = [
    "Action",
    "CheckpointError",
    "CommunicationError",
    "ExecutionError",
    "Message",
    "ModelStages",
    "NonFiniteLossError",
    "Program",
    "ProgramError",
    "SplitError",
    "Tie",
    "Trainer",
    "build_stages",
    "calibrate_costs",
    "checkpoint_state_dict",
    "compile_program",
    "latest_checkpoint",
    "load_checkpoint",
    "parse_action",
    "predict",
    "save_checkpoint",
    "split_model",
    "stages_from_state_dict",
    "train_one_process",
]
