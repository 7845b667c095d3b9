"""Held spans: a span whose facts llmspans keeps, made an SDK `ReadableSpan` only when someone will export it.

An OpenTelemetry SDK span validates every attribute as it is set, takes a lock per write and keeps an
object per event, whether or not the span is ever exported. llmspans' call, stage and turn spans are
written by llmspans itself, mostly at their end, from facts their records already hold. Where nothing
on the provider can tell the difference, `start_span` makes a `HeldSpan` instead of an SDK span:

- its ids come from the provider's id generator and its sampling decision from the provider's sampler,
  exactly as the SDK's `Tracer.start_span` would make them, so the `traceparent` sent and every child's
  parent are what they would be;
- what is written on it while it is open (by llmspans, or by the app through `get_current_span()`) is
  cleaned as the SDK cleans it and kept in order, and its owner's end-of-span facts (`SpanFacts`) are
  written only when it is built;
- `build()` makes the `ReadableSpan` the SDK path would have handed to its processors' `on_end`: the
  same name, kind, ids, parent, times, attributes (in the SDK's order and under its limits), events,
  links, status, resource and scope.

Two plans use it (`plan_of`), chosen from the provider's processors, and none other:

- `HEAD`: every processor on the provider does nothing at a span's start (the SDK's batch and simple
  processors): the span is built at its end and handed to them.
- `TAIL`: the provider's one processor is a `TailSamplingProcessor` that defers: the ended span goes to it
  unbuilt, and is built only if its trace is kept (`_tail_sampling`); the wrapped processors see
  `on_start` then, just before `on_end`.

Anything else (a processor with an `on_start` of its own beside them, a tracer the SDK configured apart,
the SDK's own span metrics switched on, an SDK of other internals) gets the SDK's own spans, as before.
"""

from __future__ import annotations

import logging
import random
import threading
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from time import time_ns
from types import MappingProxyType, TracebackType
from typing import Any, Final, Protocol

from opentelemetry import trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.context import Context
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanProcessor, SynchronousMultiSpanProcessor
from opentelemetry.sdk.trace import Tracer as SdkTracer
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import Decision, ParentBased, StaticSampler
from opentelemetry.sdk.util import BoundedList
from opentelemetry.semconv.attributes.exception_attributes import (
    EXCEPTION_ESCAPED,
    EXCEPTION_MESSAGE,
    EXCEPTION_STACKTRACE,
    EXCEPTION_TYPE,
)
from opentelemetry.trace import (
    INVALID_SPAN_CONTEXT,
    Link,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
)
from opentelemetry.util.types import AttributeValue

from llmspans import _internals
from llmspans import _names as names

logger = logging.getLogger("llmspans")

HEAD: Final = "head"
TAIL: Final = "tail"
_UNSET = Status(StatusCode.UNSET)
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_NOT_SAMPLED = TraceFlags(TraceFlags.DEFAULT)
_SAMPLED_RANDOM = TraceFlags(TraceFlags.SAMPLED | getattr(TraceFlags, "RANDOM_TRACE_ID", 0))
_NOT_SAMPLED_RANDOM = TraceFlags(TraceFlags.DEFAULT | getattr(TraceFlags, "RANDOM_TRACE_ID", 0))
_RECORD_AND_SAMPLE = Decision.RECORD_AND_SAMPLE
_DROP = Decision.DROP
_NO_ATTRIBUTES: Mapping[str, AttributeValue] = MappingProxyType({})
# The SDK's processors whose `on_start` (and `_on_ending`) do nothing: a span they see start cannot
# tell a held span from an SDK one.
_QUIET_STARTS: Final = frozenset(
    {SpanProcessor.on_start, BatchSpanProcessor.on_start, SimpleSpanProcessor.on_start}
)
_QUIET_ENDINGS: Final = frozenset(
    _internals.on_ending_of(kind) for kind in (SpanProcessor, BatchSpanProcessor, SimpleSpanProcessor)
)


