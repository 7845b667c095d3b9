"""llmspans' own aggregation exports what the SDK's instruments export for the same measurements.

One scripted workload (every instant given, span ids from a fixed sequence) runs twice: once
through the SDK's instruments (an application's own MeterProvider) and once through llmspans'
aggregation behind the reader `configure()` installs. The points must agree on names, units,
attributes, boundaries, bucket counts, counts, sums, min, max and exemplars.
"""

from __future__ import annotations

import bisect
import gc
import itertools
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.metrics import Counter, Histogram, MeterProvider
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    HistogramDataPoint,
    InMemoryMetricReader,
    MetricsData,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

import llmspans
from llmspans import _metrics, _stages, _telemetry
from llmspans import _names as names
from llmspans._aggregation import CARDINALITY_LIMIT, AggregatingReader, Aggregation
from llmspans._call import CallRecord
from tests.support.golden import CountingIds, Kept

MS = 1_000_000
TEMPORALITIES = {
    "cumulative": AggregationTemporality.CUMULATIVE,
    "delta": AggregationTemporality.DELTA,
}


def play(round_number: int) -> None:
    """A scripted workload: streamed and plain calls, retries, new connections, errors, stages, a turn."""
    for index in range(6):
        stream = index % 2 == 0
        record = CallRecord(
            operation="chat", model=f"m{index % 3}", provider="openai", stream=stream, budget=0.2,
            server_address="127.0.0.1", server_port=8000,
        )  # fmt: skip
        t = record.queued_ns
        for _attempt_number in range(index % 3):
            attempt = record.attempt(t)
            attempt.status, attempt.cause, attempt.new_connection = 503, "http_503", True
            t += 30 * MS
        attempt = record.attempt(t)
        attempt.new_connection = index % 2 == 1
        attempt.connected_ns = t + 2 * MS
        t += (40 + 17 * index + round_number) * MS
        if stream:
            record.set_response("id", f"served-{index % 2}")
            for chunk in range(3 + index):
                record.content_chunk(t + chunk * (5 + chunk * index) * MS)
            t += (3 + index) * 40 * MS
        else:
            attempt.body_done_ns = t
        record.set_usage(10 + index, 3 * index + round_number)
        outcome = "error" if index == 4 else "completed"
        record.finish(outcome, error=TimeoutError() if index == 4 else None, now_ns=t + MS)
    tracer = _telemetry.tracer()
    for stage, elapsed in (("retrieval", 12), ("tool", 250), ("retrieval", 31 + round_number)):
        span = tracer.start_span(stage)
        _stages._record_stage(span, _stages.stage_labels(stage), elapsed * MS, elapsed > 100)
        span.end()


@contextmanager
def tracing() -> Iterator[None]:
    tracer_provider = TracerProvider(id_generator=CountingIds())
    previous = _telemetry._override
    try:
        yield tracer_provider  # type: ignore[misc]
    finally:
        _telemetry._override = previous
        tracer_provider.shutdown()


def through_the_sdk(
    temporality: AggregationTemporality, rounds: int, workload: Callable[[int], None] = play
) -> list[MetricsData]:
    reader = InMemoryMetricReader(preferred_temporality={Histogram: temporality, Counter: temporality})
    provider = MeterProvider(metric_readers=[reader])
    collected = []
    with tracing() as tracer_provider:
        _telemetry._override = (
            tracer_provider.get_tracer("llmspans"),  # type: ignore[attr-defined]
            _metrics.SdkRecorder(provider.get_meter("llmspans")),
        )
        for round_number in range(rounds):
            workload(round_number)
            collected.append(reader.get_metrics_data())
    provider.shutdown()
    return collected


def through_our_aggregation(
    temporality: AggregationTemporality, rounds: int, workload: Callable[[int], None] = play
) -> list[MetricsData]:
    exporter = Kept(temporality)
    aggregation = Aggregation()
    reader = AggregatingReader(
        exporter,
        aggregation,
        Resource.create({}),
        InstrumentationScope("llmspans"),
        export_interval_millis=10**9,
    )
    provider = MeterProvider(metric_readers=[reader])
    with tracing() as tracer_provider:
        _telemetry._override = (tracer_provider.get_tracer("llmspans"), aggregation)  # type: ignore[attr-defined]
        for round_number in range(rounds):
            workload(round_number)
            provider.force_flush()
    provider.shutdown()
    return exporter.exported[:rounds]


