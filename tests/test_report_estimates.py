"""The report's estimates: histogram quantiles with the bucket they lie in, metric points read from OTLP-JSON
lines (cumulative, delta, several processes, a window), weighted quantiles with their interval, and the
triage that names a part only when it stands apart (`_estimates.py`, `_metric_points.py`, `_triage.py`)."""

from __future__ import annotations

import bisect
import json
import math
import random
from typing import Any

import pytest

from llmspans import _metrics
from llmspans import _names as names
from llmspans.report._estimates import (
    Histogram,
    apart,
    histogram_distribution,
    merged,
    rank_interval,
    weighted_distribution,
)
from llmspans.report._metric_points import Counted, MetricPoints, read_metrics
from llmspans.report._model import KIND_BUCKET, KIND_STAGE, Distribution, Part, quantile
from llmspans.report._spans import decode
from llmspans.report._triage import CANNOT_TELL_TRACES, Figures, triage

BOUNDS = _metrics.LATENCY_BOUNDARIES


def histogram_of(values: list[float], bounds: tuple[float, ...] = BOUNDS) -> Histogram:
    counts = [0] * (len(bounds) + 1)
    for value in values:
        counts[bisect.bisect_left(bounds, value)] += 1  # on a boundary: the bucket below, as OpenTelemetry
    return Histogram(bounds, tuple(counts), sum(values), min(values), max(values))


@pytest.mark.parametrize("seed", range(5))
def test_each_histogram_quantile_lies_in_its_interval_and_holds_the_nearest_rank_value(seed: int) -> None:
    rng = random.Random(seed)
    values = [rng.lognormvariate(math.log(0.004), 1.2) for _ in range(rng.randrange(1, 3000))]
    values += [0.030] * rng.randrange(0, 300)  # a spike exactly on no boundary
    ordered = sorted(values)
    distribution = histogram_distribution(histogram_of(values))
    assert distribution.count == len(values)
    assert distribution.max == ordered[-1]
    for q, name in ((0.5, "p50"), (0.95, "p95"), (0.99, "p99")):
        interval = distribution.interval(name)
        assert interval is not None
        exact = quantile(ordered, q)
        assert interval.low <= exact <= interval.high, (name, exact, interval)
        assert interval.low <= distribution.at(q) <= interval.high
        if distribution.bound(name) is None:  # a figure: within a quarter-doubling bucket of the truth
            assert interval.high <= max(interval.low * 1.19 + 1e-12, ordered[-1])


def test_a_quantile_in_the_first_bucket_is_only_its_bound_and_zeros_are_zero() -> None:
    zeros = histogram_distribution(histogram_of([0.0] * 50))
    assert (zeros.p50, zeros.p95, zeros.bounds) == (0.0, 0.0, ())
    small = histogram_distribution(histogram_of([0.0] * 40 + [0.0001] * 10))
    bound = small.bound("p95")
    assert bound is not None
    assert small.p95 == bound.upper == 0.0001  # narrowed by the max


def test_histograms_on_different_boundaries_merge_on_the_ones_they_share() -> None:
    values = [0.003, 0.007, 0.012, 0.025, 0.05, 0.3, 2.0]
    fine, coarse = histogram_of(values), histogram_of(values, names.DURATION_BOUNDARIES)
    both = merged([fine, coarse])
    assert both.bounds == names.DURATION_BOUNDARIES  # the conventions' are every fourth of the fine ones
    assert both.counts == tuple(2 * count for count in coarse.counts)
    assert (both.minimum, both.maximum, both.total) == (0.003, 2.0, pytest.approx(2 * sum(values)))


def test_a_weighted_quantiles_interval_widens_as_the_effective_sample_shrinks() -> None:
    ordered = [i / 1000 for i in range(1, 1001)]
    wide, narrow = rank_interval(ordered, 0.95, 20), rank_interval(ordered, 0.95, 1000)
    assert wide[0] < narrow[0] <= 0.95 <= narrow[1] <= wide[1]
    assert wide[1] == 1.0  # q + 1.96 sd reaches past the top: the max
    distribution = weighted_distribution(ordered, 20)
    assert distribution.interval("p95") is not None
    assert (distribution.p95, distribution.count) == (0.95, 1000)


def _part(kind: str, name: str, p95: float, low: float | None = None, high: float | None = None) -> Part:
    from llmspans.report._model import Interval

    intervals = (Interval("p95", low, high),) if low is not None and high is not None else ()
    return Part(kind, name, Distribution(100, p95 / 2, p95, p95, p95, (), intervals))


def _figures() -> Figures:
    from llmspans.report._model import Connections, Retries, Variability

    return Figures(
        variability=Variability(None, None, None),
        retries=Retries(1, 1, 0, 1, 1.0, 0, {}, 0, {}),
        connections=Connections(1, 1, 0, 0.0, 0),
        limiters=(),
        server=None,
        cannot_tell=CANNOT_TELL_TRACES,
    )


