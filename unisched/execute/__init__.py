"""Run any schedule for real on torch.distributed: compile it into per-rank
instruction lists, interpret them with non-blocking point-to-point transfers,
and record what ran when as a measured Timeline.

    trainer = unisched.Trainer(stages, simulation, loss_fn, optimizer)
    loss = trainer.step(inputs, targets)
    state = trainer.gather_state_dict()
"""

from unisched.execute.faults import CommunicationError, ExecutionError, NonFiniteLossError
from unisched.execute.measure import calibrate_costs, predict
from unisched.execute.program import Action, Message, Program, ProgramError, compile_program, parse_action
from unisched.execute.reference import train_one_process
from unisched.execute.runtime import Trainer, build_stages
from unisched.execute.split import ModelStages, SplitError, split_model

__all__ = [
    "Action",
    "CommunicationError",
    "ExecutionError",
    "Message",
    "ModelStages",
    "NonFiniteLossError",
    "Program",
    "ProgramError",
    "SplitError",
    "Trainer",
    "build_stages",
    "calibrate_costs",
    "compile_program",
    "parse_action",
    "predict",
    "split_model",
    "train_one_process",
]
