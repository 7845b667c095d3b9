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

import itertools
import logging
import os
import random
import threading
import time
import weakref
from bisect import bisect_left
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from itertools import compress, repeat
from operator import is_not
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

from llmspans import _internals
from llmspans import _names as names
from llmspans._held_span import HeldSpan
from llmspans._metrics import COUNTER, HISTOGRAM, INSTRUMENTS, CallMetrics, InstrumentSpec, Labels, Sample

logger = logging.getLogger("llmspans")

CARDINALITY_LIMIT = 2000
"""Attribute sets per instrument, as the SDK's default; later ones count in one overflow set."""
_OVERFLOW = Labels({names.METRIC_OVERFLOW: True})
_BOUND_KEPT = 1024  # kinds of call whose series are kept resolved at once
_BATCH = 128  # a kind of call's values aggregated together; its memory is bounded by this


class _Series:
    """One instrument's points for one attribute set since its start (or the last delta collection)."""

    __slots__ = ("bounds", "counts", "exemplars", "labels", "max", "min", "seen", "start_ns", "sum")

    def __init__(self, labels: Labels, buckets: int, start_ns: int, bounds: tuple[float, ...]) -> None:
        self.labels = labels
        self.bounds = bounds  # a histogram's boundaries; () for a counter
        self.start_ns = start_ns
        self.counts = [0] * buckets  # a counter keeps one "bucket"
        self.sum: float = 0
        self.min = float("inf")
        self.max = float("-inf")
        # (value, time, sample, order): `order` says which of two values came last, across kinds of call
        self.exemplars: list[tuple[float, int, Sample, int] | None] = [None] * buckets
        self.seen = 0  # measurements offered to a counter's one-exemplar reservoir

    def reset_exemplars(self) -> None:
        self.exemplars = [None] * len(self.exemplars)
        self.seen = 0


class _Pending:
    """One kind of call's values not yet aggregated (rows: the values, the time, the sample), and its
    series once resolved (by member)."""

    __slots__ = ("rows", "series")

    def __init__(self, members: int) -> None:
        self.rows: list[tuple[Any, ...]] = []
        self.series: list[_Series | None] = [None] * members


