"""HTML: the seed notebook's pipeline diagram, for notebooks and files.

Rows are workers, columns time; each work item is a cell labelled with its
direction letter and stage (``F3``, ``B3``) on its batch's colour; idle
cells are blank.  Beneath it: latency, throughput, bubble and the per-worker
statistics.

Three layouts, chosen by :func:`to_html` (or forced with ``mode=``):

- ``"grid"``: a table with one column per time quantum (the largest q that
  divides every start and end: 1 for the paper's unit costs), an item
  spanning ``duration / q`` columns;
- ``"proportional"``: irregular (e.g. measured) times: each worker's row is
  a strip on which items sit at their true start and width;
- ``"bars"``: many workers (more than ``max_workers``) or very long steps:
  per-worker bar charts of peak activations and utilization (inline SVG)
  instead of the diagram.
"""

from __future__ import annotations

import html as _html
import itertools
import math

import numpy as np

from unisched.errors import UniSchedError
from unisched.render._common import (
    DIRECTION_NAMES,
    LETTERS,
    STAT_LABELS,
    batch_color,
    fmt_bytes,
    fmt_number,
    fmt_stat,
    fmt_throughput,
    fmt_time,
    label_width,
    lanes,
    nice_step,
    stat_columns,
    text_color_on,
    time_grid,
)
from unisched.timeline import Timeline, as_timeline
from unisched.work import is_whole

MODES = ("grid", "proportional", "bars")
_ids = itertools.count()

_STYLE = """
<style>
.{s} {{font-family: -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif; font-size: 12px; color: #222;}}
.{s} .us-scroll {{overflow-x: auto; max-width: 100%;}}
.{s} table {{border-collapse: collapse; margin: 4px 0;}}
.{s} table.us-grid {{table-layout: fixed;}}
.{s} table.us-grid td, .{s} table.us-grid th {{padding: 0; height: 20px; text-align: center;
  border: 1px solid #e4e4e4; overflow: hidden; white-space: nowrap; font-size: 11px;}}
.{s} table.us-grid th {{font-weight: normal; color: #666; background: #fafafa;}}
.{s} table.us-grid th.us-wlabel {{padding: 0 6px; text-align: right;}}
.{s} table.us-thin td:not(.us-item) {{border-left: none; border-right: none;}}
.{s} table.us-grid td.us-item {{font-family: Menlo, Consolas, monospace; font-weight: 600;}}
.{s} table.us-stats td, .{s} table.us-stats th {{padding: 2px 8px; border-bottom: 1px solid #eee; text-align: right;}}
.{s} table.us-stats th {{background: #f5f5f5;}}
.{s} .us-title {{font-weight: 600; margin: 4px 0;}}
.{s} .us-summary span {{margin-right: 16px;}}
.{s} .us-legend {{color: #555; margin: 4px 0;}}
.{s} .us-swatch {{display: inline-block; min-width: 16px; padding: 0 3px; margin: 1px; text-align: center; border-radius: 2px;}}
.{s} .us-box {{position: absolute; overflow: hidden; white-space: nowrap; text-align: center;
  font-family: Menlo, Consolas, monospace; font-size: 10px; font-weight: 600; border-right: 1px solid #fff; box-sizing: border-box;}}
</style>
"""


def to_html(
    timeline: Timeline,
    *,
    mode: str | None = None,
    max_workers: int = 32,
    max_columns: int = 600,
) -> str:
    """An HTML fragment (for a notebook's ``_repr_html_`` or a page):
    diagram, legend, summary and per-worker statistics.

    ``mode`` forces a layout (see :data:`MODES`); by default the grid when
    times fall on a quantum giving at most ``max_columns`` columns, a
    proportional strip for irregular times, and bar charts when there are
    more than ``max_workers`` workers or too many columns to read.
    """
    timeline = as_timeline(timeline, "to_html")
    if mode is not None and mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    for name, value in (("max_workers", max_workers), ("max_columns", max_columns)):
        if not is_whole(value, 1):
            raise ValueError(f"{name} must be a whole number of at least 1, got {value!r}")
    timeline = timeline.per_worker()  # a gang item is drawn on each of its workers
    scope = f"unisched-{next(_ids)}"
    mode = mode or choose_mode(timeline, max_workers, max_columns)
    parts = [_STYLE.format(s=scope), f'<div class="{scope} unisched-diagram" data-mode="{mode}">']
    parts.append(f'<div class="us-title">{_esc(_title(timeline))}</div>')
    if not len(timeline):
        parts.append("<p>(no work items)</p>")
    elif mode == "grid":
        parts.append(_grid(timeline, max_columns))
        parts.append(_legend(timeline))
    elif mode == "proportional":
        parts.append(_proportional(timeline))
        parts.append(_legend(timeline))
    else:
        parts.append(_bars(timeline))
    parts.append(_summary(timeline))
    parts.append(_stats(timeline, collapse=mode == "bars" or timeline.num_workers > max_workers))
    parts.append("</div>")
    return "\n".join(parts)


