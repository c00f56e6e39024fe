"""What every renderer shares: batch colours, cell labels, the time grid, the
lane split of overlapping intervals, and number formatting.

Nothing here imports matplotlib, so the text, HTML and trace renderers stay
light.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from unisched.timeline import Timeline

# A qualitative palette: the ten strong colours first, then their light
# variants (matplotlib's tab20, reordered), so that neighbouring batches get
# far-apart colours and the first ten are the strongest.
PALETTE = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
    "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
    "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5",
    "#c49c94", "#f7b6d2", "#c7c7c7", "#dbdb8d", "#9edae5",
)  # fmt: skip

DIRECTION_NAMES = {
    "F": "forward",
    "B": "backward",
    "I": "backward (input grad)",
    "W": "backward (weight grad)",
}
LETTERS = "FBIW"


def batch_color(batch: int) -> str:
    """Hex colour of a micro-batch (cycles through :data:`PALETTE`)."""
    return PALETTE[int(batch) % len(PALETTE)]


def hex_to_rgb(color: str) -> tuple[int, int, int]:
    color = color.lstrip("#")
    return int(color[0:2], 16), int(color[2:4], 16), int(color[4:6], 16)


def shade(color: str, factor: float) -> str:
    """Darker (factor < 1) or lighter (factor > 1, towards white) hex colour."""
    r, g, b = hex_to_rgb(color)
    if factor <= 1:
        r, g, b = (int(round(c * factor)) for c in (r, g, b))
    else:
        mix = min(factor - 1, 1.0)
        r, g, b = (int(round(c + (255 - c) * mix)) for c in (r, g, b))
    return f"#{r:02x}{g:02x}{b:02x}"


def text_color_on(color: str) -> str:
    """Black or white, whichever reads better on ``color``."""
    r, g, b = hex_to_rgb(color)
    luminance = (0.299 * r + 0.587 * g + 0.114 * b) / 255
    return "#000000" if luminance > 0.55 else "#ffffff"


def labels(timeline: Timeline) -> list[str]:
    """Cell label of every row: direction letter + stage, e.g. ``F3``."""
    return [f"{LETTERS[d]}{s}" for d, s in zip(timeline.direction.tolist(), timeline.stage.tolist())]


def label_width(timeline: Timeline) -> int:
    return 1 + len(str(max(timeline.num_stages - 1, 0)))


# ---------------------------------------------------------------------- time grid
class Grid(NamedTuple):
    """Time axis of a diagram: ``origin`` is time 0 of the drawing, ``span``
    its length; ``quantum`` is the column size when every start and end is a
    multiple of it (``None`` when times are irregular, e.g. measured)."""

    origin: float
    span: float
    quantum: float | None

    @property
    def columns(self) -> int | None:
        if self.quantum is None:
            return None
        return max(1, int(round(self.span / self.quantum)))


def time_origin(timeline: Timeline) -> float:
    """Time 0 of the drawing: the step's origin (see :attr:`Timeline.origin`)."""
    return timeline.origin


def time_span(timeline: Timeline, origin: float) -> float:
    ends = [float(timeline.end.max(initial=origin))]
    if len(timeline.transfers):
        ends.append(float(timeline.transfers.end.max()))
    return max(max(ends) - origin, 0.0)


def time_grid(timeline: Timeline, max_columns: int = 4096, include_transfers: bool = False) -> Grid:
    """The column quantum: the largest q such that every start and end (less
    the origin) is a whole multiple of q, if that gives at most
    ``max_columns`` columns; else ``quantum=None`` (proportional layout)."""
    origin = time_origin(timeline)
    span = time_span(timeline, origin)
    if not len(timeline) or span <= 0:
        return Grid(origin, max(span, 1.0), 1.0)
    times = [timeline.start - origin, timeline.end - origin]
    if include_transfers and len(timeline.transfers):
        times += [timeline.transfers.start - origin, timeline.transfers.end - origin]
    values = np.unique(np.concatenate(times))
    values = values[values > span * 1e-9]
    tolerance = span * 1e-9
    floor = span / max_columns
    q = 0.0
    for value in values.tolist():
        q = _float_gcd(q, value, tolerance) if q else value
        if q < floor:
            return Grid(origin, span, None)
    if q <= 0:
        return Grid(origin, span, None)
    # Round the quantum onto a nice value when it is one (0.1, not 0.0999999).
    nice = float(f"{q:.6g}")
    if abs(nice - q) <= tolerance:
        q = nice
    return Grid(origin, span, q)