class Aggregation:
    """Every series of llmspans' histograms and counters; `Recorder` is what records into it."""

    def __init__(self, *, exemplars: str = "trace_based") -> None:
        self._lock = threading.Lock()
        self._series: list[dict[str, _Series]] = [{} for _ in INSTRUMENTS]
        # The series of each kind of call (`CallMetrics`), resolved at its first value: a call's values
        # then go straight to their series. Emptied whenever series are dropped (a delta collection).
        self._bound: dict[CallMetrics, _Pending] = {}
        # Pending values of kinds of call let go of (more than `_BOUND_KEPT`): drained at the next two
        # collections, in case a call was appending to one as it was let go of.
        self._retired: list[tuple[CallMetrics, _Pending]] = []
        self._retired_before: list[tuple[CallMetrics, _Pending]] = []
        self._order = itertools.count()  # which value came last, for the exemplars
        self.exemplar_filter = exemplars
        self.trace_based = exemplars != "always_on"  # a span that does not record gives no exemplar

    # --- recording (called with the values of one call, one stage, one turn) ---------------

    def sample(self, span: trace.Span, time_ns: int) -> Sample | None:
        """Exemplars from a sampled span (`trace_based`, the default), any valid span, or none."""
        if self.exemplar_filter == "always_off":
            return None
        if type(span) is HeldSpan:  # sampled by how it was made: only its ids' validity to look at
            # (`SpanContext` is a tuple: trace_id, span_id, is_remote, flags, state, is_valid; read without
            # its properties' calls, as `_internals.span_context` makes it)
            held = span.context
            return Sample(None, held[1], held[0], time_ns) if held[5] else None
        span_context = span.get_span_context()
        if not span_context.is_valid or (
            self.exemplar_filter == "trace_based" and not span_context.trace_flags.sampled
        ):
            return None
        return Sample(None, span_context.span_id, span_context.trace_id, time_ns)  # ids only: `Sample`

    def chunk_recorder(self, labels: Labels, sample: Sample | None) -> Callable[[int], None] | None:
        return None  # the stream counts its gaps on the boundaries itself: `add_distribution`

    def add(self, records: Sequence[tuple[InstrumentSpec, float, Labels]], sample: Sample | None) -> None:
        """Aggregate several measurements under one lock: a call's dozen values cost one acquisition.

        A histogram's count is the sum of its bucket counts, taken at collection.
        """
        now = sample.time_ns if sample is not None else 0
        tables = self._series
        with self._lock:
            order = next(self._order)
            for spec, value, labels in records:
                series = tables[spec.index].get(labels.key) or self._find(spec, labels, now)
                series.sum += value
                boundaries = spec.boundaries
                if not boundaries:  # a counter: one "bucket", and a one-exemplar reservoir as the SDK's
                    series.counts[0] += 1
                    if sample is not None:
                        series.seen += 1
                        if series.seen == 1 or random.randrange(series.seen) == 0:
                            series.exemplars[0] = (value, now, sample, order)
                    continue
                index = bisect_left(boundaries, value)
                series.counts[index] += 1
                if value < series.min:
                    series.min = value
                if value > series.max:
                    series.max = value
                if sample is not None:
                    series.exemplars[index] = (value, now, sample, order)

    def add_call(self, metrics: CallMetrics, values: Sequence[float], sample: Sample | None) -> None:
        """One call's values, kept with the others of its kind until `_BATCH` of them are aggregated
        together (or a collection comes): the request path pays for an append, and the counting runs
        in C over a column of values at a time. A bucket's exemplar is the latest sampled value in it.

        The append takes no lock: a drain takes the rows it saw off the front of the list, so one
        appended meanwhile stays for the next.
        """
        pending = self._bound.get(metrics)
        if pending is None:
            with self._lock:
                pending = self._pending_for(metrics)
        rows = pending.rows
        if sample is None:
            rows.append((*values, 0, 0, None))
        else:
            rows.append((*values, next(self._order), sample.time_ns, sample))
        if len(rows) >= _BATCH:
            with self._lock:
                self._drain(metrics, pending)

    def _pending_for(self, metrics: CallMetrics) -> _Pending:
        """Under the lock: the pending values of a kind of call (a new one if not seen since the last
        reset)."""
        pending = self._bound.get(metrics)
        if pending is None:
            if len(self._bound) >= _BOUND_KEPT:
                self._drain_all()
                self._retired.extend(self._bound.items())
                self._bound.clear()
            pending = self._bound[metrics] = _Pending(len(metrics.members))
        return pending

    def _drain(self, metrics: CallMetrics, pending: _Pending) -> None:
        """Under the lock: aggregate a kind of call's pending values, member by member (one column of
        values each), as `add` would have one by one; a bucket's exemplar is the latest sampled value
        that fell in it."""
        rows = pending.rows
        taken = len(rows)
        if not taken:
            return
        batch = rows[:taken]
        del rows[:taken]  # what was appended since stays (list operations are atomic)
        columns = list(zip(*batch, strict=True))
        orders, times, samples = columns[-3], columns[-2], columns[-1]
        unsampled = samples.count(None)
        sampled = unsampled != taken
        # The rows an exemplar may come from, in order (every row, when every call was sampled).
        with_sample: Sequence[int] = range(taken)
        if unsampled and sampled:
            with_sample = list(compress(with_sample, map(is_not, samples, repeat(None))))
        bound = pending.series
        for index, (spec, labels) in enumerate(metrics.members):
            column = columns[index]
            series = bound[index]
            if series is None:
                series = bound[index] = self._find(spec, labels, times[0])
            total = sum(column)
            series.sum += total
            boundaries = series.bounds
            if not boundaries:  # a counter: one "bucket", and a one-exemplar reservoir as the SDK's
                series.counts[0] += taken
                if sampled:
                    for value, at_ns, sample, order in zip(column, times, samples, orders, strict=True):
                        if sample is not None:
                            series.seen += 1
                            if series.seen == 1 or random.randrange(series.seen) == 0:
                                series.exemplars[0] = (value, at_ns, sample, order)
                continue
            if not any(column):  # every value 0 (queue, retry, connect, most of the time)
                low = high = column[0]
            else:
                low, high = min(column), max(column)
            if low < series.min:
                series.min = low
            if high > series.max:
                series.max = high
            at = bisect_left(boundaries, low)
            if at == bisect_left(boundaries, high):  # the usual batch: every value in one bucket
                series.counts[at] += taken
                if sampled:
                    for found in reversed(tuple(zip(column, times, samples, orders, strict=True))):
                        if found[2] is not None:  # the latest sampled value is the bucket's exemplar
                            current = series.exemplars[at]
                            if current is None or current[3] < found[3]:
                                series.exemplars[at] = found
                            break
                continue
            indexes = list(map(partial(bisect_left, boundaries), column))
            counts = series.counts
            tally: dict[int, int] = {}
            _internals.count_elements(tally, indexes)
            for at, n in tally.items():
                counts[at] += n
            if sampled:
                # The latest sampled row in each bucket, found in C (a later row overwrites an earlier
                # one's entry): its value is the bucket's exemplar. Finer boundaries spread a batch over
                # more buckets; this keeps the Python work per bucket, not per value.
                exemplars = series.exemplars
                latest = dict(zip(map(indexes.__getitem__, with_sample), with_sample, strict=True))
                for at, row in latest.items():
                    current = exemplars[at]
                    if current is None or current[3] < orders[row]:
                        exemplars[at] = (column[row], times[row], samples[row], orders[row])

    def _drain_all(self) -> None:
        for metrics, pending in self._bound.items():
            self._drain(metrics, pending)
        for metrics, pending in (*self._retired, *self._retired_before):
            self._drain(metrics, pending)

    def add_distribution(
        self, spec: InstrumentSpec, labels: Labels, counts: Sequence[int], total: float, low: float, high: float,
        lasts: Sequence[float], sample: Sample | None,
    ) -> None:  # fmt: skip
        """Merge measurements a stream already counted on `spec`'s boundaries (the per-chunk gaps)."""
        count = sum(counts)
        if not count:
            return
        with self._lock:
            order = next(self._order)
            series = self._find(spec, labels, sample.time_ns if sample is not None else time.time_ns())
            totals = series.counts
            for index, n in enumerate(counts):
                if n:
                    totals[index] += n
                    if sample is not None:
                        series.exemplars[index] = (lasts[index], sample.time_ns, sample, order)
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
                bounds = spec.boundaries if spec.kind != COUNTER else ()
                series = table[labels.key] = _Series(labels, buckets, now_ns or time.time_ns(), bounds)
        return series

    # --- collection -------------------------------------------------------------------------

    def collect(
        self, temporality: Callable[[InstrumentSpec], AggregationTemporality], now_ns: int | None = None
    ) -> list[Metric]:
        """The points since start (cumulative) or since the last collection (delta), as SDK metrics."""
        now = now_ns if now_ns is not None else time.time_ns()
        metrics: list[Metric] = []
        with self._lock:
            self._drain_all()
            self._retired_before, self._retired = self._retired, []
            dropped = False
            for spec in INSTRUMENTS:
                table = self._series[spec.index]
                if not table:
                    continue
                delta = temporality(spec) is AggregationTemporality.DELTA
                points = [self._point(spec, series, now) for series in table.values() if any(series.counts)]
                if delta:
                    table.clear()  # as the SDK: the next point starts at its first measurement
                    dropped = True
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
            if dropped:  # the pending values were drained, and the series they were bound to are gone
                for pending in (*self._bound.values(), *(retired for _, retired in self._retired_before)):
                    pending.series = [None] * len(pending.series)
        return metrics

    def _point(self, spec: InstrumentSpec, series: _Series, now: int) -> HistogramDataPoint | NumberDataPoint:
        attributes = dict(series.labels.attributes)
        exemplars = [
            Exemplar({}, value, at_ns, sample.span_id, sample.trace_id)
            for found in series.exemplars
            if found is not None
            for value, at_ns, sample, _ in (found,)
        ]
        if spec.kind == COUNTER:
            value = series.sum
            return NumberDataPoint(
                attributes=attributes, start_time_unix_nano=series.start_ns, time_unix_nano=now,
                value=int(value) if spec.integer else value, exemplars=exemplars,
            )  # fmt: skip
        return HistogramDataPoint(
            attributes=attributes, start_time_unix_nano=series.start_ns, time_unix_nano=now,
            count=sum(series.counts), sum=int(series.sum) if spec.integer else series.sum,
            bucket_counts=tuple(series.counts), explicit_bounds=spec.boundaries,
            min=int(series.min) if spec.integer else series.min,
            max=int(series.max) if spec.integer else series.max, exemplars=exemplars,
        )  # fmt: skip

    def forget_all(self) -> None:
        """Start from zero (a forked child, whose parent exports the points it inherited)."""
        self._lock = threading.Lock()
        self._series = [{} for _ in INSTRUMENTS]
        self._bound = {}
        self._retired = []
        self._retired_before = []


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
        self._temporalities = _by_kind(_internals.reader_choices(self)[0])

    def use_resource(self, resource: Resource) -> None:
        """The resource our own `MetricsData` goes out on (a forked child's has its own instance id)."""
        self._resource = resource

    def takes_explicit_histograms(self) -> bool:
        """Whether the exporter wants the explicit-bucket histograms this aggregation makes (the default);
        `OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION` may ask for exponential ones."""
        chosen = _by_kind(_internals.reader_choices(self)[1]).get(HISTOGRAM)
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
        return merge(collected, self._aggregation.collect(self._temporality), self._resource, self._scope)


