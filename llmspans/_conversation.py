"""The conversation of an OpenAI-compatible call as the GenAI conventions' messages.

`input_messages` and `system_instructions` turn a request body into `gen_ai.input.messages` and
`gen_ai.system_instructions`; `OutputMessages` assembles `gen_ai.output.messages` from a whole
response or, chunk by chunk, from a stream: one message per choice, in index order, each with its
own finish reason, tool calls assembled from their fragments. Both client families feed it (the
openai SDK's objects and decoded JSON read alike), so both record the same JSON. It runs only when
content capture is on; nothing here raises on odd input. The shapes, and the choices where the
conventions are silent, are in docs/telemetry.md ("Message content").
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

__all__ = ["OutputMessages", "input_messages", "system_instructions"]

Part = dict[str, Any]
Message = dict[str, Any]

# --- reading a decoded object or an SDK model alike ---------------------------------------------

_MISSING = object()


def _get(obj: Any, key: str) -> Any:
    """A field of a decoded JSON object or of an SDK (pydantic) model, extras included; None if absent.

    A model keeps its declared fields in `__dict__` and the ones its type does not know (vLLM's
    `reasoning_content`) in `__pydantic_extra__`: read both without `getattr`'s exception path.
    """
    if type(obj) is dict:
        return obj.get(key)
    found = getattr(obj, "__dict__", None)
    if found is not None:
        value = found.get(key, _MISSING)
        if value is not _MISSING:
            return value
        extra = getattr(obj, "__pydantic_extra__", None)
        return extra.get(key) if extra else None
    return obj.get(key) if isinstance(obj, Mapping) else None


_NO_FIELDS: Mapping[str, Any] = {}


def _fields(obj: Any) -> Mapping[str, Any]:
    """An object's fields at once, for reading several (the per-chunk path): a decoded object's own
    keys, or an SDK model's declared fields (its extras are in `__pydantic_extra__`)."""
    if type(obj) is dict:
        return obj
    found = getattr(obj, "__dict__", None)
    if found is not None:
        return found  # type: ignore[no-any-return]
    return obj if isinstance(obj, Mapping) else _NO_FIELDS


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _plain(value: Any, depth: int = 0) -> Any:
    """JSON-ready data from decoded JSON or SDK models (arguments given as an object, not as JSON text)."""
    if value is None or isinstance(value, (str, int, float, bool)) or depth > 32:
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(item, depth + 1) for item in value]
    fields = value if isinstance(value, Mapping) else getattr(value, "__dict__", None)
    if not isinstance(fields, Mapping):
        return str(value)
    plain = {str(key): _plain(item, depth + 1) for key, item in fields.items() if item is not None}
    extra = getattr(value, "__pydantic_extra__", None)
    if extra:
        plain.update({str(key): _plain(item, depth + 1) for key, item in extra.items() if item is not None})
    return plain


def _arguments(raw: Any) -> Any:
    """Tool-call arguments as the conventions want them: the object the JSON text says, else the text."""
    if not isinstance(raw, str):
        return _plain(raw)
    if not raw:
        return None
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return raw  # not JSON (or cut short): the text as the model wrote it


def _tool_call(call_id: Any, name: Any, arguments: Any) -> Part:
    return {
        "type": "tool_call",
        "id": call_id if isinstance(call_id, str) else None,
        "name": name if isinstance(name, str) else "",
        "arguments": _arguments(arguments),
    }


# --- media ----------------------------------------------------------------------------------

_AUDIO_TYPES = {"wav": "audio/wav", "mp3": "audio/mpeg", "flac": "audio/flac", "opus": "audio/opus"}


def _media(uri: Any, modality: str, keep_bytes: bool) -> Part | None:
    """A URL as a `uri` part, or a `data:` URL as a `blob` part (its bytes only when `keep_bytes`)."""
    if not isinstance(uri, str) or not uri:
        return None
    if not uri.startswith("data:"):
        return {"type": "uri", "modality": modality, "uri": uri}
    comma = uri.find(",")  # the bytes after it are copied only when they are kept
    mime = uri[len("data:") : comma if comma >= 0 else len(uri)].split(";", 1)[0]
    return _blob(modality, mime or None, uri[comma + 1 :] if keep_bytes and comma >= 0 else "")


