"""The recorded chat conversations against the official `opentelemetry-instrumentation-openai-v2`.

Both instrument the same openai client on the same call (llmspans the client, openai-v2 the SDK's
`create`), over the recorded interactions of tests/data/openai: where both record a message, the JSON
is the same but for the differences llmspans keeps on purpose, each undone here by one named rule and
listed with its reason in docs/telemetry.md ("Compared with opentelemetry-instrumentation-openai-v2").
openai-v2 (2.4b0, with `opentelemetry-util-genai` 1.1b0, both in the dev extra) instruments chat
completions only: the Responses API cases have no reference.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from opentelemetry.instrumentation.openai_v2 import OpenAIInstrumentor
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import llmspans
from llmspans import _names as names
from llmspans import _telemetry
from tests.support import recorded
from tests.support.openai_clients import read_through
from tests.support.recorded import ReplayServer

CHAT_CASES = [name for name in recorded.names() if not name.startswith("responses_")]
MESSAGES = (names.GEN_AI_INPUT_MESSAGES, names.GEN_AI_OUTPUT_MESSAGES)
REFUSALS = {"chat_refusal": "I'm sorry, I can't help with that.", "chat_refusal_stream": "I'm sorry, I can't help with that."}  # fmt: skip


@pytest.fixture(scope="module")
def replay() -> Iterator[ReplayServer]:
    with recorded.replaying() as server:
        yield server


@pytest.fixture
def both(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    """llmspans and openai-v2 recording into one in-memory exporter, openai-v2 with content on spans."""
    monkeypatch.setenv("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "SPAN_ONLY")
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    meter_provider = MeterProvider()
    # llmspans stamps the SDK's entry points once per process; first, so openai-v2 wraps on top of it.
    llmspans.instrument(openai.OpenAI(api_key="sk-test")).close()
    reference = OpenAIInstrumentor()
    reference.instrument(tracer_provider=tracer_provider, meter_provider=meter_provider)
    try:
        with _telemetry.use_providers(tracer_provider, meter_provider):
            yield exporter
    finally:
        reference.uninstrument()
        tracer_provider.shutdown()
        meter_provider.shutdown()


def as_openai_v2_records(name: str, attribute: str, ours: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Our messages with each difference we keep on purpose undone (docs/telemetry.md lists them)."""
    messages = copy.deepcopy(ours)
    for message in messages:
        parts = message["parts"]
        # 1. The output schema's finish reason is `tool_call`; openai-v2 keeps OpenAI's `tool_calls`.
        if message.get("finish_reason") == "tool_call":
            message["finish_reason"] = "tool_calls"
        # 2. openai-v2 records no reasoning (vLLM's `reasoning`, DeepSeek's `reasoning_content`).
        parts[:] = [part for part in parts if part["type"] != "reasoning"]
        # 3. openai-v2 records a refusal as no part at all; llmspans as the text the model said.
        if attribute == names.GEN_AI_OUTPUT_MESSAGES and name in REFUSALS:
            parts[:] = [part for part in parts if part != {"type": "text", "content": REFUSALS[name]}]
        # 4. openai-v2 records a message whose content is a list of parts (text, images, audio) with no
        #    parts; llmspans records each (media as `uri`/`blob` parts).
        if any(part["type"] in ("uri", "blob", "file") for part in parts):
            parts[:] = []
        # 5. A tool result given as a list of text parts: openai-v2 keeps the API's parts
        #    ({"type": "text", "text": ...}), llmspans writes them as the conventions' text parts.
        for part in parts:
            if part["type"] == "tool_call_response" and isinstance(part["response"], list):
                part["response"] = [{"type": "text", "text": item["content"]} for item in part["response"]]
    return messages


@pytest.mark.parametrize("name", CHAT_CASES)
@pytest.mark.parametrize("use_async", [False, True])
async def test_llmspans_records_what_openai_v2_records_but_for_the_listed_differences(
    name: str, use_async: bool, replay: ReplayServer, both: InMemorySpanExporter
) -> None:
    recording = replay.play(recorded.load(name))
    client: Any = (openai.AsyncOpenAI if use_async else openai.OpenAI)(
        base_url=replay.base_url, api_key="sk-test", max_retries=0
    )
    llmspans.instrument(client, capture_content=True)
    try:
        result = client.chat.completions.create(**recording.request)
        await read_through(result, bool(recording.request.get("stream")), use_async)
    except openai.APIStatusError:
        assert recording.status >= 400
    finally:
        await client.close() if use_async else client.close()
    spans = {span.instrumentation_scope.name: span.attributes for span in both.get_finished_spans()}
    ours = spans.pop(names.INSTRUMENTATION_NAME)
    (theirs,) = spans.values()
    for attribute in MESSAGES:
        assert (attribute in ours) == (attribute in theirs), attribute  # both record it, or neither
        if attribute in ours:
            expected = as_openai_v2_records(name, attribute, json.loads(ours[attribute]))
            assert expected == json.loads(theirs[attribute]), attribute
    assert names.GEN_AI_SYSTEM_INSTRUCTIONS not in ours  # chat system/developer messages are input messages
    if recording.status >= 400:
        assert names.GEN_AI_OUTPUT_MESSAGES not in ours
