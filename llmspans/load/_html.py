"""A load run as one self-contained HTML page, in the report's conventions: inline CSS and SVG, no script,
nothing fetched.

Three charts over the levels (evenly spaced, in order of load): latency percentiles (TTFT and e2e at p50,
p95, p99), throughput (requests/s, and goodput under an SLO) with the knee marked, and each bucket's p95
stacked per level in the report's bucket colours. Then the tables and the verdict. Elements carry `data-*`
attributes (level, series, seconds) so tests and other tools can read the page.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from html import escape

from llmspans import _names as names
from llmspans.load._model import LevelStats, Percentiles, Result
from llmspans.load._replay_table import ReplayResult, token_words
from llmspans.report._html import BUCKET_COLOURS, CSS
from llmspans.report._model import format_seconds as seconds

WIDTH, HEIGHT, LEFT, RIGHT, TOP, BOTTOM = 900, 260, 70, 150, 14, 36
_EXTRA_CSS = """
.knee-line { stroke: #d62728; stroke-width: 2; stroke-dasharray: 5 4; }
.grid { stroke: #eee; } .series { fill: none; stroke-width: 2; }
.verdict { background: #f6f6f6; border-left: 4px solid #d62728; padding: 8px 14px; }
.verdict.none { border-left-color: #2ca02c; }
td { white-space: nowrap; }
"""


def _ttft(stats: LevelStats) -> Percentiles | None:
    return stats.ttft


def _e2e(stats: LevelStats) -> Percentiles | None:
    return stats.e2e


_SERIES: tuple[tuple[str, Callable[[LevelStats], Percentiles | None], float, str, str], ...] = (
    ("TTFT p50", _ttft, 0.5, "#c5b0d5", ""),
    ("TTFT p95", _ttft, 0.95, "#9467bd", ""),
    ("TTFT p99", _ttft, 0.99, "#5b3a8c", "4 3"),
    ("e2e p50", _e2e, 0.5, "#aec7e8", ""),
    ("e2e p95", _e2e, 0.95, "#1f77b4", ""),
    ("e2e p99", _e2e, 0.99, "#0b3d66", "4 3"),
)


def _x(index: int, count: int) -> float:
    plot = WIDTH - LEFT - RIGHT
    return LEFT + (plot * (index + 0.5) / count)


def _frame(
    levels: Sequence[LevelStats], top: float, unit: Callable[[float], str], knee_index: int | None
) -> list[str]:
    plot_h = HEIGHT - TOP - BOTTOM
    out = []
    for step in range(5):
        value = top * step / 4
        y = TOP + plot_h * (1 - step / 4)
        out.append(f'<line class="grid" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}"/>')
        out.append(
            f'<text class="small" x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{escape(unit(value))}</text>'
        )
    for index, stats in enumerate(levels):
        x = _x(index, len(levels))
        out.append(
            f'<text class="small" x="{x:.1f}" y="{HEIGHT - BOTTOM + 16}" text-anchor="middle">{escape(stats.level.label)}</text>'
        )
    if knee_index is not None:
        x = (_x(knee_index - 1, len(levels)) + _x(knee_index, len(levels))) / 2
        out.append(
            f'<line class="knee-line" data-knee="{escape(levels[knee_index].level.label)}" x1="{x:.1f}" x2="{x:.1f}" '
            f'y1="{TOP}" y2="{HEIGHT - BOTTOM}"><title>the knee</title></line>'
            f'<text class="small" x="{x + 4:.1f}" y="{TOP + 10}">knee</text>'
        )
    return out


def _y(value: float, top: float) -> float:
    return TOP + (HEIGHT - TOP - BOTTOM) * (1 - value / top)


def _latency(levels: Sequence[LevelStats], knee_index: int | None) -> str:
    values = [
        figures.at(q) for _, getter, q, _, _ in _SERIES for s in levels if (figures := getter(s)) is not None
    ]
    top = max(values, default=0.0) * 1.1 or 1.0
    out = [
        f'<svg class="latency" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" role="img">'
    ]
    out += _frame(levels, top, seconds, knee_index)
    legend_y = TOP
    for name, getter, q, colour, dash in _SERIES:
        points = [(index, getter(s)) for index, s in enumerate(levels)]
        shown = [(index, figures.at(q)) for index, figures in points if figures is not None]
        if not shown:
            continue
        path = " ".join(f"{_x(index, len(levels)):.1f},{_y(value, top):.1f}" for index, value in shown)
        dashes = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(
            f'<polyline class="series" data-series="{escape(name)}" points="{path}" stroke="{colour}"{dashes}/>'
        )
        for index, value in shown:
            out.append(
                f'<circle data-series="{escape(name)}" data-level="{escape(levels[index].level.label)}" '
                f'data-seconds="{value:.6f}" cx="{_x(index, len(levels)):.1f}" cy="{_y(value, top):.1f}" r="3" '
                f'fill="{colour}"><title>{escape(name)} at {escape(levels[index].level.words)}: {seconds(value)}</title></circle>'
            )
        out.append(
            f'<line x1="{WIDTH - RIGHT + 12}" x2="{WIDTH - RIGHT + 32}" y1="{legend_y}" y2="{legend_y}" stroke="{colour}" stroke-width="2"{dashes}/>'
        )
        out.append(f'<text x="{WIDTH - RIGHT + 38}" y="{legend_y + 4}">{escape(name)}</text>')
        legend_y += 18
    out.append("</svg>")
    return "".join(out)


def _throughput(levels: Sequence[LevelStats], knee_index: int | None) -> str:
    values = [s.requests_per_s for s in levels] + [s.goodput_per_s or 0.0 for s in levels]
    top = max(values, default=0.0) * 1.1 or 1.0
    out = [
        f'<svg class="throughput" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" role="img">'
    ]
    out += _frame(levels, top, lambda value: f"{value:.1f}/s", knee_index)
    bar = (WIDTH - LEFT - RIGHT) / len(levels) * 0.5
    for index, stats in enumerate(levels):
        x, y = _x(index, len(levels)), _y(stats.requests_per_s, top)
        out.append(
            f'<rect class="rps" data-level="{escape(stats.level.label)}" data-rps="{stats.requests_per_s:.3f}" '
            f'x="{x - bar / 2:.1f}" y="{y:.1f}" width="{bar:.1f}" height="{HEIGHT - BOTTOM - y:.1f}" fill="#1f77b4">'
            f"<title>{escape(stats.level.words)}: {stats.requests_per_s:.2f} requests/s, "
            f"{stats.output_tokens_per_s:.0f} output tokens/s</title></rect>"
        )
        if stats.goodput_per_s is not None:
            y = _y(stats.goodput_per_s, top)
            out.append(
                f'<rect class="goodput" data-level="{escape(stats.level.label)}" data-goodput="{stats.goodput_per_s:.3f}" '
                f'x="{x - bar / 4:.1f}" y="{y:.1f}" width="{bar / 2:.1f}" height="{HEIGHT - BOTTOM - y:.1f}" fill="#2ca02c">'
                f"<title>goodput {stats.goodput_per_s:.2f} requests/s</title></rect>"
            )
    out.append(f'<rect x="{WIDTH - RIGHT + 12}" y="{TOP - 6}" width="12" height="12" fill="#1f77b4"/>')
    out.append(f'<text x="{WIDTH - RIGHT + 30}" y="{TOP + 4}">requests/s</text>')
    if any(stats.goodput_per_s is not None for stats in levels):
        out.append(f'<rect x="{WIDTH - RIGHT + 12}" y="{TOP + 12}" width="12" height="12" fill="#2ca02c"/>')
        out.append(f'<text x="{WIDTH - RIGHT + 30}" y="{TOP + 22}">goodput</text>')
    out.append("</svg>")
    return "".join(out)


def _buckets(levels: Sequence[LevelStats], knee_index: int | None) -> str:
    totals = [sum(stats.buckets_p95.values()) for stats in levels]
    top = max(totals, default=0.0) * 1.1 or 1.0
    out = [
        f'<svg class="buckets" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" role="img">'
    ]
    out += _frame(levels, top, seconds, knee_index)
    bar = (WIDTH - LEFT - RIGHT) / len(levels) * 0.5
    for index, stats in enumerate(levels):
        x = _x(index, len(levels)) - bar / 2
        base = 0.0
        for bucket in names.BUCKETS:
            value = stats.buckets_p95[bucket]
            y_top, y_base = _y(base + value, top), _y(base, top)
            out.append(
                f'<rect class="segment" data-level="{escape(stats.level.label)}" data-bucket="{bucket}" '
                f'data-seconds="{value:.6f}" x="{x:.1f}" y="{y_top:.1f}" width="{bar:.1f}" '
                f'height="{max(0.0, y_base - y_top):.1f}" fill="{BUCKET_COLOURS[bucket]}">'
                f"<title>{bucket} p95 at {escape(stats.level.words)}: {seconds(value)}</title></rect>"
            )
            base += value
    for row, bucket in enumerate(reversed(names.BUCKETS)):
        y = TOP + row * 18
        out.append(
            f'<rect x="{WIDTH - RIGHT + 12}" y="{y - 6}" width="12" height="12" fill="{BUCKET_COLOURS[bucket]}"/>'
        )
        out.append(f'<text x="{WIDTH - RIGHT + 30}" y="{y + 4}">{bucket}</text>')
    out.append("</svg>")
    return "".join(out)


def _q(figures: Percentiles | None, q: float) -> str:
    return "-" if figures is None else seconds(figures.at(q))


def _table(levels: Sequence[LevelStats], knee: str | None) -> str:
    head = (
        "<tr><th>level</th><th>requests</th><th>errors</th><th>req/s</th><th>tok/s</th><th>goodput</th>"
        "<th>TTFT p50</th><th>TTFT p95</th><th>TPOT p95</th><th>ITL p95</th><th>e2e p50</th><th>e2e p95</th>"
        "<th>lag p99</th><th>dominant</th></tr>"
    )
    rows = []
    for stats in levels:
        mark = " *" if stats.level.label == knee else ""
        goodput = "-" if stats.goodput_per_s is None else f"{stats.goodput_per_s:.1f}"
        rows.append(
            f'<tr class="level" data-level="{escape(stats.level.label)}"><td>{escape(stats.level.label)}{mark}</td>'
            f"<td>{stats.requests}</td><td>{stats.failed}</td><td>{stats.requests_per_s:.1f}</td>"
            f"<td>{stats.output_tokens_per_s:.0f}</td><td>{goodput}</td><td>{_q(stats.ttft, 0.5)}</td>"
            f"<td>{_q(stats.ttft, 0.95)}</td><td>{_q(stats.tpot, 0.95)}</td><td>{_q(stats.itl, 0.95)}</td>"
            f"<td>{_q(stats.e2e, 0.5)}</td><td>{_q(stats.e2e, 0.95)}</td><td>{_q(stats.lag, 0.99)}</td>"
            f"<td>{escape((stats.dominant or '-').replace(' (llm bucket)', ''))}</td></tr>"
        )
    return f"<table>{head}{''.join(rows)}</table>"


def _generators(result: Result) -> str:
    """`--ray`: one row per generator."""
    head = (
        "<tr><th>generator</th><th>node</th><th>requests</th><th>lost</th><th>CPU/req</th><th>lag p99</th>"
        "<th>at</th><th>clock</th></tr>"
    )
    rows = []
    for generator in result.generators:
        cpu = generator.cpu_per_request_s
        worst = generator.lag_worst
        rows.append(
            f'<tr class="generator" data-generator="{escape(generator.attribute)}">'
            f"<td>{escape(generator.name)}{' (lost)' if generator.lost_during else ''}</td>"
            f"<td>{escape(generator.node)}</td><td>{generator.requests}</td><td>{generator.lost}</td>"
            f"<td>{'-' if cpu is None else seconds(cpu)}</td><td>{'-' if worst is None else seconds(worst[1])}</td>"
            f"<td>{'-' if worst is None else escape(worst[0])}</td>"
            f"<td>{generator.clock_offset_s * 1e3:+.1f} ms ±{generator.clock_uncertainty_s * 1e3:.1f}</td></tr>"
        )
    return f"<table>{head}{''.join(rows)}</table>"


def _replay(replay: ReplayResult) -> str:
    """The recorded calls against their replay at 1x speed, and what the replay assumed."""
    parts = [
        '<section id="replay"><h2>Recorded against replayed</h2>',
        f'<p class="meta">{escape(replay.described)}</p>',
    ]
    if replay.speed is None or not replay.rows:
        parts.append('<p class="meta">No 1x speed level ran (--speed 1 gives the comparison).</p>')
    else:
        head = (
            f"<tr><th>part (at {replay.speed:g}x speed)</th><th>recorded p50</th><th>recorded p95</th>"
            "<th>replayed p50</th><th>replayed p95</th><th>calls recorded/replayed</th></tr>"
        )
        rows = []
        for row in replay.rows:
            name = "llm (the call)" if row.kind == "stage" else row.part
            rows.append(
                f'<tr class="compared" data-part="{escape(row.part)}" data-kind="{row.kind}" '
                f'data-recorded-p50="{row.recorded_p50:.6f}" data-recorded-p95="{row.recorded_p95:.6f}" '
                f'data-replayed-p50="{row.replayed_p50:.6f}" data-replayed-p95="{row.replayed_p95:.6f}">'
                f"<td>{escape(name)}</td><td>{seconds(row.recorded_p50)}</td><td>{seconds(row.recorded_p95)}</td>"
                f"<td>{seconds(row.replayed_p50)}</td><td>{seconds(row.replayed_p95)}</td>"
                f"<td>{row.recorded_count}/{row.replayed_count}</td></tr>"
            )
        parts.append(f"<table>{head}{''.join(rows)}</table>")
        if replay.largest is not None:
            parts.append(f'<p class="largest">{escape(replay.largest)}</p>')
        if replay.tokens is not None:
            parts.append(f'<p class="meta">{escape(token_words(replay.tokens))}</p>')
    parts += [f'<p class="meta assumed">assumed: {escape(line)}</p>' for line in replay.assumptions]
    return "".join(parts) + "</section>"


def render(result: Result) -> str:
    """The whole page as a string (UTF-8 when written)."""
    levels = sorted(result.levels, key=lambda stats: stats.level.value)
    labels = [stats.level for stats in levels]
    knee_index = (
        labels.index(result.knee.at) if result.knee is not None and result.knee.at in labels else None
    )
    knee = result.knee.at.label if result.knee is not None else None
    simulated = ' <span class="simulated">(simulated LLM server)</span>' if "simulat" in result.target else ""
    body = [
        f"<h1>Load: {escape(result.model)} at {escape(result.target)}</h1>{simulated}",
        f'<p class="meta">{escape(result.workload)}; run <code>{escape(result.run_id)}</code>'
        f"{' (interrupted)' if result.interrupted else ''}. Quantiles: nearest rank; TTFT and e2e count from the "
        "request's start (its scheduled time in an open loop).</p>",
        *([_replay(result.replay)] if result.replay is not None else []),
        f'<section class="verdict{"" if result.knee else " none"}" id="verdict" '
        f'data-finding="{escape(result.verdict.finding if result.verdict else "")}"><h2>'
        f"{'The knee' if result.knee else 'No knee'}</h2><p>{escape(result.summary)}</p>"
        + "".join(
            f'<p class="meta">also: {escape(note)}</p>'
            for note in (result.verdict.notes if result.verdict else ())
        )
        + "</section>",
    ]
    if levels:
        body.append(
            '<section id="latency"><h2>Latency against load</h2>'
            + _latency(levels, knee_index)
            + "</section>"
        )
        body.append(
            '<section id="throughput"><h2>Throughput against load</h2>'
            + _throughput(levels, knee_index)
            + "</section>"
        )
        body.append(
            "<section id=\"buckets\"><h2>Where a request's time goes, per level (each bucket's p95, stacked)</h2>"
            '<p class="meta">Each bar stacks the buckets\' own p95s, as the report does.</p>'
            + _buckets(levels, knee_index)
            + "</section>"
        )
        body.append('<section id="levels"><h2>Per level</h2>' + _table(levels, knee) + "</section>")
    if result.generators:
        body.append(
            '<section id="generators"><h2>The generators on Ray</h2><p class="meta">Over the run; a --limiter-cap '
            "applies per generator; lag p99 at its worst level; clock: its wall clock minus the driver's.</p>"
            + _generators(result)
            + "</section>"
        )
    for note in result.notes:
        body.append(f'<p class="meta">note: {escape(note)}</p>')
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>llmspans load</title>'
        f"<style>{CSS}{_EXTRA_CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )
