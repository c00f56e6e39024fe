"""Terminal diagrams: one row per worker, time left to right, each work item a
cell.  In colour a cell is labelled with its direction letter and stage
(``F3``, ``B3``, ``I3``, ``W3``) on its micro-batch's colour; without colour
(a pipe, a log, a ``.txt`` file, ``NO_COLOR``) it carries the whole item as
``str(Work)`` writes it, stage, letter and micro-batch (``3F0``), so that
rows which differ only in their micro-batches still read differently.

The layout adapts to the width:

- a step that fits is drawn at its natural scale, the shortest item
  ``len(label) + 1`` characters wide (so a unit-cost GPipe reads like the
  seed notebook's grid);
- a wider one is wrapped into a few bands, each with its own time axis;
- one that would need too many bands (many workers, long steps) is
  compressed to the width: an item narrower than its label shows its letter
  alone, and only colour carries the batch.

Every line is at most ``width`` visible characters (ANSI colour codes do not
count).
"""

from __future__ import annotations

import math
import os
import re
import sys
import textwrap

import numpy as np

from unisched.render._common import (
    DIRECTION_NAMES,
    LETTERS,
    PALETTE,
    fmt_stat,
    fmt_time,
    headline,
    hex_to_rgb,
    label_width,
    nice_step,
    stat_columns,
    time_grid,
)
from unisched.errors import ShapeError
from unisched.timeline import Timeline, as_timeline
from unisched.work import is_whole

MIN_WIDTH = 24
ANSI = re.compile(r"\x1b\[[0-9;]*m")
RESET = "\x1b[0m"

TEXT_HEADERS = {
    "busy_time": "busy",
    "utilization": "util",
    "weight_transmissions": "w.fetch",
    "weight_storage": "w.held",
    "activation_transmissions": "act.recv",
    "max_activation_storage": "peak.act",
    "bytes_sent": "sent",
    "bytes_received": "recv",
    "peak_memory_bytes": "peak.mem",
}


def check_width(width, name: str = "width") -> int:
    """``width`` if a diagram can be drawn that many columns wide, else an error naming it as
    ``name`` (``--width`` on the command line, checked before anything slow runs)."""
    if not is_whole(width, MIN_WIDTH):
        raise ShapeError(f"{name} must be a whole number of at least {MIN_WIDTH} columns, got {width!r}")
    return width


def visible_len(line: str) -> int:
    """Length of a line as shown in a terminal (ANSI colour codes removed)."""
    return len(ANSI.sub("", line))


COLOR_MODES = ("auto", "always", "never")
"""What ``color=`` (and the command line's ``--color``) take besides True, False and None."""
COLOR_HELP = (
    "colour the diagram by micro-batch: auto (the default) on a terminal unless NO_COLOR is set, always, or never; "
    "without colour each cell names its micro-batch (3F0: stage 3, forward, micro-batch 0)"
)
"""The command line's help for ``--color`` (every verb that draws says the same)."""


def use_color(color: bool | str | None) -> bool:
    """Whether to draw in colour.  ``True`` / ``"always"`` and ``False`` /
    ``"never"`` decide; ``None`` / ``"auto"`` colours only when stdout is a
    terminal that takes colour and ``NO_COLOR`` is unset (no-color.org)."""
    if isinstance(color, str):
        mode = color.strip().lower()
        if mode not in COLOR_MODES:
            raise ValueError(f"color must be one of {', '.join(COLOR_MODES)}, True, False or None; got {color!r}")
        color = {"always": True, "never": False, "auto": None}[mode]
    if color is not None:
        return bool(color)
    if os.environ.get("NO_COLOR"):
        return False
    isatty = getattr(sys.stdout, "isatty", None)
    try:
        return bool(isatty and isatty()) and os.environ.get("TERM") != "dumb"
    except (ValueError, OSError):
        return False


# ---------------------------------------------------------------------- colour
def _xterm256(color: str) -> int:
    """Nearest xterm-256 colour-cube index of a hex colour."""
    levels = (0, 95, 135, 175, 215, 255)

    def nearest(c):
        return min(range(6), key=lambda i: abs(levels[i] - c))

    r, g, b = (nearest(c) for c in hex_to_rgb(color))
    return 16 + 36 * r + 6 * g + b


