"""Hedged requests (`instrument(client, hedge=llmspans.Hedge(after=..., backup=...))`), over real HTTP.

Every race here is decided by delays far apart (a slow copy 0.6 s or more, `after` 0.1 s, a fast copy at
once), so the faster copy wins however busy the machine; the tests assert which copy won, what reached the
server and what it saw, and counts, never how long anything took beyond what the server's own stamps (taken
on the same clock as the test's, in this process) say.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor

import llmspans
from llmspans import _names as names
from llmspans import _prompt, _suppress
from llmspans._hedge import policy as _hedge
from llmspans.testing import Captured, settle
from llmspans.tools.simulator import Behavior, RecordedRequest, SimulatedServer
from tests.timing import retry_timing

SERVER_BEHAVIOR = Behavior(chunks=3, usage="finish")
KINDS = ["sync", "async"]
SLOW = 0.6  # the slow copy's delay; `after` is AFTER: a fast copy (no delay) wins by half a second
AFTER = 0.1
MESSAGES = [{"role": "user", "content": "what are hedged requests for"}]


@dataclass
class Answer:
    id: str
    text: str
    input_tokens: int | None
    tasks_left: int = 0  # asyncio tasks other than the test's own, right after the call
    in_flight: list[int] = field(default_factory=list)  # the limiter's, while the answer was read


def slow(stream: bool, seconds: float = SLOW, **more: Any) -> Behavior:
    """A copy that gets nowhere for `seconds`: no first content chunk (a stream), no headers (otherwise)."""
    timing = {"first_chunk_delay": seconds} if stream else {"header_delay": seconds}
    return Behavior(**{"chunks": 3, "usage": "finish", **timing, **more})


FAST = Behavior(chunks=3, usage="finish")


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    """Every test that takes it runs with the sync and the async client."""
    return str(request.param)


@pytest.fixture(params=[True, False], ids=["stream", "whole"])
def stream(request: pytest.FixtureRequest) -> bool:
    """Every test that takes it runs on a streamed and a whole (non-streamed) call."""
    return bool(request.param)


def ask(
    kind: str, url: str, *, stream: bool, after: Any = AFTER, backup_url: str | None = None,
    limiter: llmspans.Limiter | None = None, max_retries: int = 0, attempt_spans: str | None = None, **body: Any,
) -> Answer:  # fmt: skip
    """One call through a freshly made hedged client of `kind`, read to its end."""
    request = {"model": "sim-model", "messages": MESSAGES, "stream": stream, **body}
    if stream:
        request.setdefault("stream_options", {"include_usage": True})
    if kind == "sync":
        backup = (
            None if backup_url is None else openai.OpenAI(base_url=backup_url, api_key="k", max_retries=0)
        )
        client = llmspans.instrument(
            openai.OpenAI(base_url=url, api_key="k", max_retries=max_retries),
            hedge=llmspans.Hedge(after=after, backup=backup), limiter=limiter, attempt_spans=attempt_spans,
        )  # fmt: skip
        with client:
            result = client.chat.completions.create(**request)
            answer = _read(result, stream, limiter)
        if backup is not None:
            backup.close()
        return answer

    async def run() -> Answer:
        backup = (
            None
            if backup_url is None
            else openai.AsyncOpenAI(base_url=backup_url, api_key="k", max_retries=0)
        )
        client = llmspans.instrument(
            openai.AsyncOpenAI(base_url=url, api_key="k", max_retries=max_retries),
            hedge=llmspans.Hedge(after=after, backup=backup), limiter=limiter, attempt_spans=attempt_spans,
        )  # fmt: skip
        async with client:
            result = await client.chat.completions.create(**request)
            tasks_left = len(asyncio.all_tasks()) - 1
            in_flight = [] if limiter is None else [limiter.in_flight]
            if stream:
                chunks = [chunk async for chunk in result]
                answer = _from_chunks(chunks)
            else:
                answer = _from_completion(result)
        if backup is not None:
            await backup.close()
        answer.tasks_left = tasks_left
        answer.in_flight = in_flight + answer.in_flight
        return answer

    return asyncio.run(run())


def _read(result: Any, stream: bool, limiter: llmspans.Limiter | None) -> Answer:
    in_flight = [] if limiter is None else [limiter.in_flight]
    answer = _from_chunks(list(result)) if stream else _from_completion(result)
    answer.in_flight = in_flight
    return answer


def _from_chunks(chunks: list[Any]) -> Answer:
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = next((c.usage for c in chunks if c.usage is not None), None)
    return Answer(chunks[0].id, text, None if usage is None else usage.prompt_tokens)


def _from_completion(result: Any) -> Answer:
    usage = result.usage
    return Answer(
        result.id, result.choices[0].message.content, None if usage is None else usage.prompt_tokens
    )


def call_span(captured: Captured) -> ReadableSpan:
    calls = [s for s in captured.spans if (s.attributes or {}).get(names.STAGE) == names.STAGE_LLM]
    assert len(calls) == 1, [s.name for s in captured.spans]
    return calls[0]


def attempt_spans(captured: Captured, *roles: str) -> dict[str, ReadableSpan]:
    """The copies' attempt spans by role (one attempt each in these tests), once those of `roles` have ended:
    a cut copy's span ends when its cancelled attempt does, which may be just after the call returned."""
    deadline = time.monotonic() + 10
    while True:
        found = {}
        for span in captured.spans:
            role = (span.attributes or {}).get(names.HEDGE_ROLE)
            if role is not None:
                assert role not in found, role
                found[role] = span
        if set(roles) <= set(found) or time.monotonic() > deadline:
            return found
        time.sleep(0.01)