def _blob(modality: str, mime_type: str | None, content: str) -> Part:
    """Inline bytes: base64 as sent, or "" when they are left out (the part still says what was there)."""
    return {"type": "blob", "modality": modality, "mime_type": mime_type, "content": content}


def _audio(audio: Any, keep_bytes: bool) -> Part:
    kind = _get(audio, "format")
    data = _get(audio, "data")
    mime = _AUDIO_TYPES.get(kind, f"audio/{kind}") if isinstance(kind, str) and kind else None
    return _blob("audio", mime, data if keep_bytes and isinstance(data, str) else "")


def _file(file_id: Any, modality: str) -> Part | None:
    return {"type": "file", "modality": modality, "file_id": file_id} if _text(file_id) else None


def _content_part(raw: Any, keep_bytes: bool) -> Part | None:
    """One part of a message's content, chat or Responses spelling, as a conventions' part."""
    if isinstance(raw, str):
        return {"type": "text", "content": raw}
    kind = _get(raw, "type")
    if kind in ("text", "input_text", "output_text"):
        text = _get(raw, "text")
        return {"type": "text", "content": text if isinstance(text, str) else ""}
    if kind == "refusal":
        refusal = _get(raw, "refusal")
        return {"type": "text", "content": refusal if isinstance(refusal, str) else ""}
    if kind == "image_url":  # chat: {"image_url": {"url": ..., "detail": ...}}
        return _media(_get(_get(raw, "image_url"), "url"), "image", keep_bytes)
    if kind == "input_image":  # Responses: {"image_url": ...} or {"file_id": ...}
        return _media(_get(raw, "image_url"), "image", keep_bytes) or _file(_get(raw, "file_id"), "image")
    if kind == "input_audio":
        return _audio(_get(raw, "input_audio"), keep_bytes)
    if kind in ("file", "input_file"):  # chat nests its fields under "file"; Responses does not
        fields = _get(raw, "file") if kind == "file" else raw
        return (
            _file(_get(fields, "file_id"), "document")
            or _media(_get(fields, "file_url"), "document", keep_bytes)
            or _media(_get(fields, "file_data"), "document", keep_bytes)
        )
    return {"type": kind} if isinstance(kind, str) and kind else None


def _content_parts(content: Any, keep_bytes: bool) -> list[Part]:
    if isinstance(content, str):
        return [{"type": "text", "content": content}]
    parts = [_content_part(raw, keep_bytes) for raw in _list(content)]
    return [part for part in parts if part is not None]


# --- the request --------------------------------------------------------------------------------


