"""Peak memory per rank: the executor against torch.distributed.pipelining,
and against the simulator's prediction.

    python benchmarks/memory.py                  # both models, 2 ranks (this 2-core CPU machine), gloo
    python benchmarks/memory.py --model linear --width 2048 --json
    python benchmarks/memory.py --schedules gpipe,fsdp      # some schedules only

Two models, each split into one stage per rank, the same batch and SGD:

- ``linear``: stages of ``--layers`` x Linear(width, width) with ReLU
  between (32 rows in 4 micro-batches), built by
  :func:`unisched.build_stages` from a factory;
- ``gpt2``: the tiny random GPT-2 of ``examples/gpt2.py`` (2 blocks per
  stage, width 64, 4 heads, 128 tokens, 32 positions, 4 rows per
  micro-batch), split by :func:`unisched.split_model`.

Against torch (``PipelineStage`` given only its rank's stage): unisched
``gpipe`` vs ``ScheduleGPipe`` and ``one_f_one_b`` vs ``Schedule1F1B``.
Against the simulator: unisched ``gpipe``, ``one_f_one_b``, ``zb_h1`` and
``fsdp`` (fsdp: one micro-batch per rank, every rank computes every stage
and holds one stage's weights).

How memory is measured.  Each system runs in freshly launched processes,
one per rank; after set-up and one warm-up step (the shape probe, lazy
allocations) each rank measures two ways.

Against torch, the resident set size (RSS), what the machine has to hold.
Every rank first fixes glibc's mmap threshold at 16 KiB (``mallopt``), so a
freed tensor larger than that goes back to the system at once instead of
staying in the heap (a higher threshold leaves small activations to the
heap, whose fragmentation inflated the GPT-2's growth by 40 to 100%).  The
rank returns the heap's free memory (``malloc_trim``), records its RSS (the
*baseline*) and resets the kernel's peak-RSS counter
(``/proc/self/clear_refs``); after the timed steps its ``VmHWM`` is the
peak.  The process-lifetime peak (``ru_maxrss``) and the RSS at start are
reported too.

Against the simulator, the growth of torch's CPU allocator: the same number
of steps again under ``torch.profiler`` with ``profile_memory``, whose
memory events carry the running total of the bytes torch allocated since
profiling began less those freed; its largest value is what the steps hold
above what the rank holds between steps (its weights of truth and their
optimizer state).  Not RSS here: the simulator counts tensors' bytes, and
RSS counts pages (a mapped 32 KiB tensor, the tiny GPT-2's hidden states,
takes 36 KiB: about 12 points of the GPT-2's ratios) and whatever else the
process holds (gloo's buffers, Python objects).  The ratio the RSS growth
would give is printed beside.

The simulator's prediction (:func:`unisched.memory_curves`, total bytes)
uses Costs from the real model: the times calibrated from three recorded
steps (``Trainer.calibrate``), each stage's ``weight_bytes`` and
``activation_bytes`` from the Trainer (parameters; the agreed layouts of its
inputs), ``optimizer_bytes`` from the Trainer (``Trainer.memory_sizes``: the
optimizer's state per stage; none for plain SGD), and two sizes measured
here on one micro-batch, once per stage: ``stash_bytes``, what a forward
keeps for its backward when the runtime keeps its autograd graph (the
stage's inputs, its output and the tensors autograd saves, parameters left
out, each storage once), with ``input_grad_frees=0`` (the runtime keeps
the whole graph from the input-gradient pass to the weight-gradient pass);
and ``backward_workspace_bytes``, the most a backward accumulating into
existing gradients allocates above what it starts with (the allocator's
growth, as the ranks are measured: the forward runs under the profiler
too, so the saved tensors autograd frees as the backward goes count, as
they do on a rank; measured after the forward alone, the GPT-2's last
stage showed 0.78 MiB instead of 0.22).  Under a split backward (zb_h1)
it is the larger of the two halves as the runtime runs them: the
input-gradient pass keeps the graph for the weight pass and frees nothing
(0.85 MiB on the GPT-2's last stage), the weight pass frees it.  Measured rather than the Trainer's
estimate (its largest parameter, printed beside): that is the whole
workspace of the Linear stages (a parameter's fresh gradient before it is
added), but the GPT-2's is mostly the activations' gradients (the MLP's
hidden layer, the attention scores), which no parameter shows.  It is
replayed in the order that ran (:func:`unisched.execute.predict`).
Compared: the rank's weights of truth and optimizer state plus the
measured growth, with the predicted peak, printed beside what each of the
memory model's kinds holds at that peak.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

import unisched
from unisched import policies
from unisched.execute import Trainer, predict
from unisched.execute.launch import run_local
from unisched.execute.stages import build_stages
from unisched.memory import MEMORY_KINDS, memory_curves

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import gpt2 as gpt2_example  # noqa: E402

LR = 1e-3
MiB = 1024 * 1024
MMAP_THRESHOLD = 16 * 1024
CPU_DEVICE_TYPE = 0  # the profiler's device type of CPU memory events
MEASURED = "unisched.benchmarks.measured"  # the profiler range of what allocated_peak measures
TORCH_KINDS = {"gpipe": "ScheduleGPipe", "one_f_one_b": "Schedule1F1B"}
SIMULATED_KINDS = ("gpipe", "one_f_one_b", "zb_h1", "fsdp")


# ---------------------------------------------------------------------- the models
@dataclasses.dataclass
class Model:
    """One model's stages, batch and loss, rebuilt the same way in every process."""

    name: str
    config: dict

    @property
    def micro_batches(self) -> int:
        return 4

    def stages(self, S: int):
        """A factory (or ModelStages) of S stages."""
        c = self.config
        if self.name == "linear":
            return lambda s: make_linear_stage(c["width"], c["layers"])
        # untied: torch's runtime keeps no ties, so both sides train the same model
        return unisched.split_model(gpt2_example.gpt2(self.example_args(), 2 * S), S, tied="untie")

    def batch(self, B: int):
        c = self.config
        if self.name == "linear":
            g = torch.Generator().manual_seed(7)
            rows = 8 * B
            return torch.randn(rows, c["width"], generator=g), torch.randn(rows, c["width"], generator=g)
        return gpt2_example.data(self.example_args(), 0, c["rows_per_batch"] * B)

    def loss_fn(self):
        return nn.functional.mse_loss if self.name == "linear" else gpt2_example.next_token_loss

    def example_args(self) -> SimpleNamespace:
        c = self.config
        return SimpleNamespace(vocab=c["vocab"], positions=c["positions"], width=c["width"], heads=c["heads"],
                               attention="sdpa")

    def describe(self) -> str:
        c = self.config
        if self.name == "linear":
            return f"stages of {c['layers']} x Linear({c['width']}, {c['width']}), 32 rows in 4 micro-batches"
        return (f"GPT-2 of 2 blocks per stage, width {c['width']}, {c['heads']} heads, vocabulary {c['vocab']}, "
                f"{c['positions']} positions, {c['rows_per_batch']} rows per micro-batch")


