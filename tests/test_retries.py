"""The openai SDK's retries grouped into one call when only its `http_client` is instrumented
(llmspans/_retries.py), over real HTTP against the simulator, sync and async."""

from __future__ import annotations

import time
from typing import Any

import openai
import pytest

import llmspans
from llmspans import _names as names
from llmspans.testing import Captured
from llmspans.tools.simulator import Behavior, SimulatedServer
from tests.support.openai_clients import MESSAGES
from tests.timing import assert_buckets_sum_to_duration, bucket


def calls(captured: Captured) -> list[Any]:
    return [s for s in captured.spans if (s.attributes or {}).get(names.STAGE) == names.STAGE_LLM]


def sdk_over_a_plain_client(server: SimulatedServer, use_async: bool, **kwargs: Any) -> Any:
    """An SDK client whose own http client alone is instrumented (a framework's client, say)."""
    if use_async:
        http = llmspans.instrument(openai.DefaultAsyncHttpxClient())
        return openai.AsyncOpenAI(base_url=server.base_url, api_key="x", http_client=http, **kwargs)
    http = llmspans.instrument(openai.DefaultHttpxClient())
    return openai.OpenAI(base_url=server.base_url, api_key="x", http_client=http, **kwargs)


async def create(client: Any, use_async: bool) -> Any:
    result = client.chat.completions.create(model="tiny", messages=MESSAGES)
    return await result if use_async else result


@pytest.mark.parametrize("use_async", [False, True])
async def test_the_sdks_retries_are_one_call(
    server: SimulatedServer, captured: Captured, use_async: bool
) -> None:
    server.enqueue(Behavior(status=429, retry_after_ms=80), Behavior(status=503, retry_after_ms=40))
    client = sdk_over_a_plain_client(server, use_async, max_retries=2)
    await create(client, use_async)
    (span,) = calls(captured)
    attributes = span.attributes
    assert attributes[names.RETRY_COUNT] == 2
    assert list(attributes[names.RETRY_CAUSES]) == ["http_429", "http_503"]
    assert attributes[names.HTTP_RESPONSE_STATUS_CODE] == 200
    assert bucket(span, "retry") >= 0.12  # both back-offs, and the failed attempts
    assert_buckets_sum_to_duration(span)
    attempts = [s for s in captured.spans if names.HTTP_REQUEST_METHOD in (s.attributes or {})]
    assert [a.attributes.get(names.HTTP_REQUEST_RESEND_COUNT) for a in attempts] == [None, 1, 2]


@pytest.mark.parametrize("use_async", [False, True])
async def test_retries_used_up_end_the_call_where_its_last_attempt_ended(
    server: SimulatedServer, captured: Captured, use_async: bool
) -> None:
    server.enqueue(*[Behavior(status=503, retry_after_ms=1)] * 2)
    client = sdk_over_a_plain_client(server, use_async, max_retries=1)
    started = time.time_ns()
    with pytest.raises(openai.InternalServerError):
        await create(client, use_async)
    failed_at = time.time_ns()
    await create(client, use_async)  # the next call in this thread or task: the held one ends now
    first, second = calls(captured)
    assert first.attributes[names.RETRY_COUNT] == 1
    assert first.attributes[names.ERROR_TYPE] == "503"
    assert started <= first.start_time
    assert first.end_time <= failed_at
    assert names.RETRY_COUNT not in second.attributes


def test_without_a_retry_the_held_call_ends_at_its_deadline(
    server: SimulatedServer, captured: Captured
) -> None:
    server.enqueue(Behavior(status=503, retry_after_ms=1))
    client = sdk_over_a_plain_client(server, False, max_retries=0)  # the SDK still says retry count 0
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model="tiny", messages=MESSAGES)
    ended = time.time_ns()
    deadline = time.monotonic() + 5  # retry-after 1 ms: held for at most 2 s
    while not calls(captured) and time.monotonic() < deadline:
        time.sleep(0.05)
    (span,) = calls(captured)
    assert span.end_time <= ended
    assert span.attributes[names.ERROR_TYPE] == "503"


def test_a_plain_client_with_a_limiter_keeps_each_attempt_a_call(
    server: SimulatedServer, captured: Captured
) -> None:
    server.enqueue(Behavior(status=429, retry_after_ms=1))
    http = llmspans.instrument(openai.DefaultHttpxClient(), limiter=llmspans.Limiter(1, name="plain"))
    client = openai.OpenAI(base_url=server.base_url, api_key="x", http_client=http, max_retries=1)
    client.chat.completions.create(model="tiny", messages=MESSAGES)
    assert [s.attributes.get(names.HTTP_RESPONSE_STATUS_CODE) for s in calls(captured)] == [429, 200]


async def test_a_cancelled_attempt_is_not_held_for_a_retry(
    server: SimulatedServer, captured: Captured
) -> None:
    """A cancellation is not something the SDK retries: the call ends at once, not at the hold's deadline."""
    import asyncio

    server.default = Behavior(header_delay=1.0)
    client = sdk_over_a_plain_client(server, True, max_retries=2)
    task = asyncio.ensure_future(create(client, True))
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    (span,) = calls(captured)
    assert span.attributes[names.ERROR_TYPE] == "CancelledError"
