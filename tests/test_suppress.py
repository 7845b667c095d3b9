"""OpenTelemetry's suppress_instrumentation switch: inside it llmspans records nothing, and changes nothing.

An app sets the key (`opentelemetry.instrumentation.utils.suppress_instrumentation()`, or by hand as
`suppressed()` below does) around health checks, warm-ups or an exporter's own traffic. Every call,
stage and turn started inside it runs as it would uninstrumented: no span, no metric point, no
`traceparent` on the wire. A limiter is behaviour, not telemetry, so it still admits and caps.
Real HTTP against the simulated server, with the real openai SDK and plain httpx clients.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai
import pytest
from opentelemetry import context
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import llmspans
from llmspans import _names as names
from llmspans.testing import Captured
from llmspans.tools.simulator import Behavior, SimulatedServer

MESSAGES = [{"role": "user", "content": "hi"}]


@contextmanager
def suppressed() -> Iterator[None]:
    """What `opentelemetry.instrumentation.utils.suppress_instrumentation()` does (that package is not
    a dependency of ours)."""
    token = context.attach(context.set_value(context._SUPPRESS_INSTRUMENTATION_KEY, True))
    try:
        yield
    finally:
        context.detach(token)


SERVER_BEHAVIOR = Behavior(chunks=5)


def recorded_points(captured: Captured) -> list[str]:
    """Histogram and counter points: what a call or stage records (gauges are observed regardless)."""
    return [point.name for point in captured.metric_points() if point.kind != "gauge"]


def assert_recorded_nothing(captured: Captured, server: SimulatedServer) -> None:
    assert captured.spans == []
    assert recorded_points(captured) == []
    server.wait_idle()
    assert all("traceparent" not in request.headers for request in server.requests)


@pytest.mark.parametrize("stream", [True, False])
def test_a_suppressed_openai_call_records_nothing_and_returns_the_same(
    server: SimulatedServer, captured: Captured, stream: bool
) -> None:
    client = llmspans.instrument(openai.OpenAI(base_url=server.base_url, api_key="sk-test", max_retries=0))
    with suppressed():
        if stream:
            chunks = list(client.chat.completions.create(model="m", messages=MESSAGES, stream=True))
            assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == 5
        else:
            assert client.chat.completions.create(model="m", messages=MESSAGES).choices[0].message.content
    assert_recorded_nothing(captured, server)
    server.clear()
    result = client.chat.completions.create(model="m", messages=MESSAGES, stream=stream)
    if stream:
        list(result)
    server.wait_idle()
    assert {span.name for span in captured.spans} == {"chat m"}
    assert "traceparent" in server.requests[0].headers
    assert recorded_points(captured)


async def test_a_suppressed_async_stream_records_nothing(server: SimulatedServer, captured: Captured) -> None:
    client = llmspans.instrument(
        openai.AsyncOpenAI(base_url=server.base_url, api_key="sk-test", max_retries=0)
    )
    with suppressed():
        stream = await client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        contents = [
            c.choices[0].delta.content async for c in stream if c.choices and c.choices[0].delta.content
        ]
    assert len(contents) == 5
    assert_recorded_nothing(captured, server)
    await client.close()


def test_a_suppressed_plain_httpx_call_records_nothing(server: SimulatedServer, captured: Captured) -> None:
    client = llmspans.instrument(httpx.Client(base_url=server.base_url))
    body = {"model": "m", "messages": MESSAGES, "stream": True}
    with suppressed(), client.stream("POST", "/chat/completions", json=body) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: {")]
    assert len(lines) >= 5
    assert_recorded_nothing(captured, server)
    client.post("/chat/completions", json={**body, "stream": False})
    assert {span.name for span in captured.spans} == {"chat m"}
    client.close()


def test_suppressed_stages_and_turns_run_and_record_nothing(captured: Captured) -> None:
    @llmspans.retrieval(budget="1us")  # always over budget: not even the violation is counted
    def search() -> list[str]:
        return ["doc"]

    @llmspans.tool(budget="5ms", on_exceed="cancel", fallback="timed out")
    async def slow() -> str:
        await asyncio.sleep(5)
        return "done"

    with suppressed():
        with llmspans.turn("chat", budget="1us"):
            assert search() == ["doc"]
            assert asyncio.run(slow()) == "timed out"  # the budget still cuts: that is behaviour
        assert search() == ["doc"]
    assert captured.spans == []
    assert recorded_points(captured) == []
    with llmspans.turn("chat"):
        search()
    assert sorted(span.attributes[names.STAGE] for span in captured.spans) == ["retrieval", "turn"]


def test_a_limiter_still_admits_and_holds_a_suppressed_stream(
    server: SimulatedServer, captured: Captured
) -> None:
    lane = llmspans.Limiter(1, name="lane")
    client = llmspans.instrument(
        openai.OpenAI(base_url=server.base_url, api_key="sk-test", max_retries=0), limiter=lane
    )
    app_spans = InMemorySpanExporter()
    app_provider = TracerProvider()
    app_provider.add_span_processor(SimpleSpanProcessor(app_spans))
    with suppressed():
        stream = client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        next(iter(stream))
        assert lane.in_flight == 1  # the slot is held until the stream is over, as without the switch
        list(stream)
        assert lane.in_flight == 0
        with app_provider.get_tracer("app").start_as_current_span("app work"), lane:
            assert lane.in_flight == 1
    assert lane.in_flight == 0
    (app_work,) = app_spans.get_finished_spans()
    assert not app_work.events  # the `with limiter:` form stamps no admission on the app's span
    assert not app_work.attributes
    assert captured.spans == []
    assert recorded_points(captured) == []
    with app_provider.get_tracer("app").start_as_current_span("app work"), lane:
        pass
    assert [event.name for event in app_spans.get_finished_spans()[-1].events] == [names.EVENT_ADMITTED]
