"""Tail sampling: hold a local trace until its local root ends, then keep it whole or drop it whole.

A trace is kept, with weight 1, when any of its spans failed (status ERROR), went over its budget, was
retried or hedged, or when its root was slower than `slower_than`; otherwise it is kept by chance, with
probability `ratio` and weight `1/ratio`, decided from the trace id as OpenTelemetry's consistent
probability sampling does (the lowest 56 bits of the trace id, or the `rv` of an `ot` tracestate entry,
against a rejection threshold), so every process with the same ratio keeps the same traces. Kept spans
are handed to the wrapped processors as copies carrying `llmspans.sample.weight` and `ot=th:` in their
tracestate. A dropped trace never reaches the wrapped processors: no batch queue, no encoding.

What is held is bounded (`TailSampling`): at a cap the trace is decided at once on what is held (see
`TailSampling` and docs/telemetry.md, "Tail sampling"), and `llmspans.sample.overflow` counts it. The
processor starts no thread: caps and ages are looked at as spans end, and at `force_flush`/`shutdown`.
After a fork the child starts with nothing held (the parent's held spans are the parent's to export).
"""

from __future__ import annotations

import bisect
import logging
import math
import os
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace import Span as SdkSpan
from opentelemetry.trace import SpanContext, StatusCode, TraceState

from llmspans import _guard, _internals, _metrics, _telemetry
from llmspans import _names as names
from llmspans import _sites as sites
from llmspans._budget import Percentile, parse_duration
from llmspans._held_span import HeldSpan, Holder, quiet_at_start

logger = logging.getLogger("llmspans")

WINDOW: Final = 1000
"""A percentile `slower_than` compares a root with the last WINDOW roots of the same name (kept or not)."""
WARM_UP: Final = 100
"""Until a root name has WARM_UP durations in its window, each of its roots counts as slow (kept whole)."""
MAX_ROOT_NAMES: Final = 256
"""Windows kept at once; past it the name seen longest ago is forgotten (and warms up again)."""
RECENT_DECISIONS: Final = 10_000
"""Decided trace ids remembered, so a span ending after its root (a stream's) follows its trace."""
_RANDOMNESS_BITS: Final = 56
_MAX_THRESHOLD: Final = 1 << _RANDOMNESS_BITS
_RANDOMNESS_MASK: Final = _MAX_THRESHOLD - 1
_CAP_TRACE_SPANS: Final = "trace_spans"
_CAP_HELD_SPANS: Final = "held_spans"
_CAP_MAX_AGE: Final = "max_age"


def _positive_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be a whole number, got {value!r}")
    if value < 1:
        raise ValueError(f"{what} must be at least 1, got {value!r}")
    return value


def check_slower_than(value: object) -> float | str | None:
    """`slower_than` as given, checked (`_budget.parse_duration`): seconds, a percentile's name, or None."""
    if value is None:
        return None
    found = parse_duration(value, what="slower_than", percentiles=True)
    return found.name if isinstance(found, Percentile) else found


