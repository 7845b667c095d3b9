"""Issue 37's scenario, recorded under tail sampling with every span also written whole, as the truth.

An app runs TURNS turns, each a retrieval stage (7 % of them 30 ms, the rest 1 ms) and one non-streamed
LLM call (2 % answered after 250 ms, the rest after 4 ms) against the shipped simulator over real HTTP,
with `configure(traces_file=SAMPLED, tail_sampling=TailSampling(ratio, slower_than))`; a plain batch
processor on the same provider writes every span of the run to WHOLE. Which turns are slow and each
turn's trace id come from the seed, so a seed keeps the same traces every run (the tail sampler's
decision reads the trace id's low 56 bits); only the measured durations vary with the machine.

    python -m tests.support.sampled_scenario OUT --seed 1 [--turns 2000] [--ratio 0.01] [--slower-than 200ms]
        [--concurrency 8] [--scale 1] [--metrics-file M --prometheus-port P]

writes OUT/sampled.jsonl (what configure() exported: the kept spans and the metric points) and
OUT/whole.jsonl (every span). With `--prometheus-port` the app brings its own MeterProvider: its metrics
are served on 127.0.0.1:P for a Prometheus to scrape and written to M; the process runs WARM_UP_TURNS turns
first, prints `ready` and waits for a line on stdin before the measured turns, then prints `done` and waits
for stdin's end before it exits (so the last scrape sees every call).

`replay(whole, sampling, out, metrics_from)` applies another tail sampling to the same run offline: the
whole file's spans, rebuilt as the SDK's `ReadableSpan`s and handed in the order they ended to the real
`TailSamplingProcessor`, whose kept spans go to an OTLP-JSON file exporter; the metric lines of the live
run are appended (metrics count every call whatever is sampled). The test holds a replay at the live
run's own settings equal to the live file, trace for trace.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import json
import random
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

TURNS = 2000
SLOW_RETRIEVAL_SHARE, SLOW_RETRIEVAL_S, RETRIEVAL_S = 0.07, 0.030, 0.001
SLOW_ANSWER_SHARE, SLOW_ANSWER_S, ANSWER_S = 0.02, 0.250, 0.004
CONCURRENCY = 8
WARM_UP_TURNS = 10  # with --prometheus-port, before the measured turns
SERVICE = "sampled-scenario"

_PLANNED_TRACE_ID: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "planned_trace_id", default=None
)


@dataclass(frozen=True)
class Plan:
    index: int
    trace_id: int
    retrieval_s: float
    answer_s: float


def plans(seed: int, turns: int = TURNS, scale: float = 1.0) -> list[Plan]:
    """Which turns are slow, and each turn's trace id: the seed decides. `scale` multiplies every delay (on
    a busy machine, 5 keeps the machine's own stalls of tens of milliseconds small against them)."""
    rng = random.Random(seed)
    out = []
    for index in range(turns):
        retrieval = SLOW_RETRIEVAL_S if rng.random() < SLOW_RETRIEVAL_SHARE else RETRIEVAL_S
        answer = SLOW_ANSWER_S if rng.random() < SLOW_ANSWER_SHARE else ANSWER_S
        out.append(Plan(index, rng.getrandbits(128) or 1, retrieval * scale, answer * scale))
    return out


def _plant_trace_ids() -> None:
    """A root span started inside a turn gets the turn's planned trace id (the SDK's random one otherwise)."""
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    random_trace_id = RandomIdGenerator.generate_trace_id

    def generate_trace_id(self: RandomIdGenerator) -> int:
        planned = _PLANNED_TRACE_ID.get()
        if planned is not None:
            _PLANNED_TRACE_ID.set(None)  # the root only; its children inherit it
            return planned
        return random_trace_id(self)

    RandomIdGenerator.generate_trace_id = generate_trace_id  # type: ignore[method-assign]