def merge(
    collected: MetricsData | None, ours: list[Metric], resource: Resource, scope: InstrumentationScope
) -> MetricsData | None:
    """The SDK's collection with our points added under `scope`: in a `MetricsData` of our own, on
    `resource`, when the SDK collected nothing (no gauge reported)."""
    if not ours:
        return collected
    if collected is None or not collected.resource_metrics:
        return MetricsData(
            resource_metrics=[
                ResourceMetrics(
                    resource=resource,
                    scope_metrics=[ScopeMetrics(scope=scope, metrics=ours, schema_url="")],
                    schema_url=resource.schema_url,
                )
            ]
        )
    resource_metrics = collected.resource_metrics[0]
    for scope_metrics in resource_metrics.scope_metrics:
        if scope_metrics.scope.name == scope.name:
            cast(list[Metric], scope_metrics.metrics).extend(ours)
            break
    else:
        cast(list[ScopeMetrics], resource_metrics.scope_metrics).append(
            ScopeMetrics(scope=scope, metrics=ours, schema_url="")
        )
    return collected


# --- on the application's own MeterProvider ------------------------------------------------------------

_EXEMPLAR_FILTERS = {
    "TraceBasedExemplarFilter": "trace_based",
    "AlwaysOnExemplarFilter": "always_on",
    "AlwaysOffExemplarFilter": "always_off",
}
_SDK_DEFAULT_LIMIT = 2000


