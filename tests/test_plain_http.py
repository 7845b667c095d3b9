"""Plain httpx and httpx2 clients, sync and async, instrumented and pointed at an OpenAI-compatible server.

Every test runs against all four clients (`httpx.Client`, `httpx.AsyncClient`, `httpx2.Client`,
`httpx2.AsyncClient`) over real HTTP: the simulated server for timing and failures, and a raw
socket server of our own for the malformed streams the simulator never sends. Timings are
checked against the server's own stamps with the tolerances of tests/test_openai_sdk.py.

What a plain client's stream outcome is: `completed` once the body was read to its end or the
stream sent its own end marker (`[DONE]`, a final Responses event) before the response was
closed; `abandoned` when the response was closed (or collected) before either; `error` when the
read failed or the status was 4xx/5xx; `cancelled` when the reading task was cancelled mid-read.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib
import itertools
import json
import logging
import socket
import socketserver
import threading
import time
import zlib
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import llmspans
from llmspans import _names as names
from llmspans.testing import Captured
from llmspans.tools import simulator as _simulator
from llmspans.tools.simulator import Behavior, SimulatedServer
from tests.timing import (
    CLIENT_SIDE,
    TOLERANCE,
    Arrivals,
    Window,
    all_exported_text,
    assert_buckets_sum_to_duration,
    assert_client_view,
    assert_stream_stamps,
    attempt_spans,
    bucket,
    late,
    retry_timing,
)

# As in tests/test_openai_sdk.py: arrival-to-arrival figures (stream, gaps) within EXACT of the server's
# own stamps; figures that also hold the client's own work from the server's up to CLIENT_SIDE more;
# the delays the server was told to use within TOLERANCE (a loaded 2-core box oversleeps).

CLIENTS = ["httpx.Client", "httpx.AsyncClient", "httpx2.Client", "httpx2.AsyncClient"]
ASYNC_CLIENTS = [kind for kind in CLIENTS if kind.endswith("AsyncClient")]

SECRET = "sk-test-SECRET-key-123"
MESSAGES = [{"role": "user", "content": "tell me the PRIVATE-PROMPT words"}]
STREAM = Behavior(first_chunk_delay=0.08, chunk_gap=0.02, chunks=6)


def chat(model: str = "tiny", **fields: Any) -> dict[str, Any]:
    return {"model": model, "messages": MESSAGES, **fields}


class AnyClient:
    """One of the four clients behind one async face, so each test is written once for all four.

    The sync clients are called directly (blocking the test's event loop is harmless: the
    servers run in threads).
    """

    def __init__(
        self, kind: str, base_url: str, *, instrumented: bool = True, attempt_spans: str | None = None,
        capture_content: bool | None = None, **kwargs: Any,
    ) -> None:  # fmt: skip
        library, _, class_name = kind.partition(".")
        self.module = importlib.import_module(library)
        self.is_async = class_name == "AsyncClient"
        self.client = getattr(self.module, class_name)(base_url=base_url, **kwargs)
        if instrumented:
            instrumented_client = llmspans.instrument(
                self.client, attempt_spans=attempt_spans, capture_content=capture_content
            )
            assert instrumented_client is self.client

    async def request(self, method: str, url: str, **kwargs: Any) -> Any:
        """A whole response, body read (the client's default, non-streamed mode)."""
        result = self.client.request(method, url, **kwargs)
        return await result if self.is_async else result

    async def send(self, method: str, url: str, **kwargs: Any) -> Any:
        """A response whose body is still to be read: `client.send(request, stream=True)`."""
        request = self.client.build_request(method, url, **kwargs)
        result = self.client.send(request, stream=True)
        return await result if self.is_async else result

    @contextlib.asynccontextmanager
    async def stream(self, method: str, url: str, **kwargs: Any) -> AsyncIterator[Any]:
        """`client.stream(...)`: the response is closed when the block exits."""
        if self.is_async:
            async with self.client.stream(method, url, **kwargs) as response:
                yield response
        else:
            with self.client.stream(method, url, **kwargs) as response:
                yield response

    def lines(self, response: Any) -> Any:
        """The response's own line iterator (`iter_lines` or `aiter_lines`), not a wrapper of it."""
        return response.aiter_lines() if self.is_async else response.iter_lines()

    async def next_line(self, lines: Any) -> str:
        return await lines.__anext__() if self.is_async else next(lines)  # type: ignore[no-any-return]

    async def rest(self, lines: Any) -> list[str]:
        """Whatever an iterator from `lines()` still has to give."""
        if self.is_async:
            return [line async for line in lines]
        return list(lines)

    async def all_lines(self, response: Any, arrivals: Arrivals | None = None) -> list[str]:
        """Every line; `arrivals` marks when each line carrying content was in hand."""

        def seen(line: str) -> str:
            if arrivals is not None and is_content(line):
                arrivals.mark()
            return line

        if self.is_async:
            return [seen(line) async for line in response.aiter_lines()]
        return [seen(line) for line in response.iter_lines()]

    async def all_bytes(self, response: Any) -> bytes:
        if self.is_async:
            return b"".join([piece async for piece in response.aiter_bytes()])
        return b"".join(response.iter_bytes())

    async def close(self, response: Any) -> None:
        if self.is_async:
            await response.aclose()
        else:
            response.close()

    async def aclose(self) -> None:
        if self.is_async:
            await self.client.aclose()
        else:
            self.client.close()


@pytest.fixture(params=CLIENTS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def make(kind: str) -> AsyncIterator[Callable[..., AnyClient]]:
    """Builds clients of the test's kind; closes them all at the end."""
    made: list[AnyClient] = []

    def build(base_url: str, *, instrumented: bool = True, **kwargs: Any) -> AnyClient:
        made.append(AnyClient(kind, base_url, instrumented=instrumented, **kwargs))
        return made[-1]

    yield build
    for client in made:
        await client.aclose()


def call_spans(captured: Captured) -> list[Any]:
    return [s for s in captured.spans if (s.attributes or {}).get(names.STAGE) == "llm"]


def call_span(captured: Captured) -> Any:
    spans = call_spans(captured)
    assert len(spans) == 1, [s.name for s in captured.spans]
    return spans[0]


def is_content(line: str) -> bool:
    """A chat chunk line carrying text (the role chunk, finish chunk and usage chunk do not)."""
    if not line.startswith("data: {"):
        return False
    choices = json.loads(line[len("data: ") :]).get("choices") or []
    return any((choice.get("delta") or {}).get("content") for choice in choices)


def sse_payloads(lines: list[str]) -> list[dict[str, Any]]:
    return [json.loads(line[len("data: ") :]) for line in lines if line.startswith("data: {")]


async def collect_garbage(done: Callable[[], bool]) -> None:
    """Collect until `done()`: an unfinished async generator is closed by a task the event loop runs
    after the collection that found it, so what it holds is freed only by a later collection, one
    generator of the response's chain (lines, text, bytes, raw, body...) at a time."""
    for _ in range(100):
        gc.collect()
        if done():
            return
        await asyncio.sleep(0)


def assert_ended_once(captured: Captured, caplog: pytest.LogCaptureFixture) -> Any:
    """One call span, ended once (the SDK logs a second end()), and no attempt span: one attempt."""
    span = call_span(captured)
    assert attempt_spans(captured) == []
    assert "ended span" not in caplog.text
    assert "llmspans: internal error" not in caplog.text
    return span


# --- streamed chat: buckets, attributes, usage, bytes ----------------------------------------------


@retry_timing
async def test_streamed_chat_buckets_match_the_server_stamps(
    server: SimulatedServer, make: Callable[..., AnyClient], captured: Captured
) -> None:
    http = make(server.base_url)
    await http.request("POST", "/chat/completions", json=chat("warm-up"))  # a cold client pays set-up once
    captured.clear()
    server.default = STREAM
    arrivals, called_ns = Arrivals(), time.perf_counter_ns()
    async with http.stream(
        "POST", "/chat/completions", json=chat(stream=True, max_tokens=6, temperature=0)
    ) as r:
        lines = await http.all_lines(r, arrivals)
    done_ns = time.perf_counter_ns()
    assert len([line for line in lines if is_content(line)]) == 6
    assert server.wait_idle()
    served = server.requests[-1]
    span = call_span(captured)
    attrs = span.attributes
    assert span.name == "chat tiny"
    assert span.kind.name == "CLIENT"
    assert attrs[names.GEN_AI_OPERATION_NAME] == "chat"
    assert attrs[names.GEN_AI_PROVIDER_NAME] == "openai"
    assert attrs[names.GEN_AI_REQUEST_MODEL] == "tiny"
    assert attrs[names.GEN_AI_REQUEST_STREAM] is True
    assert attrs[names.GEN_AI_REQUEST_MAX_TOKENS] == 6
    assert attrs[names.GEN_AI_REQUEST_TEMPERATURE] == 0.0
    assert attrs[names.SERVER_ADDRESS] == "127.0.0.1"
    assert attrs[names.SERVER_PORT] == server.port
    assert attrs[names.GEN_AI_RESPONSE_ID] == sse_payloads(lines)[0]["id"]
    assert attrs[names.GEN_AI_RESPONSE_MODEL] == "tiny"
    assert list(attrs[names.GEN_AI_RESPONSE_FINISH_REASONS]) == ["stop"]
    assert names.GEN_AI_USAGE_OUTPUT_TOKENS not in attrs  # the server sent none: nothing invented
    assert attrs[names.STREAM_OUTCOME] == "completed"
    assert attrs[names.STREAM_CHUNKS] == 6
    assert names.RETRY_COUNT not in attrs

    due, ns = served.chunk_due_ns, 1e-9
    # From the call to the first chunk's stamp: no less than the server took until it was due, no more
    # than until the app had it; the warm-up's connection was reused, so there is nothing before.
    assert bucket(span, "connect") == 0
    assert (
        (due[0] - served.arrived_ns) * ns - 1e-6
        <= bucket(span, "first_token")
        <= (arrivals.ns[0] - called_ns) * ns + 1e-6
    )
    assert bucket(span, "first_token") >= 0.08 - 0.001  # the server took at least what it was told to
    assert_stream_stamps(span, served, arrivals)
    assert bucket(span, "queue") == 0
    assert bucket(span, "retry") == 0
    assert 0 <= bucket(span, "post") <= (done_ns - due[-1]) * ns + 1e-6  # closing the response: the client's
    assert attrs[names.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK] == pytest.approx(
        bucket(span, "first_token"), abs=2e-6
    )
    assert_buckets_sum_to_duration(span)
    events = {e.name: e.timestamp for e in span.events}
    assert (events[names.EVENT_LAST_TOKEN] - events[names.EVENT_FIRST_TOKEN]) * 1e-9 == pytest.approx(
        bucket(span, "stream"), abs=1e-6
    )
    assert attempt_spans(captured) == []  # one attempt: its HTTP facts are the call span's
    assert attrs[names.HTTP_RESPONSE_STATUS_CODE] == 200


@pytest.mark.parametrize(
    ("behavior", "fields"),
    [
        pytest.param(Behavior(chunks=3, usage="finish"), {}, id="usage-in-finish-chunk"),
        pytest.param(Behavior(chunks=3, usage="finish", done=False), {}, id="usage-in-finish-chunk-no-done"),
        pytest.param(
            Behavior(chunks=3, usage="chunk"),
            {"stream_options": {"include_usage": True}},
            id="include-usage-chunk",
        ),
        pytest.param(
            Behavior(chunks=3, usage="chunk", done=False, finish_reason="length"),
            {"stream_options": {"include_usage": True}},
            id="include-usage-chunk-no-done",
        ),
    ],
)
async def test_usage_and_finish_reasons_read_from_the_stream(
    server: SimulatedServer,
    make: Callable[..., AnyClient],
    captured: Captured,
    behavior: Behavior,
    fields: dict[str, Any],
) -> None:
    server.default = behavior
    http = make(server.base_url)
    response = await http.send("POST", "/chat/completions", json=chat(stream=True, **fields))
    lines = await http.all_lines(response)
    await http.close(response)
    assert (lines[-2:] == ["data: [DONE]", ""]) is behavior.done
    usage = [p["usage"] for p in sse_payloads(lines) if p.get("usage")]
    assert len(usage) == 1  # what the app itself read, in whichever placement the server chose
    attrs = call_span(captured).attributes
    assert attrs[names.GEN_AI_USAGE_INPUT_TOKENS] == usage[0]["prompt_tokens"] > 0
    assert attrs[names.GEN_AI_USAGE_OUTPUT_TOKENS] == usage[0]["completion_tokens"] == 3
    assert list(attrs[names.GEN_AI_RESPONSE_FINISH_REASONS]) == [behavior.finish_reason]
    assert attrs[names.STREAM_CHUNKS] == 3
    assert attrs[names.STREAM_OUTCOME] == "completed"
    assert attrs[names.OUTPUT_TOKENS_PER_SECOND] > 0


@pytest.mark.parametrize(
    ("path", "body", "name"),
    [
        ("/completions", {"model": "tiny", "prompt": "hi"}, "text_completion tiny"),
        ("/responses", {"model": "tiny", "input": "hello"}, "chat tiny"),
    ],
)
async def test_streamed_completions_and_responses(
    server: SimulatedServer,
    make: Callable[..., AnyClient],
    captured: Captured,
    path: str,
    body: dict[str, Any],
    name: str,
) -> None:
    server.default = Behavior(chunks=3, usage="finish")
    http = make(server.base_url)
    async with http.stream("POST", path, json={**body, "stream": True}) as r:
        lines = await http.all_lines(r)
    assert any(line.startswith("data: ") for line in lines)
    span = captured.span(name)
    assert span.attributes[names.STREAM_CHUNKS] == 3
    assert span.attributes[names.GEN_AI_USAGE_OUTPUT_TOKENS] == 3
    assert list(span.attributes[names.GEN_AI_RESPONSE_FINISH_REASONS]) == ["stop"]
    assert span.attributes[names.STREAM_OUTCOME] == "completed"


class _FrozenWallClock:
    """The simulator's `time` module with the wall clock stopped, so two servers write the same bytes."""

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    @staticmethod
    def time() -> float:
        return 1_750_000_000.0


@pytest.mark.parametrize("path", ["/chat/completions", "/responses"])
async def test_the_app_reads_the_same_bytes_as_without_instrumentation(
    make: Callable[..., AnyClient], captured: Captured, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    monkeypatch.setattr(_simulator, "time", _FrozenWallClock())
    body = {**chat(stream=True, stream_options={"include_usage": True}), "input": "hello"}
    bodies = []
    for instrumented in (False, True):
        # Each server answers its first request: same sequence number, same ids, same bytes.
        with SimulatedServer(Behavior(chunks=5, chunk_gap=0.002)) as server:
            http = make(server.base_url, instrumented=instrumented)
            async with http.stream("POST", path, json=body) as r:
                bodies.append(await http.all_bytes(r))
    uninstrumented, instrumented_body = bodies
    assert b"data: " in uninstrumented
    assert instrumented_body == uninstrumented
    assert call_span(captured).attributes[names.STREAM_CHUNKS] == 5


async def test_the_stream_is_not_buffered(
    server: SimulatedServer, make: Callable[..., AnyClient], captured: Captured
) -> None:
    server.default = Behavior(chunks=4, chunk_gap=0.05)
    http = make(server.base_url)
    first_content_at = None
    async with http.stream("POST", "/chat/completions", json=chat(stream=True)) as r:
        lines = http.lines(r)
        while first_content_at is None:
            if is_content(await http.next_line(lines)):
                first_content_at = time.perf_counter_ns()
        rest = await http.rest(lines)
    assert len([line for line in rest if is_content(line)]) == 3
    assert server.wait_idle()
    assert first_content_at < server.requests[-1].chunk_sent_ns[-1]
    assert call_span(captured).attributes[names.STREAM_CHUNKS] == 4


# --- non-streamed operations ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "name"),
    [
        ("/chat/completions", chat(), "chat tiny"),
        ("/completions", {"model": "tiny", "prompt": "hi there"}, "text_completion tiny"),
        ("/embeddings", {"model": "embed", "input": ["a b", "c"]}, "embeddings embed"),
        ("/responses", {"model": "tiny", "input": "hello there"}, "chat tiny"),
    ],
)
@retry_timing
async def test_non_streamed_operations(
    server: SimulatedServer,
    make: Callable[..., AnyClient],
    captured: Captured,
    path: str,
    body: dict[str, Any],
    name: str,
) -> None:
    http = make(server.base_url)
    await http.request("POST", "/chat/completions", json=chat("warm-up"))
    captured.clear()
    server.default = Behavior(header_delay=0.04, chunks=4)
    with Window() as window:
        response = await http.request("POST", path, json=body)
    answer = response.json()
    assert server.wait_idle()
    served = server.requests[-1]
    span = captured.span(name)
    attrs = span.attributes
    assert names.GEN_AI_REQUEST_STREAM not in attrs  # set only on streaming requests
    usage = answer["usage"]
    assert attrs[names.GEN_AI_USAGE_INPUT_TOKENS] == usage.get("prompt_tokens", usage.get("input_tokens"))
    if path == "/embeddings":
        assert names.GEN_AI_USAGE_OUTPUT_TOKENS not in attrs
        assert names.GEN_AI_RESPONSE_ID not in attrs  # an embeddings list has no id
    else:
        assert attrs[names.GEN_AI_USAGE_OUTPUT_TOKENS] == 4
        assert attrs[names.GEN_AI_RESPONSE_ID] == answer["id"]
        assert list(attrs[names.GEN_AI_RESPONSE_FINISH_REASONS]) == ["stop"]
    assert attrs[names.GEN_AI_RESPONSE_MODEL] == body["model"]
    assert names.STREAM_OUTCOME not in attrs
    assert names.STREAM_CHUNKS not in attrs
    server_view = (served.finished_ns - served.arrived_ns) * 1e-9
    slack = max(late(served), window.beyond(server_view))
    assert_client_view(bucket(span, "first_token"), server_view, slack)
    assert 0.04 - 0.001 <= bucket(span, "first_token") <= 0.04 + TOLERANCE + slack
    assert bucket(span, "stream") == 0
    assert bucket(span, "connect") == 0
    assert bucket(span, "post") < CLIENT_SIDE + slack  # closing the response: the client's own work
    assert_buckets_sum_to_duration(span)


async def test_what_each_operation_asked_and_answered_under_the_convention_names(
    server: SimulatedServer, make: Callable[..., AnyClient], captured: Captured
) -> None:
    http = make(server.base_url, capture_content=True)
    server.default = Behavior(chunks=4)
    asked = chat(
        stream=True, n=2, stop="END", seed=3, frequency_penalty=0.5, presence_penalty=0.25, service_tier="flex",
        response_format={"type": "json_object"}, stream_options={"include_usage": True},
    )  # fmt: skip
    async with http.stream("POST", "/chat/completions", json=asked) as response:
        await http.all_lines(response)
    responses = {"model": "tiny", "input": "hi", "instructions": "Be brief.", "conversation": "conv_9"}
    await http.request("POST", "/responses", json=responses)
    await http.request(
        "POST", "/embeddings", json={"model": "emb", "input": ["a", "b"], "encoding_format": "base64"}
    )
    chat_span, responses_span, embeddings_span = (span.attributes for span in call_spans(captured))

    assert chat_span[names.GEN_AI_REQUEST_CHOICE_COUNT] == 2
    assert list(chat_span[names.GEN_AI_REQUEST_STOP_SEQUENCES]) == ["END"]
    assert chat_span[names.GEN_AI_REQUEST_SEED] == 3
    assert chat_span[names.GEN_AI_REQUEST_FREQUENCY_PENALTY] == 0.5
    assert chat_span[names.GEN_AI_REQUEST_PRESENCE_PENALTY] == 0.25
    assert chat_span[names.GEN_AI_OUTPUT_TYPE] == "json"
    assert chat_span[names.OPENAI_REQUEST_SERVICE_TIER] == "flex"
    assert chat_span[names.OPENAI_RESPONSE_SERVICE_TIER] == "flex"  # the simulator answers on the tier asked
    assert chat_span[names.OPENAI_RESPONSE_SYSTEM_FINGERPRINT] == "fp_sim"
    assert chat_span[names.GEN_AI_USAGE_REASONING_OUTPUT_TOKENS] == 0
    assert list(chat_span[names.GEN_AI_RESPONSE_FINISH_REASONS]) == ["stop", "stop"]

    assert responses_span[names.GEN_AI_CONVERSATION_ID] == "conv_9"
    assert json.loads(responses_span[names.GEN_AI_SYSTEM_INSTRUCTIONS]) == [
        {"type": "text", "content": "Be brief."}
    ]
    assert (
        responses_span[names.GEN_AI_USAGE_CACHE_CREATION_INPUT_TOKENS] == 0
    )  # the simulator's cache_write_tokens
    assert names.GEN_AI_SYSTEM_INSTRUCTIONS not in chat_span

    assert list(embeddings_span[names.GEN_AI_REQUEST_ENCODING_FORMATS]) == ["base64"]
    assert embeddings_span[names.GEN_AI_EMBEDDINGS_DIMENSION_COUNT] == 8  # the simulator's default size
    assert json.loads(embeddings_span[names.GEN_AI_INPUT_MESSAGES]) == [
        {"role": "user", "parts": [{"type": "text", "content": "a"}]},
        {"role": "user", "parts": [{"type": "text", "content": "b"}]},
    ]
    assert names.GEN_AI_OUTPUT_MESSAGES not in embeddings_span  # vectors are not an answer to record


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/models", None),
        ("POST", "/moderations", {"input": "hi"}),
        ("POST", "/files/chat", {"model": "tiny"}),
        ("GET", "/chat/completions", None),
    ],
)
async def test_other_requests_pass_through_without_spans(
    server: SimulatedServer,
    make: Callable[..., AnyClient],
    captured: Captured,
    method: str,
    path: str,
    body: dict[str, Any] | None,
) -> None:
    http = make(server.base_url)
    response = await http.request(method, path, json=body)
    assert response.status_code in (200, 404, 405)
    if path == "/models":
        assert response.json()["data"]
    assert captured.spans == []
    assert "traceparent" not in server.requests[-1].headers


# --- every way a stream can end ends the call exactly once ---------------------------------------


async def test_read_to_the_end_is_completed(
    server: SimulatedServer,
    make: Callable[..., AnyClient],
    captured: Captured,
    caplog: pytest.LogCaptureFixture,
) -> None:
    http = make(server.base_url)
    response = await http.send("POST", "/chat/completions", json=chat(stream=True))
    await http.all_bytes(response)
    await http.close(response)
    await http.close(response)
    span = assert_ended_once(captured, caplog)
    assert span.attributes[names.STREAM_OUTCOME] == "completed"
    assert span.attributes[names.STREAM_CHUNKS] == 8


async def test_closed_early_is_abandoned(
    server: SimulatedServer,
    make: Callable[..., AnyClient],
    captured: Captured,
    caplog: pytest.LogCaptureFixture,
) -> None:
    server.default = Behavior(chunks=6, chunk_gap=0.05)
    http = make(server.base_url)
    response = await http.send("POST", "/chat/completions", json=chat(stream=True))
    lines = http.lines(response)
    while not is_content(await http.next_line(lines)):
        pass
    await http.close(response)
    span = assert_ended_once(captured, caplog)
    assert span.attributes[names.STREAM_OUTCOME] == "abandoned"
    assert span.attributes[names.STREAM_CHUNKS] == 1
    assert names.ERROR_TYPE not in span.attributes
    assert span.status.status_code.name == "UNSET"
    assert bucket(span, "stream") == 0
    assert_buckets_sum_to_duration(span)


async def test_break_inside_the_stream_block_is_abandoned(
    server: SimulatedServer,
    make: Callable[..., AnyClient],
    captured: Captured,
    caplog: pytest.LogCaptureFixture,
) -> None:
    server.default = Behavior(chunks=6, chunk_gap=0.05)
    http = make(server.base_url)
    async with http.stream("POST", "/chat/completions", json=chat(stream=True)) as r:
        if http.is_async:
            async for line in r.aiter_lines():
                if is_content(line):
                    break
        else:
            for line in r.iter_lines():
                if is_content(line):
                    break
    span = assert_ended_once(captured, caplog)
    assert span.attributes[names.STREAM_OUTCOME] == "abandoned"
    assert names.ERROR_TYPE not in span.attributes


async def test_closed_after_the_done_marker_is_completed(
    server: SimulatedServer,
    make: Callable[..., AnyClient],
    captured: Captured,
    caplog: pytest.LogCaptureFixture,
) -> None:
    http = make(server.base_url)
    async with http.stream("POST", "/chat/completions", json=chat(stream=True)) as r:
        lines = http.lines(r)
        while await http.next_line(lines) != "data: [DONE]":
            pass
    span = assert_ended_once(captured, caplog)
    assert span.attributes[names.STREAM_OUTCOME] == "completed"
    assert span.attributes[names.STREAM_CHUNKS] == 8


async def test_dropped_connection_mid_stream_is_an_error(
    server: SimulatedServer,
    make: Callable[..., AnyClient],
    captured: Captured,
    caplog: pytest.LogCaptureFixture,
) -> None:
    server.default = Behavior(chunks=6, drop_after=2)
    plain = make(server.base_url, instrumented=False)
    http = make(server.base_url)
    with pytest.raises(plain.module.TransportError) as uninstrumented:
        async with plain.stream("POST", "/chat/completions", json=chat(stream=True)) as r:
            await http.all_lines(r)
    with pytest.raises(type(uninstrumented.value)) as instrumented:
        async with http.stream("POST", "/chat/completions", json=chat(stream=True)) as r:
            await http.all_lines(r)
    assert type(instrumented.value) is type(uninstrumented.value)
    assert str(instrumented.value) == str(uninstrumented.value)
    span = assert_ended_once(captured, caplog)
    assert span.attributes[names.STREAM_OUTCOME] == "error"
    assert span.attributes[names.STREAM_CHUNKS] == 2
    assert span.attributes[names.ERROR_TYPE] == type(uninstrumented.value).__qualname__
    assert span.status.status_code.name == "ERROR"


async def test_garbage_collected_unclosed_response_is_abandoned(
    server: SimulatedServer,
    make: Callable[..., AnyClient],
    captured: Captured,
    caplog: pytest.LogCaptureFixture,
) -> None:
    server.default = Behavior(chunks=6, chunk_gap=0.05)
    http = make(server.base_url)
    response = await http.send("POST", "/chat/completions", json=chat(stream=True))
    lines = http.lines(response)
    while not is_content(await http.next_line(lines)):
        pass
    del response, lines
    await collect_garbage(lambda: bool(call_spans(captured)))
    span = assert_ended_once(captured, caplog)
    assert span.attributes[names.STREAM_OUTCOME] == "abandoned"
    assert span.attributes[names.STREAM_CHUNKS] == 1


@pytest.mark.parametrize("kind", ASYNC_CLIENTS)
async def test_task_cancelled_mid_read_is_cancelled(
    server: SimulatedServer,
    make: Callable[..., AnyClient],
    captured: Captured,
    caplog: pytest.LogCaptureFixture,
) -> None:
    server.default = Behavior(chunks=50, chunk_gap=0.02)
    http = make(server.base_url)
    got_one = asyncio.Event()

    async def consume() -> None:
        async with http.stream("POST", "/chat/completions", json=chat(stream=True)) as r:
            async for line in r.aiter_lines():
                if is_content(line):
                    got_one.set()

    task = asyncio.create_task(consume())
    await got_one.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    span = assert_ended_once(captured, caplog)
    assert span.attributes[names.STREAM_OUTCOME] == "cancelled"
    assert 1 <= span.attributes[names.STREAM_CHUNKS] < 50


# --- failures, trace context, connections, credentials --------------------------------------------


@pytest.mark.parametrize("status", [400, 429, 503])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_error_status_marks_the_call_failed_without_retries(
    server: SimulatedServer, make: Callable[..., AnyClient], captured: Captured, status: int, stream: bool
) -> None:
    server.default = Behavior(status=status)
    http = make(server.base_url)
    async with http.stream("POST", "/chat/completions", json=chat(stream=stream)) as r:
        assert r.status_code == status
        assert "error" in json.loads(await http.all_bytes(r))
    span = call_span(captured)
    assert span.status.status_code.name == "ERROR"
    assert span.attributes[names.ERROR_TYPE] == str(status)
    assert names.RETRY_COUNT not in span.attributes
    assert names.RETRY_CAUSES not in span.attributes
    if stream:
        assert span.attributes[names.STREAM_OUTCOME] == "error"
    assert span.attributes[names.HTTP_RESPONSE_STATUS_CODE] == status
    assert attempt_spans(captured) == []
    assert len(server.requests) == 1


def traceparent(span: Any) -> str:
    context = span.context
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


async def test_a_single_attempt_sends_the_call_span_as_parent(
    server: SimulatedServer, make: Callable[..., AnyClient], captured: Captured
) -> None:
    http = make(server.base_url)
    await http.request("POST", "/chat/completions", json=chat())
    assert attempt_spans(captured) == []
    assert server.requests[-1].headers["traceparent"] == traceparent(call_span(captured))


async def test_with_attempt_spans_always_the_attempt_is_the_parent(
    server: SimulatedServer, make: Callable[..., AnyClient], captured: Captured
) -> None:
    http = make(server.base_url, attempt_spans="always")
    await http.request("POST", "/chat/completions", json=chat())
    (attempt,) = attempt_spans(captured)
    assert server.requests[-1].headers["traceparent"] == traceparent(attempt)
    assert attempt.parent.span_id == call_span(captured).context.span_id
    assert attempt.attributes[names.HTTP_RESPONSE_STATUS_CODE] == 200
    assert attempt.attributes[names.URL_FULL] == f"{server.base_url}/chat/completions"
    assert names.HTTP_REQUEST_RESEND_COUNT not in attempt.attributes


async def test_second_request_reuses_the_connection(
    server: SimulatedServer, make: Callable[..., AnyClient], captured: Captured
) -> None:
    http = make(server.base_url, attempt_spans="always")
    await http.request("POST", "/chat/completions", json=chat())
    async with http.stream("POST", "/chat/completions", json=chat(stream=True)) as r:
        await http.all_bytes(r)
    first, second = call_spans(captured)
    assert first.attributes[names.CONNECT_REUSED] is False
    assert first.attributes[names.CONNECT_NEW] == 1
    assert bucket(first, "connect") > 0
    assert second.attributes[names.CONNECT_REUSED] is True
    assert names.CONNECT_NEW not in second.attributes  # no connection opened: nothing to count
    assert bucket(second, "connect") == 0
    first_attempt, second_attempt = attempt_spans(captured)
    assert first_attempt.attributes[names.CONNECT_DURATION] > 0
    assert second_attempt.attributes[names.CONNECT_REUSED] is True
    assert second_attempt.attributes[names.CONNECT_DURATION] == 0
    assert server.connections_opened == 1


async def test_no_credentials_in_the_url_or_any_attribute(
    server: SimulatedServer, make: Callable[..., AnyClient], captured: Captured
) -> None:
    with_userinfo = make(f"http://user:hunter2@127.0.0.1:{server.port}/v1", attempt_spans="always")
    await with_userinfo.request("POST", "/chat/completions?api-key=SECRET", json=chat())
    with_header = make(server.base_url, headers={"Authorization": f"Bearer {SECRET}"}, attempt_spans="always")
    async with with_header.stream(
        "POST", "/chat/completions", params={"api-key": "SECRET"}, json=chat(stream=True)
    ) as r:
        await with_header.all_bytes(r)
    basic, bearer = (request.headers["authorization"] for request in server.requests)
    assert basic.startswith("Basic ")  # the credentials did travel: the test can see a leak
    assert bearer == f"Bearer {SECRET}"
    expected = f"http://127.0.0.1:{server.port}/v1/chat/completions?api-key=REDACTED"
    with_user = f"http://REDACTED:REDACTED@127.0.0.1:{server.port}/v1/chat/completions?api-key=REDACTED"
    assert [a.attributes[names.URL_FULL] for a in attempt_spans(captured)] == [with_user, expected]
    assert len(call_spans(captured)) == 2
    text = all_exported_text(captured)
    for secret in ("hunter2", "SECRET", basic.split()[1], "Bearer", "PRIVATE-PROMPT"):
        assert secret not in text
    assert "authorization" not in text.lower()


