"""The ``unisched`` command.

    unisched                      a demo: strategies compared on a small shape
    unisched strategies           the strategy registry
    unisched simulate ...         one strategy: diagram, stats, files
    unisched compare ...          several strategies side by side, best first
    unisched plan ...             search for the best schedule (OR-Tools CP-SAT)
    unisched run ...              run a schedule for real under torchrun

Every verb takes ``--help``; ``--json`` prints one JSON object and nothing
else on stdout.  Errors go to stderr with exit status 2: one line (details,
such as a deadlock's blocked workers, indented on the lines after it), or
with ``--json`` one JSON object ``{"error": ..., "details": [...], "type": ...}``
as the last line of stderr, where every line is JSON (progress lines are
``{"progress": ...}``).

A strategy is named the same way everywhere: ``NAME`` or
``NAME(key=value, ...)``, and ``--param key=value`` (repeatable) adds
parameters to the strategy (or, in ``compare``, to every strategy listed).
Your own is ``MODULE:FUNCTION`` or ``path/to/file.py:FUNCTION``
(:func:`unisched.plan.command.user_strategy` says what it may be).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from unisched.errors import ShapeError, StrategyError, UniSchedError
from unisched.metrics import gap
from unisched.flags import (
    COST_FLAGS,
    STRATEGY_HELP,
    add_cost_arguments,
    add_memory_limit_argument,
    add_shape_arguments,
    cost_values,
    named,
    numbers,
    shape_of,
    splits_backward,
)
from unisched.render.text import add_color_arguments
from unisched.work import FORWARD, Shape, directions, name_key

DEMO_STRATEGIES = ("gpipe", "one_f_one_b", "looped", "interleaved", "zb_h1")

_EXTERNAL_VERBS = {
    # verb -> (module with add_arguments(parser) and run(args) -> int, one-line help)
    "plan": ("unisched.plan.command", "search for the best schedule and prove how good it is (OR-Tools CP-SAT)"),
    "run": ("unisched.execute.command", "run a strategy or plan for real on torch.distributed (torchrun)"),
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv = ["simulate", *argv]  # the demo, e.g. `unisched -W 8`
    as_json = "--json" in argv
    try:
        parser = build_parser(verb=argv[0])
        args, unknown = parser.parse_known_args(argv)
        if unknown:
            getattr(args, "verb_parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
        code = int(args.handler(args) or 0)
        sys.stdout.flush()  # a reader that went away is noticed here, not at exit
        return code
    except BrokenPipeError:  # e.g. piped into head: the reader has what it wanted
        _silence_stdout()
        return 0
    except CommandLineError as error:  # exits as argparse does
        if not as_json:
            print(error.usage.rstrip(), file=sys.stderr)
        raise SystemExit(_fail(str(error), as_json, type(error).__name__, prefix=f"{error.prog}: ")) from None
    except (UniSchedError, ValueError, OSError) as error:
        return _fail(str(error), as_json, type(error).__name__)
    except KeyboardInterrupt:  # outside a search, which answers with its best so far itself
        _fail("interrupted (Ctrl-C) before an answer was ready", as_json, "KeyboardInterrupt")
        return 130


class CommandLineError(UniSchedError):
    """Arguments the command line cannot read (argparse's complaints)."""

    def __init__(self, message: str, usage: str = "", prog: str = "unisched"):
        super().__init__(message)
        self.usage = usage
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    """argparse, raising its complaints so that ``main`` prints them like every other error.  No
    abbreviated options: ``--js`` is not ``--json`` (an error would not come out as JSON), and an
    abbreviation that means one option today may mean none or another when options are added."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message):
        raise CommandLineError(message, self.format_usage(), self.prog)


def _fail(message: str, as_json: bool, kind: str, prefix: str = "unisched: ") -> int:
    """Print an error: its summary on one line (a "To fix:" line joins it), details after."""
    lines = [line for line in str(message).strip().splitlines() if line.strip()] or [kind]
    fixes = [line.strip() for line in lines[1:] if line.strip().startswith("To fix")]
    details = [line for line in lines[1:] if not line.strip().startswith("To fix")]
    summary = " ".join([lines[0].strip(), *fixes])
    if as_json:
        print(json.dumps({"error": summary, "details": [d.strip() for d in details], "type": kind}), file=sys.stderr)
    else:
        print(f"{prefix}error: {summary}", file=sys.stderr)
        for line in details:
            print(line if line.startswith(" ") else "  " + line, file=sys.stderr)
    return 2


def _silence_stdout() -> None:
    """Point stdout at /dev/null so that flushing it at exit does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


def build_parser(verb: str | None = None) -> argparse.ArgumentParser:
    """The whole command line.  Of the verbs that live in other packages only
    ``verb`` (the one being run) is imported: `unisched plan` need not load
    torch for `unisched run`."""
    parser = _Parser(
        prog="unisched",
        description="Every distributed training strategy as a pair of functions: simulate, compare, plan, run.",
        epilog="With no arguments: a demo comparing strategies on a small shape.",
    )
    verbs = parser.add_subparsers(title="verbs", metavar="VERB")

    strategies = verbs.add_parser("strategies", help="list the registered strategies and their parameters")
    strategies.add_argument("--json", action="store_true", help="print the registry as JSON")
    strategies.set_defaults(handler=cmd_strategies)

    simulate = verbs.add_parser(
        "simulate",
        help="simulate one strategy: diagram, stats, files",
        description="Simulate one strategy and show its pipeline diagram and per-worker stats. "
        "Without --strategy, compare a few strategies on a small shape (the demo).",
    )
    simulate.add_argument(
        "--strategy", type=named, help=STRATEGY_HELP,
    )
    simulate.add_argument(
        "--plan", type=named, metavar="FILE", help="simulate and draw a plan file (`unisched plan --out plan.json`) instead of a "
        "strategy: its shape, costs, memory limit and order come from the file",
    )
    _add_problem_arguments(simulate)
    simulate.add_argument("--priority", type=named, help="oldest_batch_first, oldest_stage_first or backward_first: breaks the "
                          "ties of a strategy that leaves the order of work to the simulator (replaces gpipe's own; "
                          "refused for one that decides its order itself: fixed orders, looped_bfs)")
    simulate.add_argument("--out", action="append", default=[], type=named, metavar="FILE",
                          help="write the diagram: .html .png .svg .pdf .json (Chrome trace) .txt; repeatable")
    simulate.add_argument("--time-unit", default="s", metavar="UNIT",
                          help="what one unit of the costs is, for a Chrome trace (.json): s (the default), ms, us, "
                          "ns or a number of seconds")
    simulate.add_argument("--width", type=int, default=100, help="terminal diagram width (default 100)")
    add_color_arguments(simulate)
    simulate.add_argument("--json", action="store_true", help="print one JSON object with the results")
    simulate.set_defaults(handler=cmd_simulate)

    compare = verbs.add_parser(
        "compare",
        help="compare strategies side by side, best first",
        description="Simulate several strategies on one shape and rank them by latency.",
    )
    compare.add_argument(
        "--strategies", type=named,
        help=f"comma-separated, each {STRATEGY_HELP} (default: every registered strategy setting that fits the "
        "shape)",
    )
    _add_problem_arguments(compare)
    compare.add_argument("--priority", type=named, help="oldest_batch_first, oldest_stage_first or backward_first: breaks the "
                         "ties of every strategy compared that leaves the order of work to the simulator, as "
                         "simulate's --priority; one that decides its order itself (fixed orders, looped_bfs) is compared as it is")
    compare.add_argument("--json", action="store_true", help="print the table as JSON")
    compare.set_defaults(handler=cmd_compare)

    for name, (module, text) in _EXTERNAL_VERBS.items():
        sub = verbs.add_parser(name, help=text, description=text, add_help=name == verb)
        if name != verb:
            continue
        try:
            command = importlib.import_module(module)
        except ImportError as error:
            sub.set_defaults(handler=_unavailable(name, error))
            continue
        command.add_arguments(sub)
        sub.set_defaults(handler=command.run)
    for sub in verbs.choices.values():
        sub.set_defaults(verb_parser=sub)  # an unknown option is the verb's to refuse, with its own usage
    return parser


def _unavailable(verb: str, error: ImportError) -> Callable:
    def handler(_args) -> int:
        raise UniSchedError(f"`unisched {verb}` is unavailable here: {error}")

    return handler


def _add_problem_arguments(parser: argparse.ArgumentParser) -> None:
    shape = add_shape_arguments(parser)
    shape.add_argument(
        "--param", action="append", default=[], metavar="K=V",
        help="strategy parameter, repeatable (e.g. group_size=2); the same as NAME(K=V)",
    )
    costs = add_cost_arguments(parser)
    costs.add_argument(
        "--topology", type=named, metavar="FILE|PRESET",
        help="price every transfer on a cluster: a JSON topology file (docs/topology.md) or a preset "
        "(dgx_h100, dgx_a100, p4d_24xlarge); transfers share NVLink ports and NICs, all-reduces follow NCCL's "
        "cost models, times in seconds and sizes in bytes (give them with --costs); not with --comm or --fetch",
    )
    add_memory_limit_argument(parser)


# ---------------------------------------------------------------------- verbs
def cmd_strategies(args) -> int:
    from unisched import policies

    catalog = [policies.describe(name) for name in policies.names()]
    torch_schedules = [policies.describe(name) for name in policies.aliases()]
    if args.json:
        print(_dumps(catalog + torch_schedules))
        return 0
    pad = max(len(entry["name"]) for entry in catalog + torch_schedules) + 2
    for entry in catalog:
        _print_entry(entry, pad)
    print("\ntorch.distributed.pipelining's schedule classes, by name (the order torch runs):")
    for entry in torch_schedules:
        _print_entry(entry, pad)
    return 0


def _print_entry(entry: dict, pad: int) -> None:
    """One strategy of the catalog: name, description, constraints and parameters."""
    print(f"{entry['name']:<{pad}}{entry['description']}")
    if entry.get("constraints"):
        print(f"{'':<{pad}}needs: {entry['constraints']}")
    for param in entry.get("params", []):
        print(f"{'':<{pad}}--param {param['name']}=… (default {param['default']}): {param['help']}")


def cmd_simulate(args) -> int:
    from unisched.flags import check_writable
    from unisched.render import check_path, check_width

    check_width(args.width, "--width")
    for out in args.out:  # before simulating or writing anything
        check_path(out)
        check_writable(out, f"--out {out}")
    if args.plan is not None:
        sim = _simulate_plan(args)
    elif args.strategy is None:
        for given, what in ((args.param, "--param needs --strategy: it sets a parameter of the strategy simulated"),
                            (args.out, "--out needs --strategy (or --plan): it saves the one step simulated, and "
                                       "without either simulate runs a demo of several strategies"),
                            (args.time_unit != "s", "--time-unit needs --strategy (or --plan) and --out FILE.json")):
            if given:
                raise UniSchedError(what)
        return _demo(args)
    else:
        from unisched.policies.grammar import parse_params, strategy_spec

        check_size(_shape(args), splits_backward(args))
        sim = _simulate(args, *strategy_spec(args.strategy, parse_params(args.param)), _step_options(args))
    traces = [out for out in args.out if out.lower().endswith(".json")]
    if args.time_unit != "s" and not traces:
        raise UniSchedError(f"--time-unit {args.time_unit} sets the unit of a Chrome trace: give --out FILE.json too")
    for out in args.out:
        text = Path(out).suffix.lower() == ".txt"  # the terminal's diagram, as wide as it is drawn here
        sim.save(out, **({"time_unit": args.time_unit} if out in traces else {"width": args.width} if text else {}))
    from unisched.topology import cluster_json, describe_cluster

    cluster = cluster_json(sim.costs, sim.shape.num_workers)
    if args.json:
        print(_dumps({**_result_json(sim), **({"plan": args.plan} if args.plan is not None else {}),
                      **cluster}))
        return 0
    print(sim.to_text(width=args.width, color=args.color, stats=True))
    print()
    print(sim.summary())
    if cluster:
        print("  " + describe_cluster(cluster["topology"]))
        if not sim.costs.moves_bytes:
            print("  no sizes given, so every transfer takes only its route's latency: give activation_bytes and "
                  "weight_bytes in a --costs file")
    if args.out:
        print()
    for out in args.out:
        print(f"wrote {out}")
    return 0


def _simulate_plan(args):
    """``simulate --plan FILE``: the plan file's own replay (checked against what the file claims)."""
    given = [flag for flag, value in (
        ("--strategy", args.strategy), ("--param", args.param or None), ("--workers", args.workers),
        ("--stages", args.stages), ("--batches", args.batches), ("--forward", args.forward),
        ("--backward", args.backward), ("--backward-input", args.backward_input),
        ("--backward-weight", args.backward_weight), ("--costs", args.costs), ("--memory-limit", args.memory_limit),
        ("--priority", args.priority), ("--topology", args.topology), ("--comm", args.comm),
        ("--fetch", args.fetch),
    ) if value is not None]
    if given:
        raise UniSchedError(
            f"--plan {args.plan} fixes the shape, costs, memory limit and order of work; drop {', '.join(given)} "
            "(or plan again with them: unisched plan ... --out plan.json)"
        )
    from unisched.plan import load_plan

    return load_plan(args.plan).simulate()


def cmd_compare(args) -> int:
    from unisched import policies
    from unisched.plan.command import is_user_strategy, user_strategy
    from unisched.policies.grammar import parse_params, strategy_spec

    shape = _shape(args)
    check_size(shape, splits_backward(args))
    params = parse_params(args.param)
    if args.strategies is not None:  # "," names none ("" is refused as it is read)
        texts = split_strategies(args.strategies)
        candidates = [strategy_spec(text, params) for text in texts]
        if not candidates:
            raise UniSchedError(f"--strategies names no strategy: {args.strategies!r}")
        listed: dict = {}  # each strategy with every parameter's value, defaults too: what was named already
        for i, (text, (name, values)) in enumerate(zip(texts, candidates)):  # a misspelt name or parameter: an error
            if is_user_strategy(name):
                try:
                    user_strategy(name, shape, values)
                except ShapeError:
                    pass  # does not fit the shape: listed as skipped
                key = (name, tuple(sorted(values.items())))
            else:
                entry = policies.entry(name)
                candidates[i] = (entry.name, values)  # listed by its own name ("GPipe" is gpipe)
                given = {key: entry.param(key).coerce(entry.name, value) for key, value in values.items()}
                key = (entry.name, tuple(sorted({**{p.name: p.default for p in entry.params}, **given}.items())))
            if key in listed:
                raise UniSchedError(f"--strategies names {listed[key]!r} and {text!r}, the same strategy; name it once")
            listed[key] = text
    elif params:
        raise UniSchedError(
            "--param needs --strategies: it sets a parameter of every strategy listed (or write NAME(K=V) in the list)"
        )
    else:
        candidates = list(policies.variants(*shape))
        if args.priority:  # the grids' own tie-breaks (gpipe's) give way to the flag's, once per setting
            settings = [(name, {k: v for k, v in values.items() if k != "priority"}) for name, values in candidates]
            candidates = [c for i, c in enumerate(settings) if c not in settings[:i]]
    priority = name_key(args.priority) if args.priority else None  # as the strategies report it
    rows, bound, skipped = _compare(args, candidates)
    _some_row(rows, shape, skipped)
    if args.json:
        print(_dumps({"shape": list(shape), "priority": priority, "bound": bound, "results": rows,
                      "skipped": skipped}))
        return 0
    ties = f"; ties broken by {priority} where a strategy leaves them open" if priority else ""
    print(f"W={shape[0]} S={shape[1]} B={shape[2]}: {len(rows)} {'strategy' if len(rows) == 1 else 'strategies'}, "
          f"best first{ties}\n")
    print(_table(rows, COMPARE_COLUMNS))
    print(_bound_note(bound))
    for name, reason in skipped:
        print(f"skipped {name}: {reason}")
    return 0


def split_strategies(text: str) -> list[str]:
    """A comma-separated list of strategies; commas inside NAME(...) belong to it."""
    parts, depth, current = [], 0, ""
    for char in text:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth < 0:
            break
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    if depth != 0:
        raise UniSchedError(f"unbalanced parentheses in {text!r}; write e.g. gpipe,looped(group_size=2)")
    return [part.strip() for part in (*parts, current) if part.strip()]


COMPARE_COLUMNS = (
    ("strategy", "strategy", "{}"),
    ("latency", "latency", "{:g}"),
    ("batches/time", "throughput", "{:.4g}"),
    ("bubble", "bubble_fraction", "{:.1%}"),
    ("rho", "rho", "{:.4f}"),
    ("peak act", "peak_activations", "{:g}"),
    ("weights held", "weight_storage", "{:g}"),
    ("transfers", "transfers", "{:d}"),
    ("bytes moved", "bytes_moved", "{:.3g}"),
    ("vs bound", "gap", "+{:.1%}"),
)


def _compare(args, candidates) -> tuple[list[dict], float, list[tuple[str, str]]]:
    """Each (name, params) of ``candidates`` simulated: :func:`_ranked` rows,
    the strategies skipped (and why), and the bound."""
    from unisched.plan.command import is_user_strategy
    from unisched.policies import StrategyParameterError
    from unisched.policies.grammar import label_of

    simulations, skipped = [], []
    built: dict = {}  # a registry strategy with the values it resolved on this shape: the label that gave it
    options = _step_options(args)
    for name, params in candidates:
        label = label_of(name, params)
        try:
            simulation = _simulate(args, name, params, options, fixed_as_they_are=True)
        except (StrategyError, StrategyParameterError):
            raise  # a strategy that fails, maps work to no worker or is given a value it cannot take: an error
        except UniSchedError as error:
            skipped.append((label, str(error).splitlines()[0]))
            continue
        resolved = (name, tuple(sorted((k, repr(v)) for k, v in simulation.strategy.params.items())))
        if resolved in built and args.strategies is not None and not is_user_strategy(name):
            raise UniSchedError(f"--strategies names {built[resolved]!r} and {label!r}, the same strategy on this shape "
                                f"({label_of(name, simulation.strategy.params)}); name it once")
        built[resolved] = label
        simulations.append((label, simulation))
    return *_ranked(simulations), skipped


def _some_row(rows: list[dict], shape, skipped: list[tuple[str, str]]) -> None:
    """Refuse a comparison in which no strategy could be simulated (an empty table has no bound to show)."""
    if not rows:
        W, S, B = shape
        raise UniSchedError(f"no strategy could be simulated on W={W}, S={S}, B={B}; change the shape or the "
                            "strategies:\n" + "\n".join(f"{name}: {reason}" for name, reason in skipped))


def _ranked(simulations) -> tuple[list[dict], float]:
    """Rows of (label, simulation) pairs, best first, and the one bound every
    row's gap is measured against: the shape's lower bound (work per worker
    and a micro-batch's critical path), the least over the backward forms
    compared, which no row's schedule can beat.  Each row's own bound (which
    adds its busiest worker) stays in ``lower_bound`` / ``own_gap``."""
    rows = []
    for label, sim in simulations:
        stats = sim.worker_stats()
        rows.append(
            {
                "strategy": label,
                "latency": sim.latency,
                "bubble_fraction": sim.bubble_fraction,
                "throughput": sim.throughput,
                "rho": _rho(sim),
                "peak_activations": max(stats["max_activation_storage"]),
                "weight_storage": max(stats["weight_storage"]),
                "transfers": int(len(sim.transfers)),
                "bytes_moved": float(sum(stats["bytes_sent"])),
                "lower_bound": sim.lower_bound,
                "own_gap": sim.gap,
            }
        )
    bound = min((sim.lower_bounds["shape"] for _, sim in simulations), default=0.0)
    for row in rows:
        row["gap"] = gap(row["latency"], bound)
    rows.sort(key=lambda r: (r["latency"], r["peak_activations"], r["transfers"]))
    return rows, bound


def _bound_note(bound: float) -> str:
    return (f"\nvs bound: latency above {bound:g}, the shape's lower bound (work per worker, critical path),\n"
            "  one bound for every row; batches/time: micro-batches per unit of time (per second for costs in s)")


def _costs_said(args) -> str:
    """The demo's costs in a few words: the defaults, or the cost flags as given."""
    times = cost_values(args, (*COST_FLAGS, "comm", "fetch"))  # as costs_from_flags reads them
    given = [f"{flag.replace('_', ' ')} {value:g}" for flag, value in times.items() if value]
    given += [f"{flag} {getattr(args, flag)}" for flag in ("costs", "topology") if getattr(args, flag, None)]
    if not given:
        return "forward 1, backward 2"
    return ", ".join(given) + ("" if args.costs else "; otherwise forward 1, backward 2")


def _demo(args) -> int:
    """`unisched` / `unisched simulate` with no strategy: a few strategies on a small shape."""
    from unisched import policies

    shape = _shape(args)
    check_size(shape, splits_backward(args))
    if not args.json:
        print(f"unisched demo: {len(DEMO_STRATEGIES)} strategies on W={shape[0]} workers, S={shape[1]} stages, "
              f"B={shape[2]} micro-batches ({_costs_said(args)})\n")
    simulations, skipped = [], []
    options = _step_options(args)
    for name in DEMO_STRATEGIES:
        if name not in policies.names():
            continue
        try:
            sim = _simulate(args, name, {}, options)
        except UniSchedError as error:
            skipped.append((name, str(error).splitlines()[0]))
            if not args.json:
                print(f"{name}: {skipped[-1][1]}\n")
            continue
        simulations.append((name, sim))
        if not args.json:
            print(f"── {name}: {sim.strategy.description}")
            print(sim.to_text(width=args.width, color=args.color))
            print()
    rows, bound = _ranked(simulations)
    _some_row(rows, shape, skipped)
    if args.json:
        print(_dumps({"shape": list(shape), "bound": bound, "results": rows, "skipped": skipped}))
        return 0
    print(_table(rows, COMPARE_COLUMNS))
    print(_bound_note(bound))
    print("\nTry: unisched simulate --strategy gpipe --out gpipe.png   |   unisched compare   |   unisched plan")
    return 0


# ---------------------------------------------------------------------- helpers
def _shape(args) -> tuple[int, int, int]:
    return tuple(Shape(*shape_of(args)).check())


def check_size(shape, split_backward: bool) -> None:
    """Refuse a shape too large to simulate before building any strategy for it."""
    from unisched.simulate.simulation import check_size as simulator_check

    simulator_check(shape, split_backward)


def _step_options(args) -> dict:
    """What every strategy of a command is simulated with (the costs, the
    memory limit, a priority), read once from the flags."""
    from unisched.plan.command import costs_from_flags  # read as ``unisched plan`` reads them
    from unisched.simulate.priorities import priority_by_name

    W, S, B = _shape(args)
    costs = costs_from_flags(args, (W, S), encode_free_links=False)
    return {
        "priority": priority_by_name(args.priority, S, B) if getattr(args, "priority", None) else None,
        "costs": costs,
        "memory_limit": numbers("--memory-limit", args.memory_limit, W, "workers"),
    }  # the backward's form: simulate's rule, from the costs (where the time flags are) and the strategy


def _one_priority(args, name: str, params: dict) -> None:
    """Refuse a registry strategy given one priority as a parameter and another by --priority (an
    error of the command, which compare raises rather than skipping the row)."""
    from unisched.policies import StrategyParameterError

    if args.priority and "priority" in params and name_key(str(params["priority"])) != name_key(args.priority):
        raise StrategyParameterError(f"{name} is given priority={params['priority']} and --priority {args.priority}; "
                                     "give the priority once")


def _simulate(args, name: str, params: dict, options: dict, fixed_as_they_are: bool = False):
    """Strategy ``name`` with ``params`` on the flags' shape, simulated with ``options`` (:func:`_step_options`);
    with ``fixed_as_they_are``, a strategy that fixes every worker's order runs without --priority
    instead of refusing it."""
    from unisched import policies, simulate
    from unisched.plan.command import is_user_strategy, user_strategy
    from unisched.policies.grammar import label_of

    W, S, B = _shape(args)
    if is_user_strategy(name):  # simulate breaks its ties by --priority
        strategy = user_strategy(name, (W, S, B), params, label=label_of(name, params))
        if fixed_as_they_are and strategy.worker_orders is not None:
            options = {**options, "priority": None}
        return simulate(W, S, B, strategy, **options)
    strategy = policies.get(name, num_workers=W, num_stages=S, num_batches=B, **params)
    if options["priority"] is not None:  # --priority is the registry's priority parameter
        _one_priority(args, name, params)
        entry = policies.entry(name)
        if not (fixed_as_they_are and not entry.leaves_order_open(strategy)):
            strategy = entry.tie_broken(strategy, args.priority, Shape(W, S, B))
        options = {**options, "priority": None}
    if params:  # titled as given: settings of one strategy drawn side by side differ in their titles
        strategy = strategy.with_(name=label_of(name, params))
    return simulate(W, S, B, strategy, **options)


def _rho(sim) -> float:
    """The paper's throughput per worker, S B / (L W), with L in units of one
    stage's forward + backward (averaged over stages)."""
    S = sim.shape.num_stages
    durations = sim.costs.durations(S)
    backward = sum(durations[d] for d in directions(sim.timeline.split_backward)[1:])
    unit = float(np.mean(durations[FORWARD] + backward))
    L = sim.latency / unit if unit > 0 else 0.0
    return S * sim.shape.num_batches / (L * sim.shape.num_workers) if L > 0 else math.inf


def _result_json(sim) -> dict:
    """``simulate --json``'s object."""
    return {
        "strategy": sim.strategy.name,
        "params": dict(sim.strategy.params),
        "shape": list(sim.shape),
        "latency": sim.latency,
        "throughput": sim.throughput,
        "bubble_fraction": sim.bubble_fraction,
        "lower_bound": sim.lower_bound,
        "lower_bounds": sim.lower_bounds,
        "gap": gap(sim.latency, sim.lower_bounds["shape"]),
        "worker_stats": sim.worker_stats(),
    }


def _table(rows: list[dict], columns) -> str:
    header = [title for title, _, _ in columns]
    body = [[fmt.format(row[key]) if _finite(row[key]) else f"{row[key]:g}" for _, key, fmt in columns] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(header, widths)))]
    lines += ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in body]
    return "\n".join(lines)


def _finite(value) -> bool:
    return not isinstance(value, float) or math.isfinite(value)


def _dumps(value) -> str:
    """JSON without NaN or Infinity (they become null), numpy values as numbers."""
    return json.dumps(_plain_json(value), allow_nan=False)


def _plain_json(value):
    if isinstance(value, dict):
        return {str(k): _plain_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain_json(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
