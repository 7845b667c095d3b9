"""Plain httpx and httpx2 clients pointed at an OpenAI-compatible server (vLLM, a gateway, ...).

Requests to the OpenAI-compatible paths become calls (model and stream flag read from the
JSON body); the response is observed as it is read, an SSE body event by event, a JSON
body once complete, and never buffered beyond one bounded JSON body. Other requests pass
through untouched. What the body says is read by the wire format (`_openai_wire`).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Mapping
from typing import Any

from llmspans import _content, _openai_wire, _sse, _transport
from llmspans import _names as names
from llmspans import _sites as sites
from llmspans._call import CallRecord
from llmspans._guard import guarded, swallow
from llmspans._settings import Settings

_MARK = "_llmspans_plain"


class PlainHTTP:
    """The adapter for `httpx.Client`/`AsyncClient` and `httpx2.Client`/`AsyncClient`."""

    name = "httpx.Client, httpx.AsyncClient, httpx2.Client or httpx2.AsyncClient"

    def matches(self, target: Any) -> bool:
        return any(
            cls.__module__.split(".")[0] in ("httpx", "httpx2") and cls.__name__ in ("Client", "AsyncClient")
            for cls in type(target).__mro__
        )

    def default_provider(self, client: Any) -> str:
        return names.PROVIDER_OPENAI  # an OpenAI-compatible API; `provider=` names the server

    def install(self, client: Any, settings: Settings) -> None:
        _transport.install(client, OpenAIPathCalls(settings))
        setattr(client, _MARK, settings)

    def uninstall(self, client: Any) -> None:
        settings = getattr(client, _MARK, None)
        if settings is not None:
            _transport.remove(client)
            delattr(client, _MARK)
            settings.close()

    def installed(self, client: Any) -> Settings | None:
        return getattr(client, _MARK, None)


ADAPTER = PlainHTTP()


_MAX_JSON_BODY = 8 * 1024 * 1024


class _BodyReader:
    """What both observers share: the transport hands over the body as it came off the wire,
    still content-encoded, so a gzip or deflate body is decoded here as the client decodes it
    for the app. Any other coding (br, zstd) leaves the body unread: no usage, never a misreading.
    """

    complete = False
    _decoders: list[Any] | None = None  # None: identity; []: a coding we cannot undo

    def response_headers(self, headers: Any) -> None:
        codings = [c.strip().lower() for c in headers.get("content-encoding", "").split(",")]
        codings = [c for c in codings if c and c != "identity"]
        if codings:
            # MAX_WBITS | 32 takes a gzip or a zlib header, which is what "deflate" means in HTTP.
            decodable = all(c in ("gzip", "x-gzip", "deflate") for c in codings)
            self._decoders = [zlib.decompressobj(zlib.MAX_WBITS | 32) for _ in codings] if decodable else []

    def feed(self, chunk: bytes, now_ns: int) -> None:
        decoders = self._decoders
        if decoders is not None:
            if not decoders:
                return
            try:
                for decoder in reversed(decoders):  # the last coding applied is undone first
                    chunk = decoder.decompress(chunk)
            except zlib.error:
                decoders.clear()  # the app's client fails on this body too; stop reading it
                return
        self.read(chunk, now_ns)

    def read(self, chunk: bytes, now_ns: int) -> None:
        raise NotImplementedError


class _StreamObserver(_BodyReader):
    """Parses the SSE body as it arrives and stamps content events at the instant their bytes came.

    `complete` turns true at the stream's own end marker: `[DONE]` for chat and completions, the
    final `response.completed`/`incomplete`/`failed` event for the Responses API (which sends no
    `[DONE]`). A caller who stops reading there and closes the response has not abandoned the call.
    """

    def __init__(self, record: CallRecord, capture: _content.CaptureSetting, responses_api: bool) -> None:
        self.record = record
        self.capture = capture
        self.responses_api = responses_api
        self.output: list[str] | None = [] if capture else None
        self._now = 0
        self._parser = _sse.SSEObserver(self._on_event)

    def _on_event(self, event: str | None, data: str) -> None:
        info = _openai_wire.classify(event, data)
        if info is None:
            return
        if info.done or (self.responses_api and info.finish_reasons):
            self.complete = True
            self.record.ended_well = True
        record = self.record
        if info.content:
            tokens = 1
            if info.output_tokens is not None:  # cumulative usage on every chunk: exact tokens per chunk
                tokens = max(1, info.output_tokens - (record.output_tokens or 0))
            record.content_chunk(self._now, tokens)
            if self.output is not None and info.content_text:
                self.output.append(info.content_text)
        if record.response_id is None:
            record.set_response(info.response_id, info.model)
            if info.attributes:  # a stream's tier and fingerprint, said on its first chunk
                record.set_attributes(info.attributes)
        for index, reason in zip(info.finish_indexes, info.finish_reasons, strict=True):
            record.choice_finished(index, reason)
        if info.input_tokens is not None or info.output_tokens is not None:
            record.set_usage(info.input_tokens, info.output_tokens, info.cached_tokens)
            if info.attributes:
                record.set_attributes(info.attributes)

    def read(self, chunk: bytes, now_ns: int) -> None:
        self._now = now_ns
        self._parser.feed(chunk)

    def finish(self, now_ns: int, error: BaseException | None) -> None:
        if self.output is not None:
            _content.write_output(self.record, self.capture, "".join(self.output))


class _JsonObserver(_BodyReader):
    """Keeps a non-streamed JSON body (bounded) to read usage from once it is complete."""

    def __init__(self, record: CallRecord, capture: _content.CaptureSetting) -> None:
        self.record = record
        self.capture = capture
        self._parts: list[bytes] = []
        self._size = 0

    def read(self, chunk: bytes, now_ns: int) -> None:
        self._size += len(chunk)
        if self._size <= _MAX_JSON_BODY:
            self._parts.append(chunk)
        else:
            self._parts.clear()

    def finish(self, now_ns: int, error: BaseException | None) -> None:
        body = b"".join(self._parts)
        self._parts.clear()
        info = _openai_wire.classify_json_body(body) if body else None
        if info is None:
            return
        self.record.set_response(info.response_id, info.model, info.finish_reasons)
        self.record.set_usage(info.input_tokens, info.output_tokens, info.cached_tokens)
        if info.attributes:
            self.record.set_attributes(info.attributes)
        if self.capture:
            _content.write_output(self.record, self.capture, info.content_text or "")


class OpenAIPathCalls:
    """Opens a call record for each request a plain client sends to an OpenAI-compatible path."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.limiter = settings.limiter

    @guarded(sites.HTTPX_BEGIN, None)
    def begin(self, request: Any) -> tuple[CallRecord, Any] | None:
        if request.method != "POST":
            return None
        operation = _openai_wire.operation_for(request.url.path)
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
        stream = body.get("stream") is True
        url = request.url
        record = self.settings.new_record(operation, body, stream, url)
        capture = _content.resolve(self.settings.capture_content) if record.recording else False
        if capture:
            with swallow(sites.HTTPX_CONTENT):  # a redaction hook that raises must not leave the span open
                _content.write_input(record, capture, body)
        observer: _StreamObserver | _JsonObserver = (
            _StreamObserver(record, capture, responses_api=_openai_wire.is_responses_path(url.path))
            if stream
            else _JsonObserver(record, capture if operation != names.OPERATION_EMBEDDINGS else False)
        )
        return record, observer
