"""The call record: the timestamps of one logical LLM call, turned into buckets at finish.

Adapters and the transport stamp instants on it (`perf_counter_ns`, taken where the byte
or chunk arrives); `finish()` turns them into the six buckets of DESIGN §1, which sum to
the span's duration exactly because the span's start and end are derived from the same
monotonic stamps. It knows nothing of any client library. It learns of its attempts as the
transport's `AttemptWatcher`, and tells the levers it is under (`Lever`) once it is written.

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
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterator, Mapping, Sequence
from itertools import accumulate
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind, Status, StatusCode
from opentelemetry.util.types import AttributeValue

from llmspans import _budget, _deferred, _guard, _held_span, _phases, _telemetry
from llmspans import _metrics as metric
from llmspans import _names as names
from llmspans import _sites as sites
from llmspans._budget import seconds
from llmspans._gaps import SIZE as _SKETCH_SIZE
from llmspans._gaps import GapSketch, bucket_bounds, bucket_index
from llmspans._guard import check_fault, guarded, report
from llmspans._held_span import HeldSpan
from llmspans._stages import TurnTotals, current_turn

if TYPE_CHECKING:
    from llmspans._limiter import Admission, Limiter

T = TypeVar("T")

_CHUNK_BOUNDS = metric.CHUNK_BOUNDARIES_NS
_CHUNK_BUCKETS = len(_CHUNK_BOUNDS) + 1
# One table of gap buckets serves a stream's two counts: every bucket of the inter-token sketch (`_gaps`)
# and of the conventions' per-chunk histogram (gaps up to a boundary, inclusive) is a run of these, so a
# chunk costs one `bisect` and one increment, and both counts are read from them at the end. `_FINE` holds
# each bucket's lowest gap (ns); a gap's bucket is `bisect_right(_FINE, gap)`, from 1 (0 stays empty).
_FINE: tuple[int, ...] = tuple(
    sorted(
        {bucket_bounds(index)[0] for index in range(_SKETCH_SIZE)}
        | {0}
        | {bound + 1 for bound in _CHUNK_BOUNDS}
    )
)
_FINE_SIZE = len(_FINE) + 1
_CHUNK_OF: tuple[int, ...] = (0, *(bisect_left(_CHUNK_BOUNDS, low) for low in _FINE))
_SKETCH_OF: tuple[int, ...] = (0, *(bucket_index(low) for low in _FINE))
# Where each histogram bucket's run of fine buckets ends (inclusive), for the counts at the end.
_CHUNK_ENDS: tuple[int, ...] = tuple(
    max(fine for fine in range(1, _FINE_SIZE) if _CHUNK_OF[fine] == index) for index in range(_CHUNK_BUCKETS)
)
# Outcomes that end while the client waits on the server: what follows the last chunk is the server's.
_SERVER_ENDED = frozenset({names.OUTCOME_ERROR, names.OUTCOME_CANCELLED})


class Lever(Protocol):
    """Something a call is under that acts on it or learns from it: a prompt cap's estimate, the caches'
    window of call durations, a hedge. A call holds its levers in a tuple (`CallRecord.levers`), each
    independent of the others: none reads, chains or replaces another, and removing one changes none.
    What one lever learns that another may use is a fact of the call (`estimated_input_tokens`)."""

    def finished(self, call: CallRecord, outcome: str, duration_ns: int) -> None:
        """The call is over and written (its span not yet ended): add what the lever knows of it. Runs once,
        in whichever thread ends the call, never in a finalizer (see `_deferred`); what it raises is
        reported (`sites.CALL_FINISH`) and the other levers are told all the same."""


class ServerState(Protocol):
    """Where a call draws the serving engine's state from (`llmspans.vllm.ServerMetrics`)."""

    def watch(self, call: CallRecord) -> None:
        """The call was just sent to the server."""

    def attributes_during(self, sent_ns: int, answered_ns: int) -> Mapping[str, AttributeValue]:
        """The span attributes of a call sent at `sent_ns` and answered at `answered_ns`."""


