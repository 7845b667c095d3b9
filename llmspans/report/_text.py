"""The report as plain text for a terminal: fixed-width tables in 100 columns that never cut a figure
(a name too long for its column is shortened with "…"; a figure never is)."""

from __future__ import annotations

import re
import textwrap
from collections.abc import Iterable, Sequence

from llmspans.report._compare import Comparison
from llmspans.report._model import Distribution, Hedging, Report, format_quantile, part_label
from llmspans.report._model import format_seconds as seconds

WIDTH = 100
_QUANTILE_HEADERS = ("count", "p50", "p95", "p99", "max")


_FIGURE = re.compile(r"(\d) (ms|s)\b")
_KEEP = "\u00a0"  # textwrap breaks lines at ASCII whitespace only


def _wrap(text: str, indent: str = "  ") -> list[str]:
    """Lines of at most WIDTH; a figure and its unit stay on one line."""
    kept = _FIGURE.sub(rf"\1{_KEEP}\2", text)
    lines = textwrap.wrap(kept, WIDTH, initial_indent=indent, subsequent_indent=indent + "  ")
    return [line.replace(_KEEP, " ") for line in lines]


def _table(
    headers: Sequence[str], rows: Iterable[Sequence[str]], first_width: int = 30, last_width: int = 9
) -> list[str]:
    widths = [first_width] + [9] * (len(headers) - 2) + [last_width]
    lines = []
    for cells in [headers, *rows]:
        first = cells[0] if len(cells[0]) <= first_width else cells[0][: first_width - 1] + "…"
        lines.append(
            (
                "  "
                + first.ljust(widths[0])
                + "".join(" " + c.rjust(w - 1) for c, w in zip(cells[1:], widths[1:], strict=True))
            ).rstrip()
        )
    return lines


def _quantiles(distribution: Distribution) -> list[str]:
    return [
        str(distribution.count),
        format_quantile(distribution, "p50", short=True),
        format_quantile(distribution, "p95", short=True),
        format_quantile(distribution, "p99", short=True),
        "n/a" if distribution.max is None else seconds(distribution.max),
    ]


def _within(distribution: Distribution, quantile: str = "p95") -> str:
    """The interval an estimated quantile lies in: `48–57 ms`, `43 ms–0.34 s`; `-` for a figure."""
    interval = distribution.interval(quantile)
    if interval is None:
        return "-"
    low, high = seconds(interval.low), seconds(interval.high)
    if (low.endswith(" ms") and high.endswith(" ms")) or (low.endswith(" s") and high.endswith(" s")):
        low = low.rsplit(" ", 1)[0]
    return f"{low}–{high}"


_WITHIN = "p95 within"
_WITHIN_WIDTH = 16


def _estimated(distributions: Iterable[Distribution]) -> bool:
    return any(distribution.intervals for distribution in distributions)


def _within_line(rows: Iterable[tuple[str, Distribution]]) -> list[str]:
    """Under a table of estimates: where each p95 lies (its 95 % interval, or its histogram bucket)."""
    said = [f"{name} {_within(distribution)}" for name, distribution in rows if distribution.intervals]
    return _wrap(f"p95 lies within: {'; '.join(said)}", "  ") if said else []


def _bounds_note(distributions: Iterable[Distribution | None]) -> list[str]:
    """Under a table with quantiles that are only bounds: what `≤` means there."""
    bounds = [bound for d in distributions if d is not None for bound in d.bounds]
    if not bounds:
        return []
    if all(bound.first_bucket for bound in bounds):
        where = "the histogram's first bucket (from 0)"
    else:
        where = "a histogram bucket wider than the figure itself (the first bucket, from 0, always is)"
    return _wrap(
        f"≤ X: the quantile falls in {where}; interpolating inside it would invent a figure, so only the "
        "bucket's upper bound is given",
        "  ",
    )


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _ratio(value: float | None) -> str:
    return f"{value:.1f}x" if value is not None else "n/a"


