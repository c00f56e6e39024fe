"""``unisched plan``: the planner on the command line.

With no arguments it plans an embedded problem (4 workers, 4 stages, 8
micro-batches, 2 activations of memory per worker), where no named strategy
comes close to the bound and a CP-SAT mapping does.  ``--out`` writes the
plan file (``.json``) or draws the plan (``.png``, ``.svg``, ``.pdf``,
``.html``, ``.txt``).

It also reads your own strategy function named on the command line,
``--strategy MODULE:FUNCTION`` or ``path/to/file.py:FUNCTION``, for every
verb (:func:`user_strategy`).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import inspect
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Mapping

from unisched.render.text import add_color_arguments, check_width
from unisched import metrics
from unisched.errors import ShapeError, StrategyError, UniSchedError
from unisched.costs import Costs
from unisched.topology import ClusterCosts, cluster_json, describe_cluster, presets
from unisched.flags import (COST_FLAGS, DEMO_SHAPE, STRATEGY_HELP, add_cost_arguments, add_memory_limit_argument,
                            add_shape_arguments, check_writable, cost_values, named, numbers, shape_of)
from unisched.strategy import Strategy, as_strategy, required_arguments
from unisched.work import Shape

from unisched.plan.family import default_progress, other_backward
from unisched.policies.grammar import label_of, parse_params, strategy_spec
from unisched.plan.planfile import ANY_SCHEDULE, OBJECTIVES, Plan, check_plan_path, jsonable
from unisched.plan.planner import SCHEMES, SEARCHES, plan
from unisched.plan.problem import PlanInputError, check_plan_size, encode_costs, split_from
from unisched.plan.search import SEARCH_FROM_ITEMS

DEFAULT_MEMORY_LIMIT = 2.0
DEFAULT_TIME_LIMIT = 10.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Search the registered strategies with the simulator, then improve on them with OR-Tools CP-SAT "
        "(the order of work for a fixed mapping, then the mapping itself), and report how close the best "
        "plan is to a lower bound. With no arguments: a demo problem "
        f"(W={DEMO_SHAPE[0]}, S={DEMO_SHAPE[1]}, B={DEMO_SHAPE[2]}, memory limit {DEFAULT_MEMORY_LIMIT:g}); "
        "any flag of the problem (shape, costs, limits, strategy) plans that problem instead, with no memory "
        "limit unless one is given."
    )
    add_shape_arguments(parser)
    costs = add_cost_arguments(parser)
    costs.add_argument(
        "--topology", type=named, metavar="FILE|PRESET",
        help="plan for a cluster: a JSON topology file (docs/topology.md) or a preset "
        f"({', '.join(presets())}), read as `unisched simulate --topology` reads it; every transfer takes its route's "
        "bottleneck, the CP-SAT models without contention, every candidate's replay with it (docs/planning.md); "
        "times in seconds and sizes in bytes (give them with --costs); not with --comm or --fetch",
    )
    limits = parser.add_argument_group("limits")
    add_memory_limit_argument(limits, " (each worker is planned under its own)")
    limits.add_argument("--max-stages-per-worker", type=int, help="how many stages' weights a worker may hold")
    limits.add_argument("--memory-budget", metavar="BYTES",
                        help="bytes a worker may hold in all: its weights (owned and fetched), their optimizer "
                        "state and its stashes (needs a costs file with sizes); one number, or one per worker "
                        "separated by commas")
    limits.add_argument("--optimizer-bytes", metavar="BYTES",
                        help="optimizer state per stage, held by the stage's weight worker (with --memory-budget); "
                        "one number, or one per stage separated by commas")
    search = parser.add_argument_group("search")
    search.add_argument("--strategy", type=named, help="keep this strategy's mapping and optimize only the order of work: "
                        + STRATEGY_HELP)
    search.add_argument("--param", action="append", default=[], metavar="K=V",
                        help="parameter of --strategy, repeatable (e.g. group_size=2); the same as NAME(K=V)")
    search.add_argument("--time-limit", type=float, default=None,
                        help=f"seconds for the whole search (default {DEFAULT_TIME_LIMIT:g}); Ctrl-C stops it early "
                        "with the best plan so far")
    search.add_argument("--objective", choices=OBJECTIVES, default="latency",
                        help="what to minimize: the step's latency (default), or the longest busy span of one "
                        "worker (first item to last; the zero-bubble paper's measure when steps follow each other)")
    search.add_argument("--scheme", choices=SCHEMES, default="auto",
                        help="the class the CP-SAT mapping search covers: whole (a backward may run on another "
                        "worker than its forward), paired (one worker per stage and micro-batch), auto (default): "
                        "whole on small problems, then every schedule (replicated weights, a split backward's I and "
                        "W apart) with at least half the time left; not with --strategy, whose mapping is kept")
    search.add_argument("--search", choices=SEARCHES, default="auto",
                        help="cpsat: the CP-SAT models; heuristic: list scheduling and local search on the named "
                        f"strategies' mappings (unisched.plan.search); auto (default): heuristic from "
                        f"{SEARCH_FROM_ITEMS} work items on, where the CP-SAT models do not finish")
    output = parser.add_argument_group("output")
    output.add_argument("--out", action="append", default=[], type=named, metavar="FILE",
                        help="by extension: .json writes the plan file (unisched.load_plan, `unisched simulate "
                        "--plan`, `unisched run --plan`); .png .svg .pdf .html .txt draw the plan's schedule; "
                        "repeatable")
    output.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    output.add_argument("--width", type=int, default=100, help="diagram width (default 100)")
    add_color_arguments(output)


def run(args: argparse.Namespace) -> int:
    demo = _is_demo(args)
    W, S, B = shape_of(args)
    Shape(W, S, B).check()
    check_plan_size(Shape(W, S, B), heuristic=True)  # before per-worker tables that large (again with the costs' split)
    memory_limit = (DEFAULT_MEMORY_LIMIT if demo
                    else numbers("--memory-limit", args.memory_limit, W, "workers", error=PlanInputError))
    time_limit = args.time_limit if args.time_limit is not None else DEFAULT_TIME_LIMIT
    if not (time_limit > 0 and math.isfinite(time_limit)):
        raise PlanInputError(f"--time-limit must be a positive number of seconds, got {time_limit:g}")
    outputs = _outputs(args.out)
    check_width(args.width, "--width")
    costs = costs_from_flags(args, (W, S))
    split = split_from(costs, None)  # the flags' halves are in the costs now
    budget = numbers("--memory-budget", args.memory_budget, W, "workers", error=PlanInputError)
    optimizer = numbers("--optimizer-bytes", args.optimizer_bytes, S, "stages", error=PlanInputError)
    if optimizer is not None and budget is None:
        raise PlanInputError("--optimizer-bytes counts against --memory-budget: give a --memory-budget too")
    check_plan_size(Shape(W, S, B), split, heuristic=True)  # before building a strategy that large
    strategy, members = _named_strategy(args, (W, S, B), split)
    result = plan(
        W, S, B, costs,
        memory_limit=memory_limit,
        max_stages_per_worker=args.max_stages_per_worker,
        strategy=strategy,
        time_limit=time_limit,
        split_backward=split,
        members=members,
        progress=default_progress(args.json),
        memory_budget=budget,
        optimizer_bytes=optimizer or 0.0,
        objective=args.objective,
        scheme=args.scheme,
        search=args.search,
    )
    if args.json:
        print(json.dumps(jsonable(summary(result)), indent=1), flush=True)  # kept if a file cannot be written
        write_outputs(result, outputs)
        return 0
    print(report(result, width=args.width, color=args.color), flush=True)  # kept if a file cannot be written
    written = write_outputs(result, outputs)
    if written:
        print()
    for path, what in written:
        print(f"wrote {path}: {what}")
    return 0


def _named_strategy(args: argparse.Namespace, shape, split: bool):
    """``--strategy`` as (label, members): your own strategy as the only member, a registered
    one by its label; refused up front when its fixed order needs the other backward form."""
    named = _strategy(args.strategy, args.param)
    if named is None:
        return None, None
    label = label_of(*named)
    if is_user_strategy(named[0]):
        return label, [(label, user_strategy(named[0], shape, named[1], label=label), "")]
    from unisched import policies

    built = policies.get(named[0], *shape, **named[1])
    reason = other_backward(built, split)
    if reason:
        flags = ("--backward-input and --backward-weight (e.g. --backward-input 1 --backward-weight 1, the halves "
                 "of the default backward 2, as simulate splits it; or a costs file with backward_input and "
                 "backward_weight)" if built.split_backward else "no --backward-input/--backward-weight")
        raise PlanInputError(f"--strategy {label}: {reason}; give {flags}, or choose another strategy")
    return label, None


def _outputs(paths) -> list[str]:
    """``--out`` values, each checked by extension before any planning."""
    paths = [paths] if isinstance(paths, str) else list(paths or [])
    for path in paths:
        check_plan_path(path, said=f"--out {path}")
        check_writable(path, f"--out {path}")
    return paths


def write_outputs(result: Plan, paths) -> list[tuple[str, str]]:
    """Write the plan file (``.json``) or draw the plan's replay (an image, ``.html``, ``.txt``) to each path."""
    written = []
    for path in _outputs(paths):
        result.save(path)
        if Path(path).suffix.lower() == ".json":
            written.append((path, f"the plan file (replay it: unisched simulate --plan {path}, "
                                  f"or unisched.load_plan({path!r}).simulate())"))
        else:
            written.append((path, "the plan's schedule, drawn"))
    return written


