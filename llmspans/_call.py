"""The call record: the timestamps of one logical LLM call, turned into buckets at finish.

Adapters and the transport stamp instants on it (`perf_counter_ns`, taken where the byte
or chunk arrives); `finish()` turns them into the six buckets of DESIGN §1, which sum to
the span's duration exactly because the span's start and end are derived from the same
monotonic stamps. It knows nothing of any client library.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.util.types import AttributeValue

from llmspans import _budget, _deferred, _suppress, _telemetry
from llmspans import _names as names
from llmspans._gaps import GapSketch
from llmspans._guard import check_fault, guarded, report
from llmspans._stages import current_turn

if TYPE_CHECKING:
    from llmspans._limiter import Admission

_NS = 1e-9


class Attempt:
    """One HTTP attempt as the transport saw it."""

    __slots__ = (
        "body_done_ns", "cause", "connect_ns", "connected_ns", "ended_ns", "new_connection", "started_ns", "status",
    )  # fmt: skip

    def __init__(self, started_ns: int) -> None:
        self.started_ns = started_ns
        self.connected_ns = started_ns  # when the connection was ready; == start for a reused one
        self.connect_ns = 0
        self.new_connection = False
        self.status: int | None = None
        self.cause: str | None = None
        self.body_done_ns: int | None = None
        self.ended_ns: int | None = None


# Calls not yet finished, so the exit hook can end the ones still open (a stream the app never closed).
_open_calls: weakref.WeakSet[CallRecord] = weakref.WeakSet()


def end_open_calls() -> None:
    """At interpreter exit, before the providers flush: end every call still open, as abandoned."""
    for record in list(_open_calls):
        try:
            record.finish(names.OUTCOME_ABANDONED)
        except Exception as failure:
            report("call.exit", failure)


class CallRecord:
    """Owns one logical LLM call: its span, its instants and its stream statistics."""

    __slots__ = (
        "__weakref__",
        "_finish_lock",
        "admitted_ns",
        "attempts",
        "budget",
        "bytes_at_ns",
        "cache_read_tokens",
        "chunks",
        "error_type",
        "finish_on_close",
        "finish_reasons",
        "finished",
        "first_chunk_ns",
        "gaps",
        "input_tokens",
        "kind",
        "last_chunk_ns",
        "on_release",
        "output_tokens",
        "queued_ns",
        "released_ns",
        "response_id",
        "response_model",
        "server_state",
        "span",
        "stream",
        "suppressed",
        "turn",
        "wall_anchor_ns",
        "wasted_output_tokens",
    )  # fmt: skip

    def __init__(
        self,
        *,
        operation: str,
        model: str | None,
        provider: str,
        stream: bool,
        request_attributes: Mapping[str, AttributeValue] | None = None,
        server_address: str | None = None,
        server_port: int | None = None,
        budget: float | None = None,
    ) -> None:
        self.queued_ns = time.perf_counter_ns()
        self.wall_anchor_ns = time.time_ns()
        self.admitted_ns: int | None = None
        self.attempts: list[Attempt] = []
        self.first_chunk_ns = 0
        self.last_chunk_ns = 0
        self.released_ns: int | None = None
        self.chunks = 0
        self.gaps: GapSketch | None = GapSketch() if stream else None
        self.stream = stream
        self.input_tokens: int | None = None
        self.output_tokens: int | None = None
        self.cache_read_tokens: int | None = None
        self.wasted_output_tokens = 0
        self.response_id: str | None = None
        self.response_model: str | None = None
        self.finish_reasons: tuple[str, ...] = ()
        self.error_type: str | None = None
        self.finished = False
        _open_calls.add(self)
        # Set when nothing but the close of the response body will tell that the call is over
        # (a raw streaming response the caller reads by hand).
        self.finish_on_close = False
        # When the latest bytes of the response body arrived (stamped by the transport as it
        # reads them). An SDK parses a network read into items before handing them over, so
        # an item's true arrival is the read that completed it, not the moment we see it.
        self.bytes_at_ns = 0
        # Run once the call is over, e.g. handing a limiter slot back.
        self.on_release: Callable[[], None] | None = None
        # The serving engine's latest sampled state (vLLM's queue, batch, KV cache), stamped at admission.
        self.server_state: Callable[[], Mapping[str, AttributeValue]] | None = None
        self._finish_lock = threading.Lock()
        self.budget = _budget.registry.resolve(names.STAGE_LLM, budget)
        self.turn = current_turn.get()

        kind = _kind_of(operation, model, provider, stream, server_address, server_port)
        self.kind = kind
        attributes: Mapping[str, AttributeValue] = kind.span_attributes
        if request_attributes:
            attributes = {**attributes, **request_attributes}
        self.suppressed = _suppress.suppressed()
        tracer = _suppress.NOOP_TRACER if self.suppressed else _telemetry.tracer()
        self.span: Span = tracer.start_span(
            kind.span_name, kind=SpanKind.CLIENT, attributes=attributes, start_time=self.wall_anchor_ns
        )

    # --- instants -------------------------------------------------------------------------

    def wall_ns(self, monotonic_ns: int) -> int:
        """Epoch time of a monotonic stamp, on the span's own time line."""
        return self.wall_anchor_ns + (monotonic_ns - self.queued_ns)

    @guarded("call.admitted", None)
    def admitted(self, now_ns: int, attributes: Mapping[str, AttributeValue] | None = None) -> None:
        self.admitted_ns = now_ns
        if attributes:
            self.span.set_attributes(attributes)
        self.span.add_event(names.EVENT_ADMITTED, timestamp=self.wall_ns(now_ns))

    def hold(self, admission: Admission) -> None:
        """Admitted by a limiter: the call keeps its slot until it is over (a stream's end, not its headers)."""
        self.on_release = admission.release
        # The lane is the limiter's name, on the call's metrics as well as its span.
        self.kind = self.kind.in_lane(admission.name)
        self.admitted(admission.admitted_ns, admission.attributes())
        self.stamp_server_state()

    @guarded("call.server_state", None)
    def stamp_server_state(self) -> None:
        """The server's state as last sampled, on the span, at the moment the call is admitted."""
        if self.server_state is not None:
            self.span.set_attributes(self.server_state())

    def attempt(self, started_ns: int) -> Attempt:
        attempt = Attempt(started_ns)
        self.attempts.append(attempt)
        return attempt

    def content_chunk(self, now_ns: int, tokens: int = 1) -> None:
        """A chunk carrying tokens arrived: the hot path, a few integer operations.

        `tokens` > 1 when the server says how many the chunk carried (vLLM's continuous usage
        stats): the gap is then spread over them, so the inter-token figures stay per token.
        """
        last = self.last_chunk_ns
        self.last_chunk_ns = now_ns
        self.chunks += 1
        if not last:
            self.first_chunk_ns = now_ns
            return
        gaps = self.gaps
        if gaps is not None:
            if tokens > 1:
                per_token = (now_ns - last) // tokens
                for _ in range(tokens):
                    gaps.add(per_token)
            else:
                gaps.add(now_ns - last)

    def set_usage(self, input_tokens: Any, output_tokens: Any, cache_read_tokens: Any = None) -> None:
        """Record token counts the server reported; anything that is not a count is ignored."""
        if isinstance(input_tokens, int) and not isinstance(input_tokens, bool) and input_tokens >= 0:
            self.input_tokens = input_tokens
        if isinstance(output_tokens, int) and not isinstance(output_tokens, bool) and output_tokens >= 0:
            self.output_tokens = output_tokens
        if isinstance(cache_read_tokens, int) and not isinstance(cache_read_tokens, bool):
            self.cache_read_tokens = cache_read_tokens

    def set_response(
        self, response_id: Any = None, model: Any = None, finish_reasons: Sequence[Any] = ()
    ) -> None:
        if isinstance(response_id, str) and response_id:
            self.response_id = response_id
        if isinstance(model, str) and model:
            self.response_model = model
        reasons = tuple(str(reason) for reason in finish_reasons if reason)
        if reasons:
            self.finish_reasons = reasons

    def set_attributes(self, attributes: Mapping[str, AttributeValue]) -> None:
        self.span.set_attributes(attributes)

    # --- finish -----------------------------------------------------------------------------

    def buckets_ns(self, released_ns: int) -> dict[str, int]:
        """The six buckets in nanoseconds; they add up to `released_ns - queued_ns` exactly.

        The client's own time between admission and the first attempt (building the
        request) is not a retry: it counts in `first_token`, with the rest of the wait
        for the answer, so `retry` is exactly failed attempts plus back-off and `connect`
        is exactly zero on a reused connection.
        """
        queued = self.queued_ns
        admitted = self.admitted_ns if self.admitted_ns is not None else queued
        if self.attempts:
            final = self.attempts[-1]
            first_start = self.attempts[0].started_ns
            final_start, connected, body_done = final.started_ns, final.connected_ns, final.body_done_ns
        else:
            first_start = final_start = connected = admitted
            body_done = None
        if self.stream:
            first = self.first_chunk_ns or released_ns
            last = self.last_chunk_ns or first
        else:
            first = last = body_done if body_done is not None else released_ns
        points = [queued]
        for instant in (admitted, first_start, final_start, connected, first, last, released_ns):
            points.append(min(released_ns, max(points[-1], instant)))
        before_first_attempt = points[2] - points[1]
        return {
            "queue": points[1] - points[0],
            "retry": points[3] - points[2],
            "connect": points[4] - points[3],
            "first_token": points[5] - points[4] + before_first_attempt,
            "stream": points[6] - points[5],
            "post": points[7] - points[6],
        }

    def finish(self, outcome: str, error: BaseException | None = None, now_ns: int | None = None) -> None:
        """End the call exactly once, on whichever path gets here first.

        Inside a garbage collection (a library's finalizer closing the response, say) it only
        hands the end to the worker: no OpenTelemetry call runs in a finalizer (see `_deferred`).
        """
        if self.finished:
            return
        if _deferred.collecting():
            _deferred.defer(self.finish, outcome, error, now_ns or time.perf_counter_ns())
            return
        with self._finish_lock:
            if self.finished:
                return
            self.finished = True
        _open_calls.discard(self)
        released = now_ns if now_ns is not None else time.perf_counter_ns()
        self.released_ns = released
        try:
            check_fault("call.finish")
            if not self.suppressed:
                self._write(outcome, error, released)
        except Exception as failure:  # what @guarded does, without its extra frame on every call
            report("call.finish", failure)
        finally:
            try:
                self.span.end(end_time=self.wall_ns(released))
            except Exception as failure:  # a span processor that raises must not reach the app
                report("call.span_end", failure)
            if self.on_release is not None:
                self._release()

    @guarded("call.release", None)
    def _release(self) -> None:
        if self.on_release is not None:
            self.on_release()

    def _write(self, outcome: str, error: BaseException | None, released: int) -> None:
        span = self.span
        buckets = self.buckets_ns(released)
        duration = (released - self.queued_ns) * _NS
        attributes: dict[str, AttributeValue] = {
            attribute: buckets[bucket] * _NS
            for attribute, bucket in zip(names.BUCKET_ATTRIBUTES, names.BUCKETS, strict=True)
        }
        failed = self.attempts[:-1]
        attributes[names.RETRY_COUNT] = len(failed)
        if failed:
            attributes[names.RETRY_CAUSES] = [attempt.cause or "unknown" for attempt in failed]
            attributes[names.RETRY_WASTED_OUTPUT_TOKENS] = self.wasted_output_tokens
        if self.attempts:
            attributes[names.CONNECT_NEW] = sum(1 for attempt in self.attempts if attempt.new_connection)
            attributes[names.CONNECT_REUSED] = not self.attempts[-1].new_connection
        if self.stream:
            attributes[names.STREAM_CHUNKS] = self.chunks
            attributes[names.STREAM_OUTCOME] = outcome
            if self.first_chunk_ns:
                attributes[names.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK] = (
                    self.first_chunk_ns - self.queued_ns
                ) * _NS
                span.add_event(names.EVENT_FIRST_TOKEN, timestamp=self.wall_ns(self.first_chunk_ns))
                span.add_event(names.EVENT_LAST_TOKEN, timestamp=self.wall_ns(self.last_chunk_ns))
            gaps = self.gaps
            if gaps is not None and gaps.count:
                attributes[names.ITL_P50] = gaps.quantile_ns(0.5) * _NS
                attributes[names.ITL_P95] = gaps.quantile_ns(0.95) * _NS
                attributes[names.ITL_MAX] = gaps.max_ns * _NS
            stream_s = buckets["stream"] * _NS
            if self.output_tokens is not None and self.output_tokens > 1 and stream_s > 0:
                # The first token's time is in first_token; the stream bucket holds the rest.
                attributes[names.OUTPUT_TOKENS_PER_SECOND] = (self.output_tokens - 1) / stream_s
        if self.response_id:
            attributes[names.GEN_AI_RESPONSE_ID] = self.response_id
        if self.response_model:
            attributes[names.GEN_AI_RESPONSE_MODEL] = self.response_model
        if self.finish_reasons:
            attributes[names.GEN_AI_RESPONSE_FINISH_REASONS] = list(self.finish_reasons)
        if self.input_tokens is not None:
            attributes[names.GEN_AI_USAGE_INPUT_TOKENS] = self.input_tokens
        if self.output_tokens is not None:
            attributes[names.GEN_AI_USAGE_OUTPUT_TOKENS] = self.output_tokens
        if self.cache_read_tokens is not None:
            attributes[names.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] = self.cache_read_tokens

        final_status = self.attempts[-1].status if self.attempts else None
        if error is not None:
            self.error_type = type(error).__qualname__
        elif final_status is not None and final_status >= 400:
            self.error_type = str(final_status)  # the last attempt failed, so did the call
        elif outcome == names.OUTCOME_ERROR:
            self.error_type = "error"
        if self.error_type:
            attributes[names.ERROR_TYPE] = self.error_type
            span.set_status(Status(StatusCode.ERROR, self.error_type))
        span.set_attributes(attributes)

        instruments = _telemetry.instruments()
        _budget.record_on_span(span, names.STAGE_LLM, self.budget, duration, instruments.budget_exceeded)
        self._record_metrics(instruments, buckets, duration)
        if self.turn is not None:
            self.turn.add(names.STAGE_LLM, released - self.queued_ns)

    def _record_metrics(self, instruments: Any, buckets: Mapping[str, int], duration: float) -> None:
        kind = self.kind
        common, input_tokens, output_tokens = kind.result_attributes(self.response_model, self.error_type)
        instruments.operation_duration.record(duration, common)
        instruments.stage_duration.record(duration, _LLM_STAGE_ATTRIBUTES)
        record_bucket = instruments.bucket_duration.record
        for bucket, attributes in kind.bucket_attributes:
            record_bucket(buckets[bucket] * _NS, attributes)
        if self.input_tokens is not None:
            instruments.token_usage.record(self.input_tokens, input_tokens)
        if self.output_tokens is not None:
            instruments.token_usage.record(self.output_tokens, output_tokens)
        if self.stream and self.first_chunk_ns:
            instruments.time_to_first_chunk.record((self.first_chunk_ns - self.queued_ns) * _NS, common)
            if self.chunks > 1:
                mean_gap = (self.last_chunk_ns - self.first_chunk_ns) * _NS / (self.chunks - 1)
                instruments.time_per_output_chunk.record(mean_gap, common)
        for attempt in self.attempts[:-1]:
            instruments.retry_attempts.add(
                1, {**kind.metric_attributes, names.METRIC_ATTR_RETRY_CAUSE: attempt.cause or "unknown"}
            )
        opened = sum(1 for attempt in self.attempts if attempt.new_connection)
        if opened:
            instruments.connect_new.add(opened, kind.metric_attributes)


