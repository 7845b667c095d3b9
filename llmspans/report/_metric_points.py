"""The metric points in an OTLP-JSON file: what counted every call, whatever the traces kept.

`configure()`'s embedded default writes its metric points to the traces file, one export per line, beside
the spans. The span pass only notes which lines hold them (`_spans.decode`); they are read when the report
needs them, a sampled input (`read_metrics`). `MetricPoints.add` takes each line's documents and keeps, per
process (`service.instance.id`), metric, attribute set and start time, the latest cumulative point, or the
sum of the delta points: the whole run's counts and histograms, however many lines repeat them. Only the
metrics the report reads are kept (`WANTED`); their points' exemplars are skipped while decoding (the
traces say what exemplars would). Several files are several processes (or the same process twice: a point
is the same point whichever file holds it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
from opentelemetry.semconv.attributes.service_attributes import SERVICE_INSTANCE_ID, SERVICE_NAME

from llmspans import _names as names
from llmspans.report._estimates import Histogram, histogram_distribution, merged
from llmspans.report._model import KIND_BUCKET, KIND_STAGE, Distribution

WANTED = frozenset({
    names.METRIC_STAGE_DURATION, names.METRIC_BUCKET_DURATION, names.METRIC_OPERATION_DURATION,
    names.METRIC_RETRY_ATTEMPTS, names.METRIC_CONNECT_NEW, names.METRIC_BUDGET_EXCEEDED,
})  # fmt: skip
_DELTA = (1, "AGGREGATION_TEMPORALITY_DELTA")


class _AnyValue(msgspec.Struct, gc=False):
    stringValue: str | None = None
    boolValue: bool | None = None
    intValue: int | None = None
    doubleValue: float | None = None


class _KeyValue(msgspec.Struct, gc=False):
    key: str
    value: _AnyValue = msgspec.field(default_factory=_AnyValue)


class _HistogramPoint(msgspec.Struct, gc=False):
    attributes: list[_KeyValue] = []
    startTimeUnixNano: int = 0
    timeUnixNano: int = 0
    sum: float = 0.0
    bucketCounts: list[int] = []
    explicitBounds: list[float] = []
    min: float | None = None
    max: float | None = None


class _NumberPoint(msgspec.Struct, gc=False):
    attributes: list[_KeyValue] = []
    startTimeUnixNano: int = 0
    timeUnixNano: int = 0
    asInt: int | None = None
    asDouble: float | None = None


class _HistogramData(msgspec.Struct, gc=False):
    dataPoints: list[_HistogramPoint] = []
    aggregationTemporality: int | str | None = None


class _SumData(msgspec.Struct, gc=False):
    dataPoints: list[_NumberPoint] = []
    aggregationTemporality: int | str | None = None


class _Metric(msgspec.Struct, gc=False):
    name: str = ""
    histogram: _HistogramData | None = None
    sum: _SumData | None = None


class _ScopeMetrics(msgspec.Struct, gc=False):
    metrics: list[_Metric] = []


class _Resource(msgspec.Struct, gc=False):
    attributes: list[_KeyValue] = []


class ResourceMetrics(msgspec.Struct, gc=False):
    """One resource's metrics."""

    resource: _Resource | None = None
    scopeMetrics: list[_ScopeMetrics] = []


class _MetricsDocument(msgspec.Struct, gc=False):
    resourceMetrics: list[ResourceMetrics] | None = None


_DECODER = msgspec.json.Decoder(_MetricsDocument, strict=False)


def read_metrics(lines: Iterable[bytes], since_ns: int | None = None) -> MetricPoints:
    """The metric points of OTLP-JSON lines (those `_spans.decode` said hold some); a line that is not a
    metrics document of the shape OTLP gives is skipped."""
    points = MetricPoints(since_ns)
    for line in lines:
        try:
            document = _DECODER.decode(line)
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
        if document.resourceMetrics:
            points.add(document.resourceMetrics)
    return points


def _value(value: _AnyValue) -> str | bool | int | float | None:
    for found in (value.stringValue, value.boolValue, value.intValue, value.doubleValue):
        if found is not None:
            return found
    return None


def _attributes(items: list[_KeyValue]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted((item.key, _value(item.value)) for item in items))


