"""Instrumented openai clients against the simulated server, and the call span they make (shared by the
tests of the SDK adapter, the stream interceptor, the transport and `instrument()`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import openai

import llmspans
from llmspans import _names as names
from llmspans.testing import Captured
from llmspans.tools.simulator import SimulatedServer

SECRET = "sk-test-SECRET-key-123"
PROMPT = "tell me the PRIVATE-PROMPT words"
MESSAGES = [{"role": "user", "content": PROMPT}]


def sync_client(
    server: SimulatedServer, instrument: dict[str, Any] | None = None, **kwargs: Any
) -> openai.OpenAI:
    """An instrumented `openai.OpenAI` (`instrument` holds `llmspans.instrument()`'s own arguments)."""
    return _instrumented(openai.OpenAI, server, instrument, kwargs)


def async_client(
    server: SimulatedServer, instrument: dict[str, Any] | None = None, **kwargs: Any
) -> openai.AsyncOpenAI:
    return _instrumented(openai.AsyncOpenAI, server, instrument, kwargs)


def _instrumented(
    cls: Any, server: SimulatedServer, instrument: dict[str, Any] | None, kwargs: dict[str, Any]
) -> Any:
    kwargs.setdefault("max_retries", 2)
    return llmspans.instrument(cls(base_url=server.base_url, api_key=SECRET, **kwargs), **(instrument or {}))


def call_span(captured: Captured) -> Any:
    spans = [s for s in captured.spans if (s.attributes or {}).get(names.STAGE) == "llm"]
    assert len(spans) == 1, [s.name for s in captured.spans]
    return spans[0]


async def aiter_list(stream: AsyncIterator[Any]) -> list[Any]:
    return [item async for item in stream]


async def read_through(result: Any, stream: bool, use_async: bool) -> None:
    """Await a sync or async client's `create()` result and, for a stream, read it to its end (the call
    span ends there), so one code path serves the sync and async clients alike."""
    result = await result if use_async else result
    if not stream:
        return
    if use_async:
        async for _ in result:
            pass
    else:
        for _ in result:
            pass


def outcome(captured: Captured) -> str:
    """The one call span's stream outcome."""
    return str(call_span(captured).attributes[names.STREAM_OUTCOME])
