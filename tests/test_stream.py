"""The stream interceptor (`llmspans/_stream.py`): every way a stream ends ends its call, once."""

from __future__ import annotations

import asyncio
import gc
from http.server import BaseHTTPRequestHandler
from typing import Any

import httpx
import openai
import pytest

import llmspans
from llmspans import _names as names
from llmspans.testing import Captured
from llmspans.tools.simulator import Behavior, SimulatedServer
from tests.support.local_http import serving
from tests.support.openai_clients import MESSAGES, SECRET, async_client, call_span, outcome, sync_client
from tests.timing import TOLERANCE, assert_buckets_sum_to_duration, attempt_spans, bucket


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
        await task  # cancelled while it waited for its next chunk
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


# --- the SDK's .stream() helpers close the response, not the stream -----------------------------------


def stream_helper(client: Any, api: str, **extra: Any) -> Any:
    if api == "responses":
        return client.responses.stream(model="tiny", input="hi", **extra)
    return client.chat.completions.stream(model="tiny", messages=MESSAGES, **extra)


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_leaving_a_stream_helper_early_ends_the_call_and_frees_the_slot(
    server: SimulatedServer, captured: Captured, api: str
) -> None:
    server.default = Behavior(chunks=20, chunk_gap=0.005)
    limiter = llmspans.Limiter(1, name="helper", timeout=2.0)
    client = sync_client(server, instrument={"limiter": limiter})
    with stream_helper(client, api) as events:
        next(iter(events))
    # At once, not at the next collection: the call ended when the block was left ...
    (span,) = [s for s in captured._exporter.get_finished_spans() if s.name == "chat tiny"]
    assert span.attributes[names.STREAM_OUTCOME] == "abandoned"
    assert limiter.in_flight == 0  # ... and its slot came back with it
    with stream_helper(client, api) as events:  # a Limiter(1) admits the next call
        assert list(events)
    outcomes = sorted(s.attributes[names.STREAM_OUTCOME] for s in captured.spans if s.name == "chat tiny")
    assert outcomes == ["abandoned", "completed"]


@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_leaving_an_async_stream_helper_early_ends_the_call_and_frees_the_slot(
    server: SimulatedServer, captured: Captured, api: str
) -> None:
    server.default = Behavior(chunks=20, chunk_gap=0.005)
    limiter = llmspans.Limiter(1, name="async-helper", timeout=2.0)
    client = async_client(server, instrument={"limiter": limiter})
    async with stream_helper(client, api) as events:
        await events.__aiter__().__anext__()
    (span,) = [s for s in captured._exporter.get_finished_spans() if s.name == "chat tiny"]
    assert span.attributes[names.STREAM_OUTCOME] == "abandoned"
    assert limiter.in_flight == 0
    async with stream_helper(client, api) as events:
        assert [event async for event in events]
    await client.close()


# --- waiting on the server is never post -------------------------------------------------------------


@pytest.mark.parametrize("use_async", [False, True])
async def test_a_stall_until_the_read_timeout_counts_in_stream_not_post(
    server: SimulatedServer, captured: Captured, use_async: bool
) -> None:
    server.default = Behavior(chunks=4, chunk_gap=1.5)  # the second chunk comes long after the timeout
    timeout = 0.3

    async def read_to_the_end() -> None:
        if use_async:
            client = async_client(server, max_retries=0, timeout=timeout)
            async for _ in await client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True):
                pass
        else:
            client = sync_client(server, max_retries=0, timeout=timeout)
            for _ in client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True):
                pass

    # openai 3.x wraps a timeout mid-stream as APITimeoutError; 1.x/2.x let httpx's error through.
    with pytest.raises((openai.APITimeoutError, httpx.ReadTimeout)):
        await read_to_the_end()
    span = call_span(captured)
    assert span.attributes[names.STREAM_OUTCOME] == "error"
    assert span.attributes[names.STREAM_CHUNKS] == 1
    # The client waited on the server for the read timeout after the first chunk: that is stream.
    assert timeout - 0.01 <= bucket(span, "stream") <= timeout + TOLERANCE
    assert bucket(span, "post") < 0.005
    assert_buckets_sum_to_duration(span)


# --- a stream that ends without saying so ----------------------------------------------------------------


class _AnswersWith(BaseHTTPRequestHandler):
    """A 200 `text/event-stream` whose body is the server's `body`, then a clean end (what a server
    that fails after its headers, or a proxy that cuts a stream at an event boundary, looks like)."""

    server: Any

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("content-length", str(len(self.server.body)))
        self.end_headers()
        self.wfile.write(self.server.body)

    def log_message(self, *args: Any) -> None:
        pass


_ROLE_ONLY = (
    b'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"tiny",'
    b'"choices":[{"index":0,"delta":{"role":"assistant","content":"hi"},"finish_reason":null}]}\n\n'
)


@pytest.mark.parametrize("body", [b"", _ROLE_ONLY], ids=["empty", "cut-after-a-chunk"])
@pytest.mark.parametrize("how", ["openai", "openai-async", "httpx"])
async def test_a_stream_that_ends_without_saying_so_is_an_error(
    captured: Captured, body: bytes, how: str
) -> None:
    with serving(_AnswersWith, body=body) as running:
        base = f"http://127.0.0.1:{running.server_address[1]}/v1"
        request = {"model": "tiny", "messages": MESSAGES, "stream": True}
        if how == "openai":
            client = llmspans.instrument(openai.OpenAI(base_url=base, api_key=SECRET, max_retries=0))
            chunks = list(client.chat.completions.create(**request))
        elif how == "openai-async":
            aclient = llmspans.instrument(openai.AsyncOpenAI(base_url=base, api_key=SECRET, max_retries=0))
            chunks = [c async for c in await aclient.chat.completions.create(**request)]
            await aclient.close()
        else:
            http = llmspans.instrument(httpx.Client(base_url=base))
            with http, http.stream("POST", "/chat/completions", json=request) as response:
                chunks = list(response.iter_lines())
    assert len(chunks) == (0 if body == b"" else (1 if how != "httpx" else 2))  # the app saw it all
    span = call_span(captured)
    assert span.attributes[names.STREAM_OUTCOME] == "error"
    assert span.attributes[names.ERROR_TYPE] == names.ERROR_INCOMPLETE_STREAM
    assert names.GEN_AI_RESPONSE_FINISH_REASONS not in span.attributes
    assert_buckets_sum_to_duration(span)


def test_a_finish_reason_without_done_is_completed(server: SimulatedServer, captured: Captured) -> None:
    """Servers that never send `[DONE]` (some proxies, older vLLM frontends) end well with a finish."""
    server.default = Behavior(chunks=3, done=False)
    client = sync_client(server)
    assert len(list(client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True))) > 0
    span = call_span(captured)
    assert span.attributes[names.STREAM_OUTCOME] == "completed"
    assert names.ERROR_TYPE not in span.attributes
    assert span.attributes[names.GEN_AI_RESPONSE_FINISH_REASONS] == ("stop",)
