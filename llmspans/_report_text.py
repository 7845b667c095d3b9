"""The report as plain text for a terminal: fixed-width tables that fit in 100 columns."""

from __future__ import annotations

import textwrap
from collections.abc import Iterable, Sequence

from llmspans._report import Distribution, Report, part_label
from llmspans._report import format_seconds as seconds

WIDTH = 100
_QUANTILE_HEADERS = ("count", "p50", "p95", "p99", "max")


def _wrap(text: str, indent: str = "  ") -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=indent, subsequent_indent=indent + "  ")


def _table(headers: Sequence[str], rows: Iterable[Sequence[str]], first_width: int = 30) -> list[str]:
    widths = [first_width] + [9] * (len(headers) - 1)
    lines = []
    for cells in [headers, *rows]:
        first = cells[0] if len(cells[0]) <= first_width else cells[0][: first_width - 1] + "…"
        lines.append(
            (
                "  "
                + first.ljust(widths[0])
                + "".join(c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))
            ).rstrip()
        )
    return lines


def _quantiles(distribution: Distribution) -> list[str]:
    return [
        str(distribution.count),
        seconds(distribution.p50),
        seconds(distribution.p95),
        seconds(distribution.p99),
        seconds(distribution.max),
    ]


def _ratio(value: float | None) -> str:
    return f"{value:.1f}x" if value is not None else "n/a"


def render(report: Report) -> str:
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
        return "\n".join(out) + "\n"

    triage = report.triage
    if triage is not None:
        out.append("")
        label = part_label(triage.dominant_kind, triage.dominant)
        out.append(f"Dominant at p95: {label}, {seconds(triage.dominant_p95)} per request")
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

    if report.parts:
        out.append("")
        out.append("Where a request's time goes (per trace: stages' own time, buckets summed)")
        out += _table(
            ["part", "p50", "p95", "p99"],
            (
                [
                    part.label,
                    seconds(part.per_trace.p50),
                    seconds(part.per_trace.p95),
                    seconds(part.per_trace.p99),
                ]
                for part in report.parts
            ),
        )

    if report.llm_calls:
        out.append("")
        variability = report.variability
        out += _wrap(
            f"TTFT vs stream variability (p95/p50): first_token {_ratio(variability.first_token_spread)}, "
            f"stream {_ratio(variability.stream_spread)}; first_token varies {_ratio(variability.ratio)} as much",
            "",
        )
        connections = report.connections
        churn = f"{connections.per_success:.2f}" if connections.per_success is not None else "n/a"
        out += _wrap(
            f"Connection churn: {churn} new connections per successful call ({connections.new_connections} new, "
            f"{connections.successful} successful calls; the final attempt reused a pooled connection in "
            f"{connections.reused_final} of {connections.calls})",
            "",
        )
        retries = report.retries
        per_success = (
            f"{retries.attempts_per_success:.2f}" if retries.attempts_per_success is not None else "n/a"
        )
        causes = ", ".join(f"{cause} ×{count}" for cause, count in retries.causes.items()) or "none"
        out += _wrap(
            f"Retry amplification: {per_success} attempts per success ({retries.attempts} attempts, "
            f"{retries.successful} successes, {retries.failed} failed calls, {retries.retried_calls} calls "
            f"retried); causes: {causes}; wasted output tokens: {retries.wasted_output_tokens}",
            "",
        )

    for limiter in report.limiters:
        out += _wrap(
            f"Limiter '{limiter.name}' (cap {limiter.cap}, {limiter.calls} calls): backlog during "
            f"{seconds(limiter.backlog_s)} of {seconds(limiter.window_s)}; gap_fraction {limiter.gap_fraction:.2f} "
            f"(in-flight below the cap while calls waited); queue depth mean {limiter.mean_queue_depth:.1f}, "
            f"max {limiter.max_queue_depth}, p95 on entry {limiter.queue_depth_on_entry.p95:.0f}; "
            f"in-flight mean {limiter.mean_in_flight:.1f}",
            "",
        )

    server = report.server
    if server is not None:
        out.append("")
        out.append(f"first_token split by the server's llm_request spans ({server.calls} calls)")
        out += _table(
            ["part", *_QUANTILE_HEADERS],
            (
                ["first_token (client)", *_quantiles(server.first_token)],
                ["server queue", *_quantiles(server.server_queue)],
                ["prefill", *_quantiles(server.prefill)],
                ["network/other", *_quantiles(server.network_other)],
            ),
        )

    if report.slowest:
        out.append("")
        out.append("Slowest traces")
        for slow in report.slowest:
            label = part_label(slow.dominant_kind, slow.dominant)
            out.append(
                f"  {seconds(slow.duration_s):>9}  {slow.trace_id}  {slow.root[:22]:<22} "
                f"{label} {seconds(slow.dominant_s)}"[:WIDTH]
            )
    return "\n".join(out) + "\n"
