"""The OpenAI wire format: what an OpenAI-compatible request and response say.

One module for both client families: the openai SDK's adapter reads the SDK's objects, the
plain-HTTP adapter reads decoded JSON, and both go through the readers here (`fields` makes an
SDK model and a decoded object look alike). It knows the operations and their paths, the
request's GenAI attributes, usage under both namings, finish reasons, and what one
streamed event or one whole body carries (`classify`, `read_payload`). Nothing here raises on odd
input: servers differ, and telemetry must not break the call it watches.

The openai SDK's per-chunk reader (`_adapters/openai_sdk.py`) reads chunk objects by attribute
instead, for speed; it uses the names and maps defined here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from llmspans import _names as names

__all__ = [
    "RESPONSES_DELTAS",
    "RESPONSES_FINISH",
    "ChunkInfo",
    "carries_tokens",
    "choice_carries_tokens",
    "classify",
    "classify_json_body",
    "classify_payload",
    "compact_carries_tokens",
    "event_carries_tokens",
    "fields",
    "load",
    "operation_for",
    "read_outcome",
    "read_payload",
    "request_attributes",
    "response_attributes",
    "usage_attributes",
]

# --- requests ---------------------------------------------------------------------------------

_OPERATIONS = (
    ("/chat/completions", names.OPERATION_CHAT),
    ("/completions", names.OPERATION_TEXT_COMPLETION),
    ("/embeddings", names.OPERATION_EMBEDDINGS),
    ("/responses", names.OPERATION_CHAT),
)
_operation_of_path: dict[str, str | None] = {}


def operation_for(path: str) -> str | None:
    """The GenAI operation of an OpenAI-compatible path, or None for anything else."""
    try:
        return _operation_of_path[path]
    except KeyError:
        pass
    stripped = path.split("?", 1)[0].rstrip("/")
    found = next((operation for suffix, operation in _OPERATIONS if stripped.endswith(suffix)), None)
    if len(_operation_of_path) < 256:  # a client sends a handful of paths; more is not worth keeping
        _operation_of_path[path] = found
    return found


def is_responses_path(path: str) -> bool:
    return path.split("?", 1)[0].rstrip("/").endswith("/responses")


_FLOAT_PARAMETERS = (
    ("temperature", names.GEN_AI_REQUEST_TEMPERATURE),
    ("top_p", names.GEN_AI_REQUEST_TOP_P),
    ("top_k", names.GEN_AI_REQUEST_TOP_K),  # vLLM's sampling extension (extra_body); a double
    ("frequency_penalty", names.GEN_AI_REQUEST_FREQUENCY_PENALTY),
    ("presence_penalty", names.GEN_AI_REQUEST_PRESENCE_PENALTY),
)
# A requested response format as the conventions' `gen_ai.output.type`.
_OUTPUT_TYPES = {"text": "text", "json_object": "json", "json_schema": "json"}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# Every request key `request_attributes` reads: a body with none of them (model and messages, say) is
# done with at once.
_REQUEST_KEYS = frozenset(
    {
        "max_tokens", "max_completion_tokens", "max_output_tokens", "temperature", "top_p", "top_k",
        "frequency_penalty", "presence_penalty", "n", "seed", "stop", "response_format", "text",
        "service_tier", "encoding_format", "dimensions", "conversation",
    }
)  # fmt: skip


def request_attributes(body: Mapping[str, Any]) -> dict[str, Any]:
    """What the request asked for, under the GenAI (and OpenAI) names; only what it set."""
    attributes: dict[str, Any] = {}
    if _REQUEST_KEYS.isdisjoint(body):
        return attributes
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens", body.get("max_output_tokens")))
    if _is_int(max_tokens):
        attributes[names.GEN_AI_REQUEST_MAX_TOKENS] = max_tokens
    for key, attribute in _FLOAT_PARAMETERS:
        value = body.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            attributes[attribute] = float(value)
    n = body.get("n")
    if _is_int(n) and n != 1:  # the conventions ask for it only when it is not 1
        attributes[names.GEN_AI_REQUEST_CHOICE_COUNT] = n
    seed = body.get("seed")
    if _is_int(seed):
        attributes[names.GEN_AI_REQUEST_SEED] = seed
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if isinstance(stop, list) and stop and all(isinstance(item, str) for item in stop):
        attributes[names.GEN_AI_REQUEST_STOP_SEQUENCES] = tuple(stop)
    output_type = _output_type(body)
    if output_type is not None:
        attributes[names.GEN_AI_OUTPUT_TYPE] = output_type
    service_tier = body.get("service_tier")
    if isinstance(service_tier, str) and service_tier:
        attributes[names.OPENAI_REQUEST_SERVICE_TIER] = service_tier
    encoding_format = body.get("encoding_format")
    if isinstance(encoding_format, str) and encoding_format:
        attributes[names.GEN_AI_REQUEST_ENCODING_FORMATS] = (encoding_format,)
    dimensions = body.get("dimensions")
    if _is_int(dimensions):
        attributes[names.GEN_AI_EMBEDDINGS_DIMENSION_COUNT] = dimensions
    conversation = body.get("conversation")  # the Responses API's conversation: an id, or {"id": ...}
    conversation_id = conversation if isinstance(conversation, str) else fields(conversation).get("id")
    if isinstance(conversation_id, str) and conversation_id:
        attributes[names.GEN_AI_CONVERSATION_ID] = conversation_id
    return attributes


def _output_type(body: Mapping[str, Any]) -> str | None:
    """`response_format.type` (chat), or `text.format.type` (the Responses API)."""
    kind = fields(body.get("response_format")).get("type")
    if kind is None:
        kind = fields(fields(body.get("text")).get("format")).get("type")
    return _OUTPUT_TYPES.get(kind) if isinstance(kind, str) else None


# --- responses ----------------------------------------------------------------------------------

_NOTHING: Mapping[str, Any] = {}


def fields(obj: Any) -> Mapping[str, Any]:
    """A payload's fields as a mapping: a decoded JSON object as it is, an SDK model's `__dict__`.

    A pydantic model keeps its declared fields in `__dict__` (asking it for a name it lacks goes
    through its metaclass and an exception, which is slow); the keys it does not know (vLLM's
    extras) are not among them. Anything else has no fields.
    """
    if type(obj) is dict:  # decoded JSON: the usual case first, without the ABC's check
        return obj
    if obj is None:
        return _NOTHING
    if isinstance(obj, Mapping):
        return obj
    found = getattr(obj, "__dict__", None)
    return found if isinstance(found, Mapping) else _NOTHING


@dataclass(slots=True)
class ChunkInfo:
    """What one streamed event (or one non-streamed body) says about the call."""

    content: bool = False
    """Carries generated tokens: answer text, a refusal, tool-call arguments or reasoning."""
    done: bool = False
    """The event's data was the `[DONE]` sentinel."""
    response_id: str | None = None
    model: str | None = None
    finish_reasons: list[str] = field(default_factory=list)
    finish_indexes: list[int] = field(default_factory=list)
    """The choice index of each finish reason (streamed choices finish in chunks of their own)."""
    input_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    error: bool = False
    """The payload is an error object, a Responses `error` event, or a failed response."""
    attributes: dict[str, Any] | None = None
    """Other response attributes it carries (`response_attributes`, `usage_attributes`)."""


