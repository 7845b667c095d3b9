"""One fixed workload and what llmspans exports for it, in a form that compares across versions.

`tests/fixtures/golden_telemetry.json` holds what the workload exported on main before issue 22's
performance work (made by `python tests/fixtures/make_golden_telemetry.py` on that tree);
`tests/test_golden_telemetry.py` runs it again and compares. The workload covers the call paths a
cheaper implementation could lose something on: non-streamed and streamed chat (sync and async),
Responses, embeddings, a retried call, a failed one, an abandoned stream, a limiter with a budget, a
vLLM provider, phase spans, a plain httpx client, a stage and a turn.

What is compared: every span's name, kind, parent, status, attributes and events (types always,
values where the run decides them: counts, names, flags; never times, ports or durations); every
histogram and counter point's name, unit, attributes and count (token sums and bucket counts too,
which do not depend on time); whether points carry exemplars, and from which spans where time does
not decide it; which span each request's `traceparent` named. Once through the application's own
MeterProvider (the SDK's instruments) and once through llmspans' own aggregation (`configure()`'s),
sampled and unsampled, and with no provider at all.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

import httpx
import openai
from opentelemetry import metrics as otel_metrics
from opentelemetry.sdk.metrics import Counter, Histogram, MeterProvider
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    HistogramDataPoint,
    InMemoryMetricReader,
    MetricExporter,
    MetricExportResult,
    MetricsData,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, Sampler
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

import llmspans
import llmspans.testing
from llmspans import _names as names
from llmspans import _telemetry
from llmspans.tools.simulator import Behavior, SimulatedServer

MESSAGES = [{"role": "user", "content": "where does the time go"}]
LANE = "golden-lane"
# The phases the workload makes long on purpose (30 ms and more); the others (preparing the request,
# connecting) are long or short as the machine is busy or not, so they are left out.
PHASES_KEPT = {names.PHASE_SPAN_RESPONSE, names.PHASE_SPAN_FIRST_TOKEN, names.PHASE_SPAN_STREAM}
# Metrics whose values do not depend on time: their sums and bucket counts are compared too.
TIMELESS = {names.METRIC_TOKEN_USAGE, names.METRIC_RETRY_ATTEMPTS, names.METRIC_CONNECT_NEW,
            names.METRIC_BUDGET_EXCEEDED}  # fmt: skip
# Span attributes whose values change from run to run even as integers or strings (the dominant bucket
# of a fast call is whichever of two sub-millisecond buckets was longer).
VARYING = {names.SERVER_PORT, names.URL_FULL, names.BUCKET_DOMINANT}
STAGE_GAUGES = {names.METRIC_STAGE_BUDGET, names.METRIC_LIMITER_CAP, names.METRIC_LIMITER_IN_FLIGHT,
                names.METRIC_LIMITER_QUEUE_DEPTH}  # fmt: skip


# --- the workload ---------------------------------------------------------------------------------


def scenarios(server: SimulatedServer, alive: list[Any]) -> list[tuple[str, Callable[[], None]]]:
    """(name, run) in order; each run makes one or a few calls on clients of its own. What the
    collection reports on (the limiter of its gauges) is kept in `alive` until the run collects."""
    base = server.base_url

    def client(**instrument: Any) -> openai.OpenAI:
        return llmspans.instrument(openai.OpenAI(base_url=base, api_key="k", max_retries=2), **instrument)

    def aclient(**instrument: Any) -> openai.AsyncOpenAI:
        return llmspans.instrument(
            openai.AsyncOpenAI(base_url=base, api_key="k", max_retries=2), **instrument
        )

    def chat() -> None:
        client().chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=50, temperature=0.5)

    def chat_stream() -> None:
        server.enqueue(Behavior(chunks=5, usage="chunk"))
        stream = client().chat.completions.create(
            model="tiny", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
        )
        for _ in stream:
            pass

    def responses() -> None:
        client().responses.create(model="tiny", input="hi")

    def embeddings() -> None:
        client().embeddings.create(model="emb", input="hi")

    def retried() -> None:
        server.enqueue(Behavior(status=503, retry_after_ms=1))
        client().chat.completions.create(model="tiny", messages=MESSAGES)

    def failed() -> None:
        server.enqueue(Behavior(status=500))
        with suppress(openai.InternalServerError):
            client().with_options(max_retries=0).chat.completions.create(model="tiny", messages=MESSAGES)

    def abandoned() -> None:
        server.enqueue(Behavior(chunks=6))
        stream = client().chat.completions.create(model="tiny", messages=MESSAGES, stream=True)
        for index, _ in enumerate(stream):
            if index == 2:
                break
        stream.close()

    def limited() -> None:
        lane = llmspans.Limiter(1, name=LANE)
        alive.append(lane)  # its gauges report while it lives: not at the whim of the collector
        # Over its budget, so it would get phase spans as long as the machine makes them: not here.
        limited_client = client(limiter=lane, budget=0.000001, phase_spans="never")
        limited_client.chat.completions.create(model="tiny", messages=MESSAGES)

    def vllm() -> None:
        client(provider="vllm").chat.completions.create(model="tiny", messages=MESSAGES)

    def phases() -> None:
        server.enqueue(Behavior(header_delay=0.05))
        client(phase_spans="always").chat.completions.create(model="tiny", messages=MESSAGES)
        server.enqueue(Behavior(first_chunk_delay=0.03, chunk_gap=0.012, chunks=4))
        for _ in client(phase_spans="always").chat.completions.create(
            model="tiny", messages=MESSAGES, stream=True
        ):
            pass

    def async_calls() -> None:
        async def run() -> None:
            made = aclient()
            await made.chat.completions.create(model="tiny", messages=MESSAGES)
            server.enqueue(Behavior(chunks=4, usage="finish"))
            stream = await made.chat.completions.create(
                model="tiny", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
            )
            async for _ in stream:
                pass
            await made.close()

        asyncio.run(run())

    def plain() -> None:
        with llmspans.instrument(httpx.Client(base_url=base)) as http:
            http.post("/chat/completions", json={"model": "tiny", "messages": MESSAGES})
            with http.stream("POST", "/chat/completions",
                             json={"model": "tiny", "messages": MESSAGES, "stream": True}) as response:  # fmt: skip
                for _ in response.iter_lines():
                    pass

    def staged() -> None:
        @llmspans.stage("retrieval")
        def retrieve() -> str:
            return "context"

        with llmspans.turn("chat"):
            retrieve()
            server.enqueue(Behavior(header_delay=0.03))
            client().chat.completions.create(model="tiny", messages=MESSAGES)

    return [
        ("chat", chat), ("chat_stream", chat_stream), ("responses", responses), ("embeddings", embeddings),
        ("retried", retried), ("failed", failed), ("abandoned", abandoned), ("limited", limited),
        ("vllm", vllm), ("phases", phases), ("async", async_calls), ("plain", plain), ("staged", staged),
    ]  # fmt: skip


# --- where the values go --------------------------------------------------------------------------


class CountingIds(IdGenerator):
    """Ids drawn in order: two runs that start their spans in the same order get the same ids (and so the
    same sampling decisions and exemplars)."""

    def __init__(self) -> None:
        self._next = itertools.count(1)

    def generate_span_id(self) -> int:
        return next(self._next)

    def generate_trace_id(self) -> int:
        return (1 << 100) + next(self._next)


class Kept(MetricExporter):
    """A metric exporter that keeps what it was given (cumulative unless told `temporality`)."""

    def __init__(self, temporality: AggregationTemporality | None = None) -> None:
        chosen = {} if temporality is None else {Histogram: temporality, Counter: temporality}
        super().__init__(preferred_temporality=chosen)
        self.exported: list[MetricsData] = []

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any
    ) -> MetricExportResult:
        self.exported.append(metrics_data)
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        pass


@contextmanager
def _sdk_path(tracer_provider: TracerProvider) -> Iterator[Callable[[], MetricsData | None]]:
    """The application's own MeterProvider: values through the SDK's instruments."""
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    with _telemetry.use_providers(tracer_provider, meter_provider):
        yield reader.get_metrics_data
    meter_provider.shutdown()


@contextmanager
def _our_path(tracer_provider: TracerProvider) -> Iterator[Callable[[], MetricsData | None]]:
    """`configure()`'s pipeline: values through llmspans' own aggregation, added at collection."""
    from llmspans._aggregation import AggregatingReader, Aggregation
    from llmspans._metrics import SdkRecorder

    exporter = Kept()
    aggregation = Aggregation()
    reader = AggregatingReader(
        exporter, aggregation, Resource.create({}), InstrumentationScope(names.INSTRUMENTATION_NAME),
        export_interval_millis=10**9,
    )  # fmt: skip
    meter_provider = MeterProvider(metric_readers=[reader])
    SdkRecorder(meter_provider.get_meter(names.INSTRUMENTATION_NAME))  # the gauges, as configure() has them
    previous = _telemetry._override
    _telemetry._override = (tracer_provider.get_tracer(names.INSTRUMENTATION_NAME), aggregation)

    def collect() -> MetricsData | None:
        meter_provider.force_flush()
        return exporter.exported[-1] if exporter.exported else None

    try:
        yield collect
    finally:
        _telemetry._override = previous
        meter_provider.shutdown()


PATHS = {"sdk": _sdk_path, "ours": _our_path}


def run(server: SimulatedServer, path: str, sampler: Sampler) -> dict[str, Any]:
    """The workload through one metric path and sampler; the normalised result."""
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider(sampler=sampler)
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    by_scenario: dict[str, list[ReadableSpan]] = {}
    requests: dict[str, list[Any]] = {}
    gc.collect()  # an earlier run's clients (cycles) and limiters are gone: its gauges report no more
    alive: list[Any] = []
    with PATHS[path](tracer_provider) as collect:
        for name, scenario in scenarios(server, alive):
            seen, asked = len(spans.get_finished_spans()), len(server.requests)
            scenario()
            llmspans.testing.settle()
            server.wait_idle()
            by_scenario[name] = list(spans.get_finished_spans())[seen:]
            requests[name] = list(server.requests)[asked:]
        collected = collect()
        alive.clear()
    tracer_provider.shutdown()
    every_span = [span for found in by_scenario.values() for span in found]
    span_names = {span.context.span_id: span.name for span in every_span}
    port = server.port
    spans_seen = {
        name: [_span(span, span_names, port) for span in found if _kept(span)]
        for name, found in by_scenario.items()
    }
    traceparents = {
        name: [_traceparent(request, span_names) for request in asked] for name, asked in requests.items()
    }
    return {
        "spans": spans_seen,
        "traceparents": traceparents,
        "metrics": _metrics(collected, span_names, port),
    }


def run_without_provider(server: SimulatedServer) -> dict[str, Any]:
    """No provider anywhere (the API's proxies): nothing to export, and no `traceparent` is sent."""
    requests: dict[str, list[Any]] = {}
    assert type(otel_metrics.get_meter_provider()).__name__ == "_ProxyMeterProvider"
    for name, scenario in scenarios(server, []):
        asked = len(server.requests)
        scenario()
        llmspans.testing.settle()
        server.wait_idle()
        requests[name] = [_traceparent(request, {}) for request in list(server.requests)[asked:]]
    return {"traceparents": requests}


def run_all(server_factory: Callable[[], Any]) -> dict[str, Any]:
    """Every path and sampler, each on a fresh server (its ids and sequence numbers start over)."""
    result: dict[str, Any] = {}
    for label, path, sampler in (
        ("sdk-sampled", "sdk", ALWAYS_ON), ("ours-sampled", "ours", ALWAYS_ON),
        ("sdk-unsampled", "sdk", ALWAYS_OFF), ("ours-unsampled", "ours", ALWAYS_OFF),
    ):  # fmt: skip
        with server_factory() as server:
            result[label] = run(server, path, sampler)
        llmspans.testing.reset()
    with server_factory() as server:
        result["no-provider"] = run_without_provider(server)
    llmspans.testing.reset()
    return result


# --- normalising ----------------------------------------------------------------------------------


def _kept(span: ReadableSpan) -> bool:
    """Phase spans whose presence depends on the machine's speed are left out."""
    return names.PHASE not in (span.attributes or {}) or span.name in PHASES_KEPT


def _value(key: str, value: Any, port: int) -> list[Any]:
    """[type, value]: the value only where the run decides it (not a time, a port or a URL)."""
    kind = type(value).__name__
    if isinstance(value, float) or key in VARYING:
        return [kind, None]
    if isinstance(value, tuple):
        return [kind, list(value)]
    if isinstance(value, str):
        return [kind, value.replace(str(port), "{port}")]
    return [kind, value]


def _attributes(attributes: Any, port: int) -> dict[str, list[Any]]:
    return {key: _value(key, value, port) for key, value in sorted((attributes or {}).items())}


def _span(span: ReadableSpan, span_names: dict[int, str], port: int) -> dict[str, Any]:
    parent = span.parent.span_id if span.parent is not None else None
    return {
        "name": span.name,
        "kind": span.kind.name,
        "parent": span_names.get(parent, "(outside)") if parent is not None else None,
        "status": [span.status.status_code.name, span.status.description],
        "attributes": _attributes(span.attributes, port),
        "events": [[event.name, _attributes(event.attributes, port)] for event in span.events],
    }


def _traceparent(request: Any, span_names: dict[int, str]) -> list[Any]:
    headers = {key.lower(): value for key, value in request.headers.items()}
    header = headers.get("traceparent")
    if header is None:
        return [request.path, None]
    _, _, parent_id, flags = header.split("-")
    return [request.path, span_names.get(int(parent_id, 16), "(not exported)"), flags]


def _metrics(data: MetricsData | None, span_names: dict[int, str], port: int) -> list[dict[str, Any]]:
    points: list[dict[str, Any]] = []
    for resource_metrics in data.resource_metrics if data else ():
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                for point in metric.data.data_points:
                    attributes = _attributes(point.attributes, port)
                    if type(metric.data).__name__ == "Gauge" and (
                        metric.name not in STAGE_GAUGES or _foreign_gauge(point.attributes)
                    ):
                        continue  # state other code left alive (or a vLLM sampler's), not this workload's
                    shown: dict[str, Any] = {
                        "name": metric.name, "unit": metric.unit, "kind": type(metric.data).__name__,
                        "attributes": attributes,
                    }  # fmt: skip
                    temporality = getattr(metric.data, "aggregation_temporality", None)
                    if temporality is not None:
                        shown["temporality"] = AggregationTemporality(temporality).name
                    timeless = metric.name in TIMELESS
                    exemplars = list(point.exemplars or ())
                    if isinstance(point, HistogramDataPoint):
                        shown["count"] = point.count
                        shown["bounds"] = list(point.explicit_bounds)
                        if timeless:
                            shown.update(sum=point.sum, buckets=list(point.bucket_counts), min=point.min,
                                         max=point.max)  # fmt: skip
                    else:
                        shown["value"] = point.value if timeless or shown["kind"] == "Gauge" else None
                    shown["exemplars"] = bool(exemplars)
                    if timeless:
                        shown["exemplar_spans"] = sorted({span_names.get(e.span_id, "(unknown)")
                                                          for e in exemplars if e.span_id})  # fmt: skip
                    points.append(shown)
    return sorted(points, key=lambda shown: (shown["name"], repr(shown["attributes"])))


def _foreign_gauge(attributes: Any) -> bool:
    """A limiter gauge of another lane, or a budget gauge of a stage this workload did not set."""
    found = dict(attributes or {})
    if names.LIMITER_NAME in found:
        return found[names.LIMITER_NAME] != LANE
    return found.get(names.STAGE) != names.STAGE_LLM
