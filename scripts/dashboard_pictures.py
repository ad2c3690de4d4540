"""A dashboard's answers drawn as one PNG (matplotlib, no display needed): each panel at its
place in the dashboard's 24-column grid, on a white card with its title; a time-series panel as
lines (the series on the right axis that the dashboard puts there, the thresholds a panel draws
as dashed lines and bands) with its legend under it; a stat panel as its last value in large
type over a sparkline, in its threshold's colour; a state timeline as a bar per series, coloured
and named by its value mappings. Values are written in the panel's unit; time runs in minutes
from the start of the window. The picture is saved with a palette of 256 colours (fewer when it
would pass :data:`MAX_BYTES`), about a third of the size of full colour."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from dashboard_model import (
    Answer,
    Dashboard,
    Override,
    Panel,
    Window,
    format_value,
    legend_text,
    natural_key,
)
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.ticker import FixedLocator, FuncFormatter, MaxNLocator, MultipleLocator
from PIL import Image

from apogee.local import prometheus

#: Grafana's classic series colours
PALETTE: Final = (
    "#7EB26D", "#EAB839", "#6ED0E0", "#EF843C", "#E24D42",
    "#1F78C1", "#BA43A9", "#705DA0", "#508642", "#CCA300",
    "#447EBC", "#C15C17", "#890F02", "#0A437C", "#6D1F62",
    "#584477", "#B7DBAB", "#F4D598", "#70DBED", "#F9BA8F",
)  # fmt: skip
#: Grafana's named colours, as thresholds name them
COLOURS: Final = {"green": "#56A64B", "orange": "#FF9830", "red": "#E02F44", "yellow": "#F2CC0C"}
#: inches: the figure's width, one grid row, the heading, the margins
WIDTH, ROW, HEAD, MARGIN = 16.0, 0.32, 0.75, 0.12
LEGEND_ROW: Final = 0.14
#: the largest picture wanted
MAX_BYTES: Final = 150 * 1024
#: a panel's background (below its axes), and its legend
CARD: Final[dict[str, Any]] = {"facecolor": "white", "edgecolor": "#d8d9da", "lw": 0.8}
LEGEND: Final[dict[str, Any]] = {
    "fontsize": 6.5,
    "frameon": False,
    "handlelength": 1.2,
    "borderaxespad": 0,
    "columnspacing": 1.2,
    "labelspacing": 0.25,
}
#: values a stat panel writes at most
STAT_LINES: Final = 3
BYTE_UNITS: Final = ("bytes", "decbytes", "Bps", "binBps")
#: time ticks: the first spacing (seconds) that gives at most 8
TICKS_S: Final = (15, 30, 60, 120, 300, 600, 1800, 3600)

Curve = tuple[str, list[float], list[float], Override | None]


def clock(x: float, _pos: object = None) -> str:
    """Seconds as m:ss (-m:ss before 0)."""
    s = round(abs(x))
    return f"{'-' if x < 0 and s else ''}{s // 60}:{s % 60:02d}"


def _points(series: prometheus.Series, window: Window) -> tuple[list[float], list[float]]:
    """Seconds from the window's zero and values, with NaN where the series has a gap."""
    xs: list[float] = []
    ys: list[float] = []
    for t, v in series.points:
        if xs and t - window.zero - xs[-1] > 1.5 * window.step:
            xs.append(xs[-1] + window.step)
            ys.append(math.nan)
        xs.append(t - window.zero)
        ys.append(v)
    return xs, ys


def curves(p: Panel, got: Sequence[Answer], window: Window) -> list[Curve]:
    """Every series of ``got`` that has a value, named by its query's legend format."""
    out: list[Curve] = []
    for a in got:
        named = [(legend_text(a.target.legend, s.labels), s) for s in a.series]
        named.sort(key=lambda n: natural_key(n[0]))
        for name, s in named:
            if any(math.isfinite(v) for _, v in s.points):
                override = next((o for o in p.overrides if o.matches(name)), None)
                out.append((name, *_points(s, window), override))
    return out


def _colour(p: Panel, v: float) -> str:
    """The colour of the last threshold step ``v`` reaches."""
    colour = "green"
    for value, c in p.thresholds:
        if value is None or v >= value:
            colour = c
    return COLOURS.get(colour, colour)


def _xlim(window: Window) -> tuple[float, float]:
    return window.start - window.zero, window.end - window.zero


def _style(ax: Axes, unit: str, window: Window, minimum: float | None) -> None:
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: format_value(v, unit)))
    ax.yaxis.set_major_locator(MaxNLocator(4))
    if minimum is not None:
        ax.set_ylim(bottom=minimum)
    span = window.end - window.start
    ax.xaxis.set_major_locator(MultipleLocator(next((s for s in TICKS_S if span / s <= 8), 7200)))
    ax.xaxis.set_major_formatter(FuncFormatter(clock))
    ax.set_xlim(*_xlim(window))
    ax.tick_params(labelsize=6.5, length=2, pad=1.5, colors="#464c54")
    ax.spines[["top", "right"]].set_visible(False)
    ax.grid(True, color="#e4e6e8", lw=0.5)


