"""Plain httpx and httpx2 clients pointed at an OpenAI-compatible server (vLLM, a gateway, ...).

Requests to the OpenAI-compatible paths become calls (model and stream flag read from the
JSON body); the response is observed as it is read, an SSE body event by event, a JSON
body once complete, and never buffered beyond one bounded JSON body. Other requests pass
through untouched. What the body says is read by the wire format (`_openai_wire`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from llmspans import _content, _openai_wire, _retries, _telemetry, _transport
from llmspans import _names as names
from llmspans import _sites as sites
from llmspans._adapters import derives_from
from llmspans._adapters.body_readers import JsonObserver, StreamObserver
from llmspans._call import CallRecord
from llmspans._guard import guarded, swallow
from llmspans._settings import Settings

_MARK = "_llmspans_plain"


class PlainHTTP:
    """The adapter for `httpx.Client`/`AsyncClient` and `httpx2.Client`/`AsyncClient`."""

    name = "httpx.Client, httpx.AsyncClient, httpx2.Client or httpx2.AsyncClient"

    def matches(self, target: Any) -> bool:
        return self.matches_class(type(target))

    def matches_class(self, cls: type) -> bool:
        return derives_from(cls, ("httpx", "httpx2"), ("Client", "AsyncClient"))

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


class OpenAIPathCalls:
    """Opens a call record for each request a plain client sends to an OpenAI-compatible path."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.limiter = settings.limiter

    @guarded(sites.HTTPX_BEGIN, None)
    def begin(self, request: Any) -> tuple[CallRecord, Any] | None:
        if request.method != "POST":
            return None
        sinks = _telemetry.recording_sinks()
        if sinks is None and not self.settings.acts:
            return None  # nothing to record, nothing to do
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
        retry = request.headers.get(_retries.RETRY_COUNT_HEADER)
        held = _retries.claim(int(retry) if retry and retry.isdigit() else None)
        capture: _content.CaptureSetting
        if held is not None:  # the openai SDK's retry of a call this client already opened
            record = held
            capture = _content.resolve(self.settings.capture_content) if record.recording else False
        else:
            record = self.settings.new_record(operation, body, stream, url, sinks=sinks)
            capture = _content.resolve(self.settings.capture_content) if record.recording else False
            if capture:
                with swallow(
                    sites.HTTPX_CONTENT
                ):  # a redaction hook that raises must not leave the span open
                    _content.write_input(record, capture, body)
        observer: StreamObserver | JsonObserver = (
            StreamObserver(record, capture, responses_api=_openai_wire.is_responses_path(url.path))
            if stream
            else JsonObserver(record, capture if operation != names.OPERATION_EMBEDDINGS else False)
        )
        return record, observer