def _float_gcd(a: float, b: float, tolerance: float) -> float:
    a, b = max(a, b), min(a, b)
    while b > tolerance:
        r = math.fmod(a, b)
        if r > b - tolerance:
            r = 0.0
        a, b = b, r
    return a


# ---------------------------------------------------------------------- lanes
def lanes(starts: np.ndarray, ends: np.ndarray, tolerance: float = 0.0) -> np.ndarray:
    """Greedy interval partitioning: a lane index per interval such that the
    intervals in one lane do not overlap (0 for every interval when none do)."""
    n = len(starts)
    out = np.zeros(n, dtype=np.int64)
    if n < 2:
        return out
    order = np.lexsort((ends, starts))
    s_sorted, e_sorted = starts[order], ends[order]
    # The common case: no overlap at all.
    if np.all(s_sorted[1:] >= np.maximum.accumulate(e_sorted)[:-1] - tolerance):
        return out
    lane_end: list[float] = []
    for i, s, e in zip(order.tolist(), s_sorted.tolist(), e_sorted.tolist()):
        for lane, end in enumerate(lane_end):
            if s >= end - tolerance:
                lane_end[lane] = e
                out[i] = lane
                break
        else:
            lane_end.append(e)
            out[i] = len(lane_end) - 1
    return out


# ---------------------------------------------------------------------- numbers
def fmt_number(value, digits: int = 4) -> str:
    """Compact number: integers plain, others with ``digits`` significant digits."""
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    value = float(value)
    if math.isinf(value) or math.isnan(value):
        return str(value)
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.{digits}g}"


def fmt_bytes(value: float) -> str:
    value = float(value)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(value) < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1000
    return f"{value:.3g} PB"


def fmt_time(value: float, source: str) -> str:
    """A time for axis labels: seconds get a unit when measured."""
    if source == "measured":
        value = float(value)
        if value == 0:
            return "0"
        if abs(value) < 1e-3:
            return f"{value * 1e6:.3g}us"
        if abs(value) < 1:
            return f"{value * 1e3:.3g}ms"
        return f"{value:.3g}s"
    return fmt_number(value)


def nice_step(span: float, target: int) -> float:
    """A round tick step (1, 2 or 5 times a power of ten) giving about ``target`` ticks."""
    if span <= 0 or target <= 0:
        return 1.0
    raw = span / target
    power = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if m * power >= raw:
            return m * power
    return 10 * power


STAT_LABELS = {
    "busy_time": "busy",
    "utilization": "util",
    "weight_transmissions": "weight fetches",
    "weight_storage": "weights held",
    "activation_transmissions": "act. received",
    "max_activation_storage": "peak act.",
    "bytes_sent": "sent",
    "bytes_received": "received",
    "peak_memory_bytes": "peak memory",
}
BYTE_COLUMNS = ("bytes_sent", "bytes_received", "peak_memory_bytes")


def stat_columns(stats: dict[str, list]) -> list[str]:
    """The columns worth showing: byte columns only when some are non-zero."""
    return [name for name in stats if name not in BYTE_COLUMNS or any(stats[name])]


def fmt_stat(name: str, value) -> str:
    if name == "utilization":
        return f"{float(value):.1%}"
    if name in BYTE_COLUMNS:
        return fmt_bytes(value)
    return fmt_number(value)


def fmt_throughput(timeline: Timeline) -> str:
    """Micro-batches per unit of time (per second when measured): the rate
    that compares strategies whatever form their backwards take."""
    per = "s" if timeline.source == "measured" else "time"
    return f"{timeline.throughput:.4g} micro-batches/{per}"


def headline(timeline: Timeline) -> str:
    """One line: name, shape, latency, throughput, bubble."""
    name = timeline.label or timeline.source
    latency = fmt_time(timeline.latency, timeline.source) if timeline.source == "measured" else fmt_number(timeline.latency)
    return (
        f"{name}: W={timeline.num_workers} S={timeline.num_stages} B={timeline.num_batches}, "
        f"latency {latency}, throughput {fmt_throughput(timeline)}, "
        f"bubble {timeline.bubble_fraction:.1%}"
    )