def points(data: MetricsData) -> dict[tuple[str, tuple[tuple[str, Any], ...]], dict[str, Any]]:
    """Every histogram and counter point, by metric name and attributes, in comparable form."""
    found: dict[tuple[str, tuple[tuple[str, Any], ...]], dict[str, Any]] = {}
    for resource_metrics in data.resource_metrics:
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                if type(metric.data).__name__ == "Gauge":
                    continue
                for point in metric.data.data_points:
                    key = (metric.name, tuple(sorted(point.attributes.items())))
                    exemplars = [
                        (e.value, e.span_id, e.trace_id, dict(e.filtered_attributes or {}))
                        for e in point.exemplars
                    ]
                    shown: dict[str, Any] = {
                        "unit": metric.unit, "temporality": metric.data.aggregation_temporality,
                        "description": metric.description,
                    }  # fmt: skip
                    if isinstance(point, HistogramDataPoint):
                        shown.update(
                            count=point.count, sum=pytest.approx(point.sum, rel=1e-12), min=point.min, max=point.max,
                            buckets=tuple(point.bucket_counts), bounds=tuple(point.explicit_bounds),
                            exemplars=exemplars,
                        )  # fmt: skip
                    else:
                        shown.update(value=point.value, exemplar_spans={e[1] for e in exemplars})
                    found[key] = shown
    return found


@pytest.mark.parametrize("temporality", sorted(TEMPORALITIES))
def test_both_paths_export_the_same_points(temporality: str) -> None:
    chosen = TEMPORALITIES[temporality]
    sdk = through_the_sdk(chosen, rounds=2)
    ours = through_our_aggregation(chosen, rounds=2)
    for sdk_round, our_round in zip(sdk, ours, strict=True):
        expected, got = points(sdk_round), points(our_round)
        assert sorted(got) == sorted(expected)
        for key, shown in expected.items():
            mine = dict(got[key])
            if (
                "exemplar_spans" in shown
            ):  # a counter's one exemplar is a random pick among its spans, in both
                assert len(mine.pop("exemplar_spans")) == len(shown["exemplar_spans"]) == 1
                shown = {k: v for k, v in shown.items() if k != "exemplar_spans"}
            assert mine == shown, key
    names_seen = {name for name, _ in points(ours[0])}
    assert {
        names.METRIC_OPERATION_DURATION, names.METRIC_TOKEN_USAGE, names.METRIC_TIME_TO_FIRST_CHUNK,
        names.METRIC_TIME_PER_OUTPUT_CHUNK, names.METRIC_BUCKET_DURATION, names.METRIC_STAGE_DURATION,
        names.METRIC_BUDGET_EXCEEDED, names.METRIC_RETRY_ATTEMPTS, names.METRIC_CONNECT_NEW,
    } <= names_seen  # fmt: skip


def test_time_per_output_chunk_is_one_measurement_per_chunk_after_the_first() -> None:
    (data,) = through_our_aggregation(AggregationTemporality.CUMULATIVE, rounds=1)
    chunk_points = [v for (name, _), v in points(data).items() if name == names.METRIC_TIME_PER_OUTPUT_CHUNK]
    # Streamed calls 0, 2 and 4 sent 3, 5 and 7 chunks: 2 + 4 + 6 gaps.
    assert sum(point["count"] for point in chunk_points) == 12
    assert {point["bounds"] for point in chunk_points} == {names.DURATION_BOUNDARIES}


def test_attribute_sets_beyond_the_limit_count_in_one_overflow_set() -> None:
    aggregation = Aggregation()
    records = [
        (_metrics.STAGE_DURATION, 0.5, _metrics.Labels({names.STAGE: f"s{i}"}))
        for i in range(CARDINALITY_LIMIT + 5)
    ]
    aggregation.add(records, None)
    collected = aggregation.collect(lambda spec: AggregationTemporality.CUMULATIVE)
    (metric,) = collected
    attribute_sets = [dict(point.attributes) for point in metric.data.data_points]
    assert len(attribute_sets) == CARDINALITY_LIMIT + 1
    overflow = [p for p in metric.data.data_points if dict(p.attributes) == {names.METRIC_OVERFLOW: True}]
    assert [point.count for point in overflow] == [5]


