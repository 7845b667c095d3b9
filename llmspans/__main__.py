"""The `llmspans` command (also `python -m llmspans`): `llmspans report ...` and `llmspans demo ...`.

Exit codes: 0 when a report was printed (an empty one included), 2 when the input or the
arguments could not be used; the reason is one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from llmspans import _budget
from llmspans import _names as names
from llmspans._report import Report, analyse
from llmspans._report_input import Loaded, ReportInputError, fetch_jaeger, parse_since, read_files, select
from llmspans._report_text import WIDTH

EXIT_OK = 0
EXIT_BAD_INPUT = 2
DEFAULT_JAEGER_SINCE_S = 3600.0


class _Usage(Exception):
    """Arguments that parse but do not fit together; the message says what to pass."""


def _parser() -> argparse.ArgumentParser:
    from llmspans._demo import DEFAULT_CONCURRENCY, DEFAULT_REQUESTS, DEFAULT_SEED, SCENARIOS

    parser = argparse.ArgumentParser(
        prog="llmspans", description="Where an LLM request's time goes: read the spans, or watch a demo."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="{report,demo}")
    report = commands.add_parser(
        "report",
        help="per-stage and per-bucket p50/p95/p99 against budgets, and what to fix first",
        description=(
            "Read OTLP-JSON spans (the embedded default's file, or Jaeger v2's /api/v3 query API) and print "
            "per-stage and per-bucket p50/p95/p99 against budgets, the dominant part at p95 with its triage "
            "rule, TTFT vs stream variability, connection churn, retry amplification, limiter gap_fraction "
            "and the slowest traces."
        ),
    )
    report.add_argument(
        "files", nargs="*", metavar="FILE",
        help=f"OTLP-JSON lines files (default: ${names.ENV_TRACES_FILE} or ./{names.DEFAULT_TRACES_FILE})",
    )  # fmt: skip
    report.add_argument("--jaeger", metavar="URL", help="read from Jaeger v2, e.g. http://localhost:16686")
    report.add_argument(
        "--service", metavar="NAME", help="only traces of this service (required with --jaeger)"
    )
    report.add_argument(
        "--since", metavar="DURATION", help="only traces started this recently: 90s, 30m, 1h, 2d"
    )
    report.add_argument("--budgets", metavar="SPEC", help="override budgets, e.g. 'retrieval=300ms,llm=1.6s'")
    report.add_argument("--json", action="store_true", help="print the report as one JSON document")
    report.add_argument("--html", metavar="OUT.html", help="also write a self-contained HTML page")
    report.add_argument("--top", type=int, default=5, metavar="N", help="how many slowest traces to list (5)")

    scenarios = "\n".join(f"  {name:<18} {scenario.injects}" for name, scenario in SCENARIOS.items())
    demo = commands.add_parser(
        "demo",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"scenarios (each injects one bottleneck):\n{scenarios}",
        help="run a small RAG chat app against a simulated LLM server and report on it",
        description=textwrap.fill(
            "Run a small RAG chat app (retrieval, prompt, guardrail, tool, a streamed LLM call, post-processing, "
            "inside a turn with budgets, behind a limiter) against llmspans' built-in SIMULATED OpenAI-compatible "
            "server, with one known bottleneck injected, then print the report of the spans it produced.",
            79,
        ),
    )
    demo.add_argument(
        "--scenario", choices=list(SCENARIOS), default="healthy", help="the bottleneck to inject"
    )
    demo.add_argument("--requests", type=int, default=DEFAULT_REQUESTS, metavar="N", help="chat turns to run")
    demo.add_argument(
        "--concurrency", type=int, default=DEFAULT_CONCURRENCY, metavar="C", help="users at once"
    )
    demo.add_argument("--seed", type=int, default=DEFAULT_SEED, metavar="S", help="random seed")
    demo.add_argument(
        "--client", choices=("auto", "openai", "httpx"), default="auto",
        help="the LLM client: the openai SDK when installed (auto), or a plain httpx.AsyncClient",
    )  # fmt: skip
    demo.add_argument("--json", action="store_true", help="print the report as one JSON document")
    demo.add_argument(
        "--html", metavar="OUT.html", help="also write the report as a self-contained HTML page"
    )
    demo.add_argument("--top", type=int, default=5, metavar="N", help="how many slowest traces to list (5)")
    return parser


def _load(args: argparse.Namespace) -> Loaded:
    since = parse_since(args.since) if args.since else None
    if args.jaeger:
        if args.files:
            raise _Usage("pass FILE arguments or --jaeger URL, not both")
        if not args.service:
            raise _Usage("--jaeger needs --service NAME (Jaeger searches one service's traces)")
        return fetch_jaeger(args.jaeger, args.service, since or DEFAULT_JAEGER_SINCE_S)
    if args.files:
        paths = [Path(file) for file in args.files]
    else:
        default = Path(os.environ.get(names.ENV_TRACES_FILE) or names.DEFAULT_TRACES_FILE)
        if not default.exists():
            raise _Usage(
                f"no traces file at {default}: run an app that calls llmspans.configure() (or `llmspans demo`), "
                "or pass FILE or --jaeger URL"
            )
        paths = [default]
    loaded = read_files(paths)
    loaded.spans = select(loaded.spans, service=args.service, since_s=since)
    return loaded


def _warn_skipped(loaded: Loaded) -> None:
    by_source: dict[str, list[int]] = {}
    for skip in loaded.skipped:
        by_source.setdefault(skip.source, []).append(skip.line)
    for source, lines in by_source.items():
        first = next(skip for skip in loaded.skipped if skip.source == source)
        shown = ", ".join(str(line) for line in lines[:20]) + (" …" if len(lines) > 20 else "")
        print(
            f"llmspans report: skipped {len(lines)} line(s) of {source} ({shown}); line {first.line} is {first.reason}",
            file=sys.stderr,
        )


def emit(report: Report, *, as_json: bool, html: str | None) -> None:
    """Print the report (text or JSON) and write the HTML page if asked; OSError if it cannot be written."""
    if html:
        from llmspans._report_html import render as render_html

        Path(html).write_text(render_html(report), encoding="utf-8")
    if as_json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        from llmspans._report_text import render as render_text

        sys.stdout.write(render_text(report))
    if html:
        print(f"HTML report written to {html}", file=sys.stderr)


def _report(args: argparse.Namespace) -> int:
    try:
        if args.top < 0:
            raise _Usage(f"--top must be 0 or more, got {args.top}")
        budgets = _budget.parse_budgets(args.budgets, source="--budgets") if args.budgets else None
        loaded = _load(args)
    except (ReportInputError, ValueError, _Usage) as error:
        print(f"llmspans report: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    _warn_skipped(loaded)
    report = analyse(
        loaded.spans, budgets=budgets, top=args.top, sources=loaded.sources, skipped=loaded.skipped
    )
    try:
        emit(report, as_json=args.json, html=args.html)
    except OSError as error:
        print(f"llmspans report: cannot write {args.html}: {error.strerror or error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return EXIT_OK


def _say(stream: TextIO, text: str) -> None:
    print(textwrap.fill(text, WIDTH, subsequent_indent="  ", break_on_hyphens=False), file=stream)


def _demo(args: argparse.Namespace) -> int:
    """Configure, run the demo app, flush, then report on exactly the spans this run produced."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    import llmspans
    from llmspans._demo import SCENARIOS, SERVICE_PREFIX, Progress, run
    from llmspans._report_input import spans_of_readable

    scenario = SCENARIOS[args.scenario]
    say = sys.stderr if args.json else sys.stdout  # with --json, stdout holds the document alone
    service = SERVICE_PREFIX + scenario.name
    configuration = llmspans.configure(service_name=service)
    # A copy of this run's spans in memory: the report covers this run only, whatever else the
    # traces file holds, and works the same when the spans leave over OTLP.
    mine = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        provider.add_span_processor(SimpleSpanProcessor(mine))

    def started(url: str, client: str, cap: int, idle_slots: int) -> None:
        _say(say, f"llmspans demo, scenario '{scenario.name}': injects {scenario.injects}")
        held = f", {idle_slots} of them held idle by a background job" if idle_slots else ""
        _say(
            say,
            f"LLM: a SIMULATED OpenAI-compatible server at {url} (no real model), called through the {client} "
            f"client; {args.requests} chat turns, {args.concurrency} users at once, limiter cap {cap}{held}",
        )
        say.flush()

    progress = Progress(args.requests, sys.stderr, f"demo {scenario.name}")
    try:
        result = run(
            scenario, requests=args.requests, concurrency=args.concurrency, seed=args.seed, client=args.client,
            progress=progress, on_start=started,
        )  # fmt: skip
    except (ValueError, ImportError) as error:
        print(f"llmspans demo: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    progress.finish()
    if isinstance(provider, TracerProvider):
        provider.force_flush()
    failed = f" ({result.failed} failed)" if result.failed else ""
    _say(say, f"ran {result.turns} turns in {result.elapsed_s:.1f} s{failed}")
    if configuration.mode == "file" and configuration.traces_file is not None:
        _say(
            say,
            f"spans written to {configuration.traces_file}; read them again with: "
            f"llmspans report {configuration.traces_file} --service {service}",
        )
    elif configuration.mode == "otlp":
        _say(say, f"spans sent over OTLP to {configuration.endpoint or 'the OTEL_EXPORTER_OTLP_* endpoint'}")
    print(file=say)
    spans = spans_of_readable(mine.get_finished_spans())
    report = analyse(spans, top=args.top, sources=[f"this demo run ({service}, simulated LLM server)"])
    try:
        emit(report, as_json=args.json, html=args.html)
    except OSError as error:
        print(f"llmspans demo: cannot write {args.html}: {error.strerror or error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if not args.json:
        others = ", ".join(name for name in SCENARIOS if name != scenario.name)
        print()
        _say(sys.stdout, f"(simulated) try another bottleneck: llmspans demo --scenario {{{others}}}")
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `llmspans` console script."""
    args = _parser().parse_args(argv)
    if args.command == "report":
        return _report(args)
    return _demo(args)


if __name__ == "__main__":
    raise SystemExit(main())