def requests_of(server: SimulatedServer) -> list[RecordedRequest]:
    assert server.wait_idle(10)
    return [r for r in server.requests if r.path.endswith("/chat/completions")]


def was_cut(request: RecordedRequest, stream: bool) -> bool:
    """The server saw the client leave before it had sent what the copy was waiting for."""
    sent_nothing = request.chunk_sent_ns == [] if stream else request.headers_sent_ns is None
    return request.disconnected_ns is not None and sent_nothing


def counter(captured: Captured, name: str, **attributes: Any) -> float:
    return sum(
        point.value or 0
        for point in captured.metric_points(name)
        if all(point.attributes.get(key) == value for key, value in attributes.items())
    )


# --- firing, and which copy wins -------------------------------------------------------------------------


@pytest.mark.parametrize("spans", [None, "always"])
def test_no_backup_is_sent_when_the_primary_answers_within_after(
    kind: str, stream: bool, spans: str | None, server: SimulatedServer, captured: Captured
) -> None:
    answer = ask(kind, server.base_url, stream=stream, after=2.0, attempt_spans=spans)
    assert len(requests_of(server)) == 1
    assert answer.id.endswith("sim1")
    call = call_span(captured).attributes or {}
    assert call[names.HEDGE_FIRED] is False
    assert call[names.HEDGE_AFTER] == 2.0
    assert names.HEDGE_WON_BY not in call
    assert names.HEDGE_WASTED_INPUT_TOKENS not in call
    if spans is None:
        # An unfired hedge costs no span: its only copy is the call's only attempt, whose HTTP facts are
        # on the call span, as they are without a hedge.
        assert attempt_spans(captured) == {}
        assert [s.name for s in captured.spans] == ["chat sim-model"]
        assert call[names.HTTP_RESPONSE_STATUS_CODE] == 200
    else:  # every attempt has its span, the primary's with what it did
        primary = attempt_spans(captured, names.HEDGE_ROLE_PRIMARY)[names.HEDGE_ROLE_PRIMARY].attributes or {}
        assert primary[names.HEDGE_WON] is True
        assert primary[names.HEDGE_FIRST_TOKEN] > 0
    assert not [e for e in call_span(captured).events if e.name == names.EVENT_HEDGE]
    assert counter(captured, names.METRIC_HEDGE_FIRED) == 0


def test_a_slow_primary_is_beaten_by_a_backup_sent_after_after(
    kind: str, stream: bool, server: SimulatedServer, captured: Captured
) -> None:
    server.enqueue(slow(stream), FAST)
    started = time.perf_counter_ns()
    answer = ask(kind, server.base_url, stream=stream)
    primary, backup = requests_of(server)
    # The backup left no earlier than `after` past the call's start (the server stamps on this clock).
    assert backup.arrived_ns - started >= AFTER * 1e9
    assert answer.id.endswith("sim2")  # the backup's answer (the server numbers requests as they arrive)
    assert answer.text == "Hello, this"
    assert was_cut(primary, stream), primary
    assert backup.disconnected_ns is None
    assert backup.finished_ns is not None
    span = call_span(captured)
    call = span.attributes or {}
    assert (call[names.HEDGE_FIRED], call[names.HEDGE_WON_BY]) == (True, names.HEDGE_ROLE_BACKUP)
    assert call[names.GEN_AI_RESPONSE_ID] == answer.id
    copies = attempt_spans(captured, names.HEDGE_ROLE_PRIMARY, names.HEDGE_ROLE_BACKUP)
    assert (copies[names.HEDGE_ROLE_PRIMARY].attributes or {})[names.HEDGE_WON] is False
    assert (copies[names.HEDGE_ROLE_BACKUP].attributes or {})[names.HEDGE_WON] is True
    assert names.HEDGE_FIRST_TOKEN not in (copies[names.HEDGE_ROLE_PRIMARY].attributes or {})
    # The backup's launch: an event on the call span, and the start of the backup's attempt span.
    (event,) = [e for e in span.events if e.name == names.EVENT_HEDGE]
    assert (event.attributes or {})[names.ELAPSED] >= AFTER
    assert copies[names.HEDGE_ROLE_BACKUP].start_time >= event.timestamp
    # The call is one call on the winner's timeline: the wait before the backup left is first_token's.
    buckets = {bucket: call[names.BUCKET_PREFIX + bucket] for bucket in names.BUCKETS}
    assert buckets["retry"] == 0
    assert buckets["first_token"] >= AFTER
    assert sum(buckets.values()) == pytest.approx((span.end_time - span.start_time) / 1e9, abs=1e-6)
    assert counter(captured, names.METRIC_HEDGE_FIRED, **{names.GEN_AI_REQUEST_MODEL: "sim-model"}) == 1
    assert counter(captured, names.METRIC_HEDGE_BACKUP_WON) == 1


