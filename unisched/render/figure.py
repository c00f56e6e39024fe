"""matplotlib: a Gantt diagram of a Timeline, optional transfer arrows, and
memory over time per worker.

The figure is a plain :class:`matplotlib.figure.Figure` drawn with the Agg
canvas: no display and no pyplot state are needed, and a notebook shows it
as a PNG (the returned figure has ``_repr_png_``).

- Gantt: one row per worker (worker 0 on top), a box per work item from its
  start to its end, coloured by micro-batch; backward passes are a darker
  shade and hatched (``///``), split weight-gradient passes lighter and
  dotted.  Boxes wide enough carry their label (``F3`` = forward of
  stage 3).  Items that overlap on one worker (measured runs with several
  streams) are stacked in thinner lanes.
- Arrows (``arrows=True``): each transfer between two workers, from its
  start on the sender's row to its end on the receiver's, coloured by kind
  (activation, gradient, stash, weights, ...).
- Memory: per-worker step curves (:meth:`Timeline.memory`): total bytes
  when the timeline knows activation sizes, else stashed activations in
  units.  Up to ``max_memory_rows`` workers get a small panel each; more
  share one heat map (rows = workers, colour = memory).
"""

from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np
from matplotlib.patheffects import withStroke
from matplotlib.ticker import FuncFormatter
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import LineCollection, PolyCollection
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Patch

from unisched.errors import UniSchedError
from unisched.render._common import (
    DIRECTION_NAMES,
    LETTERS,
    batch_color,
    fmt_bytes,
    headline,
    lanes,
    shade,
    text_color_on,
    time_grid,
)
from unisched.timeline import TRANSFER_KINDS, Timeline, as_timeline
from unisched.work import is_real

TRANSFER_COLORS = {
    "activation": "#222222",
    "gradient": "#c0392b",
    "stash": "#8e44ad",
    "weights": "#1e8449",
    "weight_gradient": "#b7950b",
    "allreduce": "#7f8c8d",
}
DIRECTION_STYLE = {
    # letter: (shade factor, hatch)
    "F": (1.0, None),
    "B": (0.72, "///"),
    "I": (0.72, "///"),
    "W": (1.35, "..."),
}


class TimelineFigure(Figure):
    """A Figure that shows itself in a notebook as a PNG, pyplot or not."""

    def _repr_png_(self) -> bytes:
        buffer = io.BytesIO()
        self.savefig(buffer, format="png", dpi=100)
        return buffer.getvalue()


