"""The treemap as a picture that needs no script and no network: inline SVG.

A saved notebook is often read where no JavaScript runs (GitHub, nbviewer, an untrusted
notebook, a machine offline), and there a plotly figure is blank. So bigviz draws the same
treemap itself: a squarified layout (d3's algorithm, the one plotly uses, in the order given,
as plotly's ``sort=False``) of the figure's own ``ids``/``parents``/``values``, with its tile
colours, labels, borders and ``maxdepth``, written as plain SVG with a title and a legend.
Each tile carries a ``<title>`` (name, size, share, device): a hover tooltip wherever the
SVG is inline.

It reads any plotly treemap (``figure_svg``) or plain sequences (``treemap_svg``); nothing
here imports plotly.

Example:
    >>> svg = treemap_svg(["/", "/a", "/b"], ["", "/", "/"], [3, 2, 1], ["model", "a", "b"],
    ...                   ["#E8E8E8", "#0072B2", "#F0E442"], width=300, height=200)
    >>> svg.startswith("<svg") and svg.count("<rect class='tile'") == 3
    True
"""

from __future__ import annotations

import base64
import html
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["squarify", "treemap_svg", "figure_svg", "legend_of", "svg_img", "SVG_WIDTH"]

SVG_WIDTH = 960
FONT = "system-ui,-apple-system,'Segoe UI',Roboto,'Helvetica Neue',Arial,sans-serif"
FONT_SIZE = 11.0
CHAR_WIDTH = 0.62  # an average sans-serif glyph is narrower than this share of the font size
HEADER = 15.0  # band at the top of a tile whose children are drawn: the parent's label
PAD = 2.0  # gap between a parent's edge and its children
MIN_SIDE = 0.5  # tiles thinner than half a pixel are not drawn (plotly does not show them either)

Rect = tuple[float, float, float, float]  # x, y, width, height


def squarify(values: Sequence[float], rect: Rect, *, total: float | None = None, ratio: float = 1.0) -> list[Rect]:
    """Tile ``rect`` with one rectangle per value, areas proportional, close to square.

    d3's ``treemapSquarify`` (Bruls, Huizing and van Wijk), which plotly's treemap uses with
    ``ratio`` 1: values are taken in the order given, laid in rows along the shorter side,
    a row growing while its worst aspect ratio improves. With ``total`` above the sum of the
    values (a parent with bytes of its own), the rest of ``rect`` stays empty.

    Example:
        >>> [tuple(round(v) for v in r) for r in squarify([2, 1, 1], (0, 0, 4, 2))]
        [(0, 0, 2, 2), (2, 0, 2, 1), (2, 1, 2, 1)]
    """
    x0, y0, w, h = rect
    x1, y1 = x0 + w, y0 + h
    value = float(total if total is not None else sum(values))
    out: list[Rect] = []
    i0, n = 0, len(values)
    while i0 < n:
        dx, dy = x1 - x0, y1 - y0
        i1 = i0 + 1
        row_sum = min_v = max_v = float(values[i0])
        alpha = max(dy / dx, dx / dy) / (value * ratio) if dx > 0 and dy > 0 and value > 0 else 0.0
        beta = row_sum * row_sum * alpha
        worst = max(max_v / beta, beta / min_v) if beta > 0 and min_v > 0 else float("inf")
        while i1 < n:  # grow the row while its worst aspect ratio does not get worse
            v = float(values[i1])
            s, lo, hi = row_sum + v, min(min_v, v), max(max_v, v)
            beta = s * s * alpha
            new = max(hi / beta, beta / lo) if beta > 0 and lo > 0 else float("inf")
            if new > worst:
                break
            row_sum, min_v, max_v, worst, i1 = s, lo, hi, new, i1 + 1
        share = row_sum / value if value > 0 else 0.0
        if dx < dy:  # a row across the top, children side by side
            bottom = y0 + dy * share if value else y1
            out.extend(_split(values[i0:i1], (x0, y0, dx, bottom - y0), across=True))
            y0 = bottom
        else:  # a column on the left, children stacked
            right = x0 + dx * share if value else x1
            out.extend(_split(values[i0:i1], (x0, y0, right - x0, dy), across=False))
            x0 = right
        value -= row_sum
        i0 = i1
    return out