@dataclass(frozen=True)
class TailSampling:
    """What tail sampling keeps, and how much it may hold.

    `ratio` (0-1): the chance an ordinary trace is kept, the same for the same trace id everywhere.
    `slower_than`: a root slower than this is kept whole: seconds (`2.5`, `"2500ms"`), or a percentile from
    `"p50"` to `"p99.9"` (`"p95"`) of the last 1,000 roots of the same name (each name's first 100 roots
    are all kept while its window warms up); None turns the rule off.
    `max_spans_per_trace`, `max_held_spans` and `max_age` (seconds) bound what is held: a trace that
    reaches one is decided at once on what is held so far (kept whole if a held span failed, went over
    budget, was retried or hedged, or, at `max_age`, if a fixed `slower_than` already passed; else by
    the ratio), and its later spans follow that decision.
    `defer` (on by default): llmspans' own call, stage and turn spans are held as the facts they are made
    from and become SDK spans only if their trace is kept, while the processor is the provider's only one
    (`_held_span`; what the wrapped processors see is the same). `defer=False` holds SDK spans.
    """

    ratio: float = 0.01
    slower_than: float | str | None = "p95"
    max_spans_per_trace: int = 1000
    max_held_spans: int = 20_000
    max_age: float = 300.0
    defer: bool = True

    def __post_init__(self) -> None:
        ratio = self.ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
            raise TypeError(f"ratio must be a number from 0 to 1 (0.01 keeps 1 in 100), got {ratio!r}")
        if not 0 <= ratio <= 1:
            raise ValueError(f"ratio must be from 0 to 1 (0.01 keeps 1 in 100), got {ratio!r}")
        object.__setattr__(self, "ratio", float(ratio))
        object.__setattr__(self, "slower_than", check_slower_than(self.slower_than))
        _positive_int(self.max_spans_per_trace, "max_spans_per_trace")
        _positive_int(self.max_held_spans, "max_held_spans")
        if not isinstance(self.defer, bool):
            raise TypeError(f"defer must be True or False, got {self.defer!r}")
        object.__setattr__(self, "max_age", parse_duration(self.max_age, what="max_age"))

    @property
    def threshold(self) -> int:
        """OpenTelemetry's rejection threshold: a trace whose 56-bit randomness is at least this is kept."""
        return _MAX_THRESHOLD - round(self.ratio * _MAX_THRESHOLD)  # ratio * 2**56 is exact in a float

    @property
    def weight(self) -> float:
        """How many traces one kept by chance stands for."""
        return 1 / self.ratio if self.ratio > 0 else 1.0


_ON_WORDS: Final = frozenset({"1", "true", "on", "yes"})
_OFF_WORDS: Final = frozenset({"", "0", "false", "off", "no"})


def _ratio(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"ratio must be a number from 0 to 1 (0.01 keeps 1 in 100), got {value!r}") from None


def _whole(what: str) -> Callable[[str], int]:
    def whole(value: str) -> int:
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"{what} must be a whole number, got {value!r}") from None

    return whole


def _switch(value: str) -> bool:
    word = value.lower()
    if word in _ON_WORDS or word in _OFF_WORDS:
        return word in _ON_WORDS
    raise ValueError(f"defer must be true or false, got {value!r}")


_FROM_TEXT: Final[dict[str, Callable[[str], object]]] = {
    "ratio": _ratio,
    "slower_than": lambda value: None if value.lower() in ("none", "off") else value,
    "max_spans_per_trace": _whole("max_spans_per_trace"),
    "max_held_spans": _whole("max_held_spans"),
    "max_age": str,  # `parse_duration` reads it, as it reads the argument
    "defer": _switch,
}


def tail_sampling_from_text(text: str) -> TailSampling | None:
    """`TailSampling` from `"ratio=0.01,slower_than=p95"` (any of its arguments by name; `on` for its
    defaults, `off` or nothing for none), checked by `TailSampling` itself as its arguments are: what
    `LLMSPANS_TAIL_SAMPLING` holds. Raises ValueError or TypeError saying what to write."""
    stripped = text.strip()
    if stripped.lower() in _OFF_WORDS:
        return None
    if stripped.lower() in _ON_WORDS:
        return TailSampling()
    given: dict[str, object] = {}
    for entry in filter(None, (part.strip() for part in stripped.split(","))):
        key, sep, value = entry.partition("=")
        key = key.strip()
        if not sep or key not in _FROM_TEXT:
            raise ValueError(
                f"entry {entry!r} must be one of {', '.join(f'{name}=...' for name in _FROM_TEXT)}, "
                "e.g. 'ratio=0.01,slower_than=p95'"
            )
        given[key] = _FROM_TEXT[key](value.strip())
    return TailSampling(**given)  # type: ignore[arg-type]


def tail_sampling_from_environment(environ: Mapping[str, str] | None = None) -> TailSampling | None:
    """What `LLMSPANS_TAIL_SAMPLING` asks for (None: unset, off, or not understood). A value it cannot use
    is one warning line naming the variable, and tail sampling stays off."""
    text = (os.environ if environ is None else environ).get(names.ENV_TAIL_SAMPLING)
    if text is None:
        return None
    try:
        return tail_sampling_from_text(text)
    except (TypeError, ValueError) as error:
        logger.warning(
            "llmspans: %s=%r is not used (%s); tail sampling is off", names.ENV_TAIL_SAMPLING, text, error
        )
        return None