def make_linear_stage(width: int, layers: int) -> nn.Module:
    """``layers`` Linear(width, width) with a ReLU between each two."""
    modules: list[nn.Module] = []
    for i in range(layers):
        if i:
            modules.append(nn.ReLU())
        modules.append(nn.Linear(width, width))
    return nn.Sequential(*modules)


def sgd(params):
    return torch.optim.SGD(params, lr=LR)


def shape_of(kind: str, W: int, B: int) -> tuple[int, int, int]:
    """(workers, stages, micro-batches) of a strategy: fsdp takes one micro-batch per rank."""
    return (W, W, W) if kind == "fsdp" else (W, W, B)


def make_schedule(kind: str, W: int, S: int, B: int):
    return unisched.simulate(W, S, B, policies.get(kind, num_workers=W, num_stages=S, num_batches=B))


# ---------------------------------------------------------------------- what a forward keeps
def kept_bytes(stages, micro_batch) -> list[float]:
    """Per stage, the bytes a forward keeps for its backward when its autograd
    graph is kept: its inputs, its output and the tensors autograd saves
    (parameters left out, each storage counted once), on one micro-batch."""
    out = []
    x = micro_batch
    for stage in stages:
        params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
        seen: dict[int, int] = {}

        def keep(t: torch.Tensor):
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                seen[storage.data_ptr()] = storage.nbytes()
            return t

        x = x.detach().requires_grad_(x.is_floating_point())
        keep(x)
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            y = stage(x)
        keep(y)
        out.append(float(sum(seen.values())))
        x = y
    return out