@retry_timing  # a race of 0.3 s against 1.5 s: a loaded machine may stall the winner past its rival once
def test_a_primary_that_answers_before_its_backup_wins_and_the_backup_is_cut(
    kind: str, stream: bool, server: SimulatedServer, captured: Captured
) -> None:
    server.enqueue(slow(stream, 0.3), slow(stream, 1.5))
    answer = ask(kind, server.base_url, stream=stream)
    _primary, backup = requests_of(server)
    assert answer.id.endswith("sim1")
    assert was_cut(backup, stream), backup
    # Cut long before it was due to answer: the server noticed at once, not at its next write.
    assert backup.disconnected_ns - backup.arrived_ns < 1.5e9  # type: ignore[operator]
    call = call_span(captured).attributes or {}
    assert (call[names.HEDGE_FIRED], call[names.HEDGE_WON_BY]) == (True, names.HEDGE_ROLE_PRIMARY)
    assert counter(captured, names.METRIC_HEDGE_FIRED) == 1
    assert counter(captured, names.METRIC_HEDGE_BACKUP_WON) == 0


def test_a_stream_without_headers_yet_is_cut_as_well(
    kind: str, server: SimulatedServer, captured: Captured
) -> None:
    server.enqueue(Behavior(chunks=3, usage="finish", header_delay=SLOW), FAST)
    answer = ask(kind, server.base_url, stream=True)
    primary, _ = requests_of(server)
    assert answer.id.endswith("sim2")
    assert primary.headers_sent_ns is None
    assert primary.disconnected_ns is not None


def test_a_backup_client_on_another_replica_wins_and_the_slow_replica_sees_the_client_leave(
    kind: str, stream: bool, captured: Captured
) -> None:
    with (
        SimulatedServer(slow(stream)) as slow_replica,
        SimulatedServer(Behavior(chunks=5, usage="finish")) as other,
    ):
        answer = ask(kind, slow_replica.base_url, stream=stream, backup_url=other.base_url)
        (primary,) = requests_of(slow_replica)
        (backup,) = requests_of(other)
    assert answer.text == "Hello, this is a"  # five chunks: the other replica's answer
    assert was_cut(primary, stream)
    assert backup.finished_ns is not None
    copies = attempt_spans(captured, names.HEDGE_ROLE_PRIMARY, names.HEDGE_ROLE_BACKUP)
    assert (copies[names.HEDGE_ROLE_BACKUP].attributes or {})[names.SERVER_PORT] == other.port
    assert (copies[names.HEDGE_ROLE_PRIMARY].attributes or {})[names.SERVER_PORT] == slow_replica.port


# --- what it cost ---------------------------------------------------------------------------------------


def test_the_losers_tokens_are_counted_as_wasted(
    kind: str, stream: bool, server: SimulatedServer, captured: Captured
) -> None:
    server.enqueue(slow(stream), FAST)
    answer = ask(kind, server.base_url, stream=stream)
    assert answer.input_tokens is not None
    assert answer.input_tokens > 0
    call = call_span(captured).attributes or {}
    # The loser's prompt was read by the server: as many input tokens as the winner reported for the same
    # prompt; it was cut before its first content chunk, so no output token arrived.
    assert call[names.HEDGE_WASTED_INPUT_TOKENS] == answer.input_tokens
    assert call[names.HEDGE_WASTED_OUTPUT_TOKENS] == 0
    assert counter(captured, names.METRIC_HEDGE_WASTED_TOKENS, **{names.GEN_AI_TOKEN_TYPE: "input"}) == (
        answer.input_tokens
    )
    assert counter(captured, names.METRIC_HEDGE_WASTED_TOKENS, **{names.GEN_AI_TOKEN_TYPE: "output"}) == 0
    # Both copies opened a connection; the call's churn counts both.
    assert call[names.CONNECT_NEW] == 2


def test_without_usage_from_either_copy_the_wasted_input_is_the_prompt_estimated(
    kind: str, server: SimulatedServer, captured: Captured
) -> None:
    server.enqueue(slow(True, usage="none"), Behavior(chunks=3, usage="none"))
    answer = ask(kind, server.base_url, stream=True, stream_options=None)
    assert answer.input_tokens is None
    texts, tokens = _prompt.prompt_pieces({"messages": MESSAGES})
    call = call_span(captured).attributes or {}
    assert call[names.HEDGE_WASTED_INPUT_TOKENS] == _prompt.CHARACTERS.count(texts) + tokens


# --- what is never sent twice -----------------------------------------------------------------------------


