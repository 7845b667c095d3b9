"""The call record with a controlled clock: every instant is given, so every bucket is known."""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest

from llmspans import _names as names
from llmspans._call import CallRecord
from llmspans.testing import Captured

MS = 1_000_000


def _record(stream: bool, **kwargs: object) -> CallRecord:
    return CallRecord(operation="chat", model="m", provider="openai", stream=stream, **kwargs)  # type: ignore[arg-type]


def _play(
    record: CallRecord, *, limiter: bool, retries: int, new_connection: bool, stream: bool, chunks: int, outcome: str
) -> dict[str, int]:  # fmt: skip
    """Stamp a scripted call on `record` and return the buckets it must produce, in ns."""
    t = record.queued_ns
    expected = dict.fromkeys(names.BUCKETS, 0)
    if limiter:
        t += 7 * MS
        record.admitted(t)
        expected["queue"] = 7 * MS
    for attempt_number in range(retries + 1):
        attempt = record.attempt(t)
        if attempt_number < retries:
            attempt.status, attempt.cause = 429, "http_429"
            t += 3 * MS  # the failed attempt
            t += 20 * MS  # back-off
            expected["retry"] += 23 * MS
    if new_connection:
        attempt.new_connection = True
        attempt.connected_ns = t + 4 * MS
        t += 4 * MS
        expected["connect"] = 4 * MS
    t += 50 * MS
    expected["first_token"] = 50 * MS
    if stream:
        for index in range(chunks):
            record.content_chunk(t + index * 10 * MS)
        t += max(0, chunks - 1) * 10 * MS
        expected["stream"] = max(0, chunks - 1) * 10 * MS
    else:
        attempt.body_done_ns = t
    t += 5 * MS
    expected["post"] = 5 * MS
    if stream and chunks == 0:  # nothing arrived: all waiting counts as waiting for the first token
        expected["first_token"] += expected["post"]
        expected["post"] = 0
    elif stream and outcome == "error":  # it failed while the client waited for the next chunk: never post
        expected["stream"] += expected["post"]
        expected["post"] = 0
    if stream and outcome == "completed":
        record.ended_well = True  # its `[DONE]` came: see the incomplete-stream tests in test_stream.py
    record.finish(outcome, error=RuntimeError("x") if outcome == "error" else None, now_ns=t)
    return expected


CASES = [
    (limiter, retries, new, stream, chunks, outcome)
    for limiter, retries, new, (stream, chunks), outcome in itertools.product(
        (False, True), (0, 2), (False, True), ((False, 0), (True, 0), (True, 1), (True, 6)),
        ("completed", "abandoned", "error"),
    )
]  # fmt: skip


@pytest.mark.parametrize(("limiter", "retries", "new_connection", "stream", "chunks", "outcome"), CASES)
def test_buckets_match_the_script_and_sum_to_the_span_duration(
    captured: Captured, limiter: bool, retries: int, new_connection: bool, stream: bool, chunks: int, outcome: str
) -> None:  # fmt: skip
    record = _record(stream)
    expected = _play(
        record, limiter=limiter, retries=retries, new_connection=new_connection, stream=stream, chunks=chunks,
        outcome=outcome,
    )  # fmt: skip
    (span,) = captured.spans
    attributes = span.attributes or {}
    measured = {bucket: attributes[names.BUCKET_PREFIX + bucket] for bucket in names.BUCKETS}
    assert measured == {bucket: pytest.approx(value * 1e-9, abs=1e-12) for bucket, value in expected.items()}
    assert span.end_time is not None
    assert span.start_time is not None
    assert span.end_time - span.start_time == sum(expected.values())
    if retries:
        assert attributes[names.RETRY_COUNT] == retries
        assert list(attributes[names.RETRY_CAUSES]) == ["http_429"] * retries  # type: ignore[arg-type]
    else:  # zero counts and empty lists carry nothing: left out
        assert names.RETRY_COUNT not in attributes
        assert names.RETRY_CAUSES not in attributes
    assert attributes[names.CONNECT_REUSED] is (not new_connection)
    assert attributes.get(names.CONNECT_NEW, 0) == (1 if new_connection else 0)
    if stream:
        assert attributes[names.STREAM_OUTCOME] == outcome
        assert attributes[names.STREAM_CHUNKS] == chunks
    else:
        assert names.STREAM_OUTCOME not in attributes
    assert (attributes.get(names.ERROR_TYPE) == "RuntimeError") is (outcome == "error")