# Responses API events whose `delta` is generated output (answer text, a refusal, arguments, reasoning).
RESPONSES_DELTAS = frozenset(
    {
        "response.output_text.delta",
        "response.refusal.delta",
        "response.function_call_arguments.delta",
        "response.reasoning_text.delta",
    }
)
_RESPONSES_FINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})
# A Responses status as a finish reason, where no `incomplete_details.reason` says more.
RESPONSES_FINISH = {"completed": "stop", "incomplete": "length", "failed": "error"}


# --- does a chunk carry tokens: the one rule -----------------------------------------------------------

# A choice carries generated tokens when its `text`, or its delta's (a whole message's) `content`, `refusal`,
# `reasoning_content` (DeepSeek) or `reasoning` (vLLM) is a non-empty string, or its `tool_calls` a non-empty
# list; a Responses event when it is one of `RESPONSES_DELTAS` with a non-empty `delta`. Every reader of a
# stream applies it through the functions below: the adapters, the hedge, the load tool.
_TOKEN_TEXTS = ("content", "refusal", "reasoning_content", "reasoning")


def carries_tokens(chunk: Any) -> bool:
    """Whether a streamed chunk carries generated tokens: a chat or completions chunk or a Responses event, as
    an SDK object or decoded JSON."""
    obj = _said(chunk)
    kind = obj.get("type")
    if isinstance(kind, str):
        return kind in RESPONSES_DELTAS and _text(obj.get("delta")) is not None
    choices = obj.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            if choice_carries_tokens(choice):
                return True
    return False


