"""Renderers: terminal text, HTML, matplotlib figure, Chrome trace, save()."""

from __future__ import annotations

import json
import re
import time
from collections import Counter, defaultdict

import matplotlib.figure
import numpy as np
import pytest

from unisched import (
    BACKWARD,
    FORWARD,
    ComputeAndWeightWorkers,
    Costs,
    Timeline,
    TransferRecord,
    UniSchedError,
    Work,
    WorkRecord,
    simulate,
)
from unisched.render import FORMATS, save
from unisched.render._common import lanes, time_grid
from unisched.render.figure import figure
from unisched.render.html import choose_mode, to_html
from unisched.render.text import ANSI, stats_table, to_text, visible_len
from unisched.render.trace import to_chrome_trace


# ---------------------------------------------------------------------- timelines
def gpipe_strategy(w: Work) -> ComputeAndWeightWorkers:
    return ComputeAndWeightWorkers(w.stage, w.stage)


def gpipe(W=4, S=4, B=8, **kw):
    return simulate(W, S, B, gpipe_strategy, **kw).timeline


def ddp(W=4, S=4):
    return simulate(W, S, W, lambda w: ComputeAndWeightWorkers(w.batch, w.batch)).timeline


def fsdp(W=4, S=4):
    return simulate(W, S, W, lambda w: ComputeAndWeightWorkers(w.batch, w.stage % W)).timeline


def split():
    return gpipe(split_backward=True)


def with_costs():
    return gpipe(costs=Costs(activation_bytes=1e6, bandwidth=1e7, latency=0.1))


def measured(W=3, S=3, B=4, seed=0, overlap=False):
    """A recorded-looking run: float seconds, irregular durations, transfers."""
    rng = np.random.default_rng(seed)
    records, free = [], [0.0] * W
    for b in range(B):
        for s in range(S):
            start = free[s] + rng.uniform(0, 0.002)
            end = start + rng.uniform(0.004, 0.012)
            records.append(WorkRecord(Work(b, s, FORWARD), s, s, start, end))
            free[s] = end if not overlap else start + 0.001  # overlap: the next one starts early
    for b in range(B):
        for s in reversed(range(S)):
            start = free[s]
            end = start + rng.uniform(0.008, 0.02)
            records.append(WorkRecord(Work(b, s, BACKWARD), s, s, start, end))
            free[s] = end
    transfers = [
        TransferRecord("activation", r.worker, r.worker + 1, r.end, r.end + 0.001, 4e6,
                       Work(r.work.batch, r.work.stage + 1, FORWARD))
        for r in records
        if r.work.direction == FORWARD and r.work.stage < S - 1
    ]
    return Timeline.from_records((W, S, B), records, transfers, source="measured", label="measured",
                                 activation_bytes=4e6)


CASES = {
    "gpipe": gpipe,
    "ddp": ddp,
    "fsdp": fsdp,
    "split": split,
    "costs": with_costs,
    "measured": measured,
    "wide": lambda: gpipe(8, 8, 16),
}


@pytest.fixture(scope="module")
def big():
    return gpipe(64, 64, 128)


@pytest.fixture(params=sorted(CASES))
def case(request):
    return request.param, CASES[request.param]()


def worker_lines(text: str, W: int) -> dict[int, int]:
    counts = Counter()
    for line in text.splitlines():
        for w in range(W):
            if line.startswith(f"w{w} ") or line.startswith(f"w{w}|"):
                counts[w] += 1
    return counts


# ---------------------------------------------------------------------- shared helpers
def test_time_grid_unit_costs_is_one():
    grid = time_grid(gpipe())
    assert grid.quantum == 1 and grid.columns == 33


def test_time_grid_divides_every_time_with_costs():
    t = with_costs()
    grid = time_grid(t)
    assert grid.quantum is not None and grid.quantum < 1
    for values in (t.start, t.end):
        steps = (values - grid.origin) / grid.quantum
        assert np.allclose(steps, np.round(steps), atol=1e-6)


def test_time_grid_irregular_times_fall_back():
    assert time_grid(measured()).quantum is None


def test_lanes_split_overlaps_only():
    assert lanes(np.array([0.0, 1.0, 2.0]), np.array([1.0, 2.0, 3.0])).tolist() == [0, 0, 0]
    lane = lanes(np.array([0.0, 0.5, 1.0, 2.0]), np.array([1.0, 1.5, 2.0, 3.0]))
    assert lane.tolist() == [0, 1, 0, 0]


