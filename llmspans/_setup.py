"""`configure()`: one call that sets up tracing and metrics export.

With an OTLP endpoint (argument or the standard `OTEL_*` variables) spans go out through
a bounded batch processor and metrics through a periodic reader, both off the request
path. With no endpoint anywhere, the embedded default appends OTLP-JSON lines (the
encoding Jaeger's `/api/v3` returns) to a local file the report reads, through the
official `opentelemetry-exporter-otlp-json-file` exporters.

What an OTLP export promises the application (DESIGN §4, "set-up and export"):

- memory is bounded: at most `SPAN_QUEUE_SIZE` spans wait for export; when the backend is
  slow or down, newer spans are dropped instead of queued;
- nothing reaches the app: exporting runs on the SDK's worker threads, and an exception
  from an exporter is swallowed;
- an unreachable endpoint is said once: a WARNING on the `llmspans` logger names the
  endpoint and the cause; while it stays unreachable, exports fail at once (one real
  attempt every `PROBE_INTERVAL_S`) and the spans are counted as dropped;
- exit is bounded: one export gives up after `EXPORT_TIMEOUT_S` (or the standard
  `OTEL_EXPORTER_OTLP_TIMEOUT`), and flushing at exit waits for at most the export in
  flight and one more, `SHUTDOWN_BOUND_S` in all;
- the OpenTelemetry exporters keep their own log records, but repeats of one message are
  let through once per `REPEAT_LOG_WINDOW_S` (the SDK's per-batch retry warnings would
  otherwise fill the app's log during an outage).

An application that already installed a global provider keeps it: configure adds its
exporter to an SDK TracerProvider only when asked for one explicitly, and says once what
it did.
"""

from __future__ import annotations

import atexit
import importlib
import io
import logging
import os
import re
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal, cast

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    MetricExporter,
    MetricExportResult,
    MetricsData,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.util.re import parse_env_headers

from llmspans import _budget, _content
from llmspans import _names as names

logger = logging.getLogger("llmspans")

Protocol = Literal["grpc", "http/protobuf"]
PROTOCOLS: tuple[Protocol, ...] = ("grpc", "http/protobuf")
Compression = Literal["gzip", "none"]
COMPRESSIONS: tuple[Compression, ...] = ("gzip", "none")
DEFAULT_METRIC_INTERVAL_MS = 10_000

SPAN_QUEUE_SIZE = 2048
"""Spans waiting for export, at most (a few MB); beyond it new spans are dropped. `OTEL_BSP_MAX_QUEUE_SIZE` wins."""
SPAN_BATCH_SIZE = 512
"""Spans per export request. `OTEL_BSP_MAX_EXPORT_BATCH_SIZE` wins."""
EXPORT_TIMEOUT_S = 5.0
"""Seconds one export may take, the exporter's own retries included. `OTEL_EXPORTER_OTLP_TIMEOUT` wins."""
SHUTDOWN_BOUND_S = 2 * EXPORT_TIMEOUT_S
"""Flushing at exit waits for the export in flight and at most one more."""
PROBE_INTERVAL_S = 5.0
"""While the endpoint is unreachable, one export in this many seconds is really attempted."""
REPEAT_LOG_WINDOW_S = 60.0
"""A repeated OpenTelemetry export log message is let through once per this many seconds."""

# The loggers of the OpenTelemetry SDK parts that log once per failed batch or dropped item.
_EXPORT_LOGGERS = (
    "opentelemetry.sdk._shared_internal",
    "opentelemetry.sdk.metrics._internal.export",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.exporter.otlp.proto.http.metric_exporter",
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
    "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
    "opentelemetry.exporter.otlp.proto.grpc.metric_exporter",
)


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