def _unfit(provider: Any) -> str | None:
    """Why our aggregation cannot stand in for the SDK's on this provider without changing what its
    readers export; None when it can. Anything unusual keeps the SDK's instruments."""
    from opentelemetry.sdk.metrics import MeterProvider

    if not isinstance(provider, MeterProvider):
        return "not the SDK's MeterProvider"
    config = _internals.meter_provider_config(provider)
    readers = _internals.meter_provider_readers(provider)
    if config is None or readers is None or _internals.meter_provider_disabled(provider):
        return "a MeterProvider of a shape this version does not know, or disabled"
    if getattr(config, "views", None):
        return "views (they may rename, drop or re-bucket llmspans' instruments)"
    configurator = _internals.meter_configurator(provider)
    if configurator is None or getattr(configurator, "__name__", "") != "_default_meter_configurator":
        return "a meter configurator"
    if type(config.exemplar_filter).__name__ not in _EXEMPLAR_FILTERS:
        return "an exemplar filter of its own"
    if not readers:
        return "no reader"
    for reader in readers:
        if isinstance(reader, AggregatingReader) or not callable(_internals.reader_collect(reader)):
            return "a reader that collects differently"
        _, aggregations, limits_by_class = _internals.reader_choices(reader)
        chosen = _by_kind(aggregations)
        if not _our_histograms(chosen.get(HISTOGRAM)) or not isinstance(
            chosen.get(COUNTER), DefaultAggregation
        ):
            return "a reader that asks for other aggregations (exponential histograms, say)"
        limits = _by_kind(limits_by_class)
        if any(limits.get(kind, _SDK_DEFAULT_LIMIT) != CARDINALITY_LIMIT for kind in (HISTOGRAM, COUNTER)):
            return "a reader with other cardinality limits"
    return None