def figure(
    timeline: Timeline,
    *,
    arrows: bool = False,
    memory: bool = True,
    memory_kind: str | None = None,
    memory_unit: str | None = None,
    labels: bool | None = None,
    width: float = 12.0,
    title: str | None = None,
    max_memory_rows: int = 8,
    max_arrows: int = 400,
) -> Figure:
    """Draw ``timeline``; see the module's doc.

    ``memory_kind`` / ``memory_unit``: what the memory panel shows (a kind of
    :meth:`Timeline.memory`, "bytes" or "units"; default total bytes when
    sizes are known, else activations in units).  ``labels``: write ``F3``
    in boxes (default: where they fit).  ``max_arrows``: above this many
    transfers, arrows are drawn as plain lines.
    """
    timeline = as_timeline(timeline, "figure")
    if not (is_real(width) and 1 <= width <= 200):
        raise ValueError(f"figure(width=...) is the figure's width in inches, a number from 1 to 200, got {width!r}")
    timeline = timeline.per_worker()  # a gang item is drawn on each of its workers
    W = timeline.num_workers
    grid = time_grid(timeline, max_columns=1)
    origin, span = grid.origin, grid.span
    if memory and memory_kind is None:
        sized = bool(np.any(timeline.activation_bytes > 0) or np.any(timeline.weight_bytes > 0))
        memory_kind, memory_unit = ("total", "bytes") if sized else ("activations", "units")
    memory_unit = memory_unit or "units"
    per_worker_panels = memory and W <= max_memory_rows

    gantt_h = float(np.clip(0.34 * W + 0.9, 1.8, 9.0))
    if not memory:
        heights = [gantt_h]
    elif per_worker_panels:
        heights = [gantt_h] + [0.62] * W
    else:
        heights = [gantt_h, float(np.clip(0.05 * W + 1.0, 1.4, 3.5))]
    fig = TimelineFigure(figsize=(width, sum(heights) + 0.9), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(heights), 1, sharex=True, height_ratios=heights, squeeze=False)[:, 0]
    if not memory or not per_worker_panels:
        fig.get_layout_engine().set(h_pad=0.04, hspace=0.02)
    else:
        fig.get_layout_engine().set(h_pad=0.01, hspace=0.0)

    ax = axes[0]
    _gantt(ax, fig, timeline, origin, span, labels, width)
    handles = _direction_handles(timeline)
    if arrows:
        handles += _arrows(ax, timeline, origin, max_arrows)
    # The title heads the legend: both sit above the axes, and constrained
    # layout makes room for them together.
    handles = handles or [Patch(visible=False, label=" ")]
    ncol = min(len(handles), 6)
    fig.legend(handles=_row_major(handles, ncol), loc="outside upper left", ncol=ncol, fontsize=8,
               frameon=False, handlelength=1.6, columnspacing=1.4, alignment="left",
               title=title if title is not None else headline(timeline), title_fontsize=10)

    if memory:
        curves = timeline.memory(memory_kind, memory_unit)
        what = _memory_title(memory_kind, memory_unit)
        if per_worker_panels:
            _memory_panels(axes[1:], curves, origin, span, memory_unit, what)
        else:
            _memory_heatmap(fig, axes[1], curves, origin, span, memory_unit, what)
    bottom = axes[-1]
    bottom.set_xlabel("time (s)" if timeline.source == "measured" else "time")
    bottom.set_xlim(0, span if span > 0 else 1)
    return fig


def save_figure(fig: Figure, path, dpi: float | None = None) -> None:
    """Write a figure; the format follows the extension (.png, .svg, .pdf); ``dpi`` None: 150 for
    a .png, the figure's own for the others."""
    path = Path(path)
    if dpi is not None and (isinstance(dpi, bool) or not isinstance(dpi, (int, float, np.number)) or not 0 < dpi < math.inf):
        raise UniSchedError(f"dpi must be a positive number of dots per inch, got {dpi!r}")
    fig.savefig(path, dpi=dpi or (150 if path.suffix.lower() == ".png" else "figure"))