class SpanFacts(Protocol):
    """The owner of a held span: what it writes on the span once the span is built (llmspans' call
    record, a stage, a turn), and whether something in it keeps its trace by itself."""

    keeps_trace: bool

    def compact(self) -> SpanFacts:
        """What to keep while the span waits for its trace's decision: itself, or less (a call's facts
        without its record)."""

    def write_span(self, span: Any) -> None:
        """Write the end-of-span attributes, events and status on `span`: an SDK span, or what a held span
        collects them in when it is built (`set_attributes`, `add_event`, `set_status`, `start_time`)."""


def quiet_at_start(processor: SpanProcessor) -> bool:
    """Whether `processor` does nothing when a span starts or is ending (so it cannot see a held span)."""
    kind = type(processor)
    return kind.on_start in _QUIET_STARTS and _internals.on_ending_of(kind) in _QUIET_ENDINGS


class Holder(SpanProcessor):
    """A processor that takes held spans at their end (`_tail_sampling.TailSamplingProcessor`): where it is
    the provider's only processor and `defers`, spans are held (the TAIL plan)."""

    @property
    def defers(self) -> bool:
        return False

    def hold(self, span: HeldSpan, parent: SpanContext | None, duration_ns: int) -> None:
        """`span` ended (`parent`, `duration_ns`: its own, handed over as it knows them); build it
        (`HeldSpan.build`) only if its trace is kept."""
        raise NotImplementedError


class Plan:
    """How spans of one tracer are made, for the processors its provider has now."""

    __slots__ = (
        "ids",
        "members",
        "mode",
        "multi",
        "processor",
        "random",
        "random_ids",
        "sample",
        "static",
        "tracer",
    )

    def __init__(
        self, tracer: SdkTracer, multi: Any, members: tuple[SpanProcessor, ...], mode: str, processor: Any
    ) -> None:
        self.tracer = tracer
        self.multi = multi
        self.members = members
        self.mode = mode
        self.processor = processor  # HEAD: the provider's processor; TAIL: the tail-sampling processor
        self.ids = ids = tracer.id_generator
        # The SDK's default generator's ids are `random.getrandbits` (0 drawn again): drawn inline.
        self.random_ids = type(ids) is RandomIdGenerator
        self.random = bool(ids.is_trace_id_random())
        sampler = tracer.sampler
        # The decision of an always-on or -off sampler; else a function of the parent (`_fast_sampler`).
        self.static = _internals.static_decision(sampler) if type(sampler) is StaticSampler else None
        self.sample = _fast_sampler(sampler)


_last_plan: Plan | None = None
_plan_lock = threading.Lock()


def plan_of(tracer: Any) -> Plan | None:
    """The plan for spans of `tracer` now; None: the SDK makes them (see the module's docstring)."""
    found = _last_plan
    if (
        found is not None
        and found.tracer is tracer
        and _internals.processors_of(found.multi) is found.members
    ):
        return found if found.mode else None
    return _new_plan(tracer)


def _new_plan(tracer: Any) -> Plan | None:
    global _last_plan
    if type(tracer) is not SdkTracer or not _internals.tracer_is_plain(tracer):
        return None
    multi = tracer.span_processor
    members = _internals.span_processors(multi)
    if type(multi) is not SynchronousMultiSpanProcessor or members is None:
        return None
    mode = ""
    processor: Any = multi
    if len(members) == 1 and isinstance(members[0], Holder):
        if members[0].defers:
            mode, processor = TAIL, members[0]
    elif members and all(quiet_at_start(member) for member in members):
        mode = HEAD
    plan = Plan(tracer, multi, members, mode, processor)
    with _plan_lock:
        _last_plan = plan
    return plan if mode else None


def _fast_sampler(sampler: Any) -> Callable[[SpanContext | None], Decision] | None:
    """The decision of the SDK's plain samplers (always on or off, parent-based on them with the default
    delegates) as a function of the parent alone; None: ask the sampler itself."""
    if type(sampler) is StaticSampler:
        decision = _internals.static_decision(sampler)

        def static(parent: SpanContext | None) -> Decision:
            return decision

        return static
    if type(sampler) is ParentBased:
        delegates = _internals.parent_based_delegates(sampler)
        if delegates is None or any(type(each) is not StaticSampler for each in delegates):
            return None
        root, remote_sampled, remote_not, local_sampled, local_not = (
            _internals.static_decision(each) for each in delegates
        )

        def parent_based(parent: SpanContext | None) -> Decision:
            if parent is None:
                return root
            if parent.is_remote:
                return remote_sampled if parent.trace_flags.sampled else remote_not
            return local_sampled if parent.trace_flags.sampled else local_not

        return parent_based
    return None