class Attempt:
    """One HTTP attempt as the transport saw it; the facts its span (if it gets one) is made from.

    What most attempts keep as it starts out are class defaults: `__init__` runs on every attempt.
    """

    # When the latest bytes of its response body arrived, and those bytes, stamped by the transport as it
    # reads them. An SDK parses a network read into items before handing them over, so an item's true
    # arrival is the read that completed it, not the moment we see it (`_stream`). A stream's end marker
    # (`[DONE]`) is looked for in the last bytes when no finish reason came (`CallRecord.finish`).
    bytes_at_ns = 0
    last_bytes = b""
    # What its watcher adds to its span, if it gets one (a hedge's copy says which copy it is).
    span_attributes: Mapping[str, AttributeValue] | None = None
    connect_ns = 0
    new_connection = False
    status: int | None = None
    cause: str | None = None
    error_type: str | None = None
    body_done_ns: int | None = None
    ended_ns: int | None = None
    resend_count = 0
    span: Span | None = None  # only where it says something: see `_transport`
    response: Any = None  # the client library's response object, once its headers came

    def __init__(self, started_ns: int, method: str = "POST", url: Any = None) -> None:
        self.started_ns = started_ns
        self.connected_ns = started_ns  # when the connection was ready; == start for a reused one
        self.method = method
        self.url = url


# Two paths ending one call at once (a stream's end in one thread, its close in another) are rare:
# one lock for all calls makes the check-and-set atomic without a lock per call.
_finish_lock = threading.Lock()


class OpenSet(Generic[T]):
    """Objects not yet ended, held weakly, for an exit hook to end; `add` and `discard` run per call.

    A `weakref.WeakSet` in C operations only (its own methods are Python): a weak reference by `id`,
    dropped when the object ends. One collected without ending leaves a dead reference behind until its
    `id` is reused (a failure of llmspans' own; it costs a dictionary entry).
    """

    __slots__ = ("_live",)

    def __init__(self) -> None:
        self._live: dict[int, weakref.ref[T]] = {}

    def add(self, item: T) -> None:
        self._live[id(item)] = weakref.ref(item)

    def discard(self, item: T) -> None:
        self._live.pop(id(item), None)

    def __iter__(self) -> Iterator[T]:
        return iter([item for ref in list(self._live.values()) if (item := ref()) is not None])

    def __len__(self) -> int:
        return sum(1 for ref in list(self._live.values()) if ref() is not None)