# ---------------------------------------------------------------------- gantt
def _gantt(ax, fig, timeline: Timeline, origin: float, span: float, labels: bool | None, width_in: float) -> None:
    W = timeline.num_workers
    n = len(timeline)
    ax.set_ylim(W - 0.5, -0.5)
    ax.set_xlim(0, span if span > 0 else 1)
    step = max(1, int(np.ceil(W / 24)))
    ax.set_yticks(range(0, W, step))
    ax.set_yticklabels([f"worker {w}" for w in range(0, W, step)], fontsize=8 if W <= 16 else 7)
    ax.tick_params(axis="y", length=0)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.grid(axis="x", color="#dddddd", linewidth=0.6, zorder=0)
    ax.set_axisbelow(True)
    if not n:
        ax.text(0.5, 0.5, "no work items", transform=ax.transAxes, ha="center", va="center")
        return

    start = timeline.start - origin
    end = timeline.end - origin
    # Lanes for items that overlap on one worker.
    lane = np.zeros(n, dtype=np.int64)
    n_lanes = np.ones(W, dtype=np.int64)
    for w in np.unique(timeline.worker).tolist():
        rows = np.flatnonzero(timeline.worker == w)
        lane[rows] = lanes(start[rows], end[rows], tolerance=span * 1e-9)
        if 0 <= w < W:
            n_lanes[w] = lane[rows].max(initial=0) + 1
    height = 0.8 / n_lanes[np.clip(timeline.worker, 0, W - 1)]
    top = timeline.worker - 0.4 + lane * height

    letters = np.array([LETTERS[d] for d in range(4)])[timeline.direction]
    colors = [batch_color(b) for b in timeline.batch.tolist()]
    thin = n > 2000
    for letter, (factor, hatch) in DIRECTION_STYLE.items():
        rows = np.flatnonzero(letters == letter)
        if not len(rows):
            continue
        x0, x1 = start[rows], end[rows]
        y0, y1 = top[rows], top[rows] + height[rows]
        verts = np.stack([np.stack([x0, y0], 1), np.stack([x0, y1], 1), np.stack([x1, y1], 1), np.stack([x1, y0], 1)], 1)
        faces = [shade(colors[i], factor) for i in rows.tolist()]
        collection = PolyCollection(
            verts,
            facecolors=faces,
            edgecolors="white" if not thin else faces,
            linewidths=0.6 if not thin else 0.0,
            hatch=None if thin else hatch,
            zorder=2,
        )
        ax.add_collection(collection)

    # Labels where they fit.
    if labels is False:
        return
    axis_px = width_in * 0.85 * 100
    px_per_unit = axis_px / (span if span > 0 else 1)
    row_px = (fig.get_figheight() * 100) * 0.6 / max(W, 1)
    fontsize = float(np.clip(row_px * 0.32, 5.0, 8.5))
    char_px = fontsize * 0.75
    width_px = (end - start) * px_per_unit
    row_height_px = height * row_px / 0.8
    label_text = [f"{letters[i]}{int(timeline.stage[i])}" for i in range(n)]
    fits = (width_px >= char_px * (1 + np.array([len(t) for t in label_text]))) & (row_height_px >= fontsize * 1.3)
    if labels is None and fits.sum() > 1500:
        return
    for i in np.flatnonzero(fits if labels is None else np.ones(n, bool)).tolist():
        factor = DIRECTION_STYLE[letters[i]][0]
        ax.text(
            (start[i] + end[i]) / 2,
            top[i] + height[i] / 2,
            label_text[i],
            ha="center",
            va="center",
            fontsize=fontsize,
            color=text_color_on(shade(colors[i], factor)),
            fontweight="bold",
            zorder=3,
            clip_on=True,
            path_effects=[withStroke(linewidth=2.2, foreground=shade(colors[i], factor))] if factor != 1.0 else None,
        )