_LLM_STAGE_ATTRIBUTES: Mapping[str, AttributeValue] = MappingProxyType({names.STAGE: names.STAGE_LLM})
_KEPT = 256  # distinct call kinds (and result variants of one kind) cached at once


class _CallKind:
    """What every call of one kind (operation, model, provider, server, lane) shares, built once.

    The span's name and opening attributes and the attribute sets its metrics are recorded
    with are the same call after call: building them once keeps dictionary building off the
    request path. They are shared by every call of the kind, hence read-only.
    """

    __slots__ = (
        "_lanes",
        "_results",
        "bucket_attributes",
        "metric_attributes",
        "span_attributes",
        "span_name",
    )

    def __init__(
        self, span_name: str, span_attributes: Mapping[str, AttributeValue],
        metric_attributes: Mapping[str, AttributeValue],
    ) -> None:  # fmt: skip
        self.span_name = span_name
        self.span_attributes = MappingProxyType(dict(span_attributes))
        self.metric_attributes = MappingProxyType(dict(metric_attributes))
        self.bucket_attributes = tuple(
            (bucket, MappingProxyType({**metric_attributes, names.METRIC_ATTR_BUCKET: bucket}))
            for bucket in names.BUCKETS
        )
        self._results: dict[tuple[str | None, str | None], tuple[Mapping[str, AttributeValue], ...]] = {}
        self._lanes: dict[str, _CallKind] = {}

    def result_attributes(
        self, response_model: str | None, error_type: str | None
    ) -> tuple[Mapping[str, AttributeValue], ...]:
        """The attribute sets of the duration and token metrics: common, input tokens, output tokens."""
        key = (response_model, error_type)
        found = self._results.get(key)
        if found is None:
            common = dict(self.metric_attributes)
            if response_model:
                common[names.GEN_AI_RESPONSE_MODEL] = response_model
            if error_type:
                common[names.ERROR_TYPE] = error_type
            found = (
                MappingProxyType(common),
                MappingProxyType({**common, names.GEN_AI_TOKEN_TYPE: names.TOKEN_TYPE_INPUT}),
                MappingProxyType({**common, names.GEN_AI_TOKEN_TYPE: names.TOKEN_TYPE_OUTPUT}),
            )
            if len(self._results) >= _KEPT:
                self._results.clear()
            self._results[key] = found
        return found

    def in_lane(self, lane: str) -> _CallKind:
        """The same kind admitted by the limiter `lane`: its metrics carry the lane's name."""
        found = self._lanes.get(lane)
        if found is None:
            metric_attributes = {**self.metric_attributes, names.LIMITER_NAME: lane}
            found = _CallKind(self.span_name, self.span_attributes, metric_attributes)
            if len(self._lanes) >= _KEPT:
                self._lanes.clear()
            self._lanes[lane] = found
        return found


