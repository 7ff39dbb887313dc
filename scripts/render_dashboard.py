#!/usr/bin/env python
"""Render the Grafana dashboard's panels to a PNG without Grafana.

Reads a dashboard JSON (default ``docker/grafana/dashboards/mcsd.json``), runs every panel's PromQL
against a Prometheus HTTP API (``/api/v1/query_range``) over a time window, and draws the panels on
Grafana's 24-column grid with matplotlib: time series (stacking, units, max, legend format) and stat
panels (last value, threshold colour, sparkline). Grafana's variables are substituted:
``$__rate_interval`` / ``$__interval`` by ``--rate-interval`` / the step, ``$__range`` by the window,
template variables by ``--var name=value`` or their "All" value.

    python scripts/render_dashboard.py --prometheus http://127.0.0.1:9090 --minutes 5 \\
        --rate-interval 30s --out docs/dashboard.png

Needs matplotlib (``pip install matplotlib``); not a dependency of the server.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import re
import sys
import time
import urllib.parse
import urllib.request
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DASHBOARD = ROOT / "docker" / "grafana" / "dashboards" / "mcsd.json"

# Grafana's dark theme and "classic" palette.
BG, PANEL_BG, GRID, TEXT, MUTED = "#111217", "#181b1f", "#2c3235", "#ccccdc", "#8e8e8e"
PALETTE = ["#73BF69", "#F2CC0C", "#8AB8FF", "#FF780A", "#F2495C", "#5794F2", "#B877D9", "#705DA0",
           "#37872D", "#FADE2A", "#447EBC", "#C15C17", "#890F02", "#0A437C", "#6D1F62", "#584477"]
COLORS = {"green": "#73BF69", "red": "#F2495C", "orange": "#FF9830", "yellow": "#FADE2A", "blue": "#5794F2",
          "purple": "#B877D9", "text": TEXT}


# ---------------------------------------------------------------- dashboard and Prometheus
def panels_of(dash: dict) -> list[dict]:
    out = []
    for panel in dash["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def duration(text: str) -> float:
    """Seconds of a Prometheus duration (``30s``, ``1m``, ``1h30m``)."""
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w|y)", text)
    if not parts or "".join(a + b for a, b in parts) != text:
        raise ValueError(f"not a duration: {text!r}")
    return sum(float(n) * units[u] for n, u in parts)


def substitute(expr: str, values: dict[str, str]) -> str:
    """Grafana's ``$name`` / ``${name}`` / ``${name:fmt}`` replaced by ``values[name]``."""
    def repl(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        if name not in values:
            raise KeyError(f"no value for ${name} in {expr!r} (give --var {name}=...)")
        return values[name]
    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", repl, expr)


def query_range(url: str, expr: str, start: float, end: float, step: float) -> list[dict]:
    qs = urllib.parse.urlencode({"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"})
    with urllib.request.urlopen(f"{url.rstrip('/')}/api/v1/query_range?{qs}", timeout=30) as resp:
        body = json.load(resp)
    if body.get("status") != "success":
        raise RuntimeError(f"{expr}: {body.get('error')}")
    return body["data"]["result"]


def legend(fmt: str, labels: dict[str, str], expr: str) -> str:
    if fmt:
        return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt).strip()
    shown = {k: v for k, v in labels.items() if k != "__name__"}
    name = labels.get("__name__", "")
    return name + ("{" + ", ".join(f'{k}="{v}"' for k, v in shown.items()) + "}" if shown else "") or expr


def series(result: list[dict], fmt: str, expr: str) -> list[tuple[str, list[float], list[float]]]:
    out = []
    for item in result:
        ts = [float(t) for t, _ in item["values"]]
        vs = [float(v) if v not in ("NaN", "+Inf", "-Inf") else math.nan for _, v in item["values"]]
        out.append((legend(fmt, item["metric"], expr), ts, vs))
    return sorted(out, key=lambda s: s[0])


# ---------------------------------------------------------------- units
def _si(v: float) -> str:
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(v) >= div:
            return f"{v / div:.3g}{suffix}"
    return f"{v:.3g}"


def fmt_value(v: float, unit: str, decimals: int | None = None) -> str:
    if v is None or math.isnan(v):
        return "No data"
    d = decimals
    if unit == "percentunit":
        return f"{v * 100:.{1 if d is None else d}f}%"
    if unit == "s":
        if v == 0:
            return "0 s"
        if abs(v) < 1e-3:
            return f"{v * 1e6:.3g} µs"
        if abs(v) < 1:
            return f"{v * 1e3:.3g} ms"
        return f"{v:.3g} s"
    if unit == "reqps":
        return f"{v:.{2 if d is None else d}f} req/s"
    if unit.startswith("suffix:"):
        num = _si(v) if d is None else f"{v:.{d}f}"
        return f"{num}{unit[len('suffix:'):]}"
    if d is not None:
        return f"{v:.{d}f}"
    return _si(v)


# ---------------------------------------------------------------- drawing
def _style_axes(ax) -> None:
    ax.set_facecolor(PANEL_BG)
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.tick_params(colors=MUTED, labelsize=7, length=0)
    ax.grid(True, color=GRID, linewidth=0.6)