def _row_major(handles: list, ncol: int) -> list:
    """Reorder handles so that a legend (filled column by column) reads row by row."""
    rows = -(-len(handles) // ncol)
    padded = handles + [Patch(visible=False, label=" ")] * (rows * ncol - len(handles))
    return [padded[r * ncol + c] for c in range(ncol) for r in range(rows)]


def _direction_handles(timeline: Timeline) -> list:
    handles = []
    for letter in sorted({LETTERS[d] for d in timeline.direction.tolist()}, key=LETTERS.index):
        factor, hatch = DIRECTION_STYLE[letter]
        handles.append(Patch(facecolor=shade("#8a8a8a", factor), edgecolor="white", hatch=hatch,
                             label=f"{letter}: {DIRECTION_NAMES[letter]}"))
    batches = sorted(set(timeline.batch.tolist()))
    if len(batches) <= 8:
        handles += [Patch(facecolor=batch_color(b), label=f"batch {b}") for b in batches]
    else:
        handles.append(Patch(facecolor="none", edgecolor="none", label=f"colour = batch (0..{batches[-1]})"))
    return handles


def _arrows(ax, timeline: Timeline, origin: float, max_arrows: int) -> list:
    tr = timeline.transfers
    moving = np.flatnonzero(tr.src != tr.dst)
    if not len(moving):
        return []
    kinds = [TRANSFER_KINDS[k] for k in tr.kind[moving].tolist()]
    x0 = tr.start[moving] - origin
    x1 = tr.end[moving] - origin
    down = tr.dst[moving] > tr.src[moving]
    y0 = tr.src[moving] + np.where(down, 0.4, -0.4)
    y1 = tr.dst[moving] + np.where(down, -0.4, 0.4)
    colors = [TRANSFER_COLORS[k] for k in kinds]
    if len(moving) <= max_arrows:
        for a, b, c, d, color in zip(x0.tolist(), y0.tolist(), x1.tolist(), y1.tolist(), colors):
            ax.add_patch(FancyArrowPatch((a, b), (c, d), arrowstyle="-|>", mutation_scale=7, color=color,
                                         linewidth=0.8, alpha=0.8, zorder=4, shrinkA=0, shrinkB=0))
    else:
        segments = np.stack([np.stack([x0, y0], 1), np.stack([x1, y1], 1)], 1)
        ax.add_collection(LineCollection(segments, colors=colors, linewidths=0.4, alpha=0.5, zorder=4))
    present = sorted(set(kinds), key=TRANSFER_KINDS.index)
    from matplotlib.lines import Line2D

    return [Line2D([], [], color=TRANSFER_COLORS[k], linewidth=1.2, label=f"{k} transfer") for k in present]


# ---------------------------------------------------------------------- memory
def _memory_title(kind: str, unit: str) -> str:
    what = "memory" if kind == "total" else kind
    return f"{what} ({'bytes' if unit == 'bytes' else 'units'})"


def _memory_panels(axes, curves, origin: float, span: float, unit: str, what: str) -> None:
    peak = max((c.peak for c in curves), default=0.0) or 1.0
    for w, (ax, curve) in enumerate(zip(axes, curves)):
        times = np.append(curve.times - origin, span)
        values = np.append(curve.values, curve.values[-1] if len(curve.values) else 0.0)
        ax.fill_between(times, values, step="post", color="#4c78a8", alpha=0.35, linewidth=0)
        ax.step(times, values, where="post", color="#4c78a8", linewidth=1.0)
        ax.set_ylim(0, peak * 1.15)
        ax.set_yticks([])
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
        label = fmt_bytes(curve.peak) if unit == "bytes" else f"{curve.peak:g}"
        ax.set_ylabel(f"w{w}", rotation=0, ha="right", va="center", fontsize=8)
        ax.text(1.0, 0.95, f"peak {label}", transform=ax.transAxes, ha="right", va="top", fontsize=7, color="#333")
        ax.grid(axis="x", color="#eeeeee", linewidth=0.6)
    axes[0].set_title(f"{what} per worker over time (same scale in every panel)", fontsize=9, loc="left")


def _memory_heatmap(fig, ax, curves, origin: float, span: float, unit: str, what: str) -> None:
    W = len(curves)
    samples = 800
    t = (np.arange(samples) + 0.5) * (span if span > 0 else 1) / samples + origin
    image = np.zeros((W, samples))
    for w, curve in enumerate(curves):
        index = np.searchsorted(curve.times, t, side="right") - 1
        image[w] = np.where(index >= 0, curve.values[np.clip(index, 0, None)], 0.0)
    mesh = ax.imshow(image, aspect="auto", interpolation="nearest", cmap="viridis",
                     extent=(0, span if span > 0 else 1, W - 0.5, -0.5))
    step = max(1, int(np.ceil(W / 12)))
    ax.set_yticks(range(0, W, step))
    ax.set_ylabel("worker", fontsize=8)
    ax.tick_params(axis="y", labelsize=7)
    ax.set_title(f"{what} per worker over time", fontsize=9, loc="left")
    bar = fig.colorbar(mesh, ax=ax, pad=0.01, fraction=0.03)
    bar.ax.tick_params(labelsize=7)
    if unit == "bytes":
        bar.ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: fmt_bytes(v)))


class _CallableModule(type(io)):
    """``unisched.render.figure`` is this module *and* callable as the
    function: ``from unisched.render import figure; figure(timeline)`` works
    whether or not the submodule was imported first."""

    def __call__(self, timeline: Timeline, **options) -> Figure:
        return figure(timeline, **options)


import sys as _sys  # noqa: E402

_sys.modules[__name__].__class__ = _CallableModule