def _split(values: Sequence[float], rect: Rect, *, across: bool) -> Iterator[Rect]:
    """One row of ``squarify``: ``rect`` cut side by side (``across``) or stacked."""
    x, y, w, h = rect
    total = float(sum(values)) or 1.0
    for v in values:
        if across:
            step = w * v / total
            yield (x, y, step, h)
            x += step
        else:
            step = h * v / total
            yield (x, y, w, step)
            y += step


@dataclass(frozen=True)
class _Tree:
    """The treemap's nodes, indexed: children in the order given, depth from the root."""

    children: dict[int, list[int]]
    depth: list[int]
    roots: list[int]

    @classmethod
    def build(cls, ids: Sequence[str], parents: Sequence[str]) -> _Tree:
        index = {node: i for i, node in enumerate(ids)}
        children: dict[int, list[int]] = {}
        roots: list[int] = []
        for i, p in enumerate(parents):
            if p in index:
                children.setdefault(index[p], []).append(i)
            else:
                roots.append(i)
        depth = [0] * len(ids)
        stack = list(roots)
        while stack:  # ids may list a child before its parent: walk from the roots
            i = stack.pop()
            for c in children.get(i, ()):
                depth[c] = depth[i] + 1
                stack.append(c)
        return cls(children, depth, roots)


def _ink(color: str) -> str:
    """Black or white text, whichever reads better on ``color`` (``#RRGGBB``)."""
    try:
        r, g, b = (int(color[i : i + 2], 16) / 255 for i in (1, 3, 5))
    except ValueError:
        return "#000000"
    lin = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in (r, g, b)]
    luminance = 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]
    return "#000000" if luminance > 0.18 else "#FFFFFF"


def _fit(text: str, width: float, size: float = FONT_SIZE) -> str:
    """``text`` cut (with an ellipsis) to fit ``width`` pixels, or "" when too little fits."""
    room = int(width / (size * CHAR_WIDTH))
    if len(text) <= room:
        return text
    return text[: room - 1] + "\u2026" if room >= 4 else ""


def _n(x: float) -> str:
    return f"{x:.1f}".rstrip("0").rstrip(".")


@dataclass(frozen=True)
class _Style:
    labels: Sequence[str]
    colors: Sequence[str]
    sizes: Sequence[str]
    tips: Sequence[str]
    line_widths: Sequence[float]
    line_colors: Sequence[str]


def _tile(i: int, rect: Rect, style: _Style, *, header: bool) -> str:
    """One node: its rectangle, its label (and size), and a tooltip."""
    x, y, w, h = rect
    color = style.colors[i]
    width = style.line_widths[i]
    border = (
        ""
        if (style.line_colors[i], width) == (style.line_colors[0], style.line_widths[0])
        else f" stroke='{style.line_colors[i]}' stroke-width='{_n(width)}'"
    )  # the root's border is set once, on <g>
    parts = [
        f"<g><title>{html.escape(style.tips[i])}</title>"
        f"<rect class='tile' x='{_n(x)}' y='{_n(y)}' width='{_n(w)}' height='{_n(h)}' fill='{color}'{border}/>"
    ]
    ink = _ink(color)
    label = _fit(style.labels[i], w - 6)
    if label and h >= FONT_SIZE + 4:
        weight = " font-weight='600'" if header else ""
        # stroke='none': text must not take the tile border set on the enclosing <g>
        parts.append(
            f"<text x='{_n(x + 3)}' y='{_n(y + FONT_SIZE + 1)}' fill='{ink}' stroke='none'{weight}>"
            f"{html.escape(label)}</text>"
        )
        size = style.sizes[i] if not header else ""
        if size and _fit(size, w - 6) == size and h >= 2 * FONT_SIZE + 8:  # a number is never cut
            parts.append(
                f"<text x='{_n(x + 3)}' y='{_n(y + 2 * FONT_SIZE + 4)}' fill='{ink}' stroke='none' "
                f"fill-opacity='0.85'>{html.escape(size)}</text>"
            )
    parts.append("</g>")
    return "".join(parts)