@dataclass
class _Series:
    """One series' points so far: the latest cumulative one, or the deltas summed; with a window's start,
    also the latest cumulative point at or before it (what the series held when the window opened)."""

    service: str
    attributes: dict[str, Any]
    time_ns: int
    value: float  # a counter's
    histogram: Histogram | None
    before_ns: int = -1
    value_before: float = 0.0
    histogram_before: Histogram | None = None

    def amount(self) -> float:
        """A counter's total, or a histogram's count, over the window."""
        if self.histogram is not None:
            return self.histogram.count - (self.histogram_before.count if self.histogram_before else 0)
        return self.value - self.value_before

    def window(self) -> Histogram | None:
        """The histogram over the window: the latest point less the one the window opened on (bucket by
        bucket; min and max are then unknown)."""
        if self.histogram is None or self.histogram_before is None:
            return self.histogram
        before, after = self.histogram_before, self.histogram
        if before.bounds != after.bounds:
            return after
        counts = tuple(max(0, a - b) for a, b in zip(after.counts, before.counts, strict=True))
        return Histogram(after.bounds, counts, after.total - before.total, None, None)


class MetricPoints:
    """The run's histograms and counters, from every metric line read (see the module docstring). With
    `since_ns` (`--since`), only what was counted after it: a cumulative series less the point it held then,
    delta points after it."""

    def __init__(self, since_ns: int | None = None) -> None:
        self._series: dict[tuple[Any, ...], _Series] = {}
        self.points = 0
        self.since_ns = since_ns

    def __bool__(self) -> bool:
        return bool(self._series)

    def add(self, documents: Iterable[ResourceMetrics]) -> None:
        for resource_metrics in documents:
            resource = resource_metrics.resource
            attributes = dict(_attributes(resource.attributes)) if resource is not None else {}
            service = str(attributes.get(SERVICE_NAME, "unknown_service"))
            process = str(attributes.get(SERVICE_INSTANCE_ID, service))
            for scope in resource_metrics.scopeMetrics:
                for metric in scope.metrics:
                    if metric.name in WANTED:
                        self._metric(service, process, metric)

    def _metric(self, service: str, process: str, metric: _Metric) -> None:
        if metric.histogram is not None:
            delta = metric.histogram.aggregationTemporality in _DELTA
            for point in metric.histogram.dataPoints:
                counts = tuple(point.bucketCounts)
                if len(counts) != len(point.explicitBounds) + 1:
                    continue  # not a histogram this report can read
                histogram = Histogram(tuple(point.explicitBounds), counts, point.sum, point.min, point.max)
                self._point(service, process, metric.name, point, delta, 0.0, histogram)
        elif metric.sum is not None:
            delta = metric.sum.aggregationTemporality in _DELTA
            for number in metric.sum.dataPoints:
                value = number.asInt if number.asInt is not None else (number.asDouble or 0.0)
                self._point(service, process, metric.name, number, delta, float(value), None)

    def _point(
        self, service: str, process: str, name: str, point: _HistogramPoint | _NumberPoint, delta: bool,
        value: float, histogram: Histogram | None,
    ) -> None:  # fmt: skip
        attributes = _attributes(point.attributes)
        key = (process, name, attributes, 0 if delta else point.startTimeUnixNano)
        self.points += 1
        since = self.since_ns
        if delta and since is not None and point.timeUnixNano <= since:
            return  # counted before the window
        found = self._series.get(key)
        if found is None:
            found = self._series[key] = _Series(
                service, dict(attributes), point.timeUnixNano, value, histogram
            )
            if not delta and since is not None and point.timeUnixNano <= since:
                found.before_ns, found.value_before, found.histogram_before = (
                    point.timeUnixNano,
                    value,
                    histogram,
                )
            return
        if not delta and since is not None and found.before_ns < point.timeUnixNano <= since:
            found.before_ns, found.value_before, found.histogram_before = point.timeUnixNano, value, histogram
        if delta:
            found.value += value
            if histogram is not None and found.histogram is not None:
                found.histogram = merged([found.histogram, histogram])
            found.time_ns = max(found.time_ns, point.timeUnixNano)
        elif point.timeUnixNano >= found.time_ns:  # cumulative: the latest point holds everything before it
            found.time_ns, found.value, found.histogram = point.timeUnixNano, value, histogram

    # --- what the report asks ---------------------------------------------------------------------------

    def _matching(self, name: str, service: str | None, where: Mapping[str, Any]) -> Iterable[_Series]:
        for (_, metric, _, _), series in self._series.items():
            if metric != name or (service is not None and series.service != service):
                continue
            if all(series.attributes.get(key) == value for key, value in where.items()):
                yield series

    def histograms(
        self, name: str, label: str, *, service: str | None = None, where: Mapping[str, Any] | None = None
    ) -> dict[str, Histogram]:
        """Per value of `label`: the histogram of every series of `name` with that value, merged."""
        found: dict[str, list[Histogram]] = {}
        for series in self._matching(name, service, where or {}):
            histogram = series.window()
            if histogram is not None and histogram.count:
                found.setdefault(str(series.attributes.get(label, "")), []).append(histogram)
        return {value: merged(histograms) for value, histograms in found.items()}

    def totals(self, name: str, label: str | None = None, *, service: str | None = None) -> dict[str, float]:
        """Per value of `label` (or "" for all): a counter's total, or a histogram's count."""
        found: dict[str, float] = {}
        for series in self._matching(name, service, {}):
            key = str(series.attributes.get(label, "")) if label is not None else ""
            found[key] = found.get(key, 0.0) + series.amount()
        return found

    def has(self, name: str, *, service: str | None = None) -> bool:
        return any(True for _ in self._matching(name, service, {}))