def test_an_exemplar_keeps_its_span_s_ids_not_the_span() -> None:
    """An exemplar lives until the next collection; the span it came from must not (its attributes and
    events held that long, hundreds of spans at once, made the soak's heap swing by a thousand blocks)."""
    aggregation = Aggregation()
    span = TracerProvider().get_tracer("t").start_span("call")
    span.set_attribute("big", "x" * 1000)
    span.end()
    ids = span.get_span_context()
    aggregation.add(
        [(_metrics.STAGE_DURATION, 0.5, _metrics.Labels({names.STAGE: "s"}))], aggregation.sample(span, 1)
    )
    gone = weakref.ref(span)
    del span
    gc.collect()
    assert gone() is None  # the aggregation let it go
    (metric,) = aggregation.collect(lambda spec: AggregationTemporality.CUMULATIVE)
    (point,) = metric.data.data_points
    assert [(e.span_id, e.trace_id) for e in point.exemplars] == [(ids.span_id, ids.trace_id)]


def test_a_forked_child_starts_from_zero() -> None:
    aggregation = Aggregation()
    aggregation.add([(_metrics.STAGE_DURATION, 0.5, _metrics.Labels({names.STAGE: "s"}))], None)
    aggregation.forget_all()
    assert aggregation.collect(lambda spec: AggregationTemporality.CUMULATIVE) == []


@pytest.mark.parametrize("path", [through_the_sdk, through_our_aggregation], ids=["sdk", "ours"])
def test_a_turn_s_duration_has_the_turn_span_as_its_exemplar(
    path: Callable[..., list[MetricsData]],
) -> None:
    """The turn records its duration as it ends, after its context is detached: the exemplar must still
    come from the turn's own span, not from whatever span is current then (none, or an outer one)."""
    turns: list[int] = []

    def one_turn(round_number: int) -> None:
        outer = _telemetry.tracer().start_span("request handler")
        with trace.use_span(outer, end_on_exit=True), llmspans.turn("chat") as span:
            turns.append(span.get_span_context().span_id)

    (data,) = path(AggregationTemporality.CUMULATIVE, 1, one_turn)
    exemplars = [
        exemplar.span_id
        for resource_metrics in data.resource_metrics
        for scope_metrics in resource_metrics.scope_metrics
        for metric in scope_metrics.metrics
        if metric.name == names.METRIC_STAGE_DURATION
        for point in metric.data.data_points
        if point.attributes.get(names.STAGE) == names.STAGE_TURN
        for exemplar in point.exemplars
    ]
    assert exemplars == turns


# --- the application's own MeterProvider: our aggregation behind its readers ---------------------------


def through_the_applications_provider(
    temporality: AggregationTemporality, rounds: int, workload: Callable[[int], None] = play, readers: int = 1
) -> list[list[MetricsData]]:
    """An application's MeterProvider (in-memory readers), llmspans' aggregation attached to each reader;
    what each reader collected after each round."""
    made = [
        InMemoryMetricReader(preferred_temporality={Histogram: temporality, Counter: temporality})
        for _ in range(readers)
    ]
    provider = MeterProvider(metric_readers=made)
    collected: list[list[MetricsData]] = [[] for _ in made]
    with tracing() as tracer_provider:
        recorder = _telemetry._recorder_of(provider)
        assert not isinstance(recorder, _metrics.SdkRecorder)  # our aggregation stands in for the SDK's
        _telemetry._override = (tracer_provider.get_tracer("llmspans"), recorder)  # type: ignore[attr-defined]
        for round_number in range(rounds):
            workload(round_number)
            for reader, kept in zip(made, collected, strict=True):
                data = reader.get_metrics_data()
                assert data is not None
                kept.append(data)
    provider.shutdown()
    return collected


def assert_same_points(expected_rounds: list[MetricsData], got_rounds: list[MetricsData]) -> None:
    for sdk_round, our_round in zip(expected_rounds, got_rounds, strict=True):
        expected, got = points(sdk_round), points(our_round)
        assert sorted(got) == sorted(expected)
        for key, shown in expected.items():
            mine = dict(got[key])
            if "exemplar_spans" in shown:  # a counter's one exemplar is a random pick among its spans
                assert len(mine.pop("exemplar_spans")) == len(shown["exemplar_spans"]) == 1
                shown = {k: v for k, v in shown.items() if k != "exemplar_spans"}
            assert mine == shown, key