def input_messages(body: Mapping[str, Any], keep_bytes: bool = False) -> list[Message] | None:
    """The request's conversation: chat `messages`, a completion's `prompt`, the Responses API's or an
    embeddings request's `input`; None when it has none. Inline media keeps its bytes only with
    `keep_bytes`."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return [
            _chat_message(m, keep_bytes) for m in messages if isinstance(m, Mapping) or hasattr(m, "__dict__")
        ]
    for key in ("prompt", "input"):
        value = body.get(key)
        if isinstance(value, str):
            return [{"role": "user", "parts": [{"type": "text", "content": value}]}]
        if isinstance(value, list):
            # A list of texts (embeddings, legacy completions: one message each), or the Responses
            # API's input items; token-id lists are not text and are left out.
            found = [
                {"role": "user", "parts": [{"type": "text", "content": item}]}
                if isinstance(item, str)
                else _input_item(item, keep_bytes)
                for item in value
                if not isinstance(item, (int, float, list))
            ]
            return [message for message in found if message is not None]
    return None


def _chat_message(raw: Any, keep_bytes: bool) -> Message:
    role = _get(raw, "role")
    role = role if isinstance(role, str) else "user"
    content = _get(raw, "content")
    if role in ("tool", "function"):
        response = content if isinstance(content, str) else _content_parts(content, keep_bytes)
        return _message(role, [{"type": "tool_call_response", "id": _get(raw, "tool_call_id"), "response": response}], raw)  # fmt: skip
    parts: list[Part] = []
    reasoning = _text(_get(raw, "reasoning_content")) or _text(_get(raw, "reasoning"))
    if reasoning is not None:  # an assistant turn sent back with its reasoning (vLLM, DeepSeek)
        parts.append({"type": "reasoning", "content": reasoning})
    parts += _content_parts(content, keep_bytes)
    refusal = _text(_get(raw, "refusal"))
    if refusal is not None:
        parts.append({"type": "text", "content": refusal})
    for call in _list(_get(raw, "tool_calls")):
        function = _get(call, "function")
        parts.append(_tool_call(_get(call, "id"), _get(function, "name"), _get(function, "arguments")))
    function_call = _get(raw, "function_call")  # the deprecated single-function form
    if function_call is not None:
        parts.append(_tool_call(None, _get(function_call, "name"), _get(function_call, "arguments")))
    return _message(role, parts, raw)


def _message(role: str, parts: list[Part], raw: Any) -> Message:
    message: Message = {"role": role, "parts": parts}
    name = _text(_get(raw, "name"))
    if name is not None:
        message["name"] = name
    return message


def _input_item(raw: Any, keep_bytes: bool) -> Message | None:
    """One Responses API input item: a message, a tool call and its output, reasoning, or another item."""
    kind = _get(raw, "type")
    role = _get(raw, "role")
    if kind in (None, "message") and isinstance(role, str):
        return _message(role, _content_parts(_get(raw, "content"), keep_bytes), raw)
    if isinstance(kind, str) and kind.endswith("_output"):  # a tool's result: function_call_output, ...
        output = _get(raw, "output")
        response = output if isinstance(output, str) else _content_parts(output, keep_bytes)
        return {"role": "tool", "parts": [{"type": "tool_call_response", "id": _get(raw, "call_id"), "response": response}]}  # fmt: skip
    if kind == "item_reference":  # an earlier item, by id: its content is not in this request
        return {"role": "user", "parts": [{"type": kind, "id": _get(raw, "id")}]}
    parts = _output_item(raw)
    if parts is None:
        return None
    return {"role": "assistant", "parts": parts}


def system_instructions(body: Mapping[str, Any]) -> list[Part] | None:
    """The Responses API's `instructions`, given apart from the conversation. Chat `system` and
    `developer` messages are part of the conversation: they stay in the input messages, as the
    conventions say."""
    instructions = _text(body.get("instructions"))
    return [{"type": "text", "content": instructions}] if instructions is not None else None


# --- the answer ---------------------------------------------------------------------------------

# The output schema's finish reasons, from the OpenAI names where they differ.
_FINISH_REASONS = {"tool_calls": "tool_call", "function_call": "tool_call", "max_output_tokens": "length"}
_TOOL_CALL_ITEMS = frozenset({"function_call", "custom_tool_call"})


def _output_item(item: Any) -> list[Part] | None:
    """The parts one Responses output item holds (assistant message, tool call, reasoning, server tool)."""
    kind = _get(item, "type")
    if kind == "message":
        return _content_parts(_get(item, "content"), keep_bytes=False)
    if kind == "function_call":
        return [_tool_call(_get(item, "call_id"), _get(item, "name"), _get(item, "arguments"))]
    if kind == "custom_tool_call":
        return [_tool_call(_get(item, "call_id"), _get(item, "name"), _get(item, "input"))]
    if kind == "reasoning":
        texts = [
            _get(entry, "text") for entry in (*_list(_get(item, "summary")), *_list(_get(item, "content")))
        ]
        return [{"type": "reasoning", "content": text} for text in texts if _text(text) is not None]
    if isinstance(kind, str) and kind:
        # A tool the provider ran itself (web search, code interpreter, ...): named, details left out.
        name = kind[: -len("_call")] if kind.endswith("_call") else kind
        return [{"type": "server_tool_call", "id": _get(item, "id"), "name": name, "server_tool_call": {"type": name}}]  # fmt: skip
    return None


def noted(kept: str, cut: int) -> str:
    """A text shortened by `cut` characters, with the note that says so (`_content` shortens the same way)."""
    return f"{kept}…[+{cut} chars]" if cut else kept


class _Pieces(list[str]):
    """The pieces of one text as they arrived; past its owner's limit they are only counted."""

    __slots__ = ("dropped",)

    def __init__(self) -> None:
        super().__init__()
        self.dropped = 0

    def text(self) -> str:
        return noted("".join(self), self.dropped)