def start_span(
    tracer: Any, name: str, context: Context | None = None, kind: SpanKind = SpanKind.INTERNAL,
    attributes: Mapping[str, AttributeValue] | None = None, start_time: int | None = None,
) -> trace.Span:  # fmt: skip
    """A span of `tracer`, as its `start_span` would make it: a held span where the plan allows one, else
    the SDK's own span. `attributes` are llmspans' own, already clean
    (strings, numbers, booleans), shared read-only between spans."""
    plan = plan_of(tracer)
    if plan is None:
        return _sdk_span(tracer, name, context, kind, attributes, start_time)
    parent: SpanContext | None = trace.get_current_span(context).get_span_context()
    if parent is INVALID_SPAN_CONTEXT or (parent is not None and not parent.is_valid):  # (a root: no call)
        parent = None
    ids = plan.ids
    if parent is not None:
        trace_id = parent.trace_id
    elif plan.random_ids:  # `RandomIdGenerator.generate_trace_id`, without its call
        trace_id = random.getrandbits(128) or ids.generate_trace_id()
    else:
        trace_id = ids.generate_trace_id()
    decision = plan.static
    if decision is not None or plan.sample is not None:
        if decision is None:
            decision = plan.sample(parent)  # type: ignore[misc]
        state = parent.trace_state if parent is not None else None
        if attributes is None and decision is not _DROP:
            attributes = _NO_ATTRIBUTES
    else:
        result = tracer.sampler.should_sample(context, trace_id, name, kind, attributes, ())
        decision, state, attributes = result.decision, result.trace_state, result.attributes
    random_trace_id = plan.random if parent is None else parent.trace_flags.random_trace_id
    if decision is _RECORD_AND_SAMPLE:
        flags = _SAMPLED_RANDOM if random_trace_id else _SAMPLED
    else:
        flags = _NOT_SAMPLED_RANDOM if random_trace_id else _NOT_SAMPLED
    span_id = (
        (random.getrandbits(64) or ids.generate_span_id()) if plan.random_ids else ids.generate_span_id()
    )
    span_context = _internals.span_context(trace_id, span_id, flags, state)
    if decision is _DROP:
        return trace.NonRecordingSpan(span_context)
    if decision is not _RECORD_AND_SAMPLE:  # recorded but not sampled (RECORD_ONLY): the SDK's own span
        return _sdk_span(tracer, name, context, kind, attributes, start_time)
    return HeldSpan(plan, name, span_context, parent, kind, attributes, start_time)


def _sdk_span(
    tracer: Any, name: str, context: Context | None, kind: SpanKind,
    attributes: Mapping[str, AttributeValue] | None, start_time: int | None,
) -> trace.Span:  # fmt: skip
    made: trace.Span = tracer.start_span(
        name, context=context, kind=kind, attributes=attributes, start_time=start_time
    )
    return made


