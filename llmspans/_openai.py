"""The openai SDK adapter: turns the SDK's requests, streams and responses into call events.

It wraps the client's own `request()` (the one place every operation passes through, once
per logical call, around the SDK's retry loop), so one call record spans all attempts;
the transport layer under the client's HTTP client makes the attempt spans. Works with
openai 1.x/2.x (httpx) and 3.x (httpx2). Imports nothing from openai until a client is
instrumented.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import wrapt
from opentelemetry import context as otel_context
from opentelemetry import trace

from llmspans import _content, _transport
from llmspans import _names as names
from llmspans._call import CallRecord
from llmspans._guard import guarded, swallow
from llmspans._limiter import Limiter

if TYPE_CHECKING:
    from llmspans.vllm import ServerMetrics
from llmspans._stream import AsyncStreamProxy, SyncStreamProxy

_OPERATIONS = (
    ("/chat/completions", names.OPERATION_CHAT),
    ("/completions", names.OPERATION_TEXT_COMPLETION),
    ("/embeddings", names.OPERATION_EMBEDDINGS),
    ("/responses", names.OPERATION_CHAT),
)
_MARK = "_llmspans_instrumentation"


def operation_for(path: str) -> str | None:
    """The GenAI operation of an OpenAI-compatible path, or None for anything else."""
    path = path.split("?", 1)[0].rstrip("/")
    for suffix, operation in _OPERATIONS:
        if path.endswith(suffix):
            return operation
    return None


ATTEMPT_SPANS = ("retries", "always")


def check_attempt_spans(value: object, what: str = "attempt_spans") -> str | None:
    for choice in ATTEMPT_SPANS:
        if value == choice:
            return choice
    if value is None:
        return None
    raise ValueError(
        f"{what} must be 'retries' (a span per attempt once a call retries) or 'always', got {value!r}"
    )


_configured_attempt_spans = "retries"


def set_configured_attempt_spans(value: str) -> None:
    global _configured_attempt_spans
    _configured_attempt_spans = value


@dataclass(frozen=True)
class Settings:
    """What `instrument()` was asked for, shared by every call of one client."""

    provider: str
    budget: float | None
    capture_content: _content.CaptureSetting
    request_usage: bool
    limiter: Limiter | None = None
    server_metrics: ServerMetrics | None = None
    owns_server_metrics: bool = False
    attempt_spans: str | None = None  # None: configure()'s, else "retries"

    def close(self) -> None:
        """Stop what instrument() started for this client (a sampler it made)."""
        if self.owns_server_metrics and self.server_metrics is not None:
            self.server_metrics.close()

    def new_record(self, operation: str, body: Mapping[str, Any], stream: bool, url: Any) -> CallRecord:
        """A call record for one request of this client, from its JSON body and the server's URL."""
        model = body.get("model")
        record = CallRecord(
            operation=operation,
            model=model if isinstance(model, str) else None,
            provider=self.provider,
            stream=stream,
            request_attributes=request_attributes(body),
            server_address=url.host,
            server_port=url.port or (443 if url.scheme == "https" else 80),
            budget=self.budget,
            attempt_spans_always=(self.attempt_spans or _configured_attempt_spans) == "always",
        )
        sampler = self.server_metrics
        if sampler is not None:
            record.server_state = sampler.span_attributes
            if self.limiter is None:  # admitted at once: the state now is the state at admission
                record.stamp_server_state()
        return record


def request_attributes(body: Mapping[str, Any]) -> dict[str, Any]:
    """Sampling parameters from a request body, under their GenAI names."""
    attributes: dict[str, Any] = {}
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens", body.get("max_output_tokens")))
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool):
        attributes[names.GEN_AI_REQUEST_MAX_TOKENS] = max_tokens
    for key, attribute in (
        ("temperature", names.GEN_AI_REQUEST_TEMPERATURE),
        ("top_p", names.GEN_AI_REQUEST_TOP_P),
    ):
        value = body.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            attributes[attribute] = float(value)
    top_k = body.get("top_k")  # vLLM's sampling extension, sent through extra_body
    if isinstance(top_k, int) and not isinstance(top_k, bool):
        attributes[names.GEN_AI_REQUEST_TOP_K] = top_k
    return attributes


