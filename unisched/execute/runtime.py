"""The runtime: one process per worker interprets its rank's program.

``Trainer(stages, schedule, loss_fn, optimizer)`` compiles the schedule
(:mod:`unisched.execute.program`), checks on every rank that all ranks agree
(world size, number of stages, parameter shapes) before any transfer, then
each ``step`` walks the rank's instruction list:

- receives are posted early with non-blocking ``irecv`` and awaited just
  before the item that reads them, so transfers overlap compute; sends are
  posted with ``isend`` right after the item that produces them, and their
  buffers let go as soon as they complete (polled after each item; on gloo,
  which marks a transfer completed only once it is waited on, most sends are
  waited on right after the first item that certainly follows the posting of
  their receive, :func:`~unisched.execute.program.settle_points`, and the
  other sends and each returned gradient's receive by one of a set of reused
  threads);
- what travels between stages is a tensor or a tuple, list or dict of
  tensors (a pytree); its structure, shapes and dtypes, and which of its
  tensors carry a gradient back, are agreed once by a shape probe, and each
  message carries all of its tensors in one buffer;
- a forward whose backward runs on the same rank keeps its autograd graph;
  otherwise it runs without one and its input travels (the *stash*) to the
  backward's rank, which recomputes the forward from it before going back;
- a rank's backwards that follow each other with no send, reduction or
  forward between them go to autograd in one call, as a plain loop's
  ``backward`` runs through every stage (:meth:`Trainer._backward_runs`);
- a rank that computes a stage it holds no weights of fetches them
  ``lookahead`` items before its first item of the stage and returns the stage's accumulated gradient after its
  last backward of that stage, then frees both; a weight worker takes in a
  returned gradient as soon as it arrives;
- replicas all-reduce each stage's gradient in one process group per
  replica set (created once), posted as soon as the stage's gradient is
  final on the rank; the per-micro-batch losses go to every rank likewise,
  posted after the rank's last loss (broadcast by the one rank that computes
  them all, else all-reduced);
- at the end everything is awaited, a NaN loss stops every rank with the
  same error before any weight changes, and the weight workers step their
  optimizers, after the options in :mod:`unisched.execute.training` say
  (fp16 loss scale, global-norm clipping, accumulation), after the copies
  of a weight several stages share have summed their gradients
  (:mod:`unisched.execute.ties`); stages' buffers kept by several ranks are
  averaged;
- each (stage, micro-batch) forward runs under an RNG seed of its own, so a
  recomputed forward draws the same dropout masks; ``evaluate`` walks the
  forward part of the program only.

Backends are chosen automatically: NCCL when CUDA is present, gloo on CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import queue
import socket
import threading
import time
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from unisched.errors import ShapeError, UniSchedError, first_line
from unisched.execute.agreement import all_gather_json, broadcast_json, built_from_json, built_json
from unisched.execute.faults import (
    CommunicationError,
    ExecutionError,
    FaultBoard,
    NonFiniteLossError,
    Watchdog,
    hosts_store,
)
from unisched.execute.measure import Clock, NotesLayout, assemble
from unisched.execute.process_group import compute_device, default_store, ensure_process_group
from unisched.execute.stages import is_factory, materialize
from unisched.execute.ties import Tie, TiedGradients, as_ties, check_ties, tied_weights
from unisched.execute.values import (
    Agreed,
    Layout,
    Wire,
    departure,
    describe,
    detached,
    facts_from_json,
    facts_json,
    input_bytes,
    layout_arguments,
    needing_grad,
    output_bytes,
    rows_of,
    rows_shape,
    split_batch,
)
from unisched.execute.training import (
    PRECISIONS,
    autocast,
    caught,
    check_options,
    check_optimizer,
    check_scheduler,
    global_norm,
    loss_scale as _loss_scale,
    generators,
    micro_batch_seeds,
    scalar_loss,
    seed_rng,
    stage_norm_squared,
    step_scheduler,
    to_compute_dtype,
)
from unisched.dataflow import first_backward
from unisched.execute.program import (
    Action,
    Program,
    ProgramError,
    Reads,
    compile_program,
    gradient,
    output,
    post_points,
    schedule_timeline,
    settle_points,
    topological_order,
    value_stage,
)
from unisched.timeline import Timeline
from unisched.work import BACKWARD, BACKWARD_WEIGHT, FORWARD, StageGraph, Work, as_stage_graph, is_whole

DEFAULT_TIMEOUT = 300.0
SETTLE_WITHIN = 8
"""On gloo, a send is waited on right after the first item of its rank
that certainly follows its receive's posting, if that is one of the next
``SETTLE_WITHIN`` items (:func:`~unisched.execute.program.settle_points`);
else in a waiting thread, which lets its buffer go sooner but takes the
processor from the ranks.  ``python benchmarks/executor.py --settle-within
0 3`` runs the runtime with other reaches beside this one; the figures
that chose 8 are in docs/executor.md (*Transfers*)."""


class Trainer:
    """Train ``stages`` under ``schedule`` on torch.distributed, one process per worker.

    ``stages``: one ``nn.Module`` per pipeline stage, built the same way on
    every rank, or a factory ``stage_index -> nn.Module``.  The Trainer calls
    a factory only for the stages this rank computes or holds weights of
    (``trainer.stages`` is None for the others), each under its own seed
    (``seed`` and the stage index, see :func:`build_stages`), so whichever
    rank builds a stage builds the same one; an error there stops every rank
    with the same message.  Only those stages are moved to the device.  The
    replicas of a stage (data parallel) start from the lowest replica rank's
    weights and buffers, broadcast at construction as
    ``DistributedDataParallel`` does, so that stages built apart (each rank
    under its own seed) do not train apart.

    What a stage takes and returns follows ``torch.distributed.pipelining``:
    a value (a stage's output, or the micro-batch at a source stage) is a
    tensor or a tuple, list or dict of tensors, nested as deep as you like;
    a tuple or list is unpacked into positional arguments of the stage that
    takes it, anything else (a tensor, a dict, a named tuple) is one
    argument.  A stage with several predecessors in the schedule's stage
    graph takes their values one after the other, in stage order.  Only
    floating tensors that need a gradient send one back; integer token ids
    and boolean masks travel forward only.  The structure, shapes and dtypes
    of every stage's output are agreed once by a shape probe (once for
    each structure, shapes and dtypes of the batch); an output that departs from them later stops
    every rank with an error naming the stage and the field.

    An item the schedule gives to a gang of workers runs on every member:
    a tensor-parallel gang (``Gang(..., collective=True)``) gives each
    member the whole micro-batch and the first member's output (the stage
    module, built for its member, does the collectives its shards need); a
    gang that splits rows gives member i the i-th share of the rows and
    gathers their outputs.  Weights held by a host worker (worker
    ``world_size + d``) are kept in rank d's host memory with their
    optimizer state, copied to the device for each step and released after.  ``schedule``: a :class:`unisched.Simulation` (or anything
    with ``.simulate()`` returning one, or a Timeline) for W = world size
    workers.  ``loss_fn(output,
    target)`` returns a scalar.  ``optimizer``: a callable ``params ->
    torch.optim.Optimizer``, run on the weight workers of each stage.
    ``timeout`` (seconds) bounds every wait and every step.

    Training options (docs/executor.md, *Training options*): ``precision``
    ``"fp32"``/``"bf16"``/``"fp16"`` (autocast, values between stages in the
    compute dtype, fp16 loss scaling agreed by all ranks, ``loss_scale``
    overriding GradScaler's defaults), ``clip_grad_norm`` (global L2 norm
    over every stage on every rank), ``scheduler`` (a factory ``optimizer
    -> LRScheduler``, stepped after each optimizer step), ``accumulate=k``
    (the optimizer steps every k-th ``step``), ``record`` (True, False, or
    N: every N-th step).  ``trainer.optimizer`` steps this rank's weights of
    truth in the order of its owned stages; ``trainer.scheduler``;
    :meth:`training_state` for checkpoints.

    ``ties`` (default: ``stages.ties``, which ``split_model`` records for a
    GPT-2's ``lm_head`` and ``wte``): weights several stages hold a copy of,
    kept one weight (:mod:`unisched.execute.ties`): the copies start as the
    first, and at each optimizer step every copy takes the sum of their
    gradients, all-reduced among the ranks that hold them; clipping counts
    the weight once.
    """

    def __init__(
        self,
        stages: Sequence[nn.Module],
        schedule: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        optimizer: Callable[[list], torch.optim.Optimizer],
        *,
        timeout: float = DEFAULT_TIMEOUT,
        lookahead: int = 1,
        record: bool | int = True,
        device: torch.device | str | None = None,
        seed: int = 0,
        precision: str = "fp32",
        clip_grad_norm: float | None = None,
        scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
        accumulate: int = 1,
        loss_scale: dict | None = None,
        ties: Sequence[Tie] | None = None,
    ):
        timeline, self.label, graph = schedule_timeline(schedule)
        ties = list(getattr(stages, "ties", ()) if ties is None else ties)
        error = caught(lambda: check_options(
            stages, loss_fn, optimizer, timeout=timeout, lookahead=lookahead, record=record, seed=seed,
            precision=precision, clip_grad_norm=clip_grad_norm, scheduler=scheduler, accumulate=accumulate,
            loss_scale_options=loss_scale))
        # a refused timeout still bounds the agreement that makes every rank raise
        self.timeout = float(timeout) if error is None else DEFAULT_TIMEOUT
        ensure_process_group(self.timeout)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.record = record
        self.loss_fn = loss_fn
        try:
            self.device = compute_device(device)
        except ShapeError as refused:  # agreed below, as the options are
            error, self.device = error or refused, torch.device("cpu")
        self._clock = Clock(self.device)
        self._generators = generators(self.device)
        self._seeds: tuple[int, list] = (-1, [])  # (step, micro_batch_seeds of that step)
        self.stages: list[nn.Module | None] = []
        self._mine: list[int] = []
        if error is None:
            self.precision, self._dtype = precision, PRECISIONS[precision]
            self.clip_grad_norm, self.accumulate, self._seed = clip_grad_norm, accumulate, seed
            self._scale = _loss_scale(precision, loss_scale)

        program = None
        try:
            if error is None:
                program = compile_program(
                    timeline, num_stages=None if is_factory(stages) else len(stages),
                    world_size=self.world_size, lookahead=lookahead, stage_graph=graph,
                )
                self._mine = sorted({a.stage for a in program.actions[self.rank] if a.is_compute}
                                    | {s for s, held in enumerate(program.replicas) if self.rank in held})
                self.stages = materialize(stages, program.num_stages, self._mine, seed)
                self._set_up_stages(program, optimizer, scheduler)
                ties = as_ties(ties)
                self._check_tie_copies(program, ties)
        except Exception as failed:
            error = failed
        delta = datetime.timedelta(seconds=self.timeout)
        self._control = dist.new_group(backend="gloo", timeout=delta)
        # the options every rank must share, as JSON (numpy numbers too); none are known after an error
        agreed = {} if error is not None else {
            "precision": precision, "clip_grad_norm": None if clip_grad_norm is None else float(clip_grad_norm),
            "accumulate": int(accumulate), "seed": int(seed), "loss_scale": self._scale.settings(),
            "record": record if isinstance(record, bool) else int(record)}
        try:
            self._agree(error, agreed)
            ties = self._agree_ties(ties)
        except BaseException:
            # every rank raises here together, so every rank releases the group
            dist.destroy_process_group(self._control)
            self._control = None
            raise
        self.program: Program = program
        self._p2p = dist.new_group(timeout=delta)
        self._watch_transfers = dist.get_backend(self._p2p) == "gloo"
        self._waiters = _Waiters()
        self._replica_groups = {g: dist.new_group(list(g), timeout=delta) for g in program.groups()}
        self._gang_groups = {g: dist.new_group(list(g), timeout=delta) for g in program.gang_groups()}
        self._buffer_groups = self._make_buffer_groups(delta)
        self._ties = TiedGradients(ties, program.replicas, self.rank, self.device, delta)
        self._collective(self._equalize_replicas, "making the replicas' weights equal")
        self._release_weights()  # after: an offloaded replica's device copy takes part in the broadcast
        self._collective(lambda: self._ties.synchronize(self._truth), "making the copies of tied weights equal")
        store = default_store()
        self._offsets, host = self._clock_offsets(store)
        self._board = FaultBoard(store, f"unisched/{self._control.group_name}", host)

        self._actions = program.actions[self.rank]
        self._inbound = {m.key: m for m in program.messages if m.dst == self.rank and m.letter not in "wr"}
        self._graph = program.stage_graph
        self._back = first_backward(program.split_backward)
        runs, self._fused = self._backward_runs()
        ran_before = {i for others in runs.values() for i in others}
        self._items = {i: self._item(i, a, runs.get(i, ()), i in ran_before)
                       for i, a in enumerate(self._actions) if a.is_compute}
        self._runs = {a.stage for a in self._actions if a.is_compute}
        self._first_forward = [program.compute_worker[Work(0, s, FORWARD)] for s in range(program.num_stages)]
        self._loss_stage = program.loss_stage
        self._last_loss_item = max(
            (i for i, a in enumerate(self._actions)
             if a.is_compute and a.stage == self._loss_stage and a.op == self._back.letter),
            default=-1,
        )
        self._loss_source = {forward_only: _loss_source(program, forward_only) for forward_only in (False, True)}
        self._last_use = self._last_uses()
        self._post_at = post_points(program, self.rank, lookahead)
        # on gloo, the sends waited on right after one of this rank's items, and those after its last item (the
        # step's end waits on them); a waiting thread waits on the others
        settle = settle_points(program, lookahead, SETTLE_WITHIN)[self.rank] if self._watch_transfers else {}
        self._settle = {index: frozenset(messages) for index, messages in settle.items()}
        last_item = max((i for i, a in enumerate(self._actions) if a.is_compute), default=-1)
        self._unwatched = frozenset().union(*self._settle.values()) | {
            a.message for a in self._actions[last_item + 1:] if a.is_send}
        self._forward_only = [i for i, a in enumerate(self._actions)
                              if a.op == "F" or ((a.is_send or a.is_recv) and a.op[0] in "Fw")]
        self._counts_norm = {s for s in self._owned if self.program.reduce_group(self.rank, s)[0] == self.rank}
        self._counted_elsewhere = {(s, self._index[s][name]) for s, name in self._ties.counted_elsewhere
                                   if s in self._counts_norm}
        self._meta: Agreed | None = None
        self._metas: dict[tuple, Agreed] = {}
        self._failed: str | None = None
        self._step_no = 0
        self._accumulated = 0
        self._held: dict[int, list[torch.Tensor | None]] = {}
        self._recording = False
        self._state: _StepState | None = None
        self._watchdog = Watchdog(self.timeout, self._on_timeout)
        self._notes_layout = NotesLayout(program)
        self._notes: list | None = None
        self._gathering: tuple | None = None  # a recorded step's gather of notes, while under way
        self._timeline: Timeline | None = None
        self.last_loss: float | None = None
        self.last_step_seconds: float = 0.0
        self.last_step_skipped = False
        self.last_grad_norm: float | None = None

    # ------------------------------------------------------------------ public
    def step(self, inputs: Any, targets: Any) -> float:
        """One training step on the full batch; returns the mean micro-batch loss on every rank.

        ``inputs`` and ``targets`` are tensors or tuples, lists or dicts of
        them; every tensor is split along its first dimension into the
        micro-batches.  The last stage's output for a micro-batch and that
        micro-batch of ``targets``, in their own structures, go to ``loss_fn``.
        With ``accumulate=k`` only every k-th step steps the optimizer; the
        others add their gradients up."""
        self._usable()
        batch = self._split(inputs, targets)  # a batch refused here is no step: the count stays
        self._step_no += 1
        self._recording = self._records(self._step_no)
        return self._guarded(batch, self._run)

    def evaluate(self, inputs: Any, targets: Any) -> float:
        """The mean micro-batch loss of ``inputs`` and ``targets`` on every
        rank, forward only: every stage in eval mode for the call (dropout
        off, BatchNorm on its running statistics; each submodule's flag
        restored after), under ``torch.no_grad``, with the precision's
        autocast.  No weight, buffer, gradient or optimizer state changes,
        nor the step count."""
        self._usable()
        self._recording = False
        return self._guarded(self._split(inputs, targets), self._run_forwards, evaluating=True)

    def training_state(self) -> dict:
        """The small state a checkpoint must keep, beside the weights and the
        optimizer's, for a resumed run to continue exactly: the number of
        steps taken (dropout masks derive from it), the fp16 loss scale and
        its run of good steps, the position in a gradient accumulation, and
        this rank's LR scheduler state (None without one)."""
        return {
            "step": self._step_no,
            "accumulated": self._accumulated,
            "loss_scale": self._scale.state(),
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
        }

    def load_training_state(self, state: dict) -> None:
        """Continue from :meth:`training_state` of an earlier run (load the
        weights and the optimizer state alongside).  A state saved between
        the steps of one accumulation is refused: its gradients so far are
        not part of it."""
        missing = {"step", "accumulated", "loss_scale"} - set(state)
        if missing:
            raise ShapeError(f"a training state needs the keys {sorted(missing)}; pass what training_state() returned")
        if state["accumulated"]:
            raise ShapeError(
                f"the training state was saved after {state['accumulated']} of {self.accumulate} accumulated steps, "
                f"whose gradients it does not hold; save it right after an optimizer step"
            )
        self._step_no = int(state["step"])
        self._accumulated = 0
        self._scale.load(state["loss_scale"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])

    def _usable(self) -> None:
        if self._failed is not None:
            raise ExecutionError(f"rank {self.rank}: this Trainer cannot step any more: {self._failed}; "
                                 f"build a new one (after a failed step, in new processes)")

    def _records(self, step: int) -> bool:
        """Whether step number ``step`` is recorded: every step with
        ``record=True``, every N-th with ``record=N``, none with False."""
        if isinstance(self.record, bool):
            return self.record
        return self.record > 0 and step % self.record == 0

    def _split(self, inputs, targets) -> tuple[list, TreeSpec, list]:
        """The batch in the program's micro-batches (:func:`split_batch`): the inputs' leaves,
        their structure, and each micro-batch's targets in theirs."""
        micro_in, spec, micro_t, target_spec = split_batch(inputs, targets, self.program.num_batches, self.device)
        return micro_in, spec, [leaves[0] if target_spec.is_leaf() else tree_unflatten(list(leaves), target_spec)
                                for leaves in micro_t]

    def _guarded(self, batch: tuple[list, TreeSpec, list], run: Callable[["_StepState"], float],
                 evaluating: bool = False) -> float:
        """``run`` a step on the split batch under the watchdog, turning any
        failure into one that names the first cause on every rank; the
        global RNG state is the caller's again afterwards."""
        micro_in, spec, micro_t = batch
        state = _StepState(self, micro_in, micro_t, evaluating)
        self._state = state
        ticket = self._watchdog.arm()
        try:
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                self._settle_gathering()
                self._load_host_weights()
                self._meta = self._layouts_for(spec, micro_in[0])
                loss = run(state)
            # inside the try: a timeout interrupt posted before this returns lands here
            self._watchdog.disarm(ticket)
        except NonFiniteLossError:
            self._watchdog.disarm(ticket)
            raise
        except BaseException as error:
            self._watchdog.disarm(ticket)
            raise self._failure(error, state) from error
        finally:
            self._state = None
        return loss

    def gather_state_dict(self) -> dict[str, torch.Tensor]:
        """``{"<stage>.<name>": tensor}``: every stage's weights of truth, on
        every rank (CPU tensors); of a stage sharded over a tensor-parallel
        gang, shard 0 (:meth:`gather_shares` gives every shard)."""
        return {f"{s}.{name}": tensor for s in range(self.program.num_stages)
                for name, tensor in self.gather_shares(s)[0].items()}

    def gather_shares(self, stage: int) -> list[dict[str, torch.Tensor]]:
        """Per share of ``stage``'s weights (one, or one per member of a
        tensor-parallel gang), its state dict as its first holder has it, on
        every rank (CPU tensors)."""
        shares = self.program.shares[stage]
        owners = [min(h for h, share in shares.items() if share == i) for i in sorted(set(shares.values()))]
        self._load_host_weights()
        out = []
        for owner in owners:
            state = {}
            mine = self.stages[stage].state_dict() if self.rank == owner else {}
            for name, (shape, dtype) in self._state_specs[stage].items():
                buffer = (mine[name].detach().clone() if self.rank == owner
                          else torch.empty(shape, dtype=dtype, device=self.device))
                dist.broadcast(buffer, src=owner, group=self._p2p)
                state[name] = buffer.cpu()
            out.append(state)
        self._release_weights()
        return out

    def calibrate(self, inputs: Any, targets: Any, steps: int = 3, **options):
        """Run ``steps`` profiling steps (they train) and fit Costs to all but
        the first (a warm-up), so ``steps`` must be at least 2; same Costs on
        every rank, with the sizes of :meth:`memory_sizes` and the tied
        weights the Trainer keeps (``Costs.tied_weights``)."""
        from unisched.execute.measure import calibrate_costs

        if not is_whole(steps, 2):
            raise ShapeError(
                f"calibrate needs steps >= 2 (the first is a warm-up the costs leave out), got {steps!r}"
            )
        record, self.record = self.record, True
        timelines = []
        try:
            for _ in range(steps):
                self.step(inputs, targets)
                timelines.append(self.last_timeline)
        finally:
            self.record = record
        from unisched.costs import Costs

        fitted = calibrate_costs(timelines[1:], **options).to_dict() if self.rank == 0 else None
        if self.world_size > 1:
            fitted = broadcast_json(fitted, src=0, group=self._control)
        return dataclasses.replace(Costs.from_dict(fitted), **self.memory_sizes(), tied_weights=self.tied_weights)

    @property
    def tied_weights(self):
        """The tied weights this Trainer keeps, as the simulator's
        ``Costs.tied_weights`` (the same on every rank)."""
        return tied_weights(self._ties.ties, self._state_specs)

    def memory_sizes(self) -> dict[str, list[float]]:
        """Per stage, from the real stages (every rank calls it; the same on
        every rank): ``optimizer_bytes``, the optimizer state its weight
        workers hold (after a step: Adam's moments exist from the first), and
        ``backward_workspace_bytes``, its largest parameter: the fresh
        gradient a backward makes before adding it to the accumulated one
        (autograd accumulates one parameter at a time), the part of a
        backward's working memory that grows with the weights; the
        activations' gradients are left out."""
        S = self.program.num_stages
        sizes = torch.zeros(2, S, dtype=torch.float64)
        for s in self._mine:
            sizes[0, s] = max((p.numel() * p.element_size() for p in self._templates[s]), default=0)
        state = self.optimizer.state if self.optimizer is not None else {}
        for s in self._owned:
            for p in self.host_weights.get(s, self._params[s]):
                sizes[1, s] += sum(t.numel() * t.element_size() for t in state.get(p, {}).values()
                                   if isinstance(t, torch.Tensor))
        if self.world_size > 1:
            self._collective(lambda: dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=self._control),
                             "agreeing on the stages' memory sizes")
        return {"backward_workspace_bytes": sizes[0].tolist(), "optimizer_bytes": sizes[1].tolist()}

    @property
    def control_group(self):
        """The Trainer's gloo process group, for CPU collectives among all its
        ranks on any backend (checkpoint agreement, metadata)."""
        return self._control

    def close(self) -> None:
        """Release the trainer's process groups and its watchdog (every rank calls it)."""
        self._watchdog.stop()
        if self._gathering is not None and not self._failed:
            try:
                self._settle_gathering()
            except CommunicationError:
                pass  # a peer is gone: there is nothing left to gather, and the groups go below
        self._gathering = None
        self._failed = self._failed or "it was closed"
        buffer_groups = {id(group): group for group, _ in self._buffer_groups.values()}
        groups = [g for g in (*self._replica_groups.values(), *self._gang_groups.values(), *buffer_groups.values(),
                              self._p2p, self._control) if g is not None]
        self._replica_groups, self._gang_groups, self._buffer_groups, self._p2p, self._control = {}, {}, {}, None, None
        self._ties.close()
        self._waiters.close()
        if dist.is_initialized():
            for group in groups:
                dist.destroy_process_group(group)

    def __repr__(self) -> str:
        return (f"<Trainer {self.label} rank {self.rank}/{self.world_size}: S={self.program.num_stages} "
                f"B={self.program.num_batches}, {len(self._actions)} actions>")

    # ------------------------------------------------------------------ set-up checks
    def _set_up_stages(self, program: Program, optimizer, scheduler) -> None:
        """Local set-up that may fail on one rank only (user code: the
        optimizer and scheduler factories, moving stages): done before the
        ranks agree.  The optimizer steps the weights of truth this rank
        holds: the stage's own parameters, or their host copies where they
        are offloaded; the scheduler is built on it."""
        for s in self._mine:
            self.stages[s].to(self.device)
        self._params = [[] if stage is None else [p for p in stage.parameters() if p.requires_grad]
                        for stage in self.stages]
        self._index = [{} if stage is None else                       # name -> index in _params[s]
                       {name: i for i, name in enumerate(n for n, p in stage.named_parameters() if p.requires_grad)}
                       for stage in self.stages]
        self._owned = [s for s in range(program.num_stages) if self.rank in program.replicas[s]]
        self.weight_bytes = [float(sum(p.numel() * p.element_size() for p in ps)) for ps in self._params]
        self._templates = [[torch.empty_like(p, device="meta") for p in ps] for ps in self._params]
        self._state_specs = [None if stage is None else {name: (t.shape, t.dtype) for name, t in stage.state_dict().items()}
                             for stage in self.stages]
        self._fetch = {m.stage: m for m in program.messages if m.dst == self.rank and m.letter == "w"}
        pin = self.device.type == "cuda"
        self.host_weights: dict[int, list[nn.Parameter]] = {
            s: [nn.Parameter(_host_copy(p, pin)) for p in self._params[s]]
            for s in self._owned if (self.rank, s) in program.offloaded
        }
        truth = [p for s in self._owned for p in self.host_weights.get(s, self._params[s])]
        self.optimizer = None
        if truth:  # a rank holding no weights of truth has no optimizer
            self.optimizer = optimizer(truth)
            check_optimizer(self.optimizer)
        self.scheduler = None
        if scheduler is not None and self.optimizer is not None:
            self.scheduler = scheduler(self.optimizer)
            check_scheduler(self.scheduler)
        self._buffer_specs = [None if stage is None else [(tuple(b.shape), b.dtype) for b in _buffers(stage)]
                              for stage in self.stages]
        self._flat_grads = {
            s: _flat_like(self._params[s], self.device)
            for s in self._owned if len(program.reduce_group(self.rank, s)) > 1 and self._params[s]
        }

    def _equalize_replicas(self) -> None:
        """Each replicated stage's parameters (frozen ones too) and buffers made its lowest
        replica's on every replica, in stage order so that every rank broadcasts in one order;
        run while every device copy is whole (before offloaded ones are released), the host
        copies of offloaded weights of truth then taken from them."""
        for s in self._owned:
            group = self.program.reduce_group(self.rank, s)
            if len(group) < 2:
                continue
            for tensor in [*self.stages[s].parameters(), *_buffers(self.stages[s])]:
                dist.broadcast(tensor.data, src=group[0], group=self._replica_groups[group])
            with torch.no_grad():
                for host, p in zip(self.host_weights.get(s, ()), self._params[s]):
                    host.copy_(p)

    def _check_tie_copies(self, program: Program, ties: Sequence[Tie]) -> None:
        """Each copy of a tied weight this rank builds is a trainable
        parameter of its stage, and no tie reaches a stage that a
        tensor-parallel gang holds in shards."""
        for tie in ties:
            for s, name in tie.copies:
                if not 0 <= s < program.num_stages:
                    raise ShapeError(f"the tie {tie} names stage {s}, but the schedule has {program.num_stages} stages")
                if len(set(program.shares[s].values())) > 1:
                    raise ShapeError(f"the tie {tie} reaches stage {s}, which a tensor-parallel gang holds in "
                                     f"shards; tie only weights of stages held whole")
                if self.stages[s] is not None and name not in self._index[s]:
                    raise ShapeError(f"the tie {tie} names {name!r}, which is not a trainable parameter of stage "
                                     f"{s}; name the copy as the stage's named_parameters() do")

    def _agree_ties(self, ties: Sequence) -> tuple[Tie, ...]:
        """The ties, checked against every stage's weights and the same on every rank."""
        checked = check_ties(ties, self._state_specs)
        seen = all_gather_json([[t.name, [list(c) for c in t.copies]] for t in checked], self._control,
                               self.world_size)
        for rank, theirs in enumerate(seen):
            if theirs != seen[0]:
                raise ProgramError(f"rank {rank} was given other tied weights ({theirs}) than rank 0 ({seen[0]}); "
                                   f"give every rank the same stages")
        return checked

    def _truth(self, s: int, name: str) -> torch.Tensor:
        """This rank's weight of truth of parameter ``name`` of stage ``s`` (a host copy where offloaded)."""
        return self.host_weights.get(s, self._params[s])[self._index[s][name]]

    def _agree(self, error: Exception | None, options: dict) -> None:
        """Every rank learns every rank's verdict, so all raise together
        instead of hanging; every rank was given the same ``options`` (a
        clipping norm on one rank alone waits for the others' norms); ranks
        that built the same stage check that they built it alike, and every
        rank learns the sizes of the stages it did not build."""
        built = {}
        if error is None:
            built = {s: ([tuple(p.shape) for p in self.stages[s].parameters()], self._state_specs[s],
                         self.weight_bytes[s], self._buffer_specs[s]) for s in self._mine}
        message = None
        if error is not None:
            message = str(error) if isinstance(error, UniSchedError) else f"{type(error).__name__}: {error}"
        verdicts = all_gather_json([message, built_json(built), options], self._control, self.world_size)
        if error is not None:
            raise error
        for rank, (message, _, _) in enumerate(verdicts):
            if message is not None:
                raise ProgramError(f"rank {rank} cannot run this schedule: {message}")
        first = verdicts[0][2]
        for rank, (_, _, theirs) in enumerate(verdicts):
            for key in first:
                if theirs[key] != first[key]:
                    raise ProgramError(f"rank {rank} was given {key}={theirs[key]!r} but rank 0 {key}={first[key]!r}; "
                                       "give every rank the same Trainer options")
        for rank, (_, theirs, _) in enumerate(verdicts):
            for s, (shapes, specs, nbytes, buffers) in sorted(built_from_json(theirs).items()):
                if s in built and shapes != built[s][0]:
                    raise ProgramError(
                        f"rank {rank}'s stage {s} has parameters of shapes {shapes[:4]} but rank {self.rank}'s "
                        f"{built[s][0][:4]}; build the stages the same way on every rank"
                    )
                if self._state_specs[s] is None:
                    self._state_specs[s], self.weight_bytes[s], self._buffer_specs[s] = specs, nbytes, buffers

    def _make_buffer_groups(self, delta) -> dict[int, tuple[Any, bool]]:
        """Per stage with buffers that several ranks keep (replicas, or ranks
        that run its forwards), the process group that averages them at the
        end of each step, and whether this rank runs any of its forwards; a
        stage a tensor-parallel gang runs keeps each shard's buffers apart.
        Every rank makes every group, in one order."""
        program = self.program
        keepers: dict[int, tuple[int, ...]] = {}
        for s in range(program.num_stages):
            forwards = [Work(b, s, FORWARD) for b in range(program.num_batches)]
            if not self._buffer_specs[s] or any(w in program.gangs and program.gangs[w].collective for w in forwards):
                continue
            members = tuple(sorted(set(program.replicas[s]).union(*(program.members(w) for w in forwards))))
            if len(members) > 1:
                keepers[s] = members
        groups = {g: dist.new_group(list(g), timeout=delta) for g in sorted(set(keepers.values()))}
        return {s: (groups[members], any(self.rank in program.members(Work(b, s, FORWARD))
                                         for b in range(program.num_batches)))
                for s, members in keepers.items() if self.rank in members}

    def _clock_offsets(self, store) -> tuple[list[float], int | None]:
        """Per-rank clock offsets (zero on one host, where perf_counter is
        shared; barrier-aligned across hosts), and the rank whose process
        serves ``store`` (None when none does, as under torchrun)."""
        dist.barrier(group=self._control)
        now = time.perf_counter()
        seen = all_gather_json([socket.gethostname(), now, hosts_store(store)], self._control, self.world_size)
        host = next((rank for rank, (_, _, serves) in enumerate(seen) if serves), None)
        if len({name for name, _, _ in seen}) == 1:
            return [0.0] * self.world_size, host
        return [t for _, t, _ in seen], host

    def _layouts_for(self, spec: TreeSpec, leaves: tuple[torch.Tensor, ...]) -> "Agreed":
        """The layouts agreed for micro-batches like ``leaves``: remembered
        (a few, so that evaluating on other shapes does not probe again at
        every switch), or found by the shape probe, which every rank runs at
        the same step since every rank sees the same batches."""
        signature = (spec, tuple((t.shape, t.dtype) for t in leaves))
        meta = self._metas.pop(signature, None)
        if meta is None:
            self._stand_in_weights()  # the step's fetches replace them
            meta = self._agree_layouts(signature, tree_unflatten(list(leaves), spec))
        self._metas[signature] = meta
        while len(self._metas) > 8:
            del self._metas[next(iter(self._metas))]
        return meta

    def _agree_layouts(self, signature, sample) -> "Agreed":
        """What travels in steps whose micro-batches look like ``sample``:
        its own layout and every stage's output's, from the shape probe."""
        source = Layout.make(*describe(sample, "inputs", grads=False)[1])
        outputs = self._infer_shapes(sample, self._graph)
        inputs = [[outputs[p] for p in preds] or [source] for preds in self._graph.predecessors]
        return Agreed(signature, source, outputs, inputs)

    def _infer_shapes(self, sample: Any, graph: StageGraph | None = None) -> list[Layout]:
        """The :class:`Layout` of every stage's output for one micro-batch
        (every transferred value is a stage's output or its gradient): its
        structure, shapes and dtypes, and which of its tensors need a gradient.

        In topological order of the stage graph, the ranks that compute a
        stage run it (on their own predecessors' outputs, zeros of the agreed
        layout for the others'), and the rank that runs its first forward
        tells every rank what it returned; a stage no rank here computes is
        never run here.  The probe runs in eval mode, so that it leaves no
        trace in the stages' state (BatchNorm running statistics); each
        submodule's training flag is restored afterwards.  It runs with
        autograd on, the inputs that carry a gradient needing one, so that
        it learns which outputs do; each stage's graph is dropped at once."""
        graph = as_stage_graph(len(self.stages), graph)
        source = Layout.make(*describe(sample, "inputs", grads=False)[1])
        sample_leaves = tuple(tree_flatten(sample)[0])
        layouts: dict[int, Layout] = {}
        outputs: dict[int, tuple[torch.Tensor, ...]] = {}
        with self._in_eval_mode(), torch.enable_grad(), torch.random.fork_rng(
                devices=[self.device] if self.device.type == "cuda" else []):
            for s in topological_order(graph):
                told = None
                if s in self._runs:
                    preds = graph.predecessors[s]
                    xs = [needing_grad(layouts[p], outputs[p] if p in outputs else layouts[p].zeros(self.device))
                          for p in preds]
                    mine, told = self._probe(s, layout_arguments([layouts[p] for p in preds] or [source],
                                                           xs or [sample_leaves]))
                    if mine is not None:
                        outputs[s] = mine
                heard = [facts_json(told)]
                if self.world_size > 1:
                    heard = all_gather_json(heard[0], self._control, self.world_size)
                failed = next((h for h in heard if isinstance(h, str)), None)
                if failed is not None:
                    raise _ProbeFailed(failed)
                layouts[s] = Layout.make(*facts_from_json(heard[self._first_forward[s]]))
        return [layouts[s] for s in range(len(self.stages))]

    @contextlib.contextmanager
    def _in_eval_mode(self):
        """This rank's stages in eval mode, each submodule's training flag restored after."""
        modes = [(module, module.training) for s in self._mine for module in self.stages[s].modules()]
        try:
            for s in self._mine:
                self.stages[s].eval()
            yield
        finally:
            for module, training in modes:
                module.training = training

    def _probe(self, s: int, args: list) -> tuple[tuple[torch.Tensor, ...] | None, tuple | str]:
        """Stage ``s`` run once on ``args`` for the shape probe: its output's
        tensors (detached: its graph goes with this call) and the facts of
        its layout, or what went wrong."""
        try:
            leaves, facts = describe(self._call(s, args), f"stage {s} output", grads=True)
            return detached(leaves), facts
        except ShapeError as error:
            return None, f"{error} (on rank {self.rank})"
        except Exception as error:
            return None, f"stage {s} raised {type(error).__name__}: {first_line(error)} on rank {self.rank}"

    # ------------------------------------------------------------------ the step
    def _run(self, st: "_StepState") -> float:
        """Walk this rank's program for one training step, then finish it."""
        self._clear_gradients()
        for s, flat in self._flat_grads.items():
            flat.zero_()
            for p, view in zip(self._params[s], _split(flat, self._params[s])):
                p.grad = view
        if self._recording and self.world_size > 1:
            self._collective(lambda: dist.barrier(group=self._control), "the barrier that starts a recorded step")
        st.begin = st.clock.begin()
        if self._last_loss_item < 0:
            self._post_losses(st)
        self._walk(st, range(len(self._actions)))
        return self._finish(st)

    def _walk(self, st: "_StepState", indices) -> None:
        """Carry out the actions at ``indices`` of this rank's program, in order."""
        actions, items, last_use = self._actions, self._items, self._last_use
        for index in indices:
            action = st.current = actions[index]
            if st.deferred:
                self._post_due(st, index)  # a receive posted puts nothing on the compute stream
            item = items.get(index)
            if item is not None:
                self._compute(st, action, item)
                if index in st.settle:
                    self._settle_sends(st, st.settle[index])
                if (st.outgoing or st.pending) and self._reap(st):
                    st.last_end = None  # waits on sends or returned gradients added: the stream has more
                if index == self._last_loss_item:
                    self._post_losses(st)
                    st.last_end = None
            elif action.is_recv:
                self._post_or_defer(st, action, index)
            elif action.is_send:
                self._post_send(st, action)
            elif action.op == "R":
                self._post_reduce(st, action)
            if index in last_use:
                self._release_data(last_use[index])
        st.current = None

    def _run_forwards(self, st: "_StepState") -> float:
        """Walk the forward part of this rank's program (forwards, their
        activations and the weight fetches), the loss computed right after
        the last stage's forward; the mean loss, on every rank."""
        with torch.no_grad(), self._in_eval_mode():
            st.begin = time.perf_counter()
            self._walk(st, self._forward_only)
            self._post_due(st, math.inf)
            self._await_transfers(st)
            self._post_losses(st, at_end=True)
            self._collective(st.loss_work.wait, "the exchange of the losses")
        self._release_weights()
        return float(st.loss_sum.mean())

    def _post_losses(self, st, at_end: bool = False) -> None:
        """Post the exchange of the per-micro-batch losses once this rank has
        computed its last one, so that it overlaps the rest of the step: a
        broadcast from the one rank that computes them all (a pipeline's
        last stage), else an all-reduce (replicas each compute some).  On
        gloo the all-reduce waits on every rank's transport thread, which a
        rank busy computing runs late (``benchmarks/executor.py
        --all-reduce-losses`` measures the difference).  On a GPU,
        reading the losses at once would make the host wait for the GPU:
        they are copied to the host without waiting, and the exchange is
        posted at the step's end (``at_end``), when the copy has long arrived."""
        if st.loss_copy is None:
            st.loss_copy = self._copy_losses(st)
            if st.loss_copy[1] is not None and not at_end:
                return
        st.loss_sum, copied = st.loss_copy
        if copied is not None:
            copied.synchronize()
        if self.world_size == 1:
            st.loss_work = _DONE
            return
        source = self._loss_source[st.evaluating]
        try:
            if source is None:
                st.loss_work = dist.all_reduce(st.loss_sum, group=self._control, async_op=True)
            else:
                st.loss_work = dist.broadcast(st.loss_sum, src=source, group=self._control, async_op=True)
        except Exception as error:
            raise CommunicationError(f"rank {self.rank} could not post the exchange of the losses ({first_line(error)})") from error

    def _copy_losses(self, st) -> tuple[torch.Tensor, Any]:
        """Every micro-batch's loss as this rank has it (zero where another
        rank computes it), in float64, on its way to the host in one copy:
        (the host tensor, the CUDA event that marks the copy done; None on
        the CPU, where the copy is done at once)."""
        B = self.program.num_batches
        if not st.losses:
            return torch.zeros(B, dtype=torch.float64), None
        if len(st.losses) == B:
            values = torch.stack([st.losses[b] for b in range(B)])
        else:
            zero = next(iter(st.losses.values())).new_zeros(())
            values = torch.stack([st.losses.get(b, zero) for b in range(B)])
        values = values.double()
        if values.device.type != "cuda":
            return values, None
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        host.copy_(values, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return host, copied

    def _item(self, index: int, action: Action, others: tuple[int, ...], ran_before: bool) -> "_Item":
        """What running the compute ``action`` needs, found once (see
        :class:`_Item`); ``others``: the indices of the other members of the
        run it heads; ``ran_before``: a run's head runs it."""
        program, work = self.program, action.work
        reads = program.reads(work, self.rank)
        gang = program.gangs.get(work)
        after = {"F": self._back, "I": BACKWARD_WEIGHT}.get(action.op)
        return _Item(
            index=index,
            reads=reads,
            awaits=tuple(self._inbound[k].index for k in reads.keys if k in self._inbound),
            gang=gang,
            noted=gang is None or gang.workers[0] == self.rank,
            keeps=after is not None and program.compute_worker[Work(work.batch, work.stage, after)] == self.rank,
            runs_also=tuple((i, (self._actions[i].stage, self._actions[i].batch)) for i in others),
            ran_before=ran_before,
        )

    def _backward_runs(self) -> tuple[dict[int, tuple[int, ...]], dict[tuple[int, int], int]]:
        """This rank's backwards that go to the autograd engine in one call,
        as a plain loop's ``backward`` runs through every stage:
        ``{index of a run's first action: the indices of the others}``, and
        the edges ``{(s, b): t}`` along which micro-batch ``b`` stays in one
        autograd graph (stage t's forward takes stage s's output as it is,
        not as the leaf of a new graph, and t's backward flows into s's; s
        feeds t alone, so each (s, b) has one).

        A run is consecutive full backwards of this rank's program, with no
        send, reduction or forward between them (a receive listed between
        them is posted after the call: posting waits for nothing), none
        ganged, none but the first waiting for a message or fetching weights,
        and each but the first the backward of a forward that ran here and
        kept its graph: running them together moves no send and no wait.
        Each member's output gradient comes
        from before the run, or from a member along a fused edge: s feeds t
        alone, t takes s alone, and all four passes run here.  The engine
        runs the members in an order of its own (their work is the same); a
        GPU is spared an engine call per member, whose fixed cost, tens of
        microseconds, is most of a small stage's host time."""
        program, graph = self.program, self._graph
        if program.split_backward:
            return {}, {}

        def fusable(s: int, t: int, b: int) -> bool:
            if not (tuple(graph.predecessors[t]) == (s,) and tuple(graph.successors[s]) == (t,)):
                return False
            passes = [Work(b, stage, d) for stage in (s, t) for d in (FORWARD, BACKWARD)]
            return all(program.compute_worker[w] == self.rank and program.gangs.get(w) is None for w in passes)

        runs, fused = {}, {}
        run, edges, members = [], {}, set()
        for i, action in enumerate(self._actions + [None]):
            if action is not None and action.is_recv:
                continue  # posting a receive waits for nothing: it may come after the call
            work = action.work if action is not None and action.op == "B" else None
            if work is not None and program.gangs.get(work) is not None:
                work = None  # a ganged backward runs alone
            if work is not None:
                s, b = work.stage, work.batch
                inside = [t for t in graph.successors[s] if (t, b) in members]
                forward = Work(b, s, FORWARD)
                joins = (run and all(fusable(s, t, b) for t in inside) and s not in self._fetch
                         and program.compute_worker[forward] == self.rank and program.gangs.get(forward) is None
                         and not any(k in self._inbound for k in program.reads(work, self.rank).keys))
                if joins:
                    run.append(i)
                    members.add((s, b))
                    edges.update({(s, b): t for t in inside})
                    continue
            if len(run) > 1:
                runs[run[0]] = tuple(run[1:])
                fused |= edges
            run, edges, members = ([i], {}, {(work.stage, work.batch)}) if work is not None else ([], {}, set())
        return runs, fused

    def _compute(self, st: "_StepState", action: Action, item: "_Item") -> None:
        """Wait for the item's inputs, then run it (only the run is timed)."""
        s, b, reads = action.stage, action.batch, item.reads
        if s in self._fetch:
            self._load_weights(st, s)
        for message in item.awaits:
            if message in st.pending:
                st.values[self.program.messages[message].key] = self._receive(st, message)
        start = None
        if self._recording and item.noted and not item.ran_before:
            last = st.last_end  # on a GPU, where the compute item just before ended, nothing having come between
            follows = last is not None and last[0] == item.index - 1 and not item.awaits and s not in self._fetch
            start = last[1] if follows else st.clock.mark()
        if item.gang is not None:
            self._gang_pass(st, s, b, reads, item.gang, forward=action.op == "F")
        elif action.op == "F":
            self._forward(st, s, b, reads, keep_graph=item.keeps and not st.evaluating)
        elif action.op == "W":
            self._weight_pass(st, s, b, reads)
        else:
            self._backward(st, s, b, reads, item, input_only=action.op == "I")
        if self._recording and item.noted:
            if item.ran_before:  # its span was noted with its run's call
                st.last_end = None  # its input gradients may have launched kernels since the call
                return
            end = st.clock.mark()
            st.last_end = (item.index, end) if st.clock.cuda else None
            if item.runs_also:
                self._split_span(st, (item.index, (s, b)), item.runs_also, start, end)
            else:
                st.items.append((item.index, start, end))

    def _split_span(self, st, head: tuple, others: tuple, start, end) -> None:
        """A run's one engine call spanned ``start``..``end``: note each
        member's span (``head`` and ``others`` are ``(index, (stage,
        batch))``), from where the engine began its backward to where it
        began the next one's (the first from ``start``, the last to ``end``)."""
        index_of = {key: index for index, key in (head, *others)}
        began = st.boundaries  # this call's, in the order the engine reached them
        order = list(began) + [key for key in index_of if key not in began]
        marks = list(began.values())[1:]
        began.clear()
        begins = [start, *marks, *[end] * (len(index_of) - 1 - len(marks))]
        st.items.extend((index_of[key], a, z) for key, a, z in zip(order, begins, begins[1:] + [end]))

    def _call(self, s: int, args: list, batch: int | None = None) -> Any:
        """Stage ``s`` on ``args`` under the precision's autocast, the floating
        tensors of an output another stage takes cast to the compute dtype;
        for micro-batch ``batch``, under the RNG seed of (seed, step, stage,
        batch), so a recomputed forward draws the same dropout masks."""
        if batch is not None:
            if self._seeds[0] != self._step_no:
                self._seeds = (self._step_no, micro_batch_seeds(self._seed, self._step_no - 1, self.program.num_stages,
                                                                self.program.num_batches))
            seed_rng(self._generators, self._seeds[1][s][batch])
        if self._dtype is None:
            return self.stages[s](*args)
        with autocast(self.device, self._dtype):
            out = self.stages[s](*args)
        return to_compute_dtype(out, self._dtype) if self._graph.successors[s] else out

    def _forward(self, st, s: int, b: int, reads: Reads, keep_graph: bool) -> None:
        """Stage ``s`` on micro-batch ``b``, its graph kept when the backward runs here next."""
        xs = self._inputs(st, s, b, reads.inputs)
        if keep_graph:
            if self._graph.predecessors[s]:
                xs = self._needing_grad(s, xs, b)
            out = self._call(s, layout_arguments(self._meta.inputs[s], xs), b)
            leaves = self._leaves(s, out)
            st.graphs[(s, b)] = (xs, out, leaves)
            if (s, b) in self._fused:
                st.put(output(s, b), leaves)  # its successor's forward extends this graph
                return
        else:
            with torch.no_grad():
                out = self._call(s, layout_arguments(self._meta.inputs[s], xs), b)
                leaves = self._leaves(s, out)
                if st.evaluating and s == self._loss_stage:
                    st.losses[b] = self._loss(st, b, out).detach()
        st.put(output(s, b), detached(leaves))

    def _loss(self, st, b: int, out: Any) -> torch.Tensor:
        """Micro-batch ``b``'s loss of the last stage's output ``out``, a scalar, under the precision's autocast."""
        if self._dtype is None:
            return scalar_loss(self.loss_fn(out, st.micro_t[b]), b)
        with autocast(self.device, self._dtype):
            return scalar_loss(self.loss_fn(out, st.micro_t[b]), b)

    def _leaves(self, s: int, out: Any, parts: int = 1) -> tuple[torch.Tensor, ...]:
        """The tensors of stage ``s``'s output ``out`` (one of ``parts``
        shares of its rows), checked against what the shape probe agreed:
        the same structure, shapes and dtypes, and no tensor that needs a
        gradient where the probe found none."""
        layout = self._meta.outputs[s]
        if parts > 1:
            layout = layout.share(parts, f"stage {s} output")
        if layout.single:
            if (isinstance(out, torch.Tensor) and out.shape == layout.shape and out.dtype == layout.dtype
                    and (layout.grads or not out.requires_grad)):
                return (out,)
        else:
            leaves, spec = tree_flatten(out)
            if spec == layout.spec and all(
                isinstance(y, torch.Tensor) and y.shape == shape and y.dtype == dtype and (need or not y.requires_grad)
                for y, shape, dtype, need in zip(leaves, layout.shapes, layout.dtypes, layout.needs_grad)
            ):
                return tuple(leaves)
        raise ShapeError(departure(f"stage {s} output", out, layout))

    def _needing_grad(self, s: int, xs: list[tuple], b: int | None = None) -> list[tuple]:
        """Stage ``s``'s inputs, those that carry a gradient back made leaves
        of a new graph (but for micro-batch ``b``, not those of a fused edge)."""
        return [group if self._fused.get((p, b)) == s else needing_grad(layout, group)
                for p, layout, group in zip(self._graph.predecessors[s], self._meta.inputs[s], xs)]

    # ------------------------------------------------------------------ gangs
    def _gang_pass(self, st, s: int, b: int, reads: Reads, gang, forward: bool) -> None:
        """A forward or backward that every member of ``gang`` runs: the first
        member hands out what it received, each runs its share, the first
        member collects the result (see the class docstring).  A value with
        several tensors is handed out and collected tensor by tensor."""
        members = tuple(gang.workers)
        group, first = self._gang_groups[members], members[0]
        lead = self.rank == first
        rows = not gang.collective
        preds = self._graph.predecessors[s]
        layout = self._meta.outputs[s]
        if forward:
            if preds:
                xs = self._inputs(st, s, b, reads.inputs) if lead else [None] * len(preds)
                xs = [tuple(self._hand_out(x[i] if lead else None, (shape, dtype), members, group, rows,
                                           f"stage {p}'s output{path} to stage {s}")
                            for i, (shape, dtype, path) in enumerate(zip(lay.shapes, lay.dtypes, lay.paths)))
                      for x, lay, p in zip(xs, self._meta.inputs[s], preds)]
                xs = self._needing_grad(s, xs)
            else:
                xs = [tuple(rows_of(x, members, self.rank, s) for x in st.micro_in[b]) if rows else st.micro_in[b]]
            leaves = self._leaves(s, self._call(s, layout_arguments(self._meta.inputs[s], xs), b), len(members) if rows else 1)
            whole = detached(leaves)
            if rows:
                whole = tuple(self._collect(y, members, group, rows) for y in whole)
            if not st.evaluating:
                st.graphs[(s, b)] = (xs, leaves, whole)
            elif lead and s == self._loss_stage:
                st.losses[b] = self._loss(st, b, layout.tree(whole)).detach()
            if lead:
                st.put(output(s, b), whole)
            return
        xs, leaves, whole = st.graphs.pop((s, b))
        grads = None
        if lead:
            if s == self._loss_stage:
                whole = needing_grad(layout, whole)
                (loss,), _ = self._root(st, s, b, layout.tree(whole), whole, (), record_loss=True)
                wanted = [whole[i] for i in layout.grads]
                grads = tuple(_or_zeros(g, y) for g, y in zip(_gradients((loss,), None, wanted, False), wanted))
            else:
                _, grads = self._root(st, s, b, None, whole, reads.gradients, record_loss=False)
        grads = tuple(self._hand_out(grads[k] if lead else None, (layout.shapes[i], layout.dtypes[i]), members, group,
                                     rows, f"the gradient of stage {s}'s output{layout.paths[i]}")
                      for k, i in enumerate(layout.grads))
        _differentiate(tuple(leaves[i] for i in layout.grads), grads)
        for p, x, lay in zip(preds, xs, self._meta.inputs[s]):
            dx = tuple(_or_zeros(x[i].grad, x[i]) for i in lay.grads)
            dx = tuple(self._collect(d, members, group, rows) for d in dx) if rows else dx
            if lead:
                st.put(gradient(p, b, s), dx)

    def _hand_out(self, x, spec, members, group, rows: bool, what: str) -> torch.Tensor:
        """The first member's ``x`` on every member: whole (a tensor-parallel
        gang) or its share of the rows."""
        shape, dtype = torch.Size(spec[0]), spec[1]
        first = members[0]
        if not rows:
            buffer = x.detach().contiguous() if self.rank == first else torch.empty(shape, dtype=dtype, device=self.device)
            self._collective(lambda: dist.broadcast(buffer, src=first, group=group), f"handing out {what}")
            return buffer
        share = rows_shape(shape, len(members), what)
        buffer = torch.empty(share, dtype=dtype, device=self.device)
        pieces = [c.contiguous() for c in x.detach().chunk(len(members))] if self.rank == first else None
        self._collective(lambda: dist.scatter(buffer, pieces, src=first, group=group), f"handing out {what}")
        return buffer

    def _collect(self, x: torch.Tensor, members, group, rows: bool) -> torch.Tensor:
        """Every member's share of the rows, concatenated on the first member."""
        first = members[0]
        x = x.contiguous()
        pieces = [torch.empty_like(x) for _ in members] if self.rank == first else None
        self._collective(lambda: dist.gather(x, pieces, dst=first, group=group), "collecting a gang's rows")
        return torch.cat(pieces) if self.rank == first else x

    def _backward(self, st, s: int, b: int, reads: Reads, item: "_Item", input_only: bool) -> None:
        """The backward of stage ``s`` on micro-batch ``b`` (its input pass
        only when ``input_only``, the graph kept when the weight pass runs
        here); at the head of a run, the whole run's, in one engine call."""
        xs, out, leaves = st.graphs.pop((s, b), (None, None, None))
        if item.ran_before:  # its run's engine call ran it
            self._put_input_gradients(st, s, b, xs)
            return
        if leaves is None:
            xs, out, leaves = self._recompute(st, s, b, reads.inputs, needs_input_grad=True)
        roots, grads = self._root(st, s, b, out, leaves, reads.gradients, record_loss=True)
        if not input_only:
            if item.runs_also:
                roots, grads = self._run_roots(st, item.runs_also, roots, grads)
                if self._recording:
                    self._note_boundaries(st, [((s, b), leaves)] + [(key, st.graphs[key][2])
                                                                     for _, key in item.runs_also])
            _differentiate(roots, grads)
            self._put_input_gradients(st, s, b, xs)
            return
        upstream = [(p, [x[i] for i in layout.grads])
                    for p, x, layout in zip(self._graph.predecessors[s], xs, self._meta.inputs[s])]
        found = iter(_gradients(roots, grads, [x for _, xs_p in upstream for x in xs_p], retain_graph=item.keeps))
        for p, xs_p in upstream:
            st.put(gradient(p, b, s), tuple(_or_zeros(next(found), x) for x in xs_p))
        if item.keeps:
            st.weight_graphs[(s, b)] = (roots, grads)
        elif grads is not None:
            st.put(gradient(s, b), grads)

    def _run_roots(self, st, others: tuple, roots: tuple, grads) -> tuple[list, list]:
        """What a run's one engine call differentiates: the head's ``roots``
        (with ``grads``), and those of each other member (``(index, (stage,
        batch))``, whose forwards ran here and kept their graphs) whose
        output's gradient does not flow in from a member along a fused edge.
        A loss's gradient is None."""
        roots, grads = list(roots), [None] * len(roots) if grads is None else list(grads)
        for index, (p, c) in others:
            if (p, c) not in self._fused:
                _, out, leaves = st.graphs[(p, c)]
                more, given = self._root(st, p, c, out, leaves, self._items[index].reads.gradients, record_loss=True)
                roots += more
                grads += [None] * len(more) if given is None else given
        return roots, grads

    def _put_input_gradients(self, st, s: int, b: int, xs) -> None:
        """After stage ``s``'s backward on micro-batch ``b``: the gradients of
        its inputs, for the predecessors not fused with it (those took theirs
        in the same engine call)."""
        for p, x, layout in zip(self._graph.predecessors[s], xs, self._meta.inputs[s]):
            if self._fused.get((p, b)) != s:
                st.put(gradient(p, b, s), tuple(_or_zeros(x[i].grad, x[i]) for i in layout.grads))

    def _note_boundaries(self, st, members: list[tuple[tuple[int, int], tuple]]) -> None:
        """Mark when the engine begins each ``(stage, batch)``'s backward in
        a run's one call: a hook on the node that made each tensor of its
        output (``leaves``) runs before that node does."""
        def hook(key):
            def began(grad_outputs):
                if key not in st.boundaries:  # a member's first node to run; the first member's span starts with the call
                    st.boundaries[key] = st.clock.mark() if st.boundaries else None
            return began

        for key, leaves in members:
            for y in leaves:
                if y.grad_fn is not None:
                    y.grad_fn.register_prehook(hook(key))

    def _weight_pass(self, st, s: int, b: int, reads: Reads) -> None:
        roots, grads = st.weight_graphs.pop((s, b), (None, None))
        if roots is None:
            _, out, leaves = self._recompute(st, s, b, reads.inputs, needs_input_grad=False)
            roots, grads = self._root(st, s, b, out, leaves, reads.gradients, record_loss=False)
        params = self._params[s]
        if params:
            _differentiate(roots, grads, inputs=params)

    def _inputs(self, st, s: int, b: int, keys: tuple) -> list[tuple[torch.Tensor, ...]]:
        """A stage's inputs, the tensors of each value it takes: its
        predecessors' outputs in stage order, or the micro-batch at a source."""
        if not self._graph.predecessors[s]:
            return [st.micro_in[b]]
        return [st.take(key) for key in keys]

    def _recompute(self, st, s: int, b: int, keys: tuple, needs_input_grad: bool):
        """The forward again, from the stashed inputs, this time keeping the graph."""
        xs = self._inputs(st, s, b, keys)
        if needs_input_grad and self._graph.predecessors[s]:
            xs = self._needing_grad(s, xs)
        with self._buffers_kept(s):
            out = self._call(s, layout_arguments(self._meta.inputs[s], xs), b)
        return xs, out, self._leaves(s, out)

    @contextlib.contextmanager
    def _buffers_kept(self, s: int):
        """Stage ``s``'s buffers as they were before (a recomputed forward
        must not update BatchNorm's running statistics a second time)."""
        stage = self.stages[s]
        if not self._buffer_specs[s] or not stage.training:
            yield
            return
        kept = [buffer.clone() for buffer in _buffers(stage)]
        try:
            yield
        finally:
            # through .data: the recomputed graph saved the buffers (BatchNorm's
            # backward checks their version) but does not read their values
            for buffer, old in zip(_buffers(stage), kept):
                buffer.data.copy_(old)

    def _root(self, st, s: int, b: int, out: Any, leaves: tuple, gradients: tuple, record_loss: bool):
        """What to differentiate, and with which gradients: at the loss
        stage the micro-batch's share of the mean loss (no gradient);
        elsewhere the output's tensors that carry a gradient, with the sums
        of their consumers' gradients."""
        if s == self._loss_stage:
            loss = self._loss(st, b, out)
            if record_loss:
                st.losses[b] = loss.detach()
            return (loss * st.loss_factor,), None
        grads = st.take(gradients[0])
        for key in gradients[1:]:
            grads = tuple(g + h for g, h in zip(grads, st.take(key)))
        return tuple([leaves[i] for i in self._meta.outputs[s].grads]), grads

    # ------------------------------------------------------------------ transfers
    def _wire(self, key: tuple) -> "Wire":
        """How the value ``key`` travels: a stage's whole output (or a stash
        of it), or the part of its output's gradient that exists."""
        layout = self._meta.outputs[value_stage(key)]
        return layout.grad_wire if key[0] == "g" else layout.wire

    def _post_recv(self, st, action: Action) -> None:
        msg = self.program.messages[action.message]
        wire = None
        if msg.letter in "wr":
            buffer = _flat_like(self._templates[msg.stage], self.device)
        else:
            wire = self._wire(msg.key)
            buffer = wire.empty(self.device)
        work = self._posted(lambda: dist.irecv(buffer, src=msg.src, group=self._p2p, tag=msg.seq), action, msg.src)
        st.pending[msg.index] = (self._watched(work) if msg.letter == "r" else work, buffer, action, wire)

    def _posted(self, post: Callable[[], Any], action: Action, peer: int):
        """Post a transfer; one refused because the link to ``peer`` has
        failed (a transfer waited on meanwhile found it broken) is a
        CommunicationError, so the fault board names the first cause."""
        try:
            return post()
        except Exception as error:
            raise CommunicationError(f"rank {self.rank} could not post {action} to or from rank {peer} "
                                     f"({first_line(error)})", peer=peer) from error

    def _watched(self, work):
        """A send, or the receive of a returned gradient, whose completion
        :meth:`_reap` polls: on gloo, waited on in a waiting thread
        (:class:`_Waiters`), since gloo marks a transfer completed only once
        it is waited on, and the buffer would otherwise live to the step's
        end.  (Most of a pipeline's sends are instead waited on after an item,
        :meth:`_settle_sends`, which costs the ranks no thread.)"""
        return self._waiters.watch(work) if self._watch_transfers else work

    def _post_or_defer(self, st, action: Action, index: int) -> None:
        """Post a receive now, or keep a weight fetch for when it is due."""
        if self._post_at.get(index, index) > index:
            st.deferred.append(index)
        else:
            self._post_recv(st, action)

    def _post_due(self, st, index: float) -> None:
        """Post the deferred receives due at action ``index`` (in the order they were deferred)."""
        while st.deferred and self._post_at[st.deferred[0]] <= index:
            self._post_recv(st, self._actions[st.deferred.pop(0)])

    def _post_send(self, st, action: Action) -> None:
        """Post a send; its buffer (a flat copy of weights or of a returned
        gradient, or a packed value) is let go once the send has completed:
        seen by :meth:`_reap`, or waited on after an item (:meth:`_settle_sends`)
        or at the step's end."""
        self._reap(st)
        msg = self.program.messages[action.message]
        if msg.letter == "w":
            tensor = _flatten([p.detach() for p in self._params[msg.stage]], self.device)
        elif msg.letter == "r":
            tensor = _flatten([p.grad if p.grad is not None else torch.zeros(t.shape, dtype=t.dtype, device=self.device)
                               for p, t in zip(self._params[msg.stage], self._templates[msg.stage])], self.device)
            for p in self._params[msg.stage]:
                p.grad = None  # returned: the copy in flight is all that is left of it
        else:
            tensor = self._wire(msg.value).pack(st.take(msg.value), self.device)
        if self._recording:
            st.sends[msg.index] = time.perf_counter()
        work = self._posted(lambda: dist.isend(tensor, dst=msg.dst, group=self._p2p, tag=msg.seq), action, msg.dst)
        st.outgoing.append((work if msg.index in st.unwatched else self._watched(work), tensor, action, msg.dst))

    def _settle_sends(self, st, messages: frozenset[int]) -> None:
        """Wait on the sends of ``messages`` (their receives certainly posted,
        :func:`~unisched.execute.program.settle_points`) and let go of their buffers."""
        done, kept = [], []
        for entry in st.outgoing:  # one pass: this runs after an item
            (done if entry[2].message in messages else kept).append(entry)
        st.outgoing = kept
        self._await_sends(done)

    def _reap(self, st) -> bool:
        """Let go of the sends that have completed, and take in the returned
        gradients that have arrived, so that their buffers live no longer
        than the transfer (polled after each item and before each send);
        whether there was any."""
        finished = [entry[0].is_completed() for entry in st.outgoing]
        sent = any(finished)
        if sent:
            self._await_sends([entry for entry, done in zip(st.outgoing, finished) if done])
            st.outgoing = [entry for entry, done in zip(st.outgoing, finished) if not done]
        arrived = [i for i, (work, _, action, _) in st.pending.items() if action.op == "r<" and work.is_completed()]
        for index in arrived:
            self._accept(self.program.messages[index].stage, self._wait(st, index))
        return sent or bool(arrived)

    def _await_sends(self, sends: list) -> None:
        for work, _, action, peer in sends:
            try:
                work.wait()
            except Exception as error:
                raise CommunicationError(
                    f"rank {self.rank}'s send {action} to rank {peer} failed ({first_line(error)})", peer=peer
                ) from error

    def _receive(self, st, index: int) -> tuple[torch.Tensor, ...]:
        """The tensors of the value that message ``index`` carries, once it has arrived."""
        wire = st.pending[index][3]
        return wire.unpack(self._wait(st, index))

    def _wait(self, st, index: int) -> torch.Tensor:
        work, buffer, action, _ = st.pending.pop(index)
        msg = self.program.messages[index]
        start = time.perf_counter()
        st.waiting_on = msg.src
        try:
            work.wait()
        except Exception as error:
            raise CommunicationError(
                f"rank {self.rank} at {st.current} waited for {action} ({msg.kind} from rank {msg.src}), and rank "
                f"{msg.src} failed, died or timed out ({first_line(error)})",
                peer=msg.src,
            ) from error
        st.waiting_on = None
        if self._recording:
            st.receives[index] = (start, time.perf_counter())
        return buffer

    def _post_reduce(self, st, action: Action) -> None:
        """Post the all-reduce of a stage's gradient among its replicas (after
    taking in returned gradients).  Replicated stages keep their gradients
    as views of one flat buffer, so it is reduced in place, without a copy."""
        s = action.stage
        for index in [i for i, (_, _, a, _) in st.pending.items() if a.op == "r<" and a.stage == s]:
            self._accept(s, self._wait(st, index))
        params = self._params[s]
        flat = self._flat_grads.get(s)
        if flat is None:
            flat = _flatten([_grad(p) for p in params], self.device)
        try:
            work = dist.all_reduce(flat, group=self._replica_groups[action.group], async_op=True)
        except Exception as error:
            raise CommunicationError(f"rank {self.rank} could not post {action} ({first_line(error)})") from error
        st.reductions.append((action, work, flat, time.perf_counter()))

    def _accept(self, s: int, flat: torch.Tensor) -> None:
        with torch.no_grad():
            for p, chunk in zip(self._params[s], _split(flat, self._params[s])):
                p.grad = chunk.clone() if p.grad is None else p.grad.add_(chunk)

    def _collective(self, run: Callable[[], Any], what: str) -> Any:
        try:
            return run()
        except Exception as error:
            raise CommunicationError(  # a peer that stopped, or this rank's own failure: the cause says which
                f"rank {self.rank} could not complete {what} ({first_line(error)})"
            ) from error

    def _load_host_weights(self) -> None:
        """Copy the offloaded weights of truth to the device (before a step)."""
        if not self.host_weights:
            return
        with torch.no_grad():
            for s, host in self.host_weights.items():
                for p, h in zip(self._params[s], host):
                    p.data = h.detach().to(self.device, non_blocking=True, copy=True)

    def _release_weights(self) -> None:
        """Free the device copies of weights this rank does not hold on the
        device between steps: offloaded ones, and fetched ones."""
        for s in set(self.host_weights) | set(self._fetch):
            self._release_fetched(s)

    def _release_fetched(self, s: int) -> None:
        """Free the device copy of stage ``s``'s weights and its gradient (an
        offloaded or fetched stage's, after the step)."""
        self._release_data(s)
        for p in self._params[s]:
            p.grad = None

    def _release_data(self, s: int) -> None:
        """Free the device copy of stage ``s``'s weights: a fetched stage's
        after its last item in the step.  Its gradient lives on until it is
        returned (the send lets it go)."""
        for p in self._params[s]:
            p.data = torch.empty(0, dtype=p.dtype, device=self.device)

    def _last_uses(self) -> dict[int, int]:
        """Per action index, the fetched stage whose last item in the step it is."""
        last = {}
        for index, action in enumerate(self._actions):
            if action.stage in self._fetch and action.is_compute:
                last[action.stage] = index
        return {index: s for s, index in last.items()}

    def _stand_in_weights(self) -> None:
        """Zeros in place of fetched weights, for a shape probe before the fetch."""
        for s in self._fetch:
            for p, template in zip(self._params[s], self._templates[s]):
                p.data = torch.zeros(template.shape, dtype=template.dtype, device=self.device)

    def _load_weights(self, st, s: int) -> None:
        msg = self._fetch[s]
        if msg.index not in st.pending:
            return
        flat = self._wait(st, msg.index)
        for p, chunk in zip(self._params[s], _split(flat, self._templates[s])):
            p.data = chunk

    # ------------------------------------------------------------------ end of step
    def _finish(self, st) -> float:
        """Await everything (taking in the returned gradients), stop on a
        non-finite loss (but under fp16, where its gradients make the update
        skip, as GradScaler's), update (or hold the gradients for a later
        update), average buffers, and note the step."""
        self._post_due(st, math.inf)
        self._await_transfers(st)
        self._await_reductions(st)
        if st.loss_work is None:
            self._post_losses(st, at_end=True)
        self._collective(st.loss_work.wait, "the exchange of the losses")
        losses = st.loss_sum
        bad = [b for b, loss in enumerate(losses.tolist()) if not math.isfinite(loss)]
        if bad and not self._scale.enabled:  # under fp16 an overflow of the loss is one of its gradients: skipped
            self._clear_gradients()
            raise NonFiniteLossError(
                f"the loss of micro-batch {bad[0]} is {float(losses[bad[0]])} (computed on rank "
                f"{self.program.loss_rank(bad[0])}) in step {self._step_no}; no weights were changed. "
                f"Lower the learning rate or check the inputs of that micro-batch"
            )
        self._accumulated += 1
        if self._accumulated < self.accumulate:
            self._hold_gradients()
        else:
            self._accumulated = 0
            self._update(float(losses.mean()))
        self._clear_gradients()
        self._average_buffers()
        self._release_weights()
        st.clock.sync()
        st.end = time.perf_counter()
        self.last_step_seconds = st.end - st.begin
        self.last_loss = float(losses.mean())
        if self._recording:
            self._gather_timeline(st)
        return self.last_loss

    def _clear_gradients(self) -> None:
        """Drop the gradients of the stages this rank computes (what
        ``zero_grad(set_to_none=True)`` does, without walking the modules)."""
        for s in self._mine:
            for p in self._params[s]:
                p.grad = None

    def _await_transfers(self, st) -> None:
        """Every receive and send of the step, done; returned gradients taken in."""
        for index in list(st.pending):
            flat = self._wait(st, index)
            msg = self.program.messages[index]
            if msg.letter == "r":
                self._accept(msg.stage, flat)
        self._await_sends(st.outgoing)
        st.outgoing.clear()

    def _await_reductions(self, st) -> None:
        for action, work, flat, start in st.reductions:
            self._collective(work.wait, f"the gradient all-reduce {action}")
            params = self._params[action.stage]
            if action.stage not in self._flat_grads:
                for p, chunk in zip(params, _split(flat, params)):
                    p.grad = chunk
            if self._recording:
                n = len(action.group)
                sent = 2 * (n - 1) / n * flat.numel() * flat.element_size()
                st.reduces.append((action.group, sent, start, time.perf_counter()))
        st.reductions.clear()

    def _hold_gradients(self) -> None:
        """Keep this step's gradients of truth for the update that ends the accumulation."""
        for s in self._owned:
            held = self._held.setdefault(s, [None] * len(self._params[s]))
            for i, p in enumerate(self._params[s]):
                if p.grad is not None:
                    held[i] = p.grad.detach().clone() if held[i] is None else held[i].add_(p.grad)

    def _update(self, loss: float) -> None:
        """The optimizer step, on the gradients of truth (with those held
        from earlier steps of the accumulation, and each copy of a tied
        weight holding the sum of the copies'): unscaled by the fp16 loss
        scale, clipped to the global norm every rank agrees on, skipped on
        every rank when that norm is not finite under fp16."""
        truth = [p for s in self._owned for p in self._params[s]]
        for s, held in self._held.items():
            for p, h in zip(self._params[s], held):
                if h is not None:
                    p.grad = h if p.grad is None else p.grad.add_(h)
        self._held = {}
        self._collective(lambda: self._ties.reduce(lambda s, name: self._params[s][self._index[s][name]]),
                         "the all-reduce of tied weights' gradients")
        grads = [p.grad for p in truth if p.grad is not None]
        if self._scale.enabled and grads:
            torch._foreach_mul_(grads, 1.0 / self._scale.scale)
        self.last_step_skipped, self.last_grad_norm = False, None
        if self._scale.enabled or self.clip_grad_norm is not None:
            norm = self.last_grad_norm = self._global_grad_norm()
            if self._scale.enabled:
                self._scale.update(found_inf=not math.isfinite(norm))
                if not math.isfinite(norm):
                    self.last_step_skipped = True
                    return
            if self.clip_grad_norm is not None and grads:
                torch.nn.utils.clip_grads_with_norm_(truth, self.clip_grad_norm, torch.tensor(norm, device=self.device))
        for s, host in self.host_weights.items():
            for p, h in zip(self._params[s], host):
                h.grad = None if p.grad is None else p.grad.detach().to(h.device)
        if self.optimizer is not None:
            self.optimizer.step()
            if self.scheduler is not None:
                step_scheduler(self.scheduler, loss)
        for host in self.host_weights.values():
            for h in host:
                h.grad = None

    def _global_grad_norm(self) -> float:
        """The L2 norm of every stage's gradient, the same on every rank: each
        rank adds the squares of the shares it is the first holder of (a
        replicated stage counts once), and all ranks sum them.  Of a stage a
        tensor-parallel gang runs, shard 0 counts every parameter and the
        other shards only those marked as split among the shards
        (``param.tensor_model_parallel = True``, Megatron's convention); the
        others are copies of shard 0's.  A weight several stages share counts
        once, in its first copy."""
        per_stage = torch.zeros(len(self._params), dtype=torch.float64, device=self.device)
        for s in self._counts_norm:
            per_stage[s] = stage_norm_squared(
                [p.grad for i, p in enumerate(self._params[s]) if p.grad is not None
                 and (self.program.shares[s][self.rank] == 0 or _sharded(p)) and (s, i) not in self._counted_elsewhere])
        per_stage = per_stage.cpu()  # one wait for the device, on the control group's host tensors
        self._collective(lambda: dist.all_reduce(per_stage, group=self._control), "the all-reduce of the gradient norm")
        return global_norm(per_stage)

    def _average_buffers(self) -> None:
        """Average each stage's buffers over the ranks that ran its forwards
        in this step, and give the mean to every holder of its weights:
        replicas end a step with equal BatchNorm statistics."""
        for s, (group, ran) in self._buffer_groups.items():
            buffers = _buffers(self.stages[s])
            flat = torch.cat([b.detach().double().reshape(-1) * ran for b in buffers]
                             + [torch.ones(1, dtype=torch.float64, device=self.device) * ran])
            flat = flat.cpu()
            self._collective(lambda: dist.all_reduce(flat, group=group), f"the average of stage {s}'s buffers")
            mean = flat[:-1] / flat[-1]
            with torch.no_grad():
                for b, chunk in zip(buffers, mean.split([b.numel() for b in buffers])):
                    b.copy_(chunk.reshape(b.shape).to(b.dtype) if b.is_floating_point()
                            else chunk.floor().reshape(b.shape).to(b.dtype))

    def _gather_timeline(self, st) -> None:
        """Rank 0 gathers every rank's notes of the step, as one float64
        tensor each (:class:`NotesLayout`: no pickling); the Timeline is
        assembled when :attr:`last_timeline` is first read."""
        mine = torch.from_numpy(self._notes_layout.pack(
            st.begin, st.end, st.clock.resolve_spans(st.items),
            st.sends, st.receives, st.reduces))
        everyone = [mine]
        if self.world_size > 1:
            everyone = [torch.empty_like(mine) for _ in range(self.world_size)] if self.rank == 0 else None
            work = self._collective(lambda: dist.gather(mine, everyone, dst=0, group=self._control, async_op=True),
                                    "gathering the measured step on rank 0")
            # no rank waits for the others here: the gather completes in the background, settled
            # when the next step begins, last_timeline is read (on any rank) or the trainer closes
            self._gathering = (work, mine)
        if self.rank == 0:
            self._notes = (everyone, self._meta)  # unpacked when last_timeline is read
            self._timeline = None

    def _settle_gathering(self) -> None:
        """Wait for the last recorded step's gather of notes, if it is still under way."""
        if self._gathering is not None:
            work, _ = self._gathering
            self._gathering = None
            self._collective(work.wait, "gathering the measured step on rank 0")

    @property
    def last_timeline(self) -> Timeline | None:
        """Rank 0: the last recorded step, a measured :class:`unisched.Timeline`
        (None on the other ranks, and before a recorded step).  Every rank that
        reads it first waits until its part of the step's gathering has
        reached rank 0, so a rank may end right after reading it."""
        self._settle_gathering()
        if self._timeline is None and self._notes is not None:
            flats, meta = self._notes
            notes = [self._notes_layout.unpack(r, flat.numpy()) for r, flat in enumerate(flats)]
            self._timeline = assemble(
                self.program, notes, input_bytes(meta), output_bytes(meta), self.weight_bytes, self._offsets,
                label=self.label, gradient_bytes=[layout.grad_wire.nbytes for layout in meta.outputs],
            )
        return self._timeline

    # ------------------------------------------------------------------ faults
    def _failure(self, error: BaseException, st: "_StepState") -> ExecutionError:
        """Turn whatever stopped this rank into an error naming the first cause, and post it."""
        where = f" at {st.current}" if st.current is not None else ""
        if isinstance(error, KeyboardInterrupt) and self._watchdog.fired:
            mine = f"rank {self.rank} ran past the step timeout of {self.timeout:g} s{where} in step {self._step_no}"
        elif isinstance(error, CommunicationError):
            cause = self._board.read(wait=2.0)
            if cause is None and self._board.lost:
                cause = self._board.gone()
            if cause is not None:
                self._failed = cause
                return ExecutionError(f"rank {self.rank} stopped{where} in step {self._step_no} because {cause}")
            mine = str(error)
        elif isinstance(error, KeyboardInterrupt):
            self._failed = "interrupted"
            raise error
        elif isinstance(error, _ProbeFailed):  # every rank heard it alike: named once, by the rank it happened on
            mine = f"the shape probe of step {self._step_no} failed: {error}"
        else:
            mine = f"rank {self.rank} raised {type(error).__name__}: {error}{where} in step {self._step_no}"
        cause = self._board.post(mine)
        self._failed = cause
        if cause != mine:
            return ExecutionError(f"rank {self.rank} stopped{where} in step {self._step_no} because {cause}")
        return ExecutionError(mine)

    def _on_timeout(self) -> bool:
        """Post this rank as the cause unless it is only waiting for another
        rank (whose own watchdog, or the transfer's timeout, will speak)."""
        st = self._state
        if st is None or st.waiting_on is not None:
            return False
        where = f" at {st.current}" if st.current is not None else ""
        self._board.post(f"rank {self.rank} ran past the step timeout of {self.timeout:g} s{where} in step {self._step_no}")
        return True


class _Watched:
    """A transfer that a :class:`_Waiters` thread waits on (it is waited on
    exactly once): ``is_completed()`` is true as soon as it has completed,
    ``wait()`` joins that wait and raises its failure."""

    def __init__(self, work):
        self._work, self._error = work, None
        self._done = threading.Event()

    def run(self) -> None:
        """Wait on the transfer (in a waiting thread); :meth:`settle` then shows it completed."""
        try:
            self._work.wait()
        except BaseException as error:  # handed to wait()
            self._error = error
        finally:
            self._work = None  # a transfer's Work keeps its buffer: once done, let both go

    def settle(self) -> None:
        self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self) -> bool:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return True