def _strategy(text: str | None, params: list[str]) -> tuple[str, dict] | None:
    """``--strategy NAME(k=v, ...)`` and ``--param k=v`` as (name, parameters), the grammar of ``unisched simulate``."""
    given = parse_params(params)
    if text is None:
        if given:
            raise PlanInputError("--param needs --strategy: it sets a parameter of the strategy whose mapping is kept")
        return None
    return strategy_spec(text, given)


def summary(result: Plan) -> dict:
    """The --json object (with ``topology``, sized to the workers, when planned on a cluster)."""
    return {**_summary(result), **cluster_json(result.costs, result.shape[0])}


def _summary(result: Plan) -> dict:
    W, S, B = result.shape
    return {
        "shape": [W, S, B],  # and throughput, as simulate --json and compare --json give them
        "search": result.search,
        "objective": result.objective,
        "objective_value": result.value,
        "latency": result.latency,
        "throughput": B / result.latency if result.latency else None,
        "optimal": result.optimal_overall,
        "proven_for": result.claimed_class(),
        "lower_bound": result.lower_bound,
        "bound_for": result.bound_for,
        "gap": result.gap,
        "strategy": result.strategy_name,
        "bounds": dict(result.bounds),
        "bound_classes": dict(result.bound_classes),
        "interrupted": result.interrupted,
        "elapsed": result.elapsed,
        "plan": result.to_dict(),
    }


