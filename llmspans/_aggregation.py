"""llmspans' own metric aggregation: its histograms and counters at about a microsecond a value.

When `configure()` built the metrics pipeline, every histogram and counter llmspans emits is
aggregated here rather than through the SDK's instruments (a `Histogram.record` there is 12 µs,
21 µs inside a sampled span). What it keeps is what the SDK would export for the same
measurements: per instrument and attribute set, the bucket counts on the instrument's explicit
boundaries (a value on a boundary counts in the bucket below it), count, sum, min and max; one
exemplar per histogram bucket (the last one, as the SDK's aligned reservoir keeps) and one per
counter (reservoir sampling), from the calls the exemplar filter lets through; at most
`CARDINALITY_LIMIT` attribute sets per instrument, then one overflow set. Memory is constant in
the number of measurements.

`AggregatingReader`, the periodic reader `configure()` installs, adds these points to what the
SDK collected (the gauges) at each collection, in the reader's temporality per instrument
kind, before they reach the exporter: the OpenTelemetry exporters get the SDK's own
`MetricsData` classes. On a MeterProvider the application set up itself nothing here is used.

Threads: none of its own. One lock guards the series: held for a few additions per call and
for a collection's snapshot, never taken from a finalizer. At fork the child starts from zero.
"""

from __future__ import annotations

import os
import random
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from opentelemetry import trace
from opentelemetry.sdk.metrics import Exemplar
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    HistogramDataPoint,
    Metric,
    MetricsData,
    NumberDataPoint,
    PeriodicExportingMetricReader,
    ResourceMetrics,
    ScopeMetrics,
    Sum,
)
from opentelemetry.sdk.metrics.export import Histogram as HistogramData
from opentelemetry.sdk.metrics.view import DefaultAggregation, ExplicitBucketHistogramAggregation
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from llmspans import _names as names
from llmspans._metrics import COUNTER, HISTOGRAM, INSTRUMENTS, InstrumentSpec, Labels, Sample

CARDINALITY_LIMIT = 2000
"""Attribute sets per instrument, as the SDK's default; later ones count in one overflow set."""
_OVERFLOW = Labels({names.METRIC_OVERFLOW: True})


class _Series:
    """One instrument's points for one attribute set since its start (or the last delta collection)."""

    __slots__ = ("count", "counts", "exemplars", "labels", "max", "min", "seen", "start_ns", "sum")

    def __init__(self, labels: Labels, buckets: int, start_ns: int) -> None:
        self.labels = labels
        self.start_ns = start_ns
        self.counts = [0] * buckets  # a counter keeps one "bucket"
        self.count = 0
        self.sum: float = 0
        self.min = float("inf")
        self.max = float("-inf")
        self.exemplars: list[tuple[float, int, Sample] | None] = [None] * buckets
        self.seen = 0  # measurements offered to a counter's one-exemplar reservoir

    def reset_exemplars(self) -> None:
        self.exemplars = [None] * len(self.exemplars)
        self.seen = 0


