"""The openai SDK: its requests, streams and responses as call events.

It wraps the client's own `request()` (the one place every operation passes through, once per
logical call, around the SDK's retry loop), so one call record spans all attempts; the transport
layer under the client's HTTP client sees each attempt. Works with openai 1.x/2.x (httpx) and 3.x
(httpx2). Imports nothing from openai until a client is instrumented.

What a response says is read by the wire format (`_openai_wire`), except the streamed chunks:
the per-chunk readers here read the SDK's chunk objects by attribute, for speed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import wrapt
from opentelemetry import context as otel_context

from llmspans import _content, _conversation, _guard, _internals, _openai_wire, _telemetry, _transport
from llmspans import _names as names
from llmspans import _sites as sites
from llmspans._adapters import derives_from, openai_entry
from llmspans._adapters.body_readers import StreamObserver
from llmspans._adapters.openai_entry import called_at
from llmspans._call import CallRecord
from llmspans._guard import Deliberate, check_fault, report, swallow
from llmspans._openai_wire import ChunkInfo, carries_tokens, choice_carries_tokens
from llmspans._settings import Settings
from llmspans._stream import AsyncStreamProxy, SyncStreamProxy

_MARK = "_llmspans_instrumentation"
_RAW_RESPONSE_HEADER = "X-Stainless-Raw-Response"  # the SDK's mark on a raw response's request
_RESPONSE_EVENTS = frozenset(
    {"response.created", "response.completed", "response.incomplete", "response.failed"}
)


class OpenAISDK:
    """The adapter for `openai.OpenAI` and `openai.AsyncOpenAI` (their Azure subclasses too)."""

    name = "openai.OpenAI, openai.AsyncOpenAI (and their Azure subclasses)"

    def matches(self, target: Any) -> bool:
        return self.matches_class(type(target))

    def matches_class(self, cls: type) -> bool:
        return derives_from(cls, ("openai",), ("OpenAI", "AsyncOpenAI"))

    def default_provider(self, client: Any) -> str:
        """`azure.ai.openai` for an Azure client (the conventions' value), else `openai`."""
        azure = any(cls.__name__ in ("AzureOpenAI", "AsyncAzureOpenAI") for cls in type(client).__mro__)
        return names.PROVIDER_AZURE_OPENAI if azure else names.PROVIDER_OPENAI

    def install(self, client: Any, settings: Settings) -> None:
        openai_entry.install()
        OpenAIInstrumentation(client, settings).install()

    def uninstall(self, client: Any) -> None:
        installed = getattr(client, _MARK, None)
        if installed is not None:
            installed.uninstall()

    def installed(self, client: Any) -> Settings | None:
        installed = getattr(client, _MARK, None)
        return None if installed is None else installed.settings


ADAPTER = OpenAISDK()


class _Reading:
    """What the adapter keeps beside one call's record while it reads the response."""

    __slots__ = ("capture", "hide_usage", "operation", "output", "record")

    def __init__(
        self, record: CallRecord, operation: str, hide_usage: bool, capture: _content.CaptureSetting
    ) -> None:
        self.record = record
        self.operation = operation
        self.hide_usage = hide_usage
        self.capture = capture
        # Embeddings have no output message to record: not even an empty one.
        self.output: _conversation.OutputMessages | None = (
            _conversation.OutputMessages(_content.limit(record))
            if capture and not operation.endswith("/embeddings")
            else None
        )


# --- reading the SDK's objects -------------------------------------------------------------


def _apply(record: CallRecord, info: ChunkInfo) -> None:
    """What a whole response (or a Responses event carrying one) says, on the call."""
    record.set_response(info.response_id, info.model, info.finish_reasons)
    record.set_usage(info.input_tokens, info.output_tokens, info.cached_tokens)
    if info.attributes:
        record.set_attributes(info.attributes)


def _usage(record: CallRecord, usage: Any) -> None:
    record.set_usage(*_openai_wire.read_usage(usage))
    if record.recording and not record.later(_usage_attributes, usage):
        more = _openai_wire.usage_attributes(usage)
        if more:
            record.set_attributes(more)


def _usage_attributes(usage: Any) -> Mapping[str, Any] | None:
    return _openai_wire.usage_attributes(usage)


def _first_chunk(record: CallRecord, item: Any) -> None:
    """What a stream says once, on its first chunk: the response's id and model, tier, fingerprint."""
    record.set_response(getattr(item, "id", None), getattr(item, "model", None))
    if record.recording and not record.later(_response_attributes, item):
        more = _openai_wire.response_attributes(_openai_wire.fields(item))
        if more:
            record.set_attributes(more)


def _response_attributes(item: Any) -> Mapping[str, Any] | None:
    return _openai_wire.response_attributes(_openai_wire.fields(item))


def _outcome(result: Any) -> Mapping[str, Any] | None:
    """A whole response's id, finish reasons and span attributes, read for a held span when it is written
    (what `_apply` sets on the call otherwise, as the attributes the call would write from it)."""
    info = _openai_wire.read_outcome(result)
    found: dict[str, Any] = dict(info.attributes or {})
    if info.response_id:
        found[names.GEN_AI_RESPONSE_ID] = info.response_id
    reasons = tuple(str(reason) for reason in info.finish_reasons if reason)
    if reasons:
        found[names.GEN_AI_RESPONSE_FINISH_REASONS] = reasons
    return found


def _chat_item(reading: _Reading, item: Any, now: int) -> bool:
    """One streamed chat chunk (the per-chunk path): is it content, did a choice finish, any usage."""
    record = reading.record
    if record.response_id is None:
        _first_chunk(record, item)
    choices = item.choices
    usage = item.usage
    if choices:
        content = False
        for choice in choices:
            delta = choice.delta
            if not content and delta is not None and choice_carries_tokens(choice):
                content = True  # one content chunk however many choices it carries
                record.content_chunk(now, _tokens_in(record, usage) if usage is not None else 1)
            reason = choice.finish_reason
            if reason:
                record.choice_finished(choice.index, reason)
    if usage is not None:
        _usage(record, usage)
        return reading.hide_usage and not choices
    return False


def _chat_text_item(reading: _Reading, item: Any, now: int) -> bool:
    """`_chat_item` for a call that captures no content, with a shortcut for the chunk nearly all of a
    stream is: one choice whose delta carries text, no finish reason, no usage, not the first chunk (the
    commonest case of `_openai_wire.carries_tokens`, read inline)."""
    choices = item.choices
    if choices and len(choices) == 1 and item.usage is None:
        choice = choices[0]
        delta = choice.delta
        if delta is not None and delta.content and not choice.finish_reason:
            record = reading.record
            if record.response_id is not None:
                record.content_chunk(now)
                return False
    return _chat_item(reading, item, now)


def _tokens_in(record: CallRecord, usage: Any) -> int:
    """Tokens a content chunk carried, from cumulative usage on every chunk (vLLM's continuous stats)."""
    total = getattr(usage, "completion_tokens", None)
    if not isinstance(total, int) or isinstance(total, bool):
        return 1
    return max(1, total - (record.output_tokens or 0))


def _completion_item(reading: _Reading, item: Any, now: int) -> bool:
    record = reading.record
    if record.response_id is None:
        _first_chunk(record, item)
    choices = item.choices
    if choices:
        if carries_tokens(item):
            record.content_chunk(now)
        for choice in choices:
            if choice.finish_reason:
                record.choice_finished(getattr(choice, "index", None), choice.finish_reason)
    usage = getattr(item, "usage", None)
    if usage is not None:
        _usage(record, usage)
        return reading.hide_usage and not choices
    return False


def _responses_item(reading: _Reading, item: Any, now: int) -> bool:
    if carries_tokens(item):
        reading.record.content_chunk(now)
        return False
    kind = getattr(item, "type", None)
    if kind in _RESPONSE_EVENTS:
        _apply(reading.record, _openai_wire.read_response_event(kind, getattr(item, "response", None)))
    return False


def _item_reader(operation_path: str, capturing: bool) -> Callable[[_Reading, Any, int], bool]:
    """The per-chunk reader of an operation's stream; with content capture, one that also keeps the
    answer's pieces (the readers themselves never look at content, so capture off costs nothing)."""
    if operation_path.endswith("/responses"):
        return _capturing_responses_item if capturing else _responses_item
    if operation_path.endswith("/chat/completions"):
        return _capturing_chat_item if capturing else _chat_text_item
    return _capturing_completion_item if capturing else _completion_item


ItemReader = Callable[[_Reading, Any, int], bool]


def _capturing(read: ItemReader, keep: Callable[[_conversation.OutputMessages, Any], None]) -> ItemReader:
    """`read`, which also keeps each item's piece of the answer (content capture on)."""

    def capturing(reading: _Reading, item: Any, now: int) -> bool:
        hidden = read(reading, item, now)
        try:
            check_fault(sites.CONTENT_CHUNK)
            keep(reading.output, item)  # type: ignore[arg-type]
        except Exception as failure:  # the answer's content is incomplete; its timing is not
            report(sites.CONTENT_CHUNK, failure)
        return hidden

    return capturing


_capturing_chat_item = _capturing(_chat_item, _conversation.OutputMessages.chat_chunk)
_capturing_completion_item = _capturing(_completion_item, _conversation.OutputMessages.completion_chunk)
_capturing_responses_item = _capturing(_responses_item, _conversation.OutputMessages.responses_event)


def _read_result(reading: _Reading, result: Any) -> None:
    """A complete (non-streamed) response: an SDK object, or the decoded body of a raw one."""
    record = reading.record
    if reading.output is None and (not record.recording or record.later(_outcome, result)):
        # Unsampled: only what the metrics need, the model that answered and the token counts (and, for a
        # held span, the rest when the span is written).
        top = _openai_wire.fields(result)
        record.set_response(None, top.get("model"))
        usage = top.get("usage")
        if usage is not None:
            record.set_usage(*_openai_wire.read_usage(usage))  # `_usage`: a span that does not record
        return
    if reading.output is None:  # no content to capture: the answer's text is not read
        _apply(record, _openai_wire.read_outcome(result))
        return
    _apply(reading.record, _openai_wire.read_payload(result))
    if reading.output is not None:
        with swallow(sites.OPENAI_CONTENT):
            reading.output.whole(result)


def _read_failed_answer(reading: _Reading) -> None:
    """The SDK raised after the server answered (a `parse()` whose model did not validate, a length
    finish it refuses): what the answer said still belongs on the call."""
    attempts = reading.record.attempts
    if not attempts or reading.record.stream:
        return
    final = attempts[-1]
    # Only a body read to its end: one cut off mid-read is a transport failure with nothing to read.
    if final.response is not None and final.status == 200 and final.body_done_ns is not None:
        with swallow(sites.OPENAI_RAW):
            _read_result(reading, final.response.json())


def _failed(reading: _Reading, error: BaseException) -> None:
    """The SDK's request raised: cancelled, or failed (after reading what the server said, if it did)."""
    if isinstance(error, asyncio.CancelledError):
        _finish(reading, names.OUTCOME_CANCELLED, error)
        return
    _read_failed_answer(reading)
    _finish(reading, names.OUTCOME_ERROR, error)


def _finish(
    reading: _Reading, outcome: str, error: BaseException | None = None, at_ns: int | None = None
) -> None:
    if reading.output is not None and not reading.record.finished:
        with swallow(sites.OPENAI_CONTENT):
            _content.write_output(reading.record, reading.capture, reading.output)
    reading.record.finish(outcome, error=error, now_ns=at_ns)


# --- wrapping the client --------------------------------------------------------------------


class OpenAIInstrumentation:
    """Installed on one openai client; `uninstall()` puts everything back."""

    def __init__(self, client: Any, settings: Settings) -> None:
        import openai

        self.client = client
        self.settings = settings
        self.is_async = isinstance(client, openai.AsyncOpenAI)
        self._stream_types = (openai.Stream, openai.AsyncStream)
        self._raw_types = _internals.openai_raw_response_types()
        self._original_request = client.request
        self._send = self._original_request  # what sends an LLM call: the SDK's request, or a hedge's
        self._original_copy = client.copy
        self._transport_installed = False

    def install(self) -> None:
        client = self.client
        client.request = self._async_request if self.is_async else self._sync_request
        client.copy = client.with_options = self._copy
        if self.settings.hedge is not None:
            self._send = self.settings.hedge.sender(client, self._original_request, self.settings.limiter)
        http_client = _internals.openai_http_client(client)
        self._transport_installed = http_client is not None and _transport.install(http_client)
        setattr(client, _MARK, self)

    def uninstall(self) -> None:
        client = self.client
        for attribute in ("request", "copy", "with_options", "_prepare_request"):  # the last: a sync hedge's
            client.__dict__.pop(attribute, None)
        if self._transport_installed:
            _transport.remove(_internals.openai_http_client(client))
        client.__dict__.pop(_MARK, None)
        self.settings.close()

    def _copy(self, *args: Any, **kwargs: Any) -> Any:
        copied = self._original_copy(*args, **kwargs)
        with swallow(sites.OPENAI_COPY):
            if getattr(copied, _MARK, None) is None:
                # A copy shares the original's sampler; only the original closes it.
                shared = dataclasses.replace(self.settings, owns_server_metrics=False)
                OpenAIInstrumentation(copied, shared).install()
        return copied

    def _begin(self, options: Any, sinks: _telemetry.Sinks | None) -> tuple[_Reading, Any] | None:
        """Open the call for one request (None: not an LLM call, or llmspans failed and stands aside)."""
        try:
            if _guard.faults:
                check_fault(sites.OPENAI_BEGIN)
            return self._open(options, sinks)
        except Deliberate:  # a prompt cap refusing the call: the app's to see
            raise
        except Exception as failure:
            report(sites.OPENAI_BEGIN, failure)
            return None

    def _open(self, options: Any, sinks: _telemetry.Sinks | None) -> tuple[_Reading, Any] | None:
        url = getattr(options, "url", "")
        operation = _openai_wire.operation_for(url) if isinstance(url, str) else None
        if operation is None:
            return None
        body = options.json_data if isinstance(options.json_data, Mapping) else {}
        extra = getattr(options, "extra_json", None)
        if isinstance(extra, Mapping) and extra:
            body = {**body, **extra}  # extra_body: what the SDK sends merged into the JSON
        stream = body.get("stream") is True
        # A raw response (`with_streaming_response`, `with_raw_response`) the app may read line by
        # line: its bytes are then all there is to read, so the transport reads them for us.
        raw = stream and raw_mode(options) is not None
        hide_usage = False
        if (
            self.settings.request_usage and stream and operation == names.OPERATION_CHAT
            and not _openai_wire.is_responses_path(url) and "stream_options" not in body
            and not raw  # a usage chunk in raw lines could not be hidden from the app
        ):  # fmt: skip
            options = options.model_copy()
            options.json_data = {**options.json_data, "stream_options": {"include_usage": True}}
            hide_usage = True
        record = self.settings.new_record(
            operation, body, stream, self.client.base_url, called_at.get(), sinks
        )
        capture = _content.resolve(self.settings.capture_content) if record.recording else False
        reading = _Reading(record, url.rstrip("/"), hide_usage, capture)
        if raw:
            record.body_observer = StreamObserver(record, capture, _openai_wire.is_responses_path(url))
        if capture:
            with swallow(sites.OPENAI_CONTENT):
                _content.write_input(record, capture, body)
        return reading, options

    def _hand_over(self, reading: _Reading, result: Any) -> Any:
        """What both twins do after their I/O: the object the caller gets (the SDK's own when llmspans
        failed, the call then ended)."""
        wrapped = self._wrap_result(reading, result)
        if wrapped is None:  # our own failure: the caller still gets the SDK's object
            reading.record.finish(names.OUTCOME_COMPLETED)
            return result
        return wrapped

    def _wrap_result(self, reading: _Reading, result: Any) -> Any:
        """The object to hand the caller: a stream proxy, a raw-response proxy, or the result itself;
        None when llmspans failed (the caller then gets the SDK's object)."""
        try:
            if _guard.faults:
                check_fault(sites.OPENAI_RESULT)
            if isinstance(result, self._stream_types):
                proxy: type[Any] = (
                    AsyncStreamProxy if isinstance(result, self._stream_types[1]) else SyncStreamProxy
                )
                reader = _item_reader(reading.operation, reading.output is not None)
                on_item = functools.partial(reader, reading)  # called once per chunk
                return proxy(result, reading.record, on_item, functools.partial(_finish, reading))
            if isinstance(result, self._raw_types):
                return self._wrap_raw(reading, result)
            _read_result(reading, result)
            _finish(reading, names.OUTCOME_COMPLETED)
            return result
        except Exception as failure:
            report(sites.OPENAI_RESULT, failure)
            return None

    def _wrap_raw(self, reading: _Reading, raw: Any) -> Any:
        """`with_raw_response` / `with_streaming_response`: the call ends with `parse()` or the body."""
        http_response = raw.http_response
        if http_response.is_stream_consumed or http_response.is_closed:
            # The body is read: a non-streamed raw response is complete now.
            with swallow(sites.OPENAI_RAW):
                _read_result(reading, http_response.json())
            _finish(reading, names.OUTCOME_COMPLETED)
            return raw
        reading.record.finish_on_close = True
        return _RawResponseProxy(raw, self, reading)

    def _lead_in(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], sinks: _telemetry.Sinks | None
    ) -> tuple[_Reading, tuple[Any, ...], dict[str, Any]] | None:
        """What both twins do before their I/O: open the call, and pass on the (maybe amended) options;
        None: not an LLM call, or llmspans failed and stands aside."""
        options = args[1] if len(args) > 1 else kwargs.get("options")
        begun = self._begin(options, sinks)
        if begun is None:
            return None
        reading, options = begun
        if len(args) > 1:
            args = (args[0], options, *args[2:])
        else:
            kwargs["options"] = options
        return reading, args, kwargs

    def _sync_request(self, *args: Any, **kwargs: Any) -> Any:
        sinks = _telemetry.recording_sinks()
        if sinks is None and not self.settings.acts:  # nothing to record, nothing to do
            return self._original_request(*args, **kwargs)
        begun = self._lead_in(args, kwargs, sinks)
        if begun is None:
            return self._original_request(*args, **kwargs)
        reading, args, kwargs = begun
        if self.settings.limiter is not None:
            reading.record.admit(self.settings.limiter)  # a limiter timeout is the caller's error to see
        with _Sending(reading):
            result = self._send(*args, **kwargs)
        return self._hand_over(reading, result)

    async def _async_request(self, *args: Any, **kwargs: Any) -> Any:
        sinks = _telemetry.recording_sinks()
        if sinks is None and not self.settings.acts:  # nothing to record, nothing to do
            return await self._original_request(*args, **kwargs)
        begun = self._lead_in(args, kwargs, sinks)
        if begun is None:
            return await self._original_request(*args, **kwargs)
        reading, args, kwargs = begun
        if self.settings.limiter is not None:
            await reading.record.admit_async(self.settings.limiter)
        with _Sending(reading):
            result = await self._send(*args, **kwargs)
        return self._hand_over(reading, result)


