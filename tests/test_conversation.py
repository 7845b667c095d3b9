"""The recorded conversation (`llmspans/_conversation.py`, `llmspans/_content.py`): what the call span
says was asked and answered is the conversation, as the GenAI conventions' message schema spells it.

Every case is a recorded interaction in the real API's shapes (tests/data/openai), replayed over HTTP on
127.0.0.1 to all six clients: the openai SDK sync and async, and plain httpx/httpx2 clients sync and async.
Each asserts the exact JSON of `gen_ai.input.messages`, `gen_ai.output.messages` and
`gen_ai.system_instructions`, and that the app saw exactly what it sees uninstrumented. The same chat
cases through the official `opentelemetry-instrumentation-openai-v2` are in
tests/test_conversation_reference.py.
"""

from __future__ import annotations

import gc
import importlib
import json
import tracemalloc
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import llmspans
from llmspans import _content, _telemetry
from llmspans import _names as names
from llmspans._conversation import OutputMessages
from llmspans.testing import Captured
from tests.support import recorded
from tests.support.recorded import Recording, ReplayServer

KINDS = ["openai.OpenAI", "openai.AsyncOpenAI", "httpx.Client", "httpx.AsyncClient", "httpx2.Client", "httpx2.AsyncClient"]  # fmt: skip
CONTENT = (names.GEN_AI_INPUT_MESSAGES, names.GEN_AI_OUTPUT_MESSAGES, names.GEN_AI_SYSTEM_INSTRUCTIONS)


@pytest.fixture(scope="module")
def replay() -> Iterator[ReplayServer]:
    with recorded.replaying() as server:
        yield server


# --- calling: what the app sees ------------------------------------------------------------------


async def call(kind: str, server: ReplayServer, recording: Recording, capture: Any = None) -> Any:
    """Make the recorded request with a client of `kind` (instrumented when `capture` is not None) and
    return what the app got, as plain data: the SDK's objects dumped, a plain client's status and body."""
    library, _, class_name = kind.partition(".")
    is_async = class_name.startswith("Async")
    body = recording.request
    if library == "openai":
        client = getattr(openai, class_name)(base_url=server.base_url, api_key="sk-test", max_retries=0)
        if capture is not None:
            llmspans.instrument(client, capture_content=capture)
        resource = client.responses if recording.path.endswith("/responses") else client.chat.completions
        try:
            result = await resource.create(**body) if is_async else resource.create(**body)
            if body.get("stream"):
                items = [item async for item in result] if is_async else list(result)
                return [item.model_dump() for item in items]
            return result.model_dump()
        except openai.APIStatusError as error:
            return type(error).__name__, error.status_code, error.body
        finally:
            await client.close() if is_async else client.close()
    module = importlib.import_module(library)
    http = getattr(module, class_name)(base_url=server.base_url)
    if capture is not None:
        llmspans.instrument(http, capture_content=capture)
    path = recording.path[len("/v1") :]
    try:
        if is_async:
            async with http.stream("POST", path, json=body) as response:
                return response.status_code, b"".join([piece async for piece in response.aiter_bytes()])
        with http.stream("POST", path, json=body) as response:
            return response.status_code, response.read()
    finally:
        await http.aclose() if is_async else http.close()


def call_span(captured: Captured) -> Any:
    spans = [s for s in captured.spans if (s.attributes or {}).get(names.STAGE) == "llm"]
    assert len(spans) == 1, [s.name for s in captured.spans]
    return spans[0]


def content(span: Any) -> dict[str, Any]:
    """The span's content attributes, parsed (absent ones left out)."""
    attributes = span.attributes
    return {key: json.loads(attributes[key]) for key in CONTENT if key in attributes}


def text(content: str) -> dict[str, Any]:
    return {"type": "text", "content": content}


def user(content: str) -> dict[str, Any]:
    return {"role": "user", "parts": [text(content)]}