def _server_histograms(report: Report) -> list[str]:
    """vLLM's own histograms per model (Prometheus source): its side, with or without server spans."""
    out: list[str] = []
    for histograms in report.server_histograms:
        out.append("")
        out.append(
            f"vLLM's own histograms for model {histograms.model} (server side, no server spans needed)"
        )
        rows = [
            [label, *_quantiles(distribution)]
            for label, distribution in (
                ("server queue", histograms.queue), ("prefill", histograms.prefill),
                ("time to first token", histograms.time_to_first_token),
                ("between tokens", histograms.inter_token),
            )
            if distribution is not None
        ]  # fmt: skip
        out += _table(["part", *_QUANTILE_HEADERS], rows)
        out += _bounds_note(
            (histograms.queue, histograms.prefill, histograms.time_to_first_token, histograms.inter_token)
        )
    return out


def render(report: Report, comparison: Comparison | None = None) -> str:
    """The whole report; every section that has nothing to say is left out."""
    out: list[str] = []
    source = ", ".join(report.sources) or "(no source)"
    out.append(f"llmspans report: {report.traces} traces, {report.llm_calls} LLM calls, {report.spans} spans")
    out += _wrap(f"from {source}", "")
    out += _wrap(f"quantiles: {report.quantile_method}; never means", "")
    if report.skipped:
        lines = ", ".join(str(skip.line) for skip in report.skipped[:20])
        more = f" and {len(report.skipped) - 20} more" if len(report.skipped) > 20 else ""
        out += _wrap(f"skipped {len(report.skipped)} unreadable lines: {lines}{more}", "")
    for note in report.notes:
        out += _wrap(f"note: {note}", "")
    if not report.traces:
        out.append("")
        out.append("No llmspans traces found: nothing to report.")
        out += _server_histograms(report)  # a vLLM server Prometheus scrapes still says its side
        return "\n".join(out) + "\n"

    triage = report.triage
    if triage is not None:
        out.append("")
        label = part_label(triage.dominant_kind, triage.dominant)
        if not triage.told:
            leader, other = triage.compared
            out.append(f"Dominant at p95: cannot tell ({leader.label} or {other.label})")
        else:
            within = ""
            if triage.compared and triage.compared[0].low != triage.compared[0].high:
                within = f" ({seconds(triage.compared[0].low)} to {seconds(triage.compared[0].high)})"
            out.append(f"Dominant at p95: {label}, {seconds(triage.dominant_p95)} per request{within}")
        out += _wrap(triage.message)
        for note in triage.notes:
            out += _wrap(f"also: {note}")

    out.append("")
    out.append("Stages (span durations)")
    rows = []
    for row in report.stages:
        budget = "-" if row.budget is None else seconds(row.budget) + ("*" if row.budget_varies else "")
        exceeded = "-" if row.budget is None else f"{row.exceeded}/{row.budgeted}"
        rows.append([row.stage, *_quantiles(row.durations), budget, exceeded])
    out += _table(["stage", *_QUANTILE_HEADERS, "budget", "exceeded"], rows)
    out += _within_line((row.stage, row.durations) for row in report.stages)
    out += _bounds_note(row.durations for row in report.stages)
    if any(row.budget_varies for row in report.stages):
        out.append(
            "  * budgets differ between spans; the most common one is shown, each span counted against its own"
        )

    if report.buckets:
        out.append("")
        out.append("LLM call buckets (per call)")
        out += _table(
            ["bucket", *_QUANTILE_HEADERS, "of p95"],
            ([row.bucket, *_quantiles(row.values), f"{row.share_p95:.0%}"] for row in report.buckets),
        )
        out += _within_line((row.bucket, row.values) for row in report.buckets)
        out += _bounds_note(row.values for row in report.buckets)

    if report.parts:
        out.append("")
        out.append("Where a request's time goes (per trace: stages' own time, buckets summed)")
        estimated = _estimated(part.per_trace for part in report.parts)
        out += _table(
            ["part", "p50", "p95", "p99"] + ([_WITHIN] if estimated else []),
            (
                [
                    part.label,
                    format_quantile(part.per_trace, "p50", short=True),
                    format_quantile(part.per_trace, "p95", short=True),
                    format_quantile(part.per_trace, "p99", short=True),
                ]
                + ([_within(part.per_trace)] if estimated else [])
                for part in report.parts
            ),
            last_width=_WITHIN_WIDTH if estimated else 9,
        )

    if report.levels:
        out.append("")
        out.append("Load levels (calls made by llmspans load): call duration, and each bucket's p95")
        out += _table(
            ["level", "calls", "failed", "p50", "p95", "queue", "first_tok", "stream", "dominant"],
            (
                [row.label, str(row.calls), str(row.failed), seconds(row.durations.p50), seconds(row.durations.p95),
                 seconds(row.buckets_p95["queue"]), seconds(row.buckets_p95["first_token"]),
                 seconds(row.buckets_p95["stream"]), row.dominant]
                for row in report.levels
            ),
            first_width=22,
        )  # fmt: skip

    if report.llm_calls:
        out.append("")
        variability = report.variability
        over = (
            f"over the {variability.calls} {variability.over}"
            if variability.calls is not None
            else f"over {variability.over}"
        )
        if variability.calls == 0:
            out += _wrap("TTFT vs stream variability: no streamed calls to compare", "")
        else:
            out += _wrap(
                f"TTFT vs stream variability {over} (p95/p50): first_token "
                f"{_ratio(variability.first_token_spread)}, stream {_ratio(variability.stream_spread)}; "
                f"first_token varies {_ratio(variability.ratio)} as much",
                "",
            )
        connections = report.connections
        churn = f"{connections.per_success:.2f}" if connections.per_success is not None else "n/a"
        reused = (
            f"; the final attempt reused a pooled connection in {connections.reused_final} of {connections.calls}"
            if connections.reused_final is not None
            else ""
        )
        by_kind = [
            f"{name} {kind.per_success:.2f} ({kind.new_connections} new, {kind.successful} successful)"
            for name, kind in (("streamed", connections.streamed), ("non-streamed", connections.not_streamed))
            if kind is not None and kind.per_success is not None
        ]
        kinds = f"; by the calls that opened them: {', '.join(by_kind)}" if by_kind else ""
        out += _wrap(
            f"Connection churn: {churn} new connections per successful call ({connections.new_connections} new, "
            f"{connections.successful} successful calls{reused}){kinds}",
            "",
        )
        retries = report.retries
        per_success = (
            f"{retries.attempts_per_success:.2f}" if retries.attempts_per_success is not None else "n/a"
        )
        causes = ", ".join(f"{cause} ×{count}" for cause, count in retries.causes.items()) or "none"
        retried = f", {retries.retried_calls} calls retried" if retries.retried_calls is not None else ""
        wasted = (
            f"; wasted output tokens: {retries.wasted_output_tokens}"
            if retries.wasted_output_tokens is not None
            else ""
        )
        out += _wrap(
            f"Retry amplification: {per_success} attempts per success ({retries.attempts} attempts, "
            f"{retries.successful} successes, {retries.failed} failed calls{retried}); causes: {causes}{wasted}",
            "",
        )

    for limiter in report.limiters:
        calls = f", {limiter.calls} calls" if limiter.calls is not None else ""
        on_entry = (
            f", p95 on entry {limiter.queue_depth_on_entry.p95:.0f}"
            if limiter.queue_depth_on_entry is not None
            else ""
        )
        out += _wrap(
            f"Limiter '{limiter.name}' (cap {limiter.cap}{calls}): backlog during "
            f"{seconds(limiter.backlog_s)} of {seconds(limiter.window_s)}; gap_fraction {limiter.gap_fraction:.2f} "
            f"(in-flight below the cap while calls waited); queue depth mean {limiter.mean_queue_depth:.1f}, "
            f"max {limiter.max_queue_depth}{on_entry}; "
            f"in-flight mean {limiter.mean_in_flight:.1f}",
            "",
        )

    out += _levers(report)

    server = report.server
    if server is not None:
        out.append("")
        engines = f"; vLLM's {' and '.join(server.engines)} engine" if server.engines else ""
        kinds = (
            f": {server.streamed_calls} streamed, {server.calls - server.streamed_calls} not"
            if 0 < server.streamed_calls < server.calls
            else ""
        )
        out.append(
            f"first_token split by the server's llm_request spans ({server.calls} calls{kinds}{engines})"
        )
        out += _table(
            ["part", *_QUANTILE_HEADERS],
            ([row.label, *_quantiles(row.values)] for row in server.rows if row.bucket == "first_token"),
        )
        stream_rows = [row for row in server.rows if row.bucket == "stream"]
        if stream_rows:
            out.append("")
            out.append(f"stream split by the same spans ({server.streamed_calls} streamed calls)")
            out += _table(
                ["part", *_QUANTILE_HEADERS], ([row.label, *_quantiles(row.values)] for row in stream_rows)
            )
        for note in server.notes:
            out += _wrap(f"note: {note}", "")

    out += _server_histograms(report)

    for gauges in report.server_gauges:
        out += _wrap(
            f"vLLM server {gauges.server}: requests waiting max {_number(gauges.waiting_max)} (mean "
            f"{_number(gauges.waiting_mean)}), running max {_number(gauges.running_max)} (mean "
            f"{_number(gauges.running_mean)}), KV-cache usage max {_share(gauges.kv_cache_usage_max)}",
            "",
        )

    if report.slowest:
        out.append("")
        out.append("Slowest traces")
        out.append(f"  {'duration':>9}  {'dominant part':<34} {'trace id':<32}  root")
        for slow in report.slowest:
            dominant = (
                f"{seconds(slow.dominant_s):>9} {_cut(part_label(slow.dominant_kind, slow.dominant), 24)}"
            )
            line = f"  {seconds(slow.duration_s):>9}  {dominant:<34} {slow.trace_id:<32}  "
            out.append(line + _cut(slow.root, max(8, WIDTH - len(line))))
    if report.exemplars:
        out.append("")
        out.append(
            "Slow requests (exemplars: Prometheus keeps no trace list; these are the traces behind the slowest"
        )
        out.append("histogram points)")
        for exemplar in report.exemplars:
            where = exemplar.link or exemplar.trace_id
            out.append(f"  {seconds(exemplar.value_s):>9}  {_cut(exemplar.series, 30):<30}  {where}")
    if comparison is not None:
        out += _comparison(comparison)
    return "\n".join(out) + "\n"