async def test_instrument_twice_then_uninstrument(
    server: SimulatedServer, make: Callable[..., AnyClient], captured: Captured
) -> None:
    http = make(server.base_url, instrumented=False)
    original = http.client._transport
    assert llmspans.instrument(http.client) is http.client
    assert llmspans.instrument(http.client) is http.client
    assert http.client._transport.inner is original  # wrapped once
    await http.request("POST", "/chat/completions", json=chat())
    assert len(captured.spans) == 1  # one call span: not doubled
    assert llmspans.uninstrument(http.client) is http.client
    assert http.client._transport is original
    assert llmspans.uninstrument(http.client) is http.client
    await http.request("POST", "/chat/completions", json=chat())
    assert len(captured.spans) == 1
    assert "traceparent" not in server.requests[-1].headers
    llmspans.instrument(http.client)
    await http.request("POST", "/chat/completions", json=chat())
    assert len(captured.spans) == 2


# --- random SSE bodies from a server that sends exactly what it is told ---------------------------


class _ScriptedHandler(socketserver.StreamRequestHandler):
    """Answers each request on a keep-alive connection with the server's `headers` and `pieces`, one
    HTTP chunk per piece, each in its own write."""

    server: ScriptedServer

    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def handle(self) -> None:
        while self.rfile.readline():  # the request line; empty at the end of the connection
            length = 0
            while (line := self.rfile.readline()) not in (b"\r\n", b"\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            self.rfile.read(length)
            head = ["HTTP/1.1 200 OK", "transfer-encoding: chunked", *self.server.headers, "", ""]
            self.wfile.write("\r\n".join(head).encode())
            for piece in self.server.pieces:
                self.wfile.write(b"%x\r\n%b\r\n" % (len(piece), piece))
            self.wfile.write(b"0\r\n\r\n")


class ScriptedServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    headers = ("content-type: text/event-stream",)
    pieces: tuple[bytes, ...] = ()


@pytest.fixture
def scripted() -> Iterator[ScriptedServer]:
    with ScriptedServer(("127.0.0.1", 0), _ScriptedHandler) as running:
        thread = threading.Thread(target=running.serve_forever, args=(0.01,), daemon=True)
        thread.start()
        yield running
        running.shutdown()
        thread.join(5)


_FREE_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n"), max_size=12)


@st.composite
def sse_events(draw: st.DrawFn) -> tuple[str, str | None]:
    """One SSE event as lines (line endings are chosen later) and the answer text it carries, if any.
    A finish event carries no text: `sse_bodies` tells it by its `finish_reason`."""
    ascii_only = draw(st.booleans())

    def dumps(obj: Any) -> str:
        return json.dumps(obj, ensure_ascii=ascii_only)

    def choice(delta: Any, **extra: Any) -> str:
        return dumps({"id": "c1", "model": "m", "choices": [{"index": 0, "delta": delta, **extra}]})

    kind = draw(
        st.sampled_from(["content", "role", "empty", "null", "usage", "finish", "garbage", "ping", "comment"])
    )
    if kind == "content":
        text = draw(st.text(min_size=1, max_size=12))
        payload = choice({"content": text})
        if draw(st.booleans()):  # over two data lines, which SSE joins with "\n"; maybe a comment between
            head, _, tail = payload.partition(", ")
            between = draw(st.sampled_from(["", ": keep-alive\n"]))
            return f"data: {head},\n{between}data:{tail}", text
        return f"data: {payload}", text
    if kind == "role":
        return f"data: {choice({'role': 'assistant'})}", None
    if kind == "empty":
        return f"data: {choice({'content': ''})}", None
    if kind == "null":
        return f"data: {choice(None)}", None
    if kind == "usage":  # `choices: []`
        usage = {"prompt_tokens": 2, "completion_tokens": 3}
        return f"data: {dumps({'id': 'c1', 'choices': [], 'usage': usage})}", None
    if kind == "finish":
        return f"data: {choice({}, finish_reason='stop')}", None
    if kind == "garbage":
        return f"data: not json {draw(_FREE_TEXT)}", None
    if kind == "ping":
        return "event: ping\ndata: {}", None
    return f":{draw(_FREE_TEXT)}", None  # a comment alone: no data, nothing dispatched


@st.composite
def sse_bodies(draw: st.DrawFn) -> tuple[bytes, list[str], bool, bool]:
    """A whole SSE body, the texts of its content events, whether it said it was over (a `[DONE]` or a
    finish reason) and whether its choice finished (a finish reason); blank keep-alive lines between
    events."""
    newline = draw(st.sampled_from(["\n", "\r\n", "\r"]))
    events = draw(st.lists(sse_events(), max_size=12))
    parts = []
    for lines, _ in events:
        parts.append(lines + "\n\n" + "\n" * draw(st.integers(0, 2)))
    done = draw(st.booleans())
    if done:
        parts.append("data: [DONE]\n\n")
    body = "".join(parts).replace("\n", newline).encode()
    finished = any(text is None and '"finish_reason"' in lines for lines, text in events)
    return body, [text for _, text in events if text is not None], done or finished, finished


@st.composite
def pieces_of(draw: st.DrawFn, body: bytes) -> tuple[bytes, ...]:
    """The body cut anywhere, and often where a parser is likeliest to slip: between the CR and
    LF of a line ending, or inside a multi-byte UTF-8 character."""
    tricky = [i for i in range(1, len(body)) if body[i - 1] == 0x0D or body[i] & 0xC0 == 0x80]
    cuts = draw(st.lists(st.integers(0, len(body)), max_size=4))
    if tricky:
        cuts += draw(st.lists(st.sampled_from(tricky), max_size=12))
    bounds = [0, *sorted(set(cuts)), len(body)]
    return tuple(body[a:b] for a, b in itertools.pairwise(bounds) if b > a)


class _InternalErrors(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_random_sse_bodies_reach_the_app_unchanged_and_are_counted(
    kind: str, scripted: ScriptedServer, captured: Captured
) -> None:
    loop = asyncio.new_event_loop()  # one loop for every example: an async client is bound to its loop
    http = AnyClient(kind, f"http://127.0.0.1:{scripted.server_address[1]}/v1", instrumented=False)
    llmspans.instrument(http.client, capture_content=True)
    internal = _InternalErrors()
    logging.getLogger("llmspans").addHandler(internal)

    async def read() -> bytes:
        response = await http.send("POST", "/chat/completions", json={"model": "m", "stream": True})
        try:
            return await http.all_bytes(response)
        finally:
            await http.close(response)

    @settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(generated=sse_bodies(), data=st.data())
    def check(generated: tuple[bytes, list[str], bool, bool], data: st.DataObject) -> None:
        body, texts, said_over, finished = generated
        scripted.pieces = data.draw(pieces_of(body))
        captured.clear()
        received = loop.run_until_complete(read())
        assert received == body
        span = call_span(captured)
        assert attempt_spans(captured) == []
        assert span.attributes[names.STREAM_CHUNKS] == len(texts)
        if texts or finished:  # one choice: its text, and `error` when nothing said it was over
            (answer,) = json.loads(span.attributes[names.GEN_AI_OUTPUT_MESSAGES])
            assert answer == {
                "role": "assistant",
                "parts": [{"type": "text", "content": "".join(texts)}],
                "finish_reason": "stop" if finished else "error",
            }
        else:  # the model answered nothing: no output messages at all
            assert names.GEN_AI_OUTPUT_MESSAGES not in span.attributes
        if said_over:
            assert span.attributes[names.STREAM_OUTCOME] == "completed"
            assert names.ERROR_TYPE not in span.attributes
        else:  # the body closed cleanly, but nothing said the answer was over
            assert span.attributes[names.STREAM_OUTCOME] == "error"
            assert span.attributes[names.ERROR_TYPE] == names.ERROR_INCOMPLETE_STREAM
        assert internal.records == []

    try:
        check()
    finally:
        logging.getLogger("llmspans").removeHandler(internal)
        loop.run_until_complete(http.aclose())
        loop.close()


# --- content-encoded bodies: the observers read what the app reads --------------------------------

CHAT_JSON = {
    "id": "chatcmpl-gz",
    "object": "chat.completion",
    "model": "tiny",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9},
}


def compressor(coding: str) -> Any:
    return zlib.compressobj(wbits=31 if coding == "gzip" else zlib.MAX_WBITS)  # gzip or zlib framing


@pytest.mark.parametrize("coding", ["gzip", "deflate"])
async def test_compressed_json_body_is_read(
    scripted: ScriptedServer, make: Callable[..., AnyClient], captured: Captured, coding: str
) -> None:
    encoder = compressor(coding)
    encoded = encoder.compress(json.dumps(CHAT_JSON).encode()) + encoder.flush()
    scripted.headers = ("content-type: application/json", f"content-encoding: {coding}")
    scripted.pieces = (encoded[:10], encoded[10:])
    http = make(f"http://127.0.0.1:{scripted.server_address[1]}/v1")
    response = await http.request("POST", "/chat/completions", json=chat())
    assert response.json() == CHAT_JSON
    attrs = call_span(captured).attributes
    assert attrs[names.GEN_AI_USAGE_INPUT_TOKENS] == 7
    assert attrs[names.GEN_AI_USAGE_OUTPUT_TOKENS] == 2
    assert attrs[names.GEN_AI_RESPONSE_ID] == "chatcmpl-gz"


async def test_compressed_stream_is_read_event_by_event(
    scripted: ScriptedServer, make: Callable[..., AnyClient], captured: Captured
) -> None:
    events = [
        {"id": "c1", "choices": [{"index": 0, "delta": {"content": word}}]} for word in ("a", "b", "c")
    ] + [{"id": "c1", "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}}]
    encoder = compressor("gzip")
    pieces = [
        encoder.compress(f"data: {json.dumps(e)}\n\n".encode()) + encoder.flush(zlib.Z_SYNC_FLUSH)
        for e in events
    ]
    scripted.headers = ("content-type: text/event-stream", "content-encoding: gzip")
    scripted.pieces = (*pieces, encoder.compress(b"data: [DONE]\n\n") + encoder.flush())
    http = make(f"http://127.0.0.1:{scripted.server_address[1]}/v1")
    async with http.stream("POST", "/chat/completions", json=chat(stream=True)) as r:
        lines = await http.all_lines(r)
    assert lines[-2:] == ["data: [DONE]", ""]
    attrs = call_span(captured).attributes
    assert attrs[names.STREAM_CHUNKS] == 3
    assert attrs[names.GEN_AI_USAGE_OUTPUT_TOKENS] == 3
    assert attrs[names.STREAM_OUTCOME] == "completed"