def threshold_hex(threshold: int) -> str:
    """The `th` value of a threshold: 14 hex digits, trailing zeros dropped (`0` for keep-everything)."""
    if threshold <= 0:
        return "0"
    return f"{threshold:014x}".rstrip("0")


def randomness(span_context: SpanContext) -> int:
    """The 56 random bits a consistent decision reads: `rv` in the `ot` tracestate entry, else the trace id's."""
    state = span_context.trace_state
    if state:
        ot = state.get("ot")
        if ot:
            for member in ot.split(";"):
                key, _, value = member.partition(":")
                if key == "rv" and len(value) == 14:
                    try:
                        return int(value, 16)
                    except ValueError:
                        break
    return span_context.trace_id & _RANDOMNESS_MASK


def _with_threshold(state: TraceState, th: str) -> TraceState:
    """`state` with `th` set in its `ot` entry, the entry's other members kept."""
    ot = state.get("ot")
    members = [m for m in ot.split(";") if m and not m.startswith("th:")] if ot else []
    value = ";".join([f"th:{th}", *members])
    try:
        return state.update("ot", value) if ot is not None else state.add("ot", value)
    except Exception:
        return state


class _RootDurations:
    """The recent durations of roots, per root name, for a percentile `slower_than`."""

    def __init__(self, q: float) -> None:
        self.q = q
        self._windows: dict[str, tuple[deque[int], list[int]]] = {}
        self._full_rank = self._rank(WINDOW)  # a full window's (the usual one's), worked out once

    def _rank(self, count: int) -> int:
        return min(max(1, math.ceil(self.q * count - 1e-9)), count)

    def slower(self, name: str, duration_ns: int) -> bool:
        """Whether this root is slower than the percentile of its name's window, then add it to the window."""
        windows = self._windows
        found = windows.get(name)
        if found is None:
            if len(windows) >= MAX_ROOT_NAMES:
                del windows[next(iter(windows))]
            found = windows[name] = (deque(), [])
        arrival, ordered = found
        count = len(ordered)
        if count < WARM_UP:
            slow = True
        else:
            rank = self._full_rank if count == WINDOW else self._rank(count)
            slow = duration_ns > ordered[rank - 1]
        if count >= WINDOW:
            oldest = arrival.popleft()
            del ordered[bisect.bisect_left(ordered, oldest)]
        arrival.append(duration_ns)
        bisect.insort(ordered, duration_ns)
        return slow


class _Held:
    """The spans of one undecided trace, with what its held spans already say."""

    __slots__ = ("first_ns", "keep", "spans")

    def __init__(self, first_ns: int) -> None:
        self.first_ns = first_ns
        self.spans: list[ReadableSpan | HeldSpan] = []
        self.keep = False  # a held span failed, overran its budget, was retried or hedged


def _must_keep(span: ReadableSpan | HeldSpan) -> bool:
    """A span that by itself keeps its trace whole: failed, over budget, retried or hedged."""
    if type(span) is HeldSpan:
        return span.keeps_trace()
    if span.status.status_code is StatusCode.ERROR:
        return True
    attributes = _internals.span_attributes(span)  # no read-only copy per look-up
    if not attributes:
        return False
    retries = attributes.get(names.RETRY_COUNT)
    return (
        attributes.get(names.BUDGET_EXCEEDED) is True
        or attributes.get(names.HEDGE_FIRED) is True
        or (isinstance(retries, int) and retries > 0)
    )


_Decision = tuple[list[ReadableSpan | HeldSpan], float]  # the spans to export and their weight (0: dropped)