def backward_workspace(stages, micro_batch, target, loss_fn, split: bool = False) -> list[float]:
    """Per stage, the most a backward that accumulates into existing
    gradients allocates above what it starts with (torch's allocations, as
    the ranks are measured): the fresh gradient of a parameter before it is
    added, the gradients of the stage's activations, less the saved tensors
    autograd frees as it goes (the forward runs while measuring, so that
    their release counts, as it does on a rank).  ``split``: the larger of
    the two halves as the runtime runs them, the input-gradient pass
    keeping the graph for the weight pass (nothing freed; none at a source
    stage, whose input is the data) and the weight pass freeing it.  One
    micro-batch, once per stage: like the stash, a property of the stage."""
    out = []
    x = micro_batch
    for s, stage in enumerate(stages):
        x = x.detach().requires_grad_(x.is_floating_point())
        last = s == len(stages) - 1
        params = [p for p in stage.parameters() if p.requires_grad]
        kept: dict = {}

        def forward():
            kept["y"] = stage(x)

        def root(y):
            """What the backward differentiates (the loss at the last stage) and with which gradient;
            the output stays held while it runs, as on a rank."""
            return (loss_fn(y, target), None) if last else (y, torch.ones_like(y))

        def whole():
            y = kept.pop("y")
            torch.autograd.backward(*root(y))

        def input_pass():
            y = kept.pop("y")
            kept["root"] = root(y)  # kept for the weight pass, as the runtime keeps it
            if s:
                torch.autograd.grad(kept["root"][0], [x], kept["root"][1], retain_graph=True)

        def weight_pass():
            torch.autograd.backward(*kept.pop("root"), inputs=params)

        forward()
        whole()  # the gradients now exist, as after a rank's first backward of the stage
        if split:
            halves = (allocated_peak(input_pass, before=forward),
                      allocated_peak(weight_pass, before=lambda: (forward(), input_pass())))
            out.append(float(max(halves)))
        else:
            out.append(float(allocated_peak(whole, before=forward)))
        stage.zero_grad(set_to_none=True)
        x = stage(x).detach()
    return out


# ---------------------------------------------------------------------- measuring a rank
LIBC = ctypes.CDLL("libc.so.6")


def fix_mmap_threshold() -> None:
    """Freed tensors larger than the threshold go back to the system at once, so RSS follows the live tensors."""
    M_MMAP_THRESHOLD = -3
    LIBC.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rss_peak_since_reset() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_peak() -> None:
    """Reset the kernel's peak RSS of this process to its RSS now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def lifetime_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def allocated_peak(run, before=None) -> int:
    """The most torch's CPU allocator holds, above what it held before, while ``run()`` runs.

    The profiler's memory events carry the running total of the bytes
    allocated since profiling began, less those freed (tensors made before
    are left out, so their release cannot lower it); its largest value is
    the peak growth, in the bytes asked for, without page rounding.
    ``before()``, if given, runs first under the profiler, so that what it
    makes and ``run()`` frees counts; the growth is then taken from the
    total when ``run()`` starts."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        if before is not None:
            before()
        with record_function(MEASURED):
            run()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    begin = min(e["ts"] for e in events if e.get("name") == MEASURED and e.get("ph") == "X")
    totals = sorted((e["ts"], e["args"]["Total Allocated"]) for e in events
                    if e.get("name") == "[memory]" and e["args"].get("Device Type") == CPU_DEVICE_TYPE)
    start = next((total for ts, total in reversed(totals) if ts < begin), 0)
    return max([total for ts, total in totals if ts >= begin], default=start) - start


def baseline() -> int:
    dist.barrier()
    gc.collect()
    LIBC.malloc_trim(0)
    rss = rss_now()
    reset_peak()
    return rss