def answer(*parts: dict[str, Any], finish: str = "stop") -> dict[str, Any]:
    return {"role": "assistant", "parts": list(parts), "finish_reason": finish}


def tool_call(call_id: str, city: str) -> dict[str, Any]:
    return {"type": "tool_call", "id": call_id, "name": "get_weather", "arguments": {"location": city}}


# --- what each recording must record --------------------------------------------------------------

SYSTEM = {"role": "system", "parts": [text("You are a helpful assistant.")]}
PARIS = "What's the weather like in Paris today?"
TWO_CITIES = "What's the weather like in Paris and in Tokyo?"
LOCK = "Give me step-by-step instructions to pick a lock."
REFUSAL = "I'm sorry, I can't help with that."
PRIME = "Is 17 a prime number?"
THOUGHT = "Okay, the user asks whether 17 is prime. It is not divisible by 2, 3 or 4."
STRAWBERRY = "How many r's are in the word strawberry?"
SUMMARY = "**Counting letters**\n\nThe word strawberry is s-t-r-a-w-b-e-r-r-y: one r after the t and two before the y, so three."  # fmt: skip
BOARDWALK = "https://upload.wikimedia.org/wikipedia/commons/thumb/d/dd/Gfp-wisconsin-madison-the-nature-boardwalk.jpg/2560px-Gfp-wisconsin-madison-the-nature-boardwalk.jpg"  # fmt: skip
PAST_CALLS = [
    tool_call("call_8nQe2VbXwT5mK0rJ4yH7sL1d", "Paris, France"),
    tool_call("call_Zp6fT3uW9aE2qR8kM5nB0xC4", "Tokyo, Japan"),
]

EXPECTED: dict[str, dict[str, Any]] = {
    "chat_n2": {
        names.GEN_AI_INPUT_MESSAGES: [SYSTEM, user("Say this is a test")],
        names.GEN_AI_OUTPUT_MESSAGES: [
            answer(text("This is a test. How can I assist you further?")),
            answer(text("This is a test.")),
        ],
    },
    "chat_n2_stream": {  # interleaved deltas; choice 1 finishes first, choice 0 on max_tokens
        names.GEN_AI_INPUT_MESSAGES: [SYSTEM, user("What's the weather in Paris right now?")],
        names.GEN_AI_OUTPUT_MESSAGES: [
            answer(text("I'm unable to provide real-time weather updates."), finish="length"),
            answer(text("I'm unable to browse the internet.")),
        ],
    },
    "chat_tool_call": {
        names.GEN_AI_INPUT_MESSAGES: [user(PARIS)],
        names.GEN_AI_OUTPUT_MESSAGES: [
            answer(tool_call("call_DdmO9pD3xa9XTPNJ32zg2hcA", "Paris, France"), finish="tool_call")
        ],
    },
    "chat_tool_call_stream": {
        names.GEN_AI_INPUT_MESSAGES: [user(PARIS)],
        names.GEN_AI_OUTPUT_MESSAGES: [
            answer(tool_call("call_3kYb8GmRq2ZxWnV1pT0sL9cJ", "Paris, France"), finish="tool_call")
        ],
    },
    "chat_two_tool_calls": {
        names.GEN_AI_INPUT_MESSAGES: [user(TWO_CITIES)],
        names.GEN_AI_OUTPUT_MESSAGES: [answer(*PAST_CALLS, finish="tool_call")],
    },
    "chat_two_tool_calls_stream": {
        names.GEN_AI_INPUT_MESSAGES: [user(TWO_CITIES)],
        names.GEN_AI_OUTPUT_MESSAGES: [
            answer(
                tool_call("call_Qw3eR5tY7uI9oP1aS3dF5gH7", "Paris, France"),
                tool_call("call_Jk2lZ4xC6vB8nM0qW2eR4tY6", "Tokyo, Japan"),
                finish="tool_call",
            )
        ],
    },
    "chat_tool_result": {  # a developer message stays in the conversation: no system instructions
        names.GEN_AI_INPUT_MESSAGES: [
            {"role": "developer", "parts": [text("Answer in one sentence.")]},
            user(TWO_CITIES),
            {"role": "assistant", "parts": PAST_CALLS},
            {
                "role": "tool",
                "parts": [
                    {
                        "type": "tool_call_response",
                        "id": "call_8nQe2VbXwT5mK0rJ4yH7sL1d",
                        "response": '{"temperature": 18, "unit": "celsius", "conditions": "light rain"}',
                    }
                ],
            },
            {
                "role": "tool",
                "parts": [
                    {
                        "type": "tool_call_response",
                        "id": "call_Zp6fT3uW9aE2qR8kM5nB0xC4",
                        "response": [text("24 °C, clear")],
                    }
                ],
            },
        ],
        names.GEN_AI_OUTPUT_MESSAGES: [
            answer(text("It's 18 °C with light rain in Paris and a clear 24 °C in Tokyo."))
        ],
    },
    "chat_refusal": {
        names.GEN_AI_INPUT_MESSAGES: [user(LOCK)],
        names.GEN_AI_OUTPUT_MESSAGES: [answer(text(REFUSAL))],
    },
    "chat_refusal_stream": {
        names.GEN_AI_INPUT_MESSAGES: [user(LOCK)],
        names.GEN_AI_OUTPUT_MESSAGES: [answer(text(REFUSAL))],
    },
    "chat_multimodal": {  # the bytes of inline media are left out with capture_content=True
        names.GEN_AI_INPUT_MESSAGES: [
            {
                "role": "user",
                "parts": [
                    text("What do these show and say?"),
                    {"type": "uri", "modality": "image", "uri": BOARDWALK},
                    {"type": "blob", "modality": "image", "mime_type": "image/png", "content": ""},
                    {"type": "blob", "modality": "audio", "mime_type": "audio/wav", "content": ""},
                ],
            }
        ],
        names.GEN_AI_OUTPUT_MESSAGES: [
            answer(text("A wooden boardwalk through green grass, a single pixel, and a moment of silence."))
        ],
    },
    # A failed call: what was asked, and no output at all.
    "chat_404": {names.GEN_AI_INPUT_MESSAGES: [user("Hello")]},
    "chat_404_stream": {names.GEN_AI_INPUT_MESSAGES: [user("Hello")]},
    "chat_400": {
        names.GEN_AI_INPUT_MESSAGES: [
            user("Hello"),
            {
                "role": "tool",
                "parts": [{"type": "tool_call_response", "id": "call_missing", "response": "42"}],
            },
        ]
    },
    "responses_404": {names.GEN_AI_INPUT_MESSAGES: [user("Hello")]},
    "vllm_reasoning": {
        names.GEN_AI_INPUT_MESSAGES: [user(PRIME)],
        names.GEN_AI_OUTPUT_MESSAGES: [
            answer({"type": "reasoning", "content": THOUGHT}, text("Yes, 17 is prime."))
        ],
    },
    "vllm_reasoning_stream": {
        names.GEN_AI_INPUT_MESSAGES: [user(PRIME)],
        names.GEN_AI_OUTPUT_MESSAGES: [
            answer({"type": "reasoning", "content": THOUGHT}, text("Yes, 17 is prime."))
        ],
    },
    "deepseek_reasoning_stream": {
        names.GEN_AI_INPUT_MESSAGES: [user(PRIME)],
        names.GEN_AI_OUTPUT_MESSAGES: [
            answer({"type": "reasoning", "content": THOUGHT}, text("Yes, 17 is prime."))
        ],
    },
    "responses_function_call": {
        names.GEN_AI_INPUT_MESSAGES: [user(PARIS)],
        names.GEN_AI_OUTPUT_MESSAGES: [
            answer(tool_call("call_Nh0pQ6rW2sE9tY4uI7oP3aL5", "Paris, France"), finish="tool_call")
        ],
    },
    "responses_function_call_stream": {
        names.GEN_AI_INPUT_MESSAGES: [user(PARIS)],
        names.GEN_AI_OUTPUT_MESSAGES: [
            answer(tool_call("call_Vb7nM3kL9jH5gF1dS8aQ2wE4", "Paris, France"), finish="tool_call")
        ],
    },
    "responses_reasoning": {
        names.GEN_AI_INPUT_MESSAGES: [user(STRAWBERRY)],
        names.GEN_AI_OUTPUT_MESSAGES: [
            answer({"type": "reasoning", "content": SUMMARY}, text('There are three r\'s in "strawberry".'))
        ],
    },
    "responses_reasoning_stream": {
        names.GEN_AI_INPUT_MESSAGES: [user(STRAWBERRY)],
        names.GEN_AI_OUTPUT_MESSAGES: [
            answer({"type": "reasoning", "content": SUMMARY}, text('There are three r\'s in "strawberry".'))
        ],
    },
    "responses_function_call_output": {  # `instructions` are given apart: the system instructions
        names.GEN_AI_INPUT_MESSAGES: [
            user(PARIS),
            {"role": "assistant", "parts": [tool_call("call_Nh0pQ6rW2sE9tY4uI7oP3aL5", "Paris, France")]},
            {
                "role": "tool",
                "parts": [
                    {
                        "type": "tool_call_response",
                        "id": "call_Nh0pQ6rW2sE9tY4uI7oP3aL5",
                        "response": '{"temperature": 18, "unit": "celsius", "conditions": "light rain"}',
                    }
                ],
            },
        ],
        names.GEN_AI_OUTPUT_MESSAGES: [answer(text("It's 18 °C with light rain in Paris today."))],
        names.GEN_AI_SYSTEM_INSTRUCTIONS: [text("You are a weather assistant. Answer in one sentence.")],
    },
}


def test_every_recording_has_its_expected_conversation() -> None:
    assert sorted(EXPECTED) == recorded.names()


@pytest.mark.parametrize("name", sorted(EXPECTED))
@pytest.mark.parametrize("kind", KINDS)
async def test_the_recorded_conversation_is_the_conversation(
    kind: str, name: str, replay: ReplayServer, captured: Captured
) -> None:
    recording = replay.play(recorded.load(name))
    bare = await call(kind, replay, recording)
    captured.clear()
    seen = await call(kind, replay, recording, capture=True)
    assert seen == bare  # the app sees exactly what it sees uninstrumented
    assert replay.received == [(recording.path, recording.request)] * 2  # the recorded request, as recorded
    span = call_span(captured)
    assert content(span) == EXPECTED[name]
    if recording.status >= 400:  # the failure is said where the conventions say it, not as an answer
        assert span.attributes[names.ERROR_TYPE] in (
            "NotFoundError",
            "BadRequestError",
            str(recording.status),
        )


@pytest.mark.parametrize("name", ["chat_n2", "chat_n2_stream", "chat_two_tool_calls_stream", "chat_404"])
def test_with_capture_off_nothing_of_the_conversation_is_recorded(
    name: str, replay: ReplayServer, captured: Captured
) -> None:
    recording = replay.play(recorded.load(name))
    client = llmspans.instrument(openai.OpenAI(base_url=replay.base_url, api_key="sk-test", max_retries=0))
    try:
        result = client.chat.completions.create(**recording.request)
        if recording.request.get("stream"):
            list(result)
    except openai.APIStatusError:
        pass
    assert content(call_span(captured)) == {}


# --- streams cut short ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
async def test_a_stream_cut_short_records_what_came_and_says_error(
    kind: str, replay: ReplayServer, captured: Captured
) -> None:
    """Choices that had begun keep what came, with finish_reason `error` where none came."""
    full = recorded.load("chat_n2_stream")
    # The two role chunks, then 5 content chunks: "I'm unable to" for choice 0, "I'm unable" for choice 1.
    await call(kind, replay, replay.play(full.cut(7)), capture=True)
    assert json.loads(call_span(captured).attributes[names.GEN_AI_OUTPUT_MESSAGES]) == [
        answer(text("I'm unable to"), finish="error"),
        answer(text("I'm unable"), finish="error"),
    ]
    captured.clear()
    # Cut after the role chunks alone: nothing of the answer came, so there is no output message.
    await call(kind, replay, replay.play(full.cut(2)), capture=True)
    assert names.GEN_AI_OUTPUT_MESSAGES not in call_span(captured).attributes


@pytest.mark.parametrize("kind", KINDS)
async def test_a_responses_stream_cut_short_keeps_its_finished_items_and_the_pieces_of_the_next(
    kind: str, replay: ReplayServer, captured: Captured
) -> None:
    full = recorded.load("responses_reasoning_stream")
    # Up to the message's fourth text delta: the reasoning item is done, the message is under way.
    events = full.events
    fourth = [i for i, e in enumerate(events) if b"response.output_text.delta" in e][3]
    await call(kind, replay, replay.play(full.cut(fourth + 1)), capture=True)
    assert json.loads(call_span(captured).attributes[names.GEN_AI_OUTPUT_MESSAGES]) == [
        answer({"type": "reasoning", "content": SUMMARY}, text("There are three r"), finish="error")
    ]


@pytest.mark.parametrize("name", ["responses_reasoning_stream", "responses_function_call_stream"])
@pytest.mark.parametrize("kind", ["openai.OpenAI", "httpx2.AsyncClient"])
async def test_responses_deltas_alone_assemble_the_same_parts_as_the_finished_items(
    kind: str, name: str, replay: ReplayServer, captured: Captured
) -> None:
    """Without the finished items and the final response, the deltas say the same; only the finish
    reason differs (nothing said the answer was over)."""
    recording = recorded.load(name).without("response.output_item.done", "response.completed")
    await call(kind, replay, replay.play(recording), capture=True)
    (expected,) = EXPECTED[name][names.GEN_AI_OUTPUT_MESSAGES]
    assert json.loads(call_span(captured).attributes[names.GEN_AI_OUTPUT_MESSAGES]) == [
        {**expected, "finish_reason": "error"}
    ]


# --- inline media ---------------------------------------------------------------------------------

PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
WAV = "UklGRiQAAABXQVZFZm10IBAAAAABAAEAQB8AAIA+AAACABAAZGF0YQAAAAA="


@pytest.mark.parametrize("kind", ["openai.OpenAI", "httpx.Client"])
async def test_inline_media_keeps_its_bytes_only_for_a_redaction_hook(
    kind: str, replay: ReplayServer, captured: Captured
) -> None:
    """`capture_content=True` records what was attached without its bytes; a redaction hook is handed
    the bytes (base64, as sent) and what it returns is recorded."""
    seen: list[Any] = []

    def keep(messages: Any) -> Any:
        seen.append(messages)
        return messages

    recording = replay.play(recorded.load("chat_multimodal"))
    await call(kind, replay, recording, capture=keep)
    (message,) = json.loads(call_span(captured).attributes[names.GEN_AI_INPUT_MESSAGES])
    assert message["parts"][2:] == [
        {"type": "blob", "modality": "image", "mime_type": "image/png", "content": PNG},
        {"type": "blob", "modality": "audio", "mime_type": "audio/wav", "content": WAV},
    ]
    assert seen[0][0]["parts"][2]["content"] == PNG  # the hook saw them before anything was recorded


def test_media_in_responses_input_and_chat_files_are_parts_too() -> None:
    from llmspans._conversation import input_messages

    body = {
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Compare these."},
                    {"type": "input_image", "image_url": "https://example.com/a.png", "detail": "auto"},
                    {"type": "input_image", "file_id": "file-abc"},
                    {"type": "input_file", "file_url": "https://example.com/report.pdf"},
                    {
                        "type": "input_file",
                        "filename": "b.pdf",
                        "file_data": "data:application/pdf;base64,JVBERi0=",
                    },
                ],
            },
            {"type": "item_reference", "id": "msg_123"},
        ]
    }
    assert input_messages(body) == [
        {
            "role": "user",
            "parts": [
                text("Compare these."),
                {"type": "uri", "modality": "image", "uri": "https://example.com/a.png"},
                {"type": "file", "modality": "image", "file_id": "file-abc"},
                {"type": "uri", "modality": "document", "uri": "https://example.com/report.pdf"},
                {"type": "blob", "modality": "document", "mime_type": "application/pdf", "content": ""},
            ],
        },
        {"role": "user", "parts": [{"type": "item_reference", "id": "msg_123"}]},
    ]
    chat = {
        "messages": [
            {"role": "user", "name": "ana", "content": [{"type": "file", "file": {"file_id": "file-xyz"}}]}
        ]
    }
    assert input_messages(chat) == [
        {
            "role": "user",
            "parts": [{"type": "file", "modality": "document", "file_id": "file-xyz"}],
            "name": "ana",
        }
    ]


# --- long content ---------------------------------------------------------------------------------


def _with_answer(recording: Recording, answer_text: str) -> Recording:
    body = json.loads(recording.body)
    body["choices"][0]["message"]["content"] = answer_text
    return recorded.Recording(**{**recording.__dict__, "body": json.dumps(body).encode()})


@pytest.mark.parametrize("kind", ["openai.OpenAI", "httpx2.AsyncClient"])
async def test_long_content_is_shortened_inside_valid_json_within_the_limit(
    kind: str, replay: ReplayServer, captured: Captured
) -> None:
    """A 50,000-character prompt and a 40,000-character answer: each attribute stays within 16 KiB and
    stays the conversation (every message and part there, each long text cut with a note of how much)."""
    recording = _with_answer(recorded.load("chat_n2"), "B" * 40_000)
    messages = [recording.request["messages"][0], {"role": "user", "content": "A" * 50_000}]
    recording = recorded.Recording(
        **{**recording.__dict__, "request": {**recording.request, "messages": messages}}
    )
    await call(kind, replay, replay.play(recording), capture=True)
    attributes = call_span(captured).attributes
    for key in (names.GEN_AI_INPUT_MESSAGES, names.GEN_AI_OUTPUT_MESSAGES):
        assert len(attributes[key]) <= _content.MAX_CONTENT_CHARS
    inputs = json.loads(attributes[names.GEN_AI_INPUT_MESSAGES])
    assert inputs[0] == SYSTEM  # short texts are kept whole
    (cut,) = inputs[1]["parts"]
    assert cut["content"].startswith("A" * 1000)
    kept = len(cut["content"].split("…")[0])
    assert cut["content"].endswith(f"…[+{50_000 - kept} chars]")
    outputs = json.loads(attributes[names.GEN_AI_OUTPUT_MESSAGES])
    assert [m["finish_reason"] for m in outputs] == ["stop", "stop"]
    assert outputs[1] == answer(text("This is a test."))
    cut = outputs[0]["parts"][0]["content"]
    assert cut.startswith("B" * 1000)
    kept = len(
        cut.split("…")[0]
    )  # kept to the limit as it arrived, then shortened to fit: one note, the whole count
    assert cut.endswith(f"…[+{40_000 - kept} chars]")


async def test_the_tracer_providers_attribute_length_limit_is_respected_too(replay: ReplayServer) -> None:
    """With `SpanLimits(max_span_attribute_length=...)` the SDK would cut the JSON text mid-way: llmspans
    fits its JSON within that limit instead."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(span_limits=SpanLimits(max_span_attribute_length=700))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    recording = replay.play(recorded.load("chat_tool_result"))
    with _telemetry.use_providers(provider, MeterProvider()):
        await call("openai.OpenAI", replay, recording, capture=True)
    (span,) = exporter.get_finished_spans()
    recorded_inputs = span.attributes[names.GEN_AI_INPUT_MESSAGES]
    expected = EXPECTED["chat_tool_result"][names.GEN_AI_INPUT_MESSAGES]
    assert (
        len(json.dumps(expected, ensure_ascii=False, separators=(",", ":"))) > 700
    )  # it had to be shortened
    assert len(recorded_inputs) <= 700
    inputs = json.loads(recorded_inputs)
    assert [m["role"] for m in inputs] == [m["role"] for m in expected]
    assert [[p["type"] for p in m["parts"]] for m in inputs] == [
        [p["type"] for p in m["parts"]] for m in expected
    ]
    assert inputs[2] == expected[2]  # short texts, ids and names are kept whole
    assert inputs[3]["parts"][0]["response"].endswith(" chars]")  # the longest text was cut, and says so
    provider.shutdown()


def test_fitting_keeps_structure_drops_bytes_whole_then_the_oldest_messages() -> None:
    blob = {"type": "blob", "modality": "image", "mime_type": "image/png", "content": "x" * 500}
    messages = [{"role": "user", "parts": [text("hello"), blob]}]
    fitted = json.loads(_content.fit(messages, 140) or "null")
    assert fitted == [
        {"role": "user", "parts": [text("hello"), {**blob, "content": ""}]}
    ]  # never half a blob
    many = [user(str(i)) for i in range(100)]
    fitted = json.loads(_content.fit(many, 200) or "null")
    assert fitted == many[-len(fitted) :]  # the newest kept
    assert len(_content.fit(many, 200) or "") <= 200
    assert _content.fit([{"role": "user", "parts": [text("hi")]}], 10) is None  # not even its shape fits


def test_a_long_stream_is_kept_to_the_limit_as_it_arrives() -> None:
    """Collecting content allocates nothing per chunk once a choice holds `limit` characters."""
    output = OutputMessages(limit=1000)
    chunk = {"choices": [{"index": 0, "delta": {"content": "0123456789"}, "finish_reason": None}]}
    for _ in range(200):
        output.chat_chunk(chunk)
    tracemalloc.start()
    gc.collect()
    before = tracemalloc.get_traced_memory()[0]
    for _ in range(20_000):
        output.chat_chunk(chunk)
    gc.collect()
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert grown < 1_000, grown  # nothing kept: 20,000 chunks would be 200 KB of text
    (message,) = output.messages() or []
    # 1,000 characters kept; the other 201,000 that came (200 chunks before, 20,000 after) counted.
    assert message["parts"][0]["content"] == "0123456789" * 100 + "…[+201000 chars]"
    assert message["finish_reason"] == "error"


STREAMS = [
    name for name in recorded.names() if recorded.load(name).streamed and recorded.load(name).status == 200
]


@pytest.mark.parametrize("name", STREAMS)
async def test_the_sdk_and_a_plain_client_count_the_same_chunks_of_a_stream(
    name: str, replay: ReplayServer, captured: Captured
) -> None:
    """Reasoning and refusal deltas are generated tokens on both paths (the first of them is the first token)."""
    recording = replay.play(recorded.load(name))
    seen = []
    for kind in ("openai.OpenAI", "httpx.Client"):
        captured.clear()
        await call(kind, replay, recording, capture=False)
        attributes = call_span(captured).attributes
        seen.append(
            (attributes[names.STREAM_CHUNKS], tuple(attributes[names.GEN_AI_RESPONSE_FINISH_REASONS]))
        )
    assert seen[0] == seen[1]
    assert seen[0][0] > 0


# --- what the recordings do not show -------------------------------------------------------------


def test_legacy_completions_give_one_message_per_choice_streamed_or_not() -> None:
    whole = OutputMessages(limit=1000)
    whole.whole(
        {
            "object": "text_completion",
            "choices": [
                {"text": " one", "index": 0, "logprobs": None, "finish_reason": "length"},
                {"text": " two", "index": 1, "logprobs": None, "finish_reason": "stop"},
            ],
        }
    )
    streamed = OutputMessages(limit=1000)
    for index, piece, reason in ((1, " tw", None), (0, " one", "length"), (1, "o", "stop")):
        streamed.completion_chunk({"choices": [{"text": piece, "index": index, "finish_reason": reason}]})
    expected = [answer(text(" one"), finish="length"), answer(text(" two"))]
    assert whole.messages() == streamed.messages() == expected


def test_a_responses_answer_says_how_it_ended() -> None:
    def ended(**response: Any) -> Any:
        output = OutputMessages(limit=1000)
        output.whole({"object": "response", **response})
        return output.messages()

    message = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Par"}]}
    incomplete = {"reason": "max_output_tokens"}
    assert ended(status="incomplete", incomplete_details=incomplete, output=[message]) == [
        answer(text("Par"), finish="length")
    ]
    assert ended(status="failed", output=[]) is None  # the model returned nothing
    searched = {"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {"query": "x"}}
    assert ended(status="completed", output=[searched, message]) == [
        answer(
            {
                "type": "server_tool_call",
                "id": "ws_1",
                "name": "web_search",
                "server_tool_call": {"type": "web_search"},
            },
            text("Par"),
        )
    ]
    custom = {"type": "custom_tool_call", "call_id": "call_9", "name": "run_sql", "input": "SELECT 1"}
    assert ended(status="completed", output=[custom]) == [
        answer(
            {"type": "tool_call", "id": "call_9", "name": "run_sql", "arguments": "SELECT 1"},
            finish="tool_call",
        )
    ]


def test_the_deprecated_function_call_is_a_tool_call_in_and_out() -> None:
    from llmspans._conversation import input_messages

    call = {"name": "get_weather", "arguments": '{"location": "Oslo"}'}
    output = OutputMessages(limit=1000)
    output.whole(
        {
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": None, "function_call": call},
                    "finish_reason": "function_call",
                }
            ],
        }
    )
    part = {"type": "tool_call", "id": None, "name": "get_weather", "arguments": {"location": "Oslo"}}
    assert output.messages() == [answer(part, finish="tool_call")]
    sent_back = [
        {"role": "assistant", "content": None, "function_call": call},
        {"role": "function", "name": "get_weather", "content": "rain"},
    ]
    assert input_messages({"messages": sent_back}) == [
        {"role": "assistant", "parts": [part]},
        {
            "role": "function",
            "parts": [{"type": "tool_call_response", "id": None, "response": "rain"}],
            "name": "get_weather",
        },
    ]


def test_responses_input_items_sent_back_keep_their_reasoning_and_tool_calls() -> None:
    from llmspans._conversation import input_messages

    body = {
        "input": [
            {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Look it up."}]},
            {"type": "custom_tool_call", "call_id": "call_9", "name": "run_sql", "input": "SELECT 1"},
            {"type": "custom_tool_call_output", "call_id": "call_9", "output": "1"},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "It is 1."}],
            },
        ]
    }
    assert input_messages(body) == [
        {"role": "assistant", "parts": [{"type": "reasoning", "content": "Look it up."}]},
        {
            "role": "assistant",
            "parts": [{"type": "tool_call", "id": "call_9", "name": "run_sql", "arguments": "SELECT 1"}],
        },
        {"role": "tool", "parts": [{"type": "tool_call_response", "id": "call_9", "response": "1"}]},
        {"role": "assistant", "parts": [text("It is 1.")]},
    ]