# ---------------------------------------------------------------------- text
@pytest.mark.parametrize("width", [40, 80, 100, 160])
@pytest.mark.parametrize("color", [False, True])
def test_text_lines_fit_width(case, width, color):
    name, t = case
    text = to_text(t, width=width, color=color, stats=True)
    for line in text.splitlines():
        assert visible_len(line) <= width, (name, line)
    rows = worker_lines(text, t.num_workers)
    assert sorted(rows) == list(range(t.num_workers)), name
    assert len(set(rows.values())) == 1  # every band has every worker


def test_text_big_fits_and_is_compressed(big):
    start = time.perf_counter()
    text = to_text(big, width=100, color=True)
    elapsed = time.perf_counter() - start
    assert elapsed < 1.0
    assert all(visible_len(line) <= 100 for line in text.splitlines())
    assert "compressed" in text
    assert worker_lines(text, 64)[63] == 1


def test_text_labels_and_grid():
    # without colour a cell is the whole item, stage + letter + micro-batch, as str(Work) writes it
    text = to_text(gpipe(), width=100, color=False)
    assert "0F0" in text and "3B7" in text and "2F5" in text
    assert "latency 33" in text
    assert "sFb = forward of stage s, micro-batch b" in text
    split_text = to_text(split(), width=100, color=False)
    assert "2I0" in split_text and "2W7" in split_text
    # in colour the cell is the direction and stage on the micro-batch's colour
    visible = ANSI.sub("", to_text(gpipe(), width=100, color=True))
    assert "w0|F0F0F0" in visible and "B3" in visible
    assert "colour = micro-batch" in visible


def test_plain_text_tells_micro_batches_apart():
    """Two workers running the same stages on different micro-batches read differently without colour."""
    t = ddp(W=2, S=1)
    rows = {line.split("|")[0]: line.split("|")[1] for line in to_text(t, color=False).splitlines() if "|" in line}
    assert rows["w0"].split() == ["0F0", "0B0"] and rows["w1"].split() == ["0F1", "0B1"]
    coloured = {line.split("|")[0]: ANSI.sub("", line.split("|")[1])
                for line in to_text(t, color=True).splitlines() if line.startswith("w")}
    assert coloured["w0"] == coloured["w1"]  # there the colour tells them apart
    assert "color=True" not in to_text(t, color=False)  # nothing to ask for: the cells say it


def test_plain_text_compressed_says_how_to_see_the_batches(big):
    text = to_text(big, width=100, color=False)
    assert "compressed" in text and "--color always" in text and "color=True" in text


@pytest.mark.parametrize("mode, painted", [("always", True), ("never", False), ("auto", False)])
def test_text_color_modes(mode, painted):
    assert ("\x1b[" in to_text(gpipe(), color=mode)) == painted


def test_text_color_auto_follows_the_terminal_and_no_color(monkeypatch):
    class Terminal:
        def isatty(self):
            return True

    monkeypatch.setattr("sys.stdout", Terminal())
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    assert "\x1b[" in to_text(gpipe(), color="auto")
    monkeypatch.setenv("NO_COLOR", "1")
    assert "\x1b[" not in to_text(gpipe(), color="auto")
    assert "\x1b[" in to_text(gpipe(), color="always")  # an explicit choice beats NO_COLOR
    with pytest.raises(ValueError, match="auto, always, never"):
        to_text(gpipe(), color="sometimes")


def test_text_wraps_into_bands_when_wide():
    text = to_text(gpipe(8, 8, 16), width=100, color=False)
    assert worker_lines(text, 8)[0] > 1  # wrapped into several bands
    # The continuation of an item that crosses a band boundary keeps its label.
    bands = [line for line in text.splitlines() if line.startswith("w0|")]
    assert all(re.match(r"(0[FB]\d+|\.)( |$)", band[3:]) for band in bands)
    # Where the rest of an item is shorter than its label, it shows the label's beginning, as a
    # short item does: never its tail (``F7`` of ``1F7`` read as stage 7's).
    uneven = to_text(gpipe(costs=Costs(forward=1.5, backward=2.5)), width=60, color=False)
    tokens = [token for line in uneven.splitlines() if re.match(r"w\d\|", line) for token in line[3:].split()]
    assert len(uneven.splitlines()) > 12 and all(re.fullmatch(r"\d+([FB]\d*)?|\.", token) for token in tokens), tokens


