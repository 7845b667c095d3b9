"""`llmspans load ...`: the arguments, the question before a run against another host, and the output.

Exit codes: 0 when the run was reported, 1 when a worker process died or could not start, or every Ray
generator was lost (the levels before are printed, and the worker named), 2 when the arguments, the target
or the Ray cluster could not be used (one line on stderr, never a traceback), 130 when Ctrl-C stopped it
(what it had is printed all the same).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import os
import signal
import sys
import urllib.parse
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from llmspans import _names as names
from llmspans.load import _replay_cli as replay_cli
from llmspans.load._model import SHAPE_CONCURRENCY, SHAPE_RATE, Level, Result
from llmspans.load._requests import RequestRecord
from llmspans.load._workload import (
    DEFAULT_CONCURRENCY,
    DEFAULT_KNEE_FACTOR,
    DEFAULT_LEVEL_SECONDS,
    DEFAULT_MAX_REQUESTS,
    DEFAULT_MAX_SECONDS,
    DEFAULT_MAX_TOKENS,
    DEFAULT_PROMPT_TOKENS,
    DEFAULT_SEED,
    ENDPOINTS,
    Plan,
    Workload,
    parse_levels,
    parse_prompt_tokens,
    parse_slo,
    plan_words,
    prompts_from_file,
    prompts_from_traces,
)
from llmspans.report._model import format_seconds

if TYPE_CHECKING:
    from llmspans.load._model import GeneratorStats, LevelStats
    from llmspans.load._ray import Connection
    from llmspans.load._replay_cli import Replay
    from llmspans.load._replay_table import ReplayResult
    from llmspans.load._runner import Runner, RunOutcome

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
SERVICE_NAME = "llmspans-load"
MAX_WORKERS = 64  # processes of ~100 MB each: a bound, as every load of this command has one
INSTALL_OPENAI = "llmspans load needs the openai SDK: pip install 'llmspans[openai]'"
INSTALL_VLLM = (
    "--provider vllm reads the server's /metrics with prometheus-client: pip install 'llmspans[vllm]'"
)


class Usage(Exception):
    """Arguments that parse but cannot be used; the message says what to pass."""


def add_arguments(load: argparse.ArgumentParser) -> None:
    load.add_argument(
        "base_url", metavar="BASE_URL", help="the OpenAI-compatible API, e.g. http://127.0.0.1:8000/v1"
    )
    load.add_argument("--model", required=True, help="the model to ask for, as the server names it")
    load.add_argument(
        "--endpoint",
        choices=ENDPOINTS,
        default=None,
        help="chat completions (default), completions or responses (with --replay: where recorded chat calls go)",
    )
    load.add_argument(
        "--no-stream", action="store_true", help="ask for whole responses (no TTFT, TPOT or ITL then)"
    )
    shape = load.add_mutually_exclusive_group()
    shape.add_argument(
        "--concurrency", metavar="C,C,...",
        help=f"closed loop: this many users at once, per level (default {','.join(map(str, DEFAULT_CONCURRENCY))})",
    )  # fmt: skip
    shape.add_argument("--rate", metavar="R,R,...", help="open loop: requests per second, per level")
    load.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="open loop arrivals: 1 is Poisson; gamma shape otherwise",
    )
    load.add_argument(
        "--sweep", action="store_true",
        help="find the knee: double the load from the first level until it is past the knee or breaks an --slo, "
        "then sample levels in between",
    )  # fmt: skip
    load.add_argument("--requests", type=int, metavar="N", help="requests per level (default: 4 per user, at least 20; "
                      "open loop: 10 s of arrivals)")  # fmt: skip
    load.add_argument(
        "--level-seconds",
        type=float,
        metavar="S",
        help="a level issues for at most this long (60; a replay: its recorded span at its speed, plus 60)",
    )
    load.add_argument(
        "--max-requests",
        type=int,
        metavar="N",
        help="requests in the whole run (2000; a replay: its calls at every speed)",
    )
    load.add_argument(
        "--max-seconds",
        type=float,
        metavar="S",
        help="seconds for the whole run (600; a replay: each speed's level seconds, if more)",
    )
    load.add_argument(
        "--prompt-tokens",
        default=str(DEFAULT_PROMPT_TOKENS),
        metavar="N[,SD]",
        help="synthetic prompt length in words, with a spread (128)",
    )
    load.add_argument(
        "--max-tokens",
        type=int,
        metavar="N",
        help="output tokens asked per request (64; a replay: for a call with no recorded count)",
    )
    prompts = load.add_mutually_exclusive_group()
    prompts.add_argument("--prompts", metavar="FILE", help="JSON lines of chat messages to send in turn")
    prompts.add_argument(
        "--prompts-from",
        metavar="FILE",
        help="reuse the prompts of a traces file recorded with content capture on (with --replay: each "
        "recorded call sent with its own)",
    )
    load.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        metavar="N",
        help="every synthetic prompt starts with the same N words",
    )
    load.add_argument(
        "--seed", type=int, default=DEFAULT_SEED, help="random seed for prompts and arrivals (7)"
    )
    load.add_argument("--slo", metavar="SPEC", help="goodput under SLOs, e.g. ttft=500ms,tpot=50ms,e2e=2s")
    load.add_argument(
        "--knee-factor",
        type=float,
        default=DEFAULT_KNEE_FACTOR,
        help="the knee: p95 TTFT or e2e over this times the first level's (2)",
    )
    load.add_argument(
        "--provider", choices=("openai", "vllm"), default=None, help="vllm: also sample the server's /metrics"
    )
    load.add_argument(
        "--limiter-cap",
        type=int,
        metavar="N",
        help="put an llmspans.Limiter of this cap in front of the calls, as an app would",
    )
    load.add_argument(
        "--max-retries",
        type=int,
        default=2,
        metavar="N",
        help="retries per request, as the openai SDK retries (2)",
    )
    load.add_argument("--timeout", type=float, default=60.0, metavar="S", help="per request (60)")
    load.add_argument(
        "--client", choices=("httpx", "openai"), default="httpx",
        help="httpx (default): a plain httpx2 client on a lean transport; openai: the openai SDK, about 7x "
        "the CPU per streamed request",
    )  # fmt: skip
    load.add_argument(
        "--workers", default="auto", metavar="N|auto",
        help="processes sending a level's requests (auto: one per 50 requests/s of an open loop, at most one "
        "per CPU; 1 for a closed loop)",
    )  # fmt: skip
    load.add_argument(
        "--ray", nargs="?", const="", default=None, metavar="ADDRESS",
        help="send from generators on a Ray cluster (llmspans[ray]); ADDRESS as ray.init takes it: auto, "
        "HOST:6379, ray://HOST:10001 (default RAY_ADDRESS, else auto). The driver keeps the schedule",
    )  # fmt: skip
    load.add_argument(
        "--generators", metavar="N|per-cpu",
        help="with --ray: how many generators (Ray actors of one CPU each, spread over the nodes); per-cpu "
        "(default): one per CPU of the cluster",
    )  # fmt: skip
    load.add_argument(
        "--service", metavar="NAME",
        help=f"service name on the spans ({SERVICE_NAME}); with --replay, the recorded service to replay",
    )  # fmt: skip
    load.add_argument("--json", action="store_true", help="print the result as one JSON document")
    load.add_argument("--html", metavar="OUT.html", help="also write a self-contained HTML page")
    load.add_argument(
        "--yes", action="store_true", help="do not ask before a run against a host other than this one"
    )
    replay_cli.add_arguments(load)


def _local(base_url: str) -> bool:
    host = urllib.parse.urlsplit(base_url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _checks(args: argparse.Namespace) -> None:
    """What every run needs of its arguments, a replay's too: the URL, the client's own bounds, the workers."""
    parts = urllib.parse.urlsplit(args.base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise Usage(
            f"BASE_URL must be an http(s) URL such as http://127.0.0.1:8000/v1, got {args.base_url!r}"
        )
    if args.limiter_cap is not None and args.limiter_cap < 1:
        raise Usage(f"--limiter-cap must be 1 or more, got {args.limiter_cap}")
    if args.max_retries < 0:
        raise Usage(f"--max-retries must be 0 or more, got {args.max_retries}")
    if not args.timeout > 0:
        raise Usage(f"--timeout must be a positive number of seconds, got {args.timeout}")
    workers = parse_workers(args.workers)
    if args.ray is None and workers is not None and workers > 1 and args.limiter_cap is not None:
        raise Usage("--limiter-cap puts one Limiter in front of every call: it needs --workers 1")
    if args.ray is not None:
        if args.workers != "auto":
            raise Usage("--workers is for one machine: with --ray, --generators N says how many send")
        if urllib.parse.urlsplit(args.ray).scheme in ("http", "https"):
            raise Usage(f"--ray takes a Ray address, got {args.ray!r}: put BASE_URL first, or --ray=ADDRESS")
    elif args.generators is not None:
        raise Usage("--generators is for --ray (Ray actors); on one machine, --workers N")


def _plan(args: argparse.Namespace) -> tuple[Workload, Plan]:
    _checks(args)
    tokens, stddev = parse_prompt_tokens(args.prompt_tokens)
    given: tuple[list[dict[str, object]], ...] = ()
    source = None
    if args.prompts:
        given, source = prompts_from_file(args.prompts), args.prompts
    elif args.prompts_from:
        given, source = prompts_from_traces(args.prompts_from), args.prompts_from
    workload = Workload(
        model=args.model, endpoint=args.endpoint or "chat", stream=not args.no_stream,
        max_tokens=args.max_tokens if args.max_tokens is not None else DEFAULT_MAX_TOKENS,
        prompt_tokens=tokens, prompt_stddev=stddev, shared_prefix=args.shared_prefix, seed=args.seed,
        prompts=given, prompts_source=source,
    )  # fmt: skip
    shape = SHAPE_RATE if args.rate else SHAPE_CONCURRENCY
    spec = args.rate or args.concurrency or ",".join(map(str, DEFAULT_CONCURRENCY))
    levels = parse_levels(spec, shape)
    slo = parse_slo(args.slo) if args.slo else {}
    if not workload.stream and ({"ttft", "tpot"} & set(slo)):
        raise Usage("--slo ttft and tpot need streamed calls: leave out --no-stream or use e2e alone")
    if args.sweep and len(levels) > 1:
        raise Usage(
            "--sweep starts from one level (e.g. --concurrency 1 --sweep) and finds the others itself"
        )
    plan = Plan(
        shape=shape, levels=levels, sweep=args.sweep, requests_per_level=args.requests,
        level_seconds=DEFAULT_LEVEL_SECONDS if args.level_seconds is None else args.level_seconds,
        max_requests=DEFAULT_MAX_REQUESTS if args.max_requests is None else args.max_requests,
        max_seconds=DEFAULT_MAX_SECONDS if args.max_seconds is None else args.max_seconds,
        burstiness=args.burstiness, knee_factor=args.knee_factor, slo=slo,
    )  # fmt: skip
    return workload, plan


def parse_workers(spec: str) -> int | None:
    """`--workers`: a positive whole number, or `auto` (None)."""
    if spec == "auto":
        return None
    try:
        workers = int(spec)
    except ValueError:
        workers = 0
    if not 1 <= workers <= MAX_WORKERS:
        raise Usage(f"--workers takes a whole number from 1 to {MAX_WORKERS}, or auto; got {spec!r}")
    return workers


def _confirm(args: argparse.Namespace, workload: Workload, plan: Plan, stdin: TextIO) -> None:
    """Before a run against another host: the plan, then a question (a load test on a paid API costs money)."""
    if args.yes or _local(args.base_url):
        return
    host = urllib.parse.urlsplit(args.base_url).hostname
    print(f"llmspans load is about to send requests to {host}, which is not this machine:", file=sys.stderr)
    for line in plan_words(plan, workload):
        print(f"  {line}", file=sys.stderr)
    if not stdin.isatty():
        raise Usage(f"{host} is not this machine and there is no terminal to ask: pass --yes to run anyway")
    print("Go on? [y/N] ", end="", file=sys.stderr, flush=True)
    if stdin.readline().strip().lower() not in ("y", "yes"):
        raise Usage("not run: answer 'y' to go on, or pass --yes")


class _Progress:
    """One line per level on stderr: redrawn in place on a terminal, printed once at the level's end otherwise."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.live = stream.isatty()

    def __call__(self, level: Level, records: Sequence[RequestRecord], planned: int, final: bool) -> None:
        if not (final or self.live):
            return
        done = [record for record in records if record.done_ns]
        errors = sum(1 for record in done if not record.ok and not record.cancelled)
        ttfts = sorted(record.ttft_ns for record in done if record.ok and record.ttft_ns is not None)
        p95 = (
            f", p95 TTFT {format_seconds(ttfts[max(0, -(-95 * len(ttfts) // 100) - 1)] / 1e9)}"
            if ttfts
            else ""
        )
        line = f"{level.words}: {len(done)}/{planned} done{p95}, {errors} errors"
        if self.live:
            self.stream.write("\r\033[K" + line + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def run(args: argparse.Namespace, stdin: TextIO | None = None) -> int:
    """`llmspans load` with parsed arguments. Ctrl-C during the run stops it and prints what it has;
    outside that window (while the SDK imports, or a second Ctrl-C) it ends at once, with one line."""
    try:
        return _run(args, stdin)
    except KeyboardInterrupt:
        print("\nllmspans load: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _run(args: argparse.Namespace, stdin: TextIO | None) -> int:
    replay: Replay | None = None
    try:
        if args.ray is not None and args.replay is not None:
            raise Usage("--replay runs on one machine (--workers N spreads it), not on --ray yet")
        replay = replay_cli.prepare(args)
        workload: Workload
        if replay is not None:
            _checks(args)
            workload, plan = replay.plan(args)
        else:
            workload, plan = _plan(args)
        import openai  # noqa: F401  (only to say how to install it before anything starts)
    except ImportError:
        print(f"llmspans load: {INSTALL_OPENAI}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (ValueError, Usage) as error:
        print(f"llmspans load: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.provider == "vllm":
        try:
            import prometheus_client  # noqa: F401
        except ImportError:
            print(f"llmspans load: {INSTALL_VLLM}", file=sys.stderr)
            return EXIT_BAD_INPUT
    if args.ray is not None:
        from llmspans.load._ray import RayUnavailable, import_ray

        try:
            import_ray()
        except RayUnavailable as error:
            print(f"llmspans load: {error}", file=sys.stderr)
            return EXIT_BAD_INPUT
    try:
        _confirm(args, workload, plan, stdin or sys.stdin)
    except Usage as error:
        print(f"llmspans load: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    connection = None
    if args.ray is not None:
        from llmspans.load._ray import RayUnavailable, connect

        try:
            connection = connect(args.ray or None)
        except RayUnavailable as error:
            print(f"llmspans load: {error}", file=sys.stderr)
            return EXIT_BAD_INPUT
    try:
        return _load(args, workload, plan, replay, connection)
    finally:
        if connection is not None:
            connection.close()


def _load(
    args: argparse.Namespace, workload: Workload, plan: Plan, replay: Replay | None = None,
    connection: Connection | None = None,
) -> int:  # fmt: skip
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    import llmspans
    from llmspans.load._runner import LoadError, Runner, new_run_id
    from llmspans.load._workers import WorkerExport, workers_words

    service = SERVICE_NAME if replay is not None or not args.service else args.service
    configuration = llmspans.configure(service_name=service)
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        print(
            "llmspans load: the global tracer provider is not the OpenTelemetry SDK's: run it on its own",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    server_metrics = None
    if args.provider == "vllm":
        from llmspans.vllm import ServerMetrics

        server_metrics = ServerMetrics(args.base_url, interval=0.25)
    limiter = (
        llmspans.Limiter(args.limiter_cap, name="load") if args.limiter_cap and connection is None else None
    )
    workers = parse_workers(args.workers) if connection is None else 1
    if configuration.mode == "existing" and connection is not None:
        print(
            "llmspans load: --ray needs configure()'s own exporters (the spans here go to a provider set up "
            "before it)",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    if configuration.mode == "existing" and workers != 1:
        if workers is not None:
            print(
                "llmspans load: --workers needs configure()'s own exporters (the spans here go to a provider "
                "set up before it): pass --workers 1",
                file=sys.stderr,
            )
            return EXIT_BAD_INPUT
        workers = 1
    export = WorkerExport(service, configuration.traces_file if configuration.mode == "file" else None)
    run_id = new_run_id()
    api_key = os.environ.get("OPENAI_API_KEY") or "none"
    if replay is not None:  # what the server counts per word, before the requests are sized by it
        workload = replay.measure(args, api_key, run_id)
    # The plan on stderr with the progress lines: stdout holds the result alone.
    print(f"llmspans load: {args.base_url}, model {workload.model}, run {run_id}", file=sys.stderr)
    fleet = None
    if connection is not None:
        from llmspans.load._ray import Fleet, generator_setups, generators_for

        try:
            count = generators_for(args.generators or "per-cpu", connection.cpus())
        except ValueError as error:
            print(f"llmspans load: {error}", file=sys.stderr)
            return EXIT_BAD_INPUT
        setups = generator_setups(
            workload, base_url=args.base_url, api_key=os.environ.get("OPENAI_API_KEY") or "none",
            provider=args.provider, max_retries=args.max_retries, timeout=args.timeout, run_id=run_id,
            service_name=service, client=args.client, limiter_cap=args.limiter_cap,
            file_export=configuration.mode == "file",
        )  # fmt: skip
        fleet = Fleet(connection, count, setups)
    for line in plan_words(plan, workload):
        print(f"  {line}", file=sys.stderr)
    if fleet is not None and connection is not None:
        print(f"  generators: {fleet.count} Ray actors of one CPU each, spread over the nodes of {connection.address}",
              file=sys.stderr)  # fmt: skip
        if args.limiter_cap:
            print(f"  limiter: a cap of {args.limiter_cap} per generator ({args.limiter_cap * fleet.count} in flight "
                  "at most over all)", file=sys.stderr)  # fmt: skip
    else:
        print(f"  {workers_words(workers)}", file=sys.stderr)
    runner = Runner(
        workload, plan, base_url=args.base_url, tracer_provider=provider, api_key=api_key,
        provider=args.provider, limiter=limiter, server_metrics=server_metrics, max_retries=args.max_retries,
        timeout=args.timeout, client=args.client, run_id=run_id, progress=_Progress(sys.stderr), workers=workers, export=export,
        notice=lambda line: print(f"llmspans load: {line}", file=sys.stderr), fleet=fleet,
    )  # fmt: skip
    try:
        outcome = asyncio.run(_main(runner))
    except LoadError as error:
        print(f"llmspans load: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    finally:
        if server_metrics is not None:
            server_metrics.close()
        provider.force_flush()
    notes = list(outcome.notes)
    if fleet is not None:
        from llmspans.load._ray import notes as generator_notes
        from llmspans.load._ray import passed_environment

        notes += generator_notes(outcome.generators, passed_environment(), fleet.driver_node())
    result = build_result(
        outcome.levels, workload=workload, plan=plan, target=args.base_url, run_id=run_id,
        interrupted=outcome.interrupted, notes=notes, generators=outcome.generators,
        replay=replay.result(outcome.records) if replay is not None else None,
    )  # fmt: skip
    try:
        emit(result, as_json=args.json, html=args.html)
    except OSError as error:
        print(f"llmspans load: cannot write {args.html}: {error.strerror or error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if configuration.mode == "file" and configuration.traces_file is not None:
        print(
            f"spans written to {configuration.traces_file}, each call with {names.LOAD_LEVEL} and "
            f"{names.LOAD_RUN_ID}={run_id}; read them again with: llmspans report {configuration.traces_file}",
            file=sys.stderr,
        )
    elif configuration.mode == "otlp":
        print(
            f"spans sent over OTLP to {configuration.endpoint or 'the OTEL_EXPORTER_OTLP_* endpoint'}",
            file=sys.stderr,
        )
    if outcome.failure is not None:
        print(f"llmspans load: {outcome.failure}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_INTERRUPTED if outcome.interrupted else EXIT_OK


async def _main(runner: Runner) -> RunOutcome:
    """The run, with Ctrl-C stopping it gracefully the first time (and the usual way the second)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def interrupted() -> None:
        stop.set()
        loop.remove_signal_handler(signal.SIGINT)
        print("\nllmspans load: stopping (Ctrl-C again to abort)", file=sys.stderr)

    with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread, or no signals here
        loop.add_signal_handler(signal.SIGINT, interrupted)
    return await runner.run(stop)


def build_result(
    levels: Sequence[LevelStats], *, workload: Workload, plan: Plan, target: str, run_id: str, interrupted: bool,
    notes: Sequence[str] = (), generators: Sequence[GeneratorStats] = (), replay: ReplayResult | None = None,
) -> Result:  # fmt: skip
    from llmspans.load._verdict import find_knee, summary, verdict

    stats = sorted(levels, key=lambda level: level.level.value)
    knee = find_knee(stats, plan.knee_factor)
    said = verdict(stats, knee) if knee is not None else None
    return Result(
        target=target, model=workload.model, endpoint=workload.endpoint, stream=workload.stream, shape=plan.shape,
        run_id=run_id, workload=workload.describe(), levels=tuple(stats), knee=knee, verdict=said,
        summary=summary(knee, said, stats, plan.knee_factor), slo=dict(plan.slo), interrupted=interrupted,
        notes=tuple(notes), generators=tuple(generators), replay=replay,
    )  # fmt: skip


def emit(result: Result, *, as_json: bool, html: str | None) -> None:
    """Print the result (text or JSON) and write the HTML page if asked; OSError if it cannot be written."""
    if html:
        from llmspans.load._html import render as render_html

        Path(html).write_text(render_html(result), encoding="utf-8")
    if as_json:
        import json

        print(json.dumps(result.to_dict(), indent=2))
    else:
        from llmspans.load._text import render as render_text

        sys.stdout.write(render_text(result))
    if html:
        print(f"HTML written to {html}", file=sys.stderr)
