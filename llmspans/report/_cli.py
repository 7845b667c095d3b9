"""`llmspans report ...`: the arguments, the sources they name, and where the report is written.

Exit codes: 0 when a report was printed (an empty one included), 2 when the input or the arguments
could not be used; the reason is one line on stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

from llmspans import _budget
from llmspans import _names as names
from llmspans.report._analysis import analyse_batches
from llmspans.report._compare import Comparison, compare
from llmspans.report._model import Report, SkippedLine
from llmspans.report._sources import SpanSource, parse_duration
from llmspans.report._sources.file import FileSource
from llmspans.report._sources.jaeger import fetch_jaeger
from llmspans.report._sources.tempo import DEFAULT_LIMIT as DEFAULT_TEMPO_LIMIT
from llmspans.report._sources.tempo import fetch_tempo
from llmspans.report._spans import ReportInputError

EXIT_OK = 0
EXIT_BAD_INPUT = 2
DEFAULT_JAEGER_SINCE_S = 3600.0
DEFAULT_PROMETHEUS_SINCE_S = 3600.0
DEFAULT_TEMPO_SINCE_S = 3600.0
ENV_TEMPO_TENANT = "LLMSPANS_TEMPO_TENANT"
ENV_TEMPO_HEADERS = "LLMSPANS_TEMPO_HEADERS"  # OTEL_EXPORTER_OTLP_HEADERS' format: name=value,name=value
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")


class Usage(Exception):
    """Arguments that parse but do not fit together; the message says what to pass."""


def add_arguments(report: argparse.ArgumentParser) -> None:
    report.add_argument(
        "files", nargs="*", metavar="FILE",
        help=f"OTLP-JSON lines files (default: ${names.ENV_TRACES_FILE} or ./{names.DEFAULT_TRACES_FILE})",
    )  # fmt: skip
    report.add_argument(
        "--jaeger",
        metavar="URL",
        help="read from Jaeger v2, e.g. http://localhost:16686 (with --prometheus: link exemplars' traces there)",
    )
    report.add_argument(
        "--tempo",
        metavar="URL",
        help="read from Grafana Tempo, e.g. http://localhost:3200 (with --prometheus: link exemplars' traces there)",
    )
    report.add_argument(
        "--prometheus", metavar="URL",
        help="compute the triage from the metrics in Prometheus (or Mimir, Thanos, VictoriaMetrics), "
        "e.g. http://localhost:9090",
    )  # fmt: skip
    report.add_argument(
        "--service", metavar="NAME",
        help="only traces of this service (required with --jaeger and --tempo; the Prometheus job with --prometheus)",
    )  # fmt: skip
    report.add_argument(
        "--since",
        metavar="DURATION",
        help="only traces started this recently, or the Prometheus window: 90s, 30m, 1h, 2d",
    )
    report.add_argument(
        "--limit", metavar="N",
        help=f"with --tempo: read at most N traces, the search's limit ({DEFAULT_TEMPO_LIMIT})",
    )  # fmt: skip
    report.add_argument(
        "--tempo-tenant", metavar="ID",
        help=f"with --tempo: the X-Scope-OrgID of a multi-tenant Tempo (default ${ENV_TEMPO_TENANT})",
    )  # fmt: skip
    report.add_argument(
        "--header", action="append", metavar="'NAME: VALUE'",
        help=f"with --tempo: send this header, e.g. 'Authorization: Bearer ...' (repeatable; also "
        f"${ENV_TEMPO_HEADERS}=name=value,...); never printed",
    )  # fmt: skip
    report.add_argument(
        "--baseline", nargs="+", metavar="RUN",
        help="compare against a baseline run: a FILE, or with --prometheus a window WINDOW@AGO (e.g. 1h@1d, "
        "or @1d for the --since window a day earlier); two RUNs compare the first (before) with the second "
        "(after)",
    )  # fmt: skip
    report.add_argument("--budgets", metavar="SPEC", help="override budgets, e.g. 'retrieval=300ms,llm=1.6s'")
    report.add_argument("--json", action="store_true", help="print the report as one JSON document")
    report.add_argument("--html", metavar="OUT.html", help="also write a self-contained HTML page")
    report.add_argument("--top", type=int, default=5, metavar="N", help="how many slowest traces to list (5)")


@dataclass(frozen=True)
class _Options:
    budgets: dict[str, float] | None
    top: int
    service: str | None
    since_s: float | None
    jaeger: str | None = None  # with --prometheus: where exemplar traces link to
    tempo: str | None = None  # the same, for a Tempo


def _span_report(source: SpanSource, options: _Options, *, select: bool = True) -> Report:
    """The span report of one source; `select` keeps only --service's traces started within --since
    (Jaeger's search did that already)."""
    cutoff = None if options.since_s is None or not select else int((time.time() - options.since_s) * 1e9)
    if isinstance(source, FileSource):
        source.since_ns = cutoff  # a file's metric points too: only what they counted after it
    report = analyse_batches(
        source.batches,
        budgets=options.budgets,
        top=options.top,
        service=options.service if select else None,
        cutoff_ns=cutoff,
        sources=source.sources,
        skipped=lambda: tuple(source.skipped),
        metrics=lambda: source.metrics,
    )
    _warn_skipped(report.skipped)
    return report


def _files(args: argparse.Namespace) -> list[Path]:
    if args.files:
        return [Path(file) for file in args.files]
    default = Path(os.environ.get(names.ENV_TRACES_FILE) or names.DEFAULT_TRACES_FILE)
    if not default.exists():
        raise Usage(
            f"no traces file at {default}: run an app that calls llmspans.configure() (or `llmspans demo`), "
            "or pass FILE, --jaeger URL, --tempo URL or --prometheus URL"
        )
    return [default]


def _current(args: argparse.Namespace, options: _Options) -> Report:
    """The report of the run the arguments name (files, Jaeger, Tempo or Prometheus)."""
    if args.tempo and (args.files or args.jaeger):
        raise Usage("--tempo reads the traces itself: pass no FILE or --jaeger with it")
    if sum(bool(given) for given in (args.files, args.jaeger and not args.prometheus, args.prometheus)) > 1:
        raise Usage("pass FILE arguments, --jaeger URL, --tempo URL or --prometheus URL, only one of them")
    if args.prometheus:
        return _prometheus_report(args.prometheus, options, ago_s=0.0)
    if args.tempo:
        if not args.service:
            raise Usage("--tempo needs --service NAME (Tempo's search selects one service's traces)")
        traces = fetch_tempo(
            args.tempo, args.service, options.since_s or DEFAULT_TEMPO_SINCE_S, limit=_limit(args),
            tenant=args.tempo_tenant or os.environ.get(ENV_TEMPO_TENANT) or None, headers=tempo_headers(args),
        )  # fmt: skip
        # The window is Tempo's search's (start/end), as Jaeger's is; --service is applied again to what
        # came back (a no-op against Tempo's TraceQL selection), as for a file.
        report = _span_report(traces, dataclasses.replace(options, since_s=None))
        return dataclasses.replace(report, notes=(*report.notes, *traces.notes)) if traces.notes else report
    if args.jaeger:
        if not args.service:
            raise Usage("--jaeger needs --service NAME (Jaeger searches one service's traces)")
        page = fetch_jaeger(args.jaeger, args.service, options.since_s or DEFAULT_JAEGER_SINCE_S)
        return _span_report(page, options, select=False)
    source = FileSource(_files(args))
    source.check()
    return _span_report(source, options)


def _prometheus_report(url: str, options: _Options, *, ago_s: float, window_s: float | None = None) -> Report:
    from llmspans.report._sources.prometheus import query_report

    return query_report(
        url, service=options.service, window_s=window_s or options.since_s or DEFAULT_PROMETHEUS_SINCE_S,
        ago_s=ago_s, budgets=options.budgets, top=options.top, jaeger=options.jaeger, tempo=options.tempo,
    )  # fmt: skip


def _limit(args: argparse.Namespace) -> int:
    if args.limit is None:
        return DEFAULT_TEMPO_LIMIT
    try:
        limit = int(args.limit)
    except ValueError:
        limit = 0
    if limit < 1:
        raise Usage(f"--limit must be a whole number of traces, 1 or more, got {args.limit!r}")
    return limit


def tempo_headers(args: argparse.Namespace) -> list[tuple[str, str]]:
    """--header 'Name: value' (repeatable), after $LLMSPANS_TEMPO_HEADERS; a value is never echoed."""
    found: list[tuple[str, str]] = []
    for item in filter(None, (os.environ.get(ENV_TEMPO_HEADERS) or "").split(",")):
        name, equals, value = item.partition("=")
        if not equals or not _HEADER_NAME.match(name.strip()):
            raise Usage(f"${ENV_TEMPO_HEADERS} must look like 'authorization=Bearer%20...,name=value'")
        found.append((name.strip(), unquote(value.strip())))
    for item in args.header or ():
        name, colon, value = item.partition(":")
        if not colon or not _HEADER_NAME.match(name.strip()) or not value.strip():
            raise Usage("--header must look like 'Authorization: Bearer ...' (a name, a colon, a value)")
        found.append((name.strip(), value.strip()))
    return found


def _baseline(run: str, args: argparse.Namespace, options: _Options) -> Report:
    """One `--baseline` RUN: a window of the same Prometheus (`1h@1d`, `@1d`), or a file."""
    if "@" in run and not Path(run).exists():
        if not args.prometheus:
            raise Usage(f"--baseline {run!r} names a Prometheus window; it needs --prometheus URL")
        window, _, ago = run.partition("@")
        window_s = parse_duration(window, "--baseline's window") if window else None
        return _prometheus_report(args.prometheus, options, ago_s=parse_duration(ago, "--baseline's @AGO"),
                                  window_s=window_s)  # fmt: skip
    source = FileSource([Path(run)])
    source.check()
    # --service and --since select a file's traces too, unless they name a Prometheus job and window.
    return _span_report(source, options, select=not args.prometheus)


def _check_tempo_options(args: argparse.Namespace) -> None:
    """--tempo alone is a trace source; with --prometheus it is only where exemplars link to."""
    if args.tempo and args.jaeger and args.prometheus:
        raise Usage(
            "exemplars link to one place: pass --jaeger URL or --tempo URL with --prometheus, not both"
        )
    reads_tempo = bool(args.tempo) and not args.prometheus
    for given, option in (
        (args.limit, "--limit"),
        (args.tempo_tenant, "--tempo-tenant"),
        (args.header, "--header"),
    ):
        if given is not None and not reads_tempo:
            raise Usage(
                f"{option} goes with --tempo URL, when the report reads its traces from Tempo"
                + (" (with --prometheus, Tempo is only where exemplars link to)" if args.tempo else "")
            )


def _warn_skipped(skipped: Sequence[SkippedLine]) -> None:
    by_source: dict[str, list[SkippedLine]] = {}
    for skip in skipped:
        by_source.setdefault(skip.source, []).append(skip)
    for source, lines in by_source.items():
        shown = ", ".join(str(skip.line) for skip in lines[:20]) + (" …" if len(lines) > 20 else "")
        print(
            f"llmspans report: skipped {len(lines)} line(s) of {source} ({shown}); line {lines[0].line} is "
            f"{lines[0].reason}",
            file=sys.stderr,
        )


def emit(report: Report, *, as_json: bool, html: str | None, comparison: Comparison | None = None) -> None:
    """Print the report (text or JSON) and write the HTML page if asked; OSError if it cannot be written."""
    if html:
        from llmspans.report._html import render as render_html

        Path(html).write_text(render_html(report, comparison), encoding="utf-8")
    if as_json:
        import json

        document = report.to_dict()
        if comparison is not None:
            document["comparison"] = comparison.to_dict()
        print(json.dumps(document, indent=2))
    else:
        from llmspans.report._text import render as render_text

        sys.stdout.write(render_text(report, comparison))
    if html:
        print(f"HTML report written to {html}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    """`llmspans report` with parsed arguments."""
    try:
        if args.top < 0:
            raise Usage(f"--top must be 0 or more, got {args.top}")
        if args.baseline and len(args.baseline) > 2:
            raise Usage(
                f"--baseline takes one RUN (compared with the input) or two (before, after), got {len(args.baseline)}"
            )
        options = _Options(
            budgets=_budget.parse_budgets(args.budgets, source="--budgets") if args.budgets else None,
            top=args.top,
            service=args.service,
            since_s=parse_duration(args.since) if args.since else None,
            jaeger=args.jaeger,
            tempo=args.tempo,
        )
        _check_tempo_options(args)
        comparison = None
        if args.baseline and len(args.baseline) == 2:
            if args.files or args.jaeger or (args.tempo and not args.prometheus):
                raise Usage(
                    "--baseline A B compares two runs by themselves: pass no FILE, --jaeger or --tempo with it"
                )
            before = _baseline(args.baseline[0], args, options)
            report = _baseline(args.baseline[1], args, options)
            comparison = compare(before, report, before_name=args.baseline[0], after_name=args.baseline[1])
        else:
            report = _current(args, options)
            if args.baseline:
                before = _baseline(args.baseline[0], args, options)
                comparison = compare(before, report, before_name=args.baseline[0], after_name="this run")
    except (ReportInputError, ValueError, Usage) as error:
        print(f"llmspans report: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        emit(report, as_json=args.json, html=args.html, comparison=comparison)
    except OSError as error:
        print(f"llmspans report: cannot write {args.html}: {error.strerror or error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return EXIT_OK
