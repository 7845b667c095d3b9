"""Watching a Server-Sent-Events body as it is read, and telling what each event carries.

The transport hands `SSEObserver.feed` every piece of the body the application reads, in
whatever pieces the network delivered. The observer never changes or holds back those bytes:
it decodes them, keeps only the unterminated last line and the event being assembled, and
calls back once per complete event. Parsing follows the WHATWG rules
(https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation).

`classify` turns one event's data into a `ChunkInfo` for OpenAI-compatible streams (chat
completions, legacy completions, the Responses API); `classify_json_body` does the same for a
non-streamed JSON body. Neither raises on odd input: servers differ, and telemetry must not
break the call it watches.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ChunkInfo", "SSEObserver", "classify", "classify_json_body"]

DEFAULT_MAX_EVENT_BYTES = 16 * 1024 * 1024


def _utf8_len(text: str) -> int:
    # isascii() is O(1) in CPython, so the common (ASCII JSON) case costs nothing extra.
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


class SSEObserver:
    """Feed raw body bytes; `on_event(event_name, data)` is called for each complete event.

    What the caller can rely on:

    - Chunks may be split anywhere: mid-line, mid-UTF-8 character, between the CR and LF of
      one line ending. The events are the same as if the body had been fed in one piece.
    - Lines end with CRLF, LF or CR; a blank line dispatches the event; `data:` lines are
      joined with "\\n"; one space after the colon is dropped; `:` lines are comments;
      `event:` names the event (`event_name` is None when there was no name, which SSE
      calls "message"); `id`, `retry` and unknown fields are ignored; an event without
      `data` lines is not dispatched. A leading byte-order mark is skipped.
    - Bytes that are not valid UTF-8 become U+FFFD; `feed` never raises for malformed input.
    - Memory is bounded: an event whose data and event name exceed `max_event_bytes` (UTF-8
      bytes, counting one newline per data line) is dropped as soon as it does, counted in
      `dropped_events`, and the rest of it is skipped up to its blank line. A comment line
      longer than the limit is skipped without affecting the event around it.
    - `close()` ends the body: an event not yet followed by a blank line is discarded, as the
      SSE specification requires for a stream that ends mid-event. Later `feed` calls are
      ignored.
    - If `on_event` raises, the exception propagates out of `feed` and the remaining events of
      that chunk are not delivered; the parser's own state stays consistent for later chunks.
    """

    __slots__ = (
        "_closed",
        "_data",
        "_decode",
        "_dropping",
        "_event_name",
        "_event_size",
        "_max_event_bytes",
        "_on_event",
        "_skip_lf",
        "_skip_line",
        "_started",
        "_tail",
        "_tail_size",
        "dropped_events",
    )

    def __init__(
        self,
        on_event: Callable[[str | None, str], None],
        *,
        max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
    ) -> None:
        if isinstance(max_event_bytes, bool) or not isinstance(max_event_bytes, int) or max_event_bytes <= 0:
            raise ValueError(f"max_event_bytes must be a positive number of bytes, got {max_event_bytes!r}")
        self._on_event = on_event
        self._max_event_bytes = max_event_bytes
        self._decode = codecs.getincrementaldecoder("utf-8")(errors="replace").decode
        self._started = False
        self._closed = False
        self._skip_lf = False  # the last chunk ended with CR: a leading LF is part of that line ending
        self._tail: list[str] = []  # pieces of the unterminated last line
        self._tail_size = 0
        self._skip_line = False  # the unterminated line outgrew the limit and is being skipped
        self._data: list[str] = []
        self._event_name: str | None = None
        self._event_size = 0
        self._dropping = False  # the current event outgrew the limit; skip to its blank line
        self.dropped_events = 0

    def feed(self, chunk: bytes) -> None:
        """Observe the next piece of the body, calling back for every event it completes."""
        if self._closed or not chunk:
            return
        text = self._decode(chunk)
        if not text:
            return
        if not self._started:
            self._started = True
            if text[0] == "\ufeff":
                text = text[1:]
                if not text:
                    return
        if self._skip_lf:
            self._skip_lf = False
            if text[0] == "\n":
                text = text[1:]
                if not text:
                    return
        if "\r" in text:
            self._skip_lf = text[-1] == "\r"
            text = text.replace("\r\n", "\n").replace("\r", "\n")
        if "\n" not in text:
            self._grow_tail(text)
            return
        lines = text.split("\n")
        rest = lines.pop()
        first = 0
        if self._skip_line:
            self._skip_line = False
            first = 1  # the end of a line already given up on, even if it looks blank
        elif self._tail:
            self._tail.append(lines[0])
            lines[0] = "".join(self._tail)
            self._tail.clear()
            self._tail_size = 0
        events = self._parse(lines, first)
        if rest:
            self._grow_tail(rest)
        for name, data in events:
            self._on_event(name, data)

    def close(self) -> None:
        """End of body: drop any unfinished event (SSE never dispatches one) and ignore later feeds."""
        if self._closed:
            return
        self._closed = True
        self._decode(b"", True)
        self._tail.clear()
        self._data.clear()
        self._event_name = None
        self._tail_size = self._event_size = 0

    def _parse(self, lines: list[str], first: int) -> list[tuple[str | None, str]]:
        """Apply complete lines to the event being assembled; return the events they finished."""
        events: list[tuple[str | None, str]] = []
        data = self._data
        for index in range(first, len(lines)):
            line = lines[index]
            if not line:
                if data and not self._dropping:
                    events.append((self._event_name or None, "\n".join(data)))
                data.clear()
                self._event_name = None
                self._event_size = 0
                self._dropping = False
                continue
            if self._dropping or line[0] == ":":
                continue
            if line.startswith("data: "):
                value = line[6:]
            else:
                name, colon, value = line.partition(":")
                if colon and value[:1] == " ":
                    value = value[1:]
                if name == "event":
                    self._event_size += _utf8_len(value) - _utf8_len(self._event_name or "")
                    self._event_name = value
                    if self._event_size > self._max_event_bytes:
                        self._drop()
                    continue
                if name != "data":
                    continue
            self._event_size += _utf8_len(value) + 1
            if self._event_size > self._max_event_bytes:
                self._drop()
            else:
                data.append(value)
        return events

    def _drop(self) -> None:
        """Give up on the current event: count it, release what it holds, skip to its blank line."""
        self.dropped_events += 1
        self._dropping = True
        self._data.clear()
        self._event_name = None
        self._event_size = 0

    def _grow_tail(self, text: str) -> None:
        """Keep an unterminated line for the next chunk, within the event's memory limit."""
        if self._skip_line:
            return
        self._tail.append(text)
        self._tail_size += _utf8_len(text)
        if self._tail_size + self._event_size > self._max_event_bytes:
            if self._tail[0][0] != ":" and not self._dropping:
                self._drop()
            self._tail.clear()
            self._tail_size = 0
            self._skip_line = True


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
    content_text: str | None = None
    """The answer or refusal text it carries, for optional content capture; None when it carries
    none (tool-call arguments and reasoning set `content` but are not answer text)."""
    error: bool = False
    """The payload is an error object, a Responses `error` event, or a failed response."""


# Responses API events whose `delta` is generated output; the value says whether it is answer text.
_RESPONSES_DELTAS = {
    "response.output_text.delta": True,
    "response.refusal.delta": True,
    "response.function_call_arguments.delta": False,
    "response.reasoning_text.delta": False,
}
_RESPONSES_FINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})


def classify(event_name: str | None, data: str) -> ChunkInfo | None:
    """Describe one SSE event's data; None when it is neither `[DONE]` nor a JSON object.

    The Responses API event type is taken from the payload's `type`, else from `event_name`.
    """
    if data.strip() == "[DONE]":
        return ChunkInfo(done=True)
    obj = _load(data)
    if obj is None:
        return None
    kind = obj.get("type")
    if not isinstance(kind, str):
        kind = event_name
    if kind is not None and (kind == "error" or kind.startswith("response.")):
        return _responses_event(kind, obj)
    return _completion(obj)


def classify_json_body(body: bytes) -> ChunkInfo | None:
    """Describe a non-streamed JSON response: chat.completion, text_completion, an embeddings
    list or a Responses `response` object. None when the body is not a JSON object.

    `content` says whether the body holds generated output and `content_text` is its answer text.
    """
    obj = _load(body)
    if obj is None:
        return None
    if obj.get("object") == "response":
        info = ChunkInfo(error=_is_error(obj))
        _read_response(obj, info, final=True)
        _read_response_output(obj.get("output"), info)
        return info
    return _completion(obj)


def _load(data: str | bytes) -> dict[str, Any] | None:
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


