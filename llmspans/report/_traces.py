"""Whole traces out of a stream of span batches, one at a time, so no more than a few are held at once.

A trace is handed on at the end of the batch (a line of the file, a Jaeger page) in which its root
span (one without a parent) arrived: a process exports a span when it ends, and a root ends after
everything under it, so its trace is complete. A trace whose root never shows (its parent lives in
another service) is handed on at the end of the input. Should a span still arrive for a trace already
handed on (a vLLM server's file read after the client's, a span that outlived its turn), the
optimistic pass is abandoned with `LateSpan` and `exact_traces` reads the input twice instead: first
only to learn in which batch each trace ends, then handing each trace on after that batch. Both give
the same traces; the report (`_analysis.py`) sorts where order matters, so it does not depend on the
order traces are handed on in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from operator import attrgetter
from typing import Any

from llmspans import _names as names
from llmspans.report._model import KIND_BUCKET, KIND_OTHER, KIND_STAGE, UNMARKED
from llmspans.report._spans import Span
from llmspans.report._spans import number as attribute_number

_BUCKET_KEYS = tuple((KIND_BUCKET, bucket) for bucket in names.BUCKETS)
_UNMARKED_KEY = (KIND_OTHER, UNMARKED)
_START, _END = attrgetter("start_ns"), attrgetter("end_ns")
_LLM, _TURN = names.STAGE_LLM, names.STAGE_TURN
_WEIGHT = names.SAMPLE_WEIGHT
_NUMBERS = (int, float)
Batches = Callable[[], Iterable[list[Span]]]  # each call reads the input afresh


class LateSpan(Exception):
    """A span arrived for a trace already handed on: the optimistic pass cannot be exact."""


def number(span: Span, attribute: str) -> float:
    return attribute_number(span.attributes, attribute)


def bucket_nanoseconds(span: Span) -> dict[str, int]:
    """An LLM call's buckets by name, to the nanosecond."""
    return dict(zip(names.BUCKETS, span.buckets_ns, strict=True))


def is_call(span: Span) -> bool:
    return span.stage == names.STAGE_LLM