class _Waiters:
    """Daemon threads that wait on transfers, kept for reuse (starting a
    thread per send costs more than the send on a small step): each
    transfer goes to an idle thread, or to a new one when all are busy, so
    no wait ever queues behind another transfer's."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)  # one count per thread about to take the next transfer
        self._threads = 0

    def watch(self, work) -> _Watched:
        """``work``, waited on by one of the threads."""
        watched = _Watched(work)
        self._queue.put(watched)
        if not self._idle.acquire(blocking=False):
            self._threads += 1
            threading.Thread(target=self._serve, name="unisched-transfer", daemon=True).start()
        return watched

    def close(self) -> None:
        """Let every thread end once its current wait is over."""
        for _ in range(self._threads):
            self._queue.put(None)
        self._threads = 0

    def _serve(self) -> None:
        while (watched := self._queue.get()) is not None:
            watched.run()
            self._idle.release()  # idle before the transfer shows completed: the next watch finds this thread
            watched.settle()


class _Item(NamedTuple):
    """A compute action of this rank's program, with what running it needs:
    its ``index`` in the program, what it ``reads``, the messages it
    ``awaits``, the ``gang`` that runs it (None: this rank alone), whether
    this rank notes it in a recorded step (``noted``: the gang's first
    member does), whether it ``keeps`` its autograd graph (a forward
    whose backward, or an input pass whose weight pass, runs here next),
    and for a run of backwards that go to the engine in one call (see
    :meth:`Trainer._backward_runs`): at its head, the indices of the other
    members it ``runs_also`` (each ``(index, (stage, batch))``); at those,
    that the head's call ran it (``ran_before``)."""

    index: int
    reads: Reads
    awaits: tuple[int, ...]
    gang: Any
    noted: bool
    keeps: bool
    runs_also: tuple[tuple[int, tuple[int, int]], ...] = ()
    ran_before: bool = False