NEVER = {
    "responses, stored by default": ("responses", {}),
    "responses with store=True": ("responses", {"store": True}),
    "responses in the background": ("responses", {"store": False, "background": True}),
    "responses in a conversation": ("responses", {"store": False, "conversation": "conv_1"}),
    "chat with store=True": ("chat", {"store": True}),
    "a raw response": ("raw", {}),
}


@pytest.mark.parametrize("case", list(NEVER))
def test_calls_that_change_something_on_the_server_are_never_hedged(
    case: str, server: SimulatedServer, captured: Captured
) -> None:
    operation, extra = NEVER[case]
    server.default = Behavior(header_delay=0.4)
    client = llmspans.instrument(
        openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0), hedge=llmspans.Hedge(after=AFTER)
    )
    with client:
        if operation == "responses":
            client.responses.create(model="sim-model", input="hi", **extra)
        elif operation == "chat":
            client.chat.completions.create(model="sim-model", messages=MESSAGES, **extra)
        else:
            client.chat.completions.with_raw_response.create(model="sim-model", messages=MESSAGES).parse()
    assert server.wait_idle(10)
    assert len(server.requests) == 1
    call = call_span(captured).attributes or {}
    assert not [key for key in call if key.startswith("llmspans.hedge.")]


def test_a_responses_call_that_stores_nothing_is_hedged(server: SimulatedServer, captured: Captured) -> None:
    server.enqueue(Behavior(header_delay=SLOW), Behavior())
    client = llmspans.instrument(
        openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0), hedge=llmspans.Hedge(after=AFTER)
    )
    with client:
        response = client.responses.create(model="sim-model", input="hi", store=False)
    assert response.id == "resp_sim2"
    assert (call_span(captured).attributes or {})[names.HEDGE_WON_BY] == names.HEDGE_ROLE_BACKUP


def test_what_may_be_sent_twice() -> None:
    assert _hedge.eligible("post", "/chat/completions", {"model": "m"})
    assert _hedge.eligible("post", "/completions", {})
    assert _hedge.eligible("post", "/embeddings", {})
    assert _hedge.eligible("post", "/responses", {"store": False, "previous_response_id": "resp_1"})
    assert not _hedge.eligible("post", "/responses", {"store": None})
    assert not _hedge.eligible("post", "/files", {})
    assert not _hedge.eligible("get", "/chat/completions", {})


def test_embeddings_are_hedged(server: SimulatedServer, captured: Captured) -> None:
    server.enqueue(Behavior(header_delay=SLOW), Behavior())
    client = llmspans.instrument(
        openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0), hedge=llmspans.Hedge(after=AFTER)
    )
    with client:
        client.embeddings.create(model="sim-embed", input=["one"])
    assert server.wait_idle(10)  # the server notices the primary leave in its own time
    primary, backup = server.requests
    assert primary.disconnected_ns is not None
    assert backup.finished_ns is not None
    assert (call_span(captured).attributes or {})[names.HEDGE_WON_BY] == names.HEDGE_ROLE_BACKUP


# --- after="p95" --------------------------------------------------------------------------------------------


def test_a_percentile_after_sends_nothing_until_it_has_seen_enough_and_converges_on_the_p95(
    server: SimulatedServer, captured: Captured
) -> None:
    """Forty calls whose first chunks take 0, 10, ..., 190 ms (each twice, in a scrambled order): the p95
    (nearest rank 38 of 40) of those delays is 180 ms. What the hedge observed is each delay plus what the
    client and server add, which it cannot be less than."""
    hedge = llmspans.Hedge(after="p95")
    client = llmspans.instrument(
        openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0), hedge=hedge
    )
    delays = [((7 * n) % 20) / 100 for n in range(40)]
    with client:
        for delay in delays:
            list(
                client.chat.completions.create(
                    model="sim-model", messages=MESSAGES, stream=True,
                    extra_body={"x_sim": {"first_chunk_delay": delay}},
                )
            )  # fmt: skip
    calls = [s for s in captured.spans if (s.attributes or {}).get(names.STAGE) == names.STAGE_LLM]
    calls.sort(key=lambda span: span.start_time or 0)
    assert len(calls) == 40
    for index, span in enumerate(calls):
        attributes = span.attributes or {}
        if index < _hedge.MIN_SAMPLES:  # too few seen before it: no backup could be sent
            assert names.HEDGE_AFTER not in attributes
            assert attributes[names.HEDGE_FIRED] is False
        else:
            assert attributes[names.HEDGE_AFTER] > 0
    window = hedge._windows["sim-model"]
    observed = list(window.arrived)
    assert len(observed) == 40
    excess = max(value - delay * 1e9 for value, delay in zip(observed, delays, strict=True))
    p95 = hedge.after_ns("sim-model")
    assert p95 is not None
    assert 0.18e9 <= p95 <= 0.18e9 + excess
    assert p95 == sorted(observed)[37]


