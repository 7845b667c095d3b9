"""The stream interceptor (`llmspans/_stream.py`): every way a stream ends ends its call, once."""

from __future__ import annotations

import asyncio
import gc

import httpx
import openai
import pytest

from llmspans import _names as names
from llmspans.testing import Captured
from llmspans.tools.simulator import Behavior, SimulatedServer
from tests.support.openai_clients import MESSAGES, SECRET, async_client, call_span, outcome, sync_client
from tests.timing import (
    attempt_spans,
)


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