class _Choice:
    """One choice of a chat or completion answer as its pieces arrive, kept to `limit` chars in all."""

    __slots__ = ("finish", "function", "reasoning", "refusal", "size", "text", "tools")

    def __init__(self) -> None:
        self.text = _Pieces()
        self.reasoning: _Pieces | None = None
        self.refusal: _Pieces | None = None
        self.tools: dict[int, _ToolCall] | None = None
        self.function: _ToolCall | None = None
        self.finish: str | None = None
        self.size = 0

    def parts(self) -> list[Part]:
        parts: list[Part] = []
        if self.reasoning is not None:
            parts.append({"type": "reasoning", "content": self.reasoning.text()})
        text = self.text.text()
        if text:
            parts.append({"type": "text", "content": text})
        if self.refusal is not None:
            parts.append({"type": "text", "content": self.refusal.text()})
        for key in sorted(self.tools or ()):
            parts.append(self.tools[key].part())  # type: ignore[index]
        if self.function is not None:
            parts.append(self.function.part())
        return parts


class _ToolCall:
    __slots__ = ("arguments", "call_id", "name")

    def __init__(self) -> None:
        self.call_id: str | None = None
        self.name: str | None = None
        self.arguments = _Pieces()

    def part(self) -> Part:
        return _tool_call(self.call_id, self.name, self.arguments.text())


class _Item:
    """One Responses output item as its events arrive: what `output_item.added` said, its deltas, or,
    once `output_item.done` came, its parts."""

    __slots__ = ("buffers", "call_id", "kind", "name", "parts", "size")

    def __init__(self) -> None:
        self.size = 0
        self.kind: Any = None
        self.call_id: Any = None
        self.name: Any = None
        self.buffers: dict[tuple[str, Any], _Pieces] = {}
        self.parts: list[Part] | None = None

    def built(self) -> list[Part]:
        if self.parts is not None:
            return self.parts
        parts: list[Part] = []
        for (kind, _), pieces in self.buffers.items():
            if kind == "text":
                parts.append({"type": "text", "content": pieces.text()})
            elif kind == "reasoning":
                parts.append({"type": "reasoning", "content": pieces.text()})
        if self.kind in _TOOL_CALL_ITEMS:
            arguments = self.buffers.get(("arguments", None))
            parts.append(_tool_call(self.call_id, self.name, arguments.text() if arguments else ""))
        return parts


# The Responses stream's delta events: which buffer of its item each one adds to.
_RESPONSES_DELTAS = {
    "response.output_text.delta": ("text", "content_index"),
    "response.refusal.delta": ("text", "content_index"),
    "response.reasoning_summary_text.delta": ("reasoning", "summary_index"),
    "response.reasoning_text.delta": ("reasoning", "content_index"),
    "response.function_call_arguments.delta": ("arguments", None),
    "response.custom_tool_call_input.delta": ("arguments", None),
}
_RESPONSES_FINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})