def _text_parts(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "content": content}]
    if isinstance(content, list):
        return [
            {"type": "text", "content": part.get("text", "")}
            for part in content
            if isinstance(part, Mapping) and part.get("type") in ("text", "input_text", "output_text")
        ]
    return []


def input_messages(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """The request's messages in the GenAI convention's shape (role + parts)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return [
            {"role": str(m.get("role", "user")), "parts": _text_parts(m.get("content"))}
            for m in messages
            if isinstance(m, Mapping)
        ]
    for key in ("prompt", "input"):
        value = body.get(key)
        if isinstance(value, str):
            return [{"role": "user", "parts": _text_parts(value)}]
        if isinstance(value, list) and key == "input":
            return [
                {"role": str(m.get("role", "user")), "parts": _text_parts(m.get("content"))}
                for m in value
                if isinstance(m, Mapping)
            ]
    return None


def write_content(
    record: CallRecord, setting: _content.CaptureSetting, attribute: str, messages: Any
) -> None:
    """Serialise opted-in content through the user's redaction hook, capped in length."""
    if not setting or messages is None:
        return
    if callable(setting) and not isinstance(setting, bool):
        messages = setting(messages)
        if messages is None:
            return
    text = messages if isinstance(messages, str) else json.dumps(messages, ensure_ascii=False, default=str)
    record.set_attributes({attribute: text[: _content.MAX_CONTENT_CHARS]})


class _Call:
    """The per-call state the adapter keeps beside the record."""

    __slots__ = ("capture", "hide_usage", "operation", "output", "record")

    def __init__(
        self, record: CallRecord, operation: str, hide_usage: bool, capture: _content.CaptureSetting
    ) -> None:
        self.record = record
        self.operation = operation
        self.hide_usage = hide_usage
        self.capture = capture
        self.output: list[str] | None = [] if capture else None


# --- reading the SDK's objects -------------------------------------------------------------


_ABSENT: Any = object()


def _has(obj: Any, name: str) -> bool:
    """`hasattr(obj, name)`, without the exception a pydantic model raises (slowly) for a name it lacks.

    A pydantic model keeps its fields in `__dict__` and unknown keys in `__pydantic_extra__`;
    for anything else (a private or class attribute, another kind of object) the object is asked.
    """
    if name in getattr(obj, "__dict__", ()):
        return True
    cls = type(obj)
    private = getattr(cls, "__private_attributes__", None)
    if private is None or name in private or hasattr(cls, name):
        return hasattr(obj, name)
    extra = getattr(obj, "__pydantic_extra__", None)
    return isinstance(extra, dict) and name in extra


def _usage(record: CallRecord, usage: Any) -> None:
    if usage is None:
        return
    details = getattr(usage, "prompt_tokens_details", None) or (
        getattr(usage, "input_tokens_details", None) if _has(usage, "input_tokens_details") else None
    )
    # The Chat Completions names first, the Responses names only when they are absent (see `_has`).
    input_tokens = getattr(usage, "prompt_tokens", _ABSENT)
    if input_tokens is _ABSENT:
        input_tokens = getattr(usage, "input_tokens", None)
    output_tokens = getattr(usage, "completion_tokens", _ABSENT)
    if output_tokens is _ABSENT:
        output_tokens = getattr(usage, "output_tokens", None)
    record.set_usage(input_tokens, output_tokens, getattr(details, "cached_tokens", None))


def _chat_item(call: _Call, item: Any, now: int) -> bool:
    record = call.record
    if record.response_id is None:
        record.set_response(getattr(item, "id", None), getattr(item, "model", None))
    choices = item.choices
    usage = item.usage
    if choices:
        for choice in choices:
            delta = choice.delta
            if delta is not None:
                text = delta.content
                if text or delta.tool_calls or getattr(delta, "reasoning_content", None):
                    record.content_chunk(now, _tokens_in(record, usage) if usage is not None else 1)
                    if call.output is not None and text:
                        call.output.append(text)
                    break
        for choice in choices:
            if choice.finish_reason:
                record.choice_finished(choice.index, choice.finish_reason)
    if usage is not None:
        _usage(record, usage)
        return call.hide_usage and not choices
    return False


def _tokens_in(record: CallRecord, usage: Any) -> int:
    """Tokens a content chunk carried, from cumulative usage on every chunk (vLLM's continuous stats)."""
    total = getattr(usage, "completion_tokens", None)
    if not isinstance(total, int) or isinstance(total, bool):
        return 1
    return max(1, total - (record.output_tokens or 0))


def _completion_item(call: _Call, item: Any, now: int) -> bool:
    record = call.record
    if record.response_id is None:
        record.set_response(getattr(item, "id", None), getattr(item, "model", None))
    choices = item.choices
    if choices:
        text = choices[0].text
        if text:
            record.content_chunk(now)
            if call.output is not None:
                call.output.append(text)
        for choice in choices:
            if choice.finish_reason:
                record.choice_finished(getattr(choice, "index", None), choice.finish_reason)
    usage = getattr(item, "usage", None)
    if usage is not None:
        _usage(record, usage)
        return call.hide_usage and not choices
    return False


_RESPONSES_CONTENT = frozenset(
    {
        "response.output_text.delta", "response.function_call_arguments.delta", "response.reasoning_text.delta",
        "response.refusal.delta",
    }
)  # fmt: skip
_RESPONSES_FINISH = {"completed": "stop", "incomplete": "length", "failed": "error"}


def _responses_item(call: _Call, item: Any, now: int) -> bool:
    kind = getattr(item, "type", None)
    if kind in _RESPONSES_CONTENT:
        delta = getattr(item, "delta", None)
        if delta:
            call.record.content_chunk(now)
            if call.output is not None and kind == "response.output_text.delta":
                call.output.append(delta)
    elif kind in ("response.created", "response.completed", "response.incomplete", "response.failed"):
        _responses_object(call.record, getattr(item, "response", None))
    return False


def _responses_object(record: CallRecord, response: Any) -> None:
    if response is None:
        return
    status = getattr(response, "status", None)
    reason = _RESPONSES_FINISH.get(status) if isinstance(status, str) else None
    record.set_response(
        getattr(response, "id", None), getattr(response, "model", None), [reason] if reason else []
    )
    _usage(record, getattr(response, "usage", None))


def _item_reader(operation_path: str) -> Callable[[_Call, Any, int], bool]:
    if operation_path.endswith("/responses"):
        return _responses_item
    if operation_path.endswith("/chat/completions"):
        return _chat_item
    return _completion_item


def _read_result(call: _Call, result: Any) -> None:
    """Attributes from a complete (non-streamed) response object."""
    record = call.record
    if getattr(result, "object", None) == "response" or _has(result, "output"):
        _responses_object(record, result)
        if call.capture:
            text = getattr(result, "output_text", None)
            call.output = [text] if isinstance(text, str) else None
        return
    choices = getattr(result, "choices", None) or ()
    record.set_response(
        getattr(result, "id", None), getattr(result, "model", None),
        [c.finish_reason for c in choices if getattr(c, "finish_reason", None)],
    )  # fmt: skip
    _usage(record, getattr(result, "usage", None))
    if call.capture:
        texts = []
        for choice in choices:
            message = getattr(choice, "message", None)
            text = getattr(message, "content", None) if message is not None else getattr(choice, "text", None)
            if isinstance(text, str):
                texts.append(text)
        call.output = texts


def _finish(call: _Call, outcome: str, error: BaseException | None = None, at_ns: int | None = None) -> None:
    if call.output is not None and not call.record.finished:
        with swallow("openai.content"):
            text = "".join(call.output)
            write_content(
                call.record, call.capture, names.GEN_AI_OUTPUT_MESSAGES,
                [{"role": "assistant", "parts": [{"type": "text", "content": text}]}],
            )  # fmt: skip
    call.record.finish(outcome, error=error, now_ns=at_ns)


# --- wrapping the client --------------------------------------------------------------------


class OpenAIInstrumentation:
    """Installed on one openai client; `uninstall()` puts everything back."""

    def __init__(self, client: Any, settings: Settings) -> None:
        import openai

        self.client = client
        self.settings = settings
        self.is_async = isinstance(client, openai.AsyncOpenAI)
        self._stream_types = (openai.Stream, openai.AsyncStream)
        from openai import _legacy_response, _response

        self._raw_types = (
            _legacy_response.LegacyAPIResponse,
            _response.APIResponse,
            _response.AsyncAPIResponse,
        )
        self._original_request = client.request
        self._original_copy = client.copy
        self._transport_installed = False

    def install(self) -> None:
        client = self.client
        client.request = self._async_request if self.is_async else self._sync_request
        client.copy = client.with_options = self._copy
        self._transport_installed = _transport.install(client._client)
        setattr(client, _MARK, self)

    def uninstall(self) -> None:
        client = self.client
        for attribute in ("request", "copy", "with_options"):
            client.__dict__.pop(attribute, None)
        if self._transport_installed:
            _transport.remove(client._client)
        client.__dict__.pop(_MARK, None)
        self.settings.close()

    def _copy(self, *args: Any, **kwargs: Any) -> Any:
        copied = self._original_copy(*args, **kwargs)
        with swallow("openai.copy"):
            if getattr(copied, _MARK, None) is None:
                # A copy shares the original's sampler; only the original closes it.
                shared = dataclasses.replace(self.settings, owns_server_metrics=False)
                OpenAIInstrumentation(copied, shared).install()
        return copied

    @guarded("openai.begin", None)
    def _begin(self, options: Any) -> tuple[_Call, Any] | None:
        url = getattr(options, "url", "")
        operation = operation_for(url) if isinstance(url, str) else None
        if operation is None:
            return None
        body = options.json_data if isinstance(options.json_data, Mapping) else {}
        extra = getattr(options, "extra_json", None)
        if isinstance(extra, Mapping) and extra:
            body = {**body, **extra}  # extra_body: what the SDK sends merged into the JSON
        stream = body.get("stream") is True
        hide_usage = False
        if (
            self.settings.request_usage and stream and operation == names.OPERATION_CHAT
            and not url.rstrip("/").endswith("/responses") and "stream_options" not in body
            and "stream_options" not in (options.extra_json or {})
        ):  # fmt: skip
            options = options.model_copy()
            options.json_data = {**options.json_data, "stream_options": {"include_usage": True}}
            hide_usage = True
        record = self.settings.new_record(operation, body, stream, self.client.base_url)
        capture = _content.resolve(self.settings.capture_content) if record.recording else False
        call = _Call(record, url.rstrip("/"), hide_usage, capture)
        if capture:
            with swallow("openai.content"):
                write_content(record, capture, names.GEN_AI_INPUT_MESSAGES, input_messages(body))
        return call, options

    @guarded("openai.result", None)
    def _wrap_result(self, call: _Call, result: Any) -> Any:
        """The object to hand the caller: a stream proxy, a raw-response proxy, or the result itself."""
        if isinstance(result, self._stream_types):
            proxy: type[Any] = (
                AsyncStreamProxy if isinstance(result, self._stream_types[1]) else SyncStreamProxy
            )
            on_item = functools.partial(_item_reader(call.operation), call)  # called once per chunk
            return proxy(result, call.record, on_item, functools.partial(_finish, call))
        if isinstance(result, self._raw_types):
            return self._wrap_raw(call, result)
        _read_result(call, result)
        _finish(call, names.OUTCOME_COMPLETED)
        return result

    def _wrap_raw(self, call: _Call, raw: Any) -> Any:
        """`with_raw_response` / `with_streaming_response`: the call ends with `parse()` or the body."""
        http_response = raw.http_response
        if http_response.is_stream_consumed or http_response.is_closed:
            # The body is read: a non-streamed raw response is complete now.
            with swallow("openai.raw"):
                _read_result(call, _Json(http_response.json()))
            _finish(call, names.OUTCOME_COMPLETED)
            return raw
        call.record.finish_on_close = True
        adapter = self

        class RawProxy(_RawResponseProxy):
            def _self_parsing(self) -> None:
                call.record.finish_on_close = False  # parse() reads and closes the body: we finish

            def _self_failed(self, error: BaseException) -> None:
                _finish(call, names.OUTCOME_ERROR, error)

            def _self_wrap(self, parsed: Any) -> Any:
                wrapped = adapter._wrap_result(call, parsed)
                return parsed if wrapped is None else wrapped

        return RawProxy(raw)

    def _sync_request(self, *args: Any, **kwargs: Any) -> Any:
        options = args[1] if len(args) > 1 else kwargs.get("options")
        begun = self._begin(options)
        if begun is None:
            return self._original_request(*args, **kwargs)
        call, options = begun
        args = (args[0], options, *args[2:]) if len(args) > 1 else args
        if len(args) <= 1:
            kwargs["options"] = options
        limiter = self.settings.limiter
        if limiter is not None:
            try:
                admission = limiter.acquire()
            except BaseException as error:  # a limiter timeout is the caller's error to see
                _finish(call, names.OUTCOME_ERROR, error)
                raise
            call.record.hold(admission)
        call_token = _transport.active_call.set(call.record)
        context_token = otel_context.attach(trace.set_span_in_context(call.record.span))
        try:
            result = self._original_request(*args, **kwargs)
        except BaseException as error:
            _finish(call, names.OUTCOME_ERROR, error)
            raise
        finally:
            otel_context.detach(context_token)
            _transport.active_call.reset(call_token)
        wrapped = self._wrap_result(call, result)
        if wrapped is None:  # our own failure: the caller still gets the SDK's object
            call.record.finish(names.OUTCOME_COMPLETED)
            return result
        return wrapped

    async def _async_request(self, *args: Any, **kwargs: Any) -> Any:
        options = args[1] if len(args) > 1 else kwargs.get("options")
        begun = self._begin(options)
        if begun is None:
            return await self._original_request(*args, **kwargs)
        call, options = begun
        args = (args[0], options, *args[2:]) if len(args) > 1 else args
        if len(args) <= 1:
            kwargs["options"] = options
        limiter = self.settings.limiter
        if limiter is not None:
            try:
                admission = await limiter.acquire_async()
            except asyncio.CancelledError as error:
                _finish(call, names.OUTCOME_CANCELLED, error)
                raise
            except BaseException as error:
                _finish(call, names.OUTCOME_ERROR, error)
                raise
            call.record.hold(admission)
        call_token = _transport.active_call.set(call.record)
        context_token = otel_context.attach(trace.set_span_in_context(call.record.span))
        try:
            result = await self._original_request(*args, **kwargs)
        except asyncio.CancelledError as error:
            _finish(call, names.OUTCOME_CANCELLED, error)
            raise
        except BaseException as error:
            _finish(call, names.OUTCOME_ERROR, error)
            raise
        finally:
            otel_context.detach(context_token)
            _transport.active_call.reset(call_token)
        wrapped = self._wrap_result(call, result)
        if wrapped is None:
            call.record.finish(names.OUTCOME_COMPLETED)
            return result
        return wrapped


class _Json:
    """Attribute access over a decoded JSON object, so one reader serves models and raw bodies."""

    def __init__(self, data: Any) -> None:
        self._data = data

    def __getattr__(self, name: str) -> Any:
        data = self._data
        if isinstance(data, Mapping) and name in data:
            value = data[name]
            if isinstance(value, list):
                return [_Json(v) if isinstance(v, Mapping) else v for v in value]
            return _Json(value) if isinstance(value, Mapping) else value
        raise AttributeError(name)


class _RawResponseProxy(wrapt.ObjectProxy[Any]):
    """A raw response whose `parse()` result is instrumented like a direct call's."""

    def _self_parsing(self) -> None:  # pragma: no cover - replaced per call
        pass

    def _self_failed(self, error: BaseException) -> None:  # pragma: no cover - replaced per call
        pass

    def _self_wrap(self, parsed: Any) -> Any:  # pragma: no cover - replaced per call
        return parsed

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
