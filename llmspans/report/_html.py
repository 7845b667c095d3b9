"""The report as one self-contained HTML page: inline CSS and SVG, no script, nothing fetched.

Three charts: a stacked bar of a request's parts at p50, p95 and p99 (one segment per part,
every LLM bucket included even when it is zero), each stage's distribution against its
budget line, and a waterfall of the slowest traces with the LLM calls split into buckets;
tables for the load levels, the server's split and the levers, where the input has them.
Elements carry `data-*` attributes (part, quantile, stage, budget, trace id, cache) so tests
and other tools can read the rendered page.
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape

from llmspans import _names as names
from llmspans.report._compare import Comparison
from llmspans.report._model import (
    KIND_BUCKET,
    KIND_OTHER,
    Distribution,
    Part,
    Report,
    ServerSplit,
    SlowTrace,
    StageRow,
    format_quantile,
    part_label,
)
from llmspans.report._model import format_seconds as seconds

BUCKET_COLOURS = {
    "queue": "#d62728",
    "retry": "#ff7f0e",
    "connect": "#8c564b",
    "first_token": "#9467bd",
    "stream": "#1f77b4",
    "post": "#17becf",
}
STAGE_COLOURS = ("#2ca02c", "#98df8a", "#bcbd22", "#dbdb8d", "#7f7f7f", "#c7c7c7", "#e377c2", "#f7b6d2")
UNMARKED_COLOUR = "#eeeeee"
CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px auto; max-width: 980px; color: #222; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 17px; margin: 28px 0 8px; }
.meta { color: #666; margin: 0; } .simulated { color: #b00; font-weight: 600; }
.triage { background: #f6f6f6; border-left: 4px solid #d62728; padding: 8px 14px; }
.triage.within { border-left-color: #2ca02c; }
.legend { list-style: none; padding: 0; display: flex; flex-wrap: wrap; gap: 6px 16px; margin: 6px 0; }
.swatch { display: inline-block; width: 12px; height: 12px; margin-right: 5px; vertical-align: -1px; }
svg text { font: 12px system-ui, sans-serif; fill: #333; } svg .small { font-size: 11px; fill: #666; }
.budget-line { stroke: #d62728; stroke-width: 2; stroke-dasharray: 4 3; }
.box { fill: #9ecae1; stroke: #3182bd; } .whisker { stroke: #3182bd; stroke-width: 1.5; }
.axis { stroke: #bbb; } .over { fill: #d62728; }
table { border-collapse: collapse; } td, th { padding: 2px 10px; text-align: right; }
td:first-child, th:first-child { text-align: left; }
"""


def _colours(parts: Sequence[Part]) -> dict[tuple[str, str], str]:
    colours: dict[tuple[str, str], str] = {}
    stage_index = 0
    for part in parts:
        if part.kind == KIND_BUCKET:
            colours[(part.kind, part.name)] = BUCKET_COLOURS.get(part.name, "#999999")
        elif part.kind == KIND_OTHER:
            colours[(part.kind, part.name)] = UNMARKED_COLOUR
        else:
            colours[(part.kind, part.name)] = STAGE_COLOURS[stage_index % len(STAGE_COLOURS)]
            stage_index += 1
    return colours


def _stacked(report: Report, colours: dict[tuple[str, str], str]) -> str:
    parts = report.parts
    width, label_w, total_w, bar_h, gap = 900, 44, 70, 30, 14
    plot_w = width - label_w - total_w
    totals = {q: sum(part.per_trace.at(q) for part in parts) for q in (0.5, 0.95, 0.99)}
    scale = plot_w / max(max(totals.values()), 1e-9)
    height = 3 * (bar_h + gap)
    out = [
        f'<svg class="stacked" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img">'
    ]
    for row, q in enumerate((0.5, 0.95, 0.99)):
        name = f"p{round(q * 100)}"
        y = row * (bar_h + gap)
        out.append(f'<g class="bar" data-quantile="{name}">')
        out.append(f'<text x="0" y="{y + bar_h / 2 + 4}">{name}</text>')
        x = float(label_w)
        for part in parts:
            value = part.per_trace.at(q)
            w = value * scale
            out.append(
                f'<rect class="segment" data-part="{escape(part.kind)}:{escape(part.name)}" '
                f'data-kind="{escape(part.kind)}" data-name="{escape(part.name)}" data-seconds="{value:.6f}" '
                f'x="{x:.2f}" y="{y}" width="{w:.2f}" height="{bar_h}" fill="{colours[(part.kind, part.name)]}">'
                f"<title>{escape(part.label)} at {name}: {seconds(value)}</title></rect>"
            )
            x += w
        out.append(f'<text class="total" x="{x + 6:.2f}" y="{y + bar_h / 2 + 4}">{seconds(totals[q])}</text>')
        out.append("</g>")
    out.append("</svg>")
    legend = "".join(
        f'<li><span class="swatch" style="background:{colours[(part.kind, part.name)]}"></span>'
        f"{escape(part.label)}</li>"
        for part in parts
    )
    return "\n".join(out) + f'\n<ul class="legend">{legend}</ul>'