def report(result: Plan, width: int = 100, color: bool | str | None = None) -> str:
    W, S, B = result.shape
    problem = result.problem
    limit = problem.memory_limit
    shown = (",".join(f"{v:g}" for v in limit) if isinstance(limit, (tuple, list)) else f"{limit:g}") if limit else ""
    lines = [
        f"plan: W={W} S={S} B={B}" + (f", memory limit {shown}" if shown else "")
        + (f", at most {problem.max_stages_per_worker} stage{'s' if problem.max_stages_per_worker != 1 else ''} per "
           "worker" if problem.max_stages_per_worker else "")
        + (f" ({result.elapsed:.1f} s)" if result.elapsed is not None else ""),
        f"search: {result.search}, minimizing {result.objective}"
        + (" (interrupted: the best plan so far)" if result.interrupted else ""),
        *_on_cluster(result),
        "",
        f"{'#':>2}  {'strategy':<44} {'source':<13} {'latency':>8} {'bubble':>7} {'peak act':>8} "
        f"{'traffic':>7} {'gap':>7}  optimal",
    ]
    for rank, row in enumerate(result.candidates[:12], start=1):
        lines.append(
            f"{rank:>2}  {_fit(str(row.get('strategy')), 44):<44} {str(row.get('source', '')):<13} "
            f"{_cell(row, 'latency', 'g'):>8} {_cell(row, 'bubble', '.1%'):>7} "
            f"{_cell(row, 'peak_activations', 'g'):>8} {_cell(row, 'traffic', 'g'):>7} {_cell(row, 'gap', '.1%'):>7}  "
            f"{'yes' if row.get('optimal') else ''}{' (pareto)' if row.get('pareto') else ''}"
        )
    if len(result.candidates) > 12:
        lines.append(f"    ... {len(result.candidates) - 12} more")
    if result.dropped:
        lines.append("dropped: " + _dropped(result.dropped))
    lines += [
        "",
        *_bound_lines(result),
        f"best: {result.strategy_name}: latency {result.latency:g}"
        + (f", span {result.value:g}" if result.objective != "latency" else "") + ", " + _claim(result),
        "",
        _diagram(result, width, color),
    ]
    return "\n".join(lines)


