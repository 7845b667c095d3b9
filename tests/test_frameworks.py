"""The README's Frameworks lines, against the real frameworks (installed from PyPI by the `frameworks` extra)
talking to the local simulated server: one call span per logical call with its buckets and outcome, the
frameworks' calls nesting in turns and stages, nothing left open, and no framework internals touched.

Each test instruments the openai classes (the one line), builds the framework's object as an app does,
and uninstruments the classes at the end.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from typing import Any

import openai
import pytest

import llmspans
from llmspans import _names as names
from llmspans.testing import Captured
from llmspans.tools.simulator import Behavior, SimulatedServer
from tests.timing import assert_buckets_sum_to_duration

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # LiteLLM: no cost map from the internet
os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")  # the Agents SDK: no trace upload to OpenAI

SERVER_BEHAVIOR = Behavior(chunks=5, chunk_gap=0.005, usage="auto")


@pytest.fixture(autouse=True)
def classes_instrumented() -> Iterator[None]:
    llmspans.instrument_all()  # the README's one line
    yield
    llmspans.uninstrument_all()


def calls(captured: Captured) -> list[Any]:
    return [s for s in captured.spans if (s.attributes or {}).get(names.STAGE) == names.STAGE_LLM]


def check_call(span: Any, *, streamed: bool, outcome: str = "completed") -> None:
    attributes = span.attributes
    assert (names.GEN_AI_REQUEST_STREAM in attributes) is streamed
    if streamed:
        assert attributes[names.STREAM_OUTCOME] == outcome
        if outcome == "completed":
            assert attributes[names.STREAM_CHUNKS] == 5
    assert_buckets_sum_to_duration(span)


# --- LangChain ------------------------------------------------------------------------------------------


async def test_langchain_chat_openai_invoke_stream_ainvoke_astream(
    server: SimulatedServer, captured: Captured
) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="tiny", base_url=server.base_url, api_key="x", max_retries=0)
    with llmspans.turn("langchain"):
        assert llm.invoke("hi").content
        assert "".join(str(chunk.content) for chunk in llm.stream("hi"))
        assert (await llm.ainvoke("hi")).content
        assert "".join([str(chunk.content) async for chunk in llm.astream("hi")])
    spans = calls(captured)
    assert [span.name for span in spans] == ["chat tiny"] * 4
    for span, streamed in zip(spans, (False, True, False, True), strict=True):
        check_call(span, streamed=streamed)
    (turn,) = [s for s in captured.spans if s.name == "turn langchain"]
    assert all(span.parent.span_id == turn.context.span_id for span in spans)


def test_langchain_with_the_responses_api(server: SimulatedServer, captured: Captured) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model="tiny", base_url=server.base_url, api_key="x", max_retries=0, use_responses_api=True
    )
    assert llm.invoke("hi").content
    assert "".join(str(chunk.content) for chunk in llm.stream("hi"))
    spans = calls(captured)
    assert [span.name for span in spans] == ["chat tiny"] * 2
    check_call(spans[0], streamed=False)
    check_call(spans[1], streamed=True)


def test_langchain_retries_are_one_call(server: SimulatedServer, captured: Captured) -> None:
    from langchain_openai import ChatOpenAI

    server.enqueue(Behavior(status=503, retry_after_ms=1))
    llm = ChatOpenAI(model="tiny", base_url=server.base_url, api_key="x", max_retries=2)
    assert llm.invoke("hi").content
    (span,) = calls(captured)
    assert span.attributes[names.RETRY_COUNT] == 1
    assert list(span.attributes[names.RETRY_CAUSES]) == ["http_503"]


# --- the OpenAI Agents SDK ----------------------------------------------------------------------------


def _agent(server: SimulatedServer) -> Any:
    from agents import Agent, OpenAIChatCompletionsModel

    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    return Agent(name="helper", instructions="Be brief.", model=OpenAIChatCompletionsModel("tiny", client))


async def test_agents_sdk_run_run_streamed_and_cancel(server: SimulatedServer, captured: Captured) -> None:
    from agents import Runner

    agent = _agent(server)
    with llmspans.turn("agent"):
        result = await Runner.run(agent, "hi")
        assert result.final_output
        streamed = Runner.run_streamed(agent, "hi")
        async for _event in streamed.stream_events():
            pass
        assert streamed.final_output
    spans = calls(captured)
    assert len(spans) == 2
    check_call(spans[0], streamed=False)
    check_call(spans[1], streamed=True)
    captured.clear()
    server.default = Behavior(chunks=50, chunk_gap=0.02)
    cancelled = Runner.run_streamed(agent, "hi")
    async for event in cancelled.stream_events():
        if event.type == "raw_response_event":
            cancelled.cancel()  # the app stops the run mid-stream
    await asyncio.sleep(0.05)
    (span,) = calls(captured)  # ended, not left open
    assert span.attributes[names.STREAM_OUTCOME] in ("abandoned", "cancelled")
    assert span.attributes[names.STREAM_CHUNKS] < 50


# --- LiteLLM ------------------------------------------------------------------------------------------


async def test_litellm_completion_acompletion_and_embeddings(
    server: SimulatedServer, captured: Captured
) -> None:
    import litellm

    common: dict[str, Any] = {"api_base": server.base_url, "api_key": "x", "max_retries": 0}
    messages = [{"role": "user", "content": "hi"}]
    assert litellm.completion(model="openai/tiny", messages=messages, **common).choices[0].message.content
    for _chunk in litellm.completion(model="openai/tiny", messages=messages, stream=True, **common):
        pass
    assert (await litellm.acompletion(model="openai/tiny", messages=messages, **common)).choices
    assert litellm.embedding(model="openai/emb", input=["a b"], **common).data
    spans = calls(captured)
    assert [span.name for span in spans] == ["chat tiny", "chat tiny", "chat tiny", "embeddings emb"]
    check_call(spans[0], streamed=False)
    check_call(spans[1], streamed=True)
    check_call(spans[2], streamed=False)