class TailSamplingProcessor(Holder):
    """A span processor that keeps whole the traces worth keeping and hands only those on.

    Wrap the processors that export (`TailSamplingProcessor(BatchSpanProcessor(exporter), ratio=0.01)`)
    and add it to the TracerProvider in their place; give the provider a sampler that records every trace
    (the SDK's default, `ParentBased(ALWAYS_ON)`), or tail sampling only sees what the head kept.
    Arguments are those of `TailSampling`, or `sampling=TailSampling(...)`. Nothing the wrapped processors
    raise reaches the application.
    """

    def __init__(
        self,
        *processors: SpanProcessor | TailSampling,
        sampling: TailSampling | None = None,
        ratio: float | None = None,
        slower_than: object = ...,  # float | str | None; ... when not given
        max_spans_per_trace: int | None = None,
        max_held_spans: int | None = None,
        max_age: float | None = None,
    ) -> None:
        wrapped: list[SpanProcessor] = []
        for processor in processors:
            if isinstance(processor, TailSampling) and sampling is None:
                sampling = processor
            elif isinstance(processor, SpanProcessor):
                wrapped.append(processor)
            elif isinstance(processor, (list, tuple)):
                wrapped.extend(_checked_processors(processor))
            else:
                raise TypeError(
                    "TailSamplingProcessor wraps span processors, such as BatchSpanProcessor(exporter); "
                    f"got {processor!r}"
                )
        if not wrapped:
            raise TypeError("TailSamplingProcessor needs the processors to hand kept traces to, such as "
                            "TailSamplingProcessor(BatchSpanProcessor(exporter), ratio=0.01)")  # fmt: skip
        pairs = (
            ("ratio", ratio), ("max_spans_per_trace", max_spans_per_trace), ("max_held_spans", max_held_spans),
            ("max_age", max_age),
        )  # fmt: skip
        given: dict[str, object] = {key: value for key, value in pairs if value is not None}
        if slower_than is not ...:
            given["slower_than"] = slower_than
        if sampling is not None and given:
            raise TypeError(
                f"give either sampling=TailSampling(...) or its arguments, not both ({sorted(given)})"
            )
        if sampling is None:
            sampling = TailSampling(**given)  # type: ignore[arg-type]
        elif not isinstance(sampling, TailSampling):
            raise TypeError(f"sampling must be llmspans.TailSampling(...), got {sampling!r}")
        self.sampling = sampling
        self._processors = tuple(wrapped)
        # Whether the wrapped processors do nothing at a span's start: a kept held span is then built
        # straight into what they export; otherwise each is replayed as an SDK span for their `on_start`.
        self._quiet_starts = all(quiet_at_start(processor) for processor in wrapped)
        self._threshold = sampling.threshold
        self._chance_weight = sampling.weight
        self._by_chance = sampling.ratio > 0
        self._th_chance = threshold_hex(self._threshold)
        slower = sampling.slower_than
        threshold = None if slower is None else parse_duration(slower, what="slower_than", percentiles=True)
        self._slower_ns = round(threshold * 1e9) if isinstance(threshold, float) else None
        self._durations = _RootDurations(threshold.q) if isinstance(threshold, Percentile) else None
        self._max_trace = sampling.max_spans_per_trace
        self._max_held = sampling.max_held_spans
        self._max_age_ns = round(sampling.max_age * 1e9)
        self._lock = threading.Lock()
        # Ordered dicts: the oldest is looked at on every span's end, and a plain dict's first key is slow
        # to find once many keys before it were deleted.
        self._held: OrderedDict[int, _Held] = OrderedDict()  # by trace id, oldest first
        self._held_spans = 0
        # trace id -> weight (0: dropped), oldest first
        self._decided: OrderedDict[int, float] = OrderedDict()
        self._shutdown = False
        _live.add(self)

    # --- the SpanProcessor interface ---------------------------------------------------------------

    def on_start(self, span: SdkSpan, parent_context: Context | None = None) -> None:
        for processor in self._processors:
            try:
                processor.on_start(span, parent_context=parent_context)
            except Exception as error:
                _guard.report(sites.TAIL_SAMPLING_EXPORT, error)

    @property
    def defers(self) -> bool:
        """Whether llmspans' own spans are held unbuilt while this is the provider's only processor."""
        return self.sampling.defer

    def on_end(self, span: ReadableSpan) -> None:
        self._ended(span)

    def hold(self, span: HeldSpan, parent: SpanContext | None, duration_ns: int) -> None:
        """A held span ended (`_held_span`): held as it is, built only if its trace is kept.

        A local root while nothing is held and its trace is not yet decided (a lone call or stage, the
        commonest end by far) is decided here on the spot, as `_ended` and `_decide_alone` would decide it,
        with none of their general bookkeeping; anything else goes to `_ended`."""
        if (parent is not None and not parent.is_remote) or _guard.faults or self._shutdown:
            self._ended(span)
            return
        context = span.context
        trace_id = context[0]
        try:
            with self._lock:
                decided = self._decided
                if self._held or trace_id in decided:
                    alone = False
                else:
                    alone = True
                    keep = span.keeps_trace()
                    if self._durations is not None:
                        keep = self._durations.slower(span.name, duration_ns) or keep  # every root joins
                    elif self._slower_ns is not None and duration_ns > self._slower_ns:
                        keep = True
                    if keep:  # `_weight`, inlined
                        weight = 1.0
                    elif not self._by_chance:
                        weight = 0.0
                    else:
                        chance = trace_id & _RANDOMNESS_MASK if not context[4] else randomness(context)
                        weight = self._chance_weight if chance >= self._threshold else 0.0
                    decided[trace_id] = weight
                    if len(decided) > RECENT_DECISIONS:
                        decided.popitem(last=False)
        except Exception as error:
            _guard.report(sites.TAIL_SAMPLING_DECIDE, error)
            return
        if not alone:
            self._ended(span)
        elif weight:
            self._export((([span], weight),))
        else:
            span.drop()  # dropped: it lets go of its owner now

    def _ended(self, span: ReadableSpan | HeldSpan) -> None:
        decisions: list[_Decision] = []
        overflows: list[str] = []
        try:
            if _guard.faults:
                _guard.check_fault(sites.TAIL_SAMPLING_DECIDE)
            context = span.context
            held_span = type(span) is HeldSpan  # (sampled, by how it was made)
            if context is None or self._shutdown or not (held_span or context.trace_flags.sampled):
                return
            trace_id = context[0]  # `trace_id`: the tuple's first member, without the property's call
            now = time.monotonic_ns()
            with self._lock:
                weight = self._decided.get(trace_id)
                if weight is not None:  # a span ending after its trace was decided follows it
                    if weight:
                        decisions.append(([span], weight))
                    elif held_span:
                        span.drop()  # type: ignore[union-attr]
                else:
                    held = self._held.get(trace_id)
                    parent = span.parent
                    if held is None and (parent is None or parent.is_remote):
                        # A root with nothing held before it (a call on its own): decided now, never held.
                        decision = self._decide_alone(trace_id, span)
                        if decision[1]:
                            decisions.append(decision)
                        if self._held:
                            self._enforce_caps(now, decisions, overflows)
                        return
                    if held is None:
                        held = self._held[trace_id] = _Held(now)
                    if held_span:  # kept waiting for its trace's decision: it keeps the least it can
                        span.wait()  # type: ignore[union-attr]
                    held.spans.append(span)
                    self._held_spans += 1
                    if not held.keep and _must_keep(span):
                        held.keep = True
                    if parent is None or parent.is_remote:
                        del self._held[trace_id]
                        self._held_spans -= len(held.spans)
                        decisions.append(self._decide(trace_id, held, span))
                    elif len(held.spans) >= self._max_trace:
                        decisions.append(self._decide_early(trace_id, held, _CAP_TRACE_SPANS, now))
                        overflows.append(_CAP_TRACE_SPANS)
                self._enforce_caps(now, decisions, overflows)
        except Exception as error:
            _guard.report(sites.TAIL_SAMPLING_DECIDE, error)
        finally:
            if decisions:
                self._export(decisions)
            if overflows:
                _count_overflows(overflows)

    def shutdown(self) -> None:
        """Decide what is still held on what it holds (a root that never ended), then shut the wrapped down."""
        self._shutdown = True
        self._flush_held()
        for processor in self._processors:
            try:
                processor.shutdown()
            except Exception as error:
                _guard.report(sites.TAIL_SAMPLING_EXPORT, error)

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        """Flush the wrapped processors; undecided traces stay held (their roots have not ended)."""
        decisions: list[_Decision] = []
        overflows: list[str] = []
        with self._lock:
            self._enforce_caps(time.monotonic_ns(), decisions, overflows)
        self._export(decisions)
        if overflows:
            _count_overflows(overflows)
        flushed = True
        for processor in self._processors:
            try:
                flushed = processor.force_flush(timeout_millis) and flushed
            except Exception as error:
                _guard.report(sites.TAIL_SAMPLING_EXPORT, error)
                flushed = False
        return flushed

    # --- what is held --------------------------------------------------------------------------------

    @property
    def held_spans(self) -> int:
        """Spans held now, waiting for their trace's decision."""
        return self._held_spans

    @property
    def held_traces(self) -> int:
        return len(self._held)

    def _flush_held(self) -> None:
        decisions: list[_Decision] = []
        with self._lock:
            now = time.monotonic_ns()
            for trace_id, held in list(self._held.items()):
                decisions.append(self._decide_early(trace_id, held, _CAP_MAX_AGE, now))
        self._export(decisions)

    def _forget_held(self) -> None:
        self._lock = threading.Lock()
        self._held = OrderedDict()
        self._held_spans = 0

    def _enforce_caps(self, now: int, decisions: list[_Decision], overflows: list[str]) -> None:
        """Under the lock: decide the oldest traces while too much is held or they are too old."""
        held_traces = self._held
        while held_traces:
            trace_id = next(iter(held_traces))
            oldest = held_traces[trace_id]
            if self._held_spans > self._max_held:
                cap = _CAP_HELD_SPANS
            elif now - oldest.first_ns > self._max_age_ns:
                cap = _CAP_MAX_AGE
            else:
                return
            decisions.append(self._decide_early(trace_id, oldest, cap, now))
            overflows.append(cap)

    # --- deciding --------------------------------------------------------------------------------------

    def _decide_alone(self, trace_id: int, root: ReadableSpan | HeldSpan) -> _Decision:
        """Under the lock, at the end of a local root that had no span held before it."""
        keep = _must_keep(root)
        duration = (root.end_time or 0) - (root.start_time or 0)
        if self._durations is not None:
            keep = self._durations.slower(root.name, duration) or keep  # every root joins the window
        elif self._slower_ns is not None and duration > self._slower_ns:
            keep = True
        return self._remember(trace_id, [root], keep, root.context)

    def _decide(self, trace_id: int, held: _Held, root: ReadableSpan | HeldSpan) -> _Decision:
        """Under the lock, at the local root's end."""
        keep = held.keep
        duration = (root.end_time or 0) - (root.start_time or 0)
        if self._durations is not None:
            keep = self._durations.slower(root.name, duration) or keep  # every root joins the window
        elif self._slower_ns is not None and duration > self._slower_ns:
            keep = True
        return self._remember(trace_id, held.spans, keep, root.context)

    def _decide_early(self, trace_id: int, held: _Held, cap: str, now: int) -> _Decision:
        """Under the lock, at a cap: on what is held; the trace's later spans follow."""
        del self._held[trace_id]
        self._held_spans -= len(held.spans)
        keep = held.keep or (
            cap == _CAP_MAX_AGE and self._slower_ns is not None and now - held.first_ns > self._slower_ns
        )
        return self._remember(trace_id, held.spans, keep, held.spans[0].context if held.spans else None)

    def _remember(
        self, trace_id: int, spans: list[ReadableSpan | HeldSpan], keep: bool, context: SpanContext | None
    ) -> _Decision:
        weight = self._weight(keep, context)
        decided = self._decided
        decided[trace_id] = weight
        if len(decided) > RECENT_DECISIONS:
            decided.popitem(last=False)
        if weight:
            return spans, weight
        for span in spans:  # dropped: held spans let go of their owners now
            if type(span) is HeldSpan:
                span.drop()
        return [], 0.0

    def _weight(self, keep: bool, context: SpanContext | None) -> float:
        """A decided trace's weight: 1 kept whole, `1/ratio` kept by chance, 0 dropped."""
        if keep:
            return 1.0
        if context is None or not self._by_chance:
            return 0.0
        # `randomness`, without its call for the usual context with no tracestate
        chance = context[0] & _RANDOMNESS_MASK if not context[4] else randomness(context)
        return self._chance_weight if chance >= self._threshold else 0.0

    # --- handing on ----------------------------------------------------------------------------------

    def _export(self, decisions: Iterable[_Decision]) -> None:
        for spans, weight in decisions:
            if not weight:
                continue
            th = "0" if weight == 1.0 and self._threshold > 0 else self._th_chance
            for span in spans:
                try:
                    copy = self._weighted(span, weight, th)
                except Exception as error:
                    _guard.report(sites.TAIL_SAMPLING_DECIDE, error)
                    continue
                for processor in self._processors:
                    try:
                        processor.on_end(copy)
                    except Exception as error:
                        _guard.report(sites.TAIL_SAMPLING_EXPORT, error)

    def _weighted(self, span: ReadableSpan | HeldSpan, weight: float, th: str) -> ReadableSpan:
        """A kept span as exported, weighted. A held one is built now: straight, where the wrapped processors
        do nothing at a span's start; else replayed as an SDK span that starts through this processor (their
        `on_start`, each guarded) and is then copied weighted, as an SDK span ending here would be."""
        if type(span) is not HeldSpan:
            return weighted_copy(span, weight, th)  # type: ignore[arg-type]
        if self._quiet_starts:
            return span.build(weight, weighted_context(span.context, th))
        return weighted_copy(span.sdk_span(self), weight, th)


