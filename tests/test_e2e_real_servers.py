"""End to end against real servers: a real inference server and a real OTLP backend.

`transformers serve` runs a tiny random Llama made locally (no downloads): the openai SDK
streams from it through llmspans, and the call span must describe what the server really
sent (role chunk first, one token per chunk, usage in the finish chunk, no `[DONE]`).
Arize Phoenix receives llmspans' export over OTLP/HTTP and OTLP/gRPC from a separate
process configured with `llmspans.configure(endpoint=...)`, and the spans are read back
through its REST API. Skipped locally without LLMSPANS_REAL_SERVERS_DIR; failed in CI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from typing import Any

import openai
import pytest

import llmspans
from llmspans import _names as names
from llmspans.testing import Captured
from tests.support.realservers import PhoenixServer, TransformersServer, flatten

MAX_TOKENS = 8


def llm_span(captured: Captured) -> Any:
    (span,) = [s for s in captured.spans if (s.attributes or {}).get(names.STAGE) == "llm"]
    return span


def check_real_stream(span: Any, server: TransformersServer) -> None:
    attrs = span.attributes
    assert span.name == f"chat {server.model}"
    assert attrs[names.STREAM_OUTCOME] == "completed"
    assert attrs[names.STREAM_CHUNKS] == MAX_TOKENS  # the role-only and finish chunks are not tokens
    assert attrs[names.GEN_AI_USAGE_OUTPUT_TOKENS] == MAX_TOKENS  # read from the finish chunk
    assert attrs[names.GEN_AI_USAGE_INPUT_TOKENS] > 0
    assert list(attrs[names.GEN_AI_RESPONSE_FINISH_REASONS]) == ["length"]
    assert attrs[names.GEN_AI_RESPONSE_MODEL].startswith(server.model)
    # A real CPU model: tens of ms to the first token, a few ms per token; nothing negative or absurd.
    assert 0 < attrs[names.BUCKET_PREFIX + "first_token"] < 2.0
    assert 0 < attrs[names.BUCKET_PREFIX + "stream"] < 2.0
    assert 0 < attrs[names.ITL_P50] <= attrs[names.ITL_MAX] < 1.0
    assert attrs[names.OUTPUT_TOKENS_PER_SECOND] > 0
    total = sum(attrs[a] for a in names.BUCKET_ATTRIBUTES)
    assert total == pytest.approx((span.end_time - span.start_time) * 1e-9, abs=2e-6)


def instrumented(cls: Any, server: TransformersServer) -> Any:
    """An instrumented openai client (`openai.OpenAI` or `openai.AsyncOpenAI`) of the real server, no retries."""
    return llmspans.instrument(cls(base_url=server.base_url, api_key="x", max_retries=0))


def say_hello(server: TransformersServer, **fields: Any) -> dict[str, Any]:
    """A greedy (temperature 0) chat request to the server's model, with `fields` added."""
    return {
        "model": server.model,
        "messages": [{"role": "user", "content": "Say hello"}],
        "temperature": 0,
        **fields,
    }


def test_openai_sdk_streams_from_transformers_serve(
    transformers_serve: TransformersServer, captured: Captured
) -> None:
    client = instrumented(openai.OpenAI, transformers_serve)
    stream = client.chat.completions.create(
        **say_hello(transformers_serve, stream=True, max_tokens=MAX_TOKENS)
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    check_real_stream(llm_span(captured), transformers_serve)
    assert [s.name for s in captured.spans if s.name == "POST"] == []  # one attempt: on the call span
    assert llm_span(captured).attributes[names.HTTP_RESPONSE_STATUS_CODE] == 200


async def test_async_openai_sdk_against_transformers_serve(
    transformers_serve: TransformersServer, captured: Captured
) -> None:
    client = instrumented(openai.AsyncOpenAI, transformers_serve)
    stream = await client.chat.completions.create(
        **say_hello(transformers_serve, stream=True, max_tokens=MAX_TOKENS)
    )
    async for _ in stream:
        pass
    check_real_stream(llm_span(captured), transformers_serve)


def test_non_streamed_call_to_transformers_serve(
    transformers_serve: TransformersServer, captured: Captured
) -> None:
    client = instrumented(openai.OpenAI, transformers_serve)
    result = client.chat.completions.create(**say_hello(transformers_serve, max_tokens=4))
    attrs = llm_span(captured).attributes
    assert attrs[names.GEN_AI_USAGE_OUTPUT_TOKENS] == result.usage.completion_tokens == 4
    assert attrs[names.BUCKET_PREFIX + "first_token"] > 0
    assert attrs[names.BUCKET_PREFIX + "stream"] == 0


CHILD = """
import llmspans
from llmspans.tools.simulator import Behavior, SimulatedServer
import openai
llmspans.configure(service_name="e2e", endpoint={endpoint!r}, protocol={protocol!r}, attempt_spans="always")
with SimulatedServer(Behavior(chunks=3, usage="finish")) as server:
    client = llmspans.instrument(openai.OpenAI(base_url=server.base_url, api_key="sk-never-exported"))
    with llmspans.turn("chat"):
        list(client.chat.completions.create(model="sim", messages=[{{"role": "user", "content": "hi"}}], stream=True))
"""


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_configure_exports_to_a_real_otlp_backend(phoenix: PhoenixServer, protocol: str) -> None:
    project = f"llmspans-{uuid.uuid4().hex[:8]}"
    endpoint = phoenix.http_endpoint if protocol == "http/protobuf" else phoenix.grpc_endpoint
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLMSPANS_"))}
    env["OTEL_RESOURCE_ATTRIBUTES"] = f"openinference.project.name={project}"
    code = textwrap.dedent(CHILD).format(endpoint=endpoint, protocol=protocol)
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    spans = phoenix.wait_for_spans(project, lambda found: len(found) >= 3, timeout=20)
    by_name = {span["name"]: span for span in spans}
    assert set(by_name) == {"turn chat", "chat sim", "POST"}
    turn, call, attempt = by_name["turn chat"], by_name["chat sim"], by_name["POST"]
    assert call["parent_id"] == turn["context"]["span_id"]
    assert attempt["parent_id"] == call["context"]["span_id"]
    flat = flatten(call["attributes"])
    assert flat["gen_ai.request.model"] == "sim"
    assert flat["gen_ai.usage.output_tokens"] == 3
    assert flat["llmspans.stream.chunks"] == 3
    assert isinstance(flat["llmspans.bucket.first_token"], float)
    assert flat["llmspans.connect.reused"] is False
    assert flat["llmspans.stream.outcome"] == "completed"
    assert {event["name"] for event in call["events"]} >= {"llmspans.first_token", "llmspans.last_token"}
    assert "sk-never-exported" not in str(spans)


WHERE_TIME_WENT = """
import llmspans
from llmspans.tools.simulator import Behavior, SimulatedServer
import openai
llmspans.configure(service_name={project!r}, endpoint={endpoint!r}, slow_after=0.2, openinference=True,
                   capture_content=True)
messages = [{{"role": "user", "content": "hi"}}]
with SimulatedServer(Behavior(chunks=4, usage="finish")) as server:
    client = llmspans.instrument(openai.OpenAI(base_url=server.base_url, api_key="x"))
    server.default = Behavior(first_chunk_delay=0.5, chunk_gap=0.01, chunks=4, usage="finish")
    with llmspans.turn("slow-prefill"):
        list(client.chat.completions.create(model="sim", messages=messages, stream=True))
    server.default = Behavior(chunks=4, usage="finish")
    server.enqueue(Behavior(status=429, retry_after_ms=300))
    with llmspans.turn("retries"):
        client.chat.completions.create(model="sim", messages=messages)
"""


def test_phoenix_shows_where_the_time_went(phoenix: PhoenixServer) -> None:
    """A slow-prefill call and a retried call exported to Phoenix and read back through its API: the phase
    spans under each call with durations that add up to its buckets, the retry event, the dominant bucket,
    OpenInference's kinds on the turns, and the output messages Phoenix accepts."""
    project = f"llmspans-{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLMSPANS_"))}
    code = textwrap.dedent(WHERE_TIME_WENT).format(project=project, endpoint=phoenix.http_endpoint)
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    # In the project named after the service: configure(openinference=True) set openinference.project.name.
    spans = phoenix.wait_for_spans(project, lambda found: len(found) >= 10, timeout=20)
    by_id = {span["context"]["span_id"]: span for span in spans}
    calls = [span for span in spans if flatten(span["attributes"]).get("llmspans.stage") == "llm"]
    assert len(calls) == 2
    for call in calls:
        flat = flatten(call["attributes"])
        turn = by_id[call["parent_id"]]
        assert turn["span_kind"] == "CHAIN"  # openinference.span.kind, which Phoenix lifts off the attributes
        phases = [
            s
            for s in spans
            if s["parent_id"] == call["context"]["span_id"] and "phase" in str(s["attributes"])
        ]
        per_bucket: dict[str, float] = {}
        for phase in phases:
            bucket_name = flatten(phase["attributes"])["llmspans.phase"]
            per_bucket[bucket_name] = per_bucket.get(bucket_name, 0.0) + _seconds(phase)
        if turn["name"] == "turn slow-prefill":
            assert flat["llmspans.bucket.dominant"] == "first_token"
            assert "waiting for the first token" in {phase["name"] for phase in phases}
            assert per_bucket["first_token"] == pytest.approx(flat["llmspans.bucket.first_token"], abs=2e-3)
            assert per_bucket["stream"] == pytest.approx(flat["llmspans.bucket.stream"], abs=2e-3)
            output = json.loads(flat["gen_ai.output.messages"])
            assert output[0]["finish_reason"] == "stop"
            # Phoenix accepted the messages (the schema wants finish_reason): its Output panel reads these.
            assert call["span_kind"] == "LLM"
            assert flat["llm.output_messages.0.message.content"] == output[0]["parts"][0]["content"]
            assert flat["llm.output_messages.0.message.finish_reason"] == "stop"
        else:
            assert flat["llmspans.bucket.dominant"] == "retry"
            (backoff,) = [phase for phase in phases if phase["name"] == "backing off after http_429"]
            assert 0.3 - 0.01 <= _seconds(backoff) <= 0.3 + 0.1
            (retry,) = [event for event in call["events"] if event["name"] == "llmspans.retry"]
            assert flatten(retry["attributes"])["llmspans.retry.cause"] == "http_429"


def _seconds(span: dict[str, Any]) -> float:
    from datetime import datetime

    start, end = (
        datetime.fromisoformat(span[key].replace("Z", "+00:00")) for key in ("start_time", "end_time")
    )
    return (end - start).total_seconds()
