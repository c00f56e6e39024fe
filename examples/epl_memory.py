"""EPL's memory features on the pipeline snippet: ZeRO, CPU offload and
recompute, each trained on N local gloo processes (on ``unisched.Trainer``,
the one runtime) and compared with one process, with what every rank keeps:

- optimizer state (numbers Adam keeps; none on a rank whose optimizer
  holds nothing);
- weight bytes left on the compute device between steps, of the stages the
  rank runs and of the stages it does not run;
- weight bytes the rank keeps in host memory (offloaded weights of truth,
  ``trainer.scheduled.host_weights``);
- the peak of activation bytes autograd keeps for the backward during a
  step (parameters left out), next to what ``epl.simulate`` predicts from
  each TaskGraph's input and internal activation sizes measured in one process.

Run: ``python examples/epl_memory.py --world 4`` (two replicas of two stages).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch
from epl_common import mlp
from torch import nn

from unisched import epl
from unisched.execute import train_one_process
from unisched.execute.launch import check, run_local
from unisched.memory import memory_curves

FEATURES = {
    "plain": {},
    "recompute": {"gradient_checkpoint.type": "auto"},
    "zero v1": {"zero.level": "v1"},
    "offload v0": {"offload.level": "v0"},
    "zero + offload": {"zero.level": "v1", "offload.level": "v0"},
}
MICRO = 4


def build(features: dict, width: int):
    epl.init(epl.Config({"pipeline.num_micro_batch": MICRO, **features}))
    with epl.replicate(device_count=1, name="stage_0"):
        mlp(64, width, width, width, last_activation=True)
    with epl.replicate(device_count=1, name="stage_1"):
        mlp(width, width, width, 10)
    return nn.CrossEntropyLoss()


def batch(world: int, rows_per_micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    replicas = world // 2
    rows = replicas * MICRO * rows_per_micro
    generator = torch.Generator().manual_seed(1)
    return torch.randn(rows, 64, generator=generator), torch.randint(0, 10, (rows,), generator=generator)


class SavedBytes:
    """Bytes autograd keeps for the backward, counted once per tensor (by its
    data pointer) and without parameters; :attr:`peak` is the most held at once."""

    def __init__(self, parameters):
        self.parameters = parameters
        self.live: dict[int, list] = {}
        self.now = self.peak = 0

    def pack(self, tensor: torch.Tensor):
        key = tensor.data_ptr()
        if key in {p.data_ptr() for p in self.parameters()}:
            return tensor
        entry = self.live.setdefault(key, [0, tensor.numel() * tensor.element_size()])
        if entry[0] == 0:
            self.now += entry[1]
            self.peak = max(self.peak, self.now)
        entry[0] += 1
        # a detached alias (same storage, no grad_fn): holding the tensor itself would make a
        # cycle through the graph when autograd saves an op's own output, which gc cannot free
        return _Held(tensor.detach(), self, key)

    def unpack(self, held):
        return held.tensor if isinstance(held, _Held) else held

    def release(self, key: int) -> None:
        entry = self.live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.now -= entry[1]
            del self.live[key]

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class _Held:
    def __init__(self, tensor, counter: SavedBytes, key: int):
        self.tensor, self.counter, self.key = tensor, counter, key

    def __del__(self):
        self.counter.release(self.key)


def train(rank: int, world: int, name: str, width: int, rows_per_micro: int, steps: int) -> dict:
    torch.manual_seed(0)
    loss_fn = build(FEATURES[name], width)
    inputs, targets = batch(world, rows_per_micro)
    # record=False: no measured timeline, so the step times hold no gathering of notes
    trainer = epl.Trainer(loss_fn, lambda params: torch.optim.Adam(params, lr=1e-3), record=False)
    runs = sorted({work.stage for work in trainer.order})
    mine = [trainer.stages[s] for s in runs]
    idle = [stage for s, stage in enumerate(trainer.stages) if s not in runs and stage is not None]
    counter = SavedBytes(lambda: [p for m in mine for p in m.parameters()])
    times, losses = [], []
    for _ in range(steps):
        start = time.perf_counter()
        with counter.hooks():
            losses.append(trainer.step(inputs, targets))
        times.append(time.perf_counter() - start)
    optimizer = trainer.optimizer  # None on a rank that holds no weights of truth
    state = [] if optimizer is None else [
        v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    weights = trainer.gather_state_dict()
    result = {
        "losses": losses,
        "state": {k: v.numpy() for k, v in weights.items()},
        "optimizer_numbers": sum(v.numel() for v in state),
        "device_weight_bytes": _bytes(p for m in mine for p in m.parameters()),
        "idle_weight_bytes": _bytes(p for m in idle for p in m.parameters()),
        "host_weight_bytes": _bytes(p for host in trainer.scheduled.host_weights.values() for p in host),
        "peak_saved_bytes": counter.peak,
        "step_ms": 1000 * statistics.median(times[1:] or times),
    }
    trainer.close()
    return result


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def reference(features: dict, width: int, world: int, rows_per_micro: int, steps: int):
    """One process, whole batch; also each stage's input and saved internal
    bytes for one micro-batch (the sizes ``epl.simulate`` takes)."""
    torch.manual_seed(0)
    loss_fn = build(features, width)
    inputs, targets = batch(world, rows_per_micro)
    env = epl.Env.get()
    with env.paused():
        model = nn.ModuleList(copy.deepcopy(t.module()) for t in env.taskgraphs)
    input_bytes, internal_bytes = [], []
    x = inputs[:rows_per_micro]
    for s, stage in enumerate(model):
        counter = SavedBytes(stage.parameters)
        with counter.hooks():
            x_in = x.detach().requires_grad_(s > 0)
            out = stage(x_in)
            if s == len(model) - 1:
                out = loss_fn(out, targets[:rows_per_micro])
            input_bytes.append(x.numel() * x.element_size())
            internal_bytes.append(max(counter.peak - input_bytes[-1], 0))
        x = out.detach()
        del out, x_in
    losses, state = train_one_process(model, loss_fn, lambda params: torch.optim.Adam(params, lr=1e-3),
                                      [(inputs, targets)] * steps)
    return losses, state, input_bytes, internal_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=4, help="local processes: 2 stages x replicas")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--rows", type=int, default=32, help="rows per micro-batch")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    if args.world % 2:
        parser.error("--world must be even (two pipeline stages per replica)")
    os.environ["WORLD_SIZE"] = str(args.world)

    print(f"pipeline snippet, widths {args.width}, {MICRO} micro-batches of {args.rows} rows, "
          f"{args.world // 2} replica(s) of 2 stages, Adam, {args.steps} steps, gloo on CPU")
    ranks = range(args.world)
    columns = [("Adam numbers", 28), ("device weights", 30), ("idle stages", 30), ("host weights", 30),
               ("saved peak", 28), ("simulated", 28)]
    header = (f"{'feature':<15} {'max |dw|':>9} " + " ".join(f"{title:>{width}}" for title, width in columns)
              + f" {'step ms':>8}")
    print(header)
    for name, features in FEATURES.items():
        losses, expected, input_bytes, internal_bytes = reference(features, args.width, args.world, args.rows,
                                                                   args.steps)
        simulation = epl.simulate(world_size=args.world, input_bytes=input_bytes, internal_bytes=internal_bytes)
        simulated = [c.peak for c in memory_curves(simulation.timeline, "activations")]
        results = check(run_local(train, args.world, name, args.width, args.rows, args.steps, timeout=300))
        diff = max((torch.from_numpy(results[0]["state"][k]) - v).abs().max().item() for k, v in expected.items())
        loss_diff = max(abs(a - b) for a, b in zip(results[0]["losses"], losses))
        cells = [
            [r[key] for r in results]
            for key in ("optimizer_numbers", "device_weight_bytes", "idle_weight_bytes", "host_weight_bytes",
                        "peak_saved_bytes")
        ] + [[int(simulated[r]) for r in ranks]]
        print(f"{name:<15} {max(diff, loss_diff):>9.1e} "
              + " ".join(f"{'/'.join(map(str, cell)):>{width}}" for cell, (_, width) in zip(cells, columns))
              + f" {statistics.median(r['step_ms'] for r in results):>8.1f}")
    print(f"(a/b/...: ranks 0..{args.world - 1}; rank r runs stage r mod 2 of replica r // 2; weights in bytes between "
          "steps, of the stages the rank runs and of the idle stages it does not run; saved peak: most "
          "activation bytes autograd held at once during a step)")


if __name__ == "__main__":
    main()