class Canvas:
    """A figure measured in inches from its top left corner."""

    def __init__(self, height: float, dpi: int) -> None:
        self.height = height
        self.fig = Figure(figsize=(WIDTH, height), dpi=dpi, facecolor="#f4f5f5")

    def rect(
        self, left: float, top: float, w: float, h: float
    ) -> tuple[float, float, float, float]:
        return (left / WIDTH, 1 - (top + h) / self.height, w / WIDTH, h / self.height)

    def text(self, left: float, top: float, text: str, size: float, **kw: Any) -> None:
        self.fig.text(left / WIDTH, 1 - top / self.height, text, fontsize=size, **kw)

    def axes(self, left: float, top: float, w: float, h: float) -> Axes:
        return self.fig.add_axes(self.rect(left, top, w, h))


def _last(ys: Sequence[float]) -> float:
    return next((v for v in reversed(ys) if math.isfinite(v)), math.nan)


def _stat(
    c: Canvas, p: Panel, found: list[Curve], box: tuple[float, float, float, float], window: Window
) -> None:
    """The last value of each series (at most :data:`STAT_LINES`, named when more than one)
    over their sparklines."""
    left, top, w, h = box
    shown = found[:STAT_LINES]
    size, line = (18, 0.32) if len(shown) == 1 else (8, 0.16)
    for i, (name, _, ys, _) in enumerate(shown):
        value = format_value(_last(ys), p.unit, p.decimals)
        text = value if len(found) == 1 else f"{name}: {value}"
        colour = _colour(p, _last(ys))
        at = (left + w / 2, top + 0.36 + i * line)
        c.text(*at, text, size, weight="bold", ha="center", va="top", color=colour)
    spark = 0.42 + len(shown) * line
    ax = c.axes(left + 0.05, top + spark, w - 0.1, max(0.15, h - spark - 0.05))
    ax.set_axis_off()
    for _, xs, ys, _ in found:
        ax.fill_between(xs, ys, alpha=0.15, color=_colour(p, _last(ys)), lw=0)
        ax.plot(xs, ys, lw=0.8, color=_colour(p, _last(ys)))
    ax.set_xlim(*_xlim(window))


def _binary_ticks(ax: Axes, unit: str) -> None:
    """Ticks at round numbers of B, KiB, MiB, ... on an axis in bytes (whole bytes at least)."""
    if unit not in BYTE_UNITS:
        return
    low, high = ax.get_ylim()
    base = 1024.0 ** int(math.log(max(abs(low), abs(high), 1.0), 1024))
    scaled = MaxNLocator(4, steps=[1, 2, 5, 10], integer=base == 1).tick_values(
        low / base, high / base
    )
    ticks = [t * base for t in scaled if low <= t * base <= high]
    ax.yaxis.set_major_locator(FixedLocator(ticks))


def _thresholds(ax: Axes, p: Panel) -> None:
    """Dashed lines and light bands at the thresholds within the axis (which stays as it is)."""
    low, high = ax.get_ylim()
    values = sorted(v for v, _ in p.thresholds if v is not None)
    for v, c in p.thresholds:
        if v is not None and v < high:
            upper = min([s for s in values if s > v] + [high])
            ax.axhspan(v, upper, color=COLOURS.get(c, c), alpha=0.08, lw=0)
            ax.axhline(v, color=COLOURS.get(c, c), lw=0.8, ls="--")
    ax.set_ylim(low, high)


def _series(
    c: Canvas, p: Panel, found: list[Curve], box: tuple[float, float, float, float], window: Window
) -> None:
    left, top, w, h = box
    right = any(o is not None and o.right for *_, o in found)
    column = 0.45 + 0.052 * max(len(name[:48]) for name, *_ in found)
    ncol = max(1, min(len(found), int((w - 0.3) / column)))
    legend = math.ceil(len(found) / ncol) * LEGEND_ROW + 0.05
    pad_left, pad_right, pad_top, pad_bottom = 0.62, 0.62 if right else 0.15, 0.32, 0.2 + legend
    plot_h = h - pad_top - pad_bottom
    ax = c.axes(left + pad_left, top + pad_top, w - pad_left - pad_right, plot_h)
    twin = ax.twinx() if right else None
    handles = []
    for i, (name, xs, ys, o) in enumerate(found):
        where = twin if twin is not None and o is not None and o.right else ax
        colour = PALETTE[i % len(PALETTE)]
        (line,) = where.plot(xs, ys, lw=1.0, color=colour, label=name[:48])
        where.fill_between(xs, ys, alpha=0.06, color=colour, lw=0)
        handles.append(line)
    _style(ax, p.unit, window, p.minimum)
    if twin is not None:
        unit = next((o.unit for *_, o in found if o is not None and o.right and o.unit), p.unit)
        _style(twin, unit, window, p.minimum)
        twin.spines["right"].set_visible(True)
        twin.grid(False)
    if p.threshold_lines:
        _thresholds(ax, p)
    _binary_ticks(ax, p.unit)
    if twin is not None:
        _binary_ticks(twin, unit)
    under = (0, -0.2 / plot_h)
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=under, ncol=ncol, **LEGEND)