def _new_kind(
    operation: str, model: str | None, provider: str, stream: bool, server_address: str | None,
    server_port: int | None,
) -> _CallKind:  # fmt: skip
    span_attributes: dict[str, AttributeValue] = {
        names.GEN_AI_OPERATION_NAME: operation,
        names.GEN_AI_PROVIDER_NAME: provider,
        names.GEN_AI_REQUEST_STREAM: stream,
        names.STAGE: names.STAGE_LLM,
    }
    metric_attributes: dict[str, AttributeValue] = {
        names.GEN_AI_OPERATION_NAME: operation,
        names.GEN_AI_PROVIDER_NAME: provider,
    }
    if model:
        span_attributes[names.GEN_AI_REQUEST_MODEL] = model
        metric_attributes[names.GEN_AI_REQUEST_MODEL] = model
    if server_address:
        span_attributes[names.SERVER_ADDRESS] = server_address
        metric_attributes[names.SERVER_ADDRESS] = server_address
    if server_port:
        span_attributes[names.SERVER_PORT] = server_port
        metric_attributes[names.SERVER_PORT] = server_port
    return _CallKind(f"{operation} {model}" if model else operation, span_attributes, metric_attributes)


_kinds: dict[tuple[Any, ...], _CallKind] = {}


def _kind_of(
    operation: str, model: str | None, provider: str, stream: bool, server_address: str | None,
    server_port: int | None,
) -> _CallKind:  # fmt: skip
    key = (operation, model, provider, stream, server_address, server_port)
    try:
        kind = _kinds.get(key)
    except TypeError:  # an unhashable value: build it for this call alone
        return _new_kind(*key)
    if kind is None:
        if len(_kinds) >= _KEPT:
            _kinds.clear()
        kind = _kinds[key] = _new_kind(*key)
    return kind
