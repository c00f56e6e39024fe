"""Drawing a Timeline: terminal text, HTML, matplotlib figures, Chrome traces.

Every renderer takes any :class:`~unisched.Timeline`, simulated or measured.
``save(timeline, path)`` picks one by the file's extension.  matplotlib is
imported only when a figure is asked for.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from unisched.errors import UniSchedError
from unisched.timeline import Timeline, as_timeline

FORMATS = {
    ".html": "HTML diagram and stats (open in a browser)",
    ".png": "matplotlib figure",
    ".svg": "matplotlib figure",
    ".pdf": "matplotlib figure",
    ".json": "Chrome trace event format (Perfetto, chrome://tracing)",
    ".txt": "terminal diagram without colour, with the stats table",
}
"""Extension -> what :func:`save` writes there."""

__all__ = ["FORMATS", "check_path", "check_width", "figure", "save", "stats_table", "to_chrome_trace", "to_html", "to_text"]


def save(timeline, path, **options) -> Path:
    """Write ``timeline`` to ``path``, the format chosen by the extension
    (see :data:`FORMATS`).  ``options`` go to the renderer (e.g. ``dpi`` or
    ``arrows=True`` for a figure, ``width`` for text).  Returns the path."""
    timeline = as_timeline(timeline, "save")  # a Simulation draws its Timeline
    path = Path(path)
    suffix = check_path(path)
    try:
        _write(timeline, path, suffix, options)
    except OSError as error:
        raise UniSchedError(f"cannot write {str(path)!r}: {error.strerror or error}; name a file in a folder that "
                            "exists and that you may write to") from None
    return path


def check_path(path) -> str:
    """The format :func:`save` writes ``path`` in (its extension, lower case), or an error saying
    which ones it can (checked before anything is drawn, or anything slow is run)."""
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        supported = ", ".join(FORMATS)
        shown = f"extension {suffix!r} is not supported" if suffix else "it has no extension"
        raise UniSchedError(f"cannot save {str(path)!r}: {shown}; use one of {supported}")
    return suffix


def _write(timeline: Timeline, path: Path, suffix: str, options: dict) -> None:
    """Render ``timeline`` in the format of ``suffix`` into ``path``."""
    if suffix == ".html":
        from unisched.render.html import to_html_document

        path.write_text(to_html_document(timeline, **options), encoding="utf-8")
    elif suffix == ".json":
        import json

        from unisched.render.trace import to_chrome_trace

        path.write_text(json.dumps(to_chrome_trace(timeline, **options), separators=(",", ":")), encoding="utf-8")
    elif suffix == ".txt":
        from unisched.render.text import to_text

        path.write_text(to_text(timeline, **{"stats": True, "color": False, **options}) + "\n", encoding="utf-8")
    else:
        from unisched.render.figure import figure, save_figure

        dpi = options.pop("dpi", None)
        save_figure(figure(timeline, **options), path, dpi=dpi)


_HOMES = {
    "to_text": "unisched.render.text",
    "stats_table": "unisched.render.text",
    "check_width": "unisched.render.text",
    "to_html": "unisched.render.html",
    "figure": "unisched.render.figure",
    "to_chrome_trace": "unisched.render.trace",
}
"""Where each renderer lives; each is imported on first use."""


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'unisched.render' has no attribute {name!r}")


def _on_first_call(name: str):
    def render(timeline, *args, **options):
        return getattr(importlib.import_module(_HOMES[name]), name)(timeline, *args, **options)

    return render


for _name in ("to_text", "to_html", "figure", "to_chrome_trace"):
    Timeline.register_view(_name, _on_first_call(_name))
Timeline.register_view("save", save)