def test_stream_statistics_events_and_rate(captured: Captured) -> None:
    record = _record(True)
    start = record.queued_ns
    gaps = [10, 10, 10, 10, 10, 10, 10, 10, 10, 40]  # ms
    t = start + 100 * MS
    record.content_chunk(t)
    for gap in gaps:
        t += gap * MS
        record.content_chunk(t)
    record.set_usage(12, 11)
    record.set_response("chatcmpl-1", "m-2024", ["stop"])
    record.finish("completed", now_ns=t + MS)
    (span,) = captured.spans
    attributes = span.attributes or {}
    assert attributes[names.ITL_P50] == pytest.approx(0.010, rel=1 / 16)
    assert attributes[names.ITL_P95] == pytest.approx(0.040, rel=1 / 16)
    assert attributes[names.ITL_MAX] == pytest.approx(0.040)
    assert attributes[names.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK] == pytest.approx(0.100)
    assert attributes[names.OUTPUT_TOKENS_PER_SECOND] == pytest.approx(10 / 0.130)
    assert attributes[names.GEN_AI_USAGE_INPUT_TOKENS] == 12
    assert attributes[names.GEN_AI_USAGE_OUTPUT_TOKENS] == 11
    assert attributes[names.GEN_AI_RESPONSE_ID] == "chatcmpl-1"
    assert attributes[names.GEN_AI_RESPONSE_MODEL] == "m-2024"
    assert list(attributes[names.GEN_AI_RESPONSE_FINISH_REASONS]) == ["stop"]  # type: ignore[arg-type]
    events = {event.name: event.timestamp for event in span.events}
    assert events[names.EVENT_FIRST_TOKEN] - span.start_time == 100 * MS  # type: ignore[operator]
    assert events[names.EVENT_LAST_TOKEN] - span.start_time == 230 * MS  # type: ignore[operator]


def test_finish_runs_once_whatever_calls_it(captured: Captured) -> None:
    record = _record(True)
    record.finish("abandoned")
    record.finish("error", error=ValueError())
    (span,) = captured.spans
    assert (span.attributes or {})[names.STREAM_OUTCOME] == "abandoned"
    assert names.ERROR_TYPE not in (span.attributes or {})


def test_no_usage_means_no_token_attributes_or_metrics(captured: Captured) -> None:
    record = _record(True)
    record.content_chunk(record.queued_ns + MS)
    record.content_chunk(record.queued_ns + 2 * MS)
    record.set_usage(None, "12")
    record.finish("completed", now_ns=record.queued_ns + 3 * MS)
    attributes = captured.spans[0].attributes or {}
    assert names.GEN_AI_USAGE_INPUT_TOKENS not in attributes
    assert names.GEN_AI_USAGE_OUTPUT_TOKENS not in attributes
    assert names.OUTPUT_TOKENS_PER_SECOND not in attributes
    assert captured.metric_points(names.METRIC_TOKEN_USAGE) == []


def test_metrics_carry_buckets_durations_and_retries(captured: Captured) -> None:
    record = _record(False, server_address="127.0.0.1", server_port=8000)
    failed = record.attempt(record.queued_ns)
    failed.cause = "http_503"
    record.attempt(record.queued_ns + 10 * MS).new_connection = True
    record.set_usage(3, 4)
    record.finish("completed", now_ns=record.queued_ns + 30 * MS)
    buckets = {
        p.attributes[names.METRIC_ATTR_BUCKET]: p
        for p in captured.metric_points(names.METRIC_BUCKET_DURATION)
    }
    assert set(buckets) == set(names.BUCKETS)
    assert buckets["retry"].sum == pytest.approx(0.010)
    (duration,) = captured.metric_points(names.METRIC_OPERATION_DURATION)
    assert duration.sum == pytest.approx(0.030)
    assert duration.attributes[names.GEN_AI_PROVIDER_NAME] == "openai"
    assert duration.attributes[names.SERVER_PORT] == 8000
    assert tuple(duration.explicit_bounds) == names.DURATION_BOUNDARIES
    (retry,) = captured.metric_points(names.METRIC_RETRY_ATTEMPTS)
    assert retry.value == 1
    assert retry.attributes[names.METRIC_ATTR_RETRY_CAUSE] == "http_503"
    tokens = {
        p.attributes[names.GEN_AI_TOKEN_TYPE]: p.sum for p in captured.metric_points(names.METRIC_TOKEN_USAGE)
    }
    assert tokens == {"input": 3, "output": 4}
    (connections,) = captured.metric_points(names.METRIC_CONNECT_NEW)
    assert connections.value == 1