def _state(v: float, p: Panel) -> tuple[str, str]:
    """(colour, text) of a state timeline's value: its mapping, else its threshold step."""
    for value, colour, text in p.mappings:
        if value == v:
            return COLOURS.get(colour, colour), text
    return _colour(p, v), format_value(v, p.unit, p.decimals)


def _states(
    c: Canvas, p: Panel, found: list[Curve], box: tuple[float, float, float, float], window: Window
) -> None:
    """A row per series: a bar per run of one value, in its mapping's colour and text."""
    left, top, w, h = box
    span = window.end - window.start
    pad_left = min(2.2, 0.2 + 0.055 * max(len(name) for name, *_ in found))
    ax = c.axes(left + pad_left, top + 0.32, w - pad_left - 0.15, h - 0.32 - 0.25)
    for row, (_, xs, ys, _) in enumerate(found):
        runs: list[tuple[float, float, float]] = []  # start, end, value
        for x, v in zip(xs, ys, strict=True):
            if runs and runs[-1][2] == v:
                runs[-1] = (runs[-1][0], x, v)
            elif math.isfinite(v):
                runs.append((x, x, v))
        for i, (start, _, v) in enumerate(runs):
            end = runs[i + 1][0] if i + 1 < len(runs) else runs[i][1]
            colour, text = _state(v, p)
            ax.broken_barh(
                [(start, max(end - start, 1.0))], (row - 0.4, 0.8), color=colour, alpha=0.8
            )
            if end - start > span / 12:
                ax.text(start + span / 100, row, text, fontsize=6.5, va="center", color="white")
    ax.set_ylim(len(found) - 0.5, -0.5)
    _style(ax, "short", window, None)
    ax.yaxis.set_major_locator(MultipleLocator(1))
    ax.yaxis.set_major_formatter(
        FuncFormatter(lambda v, _: found[int(v)][0][:40] if 0 <= v < len(found) else "")
    )
    ax.grid(False)


def draw_panel(c: Canvas, p: Panel, got: Sequence[Answer], window: Window) -> None:
    col = (WIDTH - 2 * MARGIN) / 24
    left, top = MARGIN + p.x * col + 0.04, HEAD + p.y * ROW + 0.04
    w, h = p.w * col - 0.08, p.h * ROW - 0.08
    x, y, fw, fh = c.rect(left, top, w, h)
    card = Rectangle((x, y), fw, fh, transform=c.fig.transFigure, zorder=-1, **CARD)
    c.fig.add_artist(card)
    c.text(left + 0.08, top + 0.06, p.title, 8, weight="bold", va="top", color="#24292e")
    found = curves(p, got, window)
    if not found:
        c.text(left + w / 2, top + h / 2, "No data", 10, color="#8e8e8e", ha="center", va="center")
    elif p.kind == "stat":
        _stat(c, p, found, (left, top, w, h), window)
    elif p.kind == "state-timeline":
        _states(c, p, found, (left, top, w, h), window)
    else:
        _series(c, p, found, (left, top, w, h), window)


def draw(
    board: Dashboard,
    answers: Mapping[int, Sequence[Answer]],
    window: Window,
    subtitle: str,
    path: Path,
    dpi: int = 80,
) -> Path:
    """One picture of ``board`` at ``path``: its panels at their places in the grid."""
    rows = max(p.y + p.h for p in board.panels)
    c = Canvas(HEAD + rows * ROW + MARGIN, dpi)
    c.text(MARGIN, 0.12, board.title, 13, weight="bold", va="top", color="#24292e")
    c.text(MARGIN, 0.42, subtitle, 8, va="top", color="#464c54")
    for p in board.panels:
        draw_panel(c, p, answers.get(p.id, []), window)
    c.fig.savefig(path, dpi=dpi, facecolor=c.fig.get_facecolor())
    with Image.open(path) as img:
        full = img.convert("RGB")
    for colours in (256, 128, 64):  # fewer colours while it is too large
        full.quantize(colours, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)
        if path.stat().st_size <= MAX_BYTES:
            break
    return path