class OutputMessages:
    """Assembles one call's output messages from what the response says, whole or chunk by chunk.

    Per chunk it keeps only the pieces of text the answer is made of, each choice's kept to `limit`
    characters (what is recorded is capped anyway); a chunk adds no object of its own. `messages()`
    is None when the model answered nothing (a failed call, a stream cut before its first token).
    """

    __slots__ = ("_choices", "_items", "_limit", "_status")

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._choices: dict[int, _Choice] = {}
        self._items: dict[int, _Item] | None = None  # a Responses answer's items, by output index
        self._status: str | None = None  # a Responses answer's finish reason, once said

    # --- whole responses ---

    def whole(self, payload: Any) -> None:
        """A complete response: a chat completion, a text completion, or a Responses `response`."""
        if _get(payload, "object") == "response" or _get(payload, "output") is not None:
            self._response(payload)
            return
        for position, raw in enumerate(_list(_get(payload, "choices"))):
            choice = self._choice(_get(raw, "index"), position)
            message = _get(raw, "message")
            if message is not None:
                self._chat_delta(choice, message)
            else:
                self._add(choice, choice.text, _get(raw, "text"))
            reason = _get(raw, "finish_reason")
            if isinstance(reason, str) and reason:
                choice.finish = reason

    # --- streams ---

    def chat_chunk(self, chunk: Any) -> None:
        """One streamed chat chunk: every choice it carries, text, refusal, reasoning and tool-call fragments."""
        choices = _get(chunk, "choices")
        if not choices or not isinstance(choices, list):
            return
        for position, raw in enumerate(choices):
            fields = _fields(raw)
            delta = fields.get("delta")
            reason = fields.get("finish_reason")
            if delta is not None or reason:
                reason = reason if isinstance(reason, str) else None
                index = fields.get("index")
                choice = self._choices.get(index) if type(index) is int else None  # `_choice`'s usual case
                if choice is None:
                    choice = self._choice(index, position)
                if delta is not None:
                    self._chat_delta(choice, delta)
                if reason:
                    choice.finish = reason

    def completion_chunk(self, chunk: Any) -> None:
        """One streamed legacy completion chunk."""
        for position, raw in enumerate(_list(_get(chunk, "choices"))):
            text = _get(raw, "text")
            reason = _text(_get(raw, "finish_reason"))
            if not text and not reason:
                continue
            choice = self._choice(_get(raw, "index"), position)
            self._add(choice, choice.text, text)
            if reason:
                choice.finish = reason

    def responses_event(self, event: Any) -> None:
        """One Responses API stream event: item starts, deltas, finished items, the final response."""
        kind = _get(event, "type")
        delta = _RESPONSES_DELTAS.get(kind) if isinstance(kind, str) else None
        if delta is not None:
            piece = _get(event, "delta")
            if not isinstance(piece, str) or not piece:
                return
            item = self._item(_get(event, "output_index"))
            if item.parts is None:
                buffer_kind, index_key = delta
                key = (buffer_kind, _get(event, index_key) if index_key else None)
                buffer = item.buffers.get(key)
                if buffer is None:
                    buffer = item.buffers[key] = _Pieces()
                if item.size < self._limit:
                    buffer.append(piece)
                    item.size += len(piece)
                else:
                    buffer.dropped += len(piece)
            return
        if kind == "response.output_item.added":
            raw = _get(event, "item")
            item = self._item(_get(event, "output_index"))
            item.kind, item.call_id, item.name = _get(raw, "type"), _get(raw, "call_id"), _get(raw, "name")
        elif kind == "response.output_item.done":
            self._item(_get(event, "output_index")).parts = _output_item(_get(event, "item")) or []
        elif kind in _RESPONSES_FINAL:
            response = _get(event, "response")
            if response is not None:
                self._response(response, final_kind=kind)

    def stream_payload(self, payload: Any) -> None:
        """A decoded SSE event of any of the three APIs (the plain-HTTP path, which reads bytes)."""
        kind = _get(payload, "type")
        if isinstance(kind, str) and kind.startswith("response."):
            self.responses_event(payload)
            return
        choices = _list(_get(payload, "choices"))
        if choices and _get(choices[0], "delta") is None and _get(choices[0], "text") is not None:
            self.completion_chunk(payload)
        else:
            self.chat_chunk(payload)

    # --- the result ---

    def messages(self) -> list[Message] | None:
        """One assistant message per choice, in index order; None when there is none to record."""
        if self._items is not None:
            return self._responses_message()
        found: list[Message] = []
        for index in sorted(self._choices):
            choice = self._choices[index]
            parts = choice.parts()
            if not parts:
                if choice.finish is None:
                    continue  # nothing came for this choice, and nothing said it was over
                parts = [{"type": "text", "content": ""}]  # an empty answer, finished
            found.append({"role": "assistant", "parts": parts, "finish_reason": _finish(choice.finish)})
        return found or None

    # --- inside ---

    def _choice(self, index: Any, position: int) -> _Choice:
        key = index if type(index) is int else position
        choice = self._choices.get(key)
        if choice is None:
            choice = self._choices[key] = _Choice()
        return choice

    def _add(self, choice: _Choice, buffer: _Pieces, piece: Any) -> None:
        if isinstance(piece, str) and piece:
            if choice.size < self._limit:
                buffer.append(piece)
                choice.size += len(piece)
            else:
                buffer.dropped += len(piece)

    def _chat_delta(self, choice: _Choice, delta: Any) -> None:
        """A chat message, or a streamed delta of one: both spell the same fields."""
        fields = _fields(delta)
        text = fields.get("content")
        if text and isinstance(text, str):  # `_add`, inlined: per chunk
            if choice.size < self._limit:
                choice.text.append(text)
                choice.size += len(text)
            else:
                choice.text.dropped += len(text)
        refusal = fields.get("refusal")
        if refusal:
            if choice.refusal is None:
                choice.refusal = _Pieces()
            self._add(choice, choice.refusal, refusal)
        # vLLM's and DeepSeek's reasoning, fields the SDK's types do not declare: a model's extras.
        more = fields if type(delta) is dict else getattr(delta, "__pydantic_extra__", None)
        if more:
            reasoning = more.get("reasoning_content") or more.get("reasoning")
            if isinstance(reasoning, str) and reasoning:
                if choice.reasoning is None:
                    choice.reasoning = _Pieces()
                self._add(choice, choice.reasoning, reasoning)
        tool_calls = fields.get("tool_calls")
        if tool_calls:
            tools = choice.tools
            if tools is None:
                tools = choice.tools = {}
            for position, raw in enumerate(tool_calls):
                index = _get(raw, "index")
                key = index if type(index) is int else position
                call = tools.get(key)
                if call is None:
                    call = tools[key] = _ToolCall()
                self._tool_fragment(choice, call, raw, _get(raw, "function"))
        function_call = fields.get("function_call")
        if function_call is not None:
            if choice.function is None:
                choice.function = _ToolCall()
            self._tool_fragment(choice, choice.function, None, function_call)

    def _tool_fragment(self, choice: _Choice, call: _ToolCall, raw: Any, function: Any) -> None:
        call_id = _get(raw, "id") if raw is not None else None
        if isinstance(call_id, str) and call_id:
            call.call_id = call_id
        name = _get(function, "name")
        if isinstance(name, str) and name:
            call.name = name
        self._add(choice, call.arguments, _get(function, "arguments"))

    def _item(self, output_index: Any) -> _Item:
        items = self._items
        if items is None:
            items = self._items = {}
        key = output_index if type(output_index) is int else len(items)
        item = items.get(key)
        if item is None:
            item = items[key] = _Item()
        return item

    def _response(self, response: Any, final_kind: str | None = None) -> None:
        """A whole Responses `response` (a body, or the final stream event): its output is authoritative."""
        output = _get(response, "output")
        if isinstance(output, list) and output:
            self._items = {}
            for position, raw in enumerate(output):
                item = self._item(position)
                item.kind = _get(raw, "type")
                item.parts = _output_item(raw) or []
        elif self._items is None:
            self._items = {}
        status = _get(response, "status")
        if not isinstance(status, str) and final_kind is not None:
            status = final_kind[len("response.") :]
        if status == "completed":
            self._status = "stop"
        elif status == "incomplete":
            reason = _text(_get(_get(response, "incomplete_details"), "reason"))
            self._status = reason or "length"
        elif status in ("failed", "cancelled"):
            self._status = "error"

    def _responses_message(self) -> list[Message] | None:
        """A Responses answer is one generation: one message holding every item's parts, in order."""
        items = self._items or {}
        parts = [part for key in sorted(items) for part in items[key].built()]
        status = self._status
        if status == "stop" and any(items[key].kind in _TOOL_CALL_ITEMS for key in items):
            status = "tool_call"
        if not parts:
            if status is None or status == "error":
                return None  # the model returned nothing
            parts = [{"type": "text", "content": ""}]
        return [{"role": "assistant", "parts": parts, "finish_reason": _finish(status)}]


def _finish(reason: str | None) -> str:
    """A choice's finish reason in the output schema's terms; `error` when nothing said it was over
    (a stream cut short after some of the answer came)."""
    if reason is None:
        return "error"
    return _FINISH_REASONS.get(reason, reason)