def _unisched(rank: int, world: int, model: Model, kind: str, config: dict) -> dict:
    fix_mmap_threshold()
    start = rss_now()
    W, S, B = shape_of(kind, world, model.micro_batches)
    x, y = model.batch(B)
    schedule = make_schedule(kind, W, S, B)
    trainer = Trainer(model.stages(S), schedule, model.loss_fn(), sgd, record=False)
    built = [s for s, stage in enumerate(trainer.stages) if stage is not None]
    trainer.step(x, y)
    base = baseline()
    for _ in range(config["steps"]):
        trainer.step(x, y)
    dist.barrier()
    result = {"start": start, "baseline": base, "peak": rss_peak_since_reset(), "lifetime_peak": lifetime_peak(),
              "stages_built": built}

    def steps():
        for _ in range(config["steps"]):
            trainer.step(x, y)

    dist.barrier()
    gc.collect()
    result["allocated_growth"] = allocated_peak(steps)
    dist.barrier()
    costs = trainer.calibrate(x, y, steps=3)
    owned = [s for s in range(S) if rank in trainer.program.replicas[s]]
    result["weights_of_truth"] = float(sum(trainer.weight_bytes[s] for s in owned))
    result["optimizer_state"] = float(sum(costs.per_stage("optimizer_bytes", S)[owned]))
    if rank == 0:
        result["costs"] = costs
    trainer.close()
    return result


def _torch(rank: int, world: int, model: Model, kind: str, config: dict) -> dict:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    fix_mmap_threshold()
    start = rss_now()
    B = model.micro_batches
    x, y = model.batch(B)
    module = build_stages(model.stages(world), world, only=[rank])[rank]
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    schedule_cls = {"gpipe": ScheduleGPipe, "one_f_one_b": Schedule1F1B}[kind]
    schedule = schedule_cls(stage, n_microbatches=B, loss_fn=model.loss_fn())
    optimizer = sgd(module.parameters())

    def step():
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=y, losses=[])
        else:
            schedule.step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    base = baseline()
    for _ in range(config["steps"]):
        step()
    dist.barrier()
    return {"start": start, "baseline": base, "peak": rss_peak_since_reset(), "lifetime_peak": lifetime_peak(),
            "stages_built": [rank]}


def measure(fn, world: int, model: Model, kind: str, config: dict) -> list[dict]:
    """``fn`` on ``world`` freshly launched ranks; their measurements, or an error."""
    results = run_local(fn, world, model, kind, config, timeout=config["timeout"], group_timeout=300)
    failed = [r for r in results if r.error is not None]
    if failed:
        raise RuntimeError(f"{fn.__name__} {model.name} {kind}: " + "; ".join(f"rank {r.rank}: {r.error}" for r in failed))
    return [r.value for r in results]


# ---------------------------------------------------------------------- prediction
def predicted_peaks(model: Model, kind: str, W: int, costs) -> tuple[list[float], list[dict], list[float], list[float]]:
    """The simulator's peak bytes per rank for the schedule that ran, under
    ``costs`` (calibrated, with the Trainer's optimizer state) with the stash
    sizes and backward workspaces measured on the real stages; per rank, what
    each of the memory model's kinds holds at that peak; the workspaces, and
    the Trainer's own (each stage's largest parameter)."""
    _, S, B = shape_of(kind, W, model.micro_batches)
    stages = build_stages(model.stages(S), S)
    x, y = model.batch(B)
    stash = kept_bytes(stages, x.chunk(B)[0])
    schedule = make_schedule(kind, W, S, B)
    workspace = backward_workspace(stages, x.chunk(B)[0], y.chunk(B)[0], model.loss_fn(),
                                   split=bool(schedule.timeline.split_backward))
    derived = list(costs.per_stage("backward_workspace_bytes", S))
    costs = dataclasses.replace(costs, stash_bytes=stash, input_grad_frees=0.0, backward_workspace_bytes=workspace)
    timeline = predict(schedule, costs).timeline
    total = memory_curves(timeline, "total", "bytes")
    at_peak = [float(c.times[np.argmax(c.values)]) for c in total]
    by_kind = {k: memory_curves(timeline, k, "bytes") for k in MEMORY_KINDS}
    parts = [{k: curves[w].at(t) for k, curves in by_kind.items()} for w, t in enumerate(at_peak)]
    return [c.peak for c in total], parts, workspace, derived