def _stage_chart(row: StageRow) -> str:
    width, label_w, right_w, height = 900, 110, 250, 40
    plot_w = width - label_w - right_w
    d = row.durations
    highest = d.max if d.max is not None else d.p99
    top = max(highest, row.budget or 0.0, 1e-9) * 1.08
    scale = plot_w / top

    def at(value: float) -> float:
        return label_w + value * scale

    y_mid = (height - 10) / 2
    parts = [
        f'<svg class="stage-dist" data-stage="{escape(row.stage)}" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}">',
        f'<text x="0" y="{y_mid + 4}">{escape(row.stage)}</text>',
        f'<line class="axis" x1="{label_w}" x2="{label_w + plot_w}" y1="{height - 8}" y2="{height - 8}"/>',
        f'<text class="small" x="{label_w}" y="{height}">0</text>',
        f'<text class="small" x="{label_w + plot_w}" y="{height}" text-anchor="end">{seconds(top)}</text>',
        f'<line class="whisker" x1="{at(d.p95):.2f}" x2="{at(highest):.2f}" y1="{y_mid}" y2="{y_mid}"/>',
        f'<rect class="box" data-from="{d.p50:.6f}" data-to="{d.p95:.6f}" x="{at(d.p50):.2f}" y="{y_mid - 9}" '
        f'width="{max(1.0, (d.p95 - d.p50) * scale):.2f}" height="18"><title>p50 {format_quantile(d, "p50")} to p95 '
        f"{format_quantile(d, 'p95')}</title></rect>",
        f'<line class="whisker p99" x1="{at(d.p99):.2f}" x2="{at(d.p99):.2f}" y1="{y_mid - 7}" y2="{y_mid + 7}">'
        f"<title>p99 {format_quantile(d, 'p99')}</title></line>",
    ]
    if d.max is not None:
        parts.append(
            f'<circle class="max{" over" if row.budget is not None and d.max > row.budget else ""}" '
            f'cx="{at(d.max):.2f}" cy="{y_mid}" r="3"><title>max {seconds(d.max)}</title></circle>'
        )
    if row.budget is not None:
        parts.append(
            f'<line class="budget-line" data-stage="{escape(row.stage)}" data-budget="{row.budget:.6f}" '
            f'x1="{at(row.budget):.2f}" x2="{at(row.budget):.2f}" y1="2" y2="{height - 2}">'
            f"<title>budget {seconds(row.budget)}</title></line>"
        )
        summary = f"p95 {format_quantile(d, 'p95')} / budget {seconds(row.budget)}, {row.exceeded} of {row.budgeted} over"
    else:
        summary = f"p95 {format_quantile(d, 'p95')}, no budget"
    parts.append(f'<text class="small" x="{label_w + plot_w + 8}" y="{y_mid + 4}">{escape(summary)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _waterfall(slow: SlowTrace, colours: dict[tuple[str, str], str]) -> str:
    width, label_w, row_h = 900, 260, 18
    plot_w = width - label_w - 70
    scale = plot_w / max(slow.duration_s, 1e-9)
    height = row_h * len(slow.rows) + 6
    out = [
        f'<svg class="waterfall" data-trace-id="{escape(slow.trace_id)}" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}">'
    ]
    for index, row in enumerate(slow.rows):
        y = index * row_h + 2
        x = label_w + row.offset_s * scale
        label = ("  " * row.depth + row.name)[:40]
        out.append(f'<g class="wf-row" data-stage="{escape(row.stage or "")}">')
        out.append(
            f'<text x="{4 + 10 * row.depth}" y="{y + 12}" xml:space="preserve">{escape(label.strip())}</text>'
        )
        if row.buckets:
            segment_x = x
            for bucket in names.BUCKETS:
                value = row.buckets.get(bucket, 0.0)
                w = value * scale
                out.append(
                    f'<rect class="wf-segment" data-bucket="{bucket}" x="{segment_x:.2f}" y="{y}" width="{w:.2f}" '
                    f'height="{row_h - 4}" fill="{BUCKET_COLOURS[bucket]}"><title>{bucket}: {seconds(value)}</title></rect>'
                )
                segment_x += w
        else:
            colour = colours.get(("stage", row.stage or ""), "#bbbbbb")
            stroke = ' stroke="#d62728"' if row.error else ""
            out.append(
                f'<rect class="wf-span" x="{x:.2f}" y="{y}" width="{max(1.0, row.duration_s * scale):.2f}" '
                f'height="{row_h - 4}" fill="{colour}"{stroke}>'
                f"<title>{escape(row.name)}: {seconds(row.duration_s)}</title></rect>"
            )
        out.append(
            f'<text class="small" x="{x + max(1.0, row.duration_s * scale) + 4:.2f}" y="{y + 12}">'
            f"{seconds(row.duration_s)}</text></g>"
        )
    out.append("</svg>")
    return "".join(out)


def _signed(value: float) -> str:
    return ("+" if value > 0 else "-" if value < 0 else "±") + seconds(abs(value))


def _comparison(comparison: Comparison) -> str:
    rows = []
    for change in comparison.changes:
        interval = (
            f"{_signed(change.low_s)} to {_signed(change.high_s)}"
            if change.low_s is not None and change.high_s is not None
            else "-"
        )
        rows.append(
            f'<tr class="change" data-kind="{escape(change.kind)}" data-name="{escape(change.name)}" '
            f'data-quantile="{change.quantile}" data-verdict="{escape(change.verdict)}" '
            f'data-change="{change.change_s:.9f}"><td>{escape(change.name)} ({escape(change.kind)})</td>'
            f"<td>{change.quantile}</td><td>{seconds(change.before_s)}</td><td>{seconds(change.after_s)}</td>"
            f"<td>{_signed(change.change_s)}</td><td>{interval}</td><td>{escape(change.verdict)}</td></tr>"
        )
    dominant = (
        f"dominant at p95: {comparison.dominant_before} before, {comparison.dominant_after} after"
        if comparison.dominant_before != comparison.dominant_after
        else f"dominant at p95: {comparison.dominant_after}, before and after"
    )
    return (
        f'<section id="comparison"><h2>Compared with {escape(comparison.before)} (before) → '
        f'{escape(comparison.after)} (after)</h2><p class="meta">{escape(comparison.method)}. '
        f"{escape(dominant or '')}.</p><table><tr><th>part</th><th>q</th><th>before</th><th>after</th>"
        "<th>change</th><th>95% interval</th><th>verdict</th></tr>" + "".join(rows) + "</table></section>"
    )


def _quantile_cells(distribution: Distribution) -> str:
    """p50, p95 and p99 as table cells; a quantile that is only bounded by its histogram bucket reads
    `≤ 300 ms (first bucket)` and carries `data-bound`."""
    cells = []
    for quantile in ("p50", "p95", "p99"):
        bound = distribution.bound(quantile)
        marker = f' data-bound="{bound.upper:.6f}"' if bound is not None else ""
        cells.append(f"<td{marker}>{escape(format_quantile(distribution, quantile))}</td>")
    return "".join(cells)


def _server_split(server: ServerSplit) -> str:
    """The buckets split by vLLM's own spans: a table per bucket, every row labelled, and what was derived."""

    def table(title: str, bucket: str) -> str:
        cells = "".join(
            f'<tr data-bucket="{escape(row.bucket)}" data-part="{escape(row.part)}" data-calls="{escape(row.calls)}">'
            f"<td>{escape(row.label)}</td><td>{row.values.count}</td>{_quantile_cells(row.values)}</tr>"
            for row in server.rows
            if row.bucket == bucket
        )
        return (
            f"<h3>{escape(title)}</h3><table><tr><th>part</th><th>calls</th><th>p50</th><th>p95</th><th>p99</th>"
            f"</tr>{cells}</table>"
        )

    engines = f" (vLLM's {' and '.join(server.engines)} engine)" if server.engines else ""
    out = [f'<section id="server"><h2>The server\'s side, from its llm_request spans{escape(engines)}</h2>']
    out.append(table(f"first_token, {server.calls} calls", "first_token"))
    if any(row.bucket == "stream" for row in server.rows):
        out.append(table(f"stream, {server.streamed_calls} streamed calls", "stream"))
    out.extend(f'<p class="meta">{escape(note)}</p>' for note in server.notes)
    out.append("</section>")
    return "".join(out)


def _levels(report: Report) -> str:
    """The calls `llmspans load` made, per level: durations and each bucket's p95."""
    head = "".join(f"<th>{bucket}</th>" for bucket in names.BUCKETS)
    rows = "".join(
        f'<tr class="load-level" data-level="{escape(row.label)}"><td>{escape(row.label)}</td><td>{row.calls}</td>'
        f"<td>{row.failed}</td><td>{seconds(row.durations.p50)}</td><td>{seconds(row.durations.p95)}</td>"
        + "".join(f"<td>{seconds(row.buckets_p95[bucket])}</td>" for bucket in names.BUCKETS)
        + f"<td>{escape(row.dominant)}</td></tr>"
        for row in report.levels
    )
    return (
        '<section id="levels"><h2>Load levels (llmspans load)</h2><p class="meta">Each level\'s calls: their '
        "durations at p50 and p95, and each bucket's p95.</p><table><tr><th>level</th><th>calls</th>"
        f"<th>failed</th><th>p50</th><th>p95</th>{head}<th>dominant</th></tr>{rows}</table></section>"
    )


def _levers(report: Report) -> str:
    """What the prompt caps, caches and hedges did: a table each (docs/levers.md)."""

    def cell(found: Distribution | None, q: float) -> str:
        return "-" if found is None else seconds(found.at(q))

    out = ['<section id="levers"><h2>Levers: prompt caps, caches and hedged requests</h2>']
    caps = report.prompt_caps
    if caps is not None:
        ratio = caps.estimate_ratio
        out.append(
            f'<table class="prompt-caps" data-calls="{caps.calls}" data-over="{caps.over}" '
            f'data-refused="{caps.refused}" data-share-over="{caps.share_over:.6f}"><tr><th>capped calls</th>'
            "<th>over the cap</th><th>refused</th><th>first_token p50 / p95 over</th>"
            "<th>first_token p50 / p95 under</th><th>estimate / server p50</th></tr>"
            f"<tr><td>{caps.calls}</td><td>{caps.over} ({caps.share_over:.0%})</td><td>{caps.refused}</td>"
            f"<td>{cell(caps.first_token_over, 0.5)} / {cell(caps.first_token_over, 0.95)}</td>"
            f"<td>{cell(caps.first_token_under, 0.5)} / {cell(caps.first_token_under, 0.95)}</td>"
            f"<td>{'-' if ratio is None else f'{ratio.p50:.2f}x'}</td></tr></table>"
            f'<p class="meta">Estimated by {escape(", ".join(caps.estimators) or "an unrecorded estimator")}; '
            "first_token of the calls sent and answered.</p>"
        )
    if report.caches:
        rows = "".join(
            f'<tr class="cache" data-cache="{escape(cache.name)}" data-lookups="{cache.lookups}" '
            f'data-hits="{cache.hits}" data-hit-rate="{cache.hit_rate:.6f}" data-saved="{cache.saved_s:.6f}">'
            f"<td>{escape(cache.name)}</td><td>{cache.lookups}</td><td>{cache.hits} ({cache.hit_rate:.0%})</td>"
            f"<td>{cache.errors}</td><td>{seconds(cache.saved_s)}</td>"
            f"<td>{cell(cache.lookup, 0.5)} / {cell(cache.lookup, 0.95)}</td>"
            f"<td>{cell(cache.with_hit, 0.5)} / {cell(cache.with_hit, 0.95)}</td>"
            f"<td>{cell(cache.with_miss, 0.5)} / {cell(cache.with_miss, 0.95)}</td></tr>"
            for cache in report.caches
        )
        out.append(
            "<table><tr><th>cache</th><th>lookups</th><th>hits</th><th>failed</th><th>LLM time saved (estimate)</th>"
            "<th>lookup p50 / p95</th><th>requests with a hit p50 / p95</th><th>with only misses p50 / p95</th>"
            f'</tr>{rows}</table><p class="meta">A hit is worth the p50 of the process\'s own recent LLM calls '
            "(of the model the lookup names); a request is the turn holding the lookup, else its trace.</p>"
        )
    hedging = report.hedging
    if hedging is not None:
        extra = hedging.extra_input
        first, cut = hedging.primaries_first, hedging.primaries_cut
        out.append(
            f'<table class="hedging" data-calls="{hedging.calls}" data-fired="{hedging.fired}" '
            f'data-backup-won="{hedging.backup_won}" data-wasted-input="{hedging.wasted_input_tokens}">'
            "<tr><th>calls that could be hedged</th><th>backup sent</th><th>backup won</th>"
            "<th>first_token p50 / p95 of those hedged</th><th>their primaries that got there first, own "
            "p50 / p95</th><th>those the backup beat: waited p50 / p95, then stopped</th>"
            "<th>input tokens wasted</th><th>output tokens wasted</th><th>not sent (limiter full)</th></tr>"
            f"<tr><td>{hedging.calls}</td><td>{hedging.fired} ({hedging.share_fired:.0%})</td>"
            f"<td>{hedging.backup_won} ({hedging.share_won:.0%})</td>"
            f"<td>{cell(hedging.first_token, 0.5)} / {cell(hedging.first_token, 0.95)}</td>"
            f"<td>{cell(first, 0.5)} / {cell(first, 0.95)}</td><td>{cell(cut, 0.5)} / {cell(cut, 0.95)}</td>"
            f"<td>{hedging.wasted_input_tokens}{'' if extra is None else f' (+{extra:.0%})'}</td>"
            f"<td>{hedging.wasted_output_tokens}</td><td>{hedging.skipped}</td></tr></table>"
            '<p class="meta">A primary the backup beat was stopped before its first token: its own time is '
            "unknown, beyond the time it had waited. Input tokens wasted: the losing copies' prompts, against "
            "the input tokens of every call counted.</p>"
        )
    out.append("</section>")
    return "".join(out)


def _server_histograms(report: Report) -> str:
    """vLLM's own histograms (Prometheus source), per model; bounded quantiles as bounds."""
    out = ['<section id="server-histograms"><h2>vLLM\'s own histograms</h2>']
    for histograms in report.server_histograms:
        rows = "".join(
            f'<tr data-part="{escape(name)}"><td>{escape(name)}</td><td>{d.count}</td>{_quantile_cells(d)}</tr>'
            for name, d in (
                ("server queue", histograms.queue), ("prefill", histograms.prefill),
                ("time to first token", histograms.time_to_first_token), ("between tokens", histograms.inter_token),
            )
            if d is not None
        )  # fmt: skip
        out.append(
            f'<h3>model {escape(histograms.model)}</h3><table data-model="{escape(histograms.model)}"><tr><th>part</th>'
            f"<th>count</th><th>p50</th><th>p95</th><th>p99</th></tr>{rows}</table>"
        )
    out.append(
        '<p class="meta">≤ X: the quantile falls in a histogram bucket wider than the figure itself (the first '
        "bucket, from 0, always is); interpolating inside it would invent a figure, so only the bound is "
        "given.</p></section>"
    )
    return "".join(out)


def _intervals(report: Report) -> str:
    """Where each estimated p95 lies (sampled traces, or histogram buckets): the stages, buckets and parts
    whose p95 is an estimate, with the interval of each; nothing when every figure is of every value."""
    rows = [
        (what, name, d)
        for what, name, d in (
            *(("stage", row.stage, row.durations) for row in report.stages),
            *(("llm bucket", row.bucket, row.values) for row in report.buckets),
            *(("per trace", part.label, part.per_trace) for part in report.parts),
        )
        if d.interval("p95") is not None
    ]
    if not rows:
        return ""
    cells = []
    for what, name, d in rows:
        interval = d.interval("p95")
        assert interval is not None
        cells.append(
            f'<tr class="interval" data-name="{escape(name)}" data-low="{interval.low:.6f}" '
            f'data-high="{interval.high:.6f}"><td>{escape(name)}</td><td>{escape(what)}</td>'
            f"<td>{format_quantile(d, 'p95')}</td><td>{seconds(interval.low)} to {seconds(interval.high)}</td></tr>"
        )
    return (
        '<p class="meta">These figures are estimates: each p95 lies within its interval (95 % for the sampled '
        "traces' figures; the bucket that holds the rank for a histogram's).</p>"
        "<table><tr><th>part</th><th>from</th><th>p95</th><th>within</th></tr>" + "".join(cells) + "</table>"
    )


def render(report: Report, comparison: Comparison | None = None) -> str:
    """The whole page as a string (UTF-8 when written)."""
    title = "llmspans report"
    colours = _colours(report.parts)
    sources = escape(", ".join(report.sources))
    simulated = ' <span class="simulated">(simulated LLM server)</span>' if "simulated" in sources else ""
    body = [
        f'<h1>Where the time goes</h1><p class="meta">{report.traces} traces, {report.llm_calls} LLM calls, '
        f"{report.spans} spans from {sources}{simulated}</p>",
        f'<p class="meta">Quantiles: {escape(report.quantile_method)}.</p>',
    ]
    if report.traces_read is not None:  # a tail-sampled input: the weighting's one line
        body.append(f'<p class="meta">{escape(report.notes[0])}.</p>')
    if not report.traces:
        body.append("<p>No llmspans traces found: nothing to report.</p>")
    triage = report.triage
    if triage is not None:
        label = part_label(triage.dominant_kind, triage.dominant)
        notes = "".join(f"<li>{escape(note)}</li>" for note in triage.notes)
        if triage.told:
            leader = triage.compared[0] if triage.compared else None
            within = (
                f" ({seconds(leader.low)} to {seconds(leader.high)})"
                if leader is not None and leader.low != leader.high
                else ""
            )
            heading = (
                f'Dominant at p95: <span class="dominant" data-part="{escape(triage.dominant_kind)}:'
                f'{escape(triage.dominant)}" data-finding="{escape(triage.finding)}">{escape(label)}</span>, '
                f"{seconds(triage.dominant_p95)} per request{within}"
            )
        else:
            first, second = triage.compared
            heading = (
                f'Dominant at p95: <span class="dominant" data-part="" data-finding="{escape(triage.finding)}">'
                f"cannot tell</span> ({escape(first.label)} or {escape(second.label)})"
            )
        body.append(
            f'<section class="triage{" within" if triage.within_budget else ""}" id="triage">'
            f"<h2>{heading}</h2><p>{escape(triage.message)}</p>"
            + (f"<ul>{notes}</ul>" if notes else "")
            + "</section>"
        )
    if report.parts:
        body.append('<section id="parts"><h2>A request\'s time at p50, p95 and p99</h2>')
        body.append(
            "<p class=\"meta\">Per trace: each stage's own time and each LLM bucket summed over the trace's calls; "
            "each bar stacks the parts' own quantiles.</p>"
        )
        body.append(_stacked(report, colours))
        body.append(_intervals(report))
        body.append("</section>")
    if report.stages:
        body.append('<section id="stages"><h2>Each stage against its budget</h2>')
        body.append('<p class="meta">Box: p50 to p95; tick: p99; dot: max; dashed red line: the budget.</p>')
        body.extend(_stage_chart(row) for row in report.stages)
        body.append("</section>")
    if report.levels:
        body.append(_levels(report))
    if report.prompt_caps is not None or report.caches or report.hedging is not None:
        body.append(_levers(report))
    if report.server is not None:
        body.append(_server_split(report.server))
    if report.server_histograms:
        body.append(_server_histograms(report))
    if report.slowest:
        body.append('<section id="slowest"><h2>The slowest traces</h2>')
        for slow in report.slowest:
            label = part_label(slow.dominant_kind, slow.dominant)
            body.append(
                f'<h3 class="meta">{seconds(slow.duration_s)}: trace <code>{escape(slow.trace_id)}</code>, '
                f"dominant {escape(label)} ({seconds(slow.dominant_s)})</h3>"
            )
            body.append(_waterfall(slow, colours))
        body.append("</section>")
    if report.exemplars:
        body.append('<section id="exemplars"><h2>Slow requests (exemplars)</h2>')
        body.append(
            '<p class="meta">Prometheus keeps no list of traces; these are the traces behind the slowest '
            "histogram points.</p><table><tr><th>series</th><th>value</th><th>trace</th></tr>"
        )
        for exemplar in report.exemplars:
            trace = escape(exemplar.trace_id)
            cell = (
                f'<a href="{escape(exemplar.link)}">{trace}</a>' if exemplar.link else f"<code>{trace}</code>"
            )
            body.append(
                f"<tr><td>{escape(exemplar.series)}</td><td>{seconds(exemplar.value_s)}</td><td>{cell}</td></tr>"
            )
        body.append("</table></section>")
    if comparison is not None:
        body.append(_comparison(comparison))
    return (
        f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
        f"<style>{CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )
