"""The plain-client adapter: an httpx or httpx2 client pointed at an OpenAI-compatible server.

Requests to the OpenAI-compatible paths become calls (model and stream flag read from the
JSON body); the response is observed as it is read, an SSE body event by event, a JSON
body once complete, and never buffered beyond one bounded JSON body. Other requests pass
through untouched.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from llmspans import _content, _sse
from llmspans import _names as names
from llmspans._call import CallRecord
from llmspans._guard import guarded
from llmspans._openai import Settings, input_messages, operation_for, request_attributes, write_content

_MAX_JSON_BODY = 8 * 1024 * 1024


class _StreamObserver:
    """Parses the SSE body as it arrives and stamps content events at the instant their bytes came."""

    def __init__(self, record: CallRecord, capture: _content.CaptureSetting) -> None:
        self.record = record
        self.capture = capture
        self.output: list[str] | None = [] if capture else None
        self._now = 0
        self._parser = _sse.SSEObserver(self._on_event)

    def _on_event(self, event: str | None, data: str) -> None:
        info = _sse.classify(event, data)
        if info is None:
            return
        record = self.record
        if info.content:
            record.content_chunk(self._now)
            if self.output is not None and info.content_text:
                self.output.append(info.content_text)
        if record.response_id is None or info.finish_reasons:
            record.set_response(info.response_id, info.model, info.finish_reasons)
        if info.input_tokens is not None or info.output_tokens is not None:
            record.set_usage(info.input_tokens, info.output_tokens, info.cached_tokens)

    def feed(self, chunk: bytes, now_ns: int) -> None:
        self._now = now_ns
        self._parser.feed(chunk)

    def finish(self, now_ns: int, error: BaseException | None) -> None:
        if self.output is not None:
            _write_output(self.record, self.capture, "".join(self.output))


class _JsonObserver:
    """Keeps a non-streamed JSON body (bounded) to read usage from once it is complete."""

    def __init__(self, record: CallRecord, capture: _content.CaptureSetting) -> None:
        self.record = record
        self.capture = capture
        self._parts: list[bytes] = []
        self._size = 0

    def feed(self, chunk: bytes, now_ns: int) -> None:
        self._size += len(chunk)
        if self._size <= _MAX_JSON_BODY:
            self._parts.append(chunk)
        else:
            self._parts.clear()

    def finish(self, now_ns: int, error: BaseException | None) -> None:
        body = b"".join(self._parts)
        self._parts.clear()
        info = _sse.classify_json_body(body) if body else None
        if info is None:
            return
        self.record.set_response(info.response_id, info.model, info.finish_reasons)
        self.record.set_usage(info.input_tokens, info.output_tokens, info.cached_tokens)
        if self.capture:
            _write_output(self.record, self.capture, _output_text(body))


def _output_text(body: bytes) -> str:
    data = json.loads(body)
    texts = []
    for choice in data.get("choices") or ():
        message = choice.get("message") or {}
        text = message.get("content") if message else choice.get("text")
        if isinstance(text, str):
            texts.append(text)
    if isinstance(data.get("output_text"), str):
        texts.append(data["output_text"])
    return "".join(texts)


def _write_output(record: CallRecord, capture: _content.CaptureSetting, text: str) -> None:
    write_content(
        record,
        capture,
        names.GEN_AI_OUTPUT_MESSAGES,
        [{"role": "assistant", "parts": [{"type": "text", "content": text}]}],
    )


class PlainClientCalls:
    """Opens a call record for each request a plain client sends to an OpenAI-compatible path."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    @guarded("httpx.begin", None)
    def begin(self, request: Any) -> tuple[CallRecord, Any] | None:
        if request.method != "POST":
            return None
        operation = operation_for(request.url.path)
        if operation is None:
            return None
        body: Mapping[str, Any] = {}
        try:
            content = request.content
        except Exception:  # a streaming request body: nothing to read without consuming it
            content = b""
        if content:
            try:
                decoded = json.loads(content)
            except ValueError:
                decoded = None
            if isinstance(decoded, Mapping):
                body = decoded
        model = body.get("model")
        stream = body.get("stream") is True
        url = request.url
        record = CallRecord(
            operation=operation,
            model=model if isinstance(model, str) else None,
            provider=self.settings.provider,
            stream=stream,
            request_attributes=request_attributes(body),
            server_address=url.host,
            server_port=url.port or (443 if url.scheme == "https" else 80),
            budget=self.settings.budget,
        )
        capture = _content.resolve(self.settings.capture_content)
        if capture:
            write_content(record, capture, names.GEN_AI_INPUT_MESSAGES, input_messages(body))
        observer = _StreamObserver(record, capture) if stream else _JsonObserver(record, capture)
        return record, observer