def test_text_color_control(capsys):
    t = gpipe()
    assert "\x1b[" in to_text(t, color=True)
    assert "\x1b[" not in to_text(t, color=False)
    # color=None follows the terminal; under pytest stdout is captured, not a TTY.
    assert "\x1b[" not in to_text(t)
    assert "\x1b[" not in t.to_text()


def test_text_too_narrow_is_an_error():
    with pytest.raises(ValueError, match="width"):
        to_text(gpipe(), width=10)
    for options in ({"width": None}, {"width": 50.5}, {"max_bands": 0}):  # a TypeError, or 0 bands accepted
        with pytest.raises(ValueError, match="must be a whole number of at least"):
            to_text(gpipe(), **options)


def test_stats_table_columns():
    table = stats_table(gpipe())
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["worker", "busy", "util"]
    assert len(lines) == 1 + 4
    assert "sent" not in lines[0]  # no bytes moved: byte columns hidden
    assert "sent" in stats_table(with_costs()).splitlines()[0]
    many = stats_table(gpipe(40, 40, 40))
    assert [line.split()[0] for line in many.splitlines()[1:]] == ["min", "mean", "max"]


# ---------------------------------------------------------------------- html
def test_html_grid_has_one_row_per_worker_and_one_cell_per_item():
    t = gpipe()
    page = to_html(t)
    assert 'data-mode="grid"' in page
    assert page.count('class="us-worker"') == t.num_workers
    assert page.count('class="us-item"') == len(t)
    assert ">F3</td>" in page and ">B0</td>" in page
    assert page.count('class="us-stat-row"') == t.num_workers
    lambda_page = to_html(ddp())  # the strategy's name is "<lambda>": escaped
    assert "&lt;lambda&gt;" in lambda_page and "<lambda>" not in lambda_page
    for word in ("latency", "throughput", "bubble"):
        assert word in page


def test_html_grid_columns_follow_the_quantum():
    t = gpipe()  # unit costs: 33 columns, a backward spans 2
    page = to_html(t)
    assert page.count('colspan="2" style="background') == (t.direction == BACKWARD).sum()
    costs_page = to_html(with_costs())
    assert 'data-mode="grid"' in costs_page
    assert costs_page.count('class="us-worker"') == 4


def test_html_colours_by_batch():
    page = to_html(ddp())
    from unisched.render._common import batch_color

    for b in range(4):
        assert f"background:{batch_color(b)}" in page


def test_html_irregular_times_are_proportional():
    t = measured()
    assert choose_mode(t) == "proportional"
    page = to_html(t)
    assert page.count('class="us-worker"') == t.num_workers
    assert page.count('class="us-box"') == len(t)


def test_html_overlapping_items_use_lanes():
    t = measured(overlap=True)
    assert choose_mode(t) == "proportional"
    assert to_html(t).count('class="us-box"') == len(t)


def test_html_many_workers_fall_back_to_bar_charts(big):
    start = time.perf_counter()
    page = to_html(big)
    elapsed = time.perf_counter() - start
    assert elapsed < 1.0
    assert 'data-mode="bars"' in page
    assert page.count("<svg") >= 2
    assert "peak activations" in page and "utilization" in page
    assert 'class="us-worker"' not in page
    assert "<details>" in page  # per-worker stats folded away


def test_html_forced_grid_and_bad_mode():
    t = gpipe()
    assert 'data-mode="bars"' in to_html(t, mode="bars")
    with pytest.raises(ValueError):
        to_html(t, mode="pie")


def test_repr_html_is_the_diagram():
    t = gpipe()
    sim = simulate(4, 4, 8, gpipe_strategy)
    assert 'class="us-worker"' in t._repr_html_()
    assert sim._repr_html_().count('class="us-worker"') == 4


# ---------------------------------------------------------------------- figure
def test_figure_panels_and_boxes():
    t = gpipe()
    fig = figure(t)
    assert isinstance(fig, matplotlib.figure.Figure)
    assert len(fig.axes) == 1 + t.num_workers  # Gantt + one memory panel per worker
    boxes = sum(len(c.get_paths()) for c in fig.axes[0].collections)
    assert boxes == len(t)
    assert fig._repr_png_().startswith(b"\x89PNG")


def test_figure_options():
    t = with_costs()
    assert len(figure(t, memory=False).axes) == 1
    with_arrows = figure(t, arrows=True)
    moving = int((t.transfers.src != t.transfers.dst).sum())
    assert len(with_arrows.axes[0].patches) == moving
    assert len(figure(measured(overlap=True)).axes) == 4


