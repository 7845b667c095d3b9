"""An OpenAI-compatible response body read as its bytes arrive, for a call whose body llmspans sees
only as bytes: any plain httpx/httpx2 client's, and the openai SDK's raw streaming responses
(`with_streaming_response`, `with_raw_response`) that the app reads line by line.

The SSE body is parsed event by event and each content event stamped at the instant its bytes came;
a JSON body is kept (bounded) and read once complete. Nothing is buffered beyond that one body. The
commonest event, a mid-stream chunk of a chat or completions stream, is read by its bytes, unparsed
(`_openai_wire.compact_carries_tokens`): it is most of a stream, and of what reading one costs.
"""

from __future__ import annotations

import contextvars
import zlib
from typing import Any, Protocol

from llmspans import _content, _conversation, _openai_wire, _sse
from llmspans import _sites as sites
from llmspans._call import CallRecord
from llmspans._guard import check_fault, report, swallow
from llmspans._openai_wire import compact_carries_tokens

__all__ = ["BodyReader", "ChunkListener", "JsonObserver", "StreamObserver", "chunk_listener"]

_MAX_JSON_BODY = 8 * 1024 * 1024


class ChunkListener(Protocol):
    """Whoever wants the instant of each content chunk of the streamed calls made in this thread or task (the
    load tool, for its inter-token figures), told with the very stamp the call's record takes."""

    def watching(self) -> None:
        """A reader took this request's streamed body: each of its content chunks will be told."""

    def chunk(self, now_ns: int) -> None:
        """A content chunk arrived at `now_ns` (`perf_counter_ns`, the read that brought it)."""


chunk_listener: contextvars.ContextVar[ChunkListener | None] = contextvars.ContextVar(
    "llmspans_chunk_listener", default=None
)
_DATA = b"data: "
_EVENT_END = b"\n\n"


class BodyReader:
    """What both observers share: the transport hands over the body as it came off the wire,
    still content-encoded, so a gzip or deflate body is decoded here as the client decodes it
    for the app. Any other coding (br, zstd) leaves the body unread: no usage, never a misreading.
    """

    complete = False
    muted = False
    """Set once something else reads the same body for the call (the SDK's parsed stream)."""
    _decoders: list[Any] | None = None  # None: identity; []: a coding we cannot undo

    def response_headers(self, headers: Any) -> None:
        codings = [c.strip().lower() for c in headers.get("content-encoding", "").split(",")]
        codings = [c for c in codings if c and c != "identity"]
        if codings:
            # MAX_WBITS | 32 takes a gzip or a zlib header, which is what "deflate" means in HTTP.
            decodable = all(c in ("gzip", "x-gzip", "deflate") for c in codings)
            self._decoders = [zlib.decompressobj(zlib.MAX_WBITS | 32) for _ in codings] if decodable else []

    def feed(self, chunk: bytes, now_ns: int) -> None:
        if self.muted:
            return
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