class _Sending:
    """The call is current while the SDK sends it (for the transport, and as the parent of spans), and what the
    SDK raises is the call's failure; sync or async alike."""

    __slots__ = ("call_token", "context_token", "reading")

    def __init__(self, reading: _Reading) -> None:
        self.reading = reading

    def __enter__(self) -> None:
        record = self.reading.record
        self.call_token = _transport.active_call.set(record)
        self.context_token = otel_context.attach(record.context())

    def __exit__(self, exc_type: Any, error: BaseException | None, traceback: Any) -> None:
        try:
            if error is not None:
                _failed(self.reading, error)
        finally:
            otel_context.detach(self.context_token)
            _transport.active_call.reset(self.call_token)


def raw_mode(options: Any) -> str | None:
    """`stream` (`with_streaming_response`), `raw` or `true` (`with_raw_response`), or None."""
    headers = getattr(options, "headers", None)
    if not headers or not isinstance(headers, Mapping):  # mostly not given (falsy): no class check then
        return None
    mode = headers.get(_RAW_RESPONSE_HEADER, headers.get(_RAW_RESPONSE_HEADER.lower()))
    return mode if isinstance(mode, str) else None


def original_request(client: Any) -> Callable[..., Any]:
    """The client's own `request`, under llmspans' instrumentation if it has one: what sends a hedge's backup
    through another client, with no call of ours around it."""
    installed = getattr(client, _MARK, None)
    return client.request if installed is None else installed._original_request  # type: ignore[no-any-return]


