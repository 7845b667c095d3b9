"""The call record: the timestamps of one logical LLM call, turned into buckets at finish.

Adapters and the transport stamp instants on it (`perf_counter_ns`, taken where the byte
or chunk arrives); `finish()` turns them into the six buckets of DESIGN §1, which sum to
the span's duration exactly because the span's start and end are derived from the same
monotonic stamps. It knows nothing of any client library.

What it writes depends on who will look: a span that is not recording (its trace was not
sampled) gets no attributes and no events, while every metric still counts the call. The
metric values of a call go to the recorder together (`_metrics`), and a stream's gaps between
chunks are counted on the conventions' boundaries as they come, in constant memory.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import weakref
from bisect import bisect_left
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol

from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.util.types import AttributeValue

from llmspans import _budget, _deferred, _phases, _suppress, _telemetry
from llmspans import _metrics as metric
from llmspans import _names as names
from llmspans import _sites as sites
from llmspans._budget import seconds
from llmspans._gaps import _LINEAR as _SKETCH_LINEAR
from llmspans._gaps import _MAX_BITS as _SKETCH_MAX_BITS
from llmspans._gaps import _SIZE as _SKETCH_SIZE
from llmspans._gaps import _SUB as _SKETCH_SUB
from llmspans._gaps import _SUB_BITS as _SKETCH_SUB_BITS
from llmspans._gaps import GapSketch
from llmspans._guard import check_fault, guarded, report
from llmspans._stages import current_turn

if TYPE_CHECKING:
    from llmspans._limiter import Admission, Limiter

_CHUNK_BOUNDS = metric.CHUNK_BOUNDARIES_NS
_CHUNK_BUCKETS = len(_CHUNK_BOUNDS) + 1
# Outcomes that end while the client waits on the server: what follows the last chunk is the server's.
_SERVER_ENDED = frozenset({names.OUTCOME_ERROR, names.OUTCOME_CANCELLED})


class ServerState(Protocol):
    """Where a call draws the serving engine's state from (`llmspans.vllm.ServerMetrics`)."""

    def watch(self, call: CallRecord) -> None:
        """The call was just sent to the server."""

    def attributes_during(self, sent_ns: int, answered_ns: int) -> Mapping[str, AttributeValue]:
        """The span attributes of a call sent at `sent_ns` and answered at `answered_ns`."""


class Attempt:
    """One HTTP attempt as the transport saw it; the facts its span (if it gets one) is made from."""

    __slots__ = (
        "body_done_ns", "cause", "connect_ns", "connected_ns", "ended_ns", "error_type", "method",
        "new_connection", "resend_count", "response", "span", "started_ns", "status", "url",
    )  # fmt: skip

    def __init__(self, started_ns: int, method: str = "POST", url: Any = None) -> None:
        self.started_ns = started_ns
        self.connected_ns = started_ns  # when the connection was ready; == start for a reused one
        self.connect_ns = 0
        self.new_connection = False
        self.status: int | None = None
        self.cause: str | None = None
        self.error_type: str | None = None
        self.body_done_ns: int | None = None
        self.ended_ns: int | None = None
        self.method = method
        self.url = url
        self.resend_count = 0
        self.span: Span | None = None  # only where it says something: see `_transport`
        self.response: Any = None  # the client library's response object, once its headers came


# Two paths ending one call at once (a stream's end in one thread, its close in another) are rare:
# one lock for all calls makes the check-and-set atomic without a lock per call.
_finish_lock = threading.Lock()
# Calls not yet finished, so the exit hook can end the ones still open (a stream the app never closed).
_open_calls: weakref.WeakSet[CallRecord] = weakref.WeakSet()


def end_open_calls() -> None:
    """At interpreter exit, before the providers flush: end every call still open, as abandoned."""
    for record in list(_open_calls):
        try:
            record.finish(names.OUTCOME_ABANDONED)
        except Exception as failure:
            report(sites.CALL_EXIT, failure)