class _LineStream(io.TextIOBase):
    """An append-only text file that writes each line whole under one lock.

    The span and metric exporters run on different threads and share the file; each
    writes one JSON line per call, so a locked write-and-flush keeps lines intact.
    """

    def __init__(self, path: Path) -> None:
        super().__init__()
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - lives as long as the exporters
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            written = self._file.write(text)
            self._file.flush()
            return written

    def flush(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.flush()

    @property
    def closed(self) -> bool:
        return self._file.closed

    def writable(self) -> bool:
        return True


class _RepeatedRecordFilter(logging.Filter):
    """Let one record of each message through per window, per logger; drop the repeats.

    Attached by `configure()` to the OpenTelemetry export loggers (`_EXPORT_LOGGERS`): during an
    outage the HTTP exporter warns once per retry of every batch. The first record of each
    message still reaches the app's handlers, so the cause is in the log once.
    """

    def __init__(self, window: float = REPEAT_LOG_WINDOW_S) -> None:
        super().__init__()
        self._window = window
        self._lock = threading.Lock()
        self._last_seen: dict[tuple[str, int, str], float] = {}
        self.suppressed = 0
        self.recent: dict[str, deque[str]] = {}
        """The latest WARNING-or-worse messages per exporter logger, repeats included: why an export failed."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        if ".exporter." in record.name:
            with self._lock:
                self.recent.setdefault(record.name, deque(maxlen=4)).append(record.getMessage())
        key = (record.name, record.levelno, str(record.msg))
        now = time.monotonic()
        with self._lock:
            last = self._last_seen.get(key)
            if last is not None and now - last < self._window:
                self.suppressed += 1
                return False
            self._last_seen[key] = now
        return True


_repeat_filter = _RepeatedRecordFilter()


def _quiet_repeated_export_logs() -> None:
    for name in _EXPORT_LOGGERS:
        export_logger = logging.getLogger(name)
        if _repeat_filter not in export_logger.filters:
            export_logger.addFilter(_repeat_filter)


class _ExportHealth:
    """Whether one signal's endpoint takes our exports, and what was dropped while it did not.

    After a failed export the endpoint counts as down: exports then fail at once, except one
    real attempt per `PROBE_INTERVAL_S` to notice it is back, and none once the process is
    exiting, so a dead collector costs neither memory nor exit time.
    """

    def __init__(self, signal: str, target: str, *, warn: bool) -> None:
        self.signal = signal
        self.target = target
        self._warn = warn
        self._lock = threading.Lock()
        self._down = False
        self._next_probe = 0.0
        self._outage_dropped = 0
        self.warned = False
        self.closing = False
        self.dropped = 0
        """Items (spans, or metric exports) lost to failed or skipped exports since start."""
        self.failures = 0

    @property
    def down(self) -> bool:
        return self._down

    def should_attempt(self) -> bool:
        with self._lock:
            if not self._down:
                return True
            if self.closing:
                return False
            now = time.monotonic()
            if now < self._next_probe:
                return False
            self._next_probe = now + PROBE_INTERVAL_S
            return True

    def skipped(self, items: int) -> None:
        with self._lock:
            self.dropped += items
            self._outage_dropped += items

    def failed(self, items: int, cause: str) -> None:
        with self._lock:
            self.failures += 1
            self.dropped += items
            self._outage_dropped += items
            newly_down = not self._down
            self._down = True
            self._next_probe = time.monotonic() + PROBE_INTERVAL_S
            say_warning = newly_down and self._warn and not self.warned
            if say_warning:
                self.warned = True
        if say_warning:
            logger.warning(
                "llmspans: could not export %s to %s (%s); %s are being dropped until it answers "
                "(tried again every %.0f s; memory stays bounded)",
                self.signal, self.target, cause, self.signal, PROBE_INTERVAL_S,
            )  # fmt: skip
        elif newly_down:
            logger.info("llmspans: could not export %s to %s (%s)", self.signal, self.target, cause)

    def succeeded(self) -> None:
        with self._lock:
            was_down, dropped = self._down, self._outage_dropped
            self._down = False
            self._outage_dropped = 0
        if was_down:
            logger.info(
                "llmspans: exporting %s to %s again; %d were dropped while it did not answer",
                self.signal, self.target, dropped,
            )  # fmt: skip


def _exporter_logger(exporter: object) -> str:
    """The logger an OTLP exporter reports failures on (the gRPC ones share their base module's)."""
    module = type(exporter).__module__
    return "opentelemetry.exporter.otlp.proto.grpc.exporter" if ".grpc." in module else module


_NETWORK_ERROR = re.compile(
    r"Connection refused|Connection reset by peer|Name or service not known|Temporary failure in name resolution"
    r"|No route to host|Network is unreachable|certificate verify failed"
)
_HTTP_CODE = re.compile(r"code: (\d{3})\b")
_GRPC_CODE = re.compile(r"StatusCode\.([A-Z_]+)")


def _failure_cause(error: BaseException | None, elapsed: float, exporter_logger: str) -> str:
    """A short cause for the warning: the exception, else what the OpenTelemetry exporter just logged."""
    if error is not None:
        return f"{type(error).__name__}: {error}"[:200]
    recent = list(reversed(_repeat_filter.recent.get(exporter_logger, ())))
    for message in recent:
        for pattern, shown in ((_NETWORK_ERROR, "{}"), (_HTTP_CODE, "HTTP {}"), (_GRPC_CODE, "gRPC {}")):
            found = pattern.search(message)
            if found and found.group(found.lastindex or 0) != "DEADLINE_EXCEEDED":
                return shown.format(found.group(found.lastindex or 0))
    if any("timeout" in message or "timed out" in message or "DEADLINE" in message for message in recent):
        return f"no answer within {elapsed:.1f} s"
    return recent[0][:200] if recent else f"the export failed after {elapsed:.1f} s"


class _GuardedSpanExporter(SpanExporter):
    """Delegates to an OTLP span exporter; never raises, says once when the endpoint is down."""

    def __init__(self, inner: SpanExporter, health: _ExportHealth) -> None:
        self._inner = inner
        self.health = health
        self._logger_name = _exporter_logger(inner)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if not self.health.should_attempt():
            self.health.skipped(len(spans))
            return SpanExportResult.FAILURE
        started = time.monotonic()
        try:
            result = self._inner.export(spans)
        except Exception as error:  # an exporter bug must not kill the export thread or reach the app
            self.health.failed(
                len(spans), _failure_cause(error, time.monotonic() - started, self._logger_name)
            )
            return SpanExportResult.FAILURE
        if result is SpanExportResult.SUCCESS:
            self.health.succeeded()
        else:
            self.health.failed(
                len(spans), _failure_cause(None, time.monotonic() - started, self._logger_name)
            )
        return result

    def shutdown(self) -> None:
        try:
            self._inner.shutdown()
        except Exception:
            logger.debug("llmspans: span exporter shutdown failed", exc_info=True)

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        try:
            return self._inner.force_flush(timeout_millis)
        except Exception:
            return False


class _GuardedMetricExporter(MetricExporter):
    """Delegates to an OTLP metric exporter; never raises, skips exports while the endpoint is down.

    Metric failures are logged at INFO only: the one warning is about spans, and a backend that
    takes traces but not metrics (Phoenix, Jaeger) is a normal set-up.
    """

    def __init__(self, inner: MetricExporter, health: _ExportHealth, spans: _ExportHealth | None) -> None:
        # The reader asks its exporter for the temporality and aggregation it wants: pass the inner one's on.
        super().__init__(
            preferred_temporality=inner._preferred_temporality,
            preferred_aggregation=inner._preferred_aggregation,
        )
        self._inner = inner
        self.health = health
        self._spans = spans
        self._logger_name = _exporter_logger(inner)

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any
    ) -> MetricExportResult:
        spans_gone = self._spans is not None and self._spans.closing and self._spans.down
        if spans_gone or not self.health.should_attempt():
            self.health.skipped(1)
            return MetricExportResult.FAILURE
        started = time.monotonic()
        try:
            result = self._inner.export(metrics_data, timeout_millis=timeout_millis, **kwargs)
        except Exception as error:
            self.health.failed(1, _failure_cause(error, time.monotonic() - started, self._logger_name))
            return MetricExportResult.FAILURE
        if result is MetricExportResult.SUCCESS:
            self.health.succeeded()
        else:
            self.health.failed(1, _failure_cause(None, time.monotonic() - started, self._logger_name))
        return result

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        try:
            return self._inner.force_flush(timeout_millis=timeout_millis)
        except Exception:
            return False

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        try:
            self._inner.shutdown(timeout_millis=timeout_millis, **kwargs)
        except Exception:
            logger.debug("llmspans: metric exporter shutdown failed", exc_info=True)


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
) -> Configuration:
    """Set up tracing and metrics for llmspans; safe to call more than once.

    `headers` are added to those of `OTEL_EXPORTER_OTLP_HEADERS` (an explicit one wins over the
    variable's of the same name); `compression` ("gzip" or "none") falls back to
    `OTEL_EXPORTER_OTLP_COMPRESSION`. Export failures never raise into the application.
    """
    global _current
    _check_arguments(service_name, endpoint, protocol, traces_file, headers, metric_interval, compression)
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
        _check_compression(compression, "compression")


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
    health: tuple[_ExportHealth, _ExportHealth] | None = None
    resolved_compression: Compression | None = None
    if use_otlp:
        resolved_compression = _resolve_compression(compression)
        _quiet_repeated_export_logs()
        span_exporter, metric_exporter, health = _otlp_exporters(
            endpoint, resolved_protocol, headers, resolved_compression
        )
        mode: Literal["otlp", "file"] = "otlp"
    else:
        path = Path(
            traces_file or os.environ.get(names.ENV_TRACES_FILE) or names.DEFAULT_TRACES_FILE
        ).resolve()
        span_exporter, metric_exporter = _file_exporters(path)
        mode = "file"
    shown_endpoint = endpoint or (env_endpoint if use_otlp else None)
    explicit = endpoint is not None or traces_file is not None
    resource = _resource(service_name)
    notes: list[str] = []

    existing_tracer = trace.get_tracer_provider()
    if isinstance(existing_tracer, trace.ProxyTracerProvider):
        tracer_provider = TracerProvider(resource=resource)
        tracer_provider.add_span_processor(_span_processor(span_exporter))
        trace.set_tracer_provider(tracer_provider)
        exporting_spans = True
    elif explicit and isinstance(existing_tracer, TracerProvider):
        existing_tracer.add_span_processor(_span_processor(span_exporter))
        notes.append("added llmspans' span exporter to the application's existing TracerProvider")
        exporting_spans = True
    else:
        exporting_spans = False
        span_exporter.shutdown()
        notes.append("left the application's existing TracerProvider and its exporters alone")

    existing_meter = metrics.get_meter_provider()
    if type(existing_meter).__name__ == "_ProxyMeterProvider":
        reader = PeriodicExportingMetricReader(
            metric_exporter, export_interval_millis=interval_ms or DEFAULT_METRIC_INTERVAL_MS
        )
        metrics.set_meter_provider(MeterProvider(resource=resource, metric_readers=[reader]))
    else:
        metric_exporter.shutdown()
        notes.append("left the application's existing MeterProvider alone (metrics go to its readers)")

    if health is not None:
        # atexit runs last-registered first: this marks the exporters as closing before the
        # providers registered above flush, so a dead endpoint is not retried at exit.
        atexit.register(_mark_closing, health)
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


