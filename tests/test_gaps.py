import random

import pytest

from llmspans._gaps import GapSketch, bucket_bounds, bucket_index


@pytest.mark.parametrize("value", [0, 1, 15, 16, 17, 31, 32, 1000, 123_456, 10**9, 2**47, 2**50])
def test_every_value_falls_inside_its_bucket(value: int) -> None:
    low, high = bucket_bounds(bucket_index(value))
    if value < 2**48:
        assert low <= value < high
    else:
        assert bucket_index(value) == bucket_index(2**60)


def test_quantiles_are_within_the_sketch_error_of_exact_ones() -> None:
    rng = random.Random(7)
    values = [int(rng.lognormvariate(16, 1.0)) for _ in range(5000)]
    sketch = GapSketch()
    for value in values:
        sketch.add(value)
    ordered = sorted(values)
    for q in (0.5, 0.95, 0.99):
        exact = ordered[max(0, int(q * len(ordered) + 0.999999) - 1)]
        assert abs(sketch.quantile_ns(q) - exact) <= exact / 16 + 1
    assert sketch.max_ns == max(values)
    assert sketch.count == len(values)


def test_memory_does_not_grow_with_the_stream() -> None:
    sketch = GapSketch()
    size = len(sketch.counts)
    for value in range(100_000):
        sketch.add(value * 997)
    assert len(sketch.counts) == size


def test_empty_sketch_reports_zero() -> None:
    assert GapSketch().quantile_ns(0.5) == 0


def test_the_call_records_inlined_copy_counts_like_the_sketch() -> None:
    """`CallRecord.content_chunk` counts gaps on its own table of buckets (one `bisect` a chunk), and the sketch
    made from it at the end must be the one `GapSketch.add` fills."""
    from opentelemetry.sdk.trace import TracerProvider

    from llmspans import _telemetry
    from llmspans._call import CallRecord
    from llmspans._metrics import SdkRecorder

    rng = random.Random(11)
    gaps = [0, 1, 15, 16, 17, 31, 32, 1000, 10**9, 2**47, 2**50] + [
        int(rng.lognormvariate(14, 2)) for _ in range(500)
    ]
    previous = _telemetry._override
    provider = TracerProvider()
    from opentelemetry.sdk.metrics import MeterProvider

    _telemetry._override = (provider.get_tracer("t"), SdkRecorder(MeterProvider().get_meter("t")))
    try:
        record = CallRecord(operation="chat", model="m", provider="openai", stream=True)
    finally:
        _telemetry._override = previous
    assert record.gaps is not None  # a recording span keeps the sketch
    t = record.queued_ns + 1
    record.content_chunk(t)
    expected = GapSketch()
    for gap in gaps:
        t += gap
        record.content_chunk(t)
        expected.add(gap)
    assert record.gaps.counts == expected.counts
    # The call's copy leaves the count to the end (the sum of the counts, taken when the span is written).
    assert (sum(record.gaps.counts), record.gaps.max_ns) == (expected.count, expected.max_ns)