# ---------------------------------------------------------------------- report
def run_model(model: Model, W: int, config: dict, kinds_torch, kinds_simulated) -> dict:
    out: dict = {"torch": {}, "simulated": {}}
    for kind in kinds_torch:
        out["torch"][kind] = {"unisched": measure(_unisched, W, model, kind, config),
                              "torch": measure(_torch, W, model, kind, config)}
    for kind in kinds_simulated:
        ranks = out["torch"].get(kind, {}).get("unisched") or measure(_unisched, W, model, kind, config)
        costs = ranks[0].pop("costs", None)
        for r in ranks[1:]:
            r.pop("costs", None)
        predicted, parts, workspace, derived = predicted_peaks(model, kind, W, costs)
        out["simulated"][kind] = [
            {"predicted_peak": p, "predicted_parts": part, "held": r["weights_of_truth"] + r["optimizer_state"],
             "measured_growth": r["allocated_growth"], "rss_growth": r["peak"] - r["baseline"],
             "predicted_growth": p - r["weights_of_truth"] - r["optimizer_state"]}
            for p, part, r in zip(predicted, parts, ranks)
        ]
        out.setdefault("backward_workspace", {})[kind] = workspace
        out.setdefault("largest_parameter", derived)
    for kind in kinds_torch:
        for r in out["torch"][kind]["unisched"]:
            r.pop("costs", None)
    return out


def ratios(run: dict) -> dict:
    torch_ratios = {
        kind: {
            "lifetime_peak": [u["lifetime_peak"] / t["lifetime_peak"] for u, t in zip(pair["unisched"], pair["torch"])],
            "step_peak": [u["peak"] / t["peak"] for u, t in zip(pair["unisched"], pair["torch"])],
            "step_growth": [(u["peak"] - u["baseline"]) / max(t["peak"] - t["baseline"], 1)
                            for u, t in zip(pair["unisched"], pair["torch"])],
        }
        for kind, pair in run["torch"].items()
    }
    simulated = {
        kind: {
            "growth": [r["measured_growth"] / max(r["predicted_growth"], 1) for r in rows],
            "peak": [(r["held"] + r["measured_growth"]) / max(r["predicted_peak"], 1) for r in rows],
            "rss_peak": [(r["held"] + r["rss_growth"]) / max(r["predicted_peak"], 1) for r in rows],
        }
        for kind, rows in run["simulated"].items()
    }
    return {"vs_torch": torch_ratios, "measured_vs_simulated": simulated}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("linear", "gpt2", "both"), default="both", help="which model (default both)")
    parser.add_argument("--ranks", type=int, default=2, help="processes = pipeline stages (default 2)")
    parser.add_argument("--width", type=int, default=4096, help="Linear width (default 4096)")
    parser.add_argument("--layers", type=int, default=2, help="Linear layers per stage (default 2)")
    parser.add_argument("--gpt2-width", type=int, default=64, help="GPT-2 n_embd (default 64, examples/gpt2.py's)")
    parser.add_argument("--steps", type=int, default=3, help="measured training steps per system (default 3)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per launch (default 300)")
    parser.add_argument("--schedules", default=",".join(SIMULATED_KINDS),
                        help=f"comma-separated schedules to run (default all: {','.join(SIMULATED_KINDS)}); "
                             f"those of {', '.join(TORCH_KINDS)} are also run against torch")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    schedules = [k for k in args.schedules.split(",") if k]
    unknown = [k for k in schedules if k not in SIMULATED_KINDS]
    if unknown or not schedules:
        parser.error(f"--schedules: {','.join(unknown) or 'none given'} not among {','.join(SIMULATED_KINDS)}; "
                     f"pass some of them, comma-separated")
    W = args.ranks
    config = {"steps": args.steps, "timeout": args.timeout}
    models = {
        "linear": Model("linear", {"width": args.width, "layers": args.layers}),
        "gpt2": Model("gpt2", {"width": args.gpt2_width, "heads": 4, "vocab": 128, "positions": 32, "rows_per_batch": 4}),
    }
    chosen = list(models) if args.model == "both" else [args.model]
    started = time.perf_counter()
    kinds_torch = [k for k in schedules if k in TORCH_KINDS]
    runs = {name: run_model(models[name], W, config, kinds_torch, schedules) for name in chosen}
    result = {"runs": runs, "ratios": {name: ratios(run) for name, run in runs.items()},
              "config": {"ranks": W, "steps": args.steps, "lr": LR, "backend": "gloo", "cpus": os.cpu_count(),
                         "mmap_threshold": MMAP_THRESHOLD, "seconds": time.perf_counter() - started,
                         "models": {name: models[name].describe() for name in chosen}}}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    show(result, W)
    return 0