def _levers(report: Report) -> list[str]:
    """What the prompt caps and caches did (docs/levers.md), a paragraph each after one blank line."""
    out: list[str] = []
    caps = report.prompt_caps
    if caps is not None:
        refused = f", {caps.refused} of them refused before sending" if caps.refused else ""
        text = f"Prompt caps: {caps.over} of {caps.calls} capped calls over the cap ({caps.share_over:.0%}){refused}"
        over, under = caps.first_token_over, caps.first_token_under
        if over is not None and under is not None:
            text += (
                f"; first_token p95 {seconds(over.p95)} over the cap ({over.count} answered) against "
                f"{seconds(under.p95)} under it ({under.count}), p50 {seconds(over.p50)} against {seconds(under.p50)}"
            )
        elif over is not None:
            text += (
                f"; first_token p95 {seconds(over.p95)} over the cap ({over.count} answered), none under it"
            )
        elif under is not None:
            text += (
                f"; first_token p95 {seconds(under.p95)} under the cap ({under.count} answered), none over it"
            )
        ratio = caps.estimate_ratio
        if ratio is not None:
            text += (
                f"; the estimate against the server's input tokens p50 {ratio.p50:.2f}x, p95 {ratio.p95:.2f}x "
                f"({', '.join(caps.estimators) or 'estimator not recorded'})"
            )
        out += _wrap(text, "")
    for cache in report.caches:
        failed = f", {cache.errors} failed" if cache.errors else ""
        text = f"Cache '{cache.name}': {cache.hits} of {cache.lookups} lookups hit ({cache.hit_rate:.0%}){failed}"
        if cache.hits:
            text += (
                f"; saved about {seconds(cache.saved_s)} of LLM time ({cache.hits_estimated} of {cache.hits} hits "
                "with an estimate: the p50 of the process's own recent calls)"
            )
        if cache.lookup is not None:
            text += f"; lookups p50 {seconds(cache.lookup.p50)}, p95 {seconds(cache.lookup.p95)}"
        hit, miss = cache.with_hit, cache.with_miss
        if hit is not None and miss is not None:
            text += (
                f"; requests with a hit p50 {seconds(hit.p50)}, p95 {seconds(hit.p95)} ({hit.count}) against p50 "
                f"{seconds(miss.p50)}, p95 {seconds(miss.p95)} with only misses ({miss.count})"
            )
        elif hit is not None or miss is not None:
            only, which = (hit, "a hit") if hit is not None else (miss, "only misses")
            assert only is not None
            text += f"; requests with {which} p50 {seconds(only.p50)}, p95 {seconds(only.p95)} ({only.count})"
        out += _wrap(text, "")
    if report.hedging is not None:
        out += _wrap(_hedging(report.hedging), "")
    return ["", *out] if out else []


