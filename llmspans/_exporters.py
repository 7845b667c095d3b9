"""Exporters and what they promise the application: bounded, quiet, never in the way.

What an OTLP export promises (DESIGN §4, "set-up and export"):

- memory is bounded: at most `SPAN_QUEUE_SIZE` spans wait for export; when the backend is
  slow or down, the oldest waiting spans make room for new ones (the SDK's queue evicts from
  its far end), and every span lost that way is counted in `ExportHealth.dropped`;
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

The embedded default's file exporters share one locked line stream.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import os
import re
import threading
import time
import weakref
from collections import deque
from collections.abc import Mapping, Sequence
from http import HTTPStatus
from pathlib import Path
from typing import IO, Any, Literal, cast

from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, MetricsData
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.util.re import parse_env_headers

from llmspans import _internals
from llmspans._redact import url_for_log

logger = logging.getLogger("llmspans")

Protocol = Literal["grpc", "http/protobuf"]
PROTOCOLS: tuple[Protocol, ...] = ("grpc", "http/protobuf")
Compression = Literal["gzip", "none"]
COMPRESSIONS: tuple[Compression, ...] = ("gzip", "none")

SPAN_QUEUE_SIZE = 2048
"""Spans waiting for export, at most (a few MB); beyond it the oldest are dropped. `OTEL_BSP_MAX_QUEUE_SIZE` wins."""
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
    "opentelemetry.exporter.otlp.json.file.trace_exporter",  # the embedded default's file exporters
    "opentelemetry.exporter.otlp.json.file.metric_exporter",
)


class _LineStream(io.TextIOBase):
    """An append-only text file that writes each line whole under one lock.

    The span and metric exporters run on different threads and share the file; each
    writes one JSON line per call, so a locked write-and-flush keeps lines intact.
    """

    def __init__(self, path: Path) -> None:
        super().__init__()
        _line_streams[path] = self
        self._lock = threading.Lock()
        self._failed = False
        self._file: IO[str] | None = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - lives as long as the exporters
        except OSError as error:  # a read-only working directory must not stop the app
            logger.warning("llmspans: cannot write traces to %s (%s); spans are dropped", path, error)

    def after_fork_in_child(self) -> None:
        """A fork during a write leaves the lock held in the child: start it afresh there."""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            if self._file is None:
                return len(text)
            try:
                written = self._file.write(text)
                self._file.flush()
            except OSError as error:
                self._cannot_write(error)
                return len(text)
            self._failed = False
            return written

    def _cannot_write(self, error: OSError) -> None:
        """A full disk: said once, then lines are dropped quietly until writing works again."""
        if not self._failed:
            self._failed = True
            logger.warning("llmspans: cannot write traces (%s); spans are dropped until it can", error)

    def flush(self) -> None:
        with self._lock:
            if self._file is not None and not self._file.closed:
                try:
                    self._file.flush()
                except OSError as error:
                    self._cannot_write(error)

    @property
    def closed(self) -> bool:
        return self._file is not None and self._file.closed

    def writable(self) -> bool:
        return True


_line_streams: weakref.WeakValueDictionary[Path, _LineStream] = weakref.WeakValueDictionary()


def append_whole_lines(target: Path, source: Path) -> int:
    """Append `source`'s lines to the traces file `target` and say how many; OSError when one of them cannot
    be read or written.

    Through the line stream this process's exporters write `target` with, when there is one, so none of
    their lines is cut in two; else opened for appending. A last line without its newline (its writer died
    in the middle of it) is left out: the file keeps only whole OTLP-JSON documents.
    """
    stream = _line_streams.get(target)
    appended = 0
    with open(source, encoding="utf-8") as lines, contextlib.ExitStack() as stack:
        write = (
            stream.write
            if stream is not None
            else stack.enter_context(open(target, "a", encoding="utf-8")).write
        )
        for line in lines:
            if line.endswith("\n"):
                write(line)
                appended += 1
    return appended


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


def quiet_repeated_export_logs() -> None:
    for name in _EXPORT_LOGGERS:
        export_logger = logging.getLogger(name)
        if _repeat_filter not in export_logger.filters:
            export_logger.addFilter(_repeat_filter)


class ExportHealth:
    """Whether one signal's endpoint takes our exports, and what was dropped while it did not.

    After a failed export the endpoint counts as down: exports then fail at once, except one
    real attempt per `PROBE_INTERVAL_S` to notice it is back, and none once the process is
    exiting, so a dead collector costs neither memory nor exit time.
    """

    def __init__(self, signal: str, target: str, *, warn: bool) -> None:
        self.signal = signal
        self.target = url_for_log(target)  # it goes into a log line: no credentials
        self._warn = warn
        self._lock = threading.Lock()
        self._down = False
        self._next_probe = 0.0
        self._outage_dropped = 0
        self.warned = False
        self.closing = False
        self._attempts_until = float("inf")  # at exit: no real attempt starts after this (monotonic)
        self.dropped = 0
        """Items (spans, or metric exports) lost to failed or skipped exports since start."""
        self.failures = 0

    @property
    def down(self) -> bool:
        return self._down

    def close(self, attempts_until: float) -> None:
        """The process is exiting: a down endpoint is not tried again, and no export starts after
        `attempts_until` (monotonic); `mark_closing` says why."""
        with self._lock:
            self._attempts_until = attempts_until
            self.closing = True

    def should_attempt(self) -> bool:
        with self._lock:
            if self.closing and time.monotonic() >= self._attempts_until:
                return False  # the exit's bound holds whatever each signal's state
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
_HTTP_TRANSIENT = re.compile(r"Transient error (.+?) encountered")
"""The SDK's retry warning names the status by its reason phrase ("Service Unavailable"), not its code."""
_HTTP_CODE_BY_PHRASE = {status.phrase.lower(): status.value for status in HTTPStatus}
_GRPC_CODE = re.compile(r"StatusCode\.([A-Z_]+)")