def show(result: dict, W: int) -> None:
    c = result["config"]
    print(f"{W} ranks (gloo, CPU), SGD, {c['steps']} measured steps after one warm-up ({c['seconds']:.0f} s; "
          f"{c['cpus']} CPUs); MiB")
    for name, run in result["runs"].items():
        r = result["ratios"][name]
        print(f"\n{name}: {c['models'][name]}")
        if run["torch"]:
            print("  vs torch.distributed.pipelining, per rank: RSS at start / baseline after warm-up / step peak / "
              "lifetime peak")
        for kind in run["torch"]:
            torch_name = TORCH_KINDS[kind]
            for system, label in (("unisched", f"unisched {kind}"), ("torch", f"torch {torch_name}")):
                for rank, m in enumerate(run["torch"][kind][system]):
                    print(f"    {label:<22} rank {rank}  {m['start'] / MiB:6.1f} / {m['baseline'] / MiB:6.1f} / "
                          f"{m['peak'] / MiB:6.1f} / {m['lifetime_peak'] / MiB:6.1f}   step growth "
                          f"{(m['peak'] - m['baseline']) / MiB:6.2f}   stages built {m['stages_built']}")
        if run["torch"]:
            print("  ratios unisched / torch per rank (<= 1.0: as small or smaller): step peak, lifetime peak, step growth")
        for kind in run["torch"]:
            torch_name, v = TORCH_KINDS[kind], r["vs_torch"][kind]
            for rank in range(W):
                print(f"    {kind + ' / ' + torch_name:<28} rank {rank}  step peak {v['step_peak'][rank]:6.3f}   "
                      f"lifetime peak {v['lifetime_peak'][rank]:6.3f}   step growth {v['step_growth'][rank]:6.3f}")
        print("  vs the simulator, per rank: held between steps (weights of truth, optimizer state), predicted "
              "peak, predicted and measured (allocator) growth above what is held; ratios measured / predicted "
              "(peak: allocator; RSS: the same with the RSS growth)")
        print("  backward workspace per stage, measured (in the prediction): "
              + "; ".join(f"{kind} " + ", ".join(f"{w / MiB:.3f}" for w in sizes)
                          for kind, sizes in run.get("backward_workspace", {}).items())
              + "; the Trainer's largest parameter: "
              + ", ".join(f"{w / MiB:.3f}" for w in run.get("largest_parameter", [])))
        for kind, rows in run["simulated"].items():
            v = r["measured_vs_simulated"][kind]
            for rank, row in enumerate(rows):
                print(f"    {kind:<12} rank {rank}  held {row['held'] / MiB:7.2f}  predicted "
                      f"{row['predicted_peak'] / MiB:7.2f}  growth: predicted {row['predicted_growth'] / MiB:7.2f} "
                      f"measured {row['measured_growth'] / MiB:7.2f} (RSS {row['rss_growth'] / MiB:7.2f})   "
                      f"ratio growth {v['growth'][rank]:6.3f}  peak {v['peak'][rank]:6.3f}  RSS {v['rss_peak'][rank]:6.3f}")
                print(f"{'':<23}predicted peak of: " + ", ".join(
                    f"{k} {b / MiB:.2f}" for k, b in row["predicted_parts"].items() if b))


if __name__ == "__main__":
    sys.exit(main())
