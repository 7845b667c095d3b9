"""The openai SDK, sync and async, over real HTTP against the simulated server.

Every timing is checked against the delays the server was told to use. Tolerances: a
few milliseconds for what the client adds (SDK parsing, scheduling on a loaded 2-core
machine); the inter-chunk quantiles carry the sketch's 1/16 relative error.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import openai
import pydantic
import pytest

import llmspans
from llmspans import _metrics
from llmspans import _names as names
from llmspans.testing import Captured
from llmspans.tools.simulator import Behavior, SimulatedServer
from tests.support.openai_clients import MESSAGES, SECRET, async_client, call_span, outcome, sync_client
from tests.timing import (
    EXACT,
    TOLERANCE,
    Arrivals,
    Window,
    all_exported_text,
    assert_buckets_sum_to_duration,
    assert_client_view,
    assert_stream_stamps,
    attempt_spans,
    bucket,
    content_events,
    late,
    retry_timing,
)

# Tolerances (EXACT, CLIENT_SIDE, TOLERANCE) and the span helpers live in tests/timing.py.


STREAM = Behavior(first_chunk_delay=0.08, chunk_gap=0.02, chunks=6)


def check_stream_timings(span: Any, served: Any, arrivals: Arrivals, called_ns: int, done_ns: int) -> None:
    """The call's figures against this very run: the server's stamps and due times, and when the app
    called (`called_ns`), had each content chunk (`arrivals`) and was done with the stream (`done_ns`)."""
    attrs = span.attributes
    due = served.chunk_due_ns
    ns = 1e-9
    # From the app's call to the first chunk's stamp: no less than the server took from the request's
    # arrival until that chunk was due, no more than until the app had it.
    to_first = bucket(span, "connect") + bucket(span, "first_token")
    assert (due[0] - served.arrived_ns) * ns - 1e-6 <= to_first <= (arrivals.ns[0] - called_ns) * ns + 1e-6
    assert bucket(span, "first_token") >= 0.08 - 0.001  # the server took at least what it was told to
    assert_stream_stamps(span, served, arrivals)
    assert bucket(span, "queue") == 0
    assert bucket(span, "retry") == 0
    assert bucket(span, "connect") <= (served.arrived_ns - called_ns) * ns  # ready before the request left
    assert 0 <= bucket(span, "post") <= (done_ns - due[-1]) * ns + 1e-6
    assert attrs[names.STREAM_CHUNKS] == 6
    assert attrs[names.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK] == pytest.approx(to_first, abs=2e-6)
    assert attrs[names.STREAM_OUTCOME] == "completed"
    assert_buckets_sum_to_duration(span)


@retry_timing
def test_sync_stream_buckets_match_the_server_delays(server: SimulatedServer, captured: Captured) -> None:
    client = sync_client(server)
    client.chat.completions.create(model="warm-up", messages=MESSAGES)  # a cold client pays its set-up once
    captured.clear()
    server.default = STREAM
    arrivals, called_ns = Arrivals(), time.perf_counter_ns()
    stream = client.chat.completions.create(
        model="tiny", messages=MESSAGES, stream=True, max_tokens=6, temperature=0
    )
    assert isinstance(stream, openai.Stream)
    texts = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.mark()
            texts.append(chunk.choices[0].delta.content)
    done_ns = time.perf_counter_ns()
    assert len(texts) == 6
    span = call_span(captured)
    assert server.wait_idle()
    check_stream_timings(span, server.requests[-1], arrivals, called_ns, done_ns)
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
    arrivals, called_ns = Arrivals(), time.perf_counter_ns()
    stream = await client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True)
    assert isinstance(stream, openai.AsyncStream)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.mark()
    done_ns = time.perf_counter_ns()
    assert len(arrivals.ns) == 6
    assert server.wait_idle()
    check_stream_timings(call_span(captured), server.requests[-1], arrivals, called_ns, done_ns)


@retry_timing
def test_non_streamed_first_token_is_the_server_work(server: SimulatedServer, captured: Captured) -> None:
    client = sync_client(server)
    client.chat.completions.create(model="warm-up", messages=MESSAGES)
    captured.clear()
    server.default = Behavior(header_delay=0.06, chunks=4)
    with Window() as window:
        result = client.chat.completions.create(model="tiny", messages=MESSAGES)
    assert result.usage is not None
    span = call_span(captured)
    assert server.wait_idle()
    served = server.requests[-1]
    server_view = (served.finished_ns - served.arrived_ns) * 1e-9
    slack = max(late(served), window.beyond(server_view))
    assert_client_view(bucket(span, "first_token"), server_view, slack)
    assert 0.06 - 0.001 <= bucket(span, "first_token") <= 0.06 + TOLERANCE + slack
    assert bucket(span, "stream") == 0
    assert bucket(span, "post") < EXACT + slack
    assert span.attributes[names.GEN_AI_USAGE_INPUT_TOKENS] == result.usage.prompt_tokens
    assert span.attributes[names.GEN_AI_USAGE_OUTPUT_TOKENS] == 4
    assert span.attributes[names.GEN_AI_RESPONSE_ID] == result.id
    assert names.STREAM_OUTCOME not in span.attributes
    assert_buckets_sum_to_duration(span)


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


# --- every way a stream can end ends the span exactly once --------------------------------------


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


@pytest.mark.parametrize(
    ("value", "recorded"),
    [
        ("true", True), ("True", True), ("SPAN_ONLY", True), ("span_only", True), ("SPAN_AND_EVENT", True),
        ("false", False), ("NO_CONTENT", False), ("EVENT_ONLY", False), ("", False), ("maybe", False),
    ],
)  # fmt: skip
def test_content_from_the_standard_environment_variable(
    server: SimulatedServer, captured: Captured, monkeypatch: pytest.MonkeyPatch, value: str, recorded: bool
) -> None:
    """The reference values of the standard switch (any case) as well as true/false: content goes on
    the span for SPAN_ONLY and SPAN_AND_EVENT; EVENT_ONLY asks for none on spans, and llmspans emits no
    content events, so it records none."""
    monkeypatch.setenv("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", value)
    sync_client(server).chat.completions.create(model="tiny", messages=MESSAGES)
    attributes = call_span(captured).attributes
    assert (names.GEN_AI_INPUT_MESSAGES in attributes) is recorded
    assert (names.GEN_AI_OUTPUT_MESSAGES in attributes) is recorded
    if recorded:
        assert "PRIVATE-PROMPT" in attributes[names.GEN_AI_INPUT_MESSAGES]
    else:
        assert "PRIVATE-PROMPT" not in all_exported_text(captured)


USAGE: Any = {"include_usage": True}


@pytest.mark.parametrize("use_async", [False, True])
async def test_what_each_operation_asked_and_answered_under_the_convention_names(
    server: SimulatedServer, captured: Captured, use_async: bool
) -> None:
    server.default = Behavior(chunks=4)
    asked: dict[str, Any] = {
        "model": "tiny", "messages": MESSAGES, "n": 2, "stop": ["END"], "seed": 3, "frequency_penalty": 0.5, "presence_penalty": 0.25,
        "service_tier": "flex", "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}},
    }  # fmt: skip
    settings = {"capture_content": True}
    if use_async:
        aclient = async_client(server, settings)
        await aclient.chat.completions.create(**asked)
        async for _ in await aclient.chat.completions.create(**asked, stream=True, stream_options=USAGE):
            pass
        await aclient.responses.create(
            model="tiny", input="hi", instructions="Be brief.", conversation="conv_9"
        )
        await aclient.embeddings.create(model="emb", input=["a", "b"], dimensions=4)
    else:
        client = sync_client(server, settings)
        client.chat.completions.create(**asked)
        for _ in client.chat.completions.create(**asked, stream=True, stream_options=USAGE):
            pass
        client.responses.create(model="tiny", input="hi", instructions="Be brief.", conversation="conv_9")
        client.embeddings.create(model="emb", input=["a", "b"], dimensions=4)
    spans = [s.attributes for s in captured.spans if (s.attributes or {}).get(names.STAGE) == "llm"]
    whole, streamed, responses, embeddings = spans
    for chat in (whole, streamed):
        assert chat[names.GEN_AI_REQUEST_CHOICE_COUNT] == 2
        assert list(chat[names.GEN_AI_REQUEST_STOP_SEQUENCES]) == ["END"]
        assert chat[names.GEN_AI_REQUEST_SEED] == 3
        assert chat[names.GEN_AI_REQUEST_FREQUENCY_PENALTY] == 0.5
        assert chat[names.GEN_AI_REQUEST_PRESENCE_PENALTY] == 0.25
        assert chat[names.GEN_AI_OUTPUT_TYPE] == "json"
        assert chat[names.OPENAI_REQUEST_SERVICE_TIER] == "flex"
        assert chat[names.OPENAI_RESPONSE_SERVICE_TIER] == "flex"
        assert chat[names.OPENAI_RESPONSE_SYSTEM_FINGERPRINT] == "fp_sim"
        assert chat[names.GEN_AI_USAGE_REASONING_OUTPUT_TOKENS] == 0
        assert list(chat[names.GEN_AI_RESPONSE_FINISH_REASONS]) == ["stop", "stop"]
    assert responses[names.GEN_AI_CONVERSATION_ID] == "conv_9"
    assert json.loads(responses[names.GEN_AI_SYSTEM_INSTRUCTIONS]) == [
        {"type": "text", "content": "Be brief."}
    ]
    assert responses[names.OPENAI_RESPONSE_SERVICE_TIER] == "default"
    assert responses[names.GEN_AI_USAGE_CACHE_CREATION_INPUT_TOKENS] == 0
    assert embeddings[names.GEN_AI_EMBEDDINGS_DIMENSION_COUNT] == 4
    # The SDK asks for base64 and decodes it itself: the span says what went over the wire.
    assert list(embeddings[names.GEN_AI_REQUEST_ENCODING_FORMATS]) == ["base64"]
    assert json.loads(embeddings[names.GEN_AI_INPUT_MESSAGES]) == [
        {"role": "user", "parts": [{"type": "text", "content": "a"}]},
        {"role": "user", "parts": [{"type": "text", "content": "b"}]},
    ]
    assert names.GEN_AI_OUTPUT_MESSAGES not in embeddings


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


@retry_timing
@pytest.mark.parametrize("use_async", [False, True])
@pytest.mark.parametrize("how", ["streaming-lines", "streaming-bytes", "raw-lines", "streaming-parse"])
async def test_a_raw_stream_read_by_hand_is_stamped_chunk_by_chunk(
    server: SimulatedServer, captured: Captured, use_async: bool, how: str
) -> None:
    """`with_streaming_response` (or `with_raw_response`) read with `iter_lines()`/`iter_bytes()`: the
    SDK parses nothing, so the transport reads the SSE itself; each chunk is stamped when its bytes came,
    once (not twice when the app does call `parse()`), and the app's bytes are what the server sent,
    with no usage chunk added even though `request_usage` is on."""
    server.default = STREAM
    settings = {"request_usage": True}
    request: dict[str, Any] = {"model": "tiny", "messages": MESSAGES, "stream": True}
    received: list[str] = []
    arrivals = Arrivals()
    pending = bytearray()  # a bytes reader's partial SSE event

    def line(text: str) -> str:
        if '"content":"' in text and '"content":""' not in text:
            arrivals.mark()
        return text

    def piece(data: bytes) -> bytes:
        arrivals.mark(content_events(pending, data))
        return data

    def parsed(chunk: Any) -> str:
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.mark()
        return str(chunk.model_dump_json())

    called_ns = time.perf_counter_ns()  # a new client each run: its first request is built cold
    if use_async:
        aclient = async_client(server, settings)
        if how == "raw-lines":
            raw = await aclient.chat.completions.with_raw_response.create(**request)
            received = [line(text) async for text in raw.http_response.aiter_lines() if text]
            await raw.http_response.aclose()
        else:
            async with aclient.chat.completions.with_streaming_response.create(**request) as response:
                if how == "streaming-lines":
                    received = [line(text) async for text in response.iter_lines() if text]
                elif how == "streaming-bytes":
                    received = (
                        b"".join([piece(data) async for data in response.iter_bytes()]).decode().split("\n\n")
                    )
                else:
                    received = [parsed(chunk) async for chunk in await response.parse()]
    else:
        client = sync_client(server, settings)
        if how == "raw-lines":
            raw = client.chat.completions.with_raw_response.create(**request)
            received = [line(text) for text in raw.http_response.iter_lines() if text]
            raw.http_response.close()
        else:
            with client.chat.completions.with_streaming_response.create(**request) as response:
                if how == "streaming-lines":
                    received = [line(text) for text in response.iter_lines() if text]
                elif how == "streaming-bytes":
                    received = b"".join(piece(data) for data in response.iter_bytes()).decode().split("\n\n")
                else:
                    received = [parsed(chunk) for chunk in response.parse()]
    done_ns = time.perf_counter_ns()
    assert server.wait_idle()
    served = server.requests[-1]
    assert "stream_options" not in served.body  # raw bytes reach the app: nothing may be added to them
    if how != "streaming-parse":
        assert any("[DONE]" in text for text in received)
    check_stream_timings(call_span(captured), served, arrivals, called_ns, done_ns)


async def test_async_with_streaming_response(server: SimulatedServer, captured: Captured) -> None:
    client = async_client(server)
    async with client.chat.completions.with_streaming_response.create(
        model="tiny", messages=MESSAGES, stream=True
    ) as response:
        stream = await response.parse()
        chunks = [c async for c in stream]
    assert chunks
    assert outcome(captured) == "completed"


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


class _Verdict(pydantic.BaseModel):
    verdict: str


@pytest.mark.parametrize("use_async", [False, True])
async def test_a_parse_that_fails_keeps_what_the_server_answered(
    server: SimulatedServer, captured: Captured, use_async: bool
) -> None:
    """`parse()` raises after a 200 whose text is not the model's JSON: the answer still belongs on
    the span (id, finish reason, tokens), so the failure reads as the app's, not the server's."""
    server.default = Behavior(chunks=3)

    async def parse() -> Any:
        if use_async:
            aclient = async_client(server)
            return await aclient.chat.completions.parse(
                model="tiny", messages=MESSAGES, response_format=_Verdict
            )
        return sync_client(server).chat.completions.parse(
            model="tiny", messages=MESSAGES, response_format=_Verdict
        )

    with pytest.raises(pydantic.ValidationError):
        await parse()
    span = call_span(captured)
    attrs = span.attributes
    assert attrs[names.ERROR_TYPE] == "ValidationError"
    assert attrs[names.GEN_AI_RESPONSE_ID].startswith("chatcmpl-")
    assert attrs[names.GEN_AI_RESPONSE_FINISH_REASONS] == ("stop",)
    assert attrs[names.GEN_AI_USAGE_OUTPUT_TOKENS] == 3
    assert attrs[names.HTTP_RESPONSE_STATUS_CODE] == 200
    assert len(server.requests) == 1  # a failed parse is not retried


def slow_to_build(delay: float) -> Iterator[dict[str, str]]:
    """Messages the SDK takes `delay` to read while it builds the request (a generator it iterates
    in `create()`, before `client.request()`), standing in for its own argument transform."""
    time.sleep(delay)
    yield from MESSAGES


@pytest.mark.parametrize("how", ["sync", "async", "raw"])
@pytest.mark.parametrize("limited", [False, True])
async def test_the_call_starts_where_the_app_calls_the_sdk(
    server: SimulatedServer, captured: Captured, how: str, limited: bool
) -> None:
    """Building the request is the app's wait too: in the span, in `first_token`, never in `queue`."""
    build = 0.08
    instrument = {"limiter": llmspans.Limiter(1, name="one")} if limited else {}
    started = time.perf_counter()
    if how == "async":
        aclient = async_client(server, instrument)
        await aclient.chat.completions.create(model="tiny", messages=slow_to_build(build))
        await aclient.close()
    elif how == "raw":
        client = sync_client(server, instrument)
        client.chat.completions.with_raw_response.create(model="tiny", messages=slow_to_build(build)).parse()
    else:
        sync_client(server, instrument).chat.completions.create(model="tiny", messages=slow_to_build(build))
    elapsed = time.perf_counter() - started
    span = call_span(captured)
    duration = (span.end_time - span.start_time) / 1e9
    assert build <= duration <= elapsed
    assert bucket(span, "first_token") >= build
    # Not the build: a free slot is taken at once, which a busy machine may stretch by some ms, never 80.
    assert bucket(span, "queue") < build / 2
    assert_buckets_sum_to_duration(span)