def test_the_window_keeps_the_last_calls_of_each_model() -> None:
    hedge = llmspans.Hedge(after="p50")
    for value in range(_hedge.WINDOW + 50):
        hedge.observed("a", value)
    assert hedge.after_ns("a") == 50 + _hedge.WINDOW // 2 - 1  # the last WINDOW values: 50 .. 249
    assert hedge.after_ns("b") is None
    for value in range(_hedge.MIN_SAMPLES - 1):
        hedge.observed("b", value)
    assert hedge.after_ns("b") is None
    hedge.observed("b", 100)
    assert hedge.after_ns("b") == 9


# --- with a limiter, retries, cancellation ------------------------------------------------------------------


def test_a_backup_takes_a_slot_of_its_own_and_none_when_the_limiter_is_full(
    kind: str, server: SimulatedServer, captured: Captured
) -> None:
    full = llmspans.Limiter(1, name="one")
    server.enqueue(slow(True))
    answer = ask(kind, server.base_url, stream=True, limiter=full)
    assert answer.id.endswith("sim1")  # no backup: the slow primary answered
    assert len(requests_of(server)) == 1
    call = call_span(captured).attributes or {}
    assert (call[names.HEDGE_FIRED], call[names.HEDGE_SKIPPED]) == (False, names.HEDGE_SKIPPED_LIMITER)
    assert full.in_flight == 0

    captured.clear()
    server.clear()
    two = llmspans.Limiter(2, name="two")
    server.enqueue(slow(True), FAST)
    answer = ask(kind, server.base_url, stream=True, limiter=two)
    assert answer.id.endswith("sim3")  # the backup's (the server counts on from the first part's call)
    assert len(requests_of(server)) == 2
    assert answer.in_flight == [1]  # while the answer was read: the winner's slot; the loser's went back
    assert two.in_flight == 0
    assert two.stats().admitted == 2  # the call's slot and the backup's own


def test_a_primary_that_lost_during_its_back_off_is_not_sent_again(
    kind: str, server: SimulatedServer, captured: Captured
) -> None:
    server.enqueue(Behavior(status=429, retry_after=0.5), FAST)
    answer = ask(kind, server.base_url, stream=True, max_retries=2)
    time.sleep(0.7)  # past the primary's back-off: a retry would have reached the server by now
    assert answer.id.endswith("sim2")
    assert [r.status for r in requests_of(server)] == [429, 200]


def test_cancelling_the_app_task_closes_both_copies(server: SimulatedServer, captured: Captured) -> None:
    server.default = slow(True, 5.0)
    limiter = llmspans.Limiter(4, name="lane")

    async def run() -> int:
        client = llmspans.instrument(
            openai.AsyncOpenAI(base_url=server.base_url, api_key="k", max_retries=0),
            hedge=llmspans.Hedge(after=AFTER), limiter=limiter,
        )  # fmt: skip
        async with client:
            task = asyncio.create_task(
                client.chat.completions.create(model="sim-model", messages=MESSAGES, stream=True)
            )
            deadline = time.monotonic() + 10
            while len(server.requests) < 2 and time.monotonic() < deadline:  # noqa: ASYNC110 - the server's threads record them
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return len(asyncio.all_tasks()) - 1

    assert asyncio.run(run()) == 0
    requests = requests_of(server)
    assert len(requests) == 2
    assert all(r.disconnected_ns is not None for r in requests)
    call = call_span(captured).attributes or {}
    assert call[names.ERROR_TYPE] == "CancelledError"
    assert call[names.HEDGE_FIRED] is True
    assert names.HEDGE_WON_BY not in call
    assert limiter.in_flight == 0


def test_a_stage_budget_that_cuts_the_call_closes_both_copies(
    server: SimulatedServer, captured: Captured
) -> None:
    server.default = slow(False, 5.0)

    async def run() -> None:
        client = llmspans.instrument(
            openai.AsyncOpenAI(base_url=server.base_url, api_key="k", max_retries=0),
            hedge=llmspans.Hedge(after=AFTER),
        )

        @llmspans.stage("answer", budget=0.5, on_exceed="cancel", fallback="too slow")
        async def answer() -> str:
            result = await client.chat.completions.create(model="sim-model", messages=MESSAGES)
            return str(result.id)

        async with client:
            assert await answer() == "too slow"

    asyncio.run(run())
    requests = requests_of(server)
    assert len(requests) == 2
    assert all(r.disconnected_ns is not None for r in requests)


def test_a_sync_stream_closed_early_closes_the_winner_and_the_loser_was_closed_already(
    server: SimulatedServer, captured: Captured
) -> None:
    server.enqueue(slow(True), Behavior(chunks=50, chunk_gap=0.05))
    client = llmspans.instrument(
        openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0), hedge=llmspans.Hedge(after=AFTER)
    )
    with client:
        stream = client.chat.completions.create(model="sim-model", messages=MESSAGES, stream=True)
        next(iter(stream))
        stream.close()
    primary, backup = requests_of(server)
    assert primary.disconnected_ns is not None
    assert backup.disconnected_ns is not None
    assert len(backup.chunk_sent_ns) < 50
    assert (call_span(captured).attributes or {})[names.STREAM_OUTCOME] == names.OUTCOME_ABANDONED