class StreamObserver(BodyReader):
    """Parses the SSE body as it arrives and stamps content events at the instant their bytes came.

    `complete` turns true at the stream's own end marker: `[DONE]` for chat and completions, the
    final `response.completed`/`incomplete`/`failed` event for the Responses API (which sends no
    `[DONE]`). A caller who stops reading there and closes the response has not abandoned the call.

    The parser calls back into `StreamEvents`, which holds neither the parser nor this observer: a
    callback bound to the observer itself would make a reference cycle of every call (garbage for the
    collector rather than freed when the call ends).

    A body whose events end in a blank line of bare newlines and hold one `data: ` line each is split here,
    by bytes, and a mid-stream chunk's content read off its bytes; any other event is handed, whole, to the
    SSE parser (which then sees only whole events, so its state is what it would be had it read the body
    itself). A carriage return anywhere hands the rest of the body to the parser. A Responses stream, or a
    call that keeps the answer's content, is parsed event by event throughout.
    """

    def __init__(self, record: CallRecord, capture: _content.CaptureSetting, responses_api: bool) -> None:
        self.record = record
        self.capture = capture
        output = _conversation.OutputMessages(_content.limit(record)) if capture else None
        listener = self._listener = chunk_listener.get()
        if listener is not None:
            listener.watching()
        self._events = StreamEvents(record, output, responses_api, listener)
        self._parser = _sse.SSEObserver(self._events.on_event)
        self._pending = b""
        self._split = not responses_api and output is None  # False once the body is not plain `data:` lines

    @property
    def responses_api(self) -> bool:
        return self._events.responses_api

    @property
    def complete(self) -> bool:  # type: ignore[override]
        return self._events.complete

    @property
    def output(self) -> _conversation.OutputMessages | None:
        return self._events.output

    def read(self, chunk: bytes, now_ns: int) -> None:
        self._events.now = now_ns
        if not self._split or b"\r" in chunk:
            if self._split:
                self._split = False
                chunk, self._pending = self._pending + chunk, b""
            self._parser.feed(chunk)
            return
        buffer = self._pending + chunk if self._pending else chunk
        *events, self._pending = buffer.split(_EVENT_END)
        record = self.record
        for event in events:
            if record.response_id is not None and event.startswith(_DATA) and b"\n" not in event:
                content = compact_carries_tokens(event[6:])
                if content is not None:
                    if content:
                        record.content_chunk(now_ns, 1)
                        if self._listener is not None:
                            self._listener.chunk(now_ns)
                    continue
            if event:
                self._parser.feed(event + _EVENT_END)

    def finish(self, now_ns: int, error: BaseException | None) -> None:
        output = self._events.output
        if output is not None and not self.muted:
            with swallow(sites.HTTPX_CONTENT):
                _content.write_output(self.record, self.capture, output)


class StreamEvents:
    """What each SSE event of a stream says, on its call (the parser's callback; see `StreamObserver`)."""

    __slots__ = ("complete", "listener", "now", "output", "record", "responses_api")

    def __init__(
        self, record: CallRecord, output: _conversation.OutputMessages | None, responses_api: bool,
        listener: ChunkListener | None = None,
    ) -> None:  # fmt: skip
        self.record = record
        self.output = output
        self.responses_api = responses_api
        self.listener = listener
        self.now = 0
        self.complete = False

    def on_event(self, event: str | None, data: str) -> None:
        output = self.output
        if output is None:
            if event is None and not self.responses_api and self.record.response_id is not None:
                content = compact_carries_tokens(data)  # a mid-stream chunk, read unparsed
                if content is not None:
                    if content:
                        self.record.content_chunk(self.now, 1)
                        if self.listener is not None:
                            self.listener.chunk(self.now)
                    return
            info = _openai_wire.classify(event, data)
            if info is None:
                return
        else:  # the decoded event is kept for the answer's content too
            payload = _openai_wire.load(data)
            if payload is None:
                info = _openai_wire.classify(event, data)  # `[DONE]`, or nothing
                if info is None:
                    return
            else:
                info = _openai_wire.classify_payload(event, payload)
                try:
                    check_fault(sites.CONTENT_CHUNK)
                    output.stream_payload(payload)
                except Exception as failure:  # the answer's content is incomplete; its timing is not
                    report(sites.CONTENT_CHUNK, failure)
        if info.done or (self.responses_api and info.finish_reasons):
            self.complete = True
            self.record.ended_well = True
        record = self.record
        if info.content:
            tokens = 1
            if info.output_tokens is not None:  # cumulative usage on every chunk: exact tokens per chunk
                tokens = max(1, info.output_tokens - (record.output_tokens or 0))
            record.content_chunk(self.now, tokens)
            if self.listener is not None:
                self.listener.chunk(self.now)
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


class JsonObserver(BodyReader):
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
        payload = _openai_wire.load(body) if body else None
        if payload is None:
            return
        info = _openai_wire.read_payload(payload)
        self.record.set_response(info.response_id, info.model, info.finish_reasons)
        self.record.set_usage(info.input_tokens, info.output_tokens, info.cached_tokens)
        if info.attributes:
            self.record.set_attributes(info.attributes)
        if self.capture:
            with swallow(sites.HTTPX_CONTENT):
                output = _conversation.OutputMessages(_content.limit(self.record))
                output.whole(payload)
                _content.write_output(self.record, self.capture, output)