def _tiles(tree: _Tree, values: Sequence[float], style: _Style, area: Rect, maxdepth: int) -> list[str]:
    """Every drawn tile, parents before their children (so children paint on top)."""
    out: list[str] = []
    queue: list[tuple[int, Rect]] = list(zip(tree.roots, squarify([values[r] for r in tree.roots], area)))
    while queue:
        i, rect = queue.pop(0)
        x, y, w, h = rect
        if w < MIN_SIDE or h < MIN_SIDE:
            continue
        kids = [c for c in tree.children.get(i, ()) if values[c] > 0]
        deeper = maxdepth < 1 or tree.depth[i] + 1 < maxdepth
        inner = (x + PAD, y + HEADER, w - 2 * PAD, h - HEADER - PAD)
        show_kids = bool(kids) and deeper and inner[2] >= 4 and inner[3] >= 4
        out.append(_tile(i, rect, style, header=show_kids))
        if show_kids:
            rects = squarify([values[c] for c in kids], inner, total=max(values[i], sum(values[c] for c in kids)))
            queue.extend(zip(kids, rects))
    return out


def legend_of(devices: Sequence[str], colors: Sequence[str]) -> list[tuple[str, str]]:
    """``(label, colour)`` pairs, once each, in first-seen order (a legend from tiles)."""
    seen: dict[tuple[str, str], None] = {}
    for device, color in zip(devices, colors):
        seen.setdefault((device, color), None)
    return list(seen)


def _legend(entries: Sequence[tuple[str, str]], top: float, width: float) -> tuple[list[str], float]:
    """Chips in rows from the left; returns the SVG and the height used."""
    out: list[str] = []
    x, y, chip_h = 6.0, top, FONT_SIZE + 7
    for label, color in entries:
        w = len(label) * FONT_SIZE * CHAR_WIDTH + 12
        if x + w > width - 6 and x > 6:
            x, y = 6.0, y + chip_h + 4
        out.append(
            f"<rect x='{_n(x)}' y='{_n(y)}' width='{_n(w)}' height='{_n(chip_h)}' rx='3' fill='{color}'/>"
            f"<text x='{_n(x + 6)}' y='{_n(y + FONT_SIZE + 2)}' fill='{_ink(color)}'>{html.escape(label)}</text>"
        )
        x += w + 4
    return out, (y + chip_h + 6 - top) if entries else 0.0


def treemap_svg(
    ids: Sequence[str],
    parents: Sequence[str],
    values: Sequence[float],
    labels: Sequence[str],
    colors: Sequence[str],
    *,
    sizes: Sequence[str] | None = None,
    tips: Sequence[str] | None = None,
    line_widths: Sequence[float] | None = None,
    line_colors: Sequence[str] | None = None,
    maxdepth: int = -1,
    title: str = "",
    legend: Sequence[tuple[str, str]] = (),
    width: int = SVG_WIDTH,
    height: int = 560,
) -> str:
    """A treemap drawn as a standalone SVG document (no script, no external resource).

    Args:
        ids, parents, values, labels, colors: one entry per node, as a plotly treemap takes
            them (``branchvalues="total"``: a parent's value covers its children).
        sizes: a second text line per tile (e.g. ``"9.0 MiB"``); tips: the tooltip per tile.
        line_widths, line_colors: tile borders (a thick black border marks an override).
        maxdepth: levels drawn counting the root, as plotly's ``maxdepth`` (-1: all).
        title: drawn at the top; legend: ``(label, colour)`` chips under it.
        width, height: the picture's size in pixels.

    Example:
        >>> svg = treemap_svg(["r", "a"], ["", "r"], [1, 1], ["root", "a"], ["#E8E8E8", "#000000"],
        ...                   title="A & B", width=200, height=100)
        >>> "A &amp; B" in svg and "fill='#FFFFFF' stroke='none'>a</text>" in svg  # white text on black
        True
    """
    n = len(ids)
    style = _Style(
        labels, colors, sizes or [""] * n, tips or labels, line_widths or [1.0] * n, line_colors or ["#FFFFFF"] * n
    )
    head: list[str] = []
    top = 4.0
    if title:
        head.append(f"<text x='6' y='20' font-size='15'>{html.escape(title)}</text>")
        top = 28.0
    chips, used = _legend(legend, top, width)
    area = (4.0, top + used, width - 8.0, height - top - used - 4.0)
    body = _tiles(_Tree.build(ids, parents), values, style, area, maxdepth) if n else []
    return (
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
        f"viewBox='0 0 {width} {height}' font-family=\"{FONT}\" font-size='{_n(FONT_SIZE)}' "
        f"role='img' aria-label='{html.escape(title or 'treemap')}' style='max-width:100%;height:auto'>"
        f"<rect width='{width}' height='{height}' fill='#FFFFFF'/>{''.join(head)}{''.join(chips)}"
        f"<g stroke='{style.line_colors[0] if n else '#FFFFFF'}' "
        f"stroke-width='{_n(style.line_widths[0]) if n else 1}'>{''.join(body)}</g></svg>"
    )