# Calls not yet finished, so the exit hook can end the ones still open (a stream the app never closed).
_open_calls: OpenSet[CallRecord] = OpenSet()


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
    # transport keeps the last network read on the attempt, looked at only when no finish reason came.
    ended_well = False
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
    # Run once the call is over, e.g. handing a limiter slot back.
    on_release: Callable[[], None] | None = None
    # The levers the call is under, each told once the call is written (`Lever`); none for most calls.
    levers: tuple[Lever, ...] = ()
    # The prompt's size in tokens as estimated before the call was sent (a prompt cap's), for any lever
    # that needs it before or without the server's count.
    estimated_input_tokens: int | None = None
    # The serving engine's sampled state (vLLM's queue, batch, KV cache): told when the call is sent
    # (`watch_server`), stamped when it ends with what the server looked like during it.
    server_state: ServerState | None = None
    # Gaps between chunks: the conventions' per-chunk histogram, counted as they come (or recorded
    # one by one where the SDK aggregates: `chunk_live`), and for a recording span a finer sketch
    # for its inter-token percentiles.
    gap_counts: list[int] | None = None  # by `_FINE` bucket, from the second chunk on
    itl_per_token: list[tuple[int, int]] | None = None  # (gap, tokens) of chunks that carried several tokens
    one_token_max = 0  # from the first such chunk on, the largest gap of a one-token chunk
    chunk_lasts: list[int] | None = None
    chunk_live: Callable[[int], None] | None = None
    chunk_labels: metric.Labels | None = None
    gap_min = 0
    gap_max = 0
    chunk_more = False  # more than the counts per chunk: the sketch, the exemplars' values, the SDK's record
    _context: Context | None = None
    attempt_spans_always = False
    turn: TurnTotals | None = None
    # A call nobody listens to (no provider, or suppressed) records nothing: these stay as they are.
    suppressed = True
    span: Span = INVALID_SPAN
    recording = False
    budget: float | None = None
    # A held span's end, from the call's end until the span is built or its facts compacted (`_held_span`):
    # outcome, buckets, final status, duration; and whether something in it keeps its trace whole.
    written: tuple[str, tuple[int, ...], int | None, int] = ("", (0, 0, 0, 0, 0, 0), None, 0)
    keeps_trace = False
    # What only its span needs from the answer, read when the span is written (`later`): (reader, payload).
    later_reads: list[tuple[Callable[[Any], Mapping[str, AttributeValue] | None], Any]] | None = None

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
        sinks: Any = _telemetry.LOOK_UP,
    ) -> None:
        now = self.queued_ns = time.perf_counter_ns()
        self.wall_anchor_ns = time.time_ns()
        if called_ns is not None and called_ns < now:  # the app called the SDK before the request
            self.queued_ns = called_ns
            self.build_ns = build = now - called_ns
            self.wall_anchor_ns -= build
        self.attempts: list[Attempt] = []
        if attempt_spans_always:
            self.attempt_spans_always = True
        self.stream = stream
        turn = current_turn.get()
        if turn is not None:
            self.turn = turn
        shape = self.shape = _shape_of(operation, model, provider, stream, server_address, server_port)
        if sinks is _telemetry.LOOK_UP:  # `sinks`: what the caller looked up just now (`recording_sinks`)
            sinks = _telemetry.recording_sinks()
        if sinks is None:
            # Nobody listens (no provider installed), or the context asks for silence: no span, no
            # metric, no `traceparent`; a limiter still admits the call (the class defaults say the rest).
            return
        self.suppressed = False
        _open_calls.add(self)
        self.budget = _budget.registry.resolve(names.STAGE_LLM, budget)
        # A held span where nothing on the provider can tell (`_held_span`): its end is written only if
        # someone will export it, which under tail sampling is only if its trace is kept.
        span = self.span = _held_span.start_span(
            sinks[0], shape.span_name, None, SpanKind.CLIENT, shape.span_attributes, self.wall_anchor_ns
        )
        self.recording = recording = span.is_recording()
        if recording:  # what only a span someone will see needs
            if request_attributes is not None:
                span.set_attributes(request_attributes())
            if stream:
                self.chunk_more = True  # its inter-token figures are read from the gaps at the end

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
    def admitted(
        self, now_ns: int, attributes: Callable[[], Mapping[str, AttributeValue]] | None = None
    ) -> None:
        """Admitted at `now_ns`; `attributes` reads what the span says of the admission (a limiter's)."""
        self.admitted_ns = now_ns
        if self.recording:
            span = self.span
            if type(span) is HeldSpan:  # kept as facts: read only if the span is built
                if attributes is not None:
                    span.note_attributes(attributes)
                span.note_event(names.EVENT_ADMITTED, self.wall_ns(now_ns))
                return
            if attributes is not None:
                span.set_attributes(attributes())
            span.add_event(names.EVENT_ADMITTED, timestamp=self.wall_ns(now_ns))

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
        self.admitted(admission.admitted_ns, admission.attributes if self.recording else None)
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

    def context(self) -> Context:
        """A context holding the call's span: the parent of its attempts and phases, and what its request
        is sent under (made once)."""
        found = self._context
        if found is None:
            found = self._context = trace.set_span_in_context(self.span)
        return found

    # --- its attempts: the call as the transport's `AttemptWatcher` -------------------------------------

    @property
    def call(self) -> CallRecord:
        """The call its attempts belong to: this one (a hedge's copy, the other kind of watcher, composes one)."""
        return self

    def attempt_started(self, attempt: Attempt, control: Any) -> None:
        """An attempt of this call is about to be sent: it is the call's latest."""
        self.attempts.append(attempt)

    def attempt_answered(self, attempt: Attempt) -> None:
        """Its headers came: the call reads them (`attempt.status`) when it is written."""

    def attempt_body_done(self, attempt: Attempt) -> None:
        """Its body was read to its end (`attempt.body_done_ns`, read when the call is written)."""

    def attempt_failed(self, attempt: Attempt, error: BaseException) -> None:
        """It failed (`attempt.cause`): a retry's cause, or the call's error if it was the last."""

    def attempt(self, started_ns: int, method: str = "POST", url: Any = None) -> Attempt:
        """An attempt made by hand (a test, a benchmark), told as the transport tells one."""
        attempt = Attempt(started_ns, method, url)
        self.attempt_started(attempt, None)
        return attempt

    def content_chunk(self, now_ns: int, tokens: int = 1) -> None:
        """A chunk carrying tokens arrived: the hot path, a few integer operations.

        `tokens` > 1 when the server says how many the chunk carried (vLLM's continuous usage
        stats): the gap is then spread over them in the sketch, so the inter-token figures stay
        per token; the per-chunk histogram counts the chunk's gap once.
        """
        last = self.last_chunk_ns
        self.last_chunk_ns = now_ns
        if not last:
            self.first_chunk_ns = now_ns
            return
        gap = now_ns - last
        if tokens != 1 or self.itl_per_token is not None:  # (vLLM's continuous usage: rare)
            self._per_token(gap, tokens)
        counts = self.gap_counts
        if counts is None:
            counts = self._first_gap(gap)
        elif gap < self.gap_min:
            self.gap_min = gap
        elif gap > self.gap_max:
            self.gap_max = gap
        fine = bisect_right(_FINE, gap)
        counts[fine] += 1  # (the chunks are these gaps and the first chunk: `chunks`)
        if not self.chunk_more:  # an unsampled call's chunk: done
            return
        lasts = self.chunk_lasts
        if lasts is not None:  # the exemplars' values: the last gap in each histogram bucket
            lasts[_CHUNK_OF[fine]] = gap
        elif self.chunk_live is not None:  # the SDK's instrument records each gap itself
            self.chunk_live(gap)

    def _per_token(self, gap: int, tokens: int) -> None:
        """A chunk that carried several tokens (vLLM's continuous usage): its gap is each token's share in the
        inter-token figures. From the first such chunk on, the largest gap of a one-token chunk is kept too
        (before it, every gap was one: the largest so far, `gap_max`)."""
        if tokens > 1:
            if self.itl_per_token is None:
                self.itl_per_token = []
                self.one_token_max = self.gap_max if self.gap_counts is not None else 0
            self.itl_per_token.append((gap, tokens))
        elif gap > self.one_token_max:
            self.one_token_max = gap

    @property
    def chunk_counts(self) -> list[int] | None:
        """The per-chunk histogram's counts (gaps up to each of the conventions' boundaries), from the gaps."""
        fine = self.gap_counts
        if fine is None:
            return None
        running = list(accumulate(fine))
        counts = [running[end] for end in _CHUNK_ENDS]
        for index in range(_CHUNK_BUCKETS - 1, 0, -1):
            counts[index] -= counts[index - 1]
        return counts

    @property
    def gaps(self) -> GapSketch | None:
        """The stream's inter-token sketch (`_gaps`), made from its gaps: for a span that records."""
        if not (self.recording and self.stream):
            return None
        sketch = GapSketch()
        fine = self.gap_counts
        if fine is None:
            return sketch
        counts = sketch.counts
        for index, count in enumerate(fine):
            if count:
                counts[_SKETCH_OF[index]] += count
        sketch.max_ns = self.gap_max
        spread = self.itl_per_token
        if spread:
            sketch.max_ns = self.one_token_max
            for gap, tokens in spread:  # a chunk of several tokens: each token its share of the gap
                counts[_SKETCH_OF[bisect_right(_FINE, gap)]] -= 1
                counts[bucket_index(gap // tokens)] += tokens
                sketch.max_ns = max(sketch.max_ns, gap // tokens)
        sketch.count = sum(counts)
        return sketch

    @property
    def chunks(self) -> int:
        """Content chunks so far: the first, and one per gap counted after it."""
        counts = self.gap_counts
        if counts is not None:
            return 1 + sum(counts)
        return 1 if self.first_chunk_ns else 0

    def _first_gap(self, gap: int) -> list[int]:
        """The second chunk: the per-chunk histogram's attributes are those known now (no error yet).

        Whoever records the gaps decides what is kept per chunk: the SDK's instrument takes each
        (`chunk_live`); llmspans' aggregation takes the counts at the end, with the last gap per bucket
        for the exemplars where there can be any (a sampled span, or a filter that wants them all).
        """
        self.gap_min = self.gap_max = gap
        counts = self.gap_counts = [0] * _FINE_SIZE
        if self.suppressed:
            return counts
        self.chunk_labels = self.shape.chunk_labels(self.response_model)
        try:
            recorder = _telemetry.recorder()
            self.chunk_live = recorder.chunk_recorder(
                self.chunk_labels, recorder.sample(self.span, self.wall_ns(self.last_chunk_ns))
            )
            if self.chunk_live is None and (self.recording or not recorder.trace_based):
                self.chunk_lasts = [0] * _CHUNK_BUCKETS
        except Exception as failure:
            report(sites.CALL_CHUNK_METRIC, failure)
            self.chunk_live = _ignore_gap
        self.chunk_more = self.chunk_lasts is not None or self.chunk_live is not None
        return counts

    def set_usage(self, input_tokens: Any, output_tokens: Any, cache_read_tokens: Any = None) -> None:
        """Record token counts the server reported; anything that is not a count (an int, not a bool) is
        ignored."""
        if type(input_tokens) is int and input_tokens >= 0:
            self.input_tokens = input_tokens
        if type(output_tokens) is int and output_tokens >= 0:
            self.output_tokens = output_tokens
        if type(cache_read_tokens) is int:
            self.cache_read_tokens = cache_read_tokens

    def set_response(
        self, response_id: Any = None, model: Any = None, finish_reasons: Sequence[Any] = ()
    ) -> None:
        """What a whole response says: its id, model, and the finish reason of every choice."""
        if isinstance(response_id, str) and response_id:
            self.response_id = response_id
        if isinstance(model, str) and model:
            self.response_model = model
        if finish_reasons:
            reasons = tuple(str(reason) for reason in finish_reasons if reason)
            if reasons:
                self.finish_reasons = reasons

    def choice_finished(self, index: Any, reason: Any) -> None:
        """One streamed choice's finish reason (choices finish in separate chunks when n > 1)."""
        if not reason:
            return
        choices = self._choices
        if choices is None:
            if index == 0 and not self.finish_reasons:  # the one choice of most calls: no table
                self.finish_reasons = (str(reason),)
                return
            choices = self._choices = {0: self.finish_reasons[0]} if self.finish_reasons else {}
        choices[index if isinstance(index, int) else len(choices)] = str(reason)
        self.finish_reasons = tuple(choices[key] for key in sorted(choices))

    def set_attributes(self, attributes: Mapping[str, AttributeValue]) -> None:
        if self.recording:
            self.span.set_attributes(attributes)

    # --- a held span's facts (`_held_span.SpanFacts`) ---------------------------------------------------

    def write_span(self, span: Any) -> None:
        """Its held span is built (its trace kept, or its end on a plain provider): its end, written now."""
        CallFacts(self, *self.written).write_span(span)

    def compact(self) -> CallFacts:
        """Its held span is kept waiting for its trace's decision: what it needs of this record, a few hundred
        bytes, so the record itself (and its sketch and per-chunk counts) can go."""
        facts = CallFacts(self, *self.written)
        facts.keeps_trace = self.keeps_trace
        return facts

    def later(self, read: Callable[[Any], Mapping[str, AttributeValue] | None], payload: Any) -> bool:
        """For a held span (`_held_span`): read `payload` (an answer, a chunk, a usage block) for the attributes
        only the span needs (`read(payload)`) when the span is written, which under tail sampling is only if
        its trace is kept; the span keeps a reference to `payload` until then. False for any other span: the
        caller reads it now."""
        if type(self.span) is not HeldSpan or self.finished:
            return False
        if self.later_reads is None:
            self.later_reads = [(read, payload)]
        else:
            self.later_reads.append((read, payload))
        return True

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
        return dict(zip(names.BUCKETS, self.bucket_values_ns(released_ns, outcome), strict=True))

    def bucket_values_ns(self, released_ns: int, outcome: str = names.OUTCOME_COMPLETED) -> tuple[int, ...]:
        """`buckets_ns` as a tuple in `names.BUCKETS` order (queue, retry, connect, first_token,
        stream, post): what the finish path uses."""
        queued, built, a, b, c, d, e, f, released = self.instants_ns(released_ns, outcome)
        return a - built, c - b, d - c, e - d + (b - a) + (built - queued), f - e, released - f

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
        if built <= admitted <= first_start <= final_start <= connected <= first <= last <= released:
            return queued, built, admitted, first_start, final_start, connected, first, last, released
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
        if _deferred.collecting_thread and _deferred.collecting():
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
            and not (self.attempts and b"[DONE]" in self.attempts[-1].last_bytes)
        ):
            # The body ended, but nothing said the answer was over (a server failing after its 200).
            outcome = names.OUTCOME_ERROR
            self.error_type = names.ERROR_INCOMPLETE_STREAM
        released = now_ns if now_ns is not None else time.perf_counter_ns()
        self.released_ns = released
        # What would keep a reference cycle alive past the call (for the collector to find): a response
        # holds its body, whose attempt scope holds this call; a raw response's observer holds it too.
        for attempt in self.attempts:
            attempt.response = None
        if self.body_observer is not None:
            self.body_observer = None
        if self.suppressed:  # nothing to write or end
            if self.on_release is not None:
                self._release()
            return
        _open_calls.discard(self)
        try:
            if _guard.faults:
                check_fault(sites.CALL_FINISH)
            self._write(outcome, error, released)
        except Exception as failure:  # what @guarded does, without its extra frame on every call
            report(sites.CALL_FINISH, failure)
        finally:
            span = self.span
            try:
                span.end(end_time=self.wall_ns(released))
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
        # `bucket_values_ns`, inlined
        queued, built, a, b, c, d, e, f, _ = self.instants_ns(released, outcome)
        buckets = (a - built, c - b, d - c, e - d + (b - a) + (built - queued), f - e, released - f)
        duration_ns = released - queued
        exceeded = self.budget is not None and _budget.exceeded(self.budget, duration_ns)
        if self.recording:
            span = self.span
            if type(span) is HeldSpan:  # its end is written if it is ever built (`write_span`): not now
                self.written = (outcome, buckets, final_status, duration_ns)
                self.keeps_trace = bool(self.error_type) or len(attempts) > 1 or exceeded
                span.mark_facts(self)
            else:
                CallFacts(self, outcome, buckets, final_status, duration_ns).write_span(span)
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
        for lever in self.levers:
            try:  # each lever on its own: one that fails leaves the others told
                lever.finished(self, outcome, duration_ns)
            except Exception as failure:
                report(sites.CALL_FINISH, failure)

    def output_speed(self, stream_ns: int) -> float | None:
        """Output tokens per second while streaming, where the server said how many: the first token's
        time is in first_token, so the stream bucket holds the rest of them."""
        tokens = self.output_tokens
        if tokens is None or tokens <= 1 or stream_ns <= 0:
            return None
        return (tokens - 1) / seconds(stream_ns)

    def _record_metrics(self, buckets: tuple[int, ...], duration_ns: int, exceeded: bool) -> None:
        """The call's values, in the order of its `CallMetrics` (`CallShape.call_metrics`): the six
        buckets' and the duration's always, the others (`_HAS_...`) where the call has them."""
        shape = self.shape
        duration = duration_ns / 1e9  # `seconds`, inlined
        queue, retry, connect, first_token, stream, post = buckets
        values: list[float] = [
            duration, duration, queue / 1e9, retry / 1e9, connect / 1e9, first_token / 1e9, stream / 1e9,
            post / 1e9,
        ]  # fmt: skip
        has = 0
        if self.input_tokens is not None:
            values.append(self.input_tokens)
            has = _HAS_INPUT_TOKENS
        if self.output_tokens is not None:
            values.append(self.output_tokens)
            has |= _HAS_OUTPUT_TOKENS
        if self.stream and self.first_chunk_ns:
            values.append((self.first_chunk_ns - self.issued_ns()) / 1e9)
            has |= _HAS_FIRST_CHUNK
            speed = self.output_speed(stream)
            if speed is not None:
                values.append(speed)
                has |= _HAS_SPEED
        attempts = self.attempts
        opened = 0
        for attempt in attempts:
            if attempt.new_connection:
                opened += 1
        if opened:
            values.append(opened)
            has |= _HAS_NEW_CONNECTIONS
        if exceeded:
            values.append(1)
            has |= _HAS_OVERRUN
        recorder = _telemetry.recorder()
        # A span that does not record was not sampled: a trace-based exemplar filter takes nothing from it.
        sample = (
            recorder.sample(self.span, self.wall_ns(self.released_ns or self.queued_ns))
            if self.recording or not recorder.trace_based
            else None
        )
        recorder.add_call(shape.call_metrics(self.response_model, self.error_type, has), values, sample)
        if len(attempts) > 1:
            recorder.add(
                [
                    (metric.RETRY_ATTEMPTS, 1, shape.retry_labels(attempt.cause or "unknown"))
                    for attempt in attempts[:-1]
                ],
                sample,
            )
        counts = self.chunk_counts
        if counts is not None and self.chunk_live is None and self.chunk_labels is not None:
            lasts = self.chunk_lasts or [0] * _CHUNK_BUCKETS  # no exemplar will need them
            recorder.add_distribution(
                metric.TIME_PER_OUTPUT_CHUNK, self.chunk_labels, counts,
                seconds(self.last_chunk_ns - self.first_chunk_ns), seconds(self.gap_min), seconds(self.gap_max),
                [seconds(value) for value in lasts], sample,
            )  # fmt: skip


class CallFacts:
    """What a call span's end is written from, taken from the call at its end (`write_span`).

    On an SDK span it is written at once; a held span (`_held_span`) keeps this instead, and writes it only
    if the span is built: for a trace tail sampling drops, never. A few hundred bytes: the call's record,
    its sketch and its per-chunk counts are let go when the call ends.
    """

    __slots__ = (
        "attempts", "budget", "cache_read_tokens", "chunks", "error_type", "finish_reasons", "first_chunk_ns",
        "input_tokens", "issued", "itl", "keeps_trace", "last_chunk_ns", "later", "output_tokens", "queued_ns",
        "response_id", "response_model", "stream", "wall_anchor_ns", "wasted_output_tokens", "written",
    )  # fmt: skip

    def __init__(
        self, call: CallRecord, outcome: str, buckets: tuple[int, ...], final_status: int | None, duration_ns: int
    ) -> None:  # fmt: skip
        self.written = (outcome, buckets, final_status, duration_ns)
        self.keeps_trace = False  # (under tail sampling, the call sets it)
        self.attempts = call.attempts
        self.budget = call.budget
        self.wasted_output_tokens = call.wasted_output_tokens
        self.stream = stream = call.stream
        if stream:
            self.chunks = call.chunks
            self.first_chunk_ns = call.first_chunk_ns
            self.last_chunk_ns = call.last_chunk_ns
            self.itl = _itl(call) if call.recording else None
        self.issued = call.issued_ns()
        self.queued_ns = call.queued_ns
        self.wall_anchor_ns = call.wall_anchor_ns
        self.response_id = call.response_id
        self.response_model = call.response_model
        self.finish_reasons = call.finish_reasons
        self.input_tokens = call.input_tokens
        self.output_tokens = call.output_tokens
        self.cache_read_tokens = call.cache_read_tokens
        self.error_type = call.error_type
        self.later = call.later_reads

    def wall_ns(self, monotonic_ns: int) -> int:
        """Epoch time of a monotonic stamp, on the span's own time line (`CallRecord.wall_ns`)."""
        return self.wall_anchor_ns + (monotonic_ns - self.queued_ns)

    def compact(self) -> CallFacts:
        return self

    def write_span(self, span: Any) -> None:
        """The call span's end: its budget, attributes, events and status (docs/telemetry.md lists which
        attributes are left out when they carry nothing). On an SDK span when the call is written; on a held
        span only when it is built (`_held_span.SpanFacts`)."""
        outcome, buckets, final_status, duration_ns = self.written
        later = self.later
        if later is not None:  # what the adapter left to read until now (`CallRecord.later`), in order
            self.later = None
            for read, payload in later:
                found = read(payload)
                if found:
                    span.set_attributes(found)
        if self.budget is not None:
            _budget.record_on_span(span, self.budget, duration_ns)
        queue, retry, connect, first_token, stream, post = buckets
        attributes: dict[str, AttributeValue] = {  # `seconds`, inlined
            _QUEUE_ATTRIBUTE: queue / 1e9,
            _RETRY_ATTRIBUTE: retry / 1e9,
            _CONNECT_ATTRIBUTE: connect / 1e9,
            _FIRST_TOKEN_ATTRIBUTE: first_token / 1e9,
            _STREAM_ATTRIBUTE: stream / 1e9,
            _POST_ATTRIBUTE: post / 1e9,
            names.BUCKET_DOMINANT: names.BUCKETS[buckets.index(max(buckets))],  # ties: the earlier
        }
        attempts = self.attempts
        if len(attempts) > 1:
            failed = attempts[:-1]
            attributes[names.RETRY_COUNT] = len(failed)
            attributes[names.RETRY_CAUSES] = tuple([attempt.cause or "unknown" for attempt in failed])
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
                    self.first_chunk_ns - self.issued
                )
                for event, at in (
                    (names.EVENT_FIRST_TOKEN, self.first_chunk_ns),
                    (names.EVENT_LAST_TOKEN, self.last_chunk_ns),
                ):
                    span.add_event(event, {names.ELAPSED: seconds(at - self.queued_ns)}, self.wall_ns(at))
            itl = self.itl
            if itl is not None:
                attributes[names.ITL_P50] = seconds(itl[0])
                attributes[names.ITL_P95] = seconds(itl[1])
                attributes[names.ITL_MAX] = seconds(itl[2])
            tokens = self.output_tokens  # `CallRecord.output_speed`
            if tokens is not None and tokens > 1 and stream > 0:
                attributes[names.OUTPUT_TOKENS_PER_SECOND] = (tokens - 1) / seconds(stream)
        if self.response_id:
            attributes[names.GEN_AI_RESPONSE_ID] = self.response_id
        if self.response_model:
            attributes[names.GEN_AI_RESPONSE_MODEL] = self.response_model
        if self.finish_reasons:
            attributes[names.GEN_AI_RESPONSE_FINISH_REASONS] = self.finish_reasons
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


def _itl(call: CallRecord) -> tuple[int, int, int] | None:
    """A stream's inter-token p50, p95 and maximum (ns), as its sketch (`_gaps.GapSketch`) gives them: each
    quantile the middle of its sketch bucket, capped at the largest gap; None without a gap."""
    fine = call.gap_counts
    if fine is None:
        return None
    if call.itl_per_token:  # chunks of several tokens: through the sketch itself
        sketch = call.gaps
        if sketch is None or not sketch.count:
            return None
        p50, p95 = sketch.quantiles_ns(0.5, 0.95)
        return p50, p95, sketch.max_ns
    running = list(accumulate(fine))
    count = running[-1]
    if not count:
        return None
    largest = call.gap_max
    found = []
    for q in (0.5, 0.95):  # `GapSketch.quantiles_ns`, on the finer buckets each sketch bucket is a run of
        rank = max(1, min(count, round(q * count + 0.5 - 1e-9)))
        low, high = bucket_bounds(_SKETCH_OF[bisect_left(running, rank)])
        found.append(min((low + high - 1) // 2 if high - low > 1 else low, largest))
    return found[0], found[1], largest


def _ignore_gap(_gap_ns: int) -> None:
    """Where a suppressed call's, or a failed recorder's, gaps go."""


_LLM_STAGE = metric.Labels({names.STAGE: names.STAGE_LLM})
# Which of a call's optional values it has (a `CallMetrics` per combination, so no value is ever None).
_HAS_INPUT_TOKENS, _HAS_OUTPUT_TOKENS, _HAS_FIRST_CHUNK, _HAS_SPEED, _HAS_NEW_CONNECTIONS, _HAS_OVERRUN = (
    1, 2, 4, 8, 16, 32,
)  # fmt: skip
(_QUEUE_ATTRIBUTE, _RETRY_ATTRIBUTE, _CONNECT_ATTRIBUTE, _FIRST_TOKEN_ATTRIBUTE, _STREAM_ATTRIBUTE,
 _POST_ATTRIBUTE) = names.BUCKET_ATTRIBUTES  # fmt: skip
_KEPT = 256  # distinct call shapes (and result variants of one shape) cached at once


class CallShape:
    """What every call of one shape (operation, model, provider, server, lane) shares, built once.

    The span's name and opening attributes and the attribute sets its metrics are recorded
    with are the same call after call: building them once keeps dictionary building off the
    request path. They are shared by every call of the shape, hence read-only.
    """

    __slots__ = (
        "_chunks",
        "_lanes",
        "_metrics",
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
        self._metrics: dict[tuple[str | None, str | None, int], metric.CallMetrics] = {}
        self._chunks: dict[str | None, metric.Labels] = {}
        self._retries: dict[str, metric.Labels] = {}
        self._lanes: dict[str, CallShape] = {}

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

    def call_metrics(
        self, response_model: str | None, error_type: str | None, has: int
    ) -> metric.CallMetrics:
        """The series a call of this shape and result records into, in `_record_metrics`' order: the
        operation's and the stage's duration, the six buckets, then those `has` says (`_HAS_...`)."""
        key = (response_model, error_type, has)
        found = self._metrics.get(key)
        if found is None:
            common, input_labels, output_labels = self.result_labels(response_model, error_type)
            members = [
                (metric.OPERATION_DURATION, common),
                (metric.STAGE_DURATION, _LLM_STAGE),
                *((metric.BUCKET_DURATION, labels) for _, labels in self.bucket_labels),
            ]
            for bit, member in (
                (_HAS_INPUT_TOKENS, (metric.TOKEN_USAGE, input_labels)),
                (_HAS_OUTPUT_TOKENS, (metric.TOKEN_USAGE, output_labels)),
                (_HAS_FIRST_CHUNK, (metric.TIME_TO_FIRST_CHUNK, common)),
                (_HAS_SPEED, (metric.STREAM_OUTPUT_SPEED, common)),
                (_HAS_NEW_CONNECTIONS, (metric.CONNECT_NEW, self.metric_labels)),
                (_HAS_OVERRUN, (metric.BUDGET_EXCEEDED, _LLM_STAGE)),
            ):
                if has & bit:
                    members.append(member)
            found = metric.CallMetrics(members)
            if len(self._metrics) >= _KEPT:
                self._metrics.clear()
            self._metrics[key] = found
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

    def in_lane(self, lane: str) -> CallShape:
        """The same shape admitted by the limiter `lane`: its metrics carry the lane's name."""
        found = self._lanes.get(lane)
        if found is None:
            metric_attributes = {**self.metric_labels.attributes, names.LIMITER_NAME: lane}
            found = CallShape(self.span_name, self.span_attributes, metric_attributes)
            if len(self._lanes) >= _KEPT:
                self._lanes.clear()
            self._lanes[lane] = found
        return found


def _new_shape(
    operation: str, model: str | None, provider: str, stream: bool, server_address: str | None,
    server_port: int | None,
) -> CallShape:  # fmt: skip
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
    return CallShape(f"{operation} {model}" if model else operation, span_attributes, metric_attributes)


_shapes: dict[tuple[Any, ...], CallShape] = {}


def _shape_of(
    operation: str, model: str | None, provider: str, stream: bool, server_address: str | None,
    server_port: int | None,
) -> CallShape:  # fmt: skip
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