class CallRecord:
    """Owns one logical LLM call: its span, its instants and its stream statistics.

    Most of a call's facts start empty and many stay so: they are class defaults, and `__init__`
    sets only what every call has (it runs on every call; see DESIGN §5).
    """

    # A call's facts as they start out (an instance sets its own as they arrive).
    admitted_ns: int | None = None
    first_chunk_ns = 0
    last_chunk_ns = 0
    released_ns: int | None = None
    chunks = 0
    input_tokens: int | None = None
    output_tokens: int | None = None
    cache_read_tokens: int | None = None
    wasted_output_tokens = 0
    response_id: str | None = None
    response_model: str | None = None
    finish_reasons: tuple[str, ...] = ()
    _choices: dict[int, str] | None = None  # a streamed response's finish reason per choice
    error_type: str | None = None
    finished = False
    # The stream's own end marker came (`[DONE]`, a final Responses event): a stream that ends with
    # neither it nor any finish reason was cut short, even if its body closed cleanly. A plain
    # client's reader sets it; for the openai SDK (which reads `[DONE]` and says nothing) the
    # transport keeps the last network read, looked at only when no finish reason came.
    ended_well = False
    last_bytes = b""
    # The SDK's own time building the request, from the app's call to the request (see
    # `_adapters/openai_entry`): before any limiter's wait, so it is `first_token`, never `queue`.
    build_ns = 0
    # The client's phase_spans setting; None: configure()'s (see `_phases`).
    phase_spans: str | None = None
    # Set when nothing but the close of the response body will tell that the call is over (a raw
    # streaming response the caller reads by hand).
    finish_on_close = False
    # What reads the response body as bytes for an adapter whose SDK will not (a raw streaming
    # response read line by line): a `_transport.BodyObserver` the transport feeds, or None.
    body_observer: Any = None
    # When the latest bytes of the response body arrived (stamped by the transport as it reads
    # them). An SDK parses a network read into items before handing them over, so an item's true
    # arrival is the read that completed it, not the moment we see it.
    bytes_at_ns = 0
    # Run once the call is over, e.g. handing a limiter slot back.
    on_release: Callable[[], None] | None = None
    # A lever the call is under (a prompt cap's estimate, the caches' window of call durations), told
    # once the call is written: `finished(record, outcome, duration_ns)`. None for most calls.
    lever: Any = None
    # The serving engine's sampled state (vLLM's queue, batch, KV cache): told when the call is sent
    # (`watch_server`), stamped when it ends with what the server looked like during it.
    server_state: ServerState | None = None
    # Gaps between chunks: the conventions' per-chunk histogram, counted as they come (or recorded
    # one by one where the SDK aggregates: `chunk_live`), and for a recording span a finer sketch
    # for its inter-token percentiles.
    gaps: GapSketch | None = None
    chunk_counts: list[int] | None = None
    chunk_lasts: list[int] | None = None
    chunk_live: Callable[[int], None] | None = None
    chunk_labels: metric.Labels | None = None
    gap_min = 0
    gap_max = 0

    def __init__(
        self,
        *,
        operation: str,
        model: str | None,
        provider: str,
        stream: bool,
        request_attributes: Callable[[], Mapping[str, AttributeValue]] | None = None,
        server_address: str | None = None,
        server_port: int | None = None,
        budget: float | None = None,
        attempt_spans_always: bool = False,
        called_ns: int | None = None,
    ) -> None:
        now = self.queued_ns = time.perf_counter_ns()
        self.wall_anchor_ns = time.time_ns()
        if called_ns is not None and called_ns < now:  # the app called the SDK before the request
            self.queued_ns = called_ns
            self.build_ns = build = now - called_ns
            self.wall_anchor_ns -= build
        self.attempts: list[Attempt] = []
        self.attempt_spans_always = attempt_spans_always
        self.stream = stream
        _open_calls.add(self)
        self.budget = _budget.registry.resolve(names.STAGE_LLM, budget)
        self.turn = current_turn.get()
        shape = self.shape = _shape_of(operation, model, provider, stream, server_address, server_port)
        self.suppressed = _suppress.suppressed()
        tracer = _suppress.NOOP_TRACER if self.suppressed else _telemetry.tracer()
        span = self.span = tracer.start_span(
            shape.span_name,
            kind=SpanKind.CLIENT,
            attributes=shape.span_attributes,
            start_time=self.wall_anchor_ns,
        )
        self.recording = recording = span.is_recording()
        if recording:  # what only a span someone will see needs
            if request_attributes is not None:
                span.set_attributes(request_attributes())
            if stream:
                self.gaps = GapSketch()

    # --- instants -------------------------------------------------------------------------

    def issued_ns(self) -> int:
        """Where time to first chunk counts from: the app's call, moved later by a limiter's wait
        (that wait is the `queue` bucket's), so the SDK's building counts with or without one."""
        admitted = self.admitted_ns
        return self.queued_ns if admitted is None else admitted - self.build_ns

    def wall_ns(self, monotonic_ns: int) -> int:
        """Epoch time of a monotonic stamp, on the span's own time line."""
        return self.wall_anchor_ns + (monotonic_ns - self.queued_ns)

    @guarded(sites.CALL_ADMITTED, None)
    def admitted(self, now_ns: int, attributes: Mapping[str, AttributeValue] | None = None) -> None:
        self.admitted_ns = now_ns
        if self.recording:
            if attributes:
                self.span.set_attributes(attributes)
            self.span.add_event(names.EVENT_ADMITTED, timestamp=self.wall_ns(now_ns))

    def admit(self, limiter: Limiter) -> None:
        """Wait for a slot of `limiter` and hold it until the call is over; a failure to get one (a
        timeout) ends the call and is the caller's to see."""
        try:
            admission = limiter.acquire()
        except BaseException as error:
            self.finish(names.OUTCOME_ERROR, error=error)
            raise
        self.hold(admission)

    async def admit_async(self, limiter: Limiter) -> None:
        """`admit` for a task; a task cancelled while it waits ends the call as cancelled."""
        try:
            admission = await limiter.acquire_async()
        except asyncio.CancelledError as error:
            self.finish(names.OUTCOME_CANCELLED, error=error)
            raise
        except BaseException as error:
            self.finish(names.OUTCOME_ERROR, error=error)
            raise
        self.hold(admission)

    def hold(self, admission: Admission) -> None:
        """Admitted by a limiter: the call keeps its slot until it is over (a stream's end, not its headers)."""
        self.on_release = admission.release
        # The lane is the limiter's name, on the call's metrics as well as its span.
        self.shape = self.shape.in_lane(admission.name)
        self.admitted(admission.admitted_ns, admission.attributes() if self.recording else None)
        if self.server_state is not None:
            self.watch_server()

    @guarded(sites.CALL_SERVER_STATE, None)
    def watch_server(self) -> None:
        """The call goes to the server now: its sampler may read the server while the call waits."""
        if self.server_state is not None and self.recording:
            self.server_state.watch(self)

    @guarded(sites.CALL_SERVER_STATE, None)
    def stamp_server_state(self) -> None:
        """What the server looked like during the call, on its span: read when the call ends, over the
        time from its sending to its first token (a non-streamed call's whole answer)."""
        server_state = self.server_state
        if server_state is None:
            return
        attempts = self.attempts
        sent = attempts[0].started_ns if attempts else self.issued_ns()
        if self.stream:
            answered = self.first_chunk_ns or self.released_ns or sent
        else:
            answered = (attempts[-1].body_done_ns if attempts else None) or self.released_ns or sent
        self.span.set_attributes(server_state.attributes_during(sent, answered))

    def attempt(self, started_ns: int, method: str = "POST", url: Any = None) -> Attempt:
        attempt = Attempt(started_ns, method, url)
        self.attempts.append(attempt)
        return attempt

    def content_chunk(self, now_ns: int, tokens: int = 1) -> None:
        """A chunk carrying tokens arrived: the hot path, a few integer operations.

        `tokens` > 1 when the server says how many the chunk carried (vLLM's continuous usage
        stats): the gap is then spread over them in the sketch, so the inter-token figures stay
        per token; the per-chunk histogram counts the chunk's gap once.
        """
        last = self.last_chunk_ns
        self.last_chunk_ns = now_ns
        self.chunks += 1
        if not last:
            self.first_chunk_ns = now_ns
            return
        gap = now_ns - last
        counts = self.chunk_counts
        if counts is None:
            counts = self._first_gap(gap)
        elif gap < self.gap_min:
            self.gap_min = gap
        elif gap > self.gap_max:
            self.gap_max = gap
        live = self.chunk_live
        if live is None:
            index = bisect_left(_CHUNK_BOUNDS, gap)
            counts[index] += 1
            self.chunk_lasts[index] = gap  # type: ignore[index]
        else:
            live(gap)
        gaps = self.gaps
        if gaps is not None:
            if tokens == 1:  # `GapSketch.add`, inlined: this runs once per chunk
                if gap > gaps.max_ns:
                    gaps.max_ns = gap
                gaps.count += 1
                if gap < _SKETCH_LINEAR:
                    gaps.counts[gap] += 1
                else:
                    bits = gap.bit_length()
                    if bits > _SKETCH_MAX_BITS:
                        gaps.counts[_SKETCH_SIZE - 1] += 1
                    else:
                        shift = bits - _SKETCH_SUB_BITS - 1
                        gaps.counts[
                            _SKETCH_LINEAR + (shift - 1) * _SKETCH_SUB + ((gap >> shift) & (_SKETCH_SUB - 1))
                        ] += 1
            else:
                per_token = gap // tokens
                for _ in range(tokens):
                    gaps.add(per_token)

    def _first_gap(self, gap: int) -> list[int]:
        """The second chunk: the per-chunk histogram's attributes are those known now (no error yet)."""
        self.gap_min = self.gap_max = gap
        self.chunk_lasts = [0] * _CHUNK_BUCKETS
        counts = self.chunk_counts = [0] * _CHUNK_BUCKETS
        if self.suppressed:
            self.chunk_live = _ignore_gap
            return counts
        self.chunk_labels = self.shape.chunk_labels(self.response_model)
        try:
            recorder = _telemetry.recorder()
            self.chunk_live = recorder.chunk_recorder(
                self.chunk_labels, recorder.sample(self.span, self.wall_ns(self.last_chunk_ns))
            )
        except Exception as failure:
            report(sites.CALL_CHUNK_METRIC, failure)
            self.chunk_live = _ignore_gap
        return counts

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
        """What a whole response says: its id, model, and the finish reason of every choice."""
        if isinstance(response_id, str) and response_id:
            self.response_id = response_id
        if isinstance(model, str) and model:
            self.response_model = model
        reasons = tuple(str(reason) for reason in finish_reasons if reason)
        if reasons:
            self.finish_reasons = reasons

    def choice_finished(self, index: Any, reason: Any) -> None:
        """One streamed choice's finish reason (choices finish in separate chunks when n > 1)."""
        if not reason:
            return
        choices = self._choices
        if choices is None:
            choices = self._choices = {}
        choices[index if isinstance(index, int) else len(choices)] = str(reason)
        self.finish_reasons = tuple(choices[key] for key in sorted(choices))

    def set_attributes(self, attributes: Mapping[str, AttributeValue]) -> None:
        if self.recording:
            self.span.set_attributes(attributes)

    # --- finish -----------------------------------------------------------------------------

    def buckets_ns(self, released_ns: int, outcome: str = names.OUTCOME_COMPLETED) -> dict[str, int]:
        """The six buckets in nanoseconds; they add up to `released_ns - queued_ns` exactly.

        The client's own time between admission and the first attempt (building the
        request) is not a retry: it counts in `first_token`, with the rest of the wait
        for the answer, so `retry` is exactly failed attempts plus back-off and `connect`
        is exactly zero on a reused connection. Time the client spends waiting on the server
        is never `post`: a stream that ended in an error or a cancellation while it waited for
        the next chunk (a read timeout, a dropped connection) counts that wait in `stream`, or
        in `first_token` before any chunk came; a non-streamed body not read to its end counts
        in `first_token` up to the failure.
        """
        queued, built, a, b, c, d, e, f, released = self.instants_ns(released_ns, outcome)
        return {
            "queue": a - built,
            "retry": c - b,
            "connect": d - c,
            "first_token": e - d + (b - a) + (built - queued),
            "stream": f - e,
            "post": released - f,
        }

    def instants_ns(self, released_ns: int, outcome: str = names.OUTCOME_COMPLETED) -> tuple[int, ...]:
        """The instants that bound the buckets, in order: called, the request built (it reached the
        client), admitted, the first attempt's start, the final attempt's start, connected, the first
        content chunk, the server's last byte, released.

        Each is clamped between the one before it and the release, so no bucket is ever negative.
        """
        queued = self.queued_ns
        built = queued + self.build_ns  # the request reached the client; a limiter's wait starts here
        admitted = self.admitted_ns if self.admitted_ns is not None else built
        if self.attempts:
            final = self.attempts[-1]
            first_start = self.attempts[0].started_ns
            final_start, connected, body_done = final.started_ns, final.connected_ns, final.body_done_ns
        else:
            first_start = final_start = connected = admitted
            body_done = None
        if self.stream:
            first = self.first_chunk_ns or released_ns
            last = released_ns if outcome in _SERVER_ENDED else (self.last_chunk_ns or first)
        else:  # the body read to its end is the server's last byte; until then the client waited on it
            first = last = body_done if body_done is not None else released_ns
        released = released_ns
        built = released if built > released else built
        a = admitted if admitted > built else built
        a = released if a > released else a
        b = first_start if first_start > a else a
        b = released if b > released else b
        c = final_start if final_start > b else b
        c = released if c > released else c
        d = connected if connected > c else c
        d = released if d > released else d
        e = first if first > d else d
        e = released if e > released else e
        f = last if last > e else e
        f = released if f > released else f
        return queued, built, a, b, c, d, e, f, released

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
        with _finish_lock:
            if self.finished:
                return
            self.finished = True
        if (
            outcome == names.OUTCOME_COMPLETED
            and self.stream
            and not self.finish_reasons
            and not self.ended_well
            and b"[DONE]" not in self.last_bytes
        ):
            # The body ended, but nothing said the answer was over (a server failing after its 200).
            outcome = names.OUTCOME_ERROR
            self.error_type = names.ERROR_INCOMPLETE_STREAM
        _open_calls.discard(self)
        released = now_ns if now_ns is not None else time.perf_counter_ns()
        self.released_ns = released
        try:
            check_fault(sites.CALL_FINISH)
            if not self.suppressed:
                self._write(outcome, error, released)
        except Exception as failure:  # what @guarded does, without its extra frame on every call
            report(sites.CALL_FINISH, failure)
        finally:
            try:
                self.span.end(end_time=self.wall_ns(released))
            except Exception as failure:  # a span processor that raises must not reach the app
                report(sites.CALL_SPAN_END, failure)
            if self.on_release is not None:
                self._release()

    @guarded(sites.CALL_RELEASE, None)
    def _release(self) -> None:
        if self.on_release is not None:
            self.on_release()

    def _write(self, outcome: str, error: BaseException | None, released: int) -> None:
        attempts = self.attempts
        final_status = attempts[-1].status if attempts else None
        if error is not None:
            self.error_type = type(error).__qualname__
        elif final_status is not None and final_status >= 400:
            self.error_type = str(final_status)  # the last attempt failed, so did the call
        elif outcome == names.OUTCOME_ERROR and self.error_type is None:
            self.error_type = "error"
        buckets = self.buckets_ns(released, outcome)
        duration_ns = released - self.queued_ns
        exceeded = _budget.record_on_span(self.span, self.budget, duration_ns)
        if self.recording:
            self._write_span(outcome, buckets, final_status)
            if self.server_state is not None:
                self.stamp_server_state()
            # Phase spans only where someone will look (a slow call): a fast call pays this comparison.
            mode = self.phase_spans or _phases.mode
            if mode != names.PHASE_SPANS_NEVER and (
                exceeded or duration_ns >= _phases.slow_after_ns or mode == names.PHASE_SPANS_ALWAYS
            ):
                _phases.write(self, outcome, released)
        self._record_metrics(buckets, duration_ns, exceeded)
        if self.turn is not None:
            self.turn.add(names.STAGE_LLM, duration_ns)
        if self.lever is not None:
            self.lever.finished(self, outcome, duration_ns)

    def _write_span(self, outcome: str, buckets: Mapping[str, int], final_status: int | None) -> None:
        """The call span's attributes and events; only for a span that records (docs/telemetry.md lists
        which attributes are left out when they carry nothing)."""
        span = self.span
        attributes: dict[str, AttributeValue] = {
            attribute: buckets[bucket] / 1e9  # `seconds`, inlined
            for attribute, bucket in zip(names.BUCKET_ATTRIBUTES, names.BUCKETS, strict=True)
        }
        attributes[names.BUCKET_DOMINANT] = max(names.BUCKETS, key=buckets.__getitem__)  # ties: the earlier
        attempts = self.attempts
        if len(attempts) > 1:
            failed = attempts[:-1]
            attributes[names.RETRY_COUNT] = len(failed)
            attributes[names.RETRY_CAUSES] = [attempt.cause or "unknown" for attempt in failed]
            if self.wasted_output_tokens:
                attributes[names.RETRY_WASTED_OUTPUT_TOKENS] = self.wasted_output_tokens
            for attempt, following in itertools.pairwise(attempts):
                span.add_event(names.EVENT_RETRY, *self._retry_event(attempt, following))
        if attempts:
            opened = 0
            for attempt in attempts:
                if attempt.new_connection:
                    opened += 1
            if opened:
                attributes[names.CONNECT_NEW] = opened
            attributes[names.CONNECT_REUSED] = not attempts[-1].new_connection
        if final_status is not None:
            attributes[names.HTTP_RESPONSE_STATUS_CODE] = final_status
        if self.stream:
            attributes[names.STREAM_CHUNKS] = self.chunks
            attributes[names.STREAM_OUTCOME] = outcome
            if attempts and attempts[-1].body_done_ns is None and attempts[-1].status is not None:
                attributes[names.STREAM_CLOSED_BEFORE_END] = True
            if self.first_chunk_ns:
                attributes[names.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK] = seconds(
                    self.first_chunk_ns - self.issued_ns()
                )
                for event, at in (
                    (names.EVENT_FIRST_TOKEN, self.first_chunk_ns),
                    (names.EVENT_LAST_TOKEN, self.last_chunk_ns),
                ):
                    span.add_event(event, {names.ELAPSED: seconds(at - self.queued_ns)}, self.wall_ns(at))
            gaps = self.gaps
            if gaps is not None and gaps.count:
                attributes[names.ITL_P50] = seconds(gaps.quantile_ns(0.5))
                attributes[names.ITL_P95] = seconds(gaps.quantile_ns(0.95))
                attributes[names.ITL_MAX] = seconds(gaps.max_ns)
            speed = self.output_speed(buckets["stream"])
            if speed is not None:
                attributes[names.OUTPUT_TOKENS_PER_SECOND] = speed
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
        if self.error_type:
            attributes[names.ERROR_TYPE] = self.error_type
            span.set_status(Status(StatusCode.ERROR, self.error_type))
        span.set_attributes(attributes)

    def _retry_event(self, attempt: Attempt, following: Attempt) -> tuple[dict[str, AttributeValue], int]:
        """A failed attempt's `llmspans.retry` event: its cause, its status, the back-off that followed it;
        at the moment it ended (when the client knew it had failed)."""
        attributes: dict[str, AttributeValue] = {names.RETRY_CAUSE: attempt.cause or "unknown"}
        if attempt.status is not None:
            attributes[names.HTTP_RESPONSE_STATUS_CODE] = attempt.status
        ended = attempt.ended_ns
        if ended is not None:
            attributes[names.RETRY_BACKOFF] = seconds(max(0, following.started_ns - ended))
        return attributes, self.wall_ns(ended if ended is not None else following.started_ns)

    def output_speed(self, stream_ns: int) -> float | None:
        """Output tokens per second while streaming, where the server said how many: the first token's
        time is in first_token, so the stream bucket holds the rest of them."""
        tokens = self.output_tokens
        if tokens is None or tokens <= 1 or stream_ns <= 0:
            return None
        return (tokens - 1) / seconds(stream_ns)

    def _record_metrics(self, buckets: Mapping[str, int], duration_ns: int, exceeded: bool) -> None:
        shape = self.shape
        common, input_labels, output_labels = shape.result_labels(self.response_model, self.error_type)
        duration = seconds(duration_ns)
        records: list[metric.Record] = [
            (metric.OPERATION_DURATION, duration, common),
            (metric.STAGE_DURATION, duration, _LLM_STAGE),
        ]
        bucket_duration = metric.BUCKET_DURATION
        for bucket, labels in shape.bucket_labels:
            records.append((bucket_duration, buckets[bucket] / 1e9, labels))  # `seconds`, inlined
        if self.input_tokens is not None:
            records.append((metric.TOKEN_USAGE, self.input_tokens, input_labels))
        if self.output_tokens is not None:
            records.append((metric.TOKEN_USAGE, self.output_tokens, output_labels))
        if self.stream and self.first_chunk_ns:
            records.append(
                (metric.TIME_TO_FIRST_CHUNK, seconds(self.first_chunk_ns - self.issued_ns()), common)
            )
            speed = self.output_speed(buckets["stream"])
            if speed is not None:
                records.append((metric.STREAM_OUTPUT_SPEED, speed, common))
        for attempt in self.attempts[:-1]:
            records.append((metric.RETRY_ATTEMPTS, 1, shape.retry_labels(attempt.cause or "unknown")))
        opened = 0
        for attempt in self.attempts:
            if attempt.new_connection:
                opened += 1
        if opened:
            records.append((metric.CONNECT_NEW, opened, shape.metric_labels))
        if exceeded:
            records.append((metric.BUDGET_EXCEEDED, 1, _LLM_STAGE))
        recorder = _telemetry.recorder()
        sample = recorder.sample(self.span, self.wall_ns(self.released_ns or self.queued_ns))
        recorder.add(records, sample)
        counts = self.chunk_counts
        if counts is not None and self.chunk_live is None and self.chunk_labels is not None:
            lasts = self.chunk_lasts or ()
            recorder.add_distribution(
                metric.TIME_PER_OUTPUT_CHUNK, self.chunk_labels, counts,
                seconds(self.last_chunk_ns - self.first_chunk_ns), seconds(self.gap_min), seconds(self.gap_max),
                [seconds(value) for value in lasts], sample,
            )  # fmt: skip


