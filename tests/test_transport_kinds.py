"""Any client on any transport still works instrumented (`llmspans/_transport.py`, `install`).

Users' own unit tests build clients on `httpx.MockTransport` (which offers both the sync and the
async method), on fakes of their own, on caching transports that return bodies already read. The
wrapper is chosen by the client, a transport that cannot serve the client is left alone, and a
response handed over with its body complete ends its call as one read through us does.

Run for every client family this environment has: plain httpx and httpx2 clients, and the openai
SDK on the library it sends through (httpx2 from openai 3, httpx before; the legacy CI leg runs
this file with openai 2.x).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import openai
import pytest

import llmspans
from llmspans import _names as names
from llmspans.testing import Captured
from tests.timing import assert_buckets_sum_to_duration, bucket

try:
    import httpx2
except ImportError:  # the legacy openai leg has no httpx2
    httpx2 = None
import httpx

OPENAI_LIBRARY: Any = httpx2 if int(openai.__version__.split(".")[0]) >= 3 else httpx
LIBRARIES: list[Any] = [lib for lib in (httpx, httpx2) if lib is not None]

BASE_URL = "http://llm.test/v1"
MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "hi"}]
ANSWER = ["Hello", " there", "!"]

CHAT_JSON = {
    "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": MODEL,
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(ANSWER)}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6},
}  # fmt: skip


def _sse_events() -> list[bytes]:
    chunk = {"id": "chatcmpl-2", "object": "chat.completion.chunk", "created": 1, "model": MODEL}
    events = [{**chunk, "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]}]
    events += [
        {**chunk, "choices": [{"index": 0, "delta": {"content": t}, "finish_reason": None}]} for t in ANSWER
    ]
    events.append({**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    return [f"data: {json.dumps(event)}\n\n".encode() for event in events] + [b"data: [DONE]\n\n"]


SSE_EVENTS = _sse_events()
JSON_HEADERS = {"content-type": "application/json"}
SSE_HEADERS = {"content-type": "text/event-stream"}


def _byte_stream(lib: Any, parts: list[bytes], gap: float, times: list[int]) -> Any:
    """A body streamed through the transport, part by part, `gap` seconds apart (both read sides);
    `times` gets the wall-clock time each part is handed over."""

    class Parts(lib.SyncByteStream, lib.AsyncByteStream):  # type: ignore[misc, name-defined]
        def __iter__(self) -> Iterator[bytes]:
            for index, part in enumerate(parts):
                if index and gap:
                    time.sleep(gap)
                times.append(time.time_ns())
                yield part

        async def __aiter__(self) -> AsyncIterator[bytes]:
            for index, part in enumerate(parts):
                if index and gap:
                    await asyncio.sleep(gap)
                times.append(time.time_ns())
                yield part

    return Parts()


def handler_for(
    lib: Any, preread: bool, delay: float = 0.0, gap: float = 0.0, times: list[int] | None = None
) -> Callable[[Any], Any]:
    """What the fake server answers: JSON or SSE by the request's `stream` flag, the body given whole
    (`content=`, read at once by the Response) or streamed; `delay` before the headers. `times` gets
    the wall-clock time it answers (after `delay`), then each streamed part's: what a test on a busy
    machine bounds the client's figures by, instead of a fixed tolerance."""
    times = [] if times is None else times

    def handle(request: Any) -> Any:
        if delay:
            time.sleep(delay)
        times.append(time.time_ns())
        streamed = json.loads(request.content).get("stream") is True
        parts = SSE_EVENTS if streamed else [json.dumps(CHAT_JSON).encode()]
        headers = SSE_HEADERS if streamed else JSON_HEADERS
        if preread:
            return lib.Response(200, headers=headers, content=b"".join(parts))
        return lib.Response(200, headers=headers, stream=_byte_stream(lib, parts, gap, times))

    return handle


def both_sides_transport(lib: Any, handle: Callable[[Any], Any]) -> Any:
    """A transport class of the app's own with both methods, not derived from the library's bases."""

    class BothSides:
        def handle_request(self, request: Any) -> Any:
            request.read()
            return handle(request)

        async def handle_async_request(self, request: Any) -> Any:
            await request.aread()
            return handle(request)

        def close(self) -> None:
            pass

        async def aclose(self) -> None:
            pass

    return BothSides()


TRANSPORTS = {
    "MockTransport": lambda lib, handle: lib.MockTransport(handle),
    "both-sides": both_sides_transport,
}


# --- the app's view, instrumented or not -----------------------------------------------------


def make_client(family: str, lib: Any, is_async: bool, transport: Any) -> Any:
    if family == "openai":
        http = (lib.AsyncClient if is_async else lib.Client)(transport=transport)
        cls = openai.AsyncOpenAI if is_async else openai.OpenAI
        return cls(api_key="sk-test", base_url=BASE_URL, http_client=http, max_retries=0)
    return (lib.AsyncClient if is_async else lib.Client)(transport=transport, base_url=BASE_URL)


async def app_call(client: Any, family: str, stream: bool, during: Callable[[], None] | None = None) -> Any:
    """One chat call as the app makes it; what it got, in a comparable form. `during` runs after the
    first item of a stream is read (the app's own work while it consumes the stream)."""
    body = {"model": MODEL, "messages": MESSAGES}
    is_async = isinstance(client, openai.AsyncOpenAI | httpx.AsyncClient) or (
        httpx2 is not None and isinstance(client, httpx2.AsyncClient)
    )
    if family == "openai":
        create = client.chat.completions.create
        if not stream:
            result = (await create(**body)) if is_async else create(**body)
            return result.model_dump()
        items: list[Any] = []
        if is_async:
            async for item in await create(stream=True, **body):
                items.append(item.model_dump())
                if during is not None and len(items) == 1:
                    during()
        else:
            for item in create(stream=True, **body):
                items.append(item.model_dump())
                if during is not None and len(items) == 1:
                    during()
        return items
    if not stream:
        response = (
            (await client.post("/chat/completions", json=body))
            if is_async
            else client.post("/chat/completions", json=body)
        )
        return response.status_code, response.json()
    lines: list[str] = []
    payload = {**body, "stream": True}
    if is_async:
        async with client.stream("POST", "/chat/completions", json=payload) as response:
            async for line in response.aiter_lines():
                lines.append(line)
                if during is not None and len(lines) == 1:
                    during()
    else:
        with client.stream("POST", "/chat/completions", json=payload) as response:
            for line in response.iter_lines():
                lines.append(line)
                if during is not None and len(lines) == 1:
                    during()
    return response.status_code, lines


def families() -> list[tuple[str, Any]]:
    return [("httpx", lib) if lib is httpx else ("httpx2", lib) for lib in LIBRARIES] + [
        ("openai", OPENAI_LIBRARY)
    ]


FAMILIES = families()
FAMILY_IDS = [f"{name}-{lib.__name__}" if name == "openai" else name for name, lib in FAMILIES]


def call_spans(captured: Captured) -> list[Any]:
    return [s for s in captured.spans if (s.attributes or {}).get(names.STAGE) == names.STAGE_LLM]


