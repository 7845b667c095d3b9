"""The OpenAI wire format (`llmspans/_openai_wire.py`): what one streamed event or one whole body says.

The same readers serve decoded JSON (the plain-HTTP adapter) and the openai SDK's objects.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from llmspans._openai_wire import ChunkInfo, classify, classify_json_body, read_payload

# --- classify: chat completions ---------------------------------------------------------------


def chat_chunk(delta: Any, finish: str | None = None, **extra: Any) -> str:
    return json.dumps(
        {
            "id": "chatcmpl-abc",
            "object": "chat.completion.chunk",
            "created": 1_700_000_000,
            "model": "gpt-4o-mini-2024-07-18",
            "system_fingerprint": "fp_0ba0d124f1",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
            **extra,
        }
    )


def test_role_only_first_chunk_is_not_content() -> None:
    info = classify(None, chat_chunk({"role": "assistant", "content": "", "refusal": None}))
    assert info == ChunkInfo(
        response_id="chatcmpl-abc",
        model="gpt-4o-mini-2024-07-18",
        attributes={"openai.response.system_fingerprint": "fp_0ba0d124f1"},
    )


def test_content_chunk() -> None:
    info = classify(None, chat_chunk({"content": "Hello"}))
    assert info is not None
    assert (info.content, info.finish_reasons) == (True, [])


def test_refusal_delta_is_content() -> None:
    info = classify(None, chat_chunk({"refusal": "I can't"}))
    assert info is not None
    assert info.content


@pytest.mark.parametrize(
    "delta",
    [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "index": 0,
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": ""},
                }
            ],
        },
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city"'}}]},
        {"reasoning_content": "Let me think"},
        {"reasoning": "Let me think", "content": None},
    ],
    ids=["tool_call_start", "tool_call_arguments", "reasoning_content", "reasoning"],
)
def test_tool_call_and_reasoning_deltas_are_content(delta: dict[str, Any]) -> None:
    info = classify(None, chat_chunk(delta))
    assert info is not None
    assert info.content


def test_finish_chunk_with_usage_transformers_serve_style() -> None:
    usage = {"prompt_tokens": 12, "completion_tokens": 34, "total_tokens": 46}
    info = classify(None, chat_chunk({}, "stop", usage=usage))
    assert info == ChunkInfo(
        response_id="chatcmpl-abc",
        model="gpt-4o-mini-2024-07-18",
        finish_reasons=["stop"],
        finish_indexes=[0],
        input_tokens=12,
        output_tokens=34,
        attributes={"openai.response.system_fingerprint": "fp_0ba0d124f1"},
    )


def test_usage_only_chunk() -> None:
    usage = {
        "prompt_tokens": 1200,
        "completion_tokens": 80,
        "total_tokens": 1280,
        "prompt_tokens_details": {"cached_tokens": 1024, "audio_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }
    payload = {
        "id": "chatcmpl-abc",
        "object": "chat.completion.chunk",
        "model": "m",
        "choices": [],
        "usage": usage,
    }
    info = classify(None, json.dumps(payload))
    assert info == ChunkInfo(
        response_id="chatcmpl-abc", model="m", input_tokens=1200, output_tokens=80, cached_tokens=1024,
        attributes={"gen_ai.usage.reasoning.output_tokens": 0},
    )  # fmt: skip


def test_done_sentinel() -> None:
    assert classify(None, "[DONE]") == ChunkInfo(done=True)
    assert classify(None, " [DONE] ") == ChunkInfo(done=True)


@pytest.mark.parametrize("data", ["", "not json", "{bad", "[1, 2]", "null", '"text"', "42", "[" * 100_000])
def test_data_that_is_not_a_json_object_gives_none(data: str) -> None:
    assert classify(None, data) is None


@pytest.mark.parametrize(
    "payload",
    [
        {"choices": [{"index": 0, "delta": None, "finish_reason": None}], "usage": None},
        {"choices": None, "usage": None},
        {"choices": [None, 3, "x", {"delta": {"content": 5, "tool_calls": {}, "reasoning": []}}]},
        {"choices": {"0": {}}, "usage": [], "id": 7, "model": None},
        {"choices": [{"delta": "text", "finish_reason": 1, "text": None}]},
    ],
)
def test_null_and_mistyped_fields_are_tolerated(payload: dict[str, Any]) -> None:
    assert classify(None, json.dumps(payload)) == ChunkInfo()


def test_only_real_non_negative_ints_count_as_tokens() -> None:
    usage = {
        "prompt_tokens": True,
        "completion_tokens": -1,
        "prompt_tokens_details": {"cached_tokens": 3.0},
        "input_tokens": "5",
    }
    info = classify(None, json.dumps({"choices": [], "usage": usage}))
    assert info is not None
    assert (info.input_tokens, info.output_tokens, info.cached_tokens) == (None, None, None)


@pytest.mark.parametrize(
    "payload",
    [
        {
            "error": {
                "message": "Rate limit reached",
                "type": "requests",
                "param": None,
                "code": "rate_limit_exceeded",
            }
        },
        {"object": "error", "message": "The model does not exist.", "type": "NotFoundError", "code": 404},
        {"error": "Input validation error", "error_type": "validation"},
    ],
    ids=["openai", "vllm", "tgi"],
)
def test_error_payloads(payload: dict[str, Any]) -> None:
    info = classify(None, json.dumps(payload))
    assert info is not None
    assert info.error
    assert not info.content


def test_error_null_is_not_an_error() -> None:
    info = classify(None, chat_chunk({"content": "x"}, error=None))
    assert info is not None
    assert not info.error


# --- classify: legacy completions -------------------------------------------------------------


def completion_chunk(text: Any, finish: str | None = None, **extra: Any) -> str:
    choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}
    return json.dumps(
        {"id": "cmpl-xyz", "object": "text_completion", "created": 1, "model": "gpt-3.5-turbo-instruct"}
        | {"choices": [choice], **extra}
    )


def test_legacy_completion_chunks() -> None:
    info = classify(None, completion_chunk(" world"))
    assert info == ChunkInfo(content=True, response_id="cmpl-xyz", model="gpt-3.5-turbo-instruct")
    usage = {"prompt_tokens": 5, "completion_tokens": 16, "total_tokens": 21}
    info = classify(None, completion_chunk("", "length", usage=usage))
    assert info is not None
    assert (info.content, info.finish_reasons, info.input_tokens, info.output_tokens) == (
        False,
        ["length"],
        5,
        16,
    )


# --- classify: Responses API ------------------------------------------------------------------


def response_object(status: str, usage: Any = None, **extra: Any) -> dict[str, Any]:
    return {
        "id": "resp_123",
        "object": "response",
        "created_at": 1_741_290_958,
        "status": status,
        "error": None,
        "incomplete_details": None,
        "model": "gpt-4.1-2025-04-14",
        "output": [],
        "usage": usage,
        **extra,
    }


def responses_event(kind: str, **fields: Any) -> tuple[str, str]:
    return kind, json.dumps({"type": kind, "sequence_number": 1, **fields})


_RESPONSES_USAGE = {
    "input_tokens": 37,
    "input_tokens_details": {"cached_tokens": 16},
    "output_tokens": 11,
    "output_tokens_details": {"reasoning_tokens": 0},
    "total_tokens": 48,
}


def test_responses_created_gives_id_and_model() -> None:
    info = classify(*responses_event("response.created", response=response_object("in_progress")))
    assert info == ChunkInfo(response_id="resp_123", model="gpt-4.1-2025-04-14")


def test_responses_output_text_delta() -> None:
    where = {"item_id": "msg_1", "output_index": 0, "content_index": 0}
    info = classify(*responses_event("response.output_text.delta", **where, delta="Hi", logprobs=[]))
    assert info == ChunkInfo(content=True)
    info = classify(*responses_event("response.output_text.delta", **where, delta=""))
    assert info == ChunkInfo()


@pytest.mark.parametrize(
    "kind",
    ["response.function_call_arguments.delta", "response.reasoning_text.delta", "response.refusal.delta"],
)
def test_other_responses_deltas_are_content(kind: str) -> None:
    info = classify(*responses_event(kind, item_id="x", output_index=0, delta="piece"))
    assert info == ChunkInfo(content=True)


def test_responses_structural_events_are_not_content() -> None:
    item = {"id": "msg_1", "type": "message", "status": "in_progress", "content": [], "role": "assistant"}
    assert classify(*responses_event("response.output_item.added", output_index=0, item=item)) == ChunkInfo()
    info = classify(*responses_event("response.output_text.done", text="Hi there"))
    assert info == ChunkInfo()


def test_responses_completed_with_usage() -> None:
    response = response_object("completed", _RESPONSES_USAGE)
    info = classify(*responses_event("response.completed", response=response))
    assert info == ChunkInfo(
        response_id="resp_123",
        model="gpt-4.1-2025-04-14",
        finish_reasons=["stop"],
        finish_indexes=[0],
        input_tokens=37,
        output_tokens=11,
        cached_tokens=16,
        attributes={"gen_ai.usage.reasoning.output_tokens": 0},
    )


def test_responses_incomplete_and_failed() -> None:
    details = {"reason": "max_output_tokens"}
    response = response_object("incomplete", _RESPONSES_USAGE, incomplete_details=details)
    info = classify(*responses_event("response.incomplete", response=response))
    assert info is not None
    assert (info.finish_reasons, info.error) == (["max_output_tokens"], False)
    info = classify(*responses_event("response.incomplete", response=response_object("incomplete")))
    assert info is not None
    assert info.finish_reasons == ["length"]
    error = {"code": "server_error", "message": "The model failed"}
    info = classify(*responses_event("response.failed", response=response_object("failed", error=error)))
    assert info is not None
    assert (info.finish_reasons, info.error) == (["error"], True)


def test_responses_error_event() -> None:
    info = classify(
        *responses_event("error", code="ERR_SOMETHING", message="Something went wrong", param=None)
    )
    assert info == ChunkInfo(error=True)


def test_event_name_is_used_when_the_payload_has_no_type() -> None:
    info = classify("response.output_text.delta", json.dumps({"delta": "Hi"}))
    assert info == ChunkInfo(content=True)
    info = classify("response.completed", json.dumps({"response": None}))
    assert info == ChunkInfo(finish_reasons=["stop"], finish_indexes=[0])


# --- classify_json_body -----------------------------------------------------------------------


def test_json_body_chat_completion() -> None:
    body = {
        "id": "chatcmpl-B9MHDbslfkBeAs8l4bebGdFOJ6PeG",
        "object": "chat.completion",
        "created": 1_741_570_283,
        "model": "gpt-4o-2024-08-06",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "The image shows", "refusal": None},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {
            "prompt_tokens": 1117,
            "completion_tokens": 46,
            "total_tokens": 1163,
            "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
        },
    }
    assert classify_json_body(json.dumps(body).encode()) == ChunkInfo(
        content=True,
        response_id="chatcmpl-B9MHDbslfkBeAs8l4bebGdFOJ6PeG",
        model="gpt-4o-2024-08-06",
        finish_reasons=["stop"],
        finish_indexes=[0],
        input_tokens=1117,
        output_tokens=46,
        cached_tokens=0,
    )


def test_json_body_chat_completion_with_tool_calls() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    message = {"role": "assistant", "content": None, "tool_calls": [call]}
    body = {"id": "c", "object": "chat.completion", "model": "m"} | {
        "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}]
    }
    info = classify_json_body(json.dumps(body).encode())
    assert info is not None
    assert (info.content, info.finish_reasons) == (True, ["tool_calls"])


def test_json_body_text_completion() -> None:
    body = json.loads(completion_chunk("\n\nThis is a test", "length"))
    body["usage"] = {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}
    assert classify_json_body(json.dumps(body).encode()) == ChunkInfo(
        content=True,
        response_id="cmpl-xyz",
        model="gpt-3.5-turbo-instruct",
        finish_reasons=["length"],
        finish_indexes=[0],
        input_tokens=5,
        output_tokens=7,
    )


def test_json_body_embeddings() -> None:
    body = {
        "object": "list",
        "data": [{"object": "embedding", "index": 0, "embedding": [0.0023, -0.0093]}],
        "model": "text-embedding-3-small",
        "usage": {"prompt_tokens": 8, "total_tokens": 8},
    }
    assert classify_json_body(json.dumps(body).encode()) == ChunkInfo(
        model="text-embedding-3-small", input_tokens=8, attributes={"gen_ai.embeddings.dimension.count": 2}
    )


def test_json_body_responses_object() -> None:
    message = {
        "type": "message",
        "id": "msg_1",
        "status": "completed",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "Under the moon", "annotations": []}],
    }
    body = response_object("completed", _RESPONSES_USAGE, output=[message])
    assert classify_json_body(json.dumps(body).encode()) == ChunkInfo(
        content=True,
        response_id="resp_123",
        model="gpt-4.1-2025-04-14",
        finish_reasons=["stop"],
        finish_indexes=[0],
        input_tokens=37,
        output_tokens=11,
        cached_tokens=16,
        attributes={"gen_ai.usage.reasoning.output_tokens": 0},
    )
    call = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "f", "arguments": "{}"}
    info = classify_json_body(json.dumps(response_object("completed", output=[call])).encode())
    assert info is not None
    assert info.content


def test_json_body_error() -> None:
    body = {
        "error": {"message": "Invalid API key", "type": "invalid_request_error", "code": "invalid_api_key"}
    }
    info = classify_json_body(json.dumps(body).encode())
    assert info is not None
    assert info.error


@pytest.mark.parametrize(
    "body", [b"", b"not json", b"\xff\xfe\xfa", b"[]", b"<html>502</html>", b"{" * 100_000]
)
def test_json_body_that_is_not_an_object_gives_none(body: bytes) -> None:
    assert classify_json_body(body) is None


# --- one reader for both: the SDK's objects say what their JSON says --------------------------------


def sdk_object(type_: Any, payload: dict[str, Any]) -> Any:
    """The object the openai SDK builds from a response body (as `construct_type` does when it parses one)."""
    from openai._models import construct_type

    return construct_type(type_=type_, value=payload)


@pytest.mark.parametrize(
    "shape",
    ["chat", "chat-tool-calls", "completion", "embeddings", "responses"],
)
def test_an_sdk_object_reads_as_its_json_body(shape: str) -> None:
    from openai.types import Completion, CreateEmbeddingResponse
    from openai.types.chat import ChatCompletion
    from openai.types.responses import Response

    usage = {
        "prompt_tokens": 9,
        "completion_tokens": 4,
        "total_tokens": 13,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    message: dict[str, Any] = {"role": "assistant", "content": "Hello there", "refusal": None}
    if shape == "chat-tool-calls":
        message = {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}  # fmt: skip
    payloads: dict[str, tuple[Any, dict[str, Any]]] = {
        "chat": (ChatCompletion, {"id": "c", "object": "chat.completion", "created": 1, "model": "m", "usage": usage,
                 "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}),
        "completion": (Completion, {"id": "t", "object": "text_completion", "created": 1, "model": "m", "usage": usage,
                       "choices": [{"index": 0, "text": "Hi", "finish_reason": "length", "logprobs": None}]}),
        "embeddings": (CreateEmbeddingResponse, {"object": "list", "model": "e", "data": [
            {"object": "embedding", "index": 0, "embedding": [0.1, 0.2]}], "usage": {"prompt_tokens": 3, "total_tokens": 3}}),
        "responses": (Response, response_object("completed", _RESPONSES_USAGE, output=[{
            "type": "message", "id": "msg", "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": "Under the moon", "annotations": []}]}])),
    }  # fmt: skip
    payloads["chat-tool-calls"] = payloads["chat"]
    type_, payload = payloads[shape]
    from_json = classify_json_body(json.dumps(payload).encode())
    assert from_json is not None
    assert from_json.response_id or from_json.input_tokens
    assert read_payload(sdk_object(type_, payload)) == from_json


# --- what else a request and a response say ----------------------------------------------------------


def test_a_request_s_parameters_under_their_convention_names() -> None:
    from llmspans._openai_wire import request_attributes

    chat = {
        "model": "m", "messages": [], "n": 3, "stop": "END", "seed": 42, "frequency_penalty": 0.5,
        "presence_penalty": -1, "top_k": 40, "service_tier": "flex", "response_format": {"type": "json_schema"},
    }  # fmt: skip
    assert request_attributes(chat) == {
        "gen_ai.request.choice.count": 3,
        "gen_ai.request.stop_sequences": ("END",),
        "gen_ai.request.seed": 42,
        "gen_ai.request.frequency_penalty": 0.5,
        "gen_ai.request.presence_penalty": -1.0,
        "gen_ai.request.top_k": 40.0,
        "openai.request.service_tier": "flex",
        "gen_ai.output.type": "json",
    }
    assert isinstance(
        request_attributes(chat)["gen_ai.request.top_k"], float
    )  # a double, as the conventions say
    # n=1 is the default: no choice count; a list of stops; the Responses API's format and conversation.
    responses = {
        "n": 1,
        "stop": ["a", "b"],
        "text": {"format": {"type": "text"}},
        "conversation": {"id": "conv_1"},
    }
    assert request_attributes(responses) == {
        "gen_ai.request.stop_sequences": ("a", "b"),
        "gen_ai.output.type": "text",
        "gen_ai.conversation.id": "conv_1",
    }
    embeddings = {"input": ["a"], "encoding_format": "base64", "dimensions": 256, "conversation": "conv_2"}
    assert request_attributes(embeddings) == {
        "gen_ai.request.encoding_formats": ("base64",),
        "gen_ai.embeddings.dimension.count": 256,
        "gen_ai.conversation.id": "conv_2",
    }
    # Wrong types are left out rather than recorded wrong.
    odd = {"n": True, "seed": "7", "stop": [1], "top_k": False, "dimensions": 2.5, "response_format": "json"}
    assert request_attributes(odd) == {}


def test_usage_details_give_reasoning_and_cache_creation_tokens() -> None:
    from llmspans._openai_wire import usage_attributes

    assert usage_attributes(
        {"completion_tokens_details": {"reasoning_tokens": 7}, "cache_creation_input_tokens": 100}
    ) == {"gen_ai.usage.reasoning.output_tokens": 7, "gen_ai.usage.cache_creation.input_tokens": 100}
    assert usage_attributes(
        {"output_tokens_details": {"reasoning_tokens": 2}, "input_tokens_details": {"cache_write_tokens": 9}}
    ) == {"gen_ai.usage.reasoning.output_tokens": 2, "gen_ai.usage.cache_creation.input_tokens": 9}
    assert usage_attributes({"prompt_tokens": 3, "completion_tokens": 4}) is None
    assert usage_attributes({"completion_tokens_details": {"reasoning_tokens": -1}}) is None


def test_a_base64_embedding_gives_its_dimension_count() -> None:
    import base64
    import struct

    vector = base64.b64encode(struct.pack("<5f", *range(5))).decode()
    body = {
        "object": "list",
        "data": [{"object": "embedding", "index": 0, "embedding": vector}],
        "model": "e",
    }
    info = classify_json_body(json.dumps(body).encode())
    assert info is not None
    assert info.attributes == {"gen_ai.embeddings.dimension.count": 5}


def test_texts_in_a_list_input_are_messages_and_instructions_are_system_instructions() -> None:
    from llmspans._conversation import input_messages, system_instructions

    assert input_messages({"input": ["first", [1, 2], "second"]}) == [
        {"role": "user", "parts": [{"type": "text", "content": "first"}]},
        {"role": "user", "parts": [{"type": "text", "content": "second"}]},
    ]
    assert system_instructions({"instructions": "Be brief."}) == [{"type": "text", "content": "Be brief."}]
    assert system_instructions({"instructions": ""}) is None
    assert system_instructions({"messages": []}) is None


# --- which chunks carry tokens: one rule, read alike by every reader of a stream --------------------------------

_CHAT = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}
_TEXT = {"id": "t", "object": "text_completion", "created": 1, "model": "m"}


def _chat(*deltas: dict[str, Any]) -> dict[str, Any]:
    choices = [
        {"index": i, "delta": delta, "logprobs": None, "finish_reason": None}
        for i, delta in enumerate(deltas)
    ]
    return {**_CHAT, "choices": choices}


def _text(*texts: str) -> dict[str, Any]:
    choices = [
        {"index": i, "text": text, "logprobs": None, "finish_reason": None} for i, text in enumerate(texts)
    ]
    return {**_TEXT, "choices": choices}


def _event(kind: str, delta: str) -> dict[str, Any]:
    return {
        "type": kind,
        "delta": delta,
        "item_id": "i",
        "output_index": 0,
        "content_index": 0,
        "sequence_number": 1,
    }


_TOOL_CALL = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{"}}
# (chunk, carries tokens); the comments name the readers that used to say otherwise.
CHUNKS: dict[str, tuple[dict[str, Any], bool]] = {
    "answer text": (_chat({"content": "hi"}), True),
    "an empty first delta": (_chat({"role": "assistant", "content": ""}), False),
    "a refusal": (_chat({"refusal": "I can't"}), True),  # the load tool's readers (SDK objects and bytes)
    "a tool call": (_chat({"tool_calls": [_TOOL_CALL]}), True),
    "vLLM's reasoning": (_chat({"reasoning": "think"}), True),  # the load tool's reader of SDK objects
    "DeepSeek's reasoning_content": (_chat({"reasoning_content": "think"}), True),
    "text in the second choice only": (_chat({"content": ""}, {"content": "b"}), True),  # the load tool's
    "a completion's text": (_text("t"), True),
    "text in a completion's second choice only": (
        _text("", "t"),
        True,
    ),  # the adapter, the hedge, the load tool
    "an empty completion": (_text(""), False),
    "usage alone": (
        {**_CHAT, "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}},
        False,
    ),
    "a Responses text delta": (_event("response.output_text.delta", "x"), True),
    "a Responses refusal delta": (_event("response.refusal.delta", "no"), True),  # the load tool's
    "a Responses arguments delta": (_event("response.function_call_arguments.delta", "{"), True),  # likewise
    "a Responses reasoning delta": (_event("response.reasoning_text.delta", "hm"), True),  # likewise
    "an empty Responses delta": (_event("response.output_text.delta", ""), False),
}


def _sdk_object(chunk: dict[str, Any]) -> Any:
    """The chunk as the openai SDK hands it over: built as its stream builds each item (not validated)."""
    from openai._models import construct_type
    from openai.types import Completion, responses
    from openai.types.chat import ChatCompletionChunk

    kinds = {
        "response.output_text.delta": responses.ResponseTextDeltaEvent,
        "response.refusal.delta": responses.ResponseRefusalDeltaEvent,
        "response.function_call_arguments.delta": responses.ResponseFunctionCallArgumentsDeltaEvent,
        "response.reasoning_text.delta": responses.ResponseReasoningTextDeltaEvent,
    }
    if "type" in chunk:
        return construct_type(type_=kinds[chunk["type"]], value=chunk)
    kind = Completion if chunk["object"] == "text_completion" else ChatCompletionChunk
    return construct_type(type_=kind, value=chunk)


@pytest.mark.parametrize("case", list(CHUNKS))
def test_every_reader_of_a_stream_agrees_on_which_chunks_carry_tokens(case: str) -> None:
    from llmspans import _openai_wire
    from llmspans._adapters import openai_sdk
    from llmspans._call import CallRecord
    from llmspans.load._plain import carries_tokens_in, content_of, content_of_bytes

    chunk, expected = CHUNKS[case]
    compact = json.dumps(chunk, separators=(",", ":"))
    sdk = _sdk_object(chunk)
    # The rule itself, on decoded JSON (the plain adapter) and on the SDK's objects (the openai adapter, the
    # hedge's read-ahead, the load tool's SDK client).
    assert _openai_wire.carries_tokens(chunk) is expected
    assert _openai_wire.carries_tokens(sdk) is expected
    # The plain adapter's event reader, and the compact read of the same data (None: only decoding can tell).
    info = classify(chunk.get("type"), compact)
    assert info is not None
    assert info.content is expected
    assert content_of(compact) in (None, expected)
    assert content_of_bytes(compact.encode()) == content_of(compact)
    assert carries_tokens_in(compact.encode()) is expected  # the load tool's own stamps
    # The openai adapter's per-chunk reader counts it as a content chunk, or not.
    path = (
        "/responses"
        if "type" in chunk
        else "/completions"
        if chunk["object"] == "text_completion"
        else "/chat/completions"
    )
    record = CallRecord(operation="chat", model="m", provider="openai", stream=True, sinks=None)
    reader = openai_sdk._item_reader(path, False)
    reader(openai_sdk._Reading(record, path, False, False), sdk, 1_000)
    assert record.chunks == (1 if expected else 0)