class _StepState:
    """Everything one step holds: values by key (each the tuple of its
    tensors), graphs, posted transfers, notes; ``micro_in[b]`` holds the
    tensors of micro-batch b's inputs, ``micro_t[b]`` its targets as given."""

    def __init__(self, trainer: Trainer, micro_in, micro_t, evaluating: bool = False):
        self.trainer = trainer
        self.evaluating = evaluating
        # the settle points hold for the whole program: a step of forwards only watches every send
        self.settle, self.unwatched = ({}, frozenset()) if evaluating else (trainer._settle, trainer._unwatched)
        self.micro_in, self.micro_t = micro_in, micro_t
        self.uses = dict(trainer.program.uses[trainer.rank])
        # a micro-batch's loss counts 1/B of the step's and 1/k of an accumulation, times the fp16 loss scale
        self.loss_factor = trainer._scale.scale / (trainer.program.num_batches * trainer.accumulate)
        self.values: dict[tuple, tuple[torch.Tensor, ...]] = {}
        self.graphs: dict[tuple[int, int], tuple] = {}
        self.weight_graphs: dict[tuple[int, int], tuple] = {}
        self.pending: dict[int, tuple] = {}
        self.deferred: list[int] = []
        self.outgoing: list = []
        self.reductions: list = []
        self.loss_sum: torch.Tensor | None = None
        self.loss_copy: tuple | None = None  # (the losses on the host, the copy's event)
        self.loss_work = None
        self.losses: dict[int, torch.Tensor] = {}
        self.clock = trainer._clock
        self.boundaries: dict[tuple[int, int], Any] = {}  # where a run's engine call began (stage, batch)'s backward
        self.last_end: tuple[int, Any] | None = None  # (action index, mark) where the last compute item ended
        self.items: list = []
        self.sends: dict[int, float] = {}
        self.receives: dict[int, tuple[float, float]] = {}
        self.reduces: list = []
        self.current: Action | None = None
        self.waiting_on: int | None = None
        self.begin = self.end = 0.0

    def put(self, key: tuple, value: tuple[torch.Tensor, ...]) -> None:
        if self.uses.get(key, 0) > 0:
            self.values[key] = value

    def take(self, key: tuple) -> tuple[torch.Tensor, ...]:
        """The value for ``key`` (waiting for its message if it comes from another rank); freed after its last use."""
        value = self.values.get(key)
        if value is None:
            msg = self.trainer._inbound.get(key)
            if msg is None or msg.index not in self.pending:
                raise ExecutionError(f"rank {self.trainer.rank} has no {key} at {self.current}; the program is inconsistent")
            value = self.trainer._receive(self, msg.index)
            self.values[key] = value
        left = self.uses.get(key, 1) - 1
        self.uses[key] = left
        if left <= 0:
            self.values.pop(key, None)
        return value