# --- the tests ------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("preread", [True, False], ids=["content", "streamed-body"])
@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(("family", "lib"), FAMILIES, ids=FAMILY_IDS)
async def test_any_transport_gives_the_uninstrumented_answer_and_one_ended_call(
    captured: Captured, family: str, lib: Any, is_async: bool, transport: str, preread: bool, stream: bool
) -> None:
    make_transport = TRANSPORTS[transport]
    expected = await app_call(
        make_client(family, lib, is_async, make_transport(lib, handler_for(lib, preread))), family, stream
    )
    assert call_spans(captured) == []  # uninstrumented: nothing

    client = llmspans.instrument(
        make_client(family, lib, is_async, make_transport(lib, handler_for(lib, preread)))
    )
    before_return = time.time_ns()
    got = await app_call(client, family, stream)
    returned = time.time_ns()
    assert got == expected

    (span,) = call_spans(captured)  # one call, ended by the time the app's call returned
    assert before_return <= span.start_time <= span.end_time <= returned
    assert span.name == f"chat {MODEL}"
    if not stream:
        assert span.attributes[names.GEN_AI_USAGE_INPUT_TOKENS] == 3
        assert span.attributes[names.GEN_AI_USAGE_OUTPUT_TOKENS] == 3
    else:
        assert span.attributes[names.STREAM_OUTCOME] == names.OUTCOME_COMPLETED
        assert span.attributes[names.STREAM_CHUNKS] == len(ANSWER)
    assert list(span.attributes[names.GEN_AI_RESPONSE_FINISH_REASONS]) == ["stop"]
    assert names.ERROR_TYPE not in span.attributes
    assert_buckets_sum_to_duration(span)


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
async def test_an_sdk_stream_on_a_preread_body_ends_when_the_stream_ends(
    captured: Captured, is_async: bool
) -> None:
    """The SDK's stream over a body that came whole: the call is the app's until it has read it all.
    (A plain client's stream is its body: its call ended when the body came, as the test above shows.)"""
    lib = OPENAI_LIBRARY
    client = llmspans.instrument(
        make_client("openai", lib, is_async, lib.MockTransport(handler_for(lib, True)))
    )
    body = {"model": MODEL, "messages": MESSAGES, "stream": True}
    create = client.chat.completions.create
    stream = (await create(**body)) if is_async else create(**body)
    iterator = stream.__aiter__() if is_async else iter(stream)
    first = (await iterator.__anext__()) if is_async else next(iterator)
    assert first.choices[0].delta.role == "assistant"
    assert call_spans(captured) == []  # headers and a chunk read: the call is not over
    rest = [item async for item in iterator] if is_async else list(iterator)
    assert len(rest) == len(SSE_EVENTS) - 2  # all but the role chunk and [DONE]
    (span,) = call_spans(captured)
    assert span.attributes[names.STREAM_OUTCOME] == names.OUTCOME_COMPLETED


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(("family", "lib"), FAMILIES, ids=FAMILY_IDS)
async def test_a_preread_body_keeps_honest_buckets(
    captured: Captured, family: str, lib: Any, is_async: bool, stream: bool
) -> None:
    """The server took `delay` before its answer, which came whole: that is first_token; the stream
    bucket is zero (every chunk arrived at once); the app's own work after the body came is post.
    Bounded by what the test saw happen, not by a tolerance (a starved process, as at nice 19 beside
    two busy workers, takes 100-300 ms between the server's answer and the next line of the client)."""
    delay, work = 0.08, 0.05
    answered: list[int] = []
    worked: list[int] = []

    def app_work() -> None:
        worked.append(time.time_ns())
        time.sleep(work)

    client = llmspans.instrument(
        make_client(family, lib, is_async, lib.MockTransport(handler_for(lib, True, delay, times=answered)))
    )
    await app_call(client, family, stream, during=app_work)
    returned = time.time_ns()
    (span,) = call_spans(captured)
    before_first_token = sum(bucket(span, name) for name in ("queue", "retry", "connect"))
    first_token_ended = span.start_time + round((before_first_token + bucket(span, "first_token")) * 1e9)
    assert delay <= bucket(span, "first_token")
    assert first_token_ended <= (worked[0] if worked else returned)  # before the app had the answer
    assert bucket(span, "stream") == 0
    # post starts when the body came whole: after the server answered, and never holds its wait
    assert bucket(span, "post") <= (returned - answered[0]) / 1e9
    if stream and family == "openai":  # the SDK's stream is the app's until read: its work is post
        assert work <= bucket(span, "post")
    else:  # a plain client's call ended when the body came, before the app's work
        assert span.end_time <= (worked[0] if worked else returned)
    assert_buckets_sum_to_duration(span)


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(("family", "lib"), FAMILIES, ids=FAMILY_IDS)
async def test_a_body_streamed_through_a_custom_transport_is_stamped_as_it_comes(
    captured: Captured, family: str, lib: Any, is_async: bool
) -> None:
    """The same call with the body streamed by the transport, `gap` between events: that is stream.
    The content chunks are events 1..3: at least two gaps between the first and the last (each sleep
    starts after the client took the part before), and at most from the first content part's hand-over
    to the call's return."""
    gap = 0.03
    handed: list[int] = []  # the handler's answer, then each part's hand-over
    transport = both_sides_transport(lib, handler_for(lib, False, gap=gap, times=handed))
    client = llmspans.instrument(make_client(family, lib, is_async, transport))
    await app_call(client, family, True)
    returned = time.time_ns()
    (span,) = call_spans(captured)
    assert 2 * gap <= bucket(span, "stream") <= (returned - handed[2]) / 1e9
    assert_buckets_sum_to_duration(span)


class OnlyAsync:
    async def handle_async_request(self, request: Any) -> Any:
        raise AssertionError("never called by a sync client")


class OnlySync:
    def handle_request(self, request: Any) -> Any:
        raise AssertionError("never called by an async client")


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(("family", "lib"), FAMILIES, ids=FAMILY_IDS)
async def test_a_transport_with_only_the_other_side_is_left_alone(
    captured: Captured, family: str, lib: Any, is_async: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """It cannot serve this client: the app sees the failure it sees uninstrumented, and no call stays open."""
    wrong = OnlySync if is_async else OnlyAsync

    async def outcome(client: Any) -> tuple[type[BaseException], str]:
        with pytest.raises((AttributeError, openai.APIConnectionError)) as raised:
            await app_call(client, family, False)
        return raised.type, str(raised.value)

    expected = await outcome(make_client(family, lib, is_async, wrong()))
    client = make_client(family, lib, is_async, wrong())
    with caplog.at_level("DEBUG", logger="llmspans"):
        llmspans.instrument(client)
    inner = client._client if family == "openai" else client
    assert isinstance(inner._transport, wrong)  # not wrapped
    assert any("pass through unobserved" in r.getMessage() for r in caplog.records)
    assert await outcome(client) == expected
    for span in call_spans(captured):  # the openai adapter's call (the SDK raised): ended, as an error
        assert span.attributes[names.ERROR_TYPE]