_BG = [_xterm256(c) for c in PALETTE]
_FG = []
for _c in PALETTE:
    _r, _g, _b = hex_to_rgb(_c)
    _FG.append(16 if (0.299 * _r + 0.587 * _g + 0.114 * _b) / 255 > 0.55 else 231)


def _paint(text: str, batch: int) -> str:
    i = batch % len(PALETTE)
    return f"\x1b[48;5;{_BG[i]}m\x1b[38;5;{_FG[i]}m{text}{RESET}"


def _row_string(chars: list[str], owner: np.ndarray, color: bool) -> str:
    """Join a row's characters, colouring runs that belong to a batch."""
    if not color:
        return "".join(chars)
    out = []
    n = len(chars)
    i = 0
    while i < n:
        b = owner[i]
        j = i + 1
        while j < n and owner[j] == b:
            j += 1
        text = "".join(chars[i:j])
        out.append(_paint(text, int(b)) if b >= 0 else text)
        i = j
    return "".join(out)


# ---------------------------------------------------------------------- diagram
def to_text(
    timeline: Timeline,
    width: int = 100,
    color: bool | str | None = None,
    *,
    stats: bool = False,
    max_bands: int | None = None,
) -> str:
    """A compact diagram of ``timeline`` for the terminal.

    ``color``: ANSI colours by batch: ``True`` / ``"always"``, ``False`` /
    ``"never"``, or ``None`` / ``"auto"`` (the default: when stdout is a
    terminal and ``NO_COLOR`` is unset).  Without colour each cell names its
    micro-batch too (``3F0``).  ``stats``: append :func:`stats_table`.  ``max_bands``: the most bands a
    wide step is wrapped into before it is compressed instead (default: as
    many as keep the diagram under about 60 lines, at most 8).
    """
    timeline = as_timeline(timeline, "to_text")
    check_width(width)
    if max_bands is not None and not is_whole(max_bands):
        raise ValueError(f"max_bands must be a whole number of at least 1 (or None: as many as fit), got "
                         f"{max_bands!r}")
    timeline = timeline.per_worker()  # a gang item is drawn on each of its workers
    color = use_color(color)
    lines = textwrap.wrap(headline(timeline), width, subsequent_indent="  ") or [""]
    if not len(timeline):
        lines.append("(no work items)")
    else:
        lines += _diagram(timeline, width, color, max_bands)
        lines += _legend(timeline, width, color)
    if stats:
        lines.append("")
        lines.append(stats_table(timeline, width=width))
    return "\n".join(lines)