# ---------------------------------------------------------------------- the shape probe and losses
class _ProbeFailed(ShapeError):
    """A stage failed in the shape probe; every rank heard which, on which rank, and raises this
    alike (so that no rank is blamed for another's failure)."""


def _loss_source(program: Program, forward_only: bool) -> int | None:
    """The one rank that computes every micro-batch's loss in a step (of
    forwards only), which broadcasts them; None where several do."""
    ranks = {program.loss_rank(b, forward_only) for b in range(program.num_batches)}
    return ranks.pop() if len(ranks) == 1 else None


# ---------------------------------------------------------------------- helpers
def _differentiate(roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor] | None, inputs=None) -> None:
    """Backpropagate from those ``roots`` that need a gradient (with their
    ``grads``; None for the loss), unless none does (a stage without
    parameters whose inputs need none)."""
    if len(roots) == 1:
        if roots[0].requires_grad:
            torch.autograd.backward(roots[0], None if grads is None else grads[0], inputs=inputs)
        return
    live = [k for k, root in enumerate(roots) if root.requires_grad]
    if live:
        torch.autograd.backward([roots[k] for k in live], None if grads is None else [grads[k] for k in live],
                                inputs=inputs)


def _gradients(roots, grads, inputs: Sequence[torch.Tensor], retain_graph: bool) -> list[torch.Tensor | None]:
    """The gradients of ``inputs`` from the ``roots`` that need one (None
    where an input is not used), leaving the parameters' gradients alone."""
    live = [k for k, root in enumerate(roots) if root.requires_grad]
    if not inputs or not live:
        return [None] * len(inputs)
    return list(torch.autograd.grad([roots[k] for k in live], list(inputs),
                                    None if grads is None else [grads[k] for k in live],
                                    retain_graph=retain_graph, allow_unused=True))