def _column(customdata: Sequence[Sequence[Any]] | None, k: int, n: int) -> list[str]:
    if not customdata:
        return [""] * n
    return [str(row[k]) if row is not None and len(row) > k else "" for row in customdata]


def figure_svg(fig: Any, *, width: int = SVG_WIDTH) -> str:
    """The SVG of a plotly figure whose first trace is a treemap (as ``bigviz.treemap``
    makes it: ``customdata`` = name, size, share, device, reason).

    Reads the figure as it is now, so later changes (colours, ``maxdepth``) show.

    Example:
        >>> import torch.nn as nn, bigviz
        >>> fig = bigviz.treemap(bigviz.plan(nn.Sequential(nn.Linear(8, 8)), {"cpu": "1MB"}))
        >>> svg = figure_svg(fig)
        >>> "<script" in svg, ">CPU</text>" in svg  # the legend names the device
        (False, True)
    """
    trace = fig.data[0]
    ids = list(trace.ids or ())
    n = len(ids)
    colors = list(trace.marker.colors or ["#E8E8E8"] * n)
    names, sizes = _column(trace.customdata, 0, n), _column(trace.customdata, 1, n)
    shares, devices = _column(trace.customdata, 2, n), _column(trace.customdata, 3, n)
    tips = [
        f"{name or ids[i]}: {size} ({share}), {device}" if size else (name or ids[i])
        for i, (name, size, share, device) in enumerate(zip(names, sizes, shares, devices))
    ]
    line = trace.marker.line
    line_colors = list(line.color) if isinstance(line.color, (list, tuple)) else [line.color or "#FFFFFF"] * n
    if isinstance(line.width, (list, tuple)):
        widths = list(line.width)
    else:  # one width for all: a border in another colour than white (an override) drawn thicker
        base = float(line.width if line.width is not None else 1.0)
        widths = [base if c.upper() == "#FFFFFF" else max(3.0, base) for c in line_colors]
    keyed = [(d, c) for d, c in zip(devices, colors) if d]
    legend = legend_of([d for d, _ in keyed], [c for _, c in keyed])
    height = int(fig.layout.height or 560)
    title = fig.layout.title.text or ""
    return treemap_svg(
        ids,
        list(trace.parents),
        list(trace.values),
        list(trace.labels or ids),
        colors,
        sizes=sizes,
        tips=tips,
        line_widths=widths,
        line_colors=line_colors,
        maxdepth=int(trace.maxdepth if trace.maxdepth is not None else -1),
        title=title,
        legend=_ordered(legend),
        width=width,
        height=height,
    )


def _ordered(legend: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The legend in fill order (GPUs by index, MPS, CPU, disk), other labels after them
    in the order seen, modules split across devices last."""
    rank = {"MPS": 1, "CPU": 2, "disk": 3, "split": 5}

    def key(entry: tuple[str, str]) -> tuple[int, int]:
        label = entry[0]
        if label.startswith("GPU ") and label[4:].isdigit():
            return (0, int(label[4:]))
        return (rank.get(label, 4), 0)

    return sorted(legend, key=key)  # stable: equal keys keep the order seen


def svg_img(svg: str, *, alt: str = "treemap") -> str:
    """An ``<img>`` tag holding ``svg`` as a data URI.

    HTML sanitizers (JupyterLab's for untrusted notebooks, GitHub's) drop inline ``<svg>``
    elements but keep an image with a ``data:`` source, so notebook HTML uses this form.

    Example:
        >>> svg_img("<svg xmlns='http://www.w3.org/2000/svg'/>", alt="a & b")[:54]
        "<img alt='a &amp; b' src='data:image/svg+xml;base64,PH"
    """
    data = base64.b64encode(svg.encode("utf-8")).decode("ascii")
    return f"<img alt='{html.escape(alt)}' src='data:image/svg+xml;base64,{data}' style='max-width:100%;height:auto'/>"