class HeldSpan(trace.Span):
    """A sampled span llmspans keeps as facts until it is built (`build`): see the module's docstring.

    It behaves as an SDK span does towards whoever holds it: writes after its end are ignored with the
    SDK's warning, `set_status` follows the SDK's rules, attributes are cleaned as they are set. Its
    owner writes its own end once, through `SpanFacts`, at the place `mark_facts` left in its writes and
    events: what others wrote after that place (a lever, a hedge) still comes after, as on an SDK span.
    """

    __slots__ = (
        "_attributes", "_end_time", "_events", "_facts_at", "_kind", "_links", "_name", "_parent", "_plan",
        "_start_time", "_status", "_writes", "context", "dropped", "facts",
    )  # fmt: skip

    def __init__(
        self, plan: Plan, name: str, context: SpanContext, parent: SpanContext | None, kind: SpanKind,
        attributes: Mapping[str, AttributeValue] | None, start_time: int | None,
    ) -> None:  # fmt: skip
        self._plan = plan
        self._name = name
        self.context = context
        self._parent = parent
        self._kind = kind
        self._attributes = attributes  # as given (read-only, llmspans' own, already clean)
        self._start_time = start_time if start_time is not None else time_ns()
        self._end_time: int | None = None
        # Attribute writes in order: a cleaned mapping, or `_Lazy` (llmspans' own, read when built). Events
        # likewise: an SDK `Event`, or an `_OwnEvent`. Where the owner's end goes among them: `_facts_at`.
        self._writes: list[Any] | None = None
        self._events: list[Any] | None = None
        self._facts_at = 0  # writes << 32 | events, as they stood at `mark_facts`
        self._links: list[Link] | None = None
        self._status = _UNSET
        self.dropped = 0  # attributes the cleaning dropped (bad keys), as the SDK counts them
        self.facts: SpanFacts | None = None

    # --- what a ReadableSpan shows, for the tail-sampling processor and whoever holds the span --------

    @property
    def name(self) -> str:
        return self._name

    @property
    def parent(self) -> SpanContext | None:
        return self._parent

    @property
    def kind(self) -> SpanKind:
        return self._kind

    @property
    def start_time(self) -> int:
        return self._start_time

    @property
    def end_time(self) -> int | None:
        return self._end_time

    @property
    def status(self) -> Status:
        return self._status

    @property
    def attributes(self) -> Mapping[str, AttributeValue]:
        """What was set on it so far (its owner's end is not written until it is built)."""
        return MappingProxyType(self._folded(_resolved(self._writes or [])))

    def get_span_context(self) -> SpanContext:
        return self.context

    def is_recording(self) -> bool:
        return self._end_time is None

    # --- writing -----------------------------------------------------------------------------------------

    def set_attributes(self, attributes: Mapping[str, AttributeValue]) -> None:
        if self._end_time is not None:
            logger.warning("Setting attribute on ended span.")
            return
        self._write(attributes)

    def set_attribute(self, key: str, value: AttributeValue) -> None:
        if self._end_time is not None:
            logger.warning("Setting attribute on ended span.")
            return
        self._write({key: value})

    def _write(self, attributes: Mapping[str, AttributeValue]) -> None:
        """Cleaned now, as the SDK cleans at the write (a list set now is a tuple of what it holds now)."""
        if not attributes:
            return
        cleaned = _internals.clean_attributes(attributes, self._max_length())
        if len(cleaned) != len(attributes):
            self.dropped += len(attributes) - len(cleaned)
        writes = self._writes
        if writes is None:
            self._writes = [cleaned]
        else:
            writes.append(cleaned)

    def note_attributes(self, attributes: Callable[[], Mapping[str, AttributeValue]]) -> None:
        """llmspans' own attributes, clean, whose values are fixed now but read only if the span is built
        (a limiter's admission): nothing is built for a trace nobody keeps."""
        if self._end_time is None:
            if self._writes is None:
                self._writes = [_Lazy(attributes)]
            else:
                self._writes.append(_Lazy(attributes))

    def add_event(
        self, name: str, attributes: Mapping[str, AttributeValue] | None = None, timestamp: int | None = None
    ) -> None:
        if self._end_time is not None:
            logger.warning("Tried calling _add_event on an ended span.")
            return
        limits = _internals.span_limits(self._plan.tracer)
        event = Event(
            name,
            BoundedAttributes(limits.max_event_attributes, attributes, immutable=True,
                              max_value_len=limits.max_attribute_length),
            timestamp,
        )  # fmt: skip
        if self._events is None:
            self._events = [event]
        else:
            self._events.append(event)

    def note_event(
        self, name: str, timestamp: int, attributes: Mapping[str, AttributeValue] | None = None
    ) -> None:
        """An event of llmspans' own (clean attributes, its instant known): kept as its parts, made an
        event only if the span is built."""
        if self._end_time is None:
            if self._events is None:
                self._events = [_OwnEvent(name, attributes, timestamp)]
            else:
                self._events.append(_OwnEvent(name, attributes, timestamp))

    def mark_facts(self, facts: SpanFacts) -> None:
        """Its owner's end goes here, among the writes and events so far and those still to come: written
        when the span is built (`SpanFacts.write_span`), never for a span nobody keeps."""
        if self._end_time is not None:
            return
        self.facts = facts
        writes, events = self._writes, self._events
        if writes is not None or events is not None:
            self._facts_at = (len(writes) if writes else 0) << 32 | (len(events) if events else 0)

    def add_link(self, context: SpanContext, attributes: Mapping[str, AttributeValue] | None = None) -> None:
        if not (context and (context.is_valid or (attributes or context.trace_state))):
            return
        if self._end_time is not None:
            logger.warning("Tried calling _add_link on an ended span.")
            return
        limits = _internals.span_limits(self._plan.tracer)
        link = Link(
            context,
            BoundedAttributes(limits.max_link_attributes, attributes, immutable=True,
                              max_value_len=limits.max_attribute_length),
        )  # fmt: skip
        if self._links is None:
            self._links = [link]
        else:
            self._links.append(link)

    def update_name(self, name: str) -> None:
        if self._end_time is not None:
            logger.warning("Tried calling update_name on an ended span.")
            return
        self._name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        if self._end_time is not None:
            logger.warning("Tried calling set_status on an ended span.")
            return
        if self._status.status_code is StatusCode.OK:  # the SDK's rules: OK is final, UNSET is ignored
            return
        if isinstance(status, Status):
            if status.status_code is StatusCode.UNSET:
                return
            if description is not None:
                logger.warning(
                    "Description %s ignored. Use either `Status` or `(StatusCode, Description)`", description
                )
            self._status = status
        elif isinstance(status, StatusCode) and status is not StatusCode.UNSET:
            self._status = Status(status, description)

    def record_exception(
        self, exception: BaseException, attributes: Mapping[str, AttributeValue] | None = None,
        timestamp: int | None = None, escaped: bool = False,
    ) -> None:  # fmt: skip
        """As the SDK records one: an `exception` event with the type, message and stack trace."""
        described: dict[str, AttributeValue] = {
            EXCEPTION_TYPE: _exception_type(exception),
            EXCEPTION_MESSAGE: str(exception),
            EXCEPTION_STACKTRACE: "".join(traceback.format_exception(exception)),
            EXCEPTION_ESCAPED: str(escaped),
        }
        if attributes:
            described.update(attributes)
        self.add_event("exception", described, timestamp)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_val: BaseException | None,
        exc_tb: TracebackType | None,
    ) -> None:
        if exc_val is not None and self.is_recording():
            self.record_exception(exc_val, escaped=True)
            self.set_status(Status(StatusCode.ERROR, f"{type(exc_val).__name__}: {exc_val}"))
        self.end()

    def end(self, end_time: int | None = None) -> None:
        """The end: built and handed to the provider's processors now (HEAD), or held by the tail-sampling
        processor until its trace is decided (TAIL)."""
        if self._end_time is not None:
            logger.warning("Calling end() on an ended span.")
            return
        self._end_time = end = end_time if end_time is not None else time_ns()
        plan = self._plan
        if plan.mode == HEAD:
            plan.processor.on_end(self.build())
        else:
            plan.processor.hold(self, self._parent, end - self._start_time)

    # --- waiting, building ---------------------------------------------------------------------------------

    def wait(self) -> None:
        """Its trace's decision is still to come (the tail-sampling processor holds it): keep the least."""
        facts = self.facts
        if facts is not None:
            self.facts = facts.compact()

    def drop(self) -> None:
        """Its trace was dropped: it lets go of its owner (which may hold it), and is never built."""
        self.facts = None

    def keeps_trace(self) -> bool:
        """Whether this span by itself keeps its trace whole: failed, over budget, retried or hedged."""
        if self._status is not _UNSET and self._status.status_code is StatusCode.ERROR:
            return True
        facts = self.facts
        if facts is not None and facts.keeps_trace:
            return True
        writes = self._writes
        return writes is not None and any(type(write) is dict and _keeping(write) for write in writes)

    def _owned(self) -> tuple[list[Any], list[Any]]:
        """The writes and events with the owner's end written in at its place, and any `_Lazy` read."""
        writes, events = self._writes or [], self._events or []
        facts = self.facts
        if facts is not None:
            self.facts = None  # written once (its owner may be gone: a span that is built holds no owner)
            own = _Collector(self)
            facts.write_span(own)
            if own.status is not None:
                self._status = own.status
            at = self._facts_at
            writes[at >> 32 : at >> 32] = own.writes
            events[at & 0xFFFFFFFF : at & 0xFFFFFFFF] = own.events
            self._writes, self._events = writes, events
        return _resolved(writes), events

    def build(self, weight: float | None = None, context: SpanContext | None = None) -> ReadableSpan:
        """The ReadableSpan the SDK would have handed to `on_end`; with `weight` added and `context` in place
        of its own when tail sampling kept it (as `_tail_sampling.weighted_copy` does for an SDK span)."""
        writes, events = self._owned()
        attributes = self._folded(writes)
        if weight is not None:
            attributes = dict(attributes)
            attributes[names.SAMPLE_WEIGHT] = weight
        tracer = self._plan.tracer
        return ReadableSpan(
            name=self._name, context=self.context if context is None else context, parent=self._parent,
            resource=tracer.resource, attributes=attributes, events=self._made_events(events),
            links=_bounded(self._links, _internals.span_limits(tracer).max_links), kind=self._kind,
            instrumentation_info=tracer.instrumentation_info, status=self._status,
            start_time=self._start_time, end_time=self._end_time,
            instrumentation_scope=_internals.instrumentation_scope(tracer),
        )  # fmt: skip

    def sdk_span(self, processor: SpanProcessor) -> Any:
        """This span replayed into an SDK span, for processors that do something at a span's start: started
        (their `on_start`, as the SDK would call it, after the start attributes), then written in the order
        it was written, then ended without handing it on (the caller does: its copy may be weighted)."""
        tracer = self._plan.tracer
        span = _internals.sdk_span_class()(
            name=self._name, context=self.context, parent=self._parent, sampler=tracer.sampler,
            resource=tracer.resource, attributes=self._attributes, span_processor=processor, kind=self._kind,
            links=tuple(self._links) if self._links else (), instrumentation_info=tracer.instrumentation_info,
            limits=_internals.span_limits(tracer), instrumentation_scope=_internals.instrumentation_scope(tracer),
        )  # fmt: skip
        span.start(start_time=self._start_time)
        writes, events = self._owned()
        for write in writes:
            span.set_attributes(write)
        for event in self._made_events(events):
            span._events.append(event)
        if self._status is not _UNSET:
            span.set_status(self._status)
        if self._name != span.name:
            span.update_name(self._name)
        _internals.end_without_processors(span, self._end_time)
        return span

    def _made_events(self, events: list[Any]) -> Sequence[Event]:
        if not events:
            return ()
        limits = _internals.span_limits(self._plan.tracer)
        plain = limits.max_attribute_length is None
        made = []
        for event in events:
            if type(event) is _OwnEvent:
                attributes = event.attributes
                most = limits.max_event_attributes
                if not plain or (attributes is not None and most is not None and len(attributes) > most):
                    attributes = BoundedAttributes(limits.max_event_attributes, attributes, immutable=True,
                                                   max_value_len=limits.max_attribute_length)  # fmt: skip
                made.append(
                    Event(event.name, attributes if attributes is not None else _EMPTY_EVENT, event.timestamp)
                )
            else:
                made.append(event)
        return _bounded(made, limits.max_events)

    @property
    def _limits(self) -> Any:
        """The tracer's `SpanLimits` under the SDK span's own name, so the one reach that reads a span's limits
        (`_internals.span_attribute_length_limit`: captured content fitted within them) reads a held span too."""
        return _internals.span_limits(self._plan.tracer)

    def _max_length(self) -> int | None:
        length: int | None = _internals.span_limits(self._plan.tracer).max_span_attribute_length
        return length

    def _folded(self, writes: Iterable[Mapping[str, AttributeValue]]) -> Mapping[str, AttributeValue]:
        """The start attributes and every write, in the SDK's order (a key written again moves to the end),
        under the SDK's limits."""
        start = self._attributes or _NO_ATTRIBUTES
        limits = _internals.span_limits(self._plan.tracer)
        if limits.max_span_attribute_length is None and not self.dropped:
            folded = dict(start)
            for write in writes:
                if folded.keys().isdisjoint(write):
                    folded.update(write)
                else:
                    for key, value in write.items():
                        folded.pop(key, None)
                        folded[key] = value
            if limits.max_span_attributes is None or len(folded) <= limits.max_span_attributes:
                return folded
        bounded = BoundedAttributes(limits.max_span_attributes, start, immutable=False,
                                    max_value_len=limits.max_span_attribute_length)  # fmt: skip
        bounded.dropped += self.dropped
        _internals.fill_attributes(bounded, writes)
        return bounded