def legend_columns(n: int, width_px: float) -> int:
    return max(1, min(n, int(width_px // 82)))


def draw_timeseries(ax, frame, panel: dict, data: list, window: tuple[float, float], width_px: float) -> None:
    import matplotlib.dates as mdates
    import numpy as np
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    defaults = panel.get("fieldConfig", {}).get("defaults", {})
    custom = defaults.get("custom", {})
    unit = defaults.get("unit", "short")
    stacked = custom.get("stacking", {}).get("mode", "none") != "none"
    alpha = custom.get("fillOpacity", 0) / 100
    _style_axes(ax)
    to_dt = lambda ts: [datetime.fromtimestamp(t) for t in ts]  # noqa: E731
    base = None
    drawn, lowest = 0, math.inf
    for i, (name, ts, vs) in enumerate(data):
        color = PALETTE[i % len(PALETTE)]
        x, y = to_dt(ts), np.array(vs, dtype=float)
        if stacked:
            grid = np.array(ts)
            if base is None:
                base_ts, base = grid, np.zeros_like(y)
            y = np.nan_to_num(y) + np.interp(grid, base_ts, base)
            ax.fill_between(x, np.interp(grid, base_ts, base), y, color=color, alpha=max(alpha, 0.1), linewidth=0)
            base_ts, base = grid, y
        elif alpha:
            ax.fill_between(x, 0, y, color=color, alpha=alpha, linewidth=0)
        ax.plot(x, y, color=color, linewidth=1.4, label=name)
        if np.isfinite(y).any():
            drawn, lowest = drawn + 1, min(lowest, float(np.nanmin(y)))
    ax.set_xlim(datetime.fromtimestamp(window[0]), datetime.fromtimestamp(window[1]))
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M" if window[1] - window[0] > 900 else "%H:%M:%S"))
    ax.xaxis.set_major_locator(mdates.AutoDateLocator(minticks=3, maxticks=5))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: fmt_value(v, unit)))
    ax.yaxis.set_major_locator(MaxNLocator(4))
    lo, hi = ax.get_ylim()
    if custom.get("axisSoftMin") == 0 and lowest >= 0:  # soft min 0: the axis starts at 0 unless data is below
        lo = 0
    if "max" in defaults and hi > defaults["max"]:
        hi = defaults["max"]
    if drawn:
        ax.set_ylim(lo, hi if hi > lo else lo + 1)
        ax.legend(loc="lower left", bbox_to_anchor=(0.0, 0.0), bbox_transform=frame.transAxes,
                  borderaxespad=0.3, ncol=legend_columns(len(data), width_px), fontsize=6.5, frameon=False,
                  labelcolor=TEXT, handlelength=1.2, columnspacing=1.0)
    else:
        ax.text(0.5, 0.5, "No data", transform=ax.transAxes, ha="center", va="center", color=MUTED, fontsize=10)


def draw_stat(ax, panel: dict, data: list) -> None:
    import numpy as np

    defaults = panel.get("fieldConfig", {}).get("defaults", {})
    unit, decimals = defaults.get("unit", "short"), defaults.get("decimals")
    ax.set_facecolor(PANEL_BG)
    ax.set_xticks([]), ax.set_yticks([])
    for spine in ax.spines.values():
        spine.set_visible(False)
    value, color = math.nan, MUTED
    if data:
        _, ts, vs = data[0]
        finite = [v for v in vs if not math.isnan(v)]
        if finite:
            value = finite[-1]
            steps = defaults.get("thresholds", {}).get("steps", [{"color": "green", "value": None}])
            for step in steps:
                if step["value"] is None or value >= step["value"]:
                    color = COLORS.get(step["color"], step["color"])
            y = np.array(vs, dtype=float)
            if np.isfinite(y).sum() > 1 and panel.get("options", {}).get("graphMode") == "area":
                lo, hi = np.nanmin(y), np.nanmax(y)
                ax.fill_between(ts, lo - (hi - lo or 1) * 0.1, y, color=color, alpha=0.18, linewidth=0)
                ax.plot(ts, y, color=color, linewidth=1, alpha=0.6)
                ax.set_xlim(ts[0], ts[-1])
                ax.set_ylim(lo - (hi - lo or 1) * 0.1, hi + (hi - lo or 1) * 1.2)
    ax.text(0.5, 0.45, fmt_value(value, unit, decimals), transform=ax.transAxes, ha="center", va="center",
            color=color, fontsize=17, fontweight="bold")


def render(dash: dict, results: dict[int, list], window: tuple[float, float], out: Path, width_px: int,
           dpi: int, subtitle: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unit_px = 30  # Grafana's grid row height
    header_px = 56
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels_of(dash))
    height_px = header_px + rows * unit_px + 10
    fig = plt.figure(figsize=(width_px / dpi, height_px / dpi), dpi=dpi, facecolor=BG)
    W, H = width_px, height_px
    fig.text(12 / W, 1 - 20 / H, dash["title"], color=TEXT, fontsize=14, fontweight="bold", va="center")
    fig.text(12 / W, 1 - 42 / H, subtitle, color=MUTED, fontsize=8, va="center")
    col = (W - 16) / 24
    gap = 6
    for panel in panels_of(dash):
        g = panel["gridPos"]
        x0, y0 = 8 + g["x"] * col, header_px + g["y"] * unit_px
        w, h = g["w"] * col, g["h"] * unit_px
        if panel["type"] == "row":
            fig.text((x0 + 4) / W, 1 - (y0 + h / 2 + 4) / H, panel["title"], color=TEXT, fontsize=10.5,
                     fontweight="bold", va="center")
            continue
        frame = fig.add_axes([(x0 + gap / 2) / W, 1 - (y0 + h - gap / 2) / H, (w - gap) / W, (h - gap) / H])
        frame.set_facecolor(PANEL_BG)
        frame.set_xticks([]), frame.set_yticks([])
        for spine in frame.spines.values():
            spine.set_color(GRID)
        frame.text(8 / (w - gap), 1 - 12 / (h - gap), panel["title"], transform=frame.transAxes, color=TEXT,
                   fontsize=8.5, fontweight="bold", va="center")
        data = results.get(panel["id"], [])
        title_px, legend_px = 24, 4
        left_px, right_px = (58, 22) if panel["type"] == "timeseries" else (6, 6)
        if panel["type"] == "timeseries":  # tick labels, then one legend line per row of entries
            legend_px = 24 + 13 * math.ceil(max(len(data), 1) / legend_columns(max(len(data), 1), w - gap))
        ax = fig.add_axes([(x0 + gap / 2 + left_px) / W, 1 - (y0 + h - gap / 2 - legend_px) / H,
                           (w - gap - left_px - right_px) / W, (h - gap - title_px - legend_px) / H])
        if panel["type"] == "stat":
            draw_stat(ax, panel, data)
        else:
            draw_timeseries(ax, frame, panel, data, window, w - gap)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, facecolor=BG)
    plt.close(fig)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:  # a 256-colour palette: a third of the size, no visible loss on flat dark panels
        from PIL import Image
    except ImportError:
        out.write_bytes(buf.getvalue())
        return
    img = Image.open(io.BytesIO(buf.getvalue())).convert("RGB")
    img.quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(out, optimize=True)


