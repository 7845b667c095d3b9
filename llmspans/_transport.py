"""The transport layer: every HTTP attempt seen, connections timed, context injected.

A wrapper around an httpx or httpx2 client's transport sees every physical attempt the
client makes (the openai SDK's retry loop calls `send()` once per attempt). For each
attempt inside an LLM call it records the attempt on the call, times connection set-up
from httpcore's `trace` request extension (no `connect_tcp` event means a pooled connection
was reused), makes an attempt span where one says something (a retried call; see
`_AttemptScope`), injects the trace context, and watches the response body so the attempt
ends when the body is closed and a non-streamed call knows when its body was read.

Which call an attempt belongs to comes from `active_call`, set by the client adapter
around the SDK's request; a plain httpx client has no adapter, so a `CallOpener` opens a
call per request to an OpenAI-compatible path. Whoever the attempts are recorded on (the call
record itself, or one copy of a hedged call) is an `AttemptWatcher`: the one way anything learns
of an attempt.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import importlib
import logging
import socket
import time
import weakref
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, Protocol

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.context import Context
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from llmspans import _deferred, _guard, _internals, _retries, _telemetry
from llmspans import _names as names
from llmspans import _sites as sites
from llmspans._budget import seconds
from llmspans._call import Attempt, CallRecord, OpenSet
from llmspans._guard import Deliberate, check_fault, report, swallow
from llmspans._limiter import Limiter
from llmspans._names import PROVIDER_VLLM

logger = logging.getLogger("llmspans")


class AttemptRefused(BaseException):
    """What a watcher raises from `attempt_started` to keep an attempt from being sent (a hedge's copy that
    lost): a BaseException, so neither a client's retry loop nor a handler of ordinary errors takes it for a
    failure to retry; it reaches whoever sent the request, unchanged."""


class AttemptControl(Protocol):
    """What a watcher may do with an attempt under way: follow its request (`request.extensions` takes a
    `trace` hook, as httpcore defines it) and `interrupt()` it from another thread or task, which shuts its
    HTTP/1.1 connection down (False where it cannot: HTTP/2, not yet on a connection)."""

    @property
    def request(self) -> Any: ...

    def interrupt(self) -> bool: ...


class AttemptWatcher(Protocol):
    """Whoever a call's attempts are recorded on, and the one way anything learns of them: the call record
    itself (`CallRecord`), or one copy of a hedged call, which composes the call (`_hedge.copies`).

    The transport makes every attempt and tells its watcher, in the thread or task that sends it:
    `attempt_started` before the request leaves (the watcher keeps the attempt, or refuses it by raising
    `AttemptRefused`); `attempt_answered` once its response headers came (`attempt.status`,
    `attempt.response`); `attempt_body_done` once its body was read to its end (`attempt.body_done_ns`);
    `attempt_failed` when it failed, before its headers or after them (`attempt.cause`, `error_type`).
    Only `attempt_started` may raise: what the others raise is reported (`sites.TRANSPORT_WATCHER`),
    never the app's. Each read of the body is stamped on the attempt itself (`Attempt.bytes_at_ns`),
    not told: it is the per-chunk path.

    The transport reads three things back: `call`, the logical call the attempts belong to (its span is
    their parent, its clock theirs); `attempts`, those kept so far, in order (an attempt's resend count,
    and the first attempt's span made once a second starts); `attempt_spans_always`, whether every
    attempt gets its span as it runs.
    """

    @property
    def call(self) -> CallRecord: ...

    @property
    def attempts(self) -> Sequence[Attempt]: ...

    @property
    def attempt_spans_always(self) -> bool: ...

    def attempt_started(self, attempt: Attempt, control: AttemptControl) -> None: ...
    def attempt_answered(self, attempt: Attempt) -> None: ...
    def attempt_body_done(self, attempt: Attempt) -> None: ...
    def attempt_failed(self, attempt: Attempt, error: BaseException) -> None: ...


# The watcher of the requests sent in this thread or task: the call the adapter made, or a hedged call's copy.
active_call: contextvars.ContextVar[AttemptWatcher | None] = contextvars.ContextVar(
    "llmspans_call", default=None
)

# Query parameters whose value is redacted in url.full: any name ending in one of the suffixes
# (the bare words included), or one of the other names, compared without '-' and '_' and case
# (x-api-key, access-token, api_token, key, sig, Signature, X-Goog-Signature, AWSAccessKeyId...).
_SECRET_QUERY_KEYS = frozenset({"auth", "authorization", "code", "awsaccesskeyid"})
_SECRET_QUERY_SUFFIXES = ("key", "token", "secret", "signature", "password", "credential", "sig")


def _secret_query_key(key: str) -> bool:
    folded = key.lower().replace("-", "").replace("_", "")
    return folded in _SECRET_QUERY_KEYS or folded.endswith(_SECRET_QUERY_SUFFIXES)


_RETRY_HEADER = "x-stainless-retry-count"


class BodyObserver(Protocol):
    """What a plain-client call watches in the response body (the SSE parser, for one).

    `response_headers` comes first: the bytes `feed` then gets are the body as it came off the
    wire, still content-encoded. `complete` turns true once the body said it was over (`[DONE]`,
    a final Responses event), so a caller who closes the response after that has not abandoned
    the call.
    """

    complete: bool

    def response_headers(self, headers: Any) -> None: ...
    def feed(self, chunk: bytes, now_ns: int) -> None: ...
    def finish(self, now_ns: int, error: BaseException | None) -> None: ...


class CallOpener(Protocol):
    """Opens call records for a plain httpx client; None for requests that are not LLM calls."""

    limiter: Limiter | None

    def begin(self, request: Any) -> tuple[CallRecord, BodyObserver | None] | None: ...


def safe_url(url: Any) -> str:
    """`url.full` as the HTTP conventions want it: user info as `REDACTED:REDACTED@`, and the
    values of secret-looking query parameters as `REDACTED`."""
    text = str(url)
    if "@" not in text and "?" not in text:  # no user info and no query: nothing to take out
        return text
    changes: dict[str, Any] = {}
    if url.username or url.password:
        changes.update(username=_REDACTED, password=_REDACTED)
    if url.query:
        params = url.params
        if any(_secret_query_key(key) for key in params):
            changes["params"] = [
                (key, _REDACTED if _secret_query_key(key) else value) for key, value in params.multi_items()
            ]
    return str(url.copy_with(**changes)) if changes else text


_REDACTED = "REDACTED"
_IDENTITY: dict[str, str] = {}  # the headers of a body that needs no decoding
_LAST_BYTES = 64  # enough of a body read whole for the `[DONE]` check of `CallRecord.finish`


def cause_of(error: BaseException) -> str:
    """A short, stable retry cause for an exception raised by an attempt."""
    kind = type(error).__name__
    if "Timeout" in kind:
        return "timeout"
    if "Connect" in kind:
        return "connect_error"
    if kind in ("ReadError", "RemoteProtocolError", "WriteError", "CloseError", "ProtocolError"):
        return "connection_error"
    return kind


# Attempts whose body is still open, so the exit hook can end them before the providers flush.
_open_attempts: OpenSet[_AttemptScope] = OpenSet()


def end_open_attempts() -> None:
    """At interpreter exit: end every attempt whose response body was never closed (and its call)."""
    for scope in list(_open_attempts):
        with swallow(sites.TRANSPORT_EXIT):
            scope.close()


class _AttemptScope:
    """One attempt: its record on its watcher, its span where it gets one, and the close of its response body.

    An attempt span only where it says something (DESIGN §2): a call whose first attempt succeeds has none,
    its request carries the call span's context, and its HTTP facts go on the call span. When a second
    attempt starts, the first gets its span after the fact, with its real start and end, and every later
    attempt gets one as it runs and sends it as the parent. With `attempt_spans="always"` (or a watcher that
    asks it: a hedge's backup) every attempt has one. A call span that does not record gets none.
    It is the `AttemptControl` its watcher gets.
    """

    __slots__ = (
        "__weakref__", "attempt", "closed", "connect_started_ns", "inner", "observer", "owns_call", "record",
        "request", "retry_after_s", "sdk_retries", "tracked", "watcher",
    )  # fmt: skip

    def __init__(
        self,
        watcher: AttemptWatcher,
        request: Any,
        owns_call: bool,
        observer: BodyObserver | None,
        inner: Any,
    ) -> None:
        now = time.perf_counter_ns()
        self.watcher = watcher
        self.request = request
        self.inner = inner
        attempt = self.attempt = Attempt(now, request.method, request.url)
        watcher.attempt_started(attempt, self)  # may refuse it (AttemptRefused): then nothing else happens
        record = self.record = watcher.call
        self.owns_call = owns_call
        self.observer = observer
        self.closed = False
        self.sdk_retries = False  # the openai SDK sent it and will retry it if it fails (see `_retries`)
        self.retry_after_s: float | None = None
        self.connect_started_ns = 0
        attempts = watcher.attempts
        resend = attempt.resend_count = len(attempts) - 1
        if owns_call:  # a plain client's call sees one attempt: the SDK above it says which retry this is
            header = request.headers.get(_RETRY_HEADER)
            if header and header.isdigit():
                attempt.resend_count = resend if resend else int(header)
                self.sdk_retries = True
        # The exit hook ends what only this attempt would end: a plain call, a raw body's reader, a span.
        self.tracked = tracked = owns_call or observer is not None
        if tracked:
            _open_attempts.add(self)
        if record.suppressed:
            return  # no span, and no traceparent sent
        sent_under: Span | None = None  # the call's span, unless this attempt has one
        if record.recording and (watcher.attempt_spans_always or resend):
            first = attempts[0]
            if first is not attempt and first.span is None:  # made now, with its real start and end
                span_attempt_after(record, first)
            sent_under = attempt.span = start_attempt_span(record, attempt)
            if not tracked:
                self.tracked = True
                _open_attempts.add(self)
        try:  # a raising propagator must not reach the app (`swallow`, inlined: it runs on every call)
            _inject_call(request.headers, record, sent_under, record.shape.provider == PROVIDER_VLLM)
            if _guard.faults:
                check_fault(sites.TRANSPORT_INJECT)
        except Exception as failure:
            report(sites.TRANSPORT_INJECT, failure)

    def on_trace_event(self, event: str) -> None:
        if event == "connection.connect_tcp.started":
            self.connect_started_ns = time.perf_counter_ns()
            self.attempt.new_connection = True
        elif event in ("connection.connect_tcp.complete", "connection.start_tls.complete"):
            now = time.perf_counter_ns()
            self.attempt.connected_ns = now
            self.attempt.connect_ns = now - (self.connect_started_ns or self.attempt.started_ns)

    def interrupt(self) -> bool:
        """Wake whatever waits on this attempt's HTTP/1.1 connection (from another thread): the connection is
        shut down, the read in it ends, the server sees the client leave. False where it cannot: an HTTP/2
        connection (shared by other requests), or the request holds no connection now."""
        response = self.attempt.response
        stream = None
        if response is not None:  # its headers came: the response says which connection it is read from
            extensions = response.extensions
            if extensions.get("http_version", b"HTTP/1.1") not in (b"HTTP/1.1", b"HTTP/1.0"):
                return False
            stream = extensions.get("network_stream")
        if stream is None:
            stream = _internals.http11_network_stream(self.inner, self.request.extensions)
        sock = None if stream is None else stream.get_extra_info("socket")
        if sock is None:
            return False
        socket.socket.shutdown(sock, socket.SHUT_RDWR)  # the plain socket's: an SSL one keeps its state
        return True

    def responded(self, status: int, headers: Any, decoded: bool = False) -> None:
        """The response headers came; `decoded`: the body the observer will get is already decoded.
        (`_Transport._answered` guards it: `sites.TRANSPORT_RESPONSE`.)"""
        attempt = self.attempt
        attempt.status = status
        if status >= 400:
            attempt.cause = f"http_{status}"
            attempt.error_type = str(status)
            if self.sdk_retries:
                self.retry_after_s = _retries.retry_after_seconds(headers)
        if self.observer is not None:
            # The body it will see is still content-encoded, unless the response arrived read.
            self.observer.response_headers(_IDENTITY if decoded else headers)
        try:
            self.watcher.attempt_answered(attempt)
            if _guard.faults:
                check_fault(sites.TRANSPORT_WATCHER)
        except Exception as failure:
            report(sites.TRANSPORT_WATCHER, failure)

    def read_whole(self, response: Any) -> None:
        """A response handed over with its body complete and read: every byte arrived now, so the
        attempt (and a plain client's call) ends now, as it would after the last read of a body
        streamed through us; the app's own consumption of it comes after, in `post`."""
        now = time.perf_counter_ns()
        content = response.content  # the decoded body (`responded` told the observer so)
        attempt = self.attempt
        attempt.bytes_at_ns = now
        attempt.last_bytes = content[-_LAST_BYTES:]
        if self.observer is not None and content:
            _observe(self.observer, content, now)
        self.body_done(now)
        self.close(None, now)

    def failed(self, error: BaseException) -> None:
        with swallow(sites.TRANSPORT_FAILED):
            self.attempt.cause = cause_of(error)
            self.attempt.error_type = type(error).__qualname__
        self.close(error)

    def body_done(self, now_ns: int) -> None:
        """The body was read to its end: the attempt's stamp, and its watcher told."""
        attempt = self.attempt
        if attempt.body_done_ns is None:
            attempt.body_done_ns = now_ns
            try:
                self.watcher.attempt_body_done(attempt)
                if _guard.faults:
                    check_fault(sites.TRANSPORT_WATCHER)
            except Exception as failure:
                report(sites.TRANSPORT_WATCHER, failure)

    def close(self, error: BaseException | None = None, at_ns: int | None = None) -> None:
        """End the attempt (and, for a plain client, its call) at `at_ns` (None: now); runs once.

        Inside a garbage collection (a library's finalizer closing the body) the worker does it.
        """
        if self.closed:
            return
        if _deferred.collecting_thread and _deferred.collecting():
            _deferred.defer(self.close, error, at_ns or time.perf_counter_ns())
            return
        self.closed = True
        if self.tracked:
            _open_attempts.discard(self)
        now = at_ns if at_ns is not None else time.perf_counter_ns()
        attempt = self.attempt
        attempt.ended_ns = now
        record = self.record
        if error is not None:
            if attempt.error_type is None:  # the body failed after the headers
                attempt.error_type = type(error).__qualname__
            with swallow(sites.TRANSPORT_WATCHER):
                self.watcher.attempt_failed(attempt, error)
        if attempt.span is not None:
            with swallow(sites.TRANSPORT_SPAN_END):  # a span processor that raises must not reach the app
                end_attempt_span(record, attempt, error)
        if self.owns_call:
            ends_call = True
        elif record.finish_on_close:
            attempts = self.watcher.attempts
            ends_call = bool(attempts) and attempts[-1] is attempt
        else:
            ends_call = False
        if ends_call:
            if (
                self.owns_call
                and self.sdk_retries
                and record.on_release is None  # a limiter's slot is not held through a back-off
                and (
                    isinstance(error, Exception)
                    or (error is None and _retries.retried_status(attempt.status))
                )
            ):  # a cancellation is not retried: it ends the call now
                with swallow(sites.TRANSPORT_CLOSE):
                    # The SDK will likely retry: the call stays open for that attempt (`_retries`).
                    _retries.hold(record, functools.partial(self._end_call, error, now), self.retry_after_s)
                    return
            self._end_call(error, now)

    def _end_call(self, error: BaseException | None, now: int) -> None:
        if self.observer is not None:
            with swallow(sites.TRANSPORT_OBSERVER):
                self.observer.finish(now, error)
        self.record.finish(self._outcome(error), error=error, now_ns=now)

    def _outcome(self, error: BaseException | None) -> str:
        """How a call ended by its body's close: cancelled, failed, read to its end, or let go of before it."""
        if isinstance(error, asyncio.CancelledError):
            return names.OUTCOME_CANCELLED
        if error is not None or (self.attempt.status or 0) >= 400:
            return names.OUTCOME_ERROR
        if self.attempt.body_done_ns is not None or (self.observer is not None and self.observer.complete):
            return names.OUTCOME_COMPLETED
        return names.OUTCOME_ABANDONED


_W3C = TraceContextTextMapPropagator()
_SPAN_KEY, _BAGGAGE_KEY, _SHORTCUT = (
    _internals.SPAN_KEY,
    _internals.BAGGAGE_KEY,
    _internals.TRACEPARENT_SHORTCUT,
)
_OTEL_PROPAGATE = propagate
_OTEL_INJECT = propagate.inject  # replaced (an app's or a tool's wrapper): theirs runs, never the shortcut
_default_textmap: Any = None  # the global propagator, once found to be OpenTelemetry's default pair


def _inject_call(headers: Any, record: CallRecord, attempt_span: Span | None, w3c_too: bool) -> None:
    """`_inject` for a request sent under the call's span (or its attempt's), without making a context to
    hold the span where the shortcut writes the header itself (no baggage in the current context)."""
    span = record.span if attempt_span is None else attempt_span
    if isinstance(span, Span) and otel_context.get_value(_BAGGAGE_KEY) is None and _shortcut():
        _write_traceparent(headers, span)
        return
    _inject(
        headers,
        record.context() if attempt_span is None else trace.set_span_in_context(attempt_span),
        w3c_too,
    )


def _inject(headers: Any, context: Context, w3c_too: bool) -> None:
    """The global propagator's headers; for vLLM also W3C `traceparent`, the only one it reads.

    With OpenTelemetry's default propagators (W3C trace context and baggage) and no baggage in the
    context, it writes the `traceparent` (and `tracestate`) header itself, exactly as they would: their
    generic path (a composite, a setter, two context look-ups each) cost more than the header.
    """
    span = context.get(_SPAN_KEY)
    if isinstance(span, Span) and context.get(_BAGGAGE_KEY) is None and _shortcut():
        _write_traceparent(headers, span)
        return
    propagate.inject(headers, context=context)
    if w3c_too and "traceparent" not in headers:
        _W3C.inject(headers, context=context)


def _shortcut() -> bool:
    """Whether OpenTelemetry's own default propagators are in place, untouched (the shortcut's condition)."""
    return (
        propagate is _OTEL_PROPAGATE
        and propagate.inject is _OTEL_INJECT
        and _SHORTCUT
        and ((textmap := propagate.get_global_textmap()) is _default_textmap or _is_default_pair(textmap))
    )


def _write_traceparent(headers: Any, span: Span) -> None:
    """`traceparent` (and `tracestate`) exactly as the W3C propagator writes them; none for an invalid span."""
    span_context = span.get_span_context()
    if span_context.is_valid:
        traceparent = (
            f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}-{span_context.trace_flags:02x}"
        )
        if not _internals.add_header(headers, b"traceparent", traceparent):  # the request had one: replaced
            headers["traceparent"] = traceparent
        if span_context.trace_state:
            headers["tracestate"] = span_context.trace_state.to_header()


def _is_default_pair(textmap: Any) -> bool:
    """Whether the global propagator is the default one `OTEL_PROPAGATORS` makes (remembered if so)."""
    global _default_textmap
    if type(textmap) is not CompositePropagator:
        return False
    found = _internals.composite_members(textmap)
    if found is not None and [type(each) for each in found] == [
        TraceContextTextMapPropagator,
        W3CBaggagePropagator,
    ]:
        _default_textmap = textmap
        return True
    return False


def start_attempt_span(record: CallRecord, attempt: Attempt) -> Span:
    """An attempt's CLIENT span under the call span, from its start (which may be in the past), with what its
    watcher adds (`Attempt.span_attributes`)."""
    url = attempt.url
    attributes: dict[str, Any] = {
        names.HTTP_REQUEST_METHOD: attempt.method,
        names.URL_FULL: safe_url(url),
        names.SERVER_ADDRESS: url.host,
    }
    if url.port:
        attributes[names.SERVER_PORT] = url.port
    if attempt.resend_count:
        attributes[names.HTTP_REQUEST_RESEND_COUNT] = attempt.resend_count
    if attempt.span_attributes:
        attributes.update(attempt.span_attributes)
    return _telemetry.tracer().start_span(
        attempt.method, context=record.context(), kind=SpanKind.CLIENT,
        attributes=attributes, start_time=record.wall_ns(attempt.started_ns),
    )  # fmt: skip


def end_attempt_span(record: CallRecord, attempt: Attempt, error: BaseException | None) -> None:
    """What the attempt came to, and the end of its span: a failure before or after its headers marks it failed."""
    span = attempt.span
    if span is None:
        return
    attributes: dict[str, Any] = {
        names.CONNECT_REUSED: not attempt.new_connection,
        names.CONNECT_DURATION: seconds(attempt.connect_ns),
    }
    if attempt.status is not None:
        attributes[names.HTTP_RESPONSE_STATUS_CODE] = attempt.status
    if attempt.error_type is not None:
        attributes[names.ERROR_TYPE] = attempt.error_type
        span.set_status(Status(StatusCode.ERROR, attempt.error_type if error is not None else None))
    span.set_attributes(attributes)
    span.end(end_time=record.wall_ns(attempt.ended_ns or attempt.started_ns))


def span_attempt_after(record: CallRecord, attempt: Attempt) -> Span:
    """The span of an attempt that ran without one, made now with its real start, and ended with its real end
    if it is over (else it ends as any attempt's does, when the attempt does): a retried call's first attempt,
    a hedged call's primary once its backup was sent."""
    span = attempt.span = start_attempt_span(record, attempt)
    if attempt.ended_ns is not None:
        end_attempt_span(record, attempt, None)
    return span


# The trace events `on_trace_event` times a connection with. httpcore sends about ten per
# request (headers and body sent, received, closed): those go straight on, at no cost.
_CONNECTION_EVENTS = frozenset(
    {"connection.connect_tcp.started", "connection.connect_tcp.complete", "connection.start_tls.complete"}
)


def _chain_trace(request: Any, scope: _AttemptScope, is_async: bool) -> None:
    """httpcore's trace hook on the request, ahead of any the app set. It holds the attempt weakly: an
    httpx response (and its request) may be left in a reference cycle of httpx's own, and the call's
    objects must not hang from it for the collector to free."""
    previous = request.extensions.get("trace")
    attempt = weakref.ref(scope)
    if is_async:

        async def atrace(event: str, info: dict[str, Any]) -> None:
            if event in _CONNECTION_EVENTS:
                with swallow(sites.TRANSPORT_TRACE):
                    found = attempt()
                    if found is not None:
                        found.on_trace_event(event)
            if previous is not None:
                await previous(event, info)

        request.extensions["trace"] = atrace
    else:

        def strace(event: str, info: dict[str, Any]) -> None:
            if event in _CONNECTION_EVENTS:
                with swallow(sites.TRANSPORT_TRACE):
                    found = attempt()
                    if found is not None:
                        found.on_trace_event(event)
            if previous is not None:
                previous(event, info)

        request.extensions["trace"] = strace


def _end_collected(scope: _AttemptScope, at_ns: int) -> None:
    """Collection of an unclosed body still ends the attempt (and a plain call), at the collection."""
    with swallow(sites.TRANSPORT_GC):
        scope.close(None, at_ns)


class _Library:
    """The wrapper classes for one HTTP library (httpx or httpx2), which must subclass its bases."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.sync_transport = type("LLMSpansTransport", (_SyncTransport, module.BaseTransport), {})
        self.async_transport = type(
            "LLMSpansAsyncTransport", (_AsyncTransport, module.AsyncBaseTransport), {}
        )
        self.sync_body = type("LLMSpansBody", (_SyncBody, module.SyncByteStream), {})
        self.async_body = type("LLMSpansAsyncBody", (_AsyncBody, module.AsyncByteStream), {})


_libraries: dict[str, _Library] = {}


def library_of(client: Any) -> _Library:
    """httpx or httpx2, whichever the client (or the SDK class it derives from) belongs to."""
    roots = [cls.__module__.split(".")[0] for cls in type(client).__mro__]
    name = next((root for root in roots if root in ("httpx", "httpx2")), None)
    if name is None:
        raise TypeError(f"{type(client).__qualname__} is neither an httpx nor an httpx2 client")
    if name not in _libraries:
        _libraries[name] = _Library(importlib.import_module(name))
    return _libraries[name]


class _EndedScope:
    """What a closed body holds in place of its attempt: an httpx response and its body may be left in a
    reference cycle of httpx's own, and the call's objects must not hang from it for the collector."""

    closed = True

    def close(self, error: BaseException | None = None, at_ns: int | None = None) -> None:
        pass


_ENDED: Any = _EndedScope()


class _Body:
    """The response body as the client reads it: stamps each read, and the close ends the attempt."""

    def __init__(self, inner: Any, scope: _AttemptScope) -> None:
        self._inner = inner
        self._scope = scope
        _deferred.start_worker()  # before `__del__` can need it

    def __del__(self) -> None:
        """Collected unclosed: the attempt (and a plain call) still ends. A finalizer, so it only stamps
        the time and hands the end to the worker (see `_deferred`)."""
        try:
            scope = self._scope
            if not scope.closed:
                _deferred.defer(_end_collected, scope, time.perf_counter_ns())
        except Exception:  # at interpreter shutdown the modules may be gone; the exit hook ended it
            pass


class _SyncBody(_Body):
    def __iter__(self) -> Iterator[bytes]:
        scope = self._scope
        attempt = scope.attempt
        observer = scope.observer
        clock = time.perf_counter_ns
        try:
            for chunk in self._inner:
                attempt.bytes_at_ns = now = clock()
                if observer is not None:
                    _observe(observer, chunk, now)
                attempt.last_bytes = chunk
                yield chunk
        except GeneratorExit:  # the reader let go of the iterator: close() or collection ends the call
            raise
        except BaseException as error:
            scope.close(error)
            raise
        scope.body_done(time.perf_counter_ns())

    def close(self) -> None:
        try:
            self._inner.close()
        finally:
            try:  # the app's own close must not see our failure (`swallow`, inlined)
                self._scope.close()
                self._scope = _ENDED
                if _guard.faults:
                    check_fault(sites.TRANSPORT_CLOSE)
            except Exception as failure:
                report(sites.TRANSPORT_CLOSE, failure)


class _AsyncBody(_Body):
    async def __aiter__(self) -> AsyncIterator[bytes]:
        scope = self._scope
        attempt = scope.attempt
        observer = scope.observer
        clock = time.perf_counter_ns
        try:
            async for chunk in self._inner:
                attempt.bytes_at_ns = now = clock()
                if observer is not None:
                    _observe(observer, chunk, now)
                attempt.last_bytes = chunk
                yield chunk
        except GeneratorExit:  # the reader let go of the iterator: close() or collection ends the call
            raise
        except BaseException as error:
            scope.close(error)
            raise
        scope.body_done(time.perf_counter_ns())

    async def aclose(self) -> None:
        try:
            await self._inner.aclose()
        finally:
            try:  # `swallow`, inlined
                self._scope.close()
                self._scope = _ENDED
                if _guard.faults:
                    check_fault(sites.TRANSPORT_CLOSE)
            except Exception as failure:
                report(sites.TRANSPORT_CLOSE, failure)


def _observe(observer: BodyObserver, chunk: bytes, now_ns: int) -> None:
    with swallow(sites.TRANSPORT_OBSERVE):
        observer.feed(chunk, now_ns)


class _Transport:
    """What the sync and async transports share: everything but the I/O of one attempt."""

    def __init__(self, inner: Any, library: _Library, plain: CallOpener | None) -> None:
        self.inner = inner
        self._library = library
        self._plain = plain

    def _open(self, request: Any) -> tuple[AttemptWatcher, BodyObserver | None, bool] | None:
        """The watcher of this request's attempt: the adapter's call (or a copy of it), or a new call a plain
        client's request opens (True: the transport owns it); None: not an LLM call, or llmspans failed and
        stands aside."""
        try:
            if _guard.faults:
                check_fault(sites.TRANSPORT_BEGIN)
            watcher = active_call.get()
            if watcher is None:
                plain = self._plain
                if plain is None:
                    return None
                opened = plain.begin(request)
                return None if opened is None else (opened[0], opened[1], True)
            call = watcher.call
            return None if call.finished else (watcher, call.body_observer, False)
        except Deliberate:  # a prompt cap refusing the call: the app's to see
            raise
        except Exception as failure:
            report(sites.TRANSPORT_BEGIN, failure)
            return None

    def _limiter(self, opened: tuple[AttemptWatcher, BodyObserver | None, bool]) -> Limiter | None:
        """A plain client's limiter admits the calls its requests open (an adapter's admits its own); a
        retry joining a held call (`_retries`) was admitted with its first attempt."""
        if not opened[2] or self._plain is None or opened[0].call.on_release is not None:
            return None
        return self._plain.limiter

    def _attempt(
        self, opened: tuple[AttemptWatcher, BodyObserver | None, bool], request: Any, is_async: bool
    ) -> _AttemptScope | None:
        watcher, observer, owns = opened
        try:
            if _guard.faults:
                check_fault(sites.TRANSPORT_ATTEMPT)
            scope = _AttemptScope(watcher, request, owns, observer, self.inner)
            _chain_trace(request, scope, is_async)
            return scope
        except Exception as failure:
            report(sites.TRANSPORT_ATTEMPT, failure)
            if owns:  # a call we opened must still end
                watcher.call.finish(names.OUTCOME_COMPLETED)
            return None

    def _answered(self, scope: _AttemptScope, response: Any, body: type[_Body]) -> None:
        scope.attempt.response = response  # what an adapter reads if the SDK fails after it (a parse)
        whole = getattr(response, "is_stream_consumed", False)
        try:  # `guarded`, inlined: this runs on every attempt
            if _guard.faults:
                check_fault(sites.TRANSPORT_RESPONSE)
            scope.responded(response.status_code, response.headers, whole)
        except Exception as failure:
            report(sites.TRANSPORT_RESPONSE, failure)
        if whole:
            # The body came whole and already read (`Response(200, content=...)`: a MockTransport
            # handler, a test fake, a cache): no read or close of it will ever reach us.
            try:
                check_fault(sites.TRANSPORT_READ_BODY)
                scope.read_whole(response)
            except Exception as failure:
                report(sites.TRANSPORT_READ_BODY, failure)
                with swallow(sites.TRANSPORT_CLOSE):  # unread or not, the attempt (and its call) ends
                    scope.close()
            return
        try:  # `swallow`, inlined
            response.stream = body(response.stream, scope)
            if _guard.faults:
                check_fault(sites.TRANSPORT_WRAP_BODY)
        except Exception as failure:
            report(sites.TRANSPORT_WRAP_BODY, failure)


class _SyncTransport(_Transport):
    def handle_request(self, request: Any) -> Any:
        opened = self._open(request)
        if opened is None:
            return self.inner.handle_request(request)
        if opened[2]:  # a call this request opened: the plain client's limiter admits it
            limiter = self._limiter(opened)
            if limiter is not None:
                opened[0].call.admit(limiter)
        scope = self._attempt(opened, request, False)
        if scope is None:
            return self.inner.handle_request(request)
        try:
            response = self.inner.handle_request(request)
        except BaseException as error:
            scope.failed(error)
            raise
        self._answered(scope, response, self._library.sync_body)
        return response

    def close(self) -> None:
        self.inner.close()

    def __enter__(self) -> Any:
        self.inner.__enter__()
        return self

    def __exit__(self, *args: Any) -> None:
        self.inner.__exit__(*args)


class _AsyncTransport(_Transport):
    async def handle_async_request(self, request: Any) -> Any:
        opened = self._open(request)
        if opened is None:
            return await self.inner.handle_async_request(request)
        if opened[2]:  # a call this request opened: the plain client's limiter admits it
            limiter = self._limiter(opened)
            if limiter is not None:
                await opened[0].call.admit_async(limiter)
        scope = self._attempt(opened, request, True)
        if scope is None:
            return await self.inner.handle_async_request(request)
        try:
            response = await self.inner.handle_async_request(request)
        except BaseException as error:
            scope.failed(error)
            raise
        self._answered(scope, response, self._library.async_body)
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def __aenter__(self) -> Any:
        await self.inner.__aenter__()
        return self

    async def __aexit__(self, *args: Any) -> None:
        await self.inner.__aexit__(*args)


def install(http_client: Any, plain: CallOpener | None = None) -> bool:
    """Wrap the client's transport (and mounted ones); False when it was already wrapped.

    The wrapper is chosen by the client, sync or async, never by the methods its transport happens
    to have: `MockTransport` and many test fakes offer both. A transport that offers only the other
    side cannot serve this client at all; it is left as it is (the client fails as it would without
    llmspans), with one debug line.
    """
    transport = _internals.client_transport(http_client)
    if isinstance(transport, _Transport):
        return False
    if transport is None:
        logger.debug("llmspans: %s keeps no transport we know of; its requests pass through unobserved",
                     type(http_client).__qualname__)  # fmt: skip
        return False
    library = library_of(http_client)
    is_async = _is_async_client(http_client, library)
    method = "handle_async_request" if is_async else "handle_request"
    make = library.async_transport if is_async else library.sync_transport

    def wrap(inner: Any) -> Any:
        if isinstance(inner, _Transport) or not callable(getattr(inner, method, None)):
            if not isinstance(inner, _Transport):
                logger.debug(
                    "llmspans: %s has no %s for this %s client; its requests pass through unobserved",
                    type(inner).__qualname__, method, "async" if is_async else "sync",
                )  # fmt: skip
            return inner
        return make(inner, library, plain)

    _internals.set_client_transport(http_client, wrap(transport))
    mounts = _internals.client_mounts(http_client)
    if mounts:
        for pattern, transport in list(mounts.items()):
            if transport is not None:
                mounts[pattern] = wrap(transport)
    return True


def _is_async_client(http_client: Any, library: _Library) -> bool:
    """An `AsyncClient` (or a subclass, like the openai SDK's own) of its library; a client class of
    neither kind is judged by its transport, as the only thing left to go by."""
    if isinstance(http_client, library.module.AsyncClient):
        return True
    if isinstance(http_client, library.module.Client):
        return False
    return callable(getattr(_internals.client_transport(http_client), "handle_async_request", None))


def remove(http_client: Any) -> None:
    """Put the client's original transports back."""
    transport = _internals.client_transport(http_client)
    if isinstance(transport, _Transport):
        _internals.set_client_transport(http_client, transport.inner)
    mounts = _internals.client_mounts(http_client)
    if mounts:
        for pattern, mounted in list(mounts.items()):
            if isinstance(mounted, _Transport):
                mounts[pattern] = mounted.inner