def to_html_document(timeline: Timeline, **options) -> str:
    """A complete HTML page around :func:`to_html` (what ``save('x.html')`` writes)."""
    title = _esc(_title(timeline))
    return (
        "<!DOCTYPE html>\n<html>\n<head>\n<meta charset=\"utf-8\">\n"
        f"<title>{title}</title>\n</head>\n<body>\n{to_html(timeline, **options)}\n</body>\n</html>\n"
    )


def choose_mode(timeline: Timeline, max_workers: int = 32, max_columns: int = 600) -> str:
    """The layout :func:`to_html` picks by default (see the module's doc)."""
    if timeline.num_workers > max_workers:
        return "bars"
    grid = time_grid(timeline, max_columns=max_columns)
    if grid.quantum is not None and grid.columns <= max_columns and not _overlaps(timeline):
        return "grid"
    per_worker = np.bincount(timeline.worker, minlength=timeline.num_workers).max(initial=0) if len(timeline) else 0
    return "proportional" if per_worker <= max_columns // 3 else "bars"


def _overlaps(timeline: Timeline) -> bool:
    """Whether two items overlap in time on one worker (a measured run with
    several streams): the grid cannot show that, the proportional strip can."""
    if len(timeline) < 2:
        return False
    order = np.lexsort((timeline.start, timeline.worker))
    worker, start, end = timeline.worker[order], timeline.start[order], timeline.end[order]
    same = worker[1:] == worker[:-1]
    running_end = end.copy()
    # Latest end so far within each worker's run.
    for i in range(1, len(end)):
        if same[i - 1] and running_end[i - 1] > running_end[i]:
            running_end[i] = running_end[i - 1]
    tolerance = 1e-9 * max(float(end.max() - start.min()), 1e-300)
    return bool(np.any(same & (start[1:] < running_end[:-1] - tolerance)))


# ---------------------------------------------------------------------- pieces
def _esc(text) -> str:
    return _html.escape(str(text), quote=True)


def _title(timeline: Timeline) -> str:
    name = timeline.label or "timeline"
    return f"{name} ({timeline.source}): W={timeline.num_workers} S={timeline.num_stages} B={timeline.num_batches}"


def _tooltip(timeline: Timeline, i: int) -> str:
    d = LETTERS[int(timeline.direction[i])]
    w, ww = int(timeline.worker[i]), int(timeline.weight_worker[i])
    source = timeline.source
    text = (
        f"{d}{int(timeline.stage[i])}: {DIRECTION_NAMES[d]}, stage {int(timeline.stage[i])}, "
        f"batch {int(timeline.batch[i])}, worker {w}, "
        f"{fmt_time(timeline.start[i], source)}-{fmt_time(timeline.end[i], source)}"
    )
    if ww != w:
        text += f", weights from worker {ww}"
    return text


def _cell_style(batch: int) -> str:
    color = batch_color(batch)
    return f"background:{color};color:{text_color_on(color)}"


