"""`configure()`: one call that sets up tracing and metrics export.

With an OTLP endpoint (argument or the standard `OTEL_*` variables) spans go out through
a bounded batch processor and metrics through a periodic reader, both off the request
path. With no endpoint anywhere, the embedded default appends OTLP-JSON lines (the
encoding Jaeger's `/api/v3` returns) to a local file the report reads, through the
official `opentelemetry-exporter-otlp-json-file` exporters.

What an export promises the application is in `_exporters`.

An application that already installed a global provider keeps it: configure adds its
exporter to an SDK TracerProvider only when asked for one explicitly, and says once what
it did.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, DEFAULT_ON
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from llmspans import _budget, _call, _content, _internals, _openinference, _phases, _telemetry, _transport
from llmspans import _exporters as exporters
from llmspans import _names as names
from llmspans._aggregation import AggregatingReader, Aggregation, exemplar_filter
from llmspans._exporters import PROTOCOLS, Compression, Protocol
from llmspans._settings import check_attempt_spans, set_configured_attempt_spans
from llmspans._tail_sampling import TailSampling, TailSamplingProcessor, tail_sampling_from_environment
from llmspans._version import __version__

logger = logging.getLogger("llmspans")

DEFAULT_METRIC_INTERVAL_MS = 10_000


@dataclass(frozen=True)
class Configuration:
    """What `configure()` set up; returned so callers and tests can see it."""

    mode: Literal["otlp", "file", "existing"]
    service_name: str | None
    endpoint: str | None = None
    protocol: Protocol | None = None
    traces_file: Path | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)
    compression: Compression | None = None
    metrics_mode: Literal["otlp", "file", "none", "existing"] = "none"
    """Where metrics go: OTLP, the traces file, nowhere (see `metrics_route`), or the application's own
    MeterProvider."""
    metrics_endpoint: str | None = None


@dataclass(frozen=True)
class MetricsRoute:
    """Where `configure()` sends metrics, and why when nowhere (said in `Configuration.notes`)."""

    destination: Literal["otlp", "file", "none"]
    endpoint: str | None = None  # an explicit endpoint; None lets the exporter read the standard variables
    protocol: Protocol = "http/protobuf"
    why: str = ""


def metrics_route(
    *, endpoint: str | None, traces_file: object, metrics: bool | None, protocol: str | None,
    environ: Mapping[str, str],
) -> MetricsRoute:  # fmt: skip
    """Metrics go only where they can: the first rule that applies decides.

    1. `configure(metrics=False)`, or `OTEL_METRICS_EXPORTER=none` (or a value without `otlp`, such as
       `prometheus`: an exporter llmspans does not set up): no metrics export.
    2. `configure(metrics=True)` or `OTEL_METRICS_EXPORTER=otlp` with no endpoint anywhere: OTLP to the
       standard default, as asked.
    3. An explicit `traces_file`: metrics in that file, with the spans.
    4. An explicit `endpoint`: OTLP to it (`/v1/metrics` over HTTP).
    5. `OTEL_EXPORTER_OTLP_METRICS_ENDPOINT`, else `OTEL_EXPORTER_OTLP_ENDPOINT`: OTLP there.
    6. Only `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`: a traces-only backend, so no metrics export (never a
       default address nobody named).
    7. Nothing at all: the embedded default's file.
    """
    chosen = (
        protocol
        or environ.get("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL")
        or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    )
    if chosen not in PROTOCOLS:
        raise ValueError(f"OTEL_EXPORTER_OTLP_METRICS_PROTOCOL must be one of {PROTOCOLS}, got {chosen!r}")
    metric_protocol: Protocol = chosen
    exporters_wanted = [
        part.strip().lower() for part in environ.get("OTEL_METRICS_EXPORTER", "").split(",") if part.strip()
    ]
    if metrics is False:
        return MetricsRoute("none", why="configure(metrics=False)")
    if exporters_wanted and "otlp" not in exporters_wanted and metrics is not True:
        return MetricsRoute(
            "none", why=f"OTEL_METRICS_EXPORTER={','.join(exporters_wanted)}: no metrics exported by llmspans"
        )
    specific = environ.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")
    general = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    asked_for_otlp = metrics is True or "otlp" in exporters_wanted
    if traces_file is not None:
        return MetricsRoute("file", protocol=metric_protocol)
    if endpoint is not None:
        return MetricsRoute("otlp", endpoint, metric_protocol)
    if specific or general or asked_for_otlp:
        return MetricsRoute("otlp", None, metric_protocol)
    if environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return MetricsRoute(
            "none",
            why="only OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set (a traces-only backend): no metrics exported; "
            "set OTEL_EXPORTER_OTLP_METRICS_ENDPOINT to export them",
        )
    return MetricsRoute("file", protocol=metric_protocol)


_lock = threading.Lock()
_current: Configuration | None = None


def configure(
    *,
    service_name: str | None = None,
    endpoint: str | None = None,
    protocol: str | None = None,
    traces_file: str | os.PathLike[str] | None = None,
    budgets: Mapping[str, object] | str | None = None,
    capture_content: object = None,
    headers: Mapping[str, str] | None = None,
    metric_interval: float | None = None,
    compression: str | None = None,
    attempt_spans: str | None = None,
    phase_spans: str | None = None,
    slow_after: float | str | None = None,
    openinference: bool | None = None,
    metrics: bool | None = None,
    tail_sampling: TailSampling | None = None,
) -> Configuration:
    """Set up tracing and metrics for llmspans; safe to call more than once.

    `headers` are added to those of `OTEL_EXPORTER_OTLP_HEADERS` (an explicit one wins over the
    variable's of the same name); `compression` ("gzip" or "none") falls back to
    `OTEL_EXPORTER_OTLP_COMPRESSION`. `attempt_spans="always"` gives every HTTP attempt a span
    (default "retries": only the attempts of a call that retried). `phase_spans` ("slow", the default,
    "always" or "never") says which calls get a child span per phase; a call is slow when it is over its
    budget or took longer than `slow_after` (2 s by default). `openinference=True` adds the span kinds
    and the project name Arize Phoenix reads. `metrics=False` exports no metrics (see `metrics_route`
    for where they go otherwise). `tail_sampling=llmspans.TailSampling(...)` records every trace and
    exports only those its rules keep (`_tail_sampling`; it wins over `OTEL_TRACES_SAMPLER`, said in the
    notes); without it, `LLMSPANS_TAIL_SAMPLING` is read. Under tail sampling llmspans' call, stage and
    turn spans are held as facts and built only for a kept trace, while the tail-sampling processor is the
    provider's only one: a processor the app adds to that provider (`add_span_processor`) ends this,
    and sees every span, kept or dropped, as an SDK span from its start, as `defer=False` does (docs:
    Sampling, Deferred spans). Export failures never raise into the application.
    """
    global _current
    _check_arguments(service_name, endpoint, protocol, traces_file, headers, metric_interval, compression)
    if tail_sampling is not None and not isinstance(tail_sampling, TailSampling):
        raise TypeError(
            f"tail_sampling must be llmspans.TailSampling(ratio=..., slower_than=...), got {tail_sampling!r}"
        )
    chosen_attempt_spans = check_attempt_spans(attempt_spans)
    chosen_phase_spans = _phases.check(phase_spans)
    chosen_slow_after = _phases.check_slow_after(slow_after)
    for flag, what in ((openinference, "openinference"), (metrics, "metrics")):
        if flag is not None and not isinstance(flag, bool):
            raise TypeError(f"{what} must be True or False, got {flag!r}")
    if chosen_attempt_spans is not None:
        set_configured_attempt_spans(chosen_attempt_spans)
    _phases.configure(chosen_phase_spans, chosen_slow_after)
    if openinference is not None:
        _openinference.configure(openinference)
    if budgets is not None:
        _budget.registry.configure(_budget.parse_budgets(budgets))
    if capture_content is not None:
        _content.set_configured(_content.check(capture_content))

    with _lock:
        if _current is not None:
            if (
                endpoint is not None
                or traces_file is not None
                or service_name is not None
                or tail_sampling is not None
            ):
                logger.warning(
                    "llmspans: configure() was already called; exporters are unchanged (%s)", _current.mode
                )
            return _current
        if tail_sampling is None:  # for an app that sets it where it deploys, not in code
            tail_sampling = tail_sampling_from_environment()
        _current = _set_up(
            service_name, endpoint, protocol, traces_file, headers, metric_interval, compression, metrics,
            tail_sampling,
        )  # fmt: skip
        return _current


def _check_arguments(
    service_name: object, endpoint: object, protocol: object, traces_file: object, headers: object,
    metric_interval: object, compression: object,
) -> None:  # fmt: skip
    if service_name is not None and (not isinstance(service_name, str) or not service_name):
        raise TypeError(f"service_name must be a non-empty string, got {service_name!r}")
    if endpoint is not None and (not isinstance(endpoint, str) or "://" not in endpoint):
        raise ValueError(f"endpoint must be a URL like 'http://localhost:4318', got {endpoint!r}")
    if protocol is not None and protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    if traces_file is not None and not isinstance(traces_file, (str, os.PathLike)):
        raise TypeError(f"traces_file must be a path, got {traces_file!r}")
    if headers is not None and not (
        isinstance(headers, Mapping)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in headers.items())
    ):
        raise TypeError("headers must be a mapping of header names to string values")
    if metric_interval is not None and (
        isinstance(metric_interval, bool)
        or not isinstance(metric_interval, (int, float))
        or metric_interval <= 0
    ):
        raise ValueError(f"metric_interval must be a positive number of seconds, got {metric_interval!r}")
    if compression is not None:
        exporters.check_compression(compression, "compression")


def _resource(service_name: str | None) -> Resource:
    attributes = {SERVICE_NAME: service_name} if service_name else {}
    resource = Resource.create(attributes)
    if not service_name and not os.environ.get("OTEL_SERVICE_NAME"):
        resource = resource.merge(Resource({SERVICE_NAME: "llmspans-app"}))
    project = _openinference.project_attributes(str(resource.attributes.get(SERVICE_NAME) or ""))
    return resource.merge(Resource(project)) if project else resource


def _set_up(
    service_name: str | None,
    endpoint: str | None,
    protocol: str | None,
    traces_file: str | os.PathLike[str] | None,
    headers: Mapping[str, str] | None,
    metric_interval: float | None,
    compression: str | None,
    metrics_wanted: bool | None,
    tail_sampling: TailSampling | None = None,
) -> Configuration:
    global _export_health
    env_endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    resolved_protocol: Protocol = (
        protocol  # type: ignore[assignment]
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    )
    if resolved_protocol not in PROTOCOLS:
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL must be one of {PROTOCOLS}, got {resolved_protocol!r}")
    route = metrics_route(
        endpoint=endpoint,
        traces_file=traces_file,
        metrics=metrics_wanted,
        protocol=protocol,
        environ=os.environ,
    )
    interval_ms = int(metric_interval * 1000) if metric_interval else None
    use_otlp = (endpoint is not None or env_endpoint) and traces_file is None
    path: Path | None = None
    health: list[exporters.ExportHealth] = []
    span_health: exporters.ExportHealth | None = None
    metric_exporter: MetricExporter | None = None
    exporters.quiet_repeated_export_logs()  # OTLP retries and a full disk alike log once per batch
    resolved_compression = (
        exporters.resolve_compression(compression) if use_otlp or route.destination == "otlp" else None
    )
    if use_otlp:
        span_exporter: SpanExporter
        span_exporter, span_health = exporters.otlp_span_exporter(
            endpoint, resolved_protocol, headers, resolved_compression
        )
        health.append(span_health)
        mode: Literal["otlp", "file"] = "otlp"
    else:
        path = Path(
            traces_file or os.environ.get(names.ENV_TRACES_FILE) or names.DEFAULT_TRACES_FILE
        ).resolve()
        span_exporter, file_metric_exporter = exporters.file_exporters(path)
        if route.destination == "file":
            metric_exporter = file_metric_exporter
        mode = "file"
    if route.destination == "otlp":
        metric_exporter, metric_health = exporters.otlp_metric_exporter(
            route.endpoint, route.protocol, headers, resolved_compression, span_health
        )
        health.append(metric_health)
    shown_endpoint = endpoint or (env_endpoint if use_otlp else None)
    explicit = endpoint is not None or traces_file is not None
    resource = _resource(service_name)
    notes: list[str] = []

    existing_tracer = trace.get_tracer_provider()
    if isinstance(existing_tracer, trace.ProxyTracerProvider):
        sampler = None
        if tail_sampling is not None:
            sampler = ALWAYS_ON  # every trace records until its end decides (tail sampling wins)
            head = os.environ.get(names.ENV_TRACES_SAMPLER)
            if head:
                notes.append(
                    f"tail sampling wins over {names.ENV_TRACES_SAMPLER}={head}: every trace is recorded "
                    "and kept or dropped whole at its end"
                )
                logger.warning("llmspans: %s", notes[-1])
        tracer_provider = TracerProvider(resource=resource, sampler=sampler)
        tracer_provider.add_span_processor(_sampled(exporters.span_processor(span_exporter), tail_sampling))
        trace.set_tracer_provider(tracer_provider)
        exporting_spans = True
    elif explicit and isinstance(existing_tracer, TracerProvider):
        existing_tracer.add_span_processor(_sampled(exporters.span_processor(span_exporter), tail_sampling))
        notes.append("added llmspans' span exporter to the application's existing TracerProvider")
        if tail_sampling is not None:
            notes.append("tail sampling sees only the traces the application's own sampler records")
        exporting_spans = True
    else:
        exporting_spans = False
        span_exporter.shutdown()
        notes.append("left the application's existing TracerProvider and its exporters alone")
        if tail_sampling is not None:
            notes.append(
                "tail sampling is not applied to the application's own TracerProvider: wrap its exporting "
                "processor in llmspans.TailSamplingProcessor(...)"
            )

    existing_meter = metrics.get_meter_provider()
    metrics_mode: Literal["otlp", "file", "none", "existing"] = route.destination
    if type(existing_meter).__name__ != "_ProxyMeterProvider":
        if metric_exporter is not None:
            metric_exporter.shutdown()
        metrics_mode = "existing"
        notes.append("left the application's existing MeterProvider alone (metrics go to its readers)")
    elif metric_exporter is None:
        notes.append(f"metrics are not exported: {route.why}")
    else:
        aggregation = Aggregation(exemplars=exemplar_filter())
        reader = AggregatingReader(
            metric_exporter, aggregation, resource, InstrumentationScope(names.INSTRUMENTATION_NAME, __version__),
            export_interval_millis=interval_ms or DEFAULT_METRIC_INTERVAL_MS,
        )  # fmt: skip
        meter_provider = MeterProvider(resource=resource, metric_readers=[reader])
        if reader.takes_explicit_histograms():  # before it is installed: no call may record elsewhere
            _telemetry.aggregate_with(meter_provider, aggregation)
        else:  # the exporter wants other histograms: the SDK's
            notes.append("the metric exporter asks for non-explicit histograms: the SDK aggregates them")
        metrics.set_meter_provider(meter_provider)
        _telemetry.pick_up_providers()  # the gauges are registered now, not at the first call
        _forget_metrics_in_a_forked_child(meter_provider, reader, aggregation)

    # atexit runs last-registered first: ending the calls still open is registered after the
    # providers, so it runs before they flush, whatever finalisers were registered before.
    atexit.register(_call.end_open_calls)
    atexit.register(_transport.end_open_attempts)
    if health:
        # atexit runs last-registered first: this marks the exporters as closing before the
        # providers registered above flush, so a dead endpoint is not retried at exit.
        atexit.register(exporters.mark_closing, tuple(health))
        _export_health = tuple(health)
    for note in notes:
        logger.info("llmspans: %s", note)
    metric_target = None
    if metrics_mode == "otlp" and health:
        metric_target = health[-1].target
    return Configuration(
        mode=mode if exporting_spans else "existing",
        service_name=resource.attributes.get(SERVICE_NAME),  # type: ignore[arg-type]
        endpoint=shown_endpoint if mode == "otlp" else None,
        protocol=resolved_protocol if mode == "otlp" else None,
        traces_file=path,
        notes=tuple(notes),
        compression=resolved_compression,
        metrics_mode=metrics_mode,
        metrics_endpoint=metric_target,
    )


def _sampled(processor: SpanProcessor, tail_sampling: TailSampling | None) -> SpanProcessor:
    """The exporting processor, behind tail sampling when asked for."""
    return processor if tail_sampling is None else TailSamplingProcessor(processor, sampling=tail_sampling)


def tail_sample_the_global_provider() -> str | None:
    """For zero-code use (`opentelemetry-instrument`, which sets up the providers itself): put the global SDK
    TracerProvider's span processors behind the tail sampling `LLMSPANS_TAIL_SAMPLING` asks for. What it did,
    or why it did nothing, in one line (None: the variable asks for none, or `configure()` set up the export)."""
    sampling = tail_sampling_from_environment()
    if sampling is None or _current is not None:
        return None
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        note = f"{names.ENV_TAIL_SAMPLING}: no SDK TracerProvider is installed to sample: nothing done"
    else:
        members = _internals.tracer_provider_processors(provider)
        if members is None or not members:
            note = f"{names.ENV_TAIL_SAMPLING}: the TracerProvider exports through no span processor: nothing done"
        elif any(isinstance(member, TailSamplingProcessor) for member in members):
            return None  # already behind tail sampling
        else:
            _internals.set_tracer_provider_processors(
                provider, (TailSamplingProcessor(*members, sampling=sampling),)
            )
            note = f"{names.ENV_TAIL_SAMPLING}: the TracerProvider's span processors are behind tail sampling"
            head = getattr(provider, "sampler", None)
            if head is not ALWAYS_ON and head is not DEFAULT_ON:
                note += (
                    f" (its sampler {type(head).__name__} decides first: tail sampling sees what it records)"
                )
    logger.info("llmspans: %s", note)
    return note


def _forget_metrics_in_a_forked_child(
    provider: MeterProvider, reader: AggregatingReader, aggregation: Aggregation
) -> None:
    """A forked child starts its metrics from zero, as the batch processor starts its span queue empty.

    The child inherits the provider's aggregated points; left alone it would export the
    parent's counts again as its own (the SDK gives the child a resource of its own, with a new
    `service.instance.id`, but keeps the points). llmspans' own aggregation starts empty and
    sends on the child's resource. Swapping in fresh storage goes through the
    SDK's measurement consumer, a private part: if it ever changes shape, the child keeps the
    SDK's behaviour and says so at DEBUG.
    """
    if not hasattr(os, "register_at_fork"):
        return
    provider_ref = weakref.ref(provider)

    def after_fork_in_child() -> None:
        aggregation.forget_all()
        current_provider = provider_ref()
        if current_provider is None:
            return
        try:
            # The provider gave itself a resource of the child's (a new service.instance.id) in its
            # own fork handler, which ran before this one: our points go out on it too.
            resource = _internals.meter_provider_resource(current_provider)
            if resource is not None:
                reader.use_resource(resource)
            if resource is None or not _internals.reset_reader_storage(current_provider, reader):
                logger.debug(
                    "llmspans: the MeterProvider's parts moved; the child keeps the SDK's metric state"
                )
        except Exception:
            logger.debug("llmspans: could not reset metric state after fork", exc_info=True)

    os.register_at_fork(after_in_child=after_fork_in_child)


def current() -> Configuration | None:
    """The configuration in force, if `configure()` ran."""
    return _current


_export_health: tuple[exporters.ExportHealth, ...] | None = None
"""The export health of the OTLP set-up, spans first then metrics, where each goes over OTLP (for tests
and diagnostics)."""


def _reset_for_tests() -> None:
    global _current
    with _lock:
        _current = None