@contextlib.contextmanager
def simulator() -> Iterator[str]:
    """The shipped simulator in a process of its own (its threads would otherwise share this one's GIL with
    the app's event loop and stretch every answer); its base URL."""
    process = subprocess.Popen(
        [sys.executable, "-m", "llmspans.tools.simulator", "--port", "0"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        yield process.stdout.readline().strip()
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def _run(turns: Sequence[Plan], concurrency: int) -> None:
    import httpx

    import llmspans

    @llmspans.retrieval
    async def retrieve(seconds: float) -> str:
        await asyncio.sleep(seconds)
        return "doc"

    with simulator() as base_url:
        async with httpx.AsyncClient(base_url=base_url + "/", timeout=30) as plain:
            client = llmspans.instrument(plain)

            async def turn(plan: Plan) -> None:
                _PLANNED_TRACE_ID.set(plan.trace_id or None)
                async with llmspans.turn("chat"):
                    await retrieve(plan.retrieval_s)
                    response = await client.post(
                        "chat/completions",
                        json={"model": "sim-model", "messages": [{"role": "user", "content": "q"}],
                              "x_sim": {"header_delay": plan.answer_s}},
                    )  # fmt: skip
                    response.raise_for_status()

            queue = iter(turns)

            async def worker() -> None:
                for plan in queue:
                    await asyncio.create_task(turn(plan))  # a task of its own: a context of its own

            await asyncio.gather(*(worker() for _ in range(concurrency)))


def record(
    out: Path, *, seed: int, turns: int = TURNS, ratio: float = 0.01, slower_than: str | float | None = "200ms",
    concurrency: int = CONCURRENCY, metrics_file: Path | None = None, prometheus_port: int | None = None,
    scale: float = 1.0,
) -> None:  # fmt: skip
    """Run the scenario in this process (once per process: it sets the global providers)."""
    from opentelemetry import metrics, trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    import llmspans
    from llmspans import _exporters

    out.mkdir(parents=True, exist_ok=True)
    _plant_trace_ids()
    if prometheus_port is not None:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        from opentelemetry.sdk.resources import Resource
        from prometheus_client import start_http_server

        assert metrics_file is not None, "--prometheus-port needs --metrics-file"
        _, metric_exporter = _exporters.file_exporters(metrics_file)
        resource = Resource.create({"service.name": SERVICE})
        metrics.set_meter_provider(
            MeterProvider(
                resource=resource,
                metric_readers=[
                    PrometheusMetricReader(),
                    PeriodicExportingMetricReader(metric_exporter, export_interval_millis=3_600_000),
                ],
            )
        )
        start_http_server(prometheus_port, addr="127.0.0.1")
    llmspans.configure(
        traces_file=out / "sampled.jsonl", service_name=SERVICE,
        tail_sampling=llmspans.TailSampling(ratio=ratio, slower_than=slower_than),
    )  # fmt: skip
    provider = trace.get_tracer_provider()
    assert isinstance(provider, TracerProvider)
    whole_exporter, _ = _exporters.file_exporters(out / "whole.jsonl")
    provider.add_span_processor(BatchSpanProcessor(whole_exporter, max_queue_size=1_000_000))
    if prometheus_port is not None:
        # A few turns first, so every series exists before the measured ones: Prometheus' increase() cannot
        # count what a series held when it was first scraped. Then wait for the cue.
        asyncio.run(
            _run([replace(plan, trace_id=0) for plan in plans(seed + 1000, WARM_UP_TURNS)], concurrency)
        )
        print("ready", flush=True)
        sys.stdin.readline()
    asyncio.run(_run(plans(seed, turns, scale), concurrency))
    provider.force_flush()
    meter_provider = metrics.get_meter_provider()
    meter_provider.force_flush()  # type: ignore[attr-defined]


# --- applying another tail sampling to a recorded run -------------------------------------------------


def _value(value: dict[str, Any]) -> Any:
    if "stringValue" in value:
        return value["stringValue"]
    if "boolValue" in value:
        return value["boolValue"]
    if "intValue" in value:
        return int(value["intValue"])
    if "doubleValue" in value:
        return float(value["doubleValue"])
    if "arrayValue" in value:
        return tuple(_value(item) for item in value["arrayValue"].get("values", []))
    return None


def _attributes(items: Sequence[dict[str, Any]]) -> dict[str, Any]:
    return {item["key"]: _value(item["value"]) for item in items}


def readable_spans(whole: Path) -> Iterator[Any]:
    """The spans of an OTLP-JSON lines file as the SDK's `ReadableSpan`s, in the file's order (the order
    a batch processor exported them in: the order they ended)."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import Event, ReadableSpan
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

    for line in whole.read_text().splitlines():
        document = json.loads(line)
        for resource_spans in document.get("resourceSpans", []):
            resource = Resource(_attributes(resource_spans.get("resource", {}).get("attributes", [])))
            for scope_spans in resource_spans.get("scopeSpans", []):
                scope = scope_spans.get("scope", {})
                instrumentation = InstrumentationScope(scope.get("name", ""), scope.get("version"))
                for span in scope_spans["spans"]:
                    trace_id = int(span["traceId"], 16)
                    context = SpanContext(
                        trace_id, int(span["spanId"], 16), False, TraceFlags(TraceFlags.SAMPLED),
                        TraceState.from_header([span["traceState"]]) if span.get("traceState") else None,
                    )  # fmt: skip
                    parent = (
                        SpanContext(
                            trace_id, int(span["parentSpanId"], 16), False, TraceFlags(TraceFlags.SAMPLED)
                        )
                        if span.get("parentSpanId")
                        else None
                    )
                    status = span.get("status", {})
                    yield ReadableSpan(
                        name=span["name"], context=context, parent=parent, resource=resource,
                        attributes=_attributes(span.get("attributes", [])),
                        events=[Event(event["name"], _attributes(event.get("attributes", [])),
                                      int(event["timeUnixNano"])) for event in span.get("events", [])],
                        kind=SpanKind(int(span.get("kind", 1)) - 1),
                        status=Status(StatusCode(int(status.get("code", 0))), status.get("message")),
                        start_time=int(span["startTimeUnixNano"]), end_time=int(span["endTimeUnixNano"]),
                        instrumentation_scope=instrumentation,
                    )  # fmt: skip


def metric_lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.startswith('{"resourceMetrics"')]


def replay(whole: Path | Sequence[Any], sampling: Any, out: Path, metrics_from: Path | None) -> Path:
    """`whole` (a file, or its `readable_spans` already read) tail-sampled offline by the real
    `TailSamplingProcessor` with `sampling`, into `out`, with the metric lines of `metrics_from` appended."""
    from opentelemetry.exporter.otlp.json.file import FileSpanExporter
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from llmspans import TailSamplingProcessor

    out.unlink(missing_ok=True)
    with out.open("a", encoding="utf-8") as stream:
        exporter = FileSpanExporter(stream=stream)
        processor = TailSamplingProcessor(SimpleSpanProcessor(exporter), sampling=sampling)
        for span in readable_spans(whole) if isinstance(whole, Path) else whole:
            processor.on_end(span)
        processor.shutdown()
        if metrics_from is not None:
            stream.writelines(line + "\n" for line in metric_lines(metrics_from))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.sampled_scenario")
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--turns", type=int, default=TURNS)
    parser.add_argument("--ratio", type=float, default=0.01)
    parser.add_argument("--slower-than", default="200ms")
    parser.add_argument("--concurrency", type=int, default=CONCURRENCY)
    parser.add_argument("--metrics-file", type=Path)
    parser.add_argument("--prometheus-port", type=int)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every delay (1)")
    args = parser.parse_args(argv)
    slower: str | None = None if args.slower_than == "none" else args.slower_than
    record(
        args.out, seed=args.seed, turns=args.turns, ratio=args.ratio, slower_than=slower,
        concurrency=args.concurrency, metrics_file=args.metrics_file, prometheus_port=args.prometheus_port,
        scale=args.scale,
    )  # fmt: skip
    print("done", flush=True)
    if args.prometheus_port is not None:
        sys.stdin.readline()  # the test's cue: Prometheus has scraped the last figures
    return 0


if __name__ == "__main__":
    sys.exit(main())