# --- nothing left behind ------------------------------------------------------------------------------------


class _Open(SpanProcessor):
    def __init__(self) -> None:
        self.started = 0
        self.ended = 0

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        self.started += 1

    def on_end(self, span: Any) -> None:
        self.ended += 1


def _pool_busy(client: Any) -> int:
    """Connections of the client's pool still serving a request."""
    transport = client._client._transport
    pool = getattr(transport, "inner", transport)._pool
    return sum(1 for connection in pool.connections if not (connection.is_idle() or connection.is_closed()))


@contextlib.contextmanager
def _no_backup_threads() -> Iterator[None]:
    yield
    deadline = time.monotonic() + 10
    while (
        any(t.name == "llmspans-hedge-backup" for t in threading.enumerate()) and time.monotonic() < deadline
    ):
        time.sleep(0.01)
    assert not [t for t in threading.enumerate() if t.name == "llmspans-hedge-backup"]


@pytest.mark.parametrize("winner", [names.HEDGE_ROLE_PRIMARY, names.HEDGE_ROLE_BACKUP])
def test_a_sync_hedge_leaves_no_thread_connection_or_span_behind(
    winner: str, stream: bool, server: SimulatedServer, captured: Captured
) -> None:
    spans = _Open()
    captured.tracer_provider.add_span_processor(spans)
    first, second = (slow(stream, 0.3), slow(stream, 1.5)) if winner == "primary" else (slow(stream), FAST)
    server.enqueue(first, second)
    client = llmspans.instrument(
        openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0), hedge=llmspans.Hedge(after=AFTER)
    )
    with _no_backup_threads(), client:
        result = client.chat.completions.create(model="sim-model", messages=MESSAGES, stream=stream)
        if stream:
            list(result)
    requests_of(server)
    assert _pool_busy(client) == 0
    assert (call_span(captured).attributes or {})[names.HEDGE_WON_BY] == winner
    assert spans.started == spans.ended == 3  # the call and its two copies


def test_an_async_hedge_returns_with_the_loser_already_closed_and_no_task_left(
    stream: bool, server: SimulatedServer, captured: Captured
) -> None:
    server.enqueue(slow(stream), FAST)
    answer = ask("async", server.base_url, stream=stream)
    assert answer.tasks_left == 0
    primary, _ = requests_of(server)
    assert primary.disconnected_ns is not None


def test_a_hedged_stream_dropped_unclosed_ends_its_call_once_and_closes_the_winner(
    kind: str, server: SimulatedServer, captured: Captured
) -> None:
    """The backup won; the app reads one chunk and drops the stream without closing it: the collector's
    finalizer ends the call span (once, abandoned), gives back both slots and closes the winner's connection."""
    spans = _Open()
    captured.tracer_provider.add_span_processor(spans)
    server.enqueue(slow(True), Behavior(chunks=50, chunk_gap=0.05))
    limiter = llmspans.Limiter(4, name="lane")
    request = {"model": "sim-model", "messages": MESSAGES, "stream": True}
    if kind == "sync":
        client = llmspans.instrument(
            openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0),
            hedge=llmspans.Hedge(after=AFTER), limiter=limiter,
        )  # fmt: skip
        with _no_backup_threads():
            stream = client.chat.completions.create(**request)
            next(iter(stream))
            del stream
            gc.collect()
            settle()
    else:

        async def run() -> None:
            client = llmspans.instrument(
                openai.AsyncOpenAI(base_url=server.base_url, api_key="k", max_retries=0),
                hedge=llmspans.Hedge(after=AFTER), limiter=limiter,
            )  # fmt: skip
            stream = await client.chat.completions.create(**request)
            await stream.__anext__()
            del stream
            gc.collect()
            settle()

        asyncio.run(run())
    primary, backup = requests_of(server)
    assert primary.disconnected_ns is not None
    assert backup.disconnected_ns is not None
    assert len(backup.chunk_sent_ns) < 50
    call = call_span(captured).attributes or {}
    assert call[names.HEDGE_WON_BY] == names.HEDGE_ROLE_BACKUP
    assert call[names.STREAM_OUTCOME] == names.OUTCOME_ABANDONED
    assert spans.started == spans.ended == 3
    assert limiter.in_flight == 0


def test_a_backup_that_fails_leaves_the_call_to_its_primary(
    kind: str, stream: bool, server: SimulatedServer, captured: Captured
) -> None:
    server.enqueue(slow(stream, 0.4), Behavior(status=500))
    answer = ask(kind, server.base_url, stream=stream)
    assert answer.id.endswith("sim1")
    call = call_span(captured).attributes or {}
    assert (call[names.HEDGE_FIRED], call[names.HEDGE_WON_BY]) == (True, names.HEDGE_ROLE_PRIMARY)
    assert names.ERROR_TYPE not in call