_live: weakref.WeakSet[TailSamplingProcessor] = weakref.WeakSet()
"""Every processor alive, so a forked child can empty them all (one fork hook for the module, which holds
no processor alive)."""


def _forget_held_in_a_forked_child() -> None:
    for processor in list(_live):
        processor._forget_held()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_held_in_a_forked_child)


def _checked_processors(processors: Sequence[object]) -> list[SpanProcessor]:
    for processor in processors:
        if not isinstance(processor, SpanProcessor):
            raise TypeError(f"TailSamplingProcessor wraps span processors, got {processor!r}")
    return list(processors)  # type: ignore[arg-type]


def weighted_context(context: SpanContext, th: str) -> SpanContext:
    """A kept span's context as exported: `ot=th:` in its tracestate."""
    return SpanContext(
        context.trace_id, context.span_id, context.is_remote, context.trace_flags,
        _with_threshold(context.trace_state, th),
    )  # fmt: skip


def weighted_copy(span: ReadableSpan, weight: float, th: str) -> ReadableSpan:
    """The span as exported: its attributes plus its trace's weight, `ot=th:` in its tracestate."""
    context = span.context
    if context is not None:
        context = weighted_context(context, th)
    attributes = dict(_internals.span_attributes(span))
    attributes[names.SAMPLE_WEIGHT] = weight
    return ReadableSpan(
        name=span.name, context=context, parent=span.parent, resource=span.resource, attributes=attributes,
        events=span.events, links=span.links, kind=span.kind, status=span.status,
        start_time=span.start_time, end_time=span.end_time, instrumentation_scope=span.instrumentation_scope,
    )  # fmt: skip


def _count_overflows(caps: Sequence[str]) -> None:
    with _guard.swallow(sites.TAIL_SAMPLING_DECIDE):
        records = [(_metrics.SAMPLE_OVERFLOW, 1.0, _labels(cap)) for cap in caps]
        _telemetry.recorder().add(records, None)


_LABELS: dict[str, _metrics.Labels] = {}


def _labels(cap: str) -> _metrics.Labels:
    found = _LABELS.get(cap)
    if found is None:
        found = _LABELS[cap] = _metrics.Labels({names.SAMPLE_OVERFLOW_CAP: cap})
    return found