def test_a_part_is_named_only_when_it_stands_apart_beyond_both_intervals() -> None:
    told = triage(
        [
            _part(KIND_STAGE, "retrieval", 0.030, 0.028, 0.034),
            _part(KIND_BUCKET, "first_token", 0.005, 0.004, 0.006),
        ],
        (),
        _figures(),
    )
    assert told is not None
    assert (told.told, told.dominant, told.finding) == (True, "retrieval", "retrieval")
    assert [e.name for e in told.compared] == ["retrieval", "first_token"]
    overlap = triage(
        [
            _part(KIND_STAGE, "retrieval", 0.030, 0.001, 0.300),
            _part(KIND_BUCKET, "first_token", 0.050, 0.004, 0.25),
        ],
        (),
        _figures(),
    )
    assert overlap is not None
    assert (overlap.told, overlap.finding) == (False, "cannot_tell")
    assert overlap.message.startswith("cannot tell first_token (llm bucket) from retrieval (stage) at p95")
    assert CANNOT_TELL_TRACES in overlap.message
    exact = triage([_part(KIND_STAGE, "a", 0.010), _part(KIND_STAGE, "b", 0.010)], (), _figures())
    assert exact is not None
    assert (exact.told, exact.dominant, exact.compared) == (True, "a", ())  # every value's figures: as before
    assert apart(_part(KIND_STAGE, "x", 0.02, 0.019, 0.021).per_trace, _part(KIND_STAGE, "y", 0.01).per_trace)


# --- metric points from OTLP-JSON lines ------------------------------------------------------------------


def _line(
    instance: str, points: list[dict[str, Any]], *, temporality: int = 2, service: str = "app"
) -> bytes:
    resource = {"attributes": [{"key": "service.name", "value": {"stringValue": service}},
                               {"key": "service.instance.id", "value": {"stringValue": instance}}]}  # fmt: skip
    metrics = [
        {"name": names.METRIC_STAGE_DURATION, "unit": "s",
         "histogram": {"dataPoints": points, "aggregationTemporality": temporality}},
        {"name": names.METRIC_OPERATION_DURATION, "unit": "s",
         "histogram": {"dataPoints": [{**points[0], "attributes": []}], "aggregationTemporality": temporality}},
        {"name": names.METRIC_RETRY_ATTEMPTS, "sum": {"dataPoints": [
            {"attributes": [{"key": names.METRIC_ATTR_RETRY_CAUSE, "value": {"stringValue": "http_429"}}],
             "startTimeUnixNano": "1", "timeUnixNano": points[0]["timeUnixNano"], "asInt": "3"}],
            "aggregationTemporality": temporality, "isMonotonic": True}},
        {"name": "some.other.metric", "gauge": {"dataPoints": [{"asDouble": 1.0}]}},
    ]  # fmt: skip
    return json.dumps(
        {"resourceMetrics": [{"resource": resource, "scopeMetrics": [{"metrics": metrics}]}]}
    ).encode()


def _point(stage: str, values: list[float], time_ns: int, start_ns: int = 1) -> dict[str, Any]:
    histogram = histogram_of(values)
    return {
        "attributes": [{"key": names.STAGE, "value": {"stringValue": stage}}],
        "startTimeUnixNano": str(start_ns), "timeUnixNano": str(time_ns), "count": str(len(values)),
        "sum": sum(values), "bucketCounts": [str(c) for c in histogram.counts], "explicitBounds": list(BOUNDS),
        "min": min(values), "max": max(values), "exemplars": [{"asDouble": 0.1, "traceId": "ab" * 16}],
    }  # fmt: skip


def _read(*lines: bytes, since_ns: int | None = None) -> MetricPoints:
    for line in lines:
        assert decode(line) == (None, True)  # the span pass sees a metrics line, and skips its points
    return read_metrics(lines, since_ns)


def test_cumulative_points_count_once_however_many_lines_repeat_them_and_processes_add_up() -> None:
    first = [0.001] * 10 + [0.030] * 2
    later = [*first, 0.002, 0.002]
    points = _read(
        _line("a", [_point("retrieval", first, 10)]),
        _line("a", [_point("retrieval", later, 20)]),
        _line("b", [_point("retrieval", [0.5], 15)]),
        _line("a", [_point("retrieval", first, 10)]),  # an older export read after a newer one
    )
    (retrieval,) = points.histograms(names.METRIC_STAGE_DURATION, names.STAGE).values()
    assert retrieval.count == 15
    counted = Counted.of(points)
    assert counted is not None
    assert counted.stages["retrieval"].count == 15
    assert counted.stages["retrieval"].max == 0.5
    assert (counted.calls, counted.causes) == (15, {"http_429": 6})
    assert Counted.of(points, "another service") is None