@pytest.mark.parametrize("stream", [False, True])
def test_every_choice_s_finish_reason_is_recorded(
    server: SimulatedServer, captured: Captured, stream: bool
) -> None:
    """`n=2`: two answers, two finish reasons, streamed or not."""
    server.default = Behavior(chunks=6)
    client = sync_client(server)
    result = client.chat.completions.create(model="tiny", messages=MESSAGES, n=2, stream=stream)
    if stream:
        indexes = {choice.index for chunk in result for choice in chunk.choices}
    else:
        indexes = {choice.index for choice in result.choices}
    assert indexes == {0, 1}
    span = call_span(captured)
    assert span.attributes[names.GEN_AI_RESPONSE_FINISH_REASONS] == ("stop", "stop")
    if stream:
        assert span.attributes[names.STREAM_CHUNKS] == 6
        assert span.attributes[names.STREAM_OUTCOME] == "completed"


# --- an unsampled call: no span work, every metric ------------------------------------------------------


RECORDED = {spec.name for spec in _metrics.INSTRUMENTS}  # the histograms and counters calls record


def _metrics_of_a_workload(server: SimulatedServer, sampler: Any) -> tuple[int, dict[Any, tuple[int, float]]]:
    """Spans exported and, per metric and attribute set, (count, sum) after the same calls."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from llmspans import _telemetry

    spans, reader = InMemorySpanExporter(), InMemoryMetricReader()
    tracer_provider = TracerProvider(sampler=sampler)
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    meter_provider = MeterProvider(metric_readers=[reader])
    server.default = Behavior(chunks=5, usage="finish")
    with _telemetry.use_providers(tracer_provider, meter_provider):
        client = sync_client(server)
        client.chat.completions.create(model="tiny", messages=MESSAGES)
        for _ in client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True):
            pass
        client.responses.create(model="tiny", input="hi")
        client.embeddings.create(model="emb", input="hi")
        client.chat.completions.with_raw_response.create(model="tiny", messages=MESSAGES).parse()
        server.enqueue(Behavior(status=500))
        with pytest.raises(openai.InternalServerError):
            client.with_options(max_retries=0).chat.completions.create(model="tiny", messages=MESSAGES)
    found: dict[Any, tuple[int, float]] = {}
    data = reader.get_metrics_data()
    for resource_metrics in data.resource_metrics if data else ():
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                if metric.name not in RECORDED:
                    continue  # gauges (a limiter some other test left alive) report state, not these calls
                for point in metric.data.data_points:
                    key = (metric.name, tuple(sorted((point.attributes or {}).items())))
                    if hasattr(point, "count"):
                        found[key] = (point.count, round(point.sum, 9))
                    else:
                        found[key] = (1, round(point.value, 9))
    tracer_provider.shutdown()
    meter_provider.shutdown()
    return len(spans.get_finished_spans()), found


def test_an_unsampled_call_is_counted_by_every_metric_as_a_sampled_one_is(server: SimulatedServer) -> None:
    """With the app's sampler saying no, no span is exported and no span-only fact is read, but the
    metrics are the same points: names, attributes (response model, error type), counts and token sums."""
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON

    sampled_spans, sampled = _metrics_of_a_workload(server, ALWAYS_ON)
    unsampled_spans, unsampled = _metrics_of_a_workload(server, ALWAYS_OFF)
    assert sampled_spans >= 6
    assert unsampled_spans == 0
    timeless = {names.METRIC_TOKEN_USAGE, names.METRIC_RETRY_ATTEMPTS, names.METRIC_CONNECT_NEW}
    assert {key: value[0] for key, value in unsampled.items()} == {
        key: value[0] for key, value in sampled.items()
    }
    assert {k: v for k, v in unsampled.items() if k[0] in timeless} == {
        k: v for k, v in sampled.items() if k[0] in timeless
    }
    token_points = [key for key in unsampled if key[0] == names.METRIC_TOKEN_USAGE]
    assert len(token_points) == 3  # chat input and output (chat completions and responses), embeddings input