def choice_carries_tokens(choice: Any) -> bool:
    """`carries_tokens` for one choice of a chunk (or of a whole response), an SDK object or decoded JSON. On a
    stream's per-chunk path: plain look-ups, no helper per field."""
    found = _said(choice)
    text = found.get("text")
    if text and isinstance(text, str):
        return True
    message = found.get("delta")
    if message is None:
        message = found.get("message")
        if message is None:
            return False
    said = _said(message)
    tool_calls = said.get("tool_calls")
    if tool_calls and isinstance(tool_calls, list):
        return True
    for key in _TOKEN_TEXTS:
        value = said.get(key)
        if value and isinstance(value, str):
            return True
    extra = getattr(message, "__pydantic_extra__", None)  # what an SDK's types do not declare (`reasoning`)
    if extra:
        for key in _TOKEN_TEXTS:
            value = extra.get(key)
            if value and isinstance(value, str):
                return True
    return False


def _said(obj: Any) -> Mapping[str, Any]:
    """`fields`, with the two usual cases first: decoded JSON, and an SDK model's own attributes."""
    if type(obj) is dict:
        return obj
    found = getattr(obj, "__dict__", None)
    return found if type(found) is dict else fields(obj)


_UNFINISHED = '"finish_reason":null'
_USAGE = '"usage":{'
_INDEX = '"index":'
_TOOL_CALLS = '"tool_calls":['
_OPENED = tuple(f'"{key}":"' for key in ("text", *_TOKEN_TEXTS))  # a string field opened, maybe empty
_COMPACT: dict[type, tuple[Any, ...]] = {  # each key as the data's own type: str or bytes
    str: (_UNFINISHED, _USAGE, _INDEX, _TOOL_CALLS, _OPENED, '"', "{"),
    bytes: (
        _UNFINISHED.encode(), _USAGE.encode(), _INDEX.encode(), _TOOL_CALLS.encode(),
        tuple(key.encode() for key in _OPENED), b'"', b"{",
    ),
}  # fmt: skip


def compact_carries_tokens(data: str | bytes) -> bool | None:
    """`carries_tokens` read off one event's data as compact JSON text (str or bytes), without decoding it:
    for a mid-stream chat or completions chunk (one choice, unfinished, no usage); None for any other data,
    which only decoding can tell. In compact JSON a key and its opening quote cannot occur inside a string
    (quotes there are escaped)."""
    unfinished, usage, index, tool_calls, opened, quote, brace = _COMPACT[type(data)]
    if not data.startswith(brace) or unfinished not in data or usage in data or data.count(index) != 1:
        return None
    for key in opened:
        at = data.find(key)
        if at >= 0:
            after = data[at + len(key) : at + len(key) + 1]
            if after and after != quote:  # a non-empty string
                return True
    return tool_calls in data


def event_carries_tokens(data: str | bytes) -> bool:
    """`carries_tokens` for one event's data as it came (decoded only where the compact read cannot tell)."""
    found = compact_carries_tokens(data)
    if found is None:
        obj = load(data)
        found = obj is not None and carries_tokens(obj)
    return found


def classify(event_name: str | None, data: str) -> ChunkInfo | None:
    """Describe one SSE event's data; None when it is neither `[DONE]` nor a JSON object.

    The Responses API event type is taken from the payload's `type`, else from `event_name`.
    """
    if data.strip() == "[DONE]":
        return ChunkInfo(done=True)
    obj = load(data)
    return None if obj is None else classify_payload(event_name, obj)


def classify_payload(event_name: str | None, obj: Mapping[str, Any]) -> ChunkInfo:
    """`classify` for an event's data already decoded (a reader that also keeps the content)."""
    kind = obj.get("type")
    if not isinstance(kind, str):
        kind = event_name
    if kind is not None and (kind == "error" or kind.startswith("response.")):
        return _responses_event(kind, obj)
    return _completion(obj)


def classify_json_body(body: bytes) -> ChunkInfo | None:
    """Describe a non-streamed JSON response; None when the body is not a JSON object."""
    obj = load(body)
    return None if obj is None else read_payload(obj)


def read_payload(payload: Any) -> ChunkInfo:
    """A whole non-streamed response, decoded or an SDK object: chat.completion, text_completion,
    an embeddings list or a Responses `response` object.

    `content` says whether it holds generated output.
    """
    top = fields(payload)
    if top.get("object") == "response" or top.get("output") is not None:
        info = ChunkInfo(error=_is_error(top))
        _read_response(top, info, final=True)
        _read_response_output(top.get("output"), info)
        return info
    return _completion(top)


def read_outcome(payload: Any) -> ChunkInfo:
    """`read_payload` for a reader that captures no content: the same response id, model, finish
    reasons, usage and attributes, without reading the answer's text (the per-call path of a sampled
    call). A Responses `response` object is read by `read_payload` itself."""
    top = fields(payload)
    if top.get("object") == "response" or top.get("output") is not None:
        return read_payload(payload)
    info = ChunkInfo(response_id=_text(top.get("id")), model=_text(top.get("model")))
    info.attributes = response_attributes(top)
    choices = top.get("choices")
    if isinstance(choices, list):
        reasons, indexes = info.finish_reasons, info.finish_indexes
        for raw_choice in choices:
            choice = fields(raw_choice)
            reason = choice.get("finish_reason")
            if isinstance(reason, str):
                reasons.append(reason)
                index = choice.get("index")
                indexes.append(index if type(index) is int else len(indexes))
    _read_usage(top.get("usage"), info)
    return info


def load(data: str | bytes) -> dict[str, Any] | None:
    """A JSON object from an event's data or a body; None for anything else."""
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError):  # ValueError covers bad JSON and bad UTF-8 in bytes
        return None
    return obj if isinstance(obj, dict) else None


def _count(value: Any) -> int | None:
    """A token count only when it is a real non-negative int (a bool is not a count)."""
    return value if type(value) is int and value >= 0 else None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _is_error(obj: Mapping[str, Any]) -> bool:
    error = obj.get("error")
    return fields(error) is not _NOTHING or _text(error) is not None or obj.get("object") == "error"


def _completion(obj: Mapping[str, Any]) -> ChunkInfo:
    """A chat or legacy completion, streamed chunk or whole body, or an embeddings list."""
    info = ChunkInfo(response_id=_text(obj.get("id")), model=_text(obj.get("model")), error=_is_error(obj))
    info.attributes = response_attributes(obj)
    choices = obj.get("choices")
    if isinstance(choices, list):
        for raw_choice in choices:
            choice = fields(raw_choice)
            if not choice:
                continue
            reason = choice.get("finish_reason")
            if isinstance(reason, str):
                info.finish_reasons.append(reason)
                index = choice.get("index")
                info.finish_indexes.append(index if type(index) is int else len(info.finish_indexes))
            if not info.content and choice_carries_tokens(choice):
                info.content = True
    _read_usage(obj.get("usage"), info)
    return info


def _responses_event(kind: str, obj: Mapping[str, Any]) -> ChunkInfo:
    info = ChunkInfo()
    if kind in RESPONSES_DELTAS:
        info.content = _text(obj.get("delta")) is not None  # `carries_tokens`, the kind already known
        return info
    if kind == "error":
        info.error = True
        return info
    response = fields(obj.get("response"))
    final = kind in _RESPONSES_FINAL
    if response:
        _read_response(response, info, final=final, kind=kind)
    elif final:
        _finish_response(kind[len("response.") :], None, info)
    if kind == "response.failed":
        info.error = True
    return info


def read_response_event(kind: Any, response: Any) -> ChunkInfo:
    """A Responses stream event that carries the `response` object (created, completed, ...)."""
    info = ChunkInfo()
    response_fields = fields(response)
    if response_fields:
        _read_response(response_fields, info, final=kind in _RESPONSES_FINAL, kind=str(kind))
    return info


def _read_response(response: Mapping[str, Any], info: ChunkInfo, *, final: bool, kind: str = "") -> None:
    info.response_id = _text(response.get("id"))
    info.model = _text(response.get("model"))
    info.attributes = response_attributes(response)
    _read_usage(response.get("usage"), info)
    if final:
        status = response.get("status")
        if not isinstance(status, str):
            status = kind[len("response.") :]
        _finish_response(status, response.get("incomplete_details"), info)


def _finish_response(status: str, incomplete_details: Any, info: ChunkInfo) -> None:
    reason: str | None
    if status == "incomplete":
        reason = _text(fields(incomplete_details).get("reason")) or RESPONSES_FINISH[status]
    else:
        reason = RESPONSES_FINISH.get(status)
    if reason is None:
        return
    info.finish_reasons.append(reason)
    info.finish_indexes.append(0)
    if status == "failed":
        info.error = True


def _read_response_output(output: Any, info: ChunkInfo) -> None:
    if not isinstance(output, list):
        return
    for raw_item in output:
        item = fields(raw_item)
        if not item:
            continue
        if item.get("type") != "message":
            info.content = True  # function calls, reasoning and other generated items
            return
        parts = item.get("content")
        for raw_part in parts if isinstance(parts, list) else ():
            part = fields(raw_part)
            if _text(part.get("text")) or _text(part.get("refusal")):
                info.content = True
                return


def read_usage(usage: Any) -> tuple[int | None, int | None, int | None]:
    """Input, output and cached input token counts, under either naming (`prompt_tokens` for chat and
    completions, `input_tokens` for the Responses API); None where the server gave no count."""
    counts = fields(usage)
    if not counts:
        return None, None, None
    get = counts.get  # `_first_count` and `_count`, inlined: this runs on every call
    input_tokens = get("prompt_tokens")
    if type(input_tokens) is not int or input_tokens < 0:
        input_tokens = get("input_tokens")
        if type(input_tokens) is not int or input_tokens < 0:
            input_tokens = None
    output_tokens = get("completion_tokens")
    if type(output_tokens) is not int or output_tokens < 0:
        output_tokens = get("output_tokens")
        if type(output_tokens) is not int or output_tokens < 0:
            output_tokens = None
    cached = None
    for key in _CACHED_IN:
        details = get(key)
        if details is not None:
            cached = fields(details).get("cached_tokens")
            if type(cached) is int and cached >= 0:
                break
            cached = None
    return input_tokens, output_tokens, cached


_CACHED_IN = ("prompt_tokens_details", "input_tokens_details")


def _read_usage(usage: Any, info: ChunkInfo) -> None:
    if usage is not None:
        info.input_tokens, info.output_tokens, info.cached_tokens = read_usage(usage)
        more = usage_attributes(usage)
        if more:
            info.attributes = more if info.attributes is None else {**info.attributes, **more}


def response_attributes(response: Mapping[str, Any]) -> dict[str, Any] | None:
    """A response's service tier and system fingerprint, and an embeddings list's vector size."""
    found: dict[str, Any] | None = None
    for key, attribute in (
        ("service_tier", names.OPENAI_RESPONSE_SERVICE_TIER),
        ("system_fingerprint", names.OPENAI_RESPONSE_SYSTEM_FINGERPRINT),
    ):
        value = response.get(key)
        if isinstance(value, str) and value:
            found = found or {}
            found[attribute] = value
    if response.get("object") == "list":
        dimensions = _dimensions(response.get("data"))
        if dimensions is not None:
            found = found or {}
            found[names.GEN_AI_EMBEDDINGS_DIMENSION_COUNT] = dimensions
    return found


def _dimensions(data: Any) -> int | None:
    """The size of the first embedding: a list of floats, or base64 of little-endian float32s."""
    if not isinstance(data, list) or not data:
        return None
    vector = fields(data[0]).get("embedding")
    if isinstance(vector, list):
        return len(vector)
    if isinstance(vector, str) and vector:
        return (len(vector) * 3 // 4 - len(vector) + len(vector.rstrip("="))) // 4
    return None


def usage_attributes(usage: Any) -> dict[str, int] | None:
    """Reasoning tokens and tokens written to the prompt cache, where the usage block has them.

    Reasoning: `completion_tokens_details` (chat) or `output_tokens_details` (Responses). Cache
    writes: `cache_creation_input_tokens` (Anthropic's spelling, which compatible servers copy), else
    `cache_write_tokens` or `cache_creation_tokens` in the prompt/input token details.
    """
    counts = fields(usage)
    if not counts:
        return None
    get = counts.get  # `_count` inlined: this runs on every sampled call
    found: dict[str, int] | None = None
    for key in _REASONING_IN:
        details = get(key)
        if details is not None:
            reasoning = fields(details).get("reasoning_tokens")
            if type(reasoning) is int and reasoning >= 0:
                found = {names.GEN_AI_USAGE_REASONING_OUTPUT_TOKENS: reasoning}
                break
    created = get("cache_creation_input_tokens")
    if type(created) is not int or created < 0:
        created = None
        for key in _CACHED_IN:
            details = get(key)
            if details is not None:
                written = fields(details)
                created = _first_count(
                    written.get("cache_write_tokens"), written.get("cache_creation_tokens")
                )
                if created is not None:
                    break
    if created is not None:
        if found is None:
            found = {}
        found[names.GEN_AI_USAGE_CACHE_CREATION_INPUT_TOKENS] = created
    return found


_REASONING_IN = ("completion_tokens_details", "output_tokens_details")


def _first_count(preferred: Any, fallback: Any) -> int | None:
    count = _count(preferred)
    return count if count is not None else _count(fallback)