def test_when_both_copies_fail_the_app_sees_the_sdks_error_for_its_primary(
    kind: str, stream: bool, server: SimulatedServer, captured: Captured
) -> None:
    """Never llmspans' own HedgeCancelled: the primary's failure, as the SDK raises it without a hedge."""
    server.enqueue(Behavior(status=503, header_delay=0.4), Behavior(status=500))
    with pytest.raises(openai.InternalServerError) as raised:
        ask(kind, server.base_url, stream=stream)
    assert raised.value.status_code == 503
    assert len(requests_of(server)) == 2
    call_span(captured)  # one call span, ended


def test_a_hedge_acts_when_nothing_records(kind: str, server: SimulatedServer, captured: Captured) -> None:
    """A lever acts whoever listens: with recording suppressed (as with no provider at all), the slow primary is
    still beaten by its backup and closed, and nothing is recorded."""
    server.enqueue(slow(True), FAST)
    with _suppress.suppressing():
        answer = ask(kind, server.base_url, stream=True)
    primary, _backup = requests_of(server)
    assert answer.id.endswith("sim2")
    assert was_cut(primary, True)
    assert [s for s in captured.spans if (s.attributes or {}).get(names.STAGE) == names.STAGE_LLM] == []


# --- what instrument() takes ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("after", "error", "says"),
    [
        (0, ValueError, "must be seconds"),
        (-1, ValueError, "must be seconds"),
        ("soon", ValueError, "'p95'"),
        ("p40", ValueError, "from p50 to p99.9"),
        ("p100", ValueError, "from p50 to p99.9"),
        (True, TypeError, "must be seconds"),
        (None, TypeError, "must be seconds"),
        (float("nan"), ValueError, "must be seconds"),
    ],
)
def test_a_bad_after_says_what_to_pass(after: Any, error: type, says: str) -> None:
    with pytest.raises(error, match=says):
        llmspans.Hedge(after=after)


def test_what_after_and_backup_take() -> None:
    assert llmspans.Hedge(after="150ms").after_ns(None) == 150_000_000
    assert llmspans.Hedge(after=0.25).after_ns("m") == 250_000_000
    assert llmspans.Hedge().after == "p95"
    with pytest.raises(TypeError, match="plain HTTP client"):
        llmspans.Hedge(backup=httpx.Client())
    with pytest.raises(TypeError, match="not a class"):
        llmspans.Hedge(backup=openai.OpenAI)
    with pytest.raises(TypeError, match="openai client or None"):
        llmspans.Hedge(backup="http://replica-2/v1")


def test_instrument_refuses_a_hedge_it_cannot_honour() -> None:
    with pytest.raises(TypeError, match="Instrument the openai client"), httpx.Client() as plain:
        llmspans.instrument(plain, hedge=llmspans.Hedge(after=AFTER))
    assert getattr(plain, "_llmspans_plain", None) is None  # refused before anything changed
    with pytest.raises(TypeError, match=r"must be an llmspans\.Hedge"):
        llmspans.instrument(openai.OpenAI(api_key="k"), hedge="150ms")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="of the client's kind"):
        llmspans.instrument(
            openai.OpenAI(api_key="k"),
            hedge=llmspans.Hedge(after=AFTER, backup=openai.AsyncOpenAI(api_key="k")),
        )
    with pytest.raises(TypeError, match="of the client's kind"):
        llmspans.instrument(openai.AsyncOpenAI, hedge=llmspans.Hedge(backup=openai.OpenAI(api_key="k")))
    with pytest.raises(TypeError, match="Instrument the openai client"):
        llmspans.instrument(httpx.AsyncClient, hedge=llmspans.Hedge())
    with pytest.raises(TypeError, match="instrument the one class"):
        llmspans.instrument_all(hedge=llmspans.Hedge(backup=openai.OpenAI(api_key="k")))


def test_a_client_class_hedges_every_client_built_from_it(
    server: SimulatedServer, captured: Captured
) -> None:
    llmspans.instrument(openai.OpenAI, hedge=llmspans.Hedge(after=AFTER))
    server.enqueue(Behavior(header_delay=SLOW), Behavior())
    with openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0) as client:
        assert client.chat.completions.create(model="sim-model", messages=MESSAGES).id.endswith("sim2")
    assert (call_span(captured).attributes or {})[names.HEDGE_WON_BY] == names.HEDGE_ROLE_BACKUP


def test_uninstrument_puts_the_sdks_request_back(server: SimulatedServer, captured: Captured) -> None:
    client = llmspans.instrument(
        openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0), hedge=llmspans.Hedge(after=AFTER)
    )
    llmspans.uninstrument(client)
    assert "_prepare_request" not in client.__dict__
    assert "request" not in client.__dict__
    server.enqueue(Behavior(header_delay=0.3), Behavior())
    with client:
        assert client.chat.completions.create(model="sim-model", messages=MESSAGES).id.endswith("sim1")
    assert len(server.requests) == 1