class _Done:
    """A finished transfer (what a world of one rank posts instead of a collective)."""

    @staticmethod
    def wait() -> bool:
        return True


_DONE = _Done()


def _or_zeros(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return grad if grad is not None else torch.zeros_like(like)


def _sharded(p: torch.Tensor) -> bool:
    """Whether a parameter of a tensor-parallel stage is this shard's own
    part (Megatron's ``tensor_model_parallel`` mark), not a copy."""
    return bool(getattr(p, "tensor_model_parallel", False))


def _buffers(stage: nn.Module) -> list[torch.Tensor]:
    """The buffers of a stage that training changes (running statistics,
    counters); boolean ones (masks) are constants."""
    return [b for b in stage.buffers() if b.dtype != torch.bool]


def _host_copy(tensor: torch.Tensor, pin: bool) -> torch.Tensor:
    """A host-memory copy of ``tensor`` (pinned when it feeds a GPU)."""
    copy = tensor.detach().to("cpu", copy=True)
    return copy.pin_memory() if pin else copy


def _grad(p: torch.Tensor) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)


def _flatten(tensors: list[torch.Tensor], device) -> torch.Tensor:
    if not tensors:
        return torch.zeros(0, device=device)
    return torch.cat([t.reshape(-1) for t in tensors])


def _flat_like(params: list[torch.Tensor], device) -> torch.Tensor:
    if not params:
        return torch.zeros(0, device=device)
    return torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=device)


def _split(flat: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor]:
    chunks = flat.split([p.numel() for p in params]) if params else []
    return [c.view_as(p) for c, p in zip(chunks, params)]