def _mark_closing(health: tuple[_ExportHealth, ...]) -> None:
    for signal_health in health:
        signal_health.closing = True


def _span_processor(exporter: SpanExporter) -> BatchSpanProcessor:
    """A batch processor whose queue is bounded (`SPAN_QUEUE_SIZE`) unless the standard variables say otherwise."""
    return BatchSpanProcessor(
        exporter,
        max_queue_size=None if os.environ.get("OTEL_BSP_MAX_QUEUE_SIZE") else SPAN_QUEUE_SIZE,
        max_export_batch_size=None if os.environ.get("OTEL_BSP_MAX_EXPORT_BATCH_SIZE") else SPAN_BATCH_SIZE,
    )


def _resolve_compression(compression: str | None) -> Compression | None:
    """The explicit argument, else the standard variables; None leaves the exporters' default (none)."""
    if compression is not None:
        return _check_compression(compression, "compression")
    for variable in ("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "OTEL_EXPORTER_OTLP_COMPRESSION"):
        raw = os.environ.get(variable)
        if raw:
            return _check_compression(raw.strip().lower(), variable)
    return None


def _check_compression(value: object, what: str) -> Compression:
    for choice in COMPRESSIONS:
        if value == choice:
            return choice
    raise ValueError(f"{what} must be one of {COMPRESSIONS}, got {value!r}")


def _merged_headers(explicit: Mapping[str, str] | None, signal: str) -> dict[str, str] | None:
    """Explicit headers on top of the standard variable's; None lets the exporter read the variable itself.

    The gRPC exporter takes either the argument or the variable, never both, and gRPC metadata
    keys must be lower case: merging here makes `headers=` and `OTEL_EXPORTER_OTLP_HEADERS` work
    together over both protocols.
    """
    if not explicit:
        return None
    raw = os.environ.get(f"OTEL_EXPORTER_OTLP_{signal}_HEADERS") or os.environ.get(
        "OTEL_EXPORTER_OTLP_HEADERS"
    )
    merged = {key.lower(): value for key, value in parse_env_headers(raw or "", liberal=True).items()}
    merged.update({key.lower(): value for key, value in explicit.items()})
    return merged


def _export_timeout(signal: str) -> float | None:
    """`EXPORT_TIMEOUT_S` unless a standard timeout variable is set (then the exporter reads it)."""
    if os.environ.get(f"OTEL_EXPORTER_OTLP_{signal}_TIMEOUT") or os.environ.get("OTEL_EXPORTER_OTLP_TIMEOUT"):
        return None
    return EXPORT_TIMEOUT_S


def _signal_url(endpoint: str, signal: str) -> str:
    """OTLP/HTTP wants the full URL per signal; a bare collector address gets the standard path."""
    base = endpoint.rstrip("/")
    return base if base.endswith(f"/v1/{signal}") else f"{base}/v1/{signal}"


def _otlp_exporters(
    endpoint: str | None,
    protocol: Protocol,
    headers: Mapping[str, str] | None,
    compression: Compression | None,
) -> tuple[SpanExporter, MetricExporter, tuple[_ExportHealth, _ExportHealth]]:
    """Guarded OTLP exporters; with no explicit endpoint they read every standard variable themselves."""
    span_args: dict[str, Any] = {}
    metric_args: dict[str, Any] = {}
    for args, signal in ((span_args, "TRACES"), (metric_args, "METRICS")):
        merged = _merged_headers(headers, signal)
        if merged is not None:
            args["headers"] = merged
        timeout = _export_timeout(signal)
        if timeout is not None:
            args["timeout"] = timeout
    span_exporter: SpanExporter
    metric_exporter: MetricExporter
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as GrpcMetrics
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpans

        if compression is not None:
            grpc_compression = importlib.import_module("grpc").Compression  # grpcio ships no type stubs
            chosen = grpc_compression.Gzip if compression == "gzip" else grpc_compression.NoCompression
            span_args["compression"] = metric_args["compression"] = chosen
        if endpoint:
            span_args["endpoint"] = metric_args["endpoint"] = endpoint
        span_exporter, metric_exporter = GrpcSpans(**span_args), GrpcMetrics(**metric_args)
        span_target = endpoint or _env_target("TRACES", None) or "localhost:4317"
        metric_target = endpoint or _env_target("METRICS", None) or "localhost:4317"
    else:
        from opentelemetry.exporter.otlp.proto.http import Compression as HttpCompression
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpMetrics
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpans

        if compression is not None:
            span_args["compression"] = metric_args["compression"] = HttpCompression(compression)
        if endpoint:
            span_args["endpoint"] = _signal_url(endpoint, "traces")
            metric_args["endpoint"] = _signal_url(endpoint, "metrics")
        span_exporter, metric_exporter = HttpSpans(**span_args), HttpMetrics(**metric_args)
        span_target = (
            span_args.get("endpoint") or _env_target("TRACES", "traces") or "http://localhost:4318/v1/traces"
        )
        metric_target = (
            metric_args.get("endpoint")
            or _env_target("METRICS", "metrics")
            or "http://localhost:4318/v1/metrics"
        )
    spans = _ExportHealth("spans", span_target, warn=True)
    metric_points = _ExportHealth("metrics", metric_target, warn=False)
    return (
        _GuardedSpanExporter(span_exporter, spans),
        _GuardedMetricExporter(metric_exporter, metric_points, spans),
        (spans, metric_points),
    )


def _env_target(signal: str, path: str | None) -> str | None:
    """Where the exporters send when only the standard variables name the endpoint (for messages)."""
    specific = os.environ.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT")
    if specific:
        return specific
    general = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if general and path:
        return _signal_url(general, path)
    return general


def _file_exporters(path: Path) -> tuple[SpanExporter, MetricExporter]:
    from opentelemetry.exporter.otlp.json.file import FileMetricExporter, FileSpanExporter

    stream = cast(IO[str], _LineStream(path))
    return FileSpanExporter(stream=stream), FileMetricExporter(stream=stream)


def current() -> Configuration | None:
    """The configuration in force, if `configure()` ran."""
    return _current


_export_health: tuple[_ExportHealth, _ExportHealth] | None = None
"""The span and metric export health of the OTLP set-up, if one was made (for tests and diagnostics)."""


def _reset_for_tests() -> None:
    global _current
    with _lock:
        _current = None