def test_an_uninstrumented_backup_is_only_watched_inside_a_hedged_call(
    server: SimulatedServer, captured: Captured
) -> None:
    with SimulatedServer(Behavior()) as other:
        backup = openai.OpenAI(base_url=other.base_url, api_key="k", max_retries=0)
        llmspans.instrument(
            openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0),
            hedge=llmspans.Hedge(after=AFTER, backup=backup),
        )
        backup.chat.completions.create(model="sim-model", messages=MESSAGES)  # the backup's own call
        assert captured.spans == []


def test_a_call_of_a_client_without_a_hedge_carries_no_hedge_attribute(
    kind: str, server: SimulatedServer, captured: Captured
) -> None:
    client: Any
    if kind == "sync":
        client = llmspans.instrument(openai.OpenAI(base_url=server.base_url, api_key="k"))
        client.chat.completions.create(model="sim-model", messages=MESSAGES)
    else:

        async def run() -> None:
            client = llmspans.instrument(openai.AsyncOpenAI(base_url=server.base_url, api_key="k"))
            async with client:
                await client.chat.completions.create(model="sim-model", messages=MESSAGES)

        asyncio.run(run())
    assert not [key for key in call_span(captured).attributes or {} if key.startswith("llmspans.hedge.")]
    assert [s.name for s in captured.spans] == ["chat sim-model"]  # no attempt span either


# --- what an unfired hedge holds, a tie, a backup that could not leave ------------------------------------


def test_decided_sync_races_leave_the_alarm_heap_at_once(server: SimulatedServer, captured: Captured) -> None:
    """A race decided long before its alarm (`after` 30 s) lets go of it at once: the heap holds what is armed
    now, however many calls were decided within `after` (rate x after); no race is kept alive by it."""
    from llmspans._hedge.alarms import alarms

    client = llmspans.instrument(
        openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0), hedge=llmspans.Hedge(after=30)
    )
    before = len(alarms)
    with client:
        for _ in range(300):
            client.chat.completions.create(model="sim-model", messages=MESSAGES)
        assert len(alarms) - before <= 70  # dead entries are swept once they outnumber the live ones by 64
        live = [entry for entry in alarms._due if entry[2].race is not None]
        assert live == []
    assert len(requests_of(server)) == 300  # none was sent twice


class _HoldFirst(httpx.BaseTransport):
    """Reads each response whole; the first request's (the primary's) is handed on only once the second's
    (the backup's) was, and the backup has had time to claim the call: a tie the backup wins, the primary's
    whole answer already in."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.lock = threading.Lock()
        self.count = 0
        self.second_returned = threading.Event()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        with self.lock:
            self.count += 1
            first = self.count == 1
        response = self.inner.handle_request(request)
        response.read()
        if first:
            assert self.second_returned.wait(10)
            time.sleep(0.5)  # the backup's claim happens as its response is handed on: microseconds
        else:
            self.second_returned.set()
        return response

    def close(self) -> None:
        self.inner.close()


def test_a_non_streamed_loser_in_a_tie_has_its_usage_read(
    server: SimulatedServer, captured: Captured
) -> None:
    transport = _HoldFirst()
    client = llmspans.instrument(
        openai.OpenAI(
            base_url=server.base_url,
            api_key="k",
            max_retries=0,
            http_client=httpx.Client(transport=transport),
        ),
        hedge=llmspans.Hedge(after=AFTER),
    )
    with client:
        result = client.chat.completions.create(model="sim-model", messages=MESSAGES)
    assert result.id.endswith("sim2")  # the backup's answer
    assert result.usage is not None
    assert result.usage.completion_tokens > 0
    call = call_span(captured).attributes or {}
    assert call[names.HEDGE_WON_BY] == names.HEDGE_ROLE_BACKUP
    # The primary's whole answer came (the same server, the same reply): its output was wasted, all of it.
    assert call[names.HEDGE_WASTED_OUTPUT_TOKENS] == result.usage.completion_tokens
    assert call[names.HEDGE_WASTED_INPUT_TOKENS] == result.usage.prompt_tokens
    assert counter(captured, names.METRIC_HEDGE_WASTED_TOKENS, **{names.GEN_AI_TOKEN_TYPE: "output"}) == (
        result.usage.completion_tokens
    )


def test_the_fired_metric_counts_only_a_backup_that_left(
    server: SimulatedServer, captured: Captured, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No thread to be had for the backup: the primary answers alone, and nothing says a hedge fired."""
    start = threading.Thread.start

    def refuse(thread: threading.Thread) -> None:
        if thread.name == "llmspans-hedge-backup":
            raise RuntimeError("can't start new thread")
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", refuse)
    server.enqueue(slow(False, 0.4))
    answer = ask("sync", server.base_url, stream=False)
    assert answer.id.endswith("sim1")
    assert len(requests_of(server)) == 1
    span = call_span(captured)
    assert (span.attributes or {})[names.HEDGE_FIRED] is False
    assert not [e for e in span.events if e.name == names.EVENT_HEDGE]
    assert attempt_spans(captured) == {}  # the primary's span is made only for a backup that left
    assert counter(captured, names.METRIC_HEDGE_FIRED) == 0