def _failure_cause(error: BaseException | None, elapsed: float, exporter_logger: str) -> str:
    """A short cause for the warning: the exception, else what the OpenTelemetry exporter just logged."""
    if error is not None:
        return f"{type(error).__name__}: {error}"[:200]
    recent = list(reversed(_repeat_filter.recent.get(exporter_logger, ())))
    for message in recent:
        transient = _HTTP_TRANSIENT.search(message)
        code = _HTTP_CODE_BY_PHRASE.get(transient.group(1).strip().lower()) if transient else None
        if code is not None:
            return f"HTTP {code}"
        for pattern, shown in ((_NETWORK_ERROR, "{}"), (_HTTP_CODE, "HTTP {}"), (_GRPC_CODE, "gRPC {}")):
            found = pattern.search(message)
            if found and found.group(found.lastindex or 0) != "DEADLINE_EXCEEDED":
                return shown.format(found.group(found.lastindex or 0))
    if any("timeout" in message or "timed out" in message or "DEADLINE" in message for message in recent):
        return f"no answer within {elapsed:.1f} s"
    return recent[0][:200] if recent else f"the export failed after {elapsed:.1f} s"


class _GuardedSpanExporter(SpanExporter):
    """Delegates to an OTLP span exporter; never raises, says once when the endpoint is down."""

    def __init__(self, inner: SpanExporter, health: ExportHealth) -> None:
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

    def __init__(self, inner: MetricExporter, health: ExportHealth, spans: ExportHealth | None) -> None:
        # The reader asks its exporter for the temporality and aggregation it wants: pass the inner one's on.
        temporality, aggregation = _internals.exporter_preferences(inner)
        super().__init__(preferred_temporality=temporality, preferred_aggregation=aggregation)
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


def mark_closing(health: tuple[ExportHealth, ...]) -> None:
    """At exit: a down endpoint is not tried again, and no signal starts a real export later than
    `EXPORT_TIMEOUT_S` after this, so the flushes of every signal end within `SHUTDOWN_BOUND_S` together
    (the export in flight, then at most one more). Each signal's own rule alone bounded that signal only:
    an exit against a refused port took 19.8 s once in a local CI run (bound 10 s; usually 3.3 s)."""
    attempts_until = time.monotonic() + SHUTDOWN_BOUND_S - EXPORT_TIMEOUT_S
    for signal_health in health:
        signal_health.close(attempts_until)


class _CountingSpanProcessor(BatchSpanProcessor):
    """A batch processor that counts the spans its full queue evicts, which the SDK drops silently.

    The SDK's queue is a bounded deque: a span ended while it is full pushes the oldest one out
    (and one ended after shutdown is ignored). Reading the queue is a private part of the SDK;
    should it change shape, spans are still exported, only no longer counted.
    """

    def __init__(self, exporter: _GuardedSpanExporter, **options: Any) -> None:
        super().__init__(exporter, **options)
        self._health = exporter.health

    def on_end(self, span: ReadableSpan) -> None:
        try:
            # A full queue (or a shut one) is rare: the span's flags are read only then.
            if (
                _internals.batch_queue_full(self)
                and span.context is not None
                and span.context.trace_flags.sampled
            ):
                self._health.skipped(1)
        except Exception:  # counting must never stop a span from being queued
            pass
        super().on_end(span)


def span_processor(exporter: SpanExporter) -> BatchSpanProcessor:
    """A batch processor whose queue is bounded (`SPAN_QUEUE_SIZE`) unless the standard variables say otherwise."""
    options: dict[str, Any] = {
        "max_queue_size": None if os.environ.get("OTEL_BSP_MAX_QUEUE_SIZE") else SPAN_QUEUE_SIZE,
        "max_export_batch_size": (
            None if os.environ.get("OTEL_BSP_MAX_EXPORT_BATCH_SIZE") else SPAN_BATCH_SIZE
        ),
    }
    if isinstance(exporter, _GuardedSpanExporter):
        return _CountingSpanProcessor(exporter, **options)
    return BatchSpanProcessor(exporter, **options)