_EMPTY_EVENT: Mapping[str, AttributeValue] = MappingProxyType({})


class _Lazy:
    """llmspans' own attributes, read only when the span is built (`HeldSpan.note_attributes`)."""

    __slots__ = ("read",)

    def __init__(self, read: Callable[[], Mapping[str, AttributeValue]]) -> None:
        self.read = read


class _OwnEvent:
    """llmspans' own event, kept as its parts until the span is built (`HeldSpan.note_event`)."""

    __slots__ = ("attributes", "name", "timestamp")

    def __init__(self, name: str, attributes: Mapping[str, AttributeValue] | None, timestamp: int) -> None:
        self.name = name
        self.attributes = attributes
        self.timestamp = timestamp


class _Collector:
    """What a held span's owner writes on it when it is built (`SpanFacts.write_span`): its values are
    llmspans' own and clean, so they are kept as they are, in order, with the status it sets."""

    __slots__ = ("events", "span", "status", "writes")

    def __init__(self, span: HeldSpan) -> None:
        self.span = span
        self.writes: list[Mapping[str, AttributeValue]] = []
        self.events: list[Any] = []
        self.status: Status | None = None

    @property
    def start_time(self) -> int:
        return self.span.start_time

    def is_recording(self) -> bool:
        return True

    def get_span_context(self) -> SpanContext:
        return self.span.context

    def set_attributes(self, attributes: Mapping[str, AttributeValue]) -> None:
        self.writes.append(attributes)

    def set_attribute(self, key: str, value: AttributeValue) -> None:
        self.writes.append({key: value})

    def add_event(
        self, name: str, attributes: Mapping[str, AttributeValue] | None = None, timestamp: int | None = None
    ) -> None:
        self.events.append(_OwnEvent(name, attributes, timestamp if timestamp is not None else time_ns()))

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        current = self.status or self.span.status
        if current.status_code is StatusCode.OK:
            return
        if isinstance(status, Status):
            if status.status_code is not StatusCode.UNSET:
                self.status = status
        elif status is not StatusCode.UNSET:
            self.status = Status(status, description)


def _bounded(items: Sequence[Any] | None, most: int | None) -> Sequence[Any]:
    """Events or links as the SDK keeps them: the latest `most`, the others counted as dropped."""
    if not items:
        return ()
    if most is None or len(items) <= most:
        return tuple(items)
    return BoundedList.from_seq(most, items)


def _resolved(writes: list[Any]) -> list[Mapping[str, AttributeValue]]:
    """The writes with each `_Lazy` read."""
    if not any(type(write) is _Lazy for write in writes):
        return writes
    return [write.read() if type(write) is _Lazy else write for write in writes]


def _keeping(write: Mapping[str, AttributeValue]) -> bool:
    retries = write.get(names.RETRY_COUNT)
    return (
        write.get(names.BUDGET_EXCEEDED) is True
        or write.get(names.HEDGE_FIRED) is True
        or (isinstance(retries, int) and not isinstance(retries, bool) and retries > 0)
    )


def _exception_type(exception: BaseException) -> str:
    """`exception.type` as the SDK writes it: the module-qualified name, bare for builtins."""
    module = type(exception).__module__
    qualname = type(exception).__qualname__
    return f"{module}.{qualname}" if module and module != "builtins" else qualname