def _grid(timeline: Timeline, max_columns: int) -> str:
    grid = time_grid(timeline, max_columns=max_columns)
    q, origin = grid.quantum, grid.origin
    if q is None:
        raise UniSchedError(f"mode='grid' draws a column per time quantum, and this step's times fall on no "
                            f"quantum giving at most max_columns={max_columns} columns; raise max_columns, or "
                            "draw it with mode='proportional'")
    columns = max(1, int(math.ceil(grid.span / q - 1e-9)))
    c0 = np.rint((timeline.start - origin) / q).astype(np.int64)
    c1 = np.rint((timeline.end - origin) / q).astype(np.int64)
    spans = c1 - c0
    positive = spans[spans > 0]
    min_span = int(positive.min()) if len(positive) else 1
    label_px = 9 * label_width(timeline) + 6
    cell_px = int(min(26, max(4, math.ceil(label_px / min_span))))
    head_px = 50 + 7 * len(str(timeline.num_workers - 1))

    out = ['<div class="us-scroll">']
    out.append(
        f'<table class="us-grid{" us-thin" if cell_px < 10 else ""}" style="width:{head_px + columns * cell_px}px">'
        f'<colgroup><col style="width:{head_px}px">' + f'<col style="width:{cell_px}px">' * columns + "</colgroup>"
    )
    # Time axis: a label every k columns, k a round number with room for the text.
    k = max(1, int(nice_step(columns, max(1, (columns * cell_px) // 40))))
    head = ['<thead><tr><th class="us-wlabel">time</th>']
    for start in range(0, columns, k):
        span = min(k, columns - start)
        text = _esc(fmt_time(start * q, timeline.source)) if span * cell_px >= 24 else ""
        head.append(f'<th colspan="{span}" style="text-align:left;padding-left:2px">{text}</th>')
    head.append("</tr></thead>")
    out.append("".join(head))
    out.append("<tbody>")
    labels = [f"{LETTERS[d]}{s}" for d, s in zip(timeline.direction.tolist(), timeline.stage.tolist())]
    for w in range(timeline.num_workers):
        rows = np.flatnonzero(timeline.worker == w)
        rows = rows[np.lexsort((c1[rows], c0[rows]))]
        cells = [f'<tr class="us-worker" data-worker="{w}"><th class="us-wlabel">worker {w}</th>']
        at = 0
        for i in rows.tolist():
            a, b = int(c0[i]), int(c1[i])
            if b <= a:
                b = a + 1  # zero-length items still get a cell
            if a < at:  # overlaps the previous item (measured): clip
                a = at
                if b <= a:
                    continue
            cells.append("<td></td>" * (a - at))
            batch = int(timeline.batch[i])
            label = labels[i] if (b - a) * cell_px >= label_px - 4 else ""
            cells.append(
                f'<td class="us-item" colspan="{b - a}" style="{_cell_style(batch)}" '
                f'title="{_esc(_tooltip(timeline, i))}">{label}</td>'
            )
            at = b
        cells.append("<td></td>" * max(0, columns - at))
        cells.append("</tr>")
        out.append("".join(cells))
    out.append("</tbody></table></div>")
    return "\n".join(out)


def _proportional(timeline: Timeline, width_px: int = 960) -> str:
    grid = time_grid(timeline, max_columns=1)  # only for origin and span
    origin, span = grid.origin, grid.span
    head_px = 50 + 7 * len(str(timeline.num_workers - 1))
    row_px = 22
    out = ['<div class="us-scroll">', f'<table class="us-grid" style="width:{head_px + width_px}px">']
    out.append(f'<colgroup><col style="width:{head_px}px"><col style="width:{width_px}px"></colgroup>')
    # Axis.
    step = nice_step(span, 10)
    ticks = []
    t = 0.0
    while t <= span + 1e-12:
        left = 100 * t / span
        ticks.append(
            f'<span style="position:absolute;left:{left:.3f}%;top:2px;padding-left:2px;border-left:1px solid #bbb">'
            f"{_esc(fmt_time(t, timeline.source))}</span>"
        )
        t += step
    out.append(
        '<thead><tr><th class="us-wlabel">time</th>'
        f'<th style="position:relative;height:18px">{"".join(ticks)}</th></tr></thead><tbody>'
    )
    labels = [f"{LETTERS[d]}{s}" for d, s in zip(timeline.direction.tolist(), timeline.stage.tolist())]
    char_px = 7
    for w in range(timeline.num_workers):
        rows = np.flatnonzero(timeline.worker == w)
        lane = lanes(timeline.start[rows], timeline.end[rows])
        n_lanes = int(lane.max(initial=0)) + 1
        height = row_px if n_lanes == 1 else max(row_px, 12 * n_lanes)
        boxes = []
        for i, l in zip(rows.tolist(), lane.tolist()):
            left = 100 * (timeline.start[i] - origin) / span
            width = 100 * (timeline.end[i] - timeline.start[i]) / span
            px = width / 100 * width_px
            label = labels[i] if px >= char_px * len(labels[i]) + 2 else ""
            top, h = l * height / n_lanes, height / n_lanes
            boxes.append(
                f'<div class="us-box" style="left:{left:.4f}%;width:max({width:.4f}%,1px);top:{top:.1f}px;'
                f'height:{h:.1f}px;line-height:{h:.1f}px;{_cell_style(int(timeline.batch[i]))}" '
                f'title="{_esc(_tooltip(timeline, i))}">{label}</div>'
            )
        out.append(
            f'<tr class="us-worker" data-worker="{w}"><th class="us-wlabel">worker {w}</th>'
            f'<td style="position:relative;height:{height}px">{"".join(boxes)}</td></tr>'
        )
    out.append("</tbody></table></div>")
    return "\n".join(out)


def _legend(timeline: Timeline) -> str:
    present = [LETTERS[d] for d in sorted(set(timeline.direction.tolist()))]
    meaning = "; ".join(f"<b>{d}</b>n: {DIRECTION_NAMES[d]} of stage n" for d in present)
    batches = sorted(set(timeline.batch.tolist()))
    shown = batches[:40]
    swatches = "".join(
        f'<span class="us-swatch" style="{_cell_style(b)}">{b}</span>' for b in shown
    )
    more = f" ... ({len(batches)} batches)" if len(batches) > len(shown) else ""
    return f'<div class="us-legend">{meaning}. Colour = micro-batch: {swatches}{more}</div>'


def _summary(timeline: Timeline) -> str:
    latency = fmt_time(timeline.latency, timeline.source) if timeline.source == "measured" else fmt_number(timeline.latency)
    items = [
        ("latency", latency),
        ("throughput", fmt_throughput(timeline)),
        ("bubble", f"{timeline.bubble_fraction:.1%}"),
        ("work items", str(len(timeline))),
        ("transfers", str(len(timeline.transfers))),
    ]
    spans = "".join(f"<span><b>{name}</b> {_esc(value)}</span>" for name, value in items)
    return f'<div class="us-summary">{spans}</div>'


def _stats(timeline: Timeline, collapse: bool) -> str:
    stats = timeline.worker_stats()
    names = stat_columns(stats)
    head = "<tr><th>worker</th>" + "".join(f"<th>{_esc(STAT_LABELS.get(n, n))}</th>" for n in names) + "</tr>"
    body = []
    for w in range(timeline.num_workers):
        cells = "".join(f"<td>{_esc(fmt_stat(n, stats[n][w]))}</td>" for n in names)
        body.append(f'<tr class="us-stat-row"><td>{w}</td>{cells}</tr>')
    table = f'<table class="us-stats"><thead>{head}</thead><tbody>{"".join(body)}</tbody></table>'
    if not collapse:
        return table
    summary_rows = []
    for label, reduce in (("min", np.min), ("mean", np.mean), ("max", np.max)):
        cells = "".join(
            f"<td>{_esc(fmt_stat(n, _plain(reduce(np.asarray(stats[n], dtype=float)))))}</td>" for n in names
        )
        summary_rows.append(f"<tr><td>{label}</td>{cells}</tr>")
    overview = f'<table class="us-stats"><thead>{head.replace("worker", "over workers", 1)}</thead><tbody>{"".join(summary_rows)}</tbody></table>'
    return f"{overview}<details><summary>per-worker statistics ({timeline.num_workers} workers)</summary>{table}</details>"


def _plain(value: float):
    value = float(value)
    return int(value) if value.is_integer() else value


# ---------------------------------------------------------------------- bar charts
def _bars(timeline: Timeline) -> str:
    stats = timeline.worker_stats()
    charts = [
        _bar_chart("peak activations (stashed inputs)", stats["max_activation_storage"], fmt_number),
        _bar_chart("utilization", stats["utilization"], lambda v: f"{v:.0%}", top=1.0),
    ]
    if any(stats["peak_memory_bytes"]):
        charts.append(_bar_chart("peak memory", stats["peak_memory_bytes"], fmt_bytes))
    note = (
        f'<div class="us-legend">{timeline.num_workers} workers, {len(timeline)} work items: '
        "per-worker charts instead of the diagram (use <code>to_html(mode='grid')</code> to force it, "
        "or <code>.figure()</code> / a Chrome trace for a zoomable view).</div>"
    )
    return note + '<div class="us-scroll">' + "".join(charts) + "</div>"


def _bar_chart(title: str, values, fmt, top: float | None = None) -> str:
    values = [float(v) for v in values]
    n = len(values)
    bar = max(3, min(24, 720 // max(n, 1)))
    gap = 1 if bar < 8 else 2
    left, bottom, plot_h = 56, 28, 110
    width = left + n * (bar + gap) + 10
    height = plot_h + bottom + 22
    vmax = top if top is not None else max(values, default=0.0)
    vmax = vmax if vmax > 0 else 1.0
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="us-bars" width="{width}" height="{height}" '
        f'style="font-family:sans-serif;font-size:10px;margin-right:12px" role="img" aria-label="{_esc(title)}">',
        f'<text x="{left}" y="12" font-size="12" font-weight="600">{_esc(title)}</text>',
    ]
    y0 = 20 + plot_h
    for frac in (0, 0.5, 1):
        y = y0 - frac * plot_h
        out.append(f'<line x1="{left - 3}" x2="{width - 8}" y1="{y:.1f}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{left - 5}" y="{y + 3:.1f}" text-anchor="end">{_esc(fmt(vmax * frac))}</text>')
    label_every = max(1, int(nice_step(n, max(1, (n * (bar + gap)) // 28))))
    for w, v in enumerate(values):
        h = plot_h * min(v / vmax, 1.0)
        x = left + w * (bar + gap)
        out.append(
            f'<rect x="{x}" y="{y0 - h:.1f}" width="{bar}" height="{h:.1f}" fill="#4c78a8">'
            f"<title>worker {w}: {_esc(fmt(v))}</title></rect>"
        )
        if w % label_every == 0:
            out.append(f'<text x="{x + bar / 2:.1f}" y="{y0 + 12}" text-anchor="middle">{w}</text>')
    out.append(f'<text x="{left + n * (bar + gap) / 2:.1f}" y="{y0 + 24}" text-anchor="middle" fill="#666">worker</text>')
    out.append("</svg>")
    return "".join(out)
