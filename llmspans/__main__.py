"""The `llmspans` command (also `python -m llmspans`): `llmspans report ...`, `llmspans demo ...` and
`llmspans load ...`.

Exit codes: 0 when a report was printed (an empty one included), 2 when the input or the
arguments could not be used; the reason is one line on stderr. `llmspans load` also exits 130 when
Ctrl-C stopped it, after printing what it had.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Sequence
from typing import TextIO

from llmspans.load import _cli as load_cli
from llmspans.report import _cli as report_cli
from llmspans.report._cli import EXIT_BAD_INPUT, EXIT_OK, emit
from llmspans.report._text import WIDTH


def _parser() -> argparse.ArgumentParser:
    from llmspans.tools.demo import DEFAULT_CONCURRENCY, DEFAULT_REQUESTS, DEFAULT_SEED, SCENARIOS

    parser = argparse.ArgumentParser(
        prog="llmspans",
        description="Where an LLM request's time goes: read the spans, watch a demo, or load a server.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="{report,demo,load}")
    report = commands.add_parser(
        "report",
        help="per-stage and per-bucket p50/p95/p99 against budgets, and what to fix first",
        description=(
            "Read OTLP-JSON spans (the embedded default's file, Jaeger v2's /api/v3 query API, or Grafana Tempo's "
            "search and trace-by-id API), or the "
            "metrics in Prometheus, and print per-stage and per-bucket p50/p95/p99 against budgets, the dominant "
            "part at p95 with its triage rule, TTFT vs stream variability, connection churn, retry "
            "amplification, limiter gap_fraction and the slowest traces; --baseline compares two runs."
        ),
    )
    report_cli.add_arguments(report)

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
    demo.add_argument(
        "--hedge", action="store_true",
        help="hedge each LLM call after 150 ms (to the other replica in the slow-replica scenario)",
    )  # fmt: skip
    demo.add_argument(
        "--load", action="store_true",
        help="instead: start the simulator with 4 batch slots and run `llmspans load --provider vllm` against it, "
        "to see the knee and what grew there (--json and --html go to the load; needs llmspans[openai,vllm])",
    )  # fmt: skip

    load = commands.add_parser(
        "load",
        help="the latency curve under load, each request split into its buckets, and the knee named",
        description=textwrap.fill(
            "Drive an OpenAI-compatible endpoint through the instrumented openai client at rising load (closed "
            "loop: --concurrency; open loop: --rate; or --sweep), print TTFT, TPOT, ITL, e2e, throughput and "
            "each bucket's p95 per level, find the knee and name what grew there in the report's words. The "
            "spans go where configure() sends them, each call with its level, so `llmspans report` splits them.",
            79,
        ),
    )
    load_cli.add_arguments(load)
    return parser


def _say(stream: TextIO, text: str) -> None:
    print(textwrap.fill(text, WIDTH, subsequent_indent="  ", break_on_hyphens=False), file=stream)


def _demo(args: argparse.Namespace) -> int:
    """Configure, run the demo app, flush, then report on exactly the spans this run produced."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    import llmspans
    from llmspans.report._analysis import analyse
    from llmspans.report._spans import spans_of_readable
    from llmspans.tools.demo import SCENARIOS, SERVICE_PREFIX, Progress, run

    scenario = SCENARIOS[args.scenario]
    say = sys.stderr if args.json else sys.stdout  # with --json, stdout holds the document alone
    service = SERVICE_PREFIX + scenario.name + ("-hedged" if args.hedge else "")
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
        where = (
            f"{scenario.replicas} SIMULATED OpenAI-compatible servers (replicas, called in turn) at {url}"
            if scenario.replicas > 1
            else f"a SIMULATED OpenAI-compatible server at {url}"
        )
        hedged = "; each call hedged after 150 ms" if args.hedge else ""
        _say(
            say,
            f"LLM: {where} (no real model), called through the {client} client; {args.requests} chat turns, "
            f"{args.concurrency} users at once, limiter cap {cap}{held}{hedged}",
        )
        say.flush()

    progress = Progress(args.requests, sys.stderr, f"demo {scenario.name}")
    try:
        result = run(
            scenario, requests=args.requests, concurrency=args.concurrency, seed=args.seed, client=args.client,
            progress=progress, on_start=started, hedge=args.hedge,
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
        if scenario.replicas > 1 and not args.hedge:
            _say(
                sys.stdout,
                f"(simulated) the same turns with each call hedged to the other replica after 150 ms: llmspans "
                f"demo --scenario {scenario.name} --hedge; compare the two runs' files with llmspans report "
                "--baseline BEFORE AFTER",
            )
    return EXIT_OK


def _load_demo(args: argparse.Namespace) -> int:
    from llmspans.tools import load_demo

    if args.scenario != "healthy" or args.hedge:
        print(
            "llmspans demo: --load runs its own workload: leave out --scenario and --hedge", file=sys.stderr
        )
        return EXIT_BAD_INPUT
    extra = (["--json"] if args.json else []) + (["--html", args.html] if args.html else [])
    return load_demo.run(extra=extra)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `llmspans` console script."""
    args = _parser().parse_args(argv)
    if args.command == "report":
        return report_cli.run(args)
    if args.command == "load":
        return load_cli.run(args)
    if args.load:
        return _load_demo(args)
    return _demo(args)


if __name__ == "__main__":
    raise SystemExit(main())