def test_delta_points_are_summed_and_a_window_counts_only_what_came_after_its_start() -> None:
    deltas = _read(
        _line("a", [_point("retrieval", [0.001] * 4, 10)], temporality=1),
        _line("a", [_point("retrieval", [0.002] * 6, 20)], temporality=1),
    )
    assert deltas.totals(names.METRIC_STAGE_DURATION) == {"": 10.0}
    cumulative = [_line("a", [_point("retrieval", [0.001] * n, t)]) for n, t in ((4, 10), (9, 20), (12, 30))]
    windowed = _read(*cumulative, since_ns=20)
    (retrieval,) = windowed.histograms(names.METRIC_STAGE_DURATION, names.STAGE).values()
    assert retrieval.count == 3  # 12 at the end, less the 9 it held when the window opened
    assert windowed.totals(names.METRIC_RETRY_ATTEMPTS) == {"": 0.0}
    late_deltas = _read(
        _line("a", [_point("retrieval", [0.001] * 4, 10)], temporality=1),
        _line("a", [_point("retrieval", [0.002] * 6, 20)], temporality=1),
        since_ns=15,
    )
    assert late_deltas.totals(names.METRIC_STAGE_DURATION) == {"": 6.0}


def _bucket_line(first_token: list[float]) -> bytes:
    """A metrics line with `llmspans.bucket.duration` for each bucket (first_token's values, the others 0)."""
    points = []
    for bucket in names.BUCKETS:
        values = first_token if bucket == "first_token" else [0.0] * len(first_token)
        point = _point("x", values, 10)
        point["attributes"] = [{"key": names.METRIC_ATTR_BUCKET, "value": {"stringValue": bucket}}]
        points.append(point)
    resource = {"attributes": [{"key": "service.instance.id", "value": {"stringValue": "a"}}]}
    metrics = [
        {
            "name": names.METRIC_BUCKET_DURATION,
            "histogram": {"dataPoints": points, "aggregationTemporality": 2},
        }
    ]
    return json.dumps(
        {"resourceMetrics": [{"resource": resource, "scopeMetrics": [{"metrics": metrics}]}]}
    ).encode()


def test_a_trace_of_several_calls_is_judged_per_trace_on_the_kept_traces_not_per_call_on_the_metrics() -> (
    None
):
    """Each turn: a 4 ms retrieval and two calls of 3 ms first_token. Per call (the metrics) retrieval is the
    larger; per request (the report's parts) first_token is, 6 ms against 4. Sampled, the metrics cannot say
    what a request spent, so the verdict is the kept traces': first_token, never retrieval."""
    from llmspans.report._analysis import Analysis
    from llmspans.report._spans import Span
    from llmspans.report._traces import Trace

    analysis = Analysis()
    ms = 1_000_000

    def span(
        trace_id: str,
        name: str,
        stage: str,
        start: int,
        end: int,
        parent: str | None,
        number: int,
        **extra: Any,
    ) -> Span:
        attributes = {names.STAGE: stage, names.SAMPLE_WEIGHT: 5.0, **extra}
        buckets = tuple(round(extra.get(f"llmspans.bucket.{b}", 0.0) * 1e9) for b in names.BUCKETS)
        return Span(trace_id, f"{number:016x}", parent, name, 1, start, end, attributes, (), False, "s", "s", stage,
                    end - start, buckets if stage == names.STAGE_LLM else ())  # fmt: skip

    for index in range(20):
        trace_id = f"{index + 1:032x}"
        turn = span(trace_id, "turn chat", names.STAGE_TURN, 0, 11 * ms, None, 1)
        first_token = {"llmspans.bucket.first_token": 0.003}
        spans = [
            turn,
            span(trace_id, "retrieval", "retrieval", 0, 4 * ms, turn.span_id, 2),
            span(trace_id, "chat m", names.STAGE_LLM, 4 * ms, 7 * ms, turn.span_id, 3, **first_token),
            span(trace_id, "chat m", names.STAGE_LLM, 7 * ms, 10 * ms, turn.span_id, 4, **first_token),
        ]
        analysis.add(Trace(index, trace_id, spans))
    stage_line = _line("a", [_point("retrieval", [0.004] * 100, 10), _point("turn", [0.011] * 100, 10)])
    points = read_metrics([stage_line, _bucket_line([0.003] * 200)])
    report = analysis.report(metrics=lambda: points)
    assert report.stages[0].durations.count == 100  # the counts are the metrics'
    triage = report.triage
    assert triage is not None
    assert (triage.dominant, triage.told) == ("first_token", True)
    assert any("decided on the kept traces' estimates" in note for note in report.notes)