def _hedging(hedging: Hedging) -> str:
    """'Hedging: fired on 8% of calls and the backup won 6%; p95 first_token of hedged calls 0.41 s; their
    primaries' own time ...; it cost 8% more input tokens', with what each figure stands on."""
    after = hedging.after
    went_by = f" (after p50 {seconds(after.p50)})" if after is not None else ""
    text = (
        f"Hedging: fired on {hedging.share_fired:.0%} of {hedging.calls} calls that could be hedged{went_by} and "
        f"the backup won {hedging.share_won:.0%}"
    )
    if hedging.first_token is not None:
        text += f"; p95 first_token of hedged calls {seconds(hedging.first_token.p95)}"
        first, cut = hedging.primaries_first, hedging.primaries_cut
        own = []
        if first is not None:
            own.append(f"p95 {seconds(first.p95)} where they got there first ({first.count})")
        if cut is not None:
            own.append(
                f"where the backup won ({cut.count}), unknown: stopped with none yet after p50 {seconds(cut.p50)}, "
                f"p95 {seconds(cut.p95)} (a lower bound)"
            )
        if own:
            text += f", and their primaries' own time to a first token: {'; '.join(own)}"
    extra = hedging.extra_input
    if extra is not None:
        text += f"; it cost {extra:.0%} more input tokens ({hedging.wasted_input_tokens} of {hedging.input_tokens})"
    else:
        text += f"; it cost {hedging.wasted_input_tokens} input tokens"
    if hedging.wasted_output_tokens:
        text += f" and {hedging.wasted_output_tokens} output tokens"
    if hedging.skipped:
        plural = "s" if hedging.skipped > 1 else ""
        text += f"; {hedging.skipped} backup{plural} not sent: the limiter had no free slot"
    return text