class Aggregation:
    """Every series of llmspans' histograms and counters; `Recorder` is what records into it."""

    def __init__(self, *, exemplars: str = "trace_based") -> None:
        self._lock = threading.Lock()
        self._series: list[dict[str, _Series]] = [{} for _ in INSTRUMENTS]
        self.exemplar_filter = exemplars

    # --- recording (called with the values of one call, one stage, one turn) ---------------

    def sample(self, span: trace.Span, time_ns: int) -> Sample | None:
        """Exemplars from a sampled span (`trace_based`, the default), any valid span, or none."""
        if self.exemplar_filter == "always_off":
            return None
        span_context = span.get_span_context()
        if not span_context.is_valid or (
            self.exemplar_filter == "trace_based" and not span_context.trace_flags.sampled
        ):
            return None
        return Sample(span, span_context.span_id, span_context.trace_id, time_ns)

    def chunk_recorder(self, labels: Labels, sample: Sample | None) -> Callable[[int], None] | None:
        return None  # the stream counts its gaps on the boundaries itself: `add_distribution`

    def add(self, records: Sequence[tuple[InstrumentSpec, float, Labels]], sample: Sample | None) -> None:
        """Aggregate several measurements under one lock: a call's dozen values cost one acquisition."""
        now = sample.time_ns if sample is not None else 0
        with self._lock:
            for spec, value, labels in records:
                self._add(spec, value, labels, sample, now)

    def add_distribution(
        self, spec: InstrumentSpec, labels: Labels, counts: Sequence[int], total: float, low: float, high: float,
        lasts: Sequence[float], sample: Sample | None,
    ) -> None:  # fmt: skip
        """Merge measurements a stream already counted on `spec`'s boundaries (the per-chunk gaps)."""
        count = sum(counts)
        if not count:
            return
        with self._lock:
            series = self._find(spec, labels, sample.time_ns if sample is not None else time.time_ns())
            totals = series.counts
            for index, n in enumerate(counts):
                if n:
                    totals[index] += n
                    if sample is not None:
                        series.exemplars[index] = (lasts[index], sample.time_ns, sample)
            series.count += count
            series.sum += total
            if low < series.min:
                series.min = low
            if high > series.max:
                series.max = high

    def _find(self, spec: InstrumentSpec, labels: Labels, now_ns: int) -> _Series:
        table = self._series[spec.index]
        series = table.get(labels.key)
        if series is None:
            if len(table) >= CARDINALITY_LIMIT:
                labels = _OVERFLOW
                series = table.get(labels.key)
            if series is None:
                buckets = len(spec.boundaries) + 1 if spec.kind != COUNTER else 1
                series = table[labels.key] = _Series(labels, buckets, now_ns or time.time_ns())
        return series

    def _add(
        self, spec: InstrumentSpec, value: float, labels: Labels, sample: Sample | None, now: int
    ) -> None:
        series = self._series[spec.index].get(labels.key) or self._find(spec, labels, now)
        series.count += 1
        series.sum += value
        if spec.kind == COUNTER:
            series.counts[0] += 1
            if sample is not None:  # reservoir sampling of one, as the SDK's fixed-size reservoir
                series.seen += 1
                if series.seen == 1 or random.randrange(series.seen) == 0:
                    series.exemplars[0] = (value, now, sample)
            return
        index = bisect_left(spec.boundaries, value)
        series.counts[index] += 1
        if value < series.min:
            series.min = value
        if value > series.max:
            series.max = value
        if sample is not None:
            series.exemplars[index] = (value, now, sample)

    # --- collection -------------------------------------------------------------------------

    def collect(
        self, temporality: Callable[[InstrumentSpec], AggregationTemporality], now_ns: int | None = None
    ) -> list[Metric]:
        """The points since start (cumulative) or since the last collection (delta), as SDK metrics."""
        now = now_ns if now_ns is not None else time.time_ns()
        metrics: list[Metric] = []
        with self._lock:
            for spec in INSTRUMENTS:
                table = self._series[spec.index]
                if not table:
                    continue
                delta = temporality(spec) is AggregationTemporality.DELTA
                points = [self._point(spec, series, now) for series in table.values() if series.count]
                if delta:
                    table.clear()  # as the SDK: the next point starts at its first measurement
                else:
                    for series in table.values():
                        series.reset_exemplars()  # exemplars are per collection, as the SDK's
                if not points:
                    continue
                kind = AggregationTemporality.DELTA if delta else AggregationTemporality.CUMULATIVE
                data: HistogramData | Sum = (
                    Sum(data_points=points, aggregation_temporality=kind, is_monotonic=True)  # type: ignore[arg-type]
                    if spec.kind == COUNTER
                    else HistogramData(data_points=points, aggregation_temporality=kind)  # type: ignore[arg-type]
                )
                metrics.append(
                    Metric(name=spec.name, description=spec.description, unit=spec.unit, data=data)
                )
        return metrics

    def _point(self, spec: InstrumentSpec, series: _Series, now: int) -> HistogramDataPoint | NumberDataPoint:
        attributes = dict(series.labels.attributes)
        exemplars = [
            Exemplar({}, value, at_ns, sample.span_id, sample.trace_id)
            for found in series.exemplars
            if found is not None
            for value, at_ns, sample in (found,)
        ]
        if spec.kind == COUNTER:
            value = series.sum
            return NumberDataPoint(
                attributes=attributes, start_time_unix_nano=series.start_ns, time_unix_nano=now,
                value=int(value) if spec.integer else value, exemplars=exemplars,
            )  # fmt: skip
        return HistogramDataPoint(
            attributes=attributes, start_time_unix_nano=series.start_ns, time_unix_nano=now,
            count=series.count, sum=int(series.sum) if spec.integer else series.sum,
            bucket_counts=tuple(series.counts), explicit_bounds=spec.boundaries,
            min=int(series.min) if spec.integer else series.min,
            max=int(series.max) if spec.integer else series.max, exemplars=exemplars,
        )  # fmt: skip

    def forget_all(self) -> None:
        """Start from zero (a forked child, whose parent exports the points it inherited)."""
        self._lock = threading.Lock()
        self._series = [{} for _ in INSTRUMENTS]


