"""Phase spans, the dominant bucket and the events that explain a call (llmspans/_phases.py and the call
record's span writing), over real HTTP against the simulated server.

A slow call's phases are children of its span with their real start and end; per bucket they add up to
the bucket exactly (the floor is set to 0 here so no phase is left out); a fast call gets none.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import pytest

import llmspans
from llmspans import _budget, _phases
from llmspans import _names as names
from llmspans.testing import Captured
from llmspans.tools.simulator import Behavior, SimulatedServer
from tests.support.openai_clients import MESSAGES, call_span, sync_client
from tests.timing import bucket

MS = 1_000_000


@pytest.fixture
def no_floor() -> Iterator[None]:
    floor, _phases.FLOOR_NS = _phases.FLOOR_NS, 0
    yield
    _phases.FLOOR_NS = floor


def phases_of(captured: Captured, call: Any) -> list[Any]:
    return [s for s in captured.spans if s.parent is not None and s.parent.span_id == call.context.span_id
            and names.PHASE in (s.attributes or {})]  # fmt: skip


def seconds(span: Any) -> float:
    return (span.end_time - span.start_time) / 1e9


def assert_phases_add_up_to_the_buckets(captured: Captured, call: Any) -> None:
    per_bucket: dict[str, int] = defaultdict(int)
    for phase in phases_of(captured, call):
        assert phase.start_time >= call.start_time
        assert phase.end_time <= call.end_time
        per_bucket[phase.attributes[names.PHASE]] += phase.end_time - phase.start_time
    # `retry` is the failed attempts (their own spans) and the back-offs between them.
    attempts = sorted(
        (s for s in captured.spans if s.parent is not None and s.parent.span_id == call.context.span_id
         and names.HTTP_REQUEST_METHOD in (s.attributes or {})),
        key=lambda s: s.start_time,
    )  # fmt: skip
    for failed in attempts[:-1]:
        per_bucket["retry"] += failed.end_time - failed.start_time
    for name in names.BUCKETS:
        assert per_bucket[name] == pytest.approx(round(bucket(call, name) * 1e9), abs=2), name


def test_a_slow_prefill_is_a_long_wait_for_the_first_token(
    server: SimulatedServer, captured: Captured, no_floor: None
) -> None:
    server.default = Behavior(first_chunk_delay=0.25, chunk_gap=0.01, chunks=5)
    client = sync_client(server, {"phase_spans": "always"})
    for _ in client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True):
        pass
    call = call_span(captured)
    phases = {span.name: span for span in phases_of(captured, call)}
    # Loopback: everything but the prefill, the stream and the tail may be 0 ns long (the floor is 0 here).
    assert set(phases) == {
        "preparing the request", "waiting for a slot", "connecting", "waiting for the first token", "streaming",
        "after the last token",
    }  # fmt: skip
    waiting = phases["waiting for the first token"]
    assert 0.25 - 0.005 <= seconds(waiting) <= 0.25 + 0.03
    assert seconds(phases["streaming"]) == pytest.approx(bucket(call, "stream"), abs=1e-6)
    assert call.attributes[names.BUCKET_DOMINANT] == "first_token"
    assert_phases_add_up_to_the_buckets(captured, call)
    # The token events say how far into the call they came, not only when.
    first, last = (e for e in call.events if e.name in (names.EVENT_FIRST_TOKEN, names.EVENT_LAST_TOKEN))
    assert first.attributes[names.ELAPSED] == pytest.approx(
        (first.timestamp - call.start_time) / 1e9, abs=1e-6
    )
    assert last.attributes[names.ELAPSED] == pytest.approx((last.timestamp - call.start_time) / 1e9, abs=1e-6)


def test_retries_are_back_off_bars_and_events_with_their_cause(
    server: SimulatedServer, captured: Captured, no_floor: None
) -> None:
    server.enqueue(Behavior(status=429, retry_after_ms=120), Behavior(status=503, retry_after_ms=60))
    client = sync_client(server, {"phase_spans": "always"})
    client.chat.completions.create(model="tiny", messages=MESSAGES)
    call = call_span(captured)
    backoffs = [span for span in phases_of(captured, call) if span.attributes[names.PHASE] == "retry"]
    assert [span.name for span in backoffs] == ["backing off after http_429", "backing off after http_503"]
    assert [span.attributes[names.HTTP_RESPONSE_STATUS_CODE] for span in backoffs] == [429, 503]
    assert 0.12 - 0.005 <= seconds(backoffs[0]) <= 0.12 + 0.03
    events = [event for event in call.events if event.name == names.EVENT_RETRY]
    assert [e.attributes[names.RETRY_CAUSE] for e in events] == ["http_429", "http_503"]
    assert [e.attributes[names.HTTP_RESPONSE_STATUS_CODE] for e in events] == [429, 503]
    for event, backoff in zip(events, backoffs, strict=True):
        assert event.timestamp == backoff.start_time  # the moment the failed attempt ended
        assert event.attributes[names.RETRY_BACKOFF] == pytest.approx(seconds(backoff), abs=1e-6)
    assert call.attributes[names.BUCKET_DOMINANT] == "retry"
    assert_phases_add_up_to_the_buckets(captured, call)


def test_a_fast_call_gets_no_phase_spans_and_a_slow_or_over_budget_one_does(
    server: SimulatedServer, captured: Captured
) -> None:
    client = sync_client(server)  # the default: "slow"
    client.chat.completions.create(model="tiny", messages=MESSAGES)
    assert phases_of(captured, call_span(captured)) == []
    captured.clear()
    server.default = Behavior(header_delay=0.06)
    over = sync_client(server, {"budget": 0.03})
    over.chat.completions.create(model="tiny", messages=MESSAGES)
    call = call_span(captured)
    assert "waiting for the response" in [span.name for span in phases_of(captured, call)]
    (ran_out,) = [event for event in call.events if event.name == names.EVENT_BUDGET_EXCEEDED]
    assert ran_out.timestamp == call.start_time + 30 * MS  # the instant the budget ran out
    assert ran_out.attributes[names.BUDGET] == 0.03
    captured.clear()
    never = sync_client(server, {"budget": 0.03, "phase_spans": "never"})
    never.chat.completions.create(model="tiny", messages=MESSAGES)
    assert phases_of(captured, call_span(captured)) == []


def test_slow_after_makes_a_call_within_budget_slow(
    server: SimulatedServer, captured: Captured, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_phases, "slow_after_ns", 50 * MS)
    server.default = Behavior(header_delay=0.08)
    sync_client(server).chat.completions.create(model="tiny", messages=MESSAGES)
    assert "waiting for the response" in [s.name for s in phases_of(captured, call_span(captured))]


@pytest.mark.parametrize("bad", ["sometimes", "SLOW", 1, True])
def test_phase_spans_takes_slow_always_or_never(server: SimulatedServer, bad: Any) -> None:
    import openai

    with pytest.raises(ValueError, match="phase_spans must be 'slow'"):
        llmspans.instrument(openai.OpenAI(base_url=server.base_url, api_key="x"), phase_spans=bad)
    with pytest.raises(ValueError, match="phase_spans must be 'slow'"):
        _phases.check(bad)
    with pytest.raises(ValueError, match="slow_after"):
        _phases.check_slow_after("soon")


def test_seconds_are_nanoseconds_over_a_billion_without_float_noise() -> None:
    assert repr(_budget.seconds(98_314)) == "9.8314e-05"
    assert repr(_budget.seconds(1_059_411_355)) == "1.059411355"