def _number(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def _share(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0%}"


def _signed(value: float) -> str:
    return ("+" if value > 0 else "-" if value < 0 else "±") + seconds(abs(value))


def _comparison(comparison: Comparison) -> list[str]:
    out = ["", *_wrap(f"Compared with {comparison.before} (before) → {comparison.after} (after)", "")]
    out += _wrap(comparison.method, "")
    if comparison.dominant_before != comparison.dominant_after:
        out += _wrap(
            f"dominant at p95: {comparison.dominant_before} before, {comparison.dominant_after} after", ""
        )
    else:
        out += _wrap(f"dominant at p95: {comparison.dominant_after}, before and after", "")
    rows = []
    for change in comparison.changes:
        ci = (
            f"{_signed(change.low_s)}..{_signed(change.high_s)}"
            if change.low_s is not None and change.high_s is not None
            else "-"
        )
        rows.append([f"{change.name} ({change.kind})", change.quantile, seconds(change.before_s),
                     seconds(change.after_s), _signed(change.change_s), ci, change.verdict])  # fmt: skip
    out += _change_table(rows)
    real = sorted((change for change in comparison.changes if change.real), key=lambda c: -abs(c.change_s))
    if real:
        out += _wrap("real changes: " + ", ".join(f"{c.name} {c.quantile} {c.verdict} by "
                                                  f"{seconds(abs(c.change_s))}" for c in real), "")  # fmt: skip
    elif comparison.changes and comparison.changes[0].low_s is not None:
        out += _wrap("no change is larger than the noise", "")
    return out


def _change_table(rows: list[list[str]]) -> list[str]:
    headers = ["part", "q", "before", "after", "change", "95% interval", "verdict"]
    widths = [26, 4, 9, 9, 10, 22]
    lines = []
    for cells in [headers, *rows]:
        line = "  " + _cut(cells[0], widths[0]).ljust(widths[0])
        line += "".join(cell.rjust(width) for cell, width in zip(cells[1:6], widths[1:], strict=True))
        lines.append(f"{line}  {cells[6]}".rstrip())
    return lines