@pytest.mark.parametrize("temporality", sorted(TEMPORALITIES))
def test_on_the_applications_provider_our_aggregation_exports_what_its_instruments_would(
    temporality: str,
) -> None:
    chosen = TEMPORALITIES[temporality]
    (ours,) = through_the_applications_provider(chosen, rounds=3)
    assert_same_points(through_the_sdk(chosen, rounds=3), ours)


def test_every_reader_of_the_applications_provider_gets_every_point() -> None:
    expected = through_the_sdk(AggregationTemporality.CUMULATIVE, rounds=2)
    for collected in through_the_applications_provider(AggregationTemporality.CUMULATIVE, 2, readers=2):
        assert_same_points(expected, collected)


def many_calls(round_number: int) -> None:
    """More calls of one kind than one batch holds (`_aggregation._BATCH`), durations spread over the
    buckets and all of them in one, token counts that vary, some over their budget; then 600 stages."""
    for index in range(300):
        record = CallRecord(
            operation="chat", model="m", provider="openai", stream=False, budget=0.5,
            server_address="127.0.0.1", server_port=8000,
        )  # fmt: skip
        t = record.queued_ns
        attempt = record.attempt(t)
        attempt.new_connection = index % 7 == 0
        spread = (index * 37 + round_number) % 900 if index % 3 else 3
        attempt.body_done_ns = t + spread * MS
        record.set_usage(5 + index % 4, index % 11)
        record.finish("completed", now_ns=t + (spread + 1) * MS)
    tracer = _telemetry.tracer()
    for index in range(600):
        span = tracer.start_span("stage")
        _stages._record_stage(span, _stages.stage_labels("work"), (index % 50) * MS, index % 50 > 40)
        span.end()


@pytest.mark.parametrize("temporality", sorted(TEMPORALITIES))
def test_values_aggregated_in_batches_are_the_points_the_sdk_makes_of_them(temporality: str) -> None:
    chosen = TEMPORALITIES[temporality]
    (ours,) = through_the_applications_provider(chosen, 2, many_calls)
    assert_same_points(through_the_sdk(chosen, 2, many_calls), ours)
    assert_same_points(through_the_sdk(chosen, 2, many_calls), through_our_aggregation(chosen, 2, many_calls))


def test_a_provider_our_aggregation_cannot_stand_in_for_keeps_the_sdk_instruments() -> None:
    """Views may rename, drop or re-bucket llmspans' instruments, and a reader may ask for exponential
    histograms: there the SDK's instruments record, so the application gets what it configured."""
    from opentelemetry.sdk.metrics.view import ExponentialBucketHistogramAggregation, View

    with_views = MeterProvider(
        metric_readers=[InMemoryMetricReader()], views=[View(instrument_name=names.METRIC_OPERATION_DURATION)]
    )
    exponential = MeterProvider(
        metric_readers=[
            InMemoryMetricReader(preferred_aggregation={Histogram: ExponentialBucketHistogramAggregation()})
        ]
    )
    for provider in (with_views, exponential):
        assert isinstance(_telemetry._recorder_of(provider), _metrics.SdkRecorder)
        provider.shutdown()
    plain = MeterProvider(metric_readers=[InMemoryMetricReader()])
    assert _telemetry._recorder_of(plain) is _telemetry._recorder_of(plain)  # attached once, gauges once
    plain.shutdown()


def test_llmspans_own_histograms_are_a_quarter_doubling_apart_and_keep_the_conventions_boundaries() -> None:
    """Fine enough to tell 5 ms from 8 ms (issue 37); the conventions' duration boundaries are among them,
    so a series on either merges with the other on the conventions' grid; `gen_ai.*` keep the conventions'."""
    bounds = _metrics.LATENCY_BOUNDARIES
    assert list(bounds) == sorted(set(bounds))
    assert len(bounds) == 77
    assert set(names.DURATION_BOUNDARIES) <= set(bounds)
    assert bounds[0] < 0.0002
    assert bounds[-1] == 81.92
    assert all(1.18 < upper / lower < 1.2 for lower, upper in itertools.pairwise(bounds))
    assert bisect.bisect_left(bounds, 0.005) != bisect.bisect_left(bounds, 0.008)
    for spec in _metrics.INSTRUMENTS:
        if spec.name.startswith("gen_ai.") and spec.unit == "s":
            assert spec.boundaries == names.DURATION_BOUNDARIES, spec.name
        elif spec.name.startswith("llmspans.") and spec.unit == "s":
            assert spec.boundaries == bounds, spec.name
