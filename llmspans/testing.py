"""Test helpers: capture the spans and metric points llmspans produces.

    from llmspans.testing import capture

    with capture() as captured:
        answer(question)
    assert captured.span("turn chat").attributes["llmspans.turn.dominant_stage"] == "llm"

Installed with llmspans, the `llmspans_capture` pytest fixture does the same.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from llmspans import (
    _budget,
    _cache,
    _content,
    _deferred,
    _guard,
    _instrument,
    _openinference,
    _phases,
    _prompt,
    _settings,
    _telemetry,
)

__all__ = ["Captured", "MetricPoint", "capture", "llmspans_capture", "reset", "settle"]


def reset() -> None:
    """Forget the process-wide choices and memories a test may have left behind, so the next starts
    clean: the budgets (configured and from `LLMSPANS_BUDGETS`, read again), the content-capture,
    attempt-span, phase-span and OpenInference choices of `configure()` (from the environment again),
    class-level instrumentation, which internal errors were already logged once, the caches' window of
    call durations, and the tokenizers prompt caps loaded.

    Providers and exporters that `configure()` set up stay (OpenTelemetry allows them once per
    process); `capture()` gives each test its own.
    """
    _budget.registry.reset()
    _content.set_configured(None)
    _settings.set_configured_attempt_spans("retries")
    _phases.reset()
    _openinference.reset()
    _instrument.uninstrument_all()
    _guard.forget_reported()
    _cache.stop_watching()
    _prompt.forget()


def settle(timeout: float = 10.0) -> bool:
    """Wait until what finalizers handed over has run: the spans of collected streams and generators
    end, and dropped limiter slots come back, on llmspans' worker thread (never inside the collector).

    `Captured.spans` and `Captured.metric_points` settle by themselves. True when it has run.
    """
    return _deferred.settle(timeout)


@dataclass(frozen=True)
class MetricPoint:
    """One exported point: a counter's or gauge's value, or a histogram's count, sum and buckets."""

    name: str
    attributes: Mapping[str, Any]
    value: float | None = None
    count: int | None = None
    sum: float | None = None
    bucket_counts: Sequence[int] = ()
    explicit_bounds: Sequence[float] = ()
    unit: str = ""
    kind: str = ""  # "histogram", "sum" (counters) or "gauge"


class Captured:
    """The spans finished and metric points recorded inside a `capture()` block."""

    def __init__(
        self, exporter: InMemorySpanExporter, reader: InMemoryMetricReader, tracer_provider: TracerProvider
    ) -> None:
        self.tracer_provider = tracer_provider  # to add a span processor of one's own for the block
        self._exporter = exporter
        self._reader = reader
        self._retired: list[MeterProvider] = []

    @property
    def spans(self) -> list[ReadableSpan]:
        """Finished spans, in the order they ended (streams and generators collected so far included)."""
        _deferred.settle()
        return list(self._exporter.get_finished_spans())

    def spans_named(self, name: str) -> list[ReadableSpan]:
        return [span for span in self.spans if span.name == name]

    def span(self, name: str) -> ReadableSpan:
        """The one finished span called `name`; an AssertionError says what there was instead."""
        found = self.spans_named(name)
        if len(found) != 1:
            raise AssertionError(
                f"expected one span named {name!r}, found {len(found)} among {[s.name for s in self.spans]}"
            )
        return found[0]

    def metric_points(self, name: str | None = None) -> list[MetricPoint]:
        """Every point collected now (cumulative since the capture began), optionally of one metric."""
        points: list[MetricPoint] = []
        _deferred.settle()
        data = self._reader.get_metrics_data()
        for resource_metrics in data.resource_metrics if data else ():
            for scope_metrics in resource_metrics.scope_metrics:
                for metric in scope_metrics.metrics:
                    if name is not None and metric.name != name:
                        continue
                    kind = type(metric.data).__name__.lower()
                    unit = metric.unit or ""
                    for point in metric.data.data_points:
                        attributes = dict(point.attributes or {})
                        if isinstance(point, HistogramDataPoint):
                            points.append(
                                MetricPoint(
                                    metric.name, attributes, count=point.count, sum=point.sum,
                                    bucket_counts=tuple(point.bucket_counts),
                                    explicit_bounds=tuple(point.explicit_bounds), unit=unit, kind=kind,
                                )
                            )  # fmt: skip
                        else:
                            value = point.value  # type: ignore[union-attr]
                            points.append(
                                MetricPoint(metric.name, attributes, value=value, unit=unit, kind=kind)
                            )
        return points

    def clear(self) -> None:
        """Forget the spans and metric points recorded so far."""
        self._exporter.clear()
        self._reader = InMemoryMetricReader()
        provider = MeterProvider(metric_readers=[self._reader])
        self._retired.append(provider)
        _telemetry.replace_meter_provider(provider)

    def _shutdown(self) -> None:
        for provider in self._retired:
            provider.shutdown()


@contextmanager
def capture() -> Iterator[Captured]:
    """Record llmspans' telemetry into private in-memory providers for the length of the block."""
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    captured = Captured(exporter, reader, tracer_provider)
    try:
        with _telemetry.use_providers(tracer_provider, meter_provider):
            yield captured
    finally:
        tracer_provider.shutdown()
        meter_provider.shutdown()
        captured._shutdown()


try:
    import pytest
except ImportError:  # pragma: no cover - pytest is only needed for the fixture
    pass
else:

    @pytest.fixture
    def llmspans_capture() -> Iterator[Captured]:
        """Yield a `Captured` holding the spans and metric points of one test."""
        with capture() as captured:
            yield captured