@dataclass(frozen=True)
class Counted:
    """What the metrics counted, as the report reads it: each stage's and each bucket's distribution (per
    span, per call), the LLM calls and failed ones by error type, retries by cause, new connections, and
    budget overruns per stage."""

    stages: dict[str, Distribution]
    buckets: dict[str, Distribution]
    calls: int
    errors: dict[str, int]
    causes: dict[str, int]
    new_connections: int
    exceeded: dict[str, int]
    histograms: dict[tuple[str, str], Histogram]  # by (kind, name), as the parts name them

    def part(self, kind: str, name: str, traces: int) -> Distribution:
        """A stage's or bucket's histogram as a per-trace part of `traces` traces, each with at most one of
        its spans: a 0 for every trace without one."""
        histogram = self.histograms[(kind, name)]
        missing = max(0, traces - histogram.count)
        if missing:
            counts = (histogram.counts[0] + missing, *histogram.counts[1:])
            histogram = Histogram(histogram.bounds, counts, histogram.total, 0.0, histogram.maximum)
        return histogram_distribution(histogram)

    @classmethod
    def of(cls, points: MetricPoints, service: str | None = None) -> Counted | None:
        """None when the points hold neither stage nor bucket histograms (nothing that counted a part)."""
        stages = points.histograms(names.METRIC_STAGE_DURATION, names.STAGE, service=service)
        buckets = points.histograms(names.METRIC_BUCKET_DURATION, names.METRIC_ATTR_BUCKET, service=service)
        if not stages and not buckets:
            return None
        calls = points.totals(names.METRIC_OPERATION_DURATION, names.ERROR_TYPE, service=service)
        causes = points.totals(names.METRIC_RETRY_ATTEMPTS, names.METRIC_ATTR_RETRY_CAUSE, service=service)
        return cls(
            stages={stage: histogram_distribution(histogram) for stage, histogram in stages.items()},
            buckets={bucket: histogram_distribution(histogram) for bucket, histogram in buckets.items()},
            histograms={
                **{(KIND_STAGE, stage): histogram for stage, histogram in stages.items()},
                **{(KIND_BUCKET, bucket): histogram for bucket, histogram in buckets.items()},
            },
            calls=round(sum(calls.values())),
            errors=_most_first({error: round(n) for error, n in calls.items() if error and round(n)}),
            causes=_most_first({cause: round(n) for cause, n in causes.items() if round(n)}),
            new_connections=round(sum(points.totals(names.METRIC_CONNECT_NEW, service=service).values())),
            exceeded={
                stage: round(n)
                for stage, n in points.totals(
                    names.METRIC_BUDGET_EXCEEDED, names.STAGE, service=service
                ).items()
            },
        )


def _most_first(counts: dict[str, int]) -> dict[str, int]:
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))