class Trace:
    """The spans of one trace, with the parent links the analysis walks.

    `index` is the order in which the trace first appeared in the input: ties are broken by it."""

    def __init__(self, index: int, trace_id: str, spans: list[Span]) -> None:
        self.index = index
        self.trace_id = trace_id
        ordered = sorted(spans, key=_END, reverse=True)  # by start, then the longest first (stable sorts)
        ordered.sort(key=_START)
        self.spans = ordered
        self.by_id = {span.span_id: span for span in spans}
        self.marked = [span for span in ordered if span.stage is not None]
        # Set by `parts()`: each part of this trace came from one span (one LLM call, each app stage once,
        # none nested in another stage), so its per-trace figure is that span's own, as the metrics saw it.
        self.one_span_per_part = True

    @property
    def weight(self) -> float:
        """How many traces this one stands for: its spans' `llmspans.sample.weight` (tail sampling), else 1."""
        weight = 1.0
        for span in self.marked:
            value: Any = span.attributes.get(_WEIGHT)
            if type(value) in _NUMBERS and value > weight:
                weight = float(value)
        return weight

    def copies(self) -> int:
        """How many times the analysis counts this trace: its weight, a fraction rounded up or down by a
        draw from the trace id's high bits (independent of the low 56 the sampler read), so the expected
        count is the weight."""
        weight = self.weight
        whole = int(weight)
        if weight == whole:
            return whole
        try:
            draw = int(self.trace_id[:8], 16) / 2**32
        except ValueError:
            draw = 0.5
        return whole + (draw < weight - whole)

    def marked_ancestor(self, span: Span) -> Span | None:
        """The nearest ancestor carrying `llmspans.stage`; attempt spans, phase spans and anything else
        without a stage are walked through."""
        seen = 0
        parent_id = span.parent_id
        while parent_id is not None and seen < 256:
            parent = self.by_id.get(parent_id)
            if parent is None:
                return None
            if parent.stage is not None:
                return parent
            parent_id = parent.parent_id
            seen += 1
        return None

    def parts(self) -> dict[tuple[str, str], int]:
        """Nanoseconds of this trace per part: app stages' own time, buckets, unmarked turn time; in the
        order the parts first appear."""
        totals: dict[tuple[str, str], int] = {}
        nested: dict[str, int] = {}
        ancestors = [self.marked_ancestor(span) for span in self.marked]
        single = True
        for span, parent in zip(self.marked, ancestors, strict=True):
            if parent is not None:
                nested[parent.span_id] = nested.get(parent.span_id, 0) + span.duration_ns
                single = single and parent.stage == _TURN
        calls = 0
        for span, parent in zip(self.marked, ancestors, strict=True):
            stage = span.stage
            if stage == _LLM:
                calls += 1
                for key, value in zip(_BUCKET_KEYS, span.buckets_ns, strict=True):
                    totals[key] = totals.get(key, 0) + value
            elif stage == _TURN:
                if parent is None:
                    totals[_UNMARKED_KEY] = totals.get(_UNMARKED_KEY, 0) + max(
                        0, span.duration_ns - nested.get(span.span_id, 0)
                    )
            else:
                key = (KIND_STAGE, stage)  # type: ignore[assignment]
                single = single and key not in totals
                totals[key] = totals.get(key, 0) + max(0, span.duration_ns - nested.get(span.span_id, 0))
        self.one_span_per_part = single and calls <= 1
        return totals

    @property
    def start_ns(self) -> int:
        return min(span.start_ns for span in self.marked)

    @property
    def duration_ns(self) -> int:
        return max(span.end_ns for span in self.marked) - self.start_ns

    def root(self) -> Span:
        roots = [span for span in self.marked if self.marked_ancestor(span) is None]
        return max(roots or self.marked, key=lambda span: span.duration_ns)


def optimistic_traces(batches: Iterable[list[Span]]) -> Iterator[Trace]:
    """Each trace once its root has arrived (see the module docstring); `LateSpan` if that was too early."""
    pending: dict[str, list[Span]] = {}
    first_seen: dict[str, int] = {}
    rooted: list[str] = []
    done: set[str] = set()
    for batch in batches:
        for span in batch:
            trace_id = span.trace_id
            group = pending.get(trace_id)
            if group is None:
                if trace_id in done:
                    raise LateSpan(trace_id)
                group = pending[trace_id] = []
                first_seen[trace_id] = len(first_seen) + len(done)
            group.append(span)
            if span.parent_id is None:
                rooted.append(trace_id)
        for trace_id in rooted:
            if trace_id in pending:
                done.add(trace_id)
                yield Trace(first_seen.pop(trace_id), trace_id, pending.pop(trace_id))
        rooted.clear()
    for trace_id, group in pending.items():
        yield Trace(first_seen[trace_id], trace_id, group)


def exact_traces(batches: Batches) -> Iterator[Trace]:
    """Each trace after the last batch that holds one of its spans (the input is read twice)."""
    last: dict[str, int] = {}
    for number_, batch in enumerate(batches()):
        for span in batch:
            last[span.trace_id] = number_
    pending: dict[str, list[Span]] = {}
    first_seen: dict[str, int] = {}
    seen = 0
    for number_, batch in enumerate(batches()):
        ending: list[str] = []
        for span in batch:
            trace_id = span.trace_id
            group = pending.get(trace_id)
            if group is None:
                group = pending[trace_id] = []
                first_seen[trace_id] = seen
                seen += 1
            group.append(span)
            if last.get(trace_id) == number_:
                ending.append(trace_id)
        for trace_id in ending:
            if trace_id in pending:
                yield Trace(first_seen.pop(trace_id), trace_id, pending.pop(trace_id))
    for trace_id, group in pending.items():  # only if the input changed between the two reads
        yield Trace(first_seen[trace_id], trace_id, group)