class _RawResponseProxy(wrapt.ObjectProxy[Any]):
    """A raw response whose `parse()` result is instrumented like a direct call's.

    One class for every call (a class made per call would be a reference cycle of its own, left for the
    collector): what the call needs rides on the proxy's `_self_` attributes.
    """

    def __init__(self, raw: Any, adapter: OpenAIInstrumentation, reading: _Reading) -> None:
        super().__init__(raw)
        self._self_adapter = adapter
        self._self_reading = reading

    def _self_parsing(self) -> None:
        record = self._self_reading.record
        record.finish_on_close = False  # parse() reads and closes the body: we finish
        observer = record.body_observer
        if observer is not None:
            observer.muted = True  # the parsed stream's items are stamped instead

    def _self_failed(self, error: BaseException) -> None:
        _finish(self._self_reading, names.OUTCOME_ERROR, error)

    def _self_wrap(self, parsed: Any) -> Any:
        wrapped = self._self_adapter._wrap_result(self._self_reading, parsed)
        return parsed if wrapped is None else wrapped

    def parse(self, *args: Any, **kwargs: Any) -> Any:
        self._self_parsing()
        try:
            parsed = self.__wrapped__.parse(*args, **kwargs)
        except BaseException as error:
            self._self_failed(error)
            raise
        if hasattr(parsed, "__await__"):

            async def awaited() -> Any:
                try:
                    result = await parsed
                except BaseException as error:
                    self._self_failed(error)
                    raise
                return self._self_wrap(result)

            return awaited()
        return self._self_wrap(parsed)

    def __enter__(self) -> Any:
        self.__wrapped__.__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> Any:
        return self.__wrapped__.__exit__(*exc_info)

    async def __aenter__(self) -> Any:
        await self.__wrapped__.__aenter__()
        return self

    async def __aexit__(self, *exc_info: Any) -> Any:
        return await self.__wrapped__.__aexit__(*exc_info)