def test_llm_budget_from_configuration_is_recorded(captured: Captured) -> None:
    from llmspans import _budget

    _budget.registry.configure({"llm": 0.02})
    record = _record(False)
    record.finish("completed", now_ns=record.queued_ns + 30 * MS)
    (call,) = [span for span in captured.spans if (span.attributes or {}).get(names.STAGE) == names.STAGE_LLM]
    attributes = call.attributes or {}
    assert attributes[names.BUDGET] == 0.02
    assert attributes[names.BUDGET_EXCEEDED] is True
    assert attributes[names.BUDGET_OVERRUN] == pytest.approx(0.01)
    (exceeded,) = captured.metric_points(names.METRIC_BUDGET_EXCEEDED)
    assert exceeded.attributes == {names.STAGE: "llm"}


def test_building_before_the_request_is_first_token_and_a_limiter_wait_is_queue(captured: Captured) -> None:
    """The SDK built the request for 3 ms after the app's call, then a limiter held it 7 ms."""
    called = time.perf_counter_ns() - 3 * MS
    record = CallRecord(operation="chat", model="m", provider="openai", stream=True, called_ns=called)
    assert record.queued_ns == called
    built = called + record.build_ns
    record.admitted(built + 7 * MS)
    record.attempt(built + 7 * MS)
    record.content_chunk(built + 57 * MS)
    record.ended_well = True
    record.finish("completed", now_ns=built + 57 * MS)
    (span,) = captured.spans
    attributes = span.attributes or {}
    assert attributes[names.BUCKET_PREFIX + "queue"] == pytest.approx(0.007, abs=1e-9)
    assert attributes[names.BUCKET_PREFIX + "first_token"] == pytest.approx(
        0.050 + record.build_ns / 1e9, abs=1e-9
    )
    # Time to first chunk counts the building, not the limiter's wait.
    assert attributes[names.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK] == pytest.approx(
        0.050 + record.build_ns / 1e9
    )
    assert span.end_time - span.start_time == 57 * MS + record.build_ns


def test_one_table_of_gaps_gives_the_sketchs_figures_and_the_conventions_histogram() -> None:
    """A stream's gaps are counted once per chunk on one table of buckets; the inter-token p50, p95 and
    maximum and the per-chunk histogram read from it at the end are what a `GapSketch` fed every token's
    share and a count per convention bucket give, also with chunks that carried several tokens."""
    import random
    from bisect import bisect_left

    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider

    from llmspans import _call, _telemetry
    from llmspans import _metrics as metric
    from llmspans._gaps import GapSketch
    from llmspans._metrics import SdkRecorder

    rng = random.Random(7)
    for several in (False, True):
        sinks = (TracerProvider().get_tracer("t"), SdkRecorder(MeterProvider().get_meter("t")))
        with _telemetry_override(_telemetry, sinks):
            record = _call.CallRecord(operation="chat", model="m", provider="openai", stream=True)
        sketch, histogram = GapSketch(), [0] * (len(metric.CHUNK_BOUNDARIES_NS) + 1)
        t = record.queued_ns + 1
        record.content_chunk(t)
        gaps = [0, 1, 15, 16, 10_000_000, 10_000_001, 2**50] + [
            int(rng.lognormvariate(15, 1.5)) for _ in range(400)
        ]
        for gap in gaps:
            tokens = rng.choice((1, 1, 1, 3)) if several else 1
            t += gap
            record.content_chunk(t, tokens)
            histogram[bisect_left(metric.CHUNK_BOUNDARIES_NS, gap)] += 1
            for _ in range(tokens):
                sketch.add(gap // tokens)
        assert record.chunk_counts == histogram
        assert record.chunks == len(gaps) + 1
        p50, p95 = sketch.quantiles_ns(0.5, 0.95)
        assert _call._itl(record) == (p50, p95, sketch.max_ns)
        assert record.gaps is not None
        assert record.gaps.counts == sketch.counts


def _telemetry_override(telemetry: Any, sinks: Any) -> Any:
    from contextlib import contextmanager

    @contextmanager
    def override() -> Any:
        previous = telemetry._override
        telemetry._override = sinks
        try:
            yield
        finally:
            telemetry._override = previous

    return override()
