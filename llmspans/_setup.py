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
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from llmspans import _budget, _call, _content, _telemetry, _transport
from llmspans import _exporters as exporters
from llmspans import _names as names
from llmspans._aggregation import AggregatingReader, Aggregation, exemplar_filter
from llmspans._exporters import PROTOCOLS, Compression, Protocol
from llmspans._settings import check_attempt_spans, set_configured_attempt_spans
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
) -> Configuration:
    """Set up tracing and metrics for llmspans; safe to call more than once.

    `headers` are added to those of `OTEL_EXPORTER_OTLP_HEADERS` (an explicit one wins over the
    variable's of the same name); `compression` ("gzip" or "none") falls back to
    `OTEL_EXPORTER_OTLP_COMPRESSION`. `attempt_spans="always"` gives every HTTP attempt a span
    (default "retries": only the attempts of a call that retried). Export failures never raise
    into the application.
    """
    global _current
    _check_arguments(service_name, endpoint, protocol, traces_file, headers, metric_interval, compression)
    chosen_attempt_spans = check_attempt_spans(attempt_spans)
    if chosen_attempt_spans is not None:
        set_configured_attempt_spans(chosen_attempt_spans)
    if budgets is not None:
        _budget.registry.configure(_budget.parse_budgets(budgets))
    if capture_content is not None:
        _content.set_configured(_content.check(capture_content))

    with _lock:
        if _current is not None:
            if endpoint is not None or traces_file is not None or service_name is not None:
                logger.warning(
                    "llmspans: configure() was already called; exporters are unchanged (%s)", _current.mode
                )
            return _current
        _current = _set_up(
            service_name, endpoint, protocol, traces_file, headers, metric_interval, compression
        )
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
    return resource


def _set_up(
    service_name: str | None,
    endpoint: str | None,
    protocol: str | None,
    traces_file: str | os.PathLike[str] | None,
    headers: Mapping[str, str] | None,
    metric_interval: float | None,
    compression: str | None,
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
    interval_ms = int(metric_interval * 1000) if metric_interval else None
    use_otlp = (endpoint is not None or env_endpoint) and traces_file is None
    path: Path | None = None
    health: tuple[exporters.ExportHealth, exporters.ExportHealth] | None = None
    resolved_compression: Compression | None = None
    exporters.quiet_repeated_export_logs()  # OTLP retries and a full disk alike log once per batch
    if use_otlp:
        resolved_compression = exporters.resolve_compression(compression)
        span_exporter, metric_exporter, health = exporters.otlp_exporters(
            endpoint, resolved_protocol, headers, resolved_compression
        )
        mode: Literal["otlp", "file"] = "otlp"
    else:
        path = Path(
            traces_file or os.environ.get(names.ENV_TRACES_FILE) or names.DEFAULT_TRACES_FILE
        ).resolve()
        span_exporter, metric_exporter = exporters.file_exporters(path)
        mode = "file"
    shown_endpoint = endpoint or (env_endpoint if use_otlp else None)
    explicit = endpoint is not None or traces_file is not None
    resource = _resource(service_name)
    notes: list[str] = []

    existing_tracer = trace.get_tracer_provider()
    if isinstance(existing_tracer, trace.ProxyTracerProvider):
        tracer_provider = TracerProvider(resource=resource)
        tracer_provider.add_span_processor(exporters.span_processor(span_exporter))
        trace.set_tracer_provider(tracer_provider)
        exporting_spans = True
    elif explicit and isinstance(existing_tracer, TracerProvider):
        existing_tracer.add_span_processor(exporters.span_processor(span_exporter))
        notes.append("added llmspans' span exporter to the application's existing TracerProvider")
        exporting_spans = True
    else:
        exporting_spans = False
        span_exporter.shutdown()
        notes.append("left the application's existing TracerProvider and its exporters alone")

    existing_meter = metrics.get_meter_provider()
    if type(existing_meter).__name__ == "_ProxyMeterProvider":
        aggregation = Aggregation(exemplars=exemplar_filter())
        reader = AggregatingReader(
            metric_exporter, aggregation, resource, InstrumentationScope(names.INSTRUMENTATION_NAME, __version__),
            export_interval_millis=interval_ms or DEFAULT_METRIC_INTERVAL_MS,
        )  # fmt: skip
        meter_provider = MeterProvider(resource=resource, metric_readers=[reader])
        metrics.set_meter_provider(meter_provider)
        if reader.takes_explicit_histograms():
            _telemetry.aggregate_with(aggregation)  # else the exporter wants other histograms: the SDK's
        else:
            notes.append("the metric exporter asks for non-explicit histograms: the SDK aggregates them")
        _forget_metrics_in_a_forked_child(meter_provider, reader, aggregation)
    else:
        metric_exporter.shutdown()
        notes.append("left the application's existing MeterProvider alone (metrics go to its readers)")

    # atexit runs last-registered first: ending the calls still open is registered after the
    # providers, so it runs before they flush, whatever finalisers were registered before.
    atexit.register(_call.end_open_calls)
    atexit.register(_transport.end_open_attempts)
    if health is not None:
        # atexit runs last-registered first: this marks the exporters as closing before the
        # providers registered above flush, so a dead endpoint is not retried at exit.
        atexit.register(exporters.mark_closing, health)
        _export_health = health
    for note in notes:
        logger.info("llmspans: %s", note)
    return Configuration(
        mode=mode if exporting_spans else "existing",
        service_name=resource.attributes.get(SERVICE_NAME),  # type: ignore[arg-type]
        endpoint=shown_endpoint if mode == "otlp" else None,
        protocol=resolved_protocol if mode == "otlp" else None,
        traces_file=path,
        notes=tuple(notes),
        compression=resolved_compression,
    )


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
            reader.use_resource(current_provider._sdk_config.resource)
            consumer = current_provider._measurement_consumer
            consumer._lock = threading.Lock()  # a fork during a collection leaves it held
            consumer.remove_metric_reader(reader)
            consumer.add_metric_reader(reader)  # fresh storage: no points, start times from now
        except Exception:
            logger.debug("llmspans: could not reset metric state after fork", exc_info=True)

    os.register_at_fork(after_in_child=after_fork_in_child)


def current() -> Configuration | None:
    """The configuration in force, if `configure()` ran."""
    return _current


_export_health: tuple[exporters.ExportHealth, exporters.ExportHealth] | None = None
"""The span and metric export health of the OTLP set-up, if one was made (for tests and diagnostics)."""


def _reset_for_tests() -> None:
    global _current
    with _lock:
        _current = None