def resolve_compression(compression: str | None) -> Compression | None:
    """The explicit argument, else the standard variables; None leaves the exporters' default (none)."""
    if compression is not None:
        return check_compression(compression, "compression")
    for variable in ("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "OTEL_EXPORTER_OTLP_COMPRESSION"):
        raw = os.environ.get(variable)
        if raw:
            return check_compression(raw.strip().lower(), variable)
    return None


def check_compression(value: object, what: str) -> Compression:
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
    base, question, query = endpoint.partition("?")
    base = base.rstrip("/")
    url = base if base.endswith(f"/v1/{signal}") else f"{base}/v1/{signal}"
    return f"{url}{question}{query}"


def otlp_span_exporter(
    endpoint: str | None,
    protocol: Protocol,
    headers: Mapping[str, str] | None,
    compression: Compression | None,
) -> tuple[_GuardedSpanExporter, ExportHealth]:
    """A guarded OTLP span exporter; with no explicit endpoint it reads the standard variables itself."""
    exporter, target = _otlp_exporter("traces", endpoint, protocol, headers, compression)
    health = ExportHealth("spans", target, warn=True)
    return _GuardedSpanExporter(exporter, health), health


def otlp_metric_exporter(
    endpoint: str | None, protocol: Protocol, headers: Mapping[str, str] | None, compression: Compression | None,
    spans: ExportHealth | None,
) -> tuple[_GuardedMetricExporter, ExportHealth]:  # fmt: skip
    """A guarded OTLP metric exporter; `spans` is the span export's health, when spans go over OTLP too
    (a dead span endpoint at exit stops the metric export as well)."""
    exporter, target = _otlp_exporter("metrics", endpoint, protocol, headers, compression)
    health = ExportHealth("metrics", target, warn=False)
    return _GuardedMetricExporter(exporter, health, spans), health


def _otlp_exporter(
    signal: Literal["traces", "metrics"], endpoint: str | None, protocol: Protocol,
    headers: Mapping[str, str] | None, compression: Compression | None,
) -> tuple[Any, str]:  # fmt: skip
    """The OpenTelemetry OTLP exporter of one signal, and where it sends (for messages)."""
    variable = signal.upper()
    args: dict[str, Any] = {}
    merged = _merged_headers(headers, variable)
    if merged is not None:
        args["headers"] = merged
    timeout = _export_timeout(variable)
    if timeout is not None:
        args["timeout"] = timeout
    if protocol == "grpc":
        if compression is not None:
            grpc_compression = importlib.import_module("grpc").Compression  # grpcio ships no type stubs
            args["compression"] = (
                grpc_compression.Gzip if compression == "gzip" else grpc_compression.NoCompression
            )
        if endpoint:
            args["endpoint"] = endpoint
        if signal == "traces":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpans

            exporter: Any = GrpcSpans(**args)
        else:
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
                OTLPMetricExporter as GrpcMetrics,
            )

            exporter = GrpcMetrics(**args)
        return exporter, endpoint or _env_target(variable, None) or "localhost:4317"
    from opentelemetry.exporter.otlp.proto.http import Compression as HttpCompression

    if compression is not None:
        args["compression"] = HttpCompression(compression)
    if endpoint:
        args["endpoint"] = _signal_url(endpoint, signal)
    if signal == "traces":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpans

        exporter = HttpSpans(**args)
    else:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpMetrics

        exporter = HttpMetrics(**args)
    return exporter, args.get("endpoint") or _env_target(
        variable, signal
    ) or f"http://localhost:4318/v1/{signal}"


def _env_target(signal: str, path: str | None) -> str | None:
    """Where the exporters send when only the standard variables name the endpoint (for messages)."""
    specific = os.environ.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT")
    if specific:
        return specific
    general = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if general and path:
        return _signal_url(general, path)
    return general


def file_exporters(path: Path) -> tuple[SpanExporter, MetricExporter]:
    from opentelemetry.exporter.otlp.json.file import FileMetricExporter, FileSpanExporter

    line_stream = _LineStream(path)
    stream = cast(IO[str], line_stream)
    span_exporter, metric_exporter = FileSpanExporter(stream=stream), FileMetricExporter(stream=stream)

    def after_fork_in_child() -> None:
        line_stream.after_fork_in_child()
        for exporter in (span_exporter, metric_exporter):  # the official exporter's own lock, likewise
            _internals.reset_exporter_lock(exporter)

    os.register_at_fork(after_in_child=after_fork_in_child)
    return span_exporter, metric_exporter
