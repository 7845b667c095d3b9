"""The openai SDK, sync and async, over real HTTP against the simulated server.

Every timing is checked against the delays the server was told to use. Tolerances: a
few milliseconds for what the client adds (SDK parsing, scheduling on a loaded 2-core
machine); the inter-chunk quantiles carry the sketch's 1/16 relative error.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest

import llmspans
from llmspans import _names as names
from llmspans.testing import Captured
from llmspans.tools.simulator import Behavior, SimulatedServer
from tests.timing import (
    EXACT,
    TOLERANCE,
    all_exported_text,
    assert_buckets_sum_to_duration,
    assert_client_view,
    attempt_spans,
    bucket,
    retry_timing,
)

# Tolerances (EXACT, CLIENT_SIDE, TOLERANCE) and the span helpers live in tests/timing.py.


SECRET = "sk-test-SECRET-key-123"
PROMPT = "tell me the PRIVATE-PROMPT words"


@pytest.fixture
def server() -> Iterator[SimulatedServer]:
    with SimulatedServer() as running:
        yield running


def sync_client(server: SimulatedServer, **kwargs: Any) -> openai.OpenAI:
    kwargs.setdefault("max_retries", 2)
    return llmspans.instrument(openai.OpenAI(base_url=server.base_url, api_key=SECRET, **kwargs))


def async_client(server: SimulatedServer, **kwargs: Any) -> openai.AsyncOpenAI:
    kwargs.setdefault("max_retries", 2)
    return llmspans.instrument(openai.AsyncOpenAI(base_url=server.base_url, api_key=SECRET, **kwargs))


MESSAGES = [{"role": "user", "content": PROMPT}]


def call_span(captured: Captured) -> Any:
    spans = [s for s in captured.spans if (s.attributes or {}).get(names.STAGE) == "llm"]
    assert len(spans) == 1, [s.name for s in captured.spans]
    return spans[0]


STREAM = Behavior(first_chunk_delay=0.08, chunk_gap=0.02, chunks=6)


def check_stream_timings(span: Any, served: Any) -> None:
    attrs = span.attributes
    sent = served.chunk_sent_ns
    server_first_token = (sent[0] - served.arrived_ns) * 1e-9
    server_stream = (sent[-1] - sent[0]) * 1e-9
    assert_client_view(bucket(span, "first_token"), server_first_token)
    assert bucket(span, "stream") == pytest.approx(server_stream, abs=EXACT)
    assert 0.08 - 0.001 <= bucket(span, "first_token") <= 0.08 + TOLERANCE
    assert 0.10 - 0.001 <= bucket(span, "stream") <= 0.10 + TOLERANCE
    assert bucket(span, "queue") == 0
    assert bucket(span, "retry") == 0
    assert bucket(span, "connect") < 0.02
    assert bucket(span, "post") < EXACT
    assert attrs[names.STREAM_CHUNKS] == 6
    gaps = sorted(b - a for a, b in itertools.pairwise(sent))
    assert attrs[names.ITL_P50] == pytest.approx(gaps[len(gaps) // 2] * 1e-9, rel=1 / 16, abs=EXACT)
    assert attrs[names.ITL_MAX] == pytest.approx(gaps[-1] * 1e-9, abs=EXACT)
    assert attrs[names.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK] == pytest.approx(
        bucket(span, "first_token"), abs=EXACT
    )
    assert attrs[names.STREAM_OUTCOME] == "completed"
    assert_buckets_sum_to_duration(span)


@retry_timing
def test_sync_stream_buckets_match_the_server_delays(server: SimulatedServer, captured: Captured) -> None:
    client = sync_client(server)
    client.chat.completions.create(model="warm-up", messages=MESSAGES)  # a cold client pays its set-up once
    captured.clear()
    server.default = STREAM
    stream = client.chat.completions.create(
        model="tiny", messages=MESSAGES, stream=True, max_tokens=6, temperature=0
    )
    assert isinstance(stream, openai.Stream)
    texts = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
    assert len(texts) == 6
    span = call_span(captured)
    assert server.wait_idle()
    check_stream_timings(span, server.requests[-1])
    attrs = span.attributes
    assert span.name == "chat tiny"
    assert span.kind.name == "CLIENT"
    assert attrs[names.GEN_AI_PROVIDER_NAME] == "openai"
    assert attrs[names.GEN_AI_REQUEST_MODEL] == "tiny"
    assert attrs[names.GEN_AI_REQUEST_STREAM] is True
    assert attrs[names.GEN_AI_REQUEST_MAX_TOKENS] == 6
    assert attrs[names.GEN_AI_REQUEST_TEMPERATURE] == 0.0
    assert attrs[names.SERVER_ADDRESS] == "127.0.0.1"
    assert attrs[names.SERVER_PORT] == server.port
    assert list(attrs[names.GEN_AI_RESPONSE_FINISH_REASONS]) == ["stop"]
    assert attrs[names.GEN_AI_RESPONSE_MODEL] == "tiny"
    assert names.GEN_AI_USAGE_OUTPUT_TOKENS not in attrs  # the server sent none: nothing invented
    events = {e.name: e.timestamp for e in span.events}
    first_token_at = (events[names.EVENT_FIRST_TOKEN] - span.start_time) * 1e-9
    assert first_token_at == pytest.approx(attrs[names.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK], abs=1e-6)
    assert (events[names.EVENT_LAST_TOKEN] - events[names.EVENT_FIRST_TOKEN]) * 1e-9 == pytest.approx(
        bucket(span, "stream"), abs=1e-6
    )


@retry_timing
async def test_async_stream_buckets_match_the_server_delays(
    server: SimulatedServer, captured: Captured
) -> None:
    client = async_client(server)
    await client.chat.completions.create(model="warm-up", messages=MESSAGES)
    captured.clear()
    server.default = STREAM
    stream = await client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True)
    assert isinstance(stream, openai.AsyncStream)
    count = 0
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            count += 1
    assert count == 6
    assert server.wait_idle()
    check_stream_timings(call_span(captured), server.requests[-1])


@retry_timing
def test_non_streamed_first_token_is_the_server_work(server: SimulatedServer, captured: Captured) -> None:
    client = sync_client(server)
    client.chat.completions.create(model="warm-up", messages=MESSAGES)
    captured.clear()
    server.default = Behavior(header_delay=0.06, chunks=4)
    result = client.chat.completions.create(model="tiny", messages=MESSAGES)
    assert result.usage is not None
    span = call_span(captured)
    assert server.wait_idle()
    served = server.requests[-1]
    assert_client_view(bucket(span, "first_token"), (served.finished_ns - served.arrived_ns) * 1e-9)
    assert 0.06 - 0.001 <= bucket(span, "first_token") <= 0.06 + TOLERANCE
    assert bucket(span, "stream") == 0
    assert bucket(span, "post") < EXACT
    assert span.attributes[names.GEN_AI_USAGE_INPUT_TOKENS] == result.usage.prompt_tokens
    assert span.attributes[names.GEN_AI_USAGE_OUTPUT_TOKENS] == 4
    assert span.attributes[names.GEN_AI_RESPONSE_ID] == result.id
    assert names.STREAM_OUTCOME not in span.attributes
    assert_buckets_sum_to_duration(span)


def test_second_call_reuses_the_connection(server: SimulatedServer, captured: Captured) -> None:
    client = sync_client(server)
    client.chat.completions.create(model="tiny", messages=MESSAGES)
    client.chat.completions.create(model="tiny", messages=MESSAGES)
    first, second = [s for s in captured.spans if s.name == "chat tiny"]
    assert first.attributes[names.CONNECT_REUSED] is False
    assert first.attributes[names.CONNECT_NEW] == 1
    assert bucket(first, "connect") > 0
    assert second.attributes[names.CONNECT_REUSED] is True
    assert names.CONNECT_NEW not in second.attributes  # nothing opened: nothing to count
    assert bucket(second, "connect") == 0
    assert server.connections_opened == 1


@pytest.mark.parametrize("use_async", [False, True])
@retry_timing
async def test_two_429s_then_success(server: SimulatedServer, captured: Captured, use_async: bool) -> None:
    server.enqueue(Behavior(status=429, retry_after_ms=40), Behavior(status=429, retry_after_ms=40))
    server.default = Behavior(chunks=3)
    if use_async:
        await async_client(server).chat.completions.create(model="tiny", messages=MESSAGES)
    else:
        sync_client(server).chat.completions.create(model="tiny", messages=MESSAGES)
    span = call_span(captured)
    attempts = sorted(attempt_spans(captured), key=lambda s: s.start_time)
    assert [a.attributes.get(names.HTTP_REQUEST_RESEND_COUNT) for a in attempts] == [None, 1, 2]
    assert [a.attributes[names.HTTP_RESPONSE_STATUS_CODE] for a in attempts] == [429, 429, 200]
    assert [a.status.status_code.name for a in attempts] == ["ERROR", "ERROR", "UNSET"]
    assert all(a.parent.span_id == span.context.span_id for a in attempts)
    assert span.attributes[names.RETRY_COUNT] == 2
    assert list(span.attributes[names.RETRY_CAUSES]) == ["http_429", "http_429"]
    # two back-offs of 40 ms (the SDK honours retry-after-ms) plus two quick failed attempts
    assert 0.08 <= bucket(span, "retry") <= 0.08 + TOLERANCE
    assert server.wait_idle()
    served = server.requests
    assert_client_view(bucket(span, "retry"), (served[2].arrived_ns - served[0].arrived_ns) * 1e-9)
    assert names.ERROR_TYPE not in span.attributes
    assert span.status.status_code.name == "UNSET"
    assert_buckets_sum_to_duration(span)
    causes = {
        p.attributes[names.METRIC_ATTR_RETRY_CAUSE]: p.value
        for p in captured.metric_points(names.METRIC_RETRY_ATTEMPTS)
    }
    assert causes == {"http_429": 2}


def test_traceparent_of_each_attempt_reaches_the_server(server: SimulatedServer, captured: Captured) -> None:
    server.enqueue(Behavior(status=503, retry_after_ms=1))
    sync_client(server).chat.completions.create(model="tiny", messages=MESSAGES)
    sent = [r.headers["traceparent"][:52] for r in server.requests]  # version, trace id, parent id
    first, second = sorted(attempt_spans(captured), key=lambda s: s.start_time)
    call = call_span(captured)
    # The first attempt went out before anyone knew it would fail: it named the call span. Its own
    # span was made when the second began, with its real start and end; the second names itself.
    assert sent == [
        f"00-{call.context.trace_id:032x}-{call.context.span_id:016x}",
        f"00-{second.context.trace_id:032x}-{second.context.span_id:016x}",
    ]
    assert call.start_time <= first.start_time < first.end_time <= second.start_time
    assert first.attributes[names.HTTP_RESPONSE_STATUS_CODE] == 503
    assert first.parent.span_id == second.parent.span_id == call.context.span_id


def test_server_error_surfaces_unchanged(server: SimulatedServer, captured: Captured) -> None:
    server.default = Behavior(status=500)
    client = sync_client(server, max_retries=0)
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(model="tiny", messages=MESSAGES)
    assert info.value.status_code == 500
    span = call_span(captured)
    assert span.status.status_code.name == "ERROR"
    assert span.attributes[names.ERROR_TYPE] == "InternalServerError"
    assert span.attributes[names.HTTP_RESPONSE_STATUS_CODE] == 500
    assert attempt_spans(captured) == []  # one attempt: no span of its own


def test_connection_refused_counts_connect_errors(captured: Captured) -> None:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = llmspans.instrument(
        openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=SECRET, max_retries=1)
    )
    with pytest.raises(openai.APIConnectionError):
        client.chat.completions.create(model="tiny", messages=MESSAGES)
    span = call_span(captured)
    assert span.attributes[names.ERROR_TYPE] == "APIConnectionError"
    assert span.attributes[names.RETRY_COUNT] == 1
    assert list(span.attributes[names.RETRY_CAUSES]) == ["connect_error"]
    assert len(attempt_spans(captured)) == 2


def test_read_timeout_is_a_timeout_cause(server: SimulatedServer, captured: Captured) -> None:
    server.default = Behavior(header_delay=0.5)
    client = sync_client(server, max_retries=1, timeout=0.1)
    with pytest.raises(openai.APITimeoutError):
        client.chat.completions.create(model="tiny", messages=MESSAGES)
    span = call_span(captured)
    assert list(span.attributes[names.RETRY_CAUSES]) == ["timeout"]
    assert span.attributes[names.ERROR_TYPE] == "APITimeoutError"


# --- every way a stream can end ends the span exactly once --------------------------------------


def outcome(captured: Captured) -> str:
    return str(call_span(captured).attributes[names.STREAM_OUTCOME])


def test_break_then_garbage_collection_abandons(server: SimulatedServer, captured: Captured) -> None:
    client = sync_client(server)
    for chunk in client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            break
    gc.collect()
    assert outcome(captured) == "abandoned"
    assert call_span(captured).attributes[names.STREAM_CHUNKS] == 1
    assert attempt_spans(captured) == []


def test_close_and_context_exit_abandon(server: SimulatedServer, captured: Captured) -> None:
    client = sync_client(server)
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True)
    next(stream)
    stream.close()
    with client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True) as second:
        assert isinstance(second, openai.Stream)
        next(second)
    spans = [s for s in captured.spans if s.name == "chat tiny"]
    assert [s.attributes[names.STREAM_OUTCOME] for s in spans] == ["abandoned", "abandoned"]


def test_exhausted_inside_context_manager_is_completed(server: SimulatedServer, captured: Captured) -> None:
    client = sync_client(server)
    with client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True) as stream:
        list(stream)
    assert outcome(captured) == "completed"


def test_dropped_connection_mid_stream_is_an_error(server: SimulatedServer, captured: Captured) -> None:
    server.default = Behavior(chunks=6, drop_after=2)
    client = sync_client(server)
    plain = openai.OpenAI(base_url=server.base_url, api_key=SECRET)
    # openai 3.x wraps a broken stream in APIConnectionError; 1.x/2.x let httpx's own error through.
    with pytest.raises((openai.APIConnectionError, httpx.RemoteProtocolError)) as uninstrumented:
        list(plain.chat.completions.create(model="tiny", messages=MESSAGES, stream=True))
    with pytest.raises(type(uninstrumented.value)) as instrumented:
        list(client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True))
    assert type(instrumented.value) is type(uninstrumented.value)
    span = call_span(captured)
    assert span.attributes[names.STREAM_OUTCOME] == "error"
    assert span.attributes[names.STREAM_CHUNKS] == 2
    assert span.attributes[names.ERROR_TYPE] == type(uninstrumented.value).__qualname__
    assert span.status.status_code.name == "ERROR"


async def test_async_cancellation_mid_stream(server: SimulatedServer, captured: Captured) -> None:
    server.default = Behavior(chunks=50, chunk_gap=0.02)
    client = async_client(server)
    got_one = asyncio.Event()

    async def consume() -> None:
        async for chunk in await client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                got_one.set()

    task = asyncio.create_task(consume())
    await got_one.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert outcome(captured) == "cancelled"


async def test_async_close_context_and_other_task(server: SimulatedServer, captured: Captured) -> None:
    client = async_client(server)
    stream = await client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True)
    await stream.__anext__()
    await stream.close()
    async with await client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True) as second:
        await second.__anext__()
    third = await client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True)
    await third.__anext__()

    async def close_elsewhere() -> None:
        await third.close()

    await asyncio.create_task(close_elsewhere())
    spans = [s for s in captured.spans if s.name == "chat tiny"]
    assert [s.attributes[names.STREAM_OUTCOME] for s in spans] == ["abandoned"] * 3


async def test_async_stream_abandoned_to_garbage_collection(
    server: SimulatedServer, captured: Captured, caplog: pytest.LogCaptureFixture
) -> None:
    client = async_client(server)
    stream = await client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True)
    await stream.__anext__()
    del stream
    gc.collect()
    assert outcome(captured) == "abandoned"
    assert "Failed to detach context" not in caplog.text


# --- usage, content, secrets --------------------------------------------------------------------


def collect(stream: Any) -> list[dict[str, Any]]:
    return [chunk.model_dump(exclude={"id", "created"}) for chunk in stream]


def test_request_usage_hides_the_usage_chunk(server: SimulatedServer, captured: Captured) -> None:
    server.default = Behavior(chunks=4)
    plain = openai.OpenAI(base_url=server.base_url, api_key=SECRET)
    expected = collect(plain.chat.completions.create(model="tiny", messages=MESSAGES, stream=True))
    client = llmspans.instrument(openai.OpenAI(base_url=server.base_url, api_key=SECRET), request_usage=True)
    seen = collect(client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True))
    assert seen == expected
    assert server.requests[-1].body["stream_options"] == {"include_usage": True}
    span = call_span(captured)
    assert span.attributes[names.GEN_AI_USAGE_OUTPUT_TOKENS] == 4
    assert span.attributes[names.OUTPUT_TOKENS_PER_SECOND] > 0


def test_caller_asking_for_usage_still_gets_it(server: SimulatedServer, captured: Captured) -> None:
    client = llmspans.instrument(openai.OpenAI(base_url=server.base_url, api_key=SECRET), request_usage=True)
    chunks = list(client.chat.completions.create(
        model="tiny", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
    ))  # fmt: skip
    assert chunks[-1].usage is not None
    assert chunks[-1].choices == []


def test_usage_in_the_finish_chunk_is_read(server: SimulatedServer, captured: Captured) -> None:
    server.default = Behavior(chunks=3, usage="finish", done=False)
    list(sync_client(server).chat.completions.create(model="tiny", messages=MESSAGES, stream=True))
    assert call_span(captured).attributes[names.GEN_AI_USAGE_OUTPUT_TOKENS] == 3


def test_no_content_or_secret_by_default(server: SimulatedServer, captured: Captured) -> None:
    client = sync_client(server)
    list(client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True))
    client.chat.completions.create(model="tiny", messages=MESSAGES)
    text = all_exported_text(captured)
    assert SECRET not in text
    assert "PRIVATE-PROMPT" not in text
    assert "Hello" not in text  # the simulated completion text
    assert "authorization" not in text.lower()


def test_content_when_opted_in_with_redaction(server: SimulatedServer, captured: Captured) -> None:
    def redact(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{**m, "parts": [{"type": "text", "content": p["content"].replace("PRIVATE", "[x]")} for p in m["parts"]]}
                for m in messages]  # fmt: skip

    client = llmspans.instrument(
        openai.OpenAI(base_url=server.base_url, api_key=SECRET), capture_content=redact
    )
    list(client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True))
    attrs = call_span(captured).attributes
    inputs = json.loads(attrs[names.GEN_AI_INPUT_MESSAGES])
    assert inputs == [
        {"role": "user", "parts": [{"type": "text", "content": "tell me the [x]-PROMPT words"}]}
    ]
    outputs = json.loads(attrs[names.GEN_AI_OUTPUT_MESSAGES])
    assert outputs[0]["role"] == "assistant"
    assert outputs[0]["parts"][0]["content"].startswith("Hello")
    assert SECRET not in all_exported_text(captured)


def test_content_from_the_standard_environment_variable(
    server: SimulatedServer, captured: Captured, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "true")
    sync_client(server).chat.completions.create(model="tiny", messages=MESSAGES)
    assert "PRIVATE-PROMPT" in call_span(captured).attributes[names.GEN_AI_INPUT_MESSAGES]


# --- operations and response wrappers -------------------------------------------------------------


def test_completions_embeddings_and_responses(server: SimulatedServer, captured: Captured) -> None:
    server.default = Behavior(chunks=3)
    client = sync_client(server)
    client.completions.create(model="tiny", prompt="hi")
    list(client.completions.create(model="tiny", prompt="hi", stream=True))
    client.embeddings.create(model="embed", input=["a b", "c"])
    client.responses.create(model="tiny", input="hello")
    events = list(client.responses.create(model="tiny", input="hello", stream=True))
    assert events[-1].type == "response.completed"
    spans = [s for s in captured.spans if s.name != "POST"]
    assert [s.name for s in spans] == [
        "text_completion tiny",
        "text_completion tiny",
        "embeddings embed",
        "chat tiny",
        "chat tiny",
    ]
    completion, completion_stream, embeddings, response, response_stream = spans
    assert completion.attributes[names.GEN_AI_USAGE_OUTPUT_TOKENS] == 3
    assert completion_stream.attributes[names.STREAM_CHUNKS] == 3
    assert embeddings.attributes[names.GEN_AI_USAGE_INPUT_TOKENS] > 0
    assert response.attributes[names.GEN_AI_USAGE_OUTPUT_TOKENS] == 3
    assert response_stream.attributes[names.STREAM_CHUNKS] == 3
    assert response_stream.attributes[names.GEN_AI_USAGE_OUTPUT_TOKENS] == 3
    assert list(response_stream.attributes[names.GEN_AI_RESPONSE_FINISH_REASONS]) == ["stop"]


def test_with_raw_response_and_with_streaming_response(server: SimulatedServer, captured: Captured) -> None:
    server.default = Behavior(chunks=3)
    client = sync_client(server)
    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=MESSAGES)
    assert raw.parse().usage is not None
    raw_stream = client.chat.completions.with_raw_response.create(
        model="tiny", messages=MESSAGES, stream=True
    )
    assert len([c for c in raw_stream.parse() if c.choices and c.choices[0].delta.content]) == 3
    with client.chat.completions.with_streaming_response.create(
        model="tiny", messages=MESSAGES, stream=True
    ) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    with client.chat.completions.with_streaming_response.create(model="tiny", messages=MESSAGES) as response:
        assert response.parse().usage.completion_tokens == 3
    spans = [s for s in captured.spans if s.name == "chat tiny"]
    assert len(spans) == 4
    assert spans[0].attributes[names.GEN_AI_USAGE_OUTPUT_TOKENS] == 3
    assert spans[1].attributes[names.STREAM_CHUNKS] == 3
    assert spans[1].attributes[names.STREAM_OUTCOME] == "completed"
    assert spans[3].attributes[names.GEN_AI_USAGE_OUTPUT_TOKENS] == 3


async def test_async_with_streaming_response(server: SimulatedServer, captured: Captured) -> None:
    client = async_client(server)
    async with client.chat.completions.with_streaming_response.create(
        model="tiny", messages=MESSAGES, stream=True
    ) as response:
        stream = await response.parse()
        chunks = [c async for c in stream]
    assert chunks
    assert outcome(captured) == "completed"


def test_instrument_is_idempotent_and_reversible(server: SimulatedServer, captured: Captured) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key=SECRET)
    assert llmspans.instrument(client) is client
    assert llmspans.instrument(client) is client
    client.chat.completions.create(model="tiny", messages=MESSAGES)
    assert len(captured.spans) == 1  # one call span: not doubled
    copy = client.with_options(timeout=5)
    copy.chat.completions.create(model="tiny", messages=MESSAGES)
    assert len(captured.spans) == 2
    llmspans.uninstrument(client)
    llmspans.uninstrument(client)
    client.chat.completions.create(model="tiny", messages=MESSAGES)
    assert len(captured.spans) == 2
    assert "traceparent" not in server.requests[-1].headers


def test_non_llm_requests_pass_through(server: SimulatedServer, captured: Captured) -> None:
    client = sync_client(server)
    assert [m.id for m in client.models.list()]
    assert captured.spans == []


def test_unsupported_clients_and_bad_arguments() -> None:
    with pytest.raises(TypeError, match=r"supports openai\.OpenAI"):
        llmspans.instrument(object())
    client = openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key=SECRET)
    with pytest.raises(ValueError, match="provider must be a non-empty string"):
        llmspans.instrument(client, provider="")
    with pytest.raises(ValueError, match="budget for the LLM call"):
        llmspans.instrument(client, budget=-1)
    with pytest.raises(TypeError, match="capture_content"):
        llmspans.instrument(client, capture_content="yes")
    with pytest.raises(TypeError, match="request_usage"):
        llmspans.instrument(client, request_usage="yes")  # type: ignore[arg-type]


def test_llm_call_inside_a_turn_counts_toward_it(server: SimulatedServer, captured: Captured) -> None:
    server.default = Behavior(header_delay=0.03)
    client = sync_client(server)
    with llmspans.turn("chat"):
        client.chat.completions.create(model="tiny", messages=MESSAGES)
    turn_span = captured.span("turn chat")
    assert turn_span.attributes[names.TURN_DOMINANT_STAGE] == "llm"
    assert call_span(captured).parent.span_id == turn_span.context.span_id


def test_metrics_per_call(server: SimulatedServer, captured: Captured) -> None:
    server.default = Behavior(chunks=5, usage="finish")
    list(sync_client(server).chat.completions.create(model="tiny", messages=MESSAGES, stream=True))
    names_seen = {p.name for p in captured.metric_points()}
    assert {
        names.METRIC_OPERATION_DURATION, names.METRIC_TOKEN_USAGE, names.METRIC_TIME_TO_FIRST_CHUNK,
        names.METRIC_TIME_PER_OUTPUT_CHUNK, names.METRIC_BUCKET_DURATION, names.METRIC_STAGE_DURATION,
        names.METRIC_CONNECT_NEW,
    } <= names_seen  # fmt: skip


async def aiter_list(stream: AsyncIterator[Any]) -> list[Any]:
    return [item async for item in stream]


def test_azure_client_is_instrumented(server: SimulatedServer, captured: Captured) -> None:
    """Azure's deployment paths end in the same operation suffixes; the simulator answers them 404."""
    client = llmspans.instrument(
        openai.AzureOpenAI(
            azure_endpoint=server.url, api_key=SECRET, api_version="2024-06-01", max_retries=0
        ),
        attempt_spans="always",
    )
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="my-deployment", messages=MESSAGES)
    span = call_span(captured)
    assert span.name == "chat my-deployment"
    assert span.attributes[names.ERROR_TYPE] == "NotFoundError"
    (attempt,) = attempt_spans(captured)
    assert "/openai/deployments/my-deployment/chat/completions" in attempt.attributes[names.URL_FULL]
    assert SECRET not in all_exported_text(captured)


def test_streaming_response_closed_early_is_abandoned(server: SimulatedServer, captured: Captured) -> None:
    server.default = Behavior(chunks=20, chunk_gap=0.005)
    client = sync_client(server)
    with client.chat.completions.with_streaming_response.create(
        model="tiny", messages=MESSAGES, stream=True
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break
    assert outcome(captured) == "abandoned"
