"""The generator's default client: a plain `httpx2.AsyncClient` that llmspans instruments, on `LeanTransport`.

An app with a plain httpx2 client gets a call span per request from llmspans' plain-HTTP adapter, which
reads the streamed body event by event. The load tool sends the same requests through the same adapter,
with two changes that keep its cost per request near `vllm bench serve`'s (docs/load.md, "What the
generator costs"):

- `LeanTransport` hands the body over one socket read at a time instead of one HTTP chunk at a time;
- `LoadStreamObserver` reads a mid-stream chunk of a chat or completions stream (a JSON object whose only
  choice is unfinished and that carries no usage) by its bytes: content or not is whether its delta's
  `content`, `reasoning_content`, `reasoning` or `text` is a non-empty string, or it has `tool_calls`.
  In compact JSON such a key and its opening quote cannot occur inside a string (quotes there are
  escaped). Every other event (the first, which names the response; the finish, the usage, errors,
  `[DONE]`, anything not compact) goes through the adapter's own reading. Each content chunk is stamped
  on the call record as the adapter would, and on the load tool's request record for its ITL.

The request body is JSON the generator encodes once, before the request is due.
"""

from __future__ import annotations

from typing import Any

from llmspans._adapters import body_readers
from llmspans._adapters.plain_http import OpenAIPathCalls
from llmspans.load._requests import CURRENT, RequestRecord

_UNFINISHED = '"finish_reason":null'
_USAGE = '"usage":{'
_CONTENT_KEYS = ('"content":"', '"reasoning_content":"', '"reasoning":"', '"text":"')
_TOOL_CALLS = '"tool_calls":['
_B_UNFINISHED, _B_USAGE, _B_TOOL_CALLS = (key.encode() for key in (_UNFINISHED, _USAGE, _TOOL_CALLS))
_B_CONTENT_KEYS = tuple(key.encode() for key in _CONTENT_KEYS)
_DATA = b"data: "
_EVENT_END = b"\n\n"
_QUOTE = ord('"')


def content_of(data: str) -> bool | None:
    """A compact mid-stream chunk's data: does it carry content? None: not such a chunk, read it whole."""
    if not data.startswith("{") or _UNFINISHED not in data or _USAGE in data or data.count('"index":') != 1:
        return None
    for key in _CONTENT_KEYS:
        at = data.find(key)
        if at >= 0 and data[at + len(key) : at + len(key) + 1] != '"':
            return True
    return _TOOL_CALLS in data


def content_of_bytes(data: bytes) -> bool | None:
    """`content_of` for an event's data still in bytes (one `data: ` line)."""
    if (
        not data.startswith(b"{")
        or _B_UNFINISHED not in data
        or _B_USAGE in data
        or data.count(b'"index":') != 1
    ):
        return None
    for key in _B_CONTENT_KEYS:
        at = data.find(key)
        if at >= 0:
            after = at + len(key)
            if after < len(data) and data[after] != _QUOTE:
                return True
    return _B_TOOL_CALLS in data


class LoadStreamEvents(body_readers.StreamEvents):
    """The adapter's event reader, with a cheap read of a plain mid-stream chunk's data, and each content
    chunk's instant kept on the load tool's request record too (for its ITL)."""

    __slots__ = ("fast", "load")

    def __init__(
        self, record: Any, output: Any, responses_api: bool, load: RequestRecord | None, fast: bool
    ) -> None:
        super().__init__(record, output, responses_api)
        self.load = load
        self.fast = fast

    def on_event(self, event: str | None, data: str) -> None:
        record = self.record
        if self.fast and event is None and record.response_id is not None:
            content = content_of(data)
            if content is not None:
                if content:
                    record.content_chunk(self.now, 1)
                    if self.load is not None:
                        self.load.chunk_ns.append(self.now)
                return
        load = self.load
        if load is None:
            super().on_event(event, data)
            return
        before = record.chunks
        super().on_event(event, data)
        if record.chunks != before:
            load.chunk_ns.append(self.now)


class LoadStreamObserver(body_readers.StreamObserver):
    """The adapter's stream observer, with a byte-level read of plain mid-stream chunks (module doc).

    A body whose events end in a blank line of bare newlines and hold one `data: ` line each is split here,
    by bytes; any other event is handed, whole, to the adapter's SSE parser (which then sees only whole
    events, so its state is the same as if it had read the body itself). A carriage return anywhere hands
    the rest of the body to the parser.
    """

    def __init__(self, record: Any, capture: Any, responses_api: bool, load: RequestRecord | None) -> None:
        self.load = load
        super().__init__(record, capture, responses_api)
        self._pending = b""
        self._split = not responses_api and not capture  # False once the body is not plain `data:` lines

    def _events_for(self, record: Any, output: Any, responses_api: bool) -> body_readers.StreamEvents:
        return LoadStreamEvents(
            record, output, responses_api, self.load, fast=output is None and not responses_api
        )

    def read(self, chunk: bytes, now_ns: int) -> None:
        if not self._split or b"\r" in chunk:
            if self._split:
                self._split = False
                chunk, self._pending = self._pending + chunk, b""
            super().read(chunk, now_ns)
            return
        self._events.now = now_ns
        buffer = self._pending + chunk if self._pending else chunk
        *events, self._pending = buffer.split(_EVENT_END)
        record, load = self.record, self.load
        for event in events:
            if record.response_id is not None and event.startswith(_DATA) and b"\n" not in event:
                content = content_of_bytes(event[6:])
                if content is not None:
                    if content:
                        record.content_chunk(now_ns, 1)
                        if load is not None:
                            load.chunk_ns.append(now_ns)
                    continue
            if event:
                self._parser.feed(event + _EVENT_END)


class LoadCalls(OpenAIPathCalls):
    """The plain adapter's call opener, with `LoadStreamObserver` on streamed calls."""

    def begin(self, request: Any) -> Any:
        opened = super().begin(request)
        if opened is None:
            return None
        record, observer = opened
        if isinstance(observer, body_readers.StreamObserver):
            load = CURRENT.get()
            observer = LoadStreamObserver(record, observer.capture, observer.responses_api, load)
            if load is not None:
                load.observed = True
        return record, observer