def _ignore_gap(_gap_ns: int) -> None:
    """Where a suppressed call's, or a failed recorder's, gaps go."""


_LLM_STAGE = metric.Labels({names.STAGE: names.STAGE_LLM})
_KEPT = 256  # distinct call shapes (and result variants of one shape) cached at once


class _CallShape:
    """What every call of one shape (operation, model, provider, server, lane) shares, built once.

    The span's name and opening attributes and the attribute sets its metrics are recorded
    with are the same call after call: building them once keeps dictionary building off the
    request path. They are shared by every call of the shape, hence read-only.
    """

    __slots__ = (
        "_chunks",
        "_lanes",
        "_results",
        "_retries",
        "bucket_labels",
        "metric_labels",
        "provider",
        "span_attributes",
        "span_name",
    )

    def __init__(
        self, span_name: str, span_attributes: Mapping[str, AttributeValue],
        metric_attributes: Mapping[str, AttributeValue],
    ) -> None:  # fmt: skip
        self.span_name = span_name
        self.span_attributes: Mapping[str, AttributeValue] = MappingProxyType(dict(span_attributes))
        self.provider = span_attributes.get(names.GEN_AI_PROVIDER_NAME)
        self.metric_labels = metric.Labels(metric_attributes)
        self.bucket_labels = tuple(
            (bucket, metric.Labels({**metric_attributes, names.METRIC_ATTR_BUCKET: bucket}))
            for bucket in names.BUCKETS
        )
        self._results: dict[tuple[str | None, str | None], tuple[metric.Labels, ...]] = {}
        self._chunks: dict[str | None, metric.Labels] = {}
        self._retries: dict[str, metric.Labels] = {}
        self._lanes: dict[str, _CallShape] = {}

    def result_labels(self, response_model: str | None, error_type: str | None) -> tuple[metric.Labels, ...]:
        """The attribute sets of the duration and token metrics: common, input tokens, output tokens."""
        key = (response_model, error_type)
        found = self._results.get(key)
        if found is None:
            common = dict(self.metric_labels.attributes)
            if response_model:
                common[names.GEN_AI_RESPONSE_MODEL] = response_model
            if error_type:
                common[names.ERROR_TYPE] = error_type
            found = (
                metric.Labels(common),
                metric.Labels({**common, names.GEN_AI_TOKEN_TYPE: names.TOKEN_TYPE_INPUT}),
                metric.Labels({**common, names.GEN_AI_TOKEN_TYPE: names.TOKEN_TYPE_OUTPUT}),
            )
            if len(self._results) >= _KEPT:
                self._results.clear()
            self._results[key] = found
        return found

    def chunk_labels(self, response_model: str | None) -> metric.Labels:
        """The per-chunk histogram's attributes: measured while the stream runs, so never an error type."""
        found = self._chunks.get(response_model)
        if found is None:
            found = self.result_labels(response_model, None)[0]
            if len(self._chunks) >= _KEPT:
                self._chunks.clear()
            self._chunks[response_model] = found
        return found

    def retry_labels(self, cause: str) -> metric.Labels:
        found = self._retries.get(cause)
        if found is None:
            found = metric.Labels({**self.metric_labels.attributes, names.METRIC_ATTR_RETRY_CAUSE: cause})
            if len(self._retries) >= _KEPT:
                self._retries.clear()
            self._retries[cause] = found
        return found

    def in_lane(self, lane: str) -> _CallShape:
        """The same shape admitted by the limiter `lane`: its metrics carry the lane's name."""
        found = self._lanes.get(lane)
        if found is None:
            metric_attributes = {**self.metric_labels.attributes, names.LIMITER_NAME: lane}
            found = _CallShape(self.span_name, self.span_attributes, metric_attributes)
            if len(self._lanes) >= _KEPT:
                self._lanes.clear()
            self._lanes[lane] = found
        return found


def _new_shape(
    operation: str, model: str | None, provider: str, stream: bool, server_address: str | None,
    server_port: int | None,
) -> _CallShape:  # fmt: skip
    span_attributes: dict[str, AttributeValue] = {
        names.GEN_AI_OPERATION_NAME: operation,
        names.GEN_AI_PROVIDER_NAME: provider,
        names.STAGE: names.STAGE_LLM,
    }
    if stream:  # set only on streaming requests, as the conventions say
        span_attributes[names.GEN_AI_REQUEST_STREAM] = True
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
    return _CallShape(f"{operation} {model}" if model else operation, span_attributes, metric_attributes)


_shapes: dict[tuple[Any, ...], _CallShape] = {}


def _shape_of(
    operation: str, model: str | None, provider: str, stream: bool, server_address: str | None,
    server_port: int | None,
) -> _CallShape:  # fmt: skip
    key = (operation, model, provider, stream, server_address, server_port)
    try:
        shape = _shapes.get(key)
    except TypeError:  # an unhashable value: build it for this call alone
        return _new_shape(*key)
    if shape is None:
        if len(_shapes) >= _KEPT:
            _shapes.clear()
        shape = _shapes[key] = _new_shape(*key)
    return shape