# ---------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dashboard", type=Path, default=DEFAULT_DASHBOARD)
    ap.add_argument("--prometheus", default="http://127.0.0.1:9090", help="Prometheus base URL")
    ap.add_argument("--minutes", type=float, default=30, help="window length, ending at --end")
    ap.add_argument("--start", type=float, help="window start (unix seconds); default --end minus --minutes")
    ap.add_argument("--end", type=float, help="window end (unix seconds); default now")
    ap.add_argument("--step", type=float, help="query resolution in seconds (default: window / 300, >= 1)")
    ap.add_argument("--rate-interval", default="1m", help="what $__rate_interval stands for (>= 4 scrapes)")
    ap.add_argument("--var", action="append", default=[], metavar="NAME=VALUE", help="a template variable's value")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "dashboard.png")
    ap.add_argument("--width", type=int, default=1600, help="image width in pixels")
    ap.add_argument("--dpi", type=int, default=100)
    args = ap.parse_args(argv)

    dash = json.loads(args.dashboard.read_text())
    end = args.end or time.time()
    start = args.start or end - args.minutes * 60
    step = args.step or max(1.0, round((end - start) / 300))
    duration(args.rate_interval)  # validate
    values = {"__rate_interval": args.rate_interval, "__interval": f"{int(step)}s",
              "__range": f"{int(end - start)}s", "__range_s": str(int(end - start)),
              "__interval_ms": str(int(step * 1000))}
    for var in dash.get("templating", {}).get("list", []):
        values[var["name"]] = var.get("allValue") or ".*"
    for item in args.var:
        name, _, value = item.partition("=")
        values[name] = value

    results: dict[int, list] = {}
    empty = []
    for panel in panels_of(dash):
        if panel["type"] == "row":
            continue
        data = []
        for target in panel.get("targets", []):
            expr = substitute(target["expr"], values)
            data += series(query_range(args.prometheus, expr, start, end, step), target.get("legendFormat", ""), expr)
        results[panel["id"]] = data
        if not any(not math.isnan(v) for _, _, vs in data for v in vs):
            empty.append(panel["title"])
    window = f"{datetime.fromtimestamp(start):%Y-%m-%d %H:%M:%S} to {datetime.fromtimestamp(end):%H:%M:%S}"
    subtitle = (f"{window}  ·  step {step:g}s, $__rate_interval = {args.rate_interval}  ·  panels of "
                f"{args.dashboard.name} queried from Prometheus by scripts/render_dashboard.py")
    render(dash, results, (start, end), args.out, args.width, args.dpi, subtitle)
    print(f"wrote {args.out} ({args.out.stat().st_size // 1024} KiB); "
          f"{len(results) - len(empty)}/{len(results)} panels with data"
          + (f"; empty: {', '.join(empty)}" if empty else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