def _our_histograms(chosen: Any) -> bool:
    """Whether a reader's histogram aggregation gives what ours does: explicit buckets on the instrument's
    own (advisory) boundaries, with min and max (what the OTLP exporters ask for by default)."""
    if isinstance(chosen, DefaultAggregation):
        return True
    if type(chosen) is not ExplicitBucketHistogramAggregation:
        return False
    boundaries, min_max = _internals.explicit_histogram_choice(chosen)
    return boundaries is None and min_max


class _Fanout:
    """One aggregation per reader of the application's provider (each collects on its own schedule and
    temporality), recorded together."""

    def __init__(self, aggregations: Sequence[Aggregation]) -> None:
        self._first = aggregations[0]
        self._all = tuple(aggregations)
        self.trace_based = self._first.trace_based

    def sample(self, span: trace.Span, time_ns: int) -> Sample | None:
        return self._first.sample(span, time_ns)

    def add(self, records: Sequence[tuple[InstrumentSpec, float, Labels]], sample: Sample | None) -> None:
        for aggregation in self._all:
            aggregation.add(records, sample)

    def add_call(self, metrics: CallMetrics, values: Sequence[float], sample: Sample | None) -> None:
        for aggregation in self._all:
            aggregation.add_call(metrics, values, sample)

    def chunk_recorder(self, labels: Labels, sample: Sample | None) -> Callable[[int], None] | None:
        return None

    def add_distribution(
        self, spec: InstrumentSpec, labels: Labels, counts: Sequence[int], total: float, low: float, high: float,
        lasts: Sequence[float], sample: Sample | None,
    ) -> None:  # fmt: skip
        for aggregation in self._all:
            aggregation.add_distribution(spec, labels, counts, total, low, high, lasts, sample)


def attach(provider: Any, scope: InstrumentationScope) -> Aggregation | _Fanout | None:
    """Aggregate llmspans' histograms and counters ourselves on the application's own MeterProvider,
    adding the points to each of its readers' collections; None when it does not fit (`_unfit`): the
    SDK's instruments record them then.

    The same private hook as `AggregatingReader` (the reader's collect function), set on readers the
    application made: each reader exports exactly what the SDK's instruments would have given it,
    in its own temporality, on the provider's resource.
    """
    reason = _unfit(provider)
    if reason is not None:
        logger.debug(
            "llmspans: the SDK's instruments record llmspans' metrics on this MeterProvider: %s", reason
        )
        return None
    exemplars = _EXEMPLAR_FILTERS[type(_internals.meter_provider_config(provider).exemplar_filter).__name__]
    aggregations = []
    for reader in _internals.meter_provider_readers(provider):
        aggregation = Aggregation(exemplars=exemplars)
        _hook(reader, aggregation, provider, scope)
        aggregations.append(aggregation)
        if hasattr(os, "register_at_fork"):
            forget = weakref.WeakMethod(aggregation.forget_all)
            os.register_at_fork(after_in_child=lambda forget=forget: (method := forget()) and method())
    return aggregations[0] if len(aggregations) == 1 else _Fanout(aggregations)


def _hook(reader: Any, aggregation: Aggregation, provider: Any, scope: InstrumentationScope) -> None:
    sdk_collect = _internals.reader_collect(reader)
    temporalities = _by_kind(_internals.reader_choices(reader)[0])

    def temporality(spec: InstrumentSpec) -> AggregationTemporality:
        chosen = temporalities.get(spec.kind)
        return chosen if isinstance(chosen, AggregationTemporality) else AggregationTemporality.CUMULATIVE

    def collect(collecting: Any, *args: Any, **kwargs: Any) -> MetricsData | None:
        collected = sdk_collect(collecting, *args, **kwargs)
        # The provider's resource now (after a fork the SDK gives the child one of its own).
        return merge(
            collected, aggregation.collect(temporality), _internals.meter_provider_resource(provider), scope
        )

    _internals.set_reader_collect(reader, collect)


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