def _diagram(timeline: Timeline, width: int, color: bool, max_bands: int | None) -> list[str]:
    W = timeline.num_workers
    digits = len(str(W - 1))
    prefix_width = digits + 3  # "w12|"
    avail = width - prefix_width
    cw = _label_width(timeline, color) + 1
    grid = time_grid(timeline)
    origin, span = grid.origin, grid.span

    durations = timeline.end - timeline.start
    positive = durations[durations > span * 1e-9]
    unit = float(positive.min()) if len(positive) else (grid.quantum or span)
    if grid.quantum is not None:
        unit = max(unit, grid.quantum)
    if max_bands is None:
        max_bands = max(1, min(8, 60 // (W + 2)))
    compressed = False
    for cell in (cw, cw - 1) if color else (cw,):  # with a space after each cell, then (told apart by colour) without
        scale = cell / unit  # characters per time unit
        total = int(math.ceil(span * scale - 1e-9))
        if total <= avail:
            band_chars = avail
            break
    else:
        cell = cw
        scale = cw / unit
        total = int(math.ceil(span * scale - 1e-9))
        cells = int(math.ceil(total / cw))
        bands = int(math.ceil(cells / max(1, avail // cw)))
        if bands <= max_bands:
            band_chars = int(math.ceil(cells / bands)) * cw  # balanced bands
        else:
            scale, total, band_chars, compressed = avail / span, avail, avail, True

    chars, owner, items = _raster(timeline, origin, scale, total, compressed, color)
    regular = grid.quantum is not None and not compressed and abs(unit - grid.quantum) < 1e-9 * max(span, 1)
    if regular:
        step = cell  # an idle mark at each empty time quantum
        for w in range(W):
            row, own = chars[w], owner[w]
            for c in range(0, total, step):
                if own[c] == -1 and row[c] == " ":
                    row[c] = "."

    lines = []
    if compressed:
        per_char = span / total
        lines.append(f"(compressed: 1 column = {fmt_time(per_char, timeline.source)} time)")
    if compressed and not color:
        lines += textwrap.wrap("(too narrow for micro-batch numbers: colour shows them, --color always or "
                               "color=True)", width)
    for lo in range(0, total, band_chars):
        hi = min(lo + band_chars, total)
        if lo:
            lines.append("")
        lines.append(" " * prefix_width + _axis(lo, hi, origin, scale, timeline.source, regular and cell or 0))
        for w in range(W):
            row = chars[w][lo:hi]
            if lo and not compressed:
                _relabel(row, items[w][lo:hi], items[w][lo - 1], owner[w][lo:hi], timeline, color)
            body = _row_string(row, owner[w][lo:hi], color)
            line = f"w{w:<{digits}}|" + body
            lines.append(line if color else line.rstrip())
    return lines


def _label(letter: str, stage: int, batch: int, color: bool) -> str:
    """A cell's text: ``F3`` on the batch's colour, ``3F0`` (``str(Work)``) without."""
    return f"{letter}{stage}" if color else f"{stage}{letter}{batch}"


def _label_width(timeline: Timeline, color: bool) -> int:
    if color:
        return label_width(timeline)
    return label_width(timeline) + len(str(max(int(timeline.batch.max(initial=0)), 0)))


def _raster(timeline: Timeline, origin: float, scale: float, total: int, compressed: bool, color: bool):
    """Character rows: ``chars[w][c]`` the character, ``owner[w][c]`` the batch
    whose colour it takes (-1 idle, -2 separator)."""
    W = timeline.num_workers
    chars = [[" "] * total for _ in range(W)]
    owner = [np.full(total, -1, dtype=np.int64) for _ in range(W)]
    items = [np.full(total, -1, dtype=np.int64) for _ in range(W)]
    c0 = np.rint((timeline.start - origin) * scale).astype(np.int64)
    c1 = np.rint((timeline.end - origin) * scale).astype(np.int64)
    c0 = np.clip(c0, 0, max(total - 1, 0))
    c1 = np.clip(c1, 0, total)
    # Long items first, so that a short item squeezed into the same character
    # (compressed view) is drawn over it and stays visible.
    order = np.lexsort((-(c1 - c0), c0))
    stages = timeline.stage.tolist()
    letters = [LETTERS[d] for d in timeline.direction.tolist()]
    batches = timeline.batch.tolist()
    workers = timeline.worker.tolist()
    c0l, c1l = c0.tolist(), c1.tolist()
    for i in order.tolist():
        w = workers[i]
        if not 0 <= w < W:
            continue
        a, b = c0l[i], c1l[i]
        row, own = chars[w], owner[w]
        items[w][a:max(b, a + 1)] = i
        if b <= a:
            # Shorter than a character: mark it unless something is there.
            if own[a] != -1:
                continue
            b = a + 1
        label = _label(letters[i], stages[i], batches[i], color)
        length = b - a
        if length > len(label):
            text = label + " " * (length - len(label) - 1)
            row[a : b - 1] = text
            own[a : b - 1] = batches[i]
            row[b - 1] = " "
            own[b - 1] = -2
        elif length == len(label):
            row[a:b] = label
            own[a:b] = batches[i]
        else:
            row[a:b] = (letters[i] + "~" * (length - 1)) if compressed else label[:length]
            own[a:b] = batches[i]
    return chars, owner, items


def _relabel(row: list[str], items: np.ndarray, before: int, owner: np.ndarray, timeline: Timeline,
             color: bool) -> None:
    """Repeat the label of an item that carries over from the previous band: whole where it fits,
    else its beginning, as a short item shows it (the label's tail left there, ``F7`` of ``1F7``,
    reads as another item)."""
    first = int(items[0])
    if first < 0 or first != before:
        return
    label = _label(LETTERS[int(timeline.direction[first])], int(timeline.stage[first]), int(timeline.batch[first]),
                   color)
    run = int(np.sum((items == first) & (owner >= 0)))
    row[: min(run, len(label))] = label[:run]


def _axis(lo: int, hi: int, origin: float, scale: float, source: str, cell: int) -> str:
    """Time labels over characters [lo, hi) of the raster."""
    n = hi - lo
    start_t, end_t = lo / scale, hi / scale
    if cell:
        # Regular grid: label every k-th cell, k a round number of cells.
        per_cell = cell / scale
        k = max(1, int(round(nice_step((end_t - start_t) / per_cell, max(1, n // 12)))))
        ticks = []
        first = int(math.ceil(lo / cell / k - 1e-9)) * k
        for index in range(first, int(hi / cell) + 1, k):
            ticks.append((index * cell - lo, index * per_cell))
    else:
        step = nice_step(end_t - start_t, max(1, n // 12))
        first = math.ceil(start_t / step - 1e-9) * step
        ticks = []
        t = first
        while t <= end_t + 1e-12:
            ticks.append((int(round(t * scale)) - lo, t))
            t += step
    line = [" "] * n
    last_end = -1
    for pos, t in ticks:
        text = fmt_time(round(t, 12), source)
        if pos < 0 or pos + len(text) > n or pos <= last_end:
            continue
        line[pos : pos + len(text)] = text
        last_end = pos + len(text)
    return "".join(line).rstrip()


def _legend(timeline: Timeline, width: int, color: bool) -> list[str]:
    present = [LETTERS[d] for d in sorted(set(timeline.direction.tolist()))]
    if color:
        first = "{letter}n = {name} of stage n"
    else:
        first = "s{letter}b = {name} of stage s, micro-batch b"
    parts = [first.format(letter=letter, name=DIRECTION_NAMES[letter]) if i == 0
             else f"{letter} = {DIRECTION_NAMES[letter]}" for i, letter in enumerate(present)]
    text = "; ".join(parts)
    if color:
        text += "; colour = micro-batch"
    lines = textwrap.wrap(text, width)
    if color:
        batches = sorted(set(timeline.batch.tolist()))
        shown, used = [], len("batches:")
        for b in batches:
            cell = f" {b} "
            if used + len(cell) + 1 > width - 4:
                shown.append(" ...")
                break
            shown.append(" " + _paint(cell, b))
            used += len(cell) + 1
        lines.append("batches:" + "".join(shown))
    return lines


# ---------------------------------------------------------------------- stats
def stats_table(timeline: Timeline, width: int = 100, max_rows: int = 32) -> str:
    """Per-worker statistics (``timeline.worker_stats()``) as a plain table.

    Byte columns appear only when some bytes moved or were held.  With more
    than ``max_rows`` workers the table gives min / mean / max over workers
    instead of one row each.  Columns that do not fit ``width`` are left off
    (the last line says which).
    """
    timeline = as_timeline(timeline, "stats_table")
    stats = timeline.worker_stats()
    names = stat_columns(stats)
    W = timeline.num_workers
    if W <= max_rows:
        row_labels = [str(w) for w in range(W)]
        cells = {name: [fmt_stat(name, v) for v in stats[name]] for name in names}
        first = "worker"
    else:
        row_labels = ["min", "mean", "max"]
        cells = {}
        for name in names:
            values = np.asarray(stats[name], dtype=float)
            summary = [values.min(), values.mean(), values.max()] if len(values) else [0, 0, 0]
            cells[name] = [fmt_stat(name, _plainish(v)) for v in summary]
        first = f"{W} workers"
    columns = [(first, row_labels, "<")] + [(TEXT_HEADERS.get(n, n), cells[n], ">") for n in names]
    widths = [max(len(h), *(len(v) for v in vals)) if vals else len(h) for h, vals, _ in columns]
    kept, used = [], 0
    for col, w in zip(columns, widths):
        if used + w > width:
            break
        kept.append((col, w))
        used += w + 2
    lines = ["  ".join(f"{h:{align}{w}}" for (h, _, align), w in kept).rstrip()]
    for r in range(len(row_labels)):
        lines.append("  ".join(f"{vals[r]:{align}{w}}" for (_, vals, align), w in kept).rstrip())
    if len(kept) < len(columns):
        left = ", ".join(h for h, _, _ in columns[len(kept) :])
        lines.extend(textwrap.wrap(f"(not shown for width: {left})", width))
    return "\n".join(lines)


def _plainish(value: float):
    value = float(value)
    return int(value) if value.is_integer() else value


def add_color_arguments(parser) -> None:
    """``--color auto|always|never`` and ``--no-color`` (the same as
    ``--color never``) on a command that draws text."""
    either = parser.add_mutually_exclusive_group()  # --no-color --color always says two things
    either.add_argument("--color", choices=COLOR_MODES, default="auto", help=COLOR_HELP)
    either.add_argument("--no-color", dest="color", action="store_const", const="never", default="auto",
                        help="the same as --color never")