def test_figure_many_workers_uses_a_heat_map(big):
    fig = figure(big)
    assert len(fig.axes) == 3  # Gantt, heat map, colour bar
    assert fig.axes[1].images


def test_figure_via_timeline_and_package():
    import unisched.render as render

    t = ddp()
    assert isinstance(t.figure(memory=False), matplotlib.figure.Figure)
    assert isinstance(render.figure(t, memory=False), matplotlib.figure.Figure)


# ---------------------------------------------------------------------- trace
def _check_trace(t: Timeline, trace: dict) -> list[dict]:
    trace = json.loads(json.dumps(trace))  # plain JSON
    events = trace["traceEvents"]
    for event in events:
        assert {"name", "ph", "pid"} <= set(event)
    complete = [e for e in events if e["ph"] == "X"]
    for e in complete:
        assert e["dur"] >= 0 and e["ts"] >= 0 and "tid" in e
    compute = [e for e in complete if e["cat"] == "compute"]
    assert len(compute) == len(t)
    transfers = [e for e in complete if e["cat"] == "transfer"]
    assert len(transfers) == len(t.transfers)
    # Slices on one track never overlap (the viewers cannot nest them).
    tracks = defaultdict(list)
    for e in complete:
        tracks[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    for spans in tracks.values():
        spans.sort()
        for (_, end), (start, _) in zip(spans, spans[1:]):
            assert start >= end - 1e-6
    names = {(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert {name for _, name in names} == {f"worker {w}" for w in range(t.num_workers)}
    threads = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {f"worker {w}" for w in set(t.worker.tolist())} <= threads
    assert any(e["ph"] == "C" for e in events)
    return compute


def test_trace_simulated_one_event_per_item():
    t = with_costs()
    compute = _check_trace(t, to_chrome_trace(t))
    by_work = {e["args"]["work"]: e for e in compute}
    for record in t.records:
        event = by_work[str(record.work)]
        assert event["name"] == f"{'FBIW'[record.work.direction]}{record.work.stage}"
        assert event["ts"] == pytest.approx(record.start * 1e6)  # 1 unit = 1 s, written in us
        assert event["dur"] == pytest.approx((record.end - record.start) * 1e6)
        assert event["pid"] == record.worker + 1
    counters = {e["name"] for e in to_chrome_trace(t)["traceEvents"] if e["ph"] == "C"}
    assert counters == {"activations", "memory"}


@pytest.mark.parametrize("unit, us", [("s", 1e6), ("ms", 1e3), ("us", 1.0), (0.5, 5e5), ("0.5", 5e5), (" 1e-3", 1e3)])
def test_trace_time_unit(unit, us):
    """Simulated times are in the unit of the costs: seconds by default, as a measured trace."""
    t = gpipe()  # forward 1, backward 2
    trace = to_chrome_trace(t, time_unit=unit)
    compute = [e for e in trace["traceEvents"] if e.get("cat") == "compute"]
    assert [e["dur"] for e in compute if e["name"].startswith("F")] == pytest.approx([1 * us] * 32)
    assert [e["dur"] for e in compute if e["name"].startswith("B")] == pytest.approx([2 * us] * 32)
    assert max(e["ts"] + e["dur"] for e in compute) == pytest.approx(33 * us)
    assert trace["otherData"]["unit_seconds"] == pytest.approx(us / 1e6)


def test_trace_time_unit_through_the_timeline_and_simulation_methods():
    sim = simulate(4, 4, 8, gpipe_strategy)
    for trace in (sim.to_chrome_trace(time_unit="ms"), sim.timeline.to_chrome_trace(time_unit="ms")):
        assert max(e["ts"] + e.get("dur", 0) for e in trace["traceEvents"] if e["ph"] == "X") == pytest.approx(33e3)
    assert sim.to_chrome_trace() == to_chrome_trace(sim.timeline)


def test_trace_time_unit_through_save_and_refused_when_unknown(tmp_path):
    save(gpipe(), tmp_path / "ms.json", time_unit="ms")
    events = json.loads((tmp_path / "ms.json").read_text())["traceEvents"]
    assert max(e["ts"] + e.get("dur", 0) for e in events if e["ph"] == "X") == pytest.approx(33e3)
    for bad in ("minutes", 0, -1, float("nan"), True, "0", "-1", "nan", "inf", ""):
        with pytest.raises(UniSchedError, match="time"):
            to_chrome_trace(gpipe(), time_unit=bad)
    for unit in (1e305, 1e30):  # past 2**53 microseconds (1e30 passed and made events of 3e37 us)
        with pytest.raises(UniSchedError, match="too long for a trace in microseconds .*; give a smaller time_unit"):
            to_chrome_trace(gpipe(), time_unit=unit)
    tiny = to_chrome_trace(gpipe(), time_unit="ns")  # forward 1, backward 2 ns: kept, not rounded to 0 or 0.001
    assert sorted({e["dur"] for e in tiny["traceEvents"] if e.get("cat") == "compute"}) == [0.001, 0.002]
    tinier = to_chrome_trace(gpipe(), time_unit=1e-15)
    assert sorted({e["dur"] for e in tinier["traceEvents"] if e.get("cat") == "compute"}) == [1e-9, 2e-9]


def test_trace_of_a_simulation_lines_up_with_a_measured_one():
    """Costs in seconds (what calibration gives) make a simulated trace as long as the measured step."""
    t = measured()
    sim = simulate(3, 3, 4, gpipe_strategy, costs=Costs(forward=0.008, backward=0.014)).timeline
    measured_end = max(e["ts"] + e["dur"] for e in to_chrome_trace(t)["traceEvents"] if e["ph"] == "X")
    simulated_end = max(e["ts"] + e["dur"] for e in to_chrome_trace(sim)["traceEvents"] if e["ph"] == "X")
    assert measured_end == pytest.approx(t.latency * 1e6, rel=0.05)
    assert simulated_end == pytest.approx(sim.latency * 1e6)
    assert 0.3 < simulated_end / measured_end < 3  # the same order of magnitude, not 1000x apart


def test_trace_measured_is_in_microseconds():
    t = measured()
    compute = _check_trace(t, to_chrome_trace(t))
    first = min(compute, key=lambda e: e["ts"])
    assert first["ts"] == 0
    durations = sorted(e["dur"] for e in compute)
    assert durations[0] > 1000  # >= 4 ms items, in microseconds
    assert to_chrome_trace(t)["otherData"]["source"] == "measured"


def test_trace_overlaps_go_to_extra_lanes():
    t = measured(overlap=True)
    compute = _check_trace(t, to_chrome_trace(t))
    assert len({e["tid"] for e in compute}) > 1


@pytest.mark.parametrize("make", [gpipe, split, fsdp])
def test_trace_structure(make):
    t = make()
    _check_trace(t, t.to_chrome_trace())


# ---------------------------------------------------------------------- save
@pytest.mark.parametrize("ext", sorted(FORMATS))
def test_save_every_format(tmp_path, ext):
    t = with_costs()
    path = tmp_path / f"diagram{ext}"
    save(t, path)
    data = path.read_bytes()
    assert data
    if ext == ".png":
        assert data.startswith(b"\x89PNG")
    elif ext == ".pdf":
        assert data.startswith(b"%PDF")
    elif ext == ".svg":
        assert b"<svg" in data[:2000]
    elif ext == ".json":
        events = json.loads(data)["traceEvents"]
        assert sum(e["ph"] == "X" and e["cat"] == "compute" for e in events) == len(t)
    elif ext == ".html":
        assert data.startswith(b"<!DOCTYPE html>") and data.count(b'class="us-worker"') == 4
    elif ext == ".txt":
        text = data.decode()
        assert "\x1b[" not in text and "F0" in text and "worker" in text
        assert all(len(line) <= 100 for line in text.splitlines())


def test_save_through_timeline_and_simulation(tmp_path):
    sim = simulate(4, 4, 8, gpipe_strategy)
    sim.save(tmp_path / "a.PNG")
    sim.timeline.save(str(tmp_path / "b.json"))
    save(sim, tmp_path / "c.txt")
    assert (tmp_path / "a.PNG").read_bytes().startswith(b"\x89PNG")
    assert json.loads((tmp_path / "b.json").read_text())["traceEvents"]
    assert "F0" in (tmp_path / "c.txt").read_text()


@pytest.mark.parametrize("name", ["diagram.gif", "diagram", "trace.jsonl"])
def test_save_unknown_extension(tmp_path, name):
    with pytest.raises(UniSchedError) as error:
        save(gpipe(), tmp_path / name)
    message = str(error.value)
    for ext in FORMATS:
        assert ext in message
    assert not (tmp_path / name).exists()


@pytest.mark.parametrize("name", ["d.txt", "d.html", "d.json", "d.png"])
def test_save_where_no_file_can_be_written_names_the_path(tmp_path, name):
    path = tmp_path / "no-such-folder" / name
    with pytest.raises(UniSchedError, match=f"cannot write '{re.escape(str(path))}': No such file or directory"):
        save(gpipe(), path)


# ---------------------------------------------------------------------- empty
def test_empty_timeline_renders():
    t = Timeline.from_records((2, 1, 1), [])
    assert "no work items" in to_text(t, color=False)
    assert "no work items" in to_html(t)
    assert not [e for e in to_chrome_trace(t)["traceEvents"] if e["ph"] == "X"]
    figure(t)


def test_gang_items_are_drawn_on_every_worker_of_the_gang():
    import unisched
    from unisched import ComputeAndWeightWorkers

    strategy = unisched.Strategy(
        lambda w: ComputeAndWeightWorkers(min(w.stage, 1) if w.stage < 2 else 2, w.stage),
        gang=lambda w: (1, 2) if w.stage == 1 else None,
    )
    timeline = unisched.simulate(3, 3, 2, strategy).timeline
    events = [e for e in timeline.to_chrome_trace()["traceEvents"] if e.get("ph") == "X" and e.get("tid") == 1]
    per_pid = {}
    for event in events:
        per_pid[event["pid"]] = per_pid.get(event["pid"], 0) + 1
    stage_1_items = 2 * 2
    assert per_pid[2] == stage_1_items and per_pid[3] == stage_1_items + 2 * 2
    rows = {line.split("|")[0]: line for line in timeline.to_text(color=False).splitlines() if "|" in line}
    assert "1F0" in rows["w1"] and "1F0" in rows["w2"]


def test_without_colour_every_cell_keeps_its_space():
    """Plain text has only the space to tell two cells apart: 2I102W8 could be 2I10 2W8 or 2I1 02W8."""
    from unisched import policies

    sim = simulate(4, 4, 12, policies.get("zb_h1", num_workers=4, num_stages=4, num_batches=12))
    for width in (160, 100):
        rows = [line.split("|", 1)[1] for line in sim.to_text(width=width, color=False).splitlines()
                if re.match(r"w\d+\|", line)]
        cells = [cell for row in rows for cell in row.split()]  # a cell per space-separated token
        assert rows and all(re.fullmatch(r"\d+[FBIW]\d+|\.", cell) for cell in cells), rows


def test_a_forced_grid_of_too_many_columns_says_what_to_change():
    sim = simulate(4, 4, 300, gpipe_strategy)
    with pytest.raises(UniSchedError, match="max_columns=600 columns; raise max_columns, or draw it with "
                                            "mode='proportional'"):
        sim.to_html(mode="grid")  # a TypeError before
    assert 'data-mode="grid"' in sim.to_html(mode="grid", max_columns=5000)


def test_a_figure_refuses_a_dpi_that_is_not_a_positive_number(tmp_path):
    for dpi in (0, -1, "x"):  # 0 drew at the default silently
        with pytest.raises(UniSchedError, match="dpi must be a positive number"):
            save(gpipe(), tmp_path / "x.png", dpi=dpi)
    assert save(gpipe(), tmp_path / "x.png", dpi=40).stat().st_size > 0


def test_every_renderer_and_measure_takes_a_simulation_as_save_does():
    """figure, to_text, ... read a Simulation's Timeline (they raised AttributeError on it), and
    name what they need for anything else."""
    import unisched
    from unisched.render import figure, stats_table, to_chrome_trace, to_html, to_text

    sim = unisched.simulate(2, 2, 4, unisched.policies.get("gpipe", 2, 2, 4))
    for draw in (figure, to_text, to_html, to_chrome_trace, stats_table, unisched.worker_stats,
                 unisched.memory_curves):
        given, alone = draw(sim), draw(sim.timeline)
        if isinstance(given, (str, dict)) and draw is not to_html:  # html names its elements afresh
            assert given == alone
        with pytest.raises(TypeError, match="needs a Timeline or Simulation, got NoneType"):
            draw(None)


@pytest.mark.parametrize("width", [0, -1, "x", 1000])
def test_a_figure_width_that_cannot_be_drawn_is_refused_by_name(width):
    """width=0 made an empty image that PIL refused to save; -1 matplotlib's own error."""
    import unisched
    from unisched.render import figure

    with pytest.raises(ValueError, match=r"figure\(width=\.\.\.\) is the figure's width in inches"):
        figure(unisched.simulate(2, 2, 4, unisched.policies.get("gpipe", 2, 2, 4)), width=width)