class AggregatingReader(PeriodicExportingMetricReader):
    """The SDK's periodic reader, with llmspans' own points added to each collection."""

    def __init__(
        self, exporter: Any, aggregation: Aggregation, resource: Resource, scope: InstrumentationScope,
        export_interval_millis: float,
    ) -> None:  # fmt: skip
        super().__init__(exporter, export_interval_millis=export_interval_millis)
        self._aggregation = aggregation
        self._resource = resource
        self._scope = scope
        self._temporalities = _by_kind(self._instrument_class_temporality)

    def use_resource(self, resource: Resource) -> None:
        """The resource our own `MetricsData` goes out on (a forked child's has its own instance id)."""
        self._resource = resource

    def takes_explicit_histograms(self) -> bool:
        """Whether the exporter wants the explicit-bucket histograms this aggregation makes (the default);
        `OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION` may ask for exponential ones."""
        chosen = _by_kind(self._instrument_class_aggregation).get(HISTOGRAM)
        return isinstance(chosen, (DefaultAggregation, ExplicitBucketHistogramAggregation))

    def _temporality(self, spec: InstrumentSpec) -> AggregationTemporality:
        chosen = self._temporalities.get(spec.kind)
        return chosen if isinstance(chosen, AggregationTemporality) else AggregationTemporality.CUMULATIVE

    # The SDK marks this final (1.45 has no hook for points aggregated elsewhere, and
    # `_receive_metrics` is not called when the SDK's own instruments have nothing): the provider
    # hands each reader its collect function here, and we wrap it so our points come along.
    # tests/test_aggregation.py fails loudly should the SDK change this.
    def _set_collect_callback(self, func: Any) -> None:  # type: ignore[misc]
        """Collect the SDK's points, then add ours: in a `MetricsData` of our own, on the provider's
        resource, when the SDK has none (no gauge reported)."""

        def collect(reader: Any, *args: Any, **kwargs: Any) -> MetricsData | None:
            return self.merge(func(reader, *args, **kwargs))

        super()._set_collect_callback(collect)  # type: ignore[arg-type]

    def merge(self, collected: MetricsData | None) -> MetricsData | None:
        ours = self._aggregation.collect(self._temporality)
        if not ours:
            return collected
        if collected is None or not collected.resource_metrics:
            return MetricsData(
                resource_metrics=[
                    ResourceMetrics(
                        resource=self._resource,
                        scope_metrics=[ScopeMetrics(scope=self._scope, metrics=ours, schema_url="")],
                        schema_url=self._resource.schema_url,
                    )
                ]
            )
        resource_metrics = collected.resource_metrics[0]
        for scope_metrics in resource_metrics.scope_metrics:
            if scope_metrics.scope.name == self._scope.name:
                cast(list[Metric], scope_metrics.metrics).extend(ours)
                break
        else:
            cast(list[ScopeMetrics], resource_metrics.scope_metrics).append(
                ScopeMetrics(scope=self._scope, metrics=ours, schema_url="")
            )
        return collected


def _by_kind(per_class: Mapping[type[Any], Any]) -> dict[str, Any]:
    """The reader's choice for the SDK's histogram and counter classes (its keys are the SDK's own,
    private, instrument classes: matched by name)."""
    found: dict[str, Any] = {}
    for cls, chosen in per_class.items():
        name = cls.__name__.lstrip("_")
        if name == "Histogram":
            found[HISTOGRAM] = chosen
        elif name == "Counter":
            found[COUNTER] = chosen
    return found


def exemplar_filter() -> str:
    """`OTEL_METRICS_EXEMPLAR_FILTER`, as the SDK reads it: trace_based, always_on or always_off."""
    chosen = os.environ.get("OTEL_METRICS_EXEMPLAR_FILTER", "trace_based").strip().lower()
    return chosen if chosen in ("trace_based", "always_on", "always_off") else "trace_based"