def _fit(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters, an ellipsis saying where it was cut."""
    return text if len(text) <= width else text[:width - 1] + "…"


def _bound_lines(result: Plan) -> list[str]:
    """The lower bounds, each under the class of schedules it holds for (a bound of a restricted
    class says nothing of the schedules outside it); a plan file without classes names only the
    class of the plan's own bound, as it was written."""
    head = f"lower bounds ({result.objective})"

    def named(keys) -> str:
        return ", ".join(f"{k.replace('_', ' ')} {result.bounds[k]:g}" for k in keys)

    if not result.bound_classes:
        return [f"{head}: {named(result.bounds)}" + (f" (for {result.bound_for})" if result.bound_for else "")]
    by_class: dict[str, list[str]] = {}
    for key in result.bounds:
        by_class.setdefault(result.bound_classes.get(key, ANY_SCHEDULE), []).append(key)
    classes = sorted(by_class, key=lambda name: name != ANY_SCHEDULE)
    lines = [f"{head}, for {classes[0]}: {named(by_class[classes[0]])}"]
    lines += [f"  for {name} only: {named(by_class[name])}" for name in classes[1:]]
    return lines


def _on_cluster(result: Plan) -> list[str]:
    """The report's line naming the topology a plan was made for (none without one)."""
    topology = cluster_json(result.costs, result.shape[0]).get("topology")
    if topology is None:
        return []
    return [describe_cluster(topology) + "; latencies are replays with link contention"]


def _claim(result: Plan) -> str:
    """What is proven about the best plan, never more: optimal over every schedule, optimal
    within a restricted class (named), or how far it is above the lower bound."""
    claimed = result.claimed_class()
    if claimed == ANY_SCHEDULE:
        return "proven optimal"
    above = f"{metrics.above(result.value, result.lower_bound)} the lower bound {result.lower_bound:g}"
    unbeaten = result.unbeaten_in()
    if unbeaten:
        above += f"; none of the {unbeaten} is shorter (proven)"
    if claimed:
        return f"proven optimal among {claimed} only; " + above if result.gap > 1e-9 else \
            f"proven optimal among {claimed} only"
    return above


def _cell(row, key: str, spec: str) -> str:
    """A number of the table, or "-" where a plan file left it out."""
    value = row.get(key)
    return "-" if value is None else format(value, spec)


def _dropped(dropped) -> str:
    """Dropped members grouped by the first clause of their reason."""
    groups: dict[str, list[str]] = {}
    for row in dropped:
        reason = row["reason"].split(":")[0] if row["reason"].startswith("deadlock") else row["reason"]
        groups.setdefault(reason, []).append(row["strategy"])  # whole: its end says what to raise, and to what
    return "; ".join(f"{', '.join(names)} ({reason})" for reason, names in groups.items())


def _diagram(result: Plan, width: int, color: bool | str | None) -> str:
    sim = result.simulate()
    try:
        return sim.timeline.to_text(width=width, color=color)
    except ImportError:
        rows = []
        for w, works in result.worker_orders().items():
            rows.append(f"worker {w}: " + " ".join(str(x) for x in works))
        return "\n".join(rows)


def _is_demo(args: argparse.Namespace) -> bool:
    given = (args.workers, args.stages, args.batches, args.forward, args.backward, args.backward_input,
             args.backward_weight, args.costs, args.memory_limit, args.max_stages_per_worker, args.strategy,
             args.memory_budget, args.optimizer_bytes, args.topology, args.comm, args.fetch)
    return all(value is None for value in given) and not args.param


def costs_from_flags(args: argparse.Namespace, shape: tuple[int, int], encode_free_links: bool = True) -> Costs:
    """The costs file, or the costs ``--comm`` and ``--fetch`` encode, with the time flags put in
    (:meth:`Costs.with_times`); with ``--topology``, on that cluster, from the file (or the
    defaults).  Every verb that takes costs (simulate, compare, plan) reads its flags here.
    Without any of these, ``encode_free_links`` gives the planner's encoding of links that take
    no time (:func:`encode_costs`), else :class:`Costs`' defaults (what ``simulate`` shows).
    The costs are checked against ``shape`` (W, S) before anything runs, a costs file's faults
    named with the file."""
    costs = _read_costs(args, encode_free_links)
    try:
        costs.check(*shape)
    except ShapeError as error:
        if not args.costs or args.topology:
            raise
        W, S = shape
        raise PlanInputError(f"costs file {args.costs}: {error} (W={W}, S={S}): fix the file or the shape") from None
    return costs


def _read_costs(args: argparse.Namespace, encode_free_links: bool) -> Costs:
    times = cost_values(args, (*COST_FLAGS, "comm", "fetch"), PlanInputError)
    links = {flag: times.pop(flag) for flag in ("comm", "fetch") if flag in times}
    clashing = [f"--{flag}" for flag, value in links.items() if value]
    if clashing and args.topology:
        raise PlanInputError(f"--topology {args.topology} prices every transfer on the cluster; drop "
                             f"{', '.join(clashing)} and give the sizes moved in a --costs file (activation_bytes, "
                             "weight_bytes)")
    if clashing and args.costs:
        instead = {"--comm": "\"latency\" (each transfer's time where it gives no sizes)",
                   "--fetch": "\"weight_bytes\" and \"bandwidth\" (a weight fetch takes latency + weight_bytes / "
                              "bandwidth)"}
        raise PlanInputError(f"--costs {args.costs} and {', '.join(clashing)} do not combine: a costs file prices "
                             f"every transfer itself (latency, bandwidth, sizes, links); drop {', '.join(clashing)} "
                             f"and give the file {' and '.join(instead[flag] for flag in clashing)}, or give the "
                             "pass times as flags instead of the file")
    try:
        if args.costs or args.topology or not (clashing or encode_free_links):
            return ClusterCosts.read(args.costs, times, args.topology)
        return encode_costs(comm=links.get("comm", 0.0), fetch=links.get("fetch", 0.0)).with_times(**times)
    except ShapeError as error:
        raise PlanInputError(str(error)) from None


# ---------------------------------------------------------------------- your own strategy
def is_user_strategy(name: str) -> bool:
    """Whether a strategy name points at your own code (``MODULE:FUNCTION``) rather than the registry."""
    return ":" in str(name)


def user_strategy(target: str, shape: Shape | tuple[int, int, int], params: Mapping[str, Any] | None = None,
                  label: str | None = None) -> Strategy:
    """Your own strategy, named ``MODULE:FUNCTION`` or ``path/to/file.py:FUNCTION``.

    The rule, by what the name holds:

    - a :class:`~unisched.Strategy` is used as it is;
    - a function of one required argument is the mapping, called with each
      ``Work`` and returning ``ComputeAndWeightWorkers`` (``unisched.as_strategy``);
    - a function of three required arguments is a factory, called as
      ``f(num_workers, num_stages, num_batches, **params)`` like the
      registry's, and returns a Strategy or a mapping.

    ``params`` (from ``--param`` or ``NAME(key=value)``) go to a factory
    only; a value that reads as a Python literal (``2``, ``0.5``, ``True``)
    is passed as one, any other as a string.  A module is looked for on the
    Python path and in the current directory."""
    W, S, B = Shape(*shape)
    obj = load_user_function(target)
    label = label or target
    params = {key: _literal(value) for key, value in (params or {}).items()}
    if isinstance(obj, Strategy):
        _no_params(target, params, "is a Strategy")
        return obj if obj.name else obj.with_(name=label)
    if required_arguments(obj) == 3:
        try:
            inspect.signature(obj).bind(W, S, B, **params)
        except TypeError as error:
            raise UniSchedError(f"strategy factory {target!r} cannot take these parameters ({error}); "
                                f"its signature is {target.rpartition(':')[2]}{inspect.signature(obj)}") from None
        try:
            made = obj(W, S, B, **params)
        except UniSchedError:
            raise  # e.g. a ShapeError: the strategy does not fit the shape
        except Exception as error:
            raise StrategyError(f"strategy factory {target!r} failed on W={W}, S={S}, B={B}"
                                f"{''.join(f', {k}={v!r}' for k, v in params.items())}: "
                                f"{type(error).__name__}: {error}") from error
        if isinstance(made, Strategy):  # the parameters it was made with are reported, as the registry's are
            return made.with_(name=made.name or label, params={**params, **dict(made.params)})
        if callable(made):
            return as_strategy(made, name=label).with_(params=params)
        raise UniSchedError(f"strategy factory {target!r} returned {type(made).__name__}; "
                            "return a unisched.Strategy or a function Work -> ComputeAndWeightWorkers")
    _no_params(target, params, "is a function of one argument (a Work)")
    return as_strategy(obj, name=label)


def load_user_function(target: str):
    """Import ``MODULE:FUNCTION`` or ``path/to/file.py:FUNCTION`` and check that
    it is a strategy function, a factory or a Strategy (see :func:`user_strategy`)."""
    source, _, attribute = str(target).strip().rpartition(":")
    source, attribute = source.strip(), attribute.strip()
    if not source or not attribute.isidentifier():
        raise UniSchedError(f"cannot read strategy {target!r}; write MODULE:FUNCTION or path/to/file.py:FUNCTION")
    module = _import_user_module(source, target)
    try:
        obj = getattr(module, attribute)
    except AttributeError:
        defined = sorted(name for name, value in vars(module).items() if callable(value) and not name.startswith("_")
                         and getattr(value, "__module__", None) == module.__name__)
        raise UniSchedError(f"{source} has no {attribute!r} for strategy {target!r}; "
                            f"it defines: {', '.join(defined) or 'no functions'}") from None
    if not isinstance(obj, Strategy):
        if not callable(obj):
            raise UniSchedError(f"strategy {target!r} is not a function: it is the {type(obj).__name__} {obj!r:.60}")
        if required_arguments(obj) not in (1, 3, None):
            raise UniSchedError(
                f"strategy {target!r} takes {required_arguments(obj)} required arguments; a strategy function "
                "takes one (a Work), a factory three (num_workers, num_stages, num_batches)"
            )
    return obj


def _import_user_module(source: str, target: str):
    if source.endswith(".py") or "/" in source or os.sep in source:
        path = Path(source).expanduser()
        if not path.is_file():
            raise UniSchedError(f"no file {source} for strategy {target!r}; give path/to/file.py:FUNCTION")
        name = f"unisched_user_{path.stem}_{abs(hash(str(path.resolve())))}"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise UniSchedError(f"cannot import {source} for strategy {target!r}: not a Python file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as error:
            del sys.modules[name]
            raise UniSchedError(f"importing {source} for strategy {target!r} failed: "
                                f"{type(error).__name__}: {error}") from error
        return module
    here = os.getcwd()
    added = here not in sys.path
    if added:
        sys.path.insert(0, here)
    try:
        return importlib.import_module(source)
    except ModuleNotFoundError as error:
        missing = error.name or ""
        if missing and (source == missing or source.startswith(missing + ".")):
            raise UniSchedError(
                f"no module {source!r} for strategy {target!r} (looked on the Python path and in {here}); "
                "give MODULE:FUNCTION for an importable module or path/to/file.py:FUNCTION"
            ) from None
        raise UniSchedError(f"importing {source} for strategy {target!r} failed: {error}") from error
    except Exception as error:
        raise UniSchedError(f"importing {source} for strategy {target!r} failed: "
                            f"{type(error).__name__}: {error}") from error
    finally:
        if added and here in sys.path:
            sys.path.remove(here)


def _no_params(target: str, params: Mapping[str, Any], what: str) -> None:
    if params:
        raise UniSchedError(
            f"strategy {target!r} {what} and takes no parameters ({', '.join(params)} given); to take them, "
            "write a factory f(num_workers, num_stages, num_batches, key=default) that returns the strategy"
        )


def _literal(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return ast.literal_eval(value.strip())
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return value.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="unisched plan")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except UniSchedError as error:
        print(f"unisched plan: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("unisched plan: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