def _is_error(obj: dict[str, Any]) -> bool:
    error = obj.get("error")
    return isinstance(error, dict) or _text(error) is not None or obj.get("object") == "error"


def _completion(obj: dict[str, Any]) -> ChunkInfo:
    """A chat or legacy completion, streamed chunk or whole body, or an embeddings list."""
    info = ChunkInfo(response_id=_text(obj.get("id")), model=_text(obj.get("model")), error=_is_error(obj))
    choices = obj.get("choices")
    if isinstance(choices, list):
        texts: list[str] = []
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            reason = choice.get("finish_reason")
            if isinstance(reason, str):
                info.finish_reasons.append(reason)
                index = choice.get("index")
                info.finish_indexes.append(index if type(index) is int else len(info.finish_indexes))
            text = _text(choice.get("text"))
            if text is not None:
                texts.append(text)
            message = choice.get("delta")
            if message is None:
                message = choice.get("message")
            if not isinstance(message, dict):
                continue
            for key in ("content", "refusal"):
                text = _text(message.get(key))
                if text is not None:
                    texts.append(text)
            tool_calls = message.get("tool_calls")
            if (
                (isinstance(tool_calls, list) and tool_calls)
                or _text(message.get("reasoning_content"))
                or _text(message.get("reasoning"))
            ):
                info.content = True
        if texts:
            info.content = True
            info.content_text = "".join(texts)
    _read_usage(obj.get("usage"), info)
    return info


def _responses_event(kind: str, obj: dict[str, Any]) -> ChunkInfo:
    info = ChunkInfo()
    answer = _RESPONSES_DELTAS.get(kind)
    if answer is not None:
        delta = _text(obj.get("delta"))
        if delta is not None:
            info.content = True
            if answer:
                info.content_text = delta
        return info
    if kind == "error":
        info.error = True
        return info
    response = obj.get("response")
    final = kind in _RESPONSES_FINAL
    if isinstance(response, dict):
        _read_response(response, info, final=final, kind=kind)
    elif final:
        _finish_response(kind[len("response.") :], None, info)
    if kind == "response.failed":
        info.error = True
    return info


def _read_response(response: dict[str, Any], info: ChunkInfo, *, final: bool, kind: str = "") -> None:
    info.response_id = _text(response.get("id"))
    info.model = _text(response.get("model"))
    _read_usage(response.get("usage"), info)
    if final:
        status = response.get("status")
        if not isinstance(status, str):
            status = kind[len("response.") :]
        _finish_response(status, response.get("incomplete_details"), info)


def _finish_response(status: str, incomplete_details: Any, info: ChunkInfo) -> None:
    if status == "completed":
        info.finish_reasons.append("stop")
        info.finish_indexes.append(0)
    elif status == "incomplete":
        reason = incomplete_details.get("reason") if isinstance(incomplete_details, dict) else None
        info.finish_reasons.append(_text(reason) or "length")
        info.finish_indexes.append(0)
    elif status == "failed":
        info.finish_reasons.append("error")
        info.finish_indexes.append(0)
        info.error = True


def _read_response_output(output: Any, info: ChunkInfo) -> None:
    if not isinstance(output, list):
        return
    texts: list[str] = []
    for item in output:
        if not isinstance(item, dict):
            continue
        if item.get("type") != "message":
            info.content = True  # function calls, reasoning and other generated items
            continue
        parts = item.get("content")
        for part in parts if isinstance(parts, list) else ():
            if isinstance(part, dict):
                text = _text(part.get("text")) or _text(part.get("refusal"))
                if text is not None:
                    texts.append(text)
    if texts:
        info.content = True
        info.content_text = "".join(texts)


def _read_usage(usage: Any, info: ChunkInfo) -> None:
    """Token counts under either naming: chat/completions (`prompt_tokens`) or Responses (`input_tokens`)."""
    if not isinstance(usage, dict):
        return
    info.input_tokens = _first_count(usage.get("prompt_tokens"), usage.get("input_tokens"))
    info.output_tokens = _first_count(usage.get("completion_tokens"), usage.get("output_tokens"))
    cached = None
    for key in ("prompt_tokens_details", "input_tokens_details"):
        details = usage.get(key)
        if isinstance(details, dict):
            cached = _count(details.get("cached_tokens"))
            if cached is not None:
                break
    info.cached_tokens = cached


def _first_count(preferred: Any, fallback: Any) -> int | None:
    count = _count(preferred)
    return count if count is not None else _count(fallback)
