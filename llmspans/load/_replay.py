"""The recorded LLM calls a replay sends again: read from the report's sources, bounded, with their structure.

The spans come from the report's own sources (`llmspans.report._sources`: a traces file, Tempo, Jaeger)
and whole traces from its `_traces.py`, so a replay reads exactly what `llmspans report` reads. Only the
attributes that say a call's shape are read (`_spans.REPLAY_ATTRIBUTES`), never its content.

Kept per call: when it started and ended, its endpoint, stream or not, its token counts, its turn (the
nearest `turn` span above it, else its trace), the call of that turn it waited for and the gap after it,
and what says it shared a prompt prefix without content: the server's cached-token count
(`gen_ai.usage.cache_read.input_tokens`), the conversation id. Bounded: the `limit` earliest calls (a heap,
whatever the file's size), then those within `window_s` of the first. docs/load-replay.md says how each
fact is used.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from llmspans import _names as names
from llmspans.report._sources import SpanSource
from llmspans.report._spans import Span
from llmspans.report._traces import LateSpan, Trace, exact_traces, optimistic_traces

DEFAULT_LIMIT = 10_000
ENDPOINT_OF_OPERATION = {names.OPERATION_CHAT: "chat", names.OPERATION_TEXT_COMPLETION: "completions"}


class NoCalls(Exception):
    """The source holds no LLM call to replay (one line saying where it looked)."""


@dataclass(frozen=True)
class RecordedCall:
    """One recorded LLM call, as the replay needs it; `number` is its place by recorded start (0 first)."""

    number: int
    trace_id: str
    span_id: str
    start_ns: int  # unix ns, as recorded
    end_ns: int
    offset_ns: int  # from the window's start (the first call's start)
    endpoint: str | None  # chat or completions; None when the span does not say
    operation: str | None
    stream: bool
    input_tokens: int | None
    output_tokens: int | None
    cached_tokens: int | None  # the recorded server's prefix-cache hit, when it reported one
    chunks: int | None  # content chunks of a streamed call
    max_tokens: int | None
    conversation: str | None
    turn: str  # the calls of one user interaction share it
    after: int | None  # the number of the call of its turn it waited for; None: it waited for none
    gap_ns: int  # from that call's end to this one's start
    failed: bool
    retries: int
    limiter: str | None  # the app's client limiter (its name and cap), which the replay does not re-create
    limiter_cap: int | None
    buckets_ns: tuple[int, ...]
    duration_ns: int
    weight: float  # how many calls it stands for (tail sampling); 1 otherwise
    service: str


@dataclass
class Recording:
    """The calls to replay, in recorded order, and what was left out of them."""

    source: str  # what `llmspans.load.replay.source` says: the file, `tempo URL` or `jaeger URL`
    described: str  # the source as the report names it
    calls: list[RecordedCall]
    service: str | None
    found: int = 0  # LLM calls of the service in the source
    cut_by_limit: int = 0
    cut_by_window: int = 0
    window_s: float | None = None
    limit: int = DEFAULT_LIMIT
    embeddings: int = 0  # embeddings calls: not a generation, not replayed

    @property
    def span_ns(self) -> int:
        """From the first call's start to the last one's (the schedule's length at speed 1)."""
        return self.calls[-1].offset_ns if self.calls else 0


@dataclass(order=True)
class _Held:
    """A heap entry: the latest start on top (negated), so the earliest `limit` calls stay."""

    key: tuple[int, int]
    call: dict[str, Any] = field(compare=False)


def read_recording(
    source: SpanSource, *, label: str, service: str | None, window_s: float | None, limit: int = DEFAULT_LIMIT
) -> Recording:
    """The calls of `source` to replay: `service`'s (every service's when None, which must then be one),
    the `limit` earliest, those within `window_s` of the first. `NoCalls` when there is none;
    ValueError when several services' calls are mixed and none was named."""
    if limit < 1:
        raise ValueError(f"--limit must be 1 or more calls, got {limit}")
    if window_s is not None and not window_s > 0:
        raise ValueError(f"--window must be a positive duration, got {window_s!r}")
    described = source.sources[0] if source.sources else label
    try:
        collected = _collect(optimistic_traces(source.batches()), service, limit)
    except LateSpan:
        collected = _collect(exact_traces(source.batches), service, limit)
    found, services, embeddings, held = collected
    if service is None and len(services) > 1:
        listed = ", ".join(
            f"{name} ({count} call{'s' if count != 1 else ''})" for name, count in sorted(services.items())
        )
        raise ValueError(
            f"{described} holds the LLM calls of several services, {listed}: pass --service NAME"
        )
    if not held:
        where = f" of service {service!r}" if service is not None else ""
        raise NoCalls(f"{described} holds no LLM call span{where} (llmspans.stage=llm) to replay")
    raw = sorted((entry.call for entry in held), key=lambda call: (call["start_ns"], call["span_id"]))
    first = raw[0]["start_ns"]
    cut_by_window = 0
    if window_s is not None:
        kept = [call for call in raw if call["start_ns"] - first <= window_s * 1e9]
        cut_by_window = len(raw) - len(kept)
        raw = kept
    number_of = {(call["trace_id"], call["span_id"]): number for number, call in enumerate(raw)}
    calls = []
    for number, call in enumerate(raw):
        after, gap = call.pop("after"), call.pop("gap_ns")
        before = number_of.get((call["trace_id"], after)) if after is not None else None
        calls.append(
            RecordedCall(
                number=number, offset_ns=call["start_ns"] - first, after=before,
                gap_ns=gap if before is not None else 0, **call,
            )
        )  # fmt: skip
    return Recording(
        source=label, described=described, calls=calls, service=service or next(iter(services), None),
        found=found, cut_by_limit=max(0, found - len(held)), cut_by_window=cut_by_window, window_s=window_s,
        limit=limit, embeddings=embeddings,
    )  # fmt: skip


def _collect(
    traces: Iterable[Trace], service: str | None, limit: int
) -> tuple[int, dict[str, int], int, list[_Held]]:
    """(calls found, calls per service, embeddings calls, the `limit` earliest calls) of whole traces."""
    found = embeddings = 0
    services: dict[str, int] = {}
    held: list[_Held] = []
    for trace in traces:
        for call in _calls_of(trace, service):
            if call["operation"] == names.OPERATION_EMBEDDINGS:
                embeddings += 1
                continue
            found += 1
            services[call["service"]] = services.get(call["service"], 0) + 1
            entry = _Held((-call["start_ns"], -found), call)
            if len(held) < limit:
                heapq.heappush(held, entry)
            elif entry > held[0]:  # earlier than the latest held one
                heapq.heapreplace(held, entry)
    return found, services, embeddings, held


def _calls_of(trace: Trace, service: str | None) -> Iterator[dict[str, Any]]:
    """The trace's LLM calls (of `service`), each with its turn and the call of that turn it waited for."""
    calls = [span for span in trace.marked if span.stage == names.STAGE_LLM]
    if service is not None:
        calls = [span for span in calls if span.service == service]
    if not calls:
        return
    weight = trace.weight
    turns: dict[str, list[Span]] = {}
    for span in calls:
        turns.setdefault(_turn_of(trace, span), []).append(span)
    for turn, spans in turns.items():
        spans.sort(key=lambda span: (span.start_ns, span.span_id))
        for index, span in enumerate(spans):
            # The call it waited for: of the earlier calls of its turn, the last to end before it started.
            ended = [other for other in spans[:index] if other.end_ns <= span.start_ns]
            before = max(ended, key=lambda other: other.end_ns) if ended else None
            yield _facts(span, turn, weight, before)


def _turn_of(trace: Trace, span: Span) -> str:
    """The nearest `turn` span above the call, else the trace: one user interaction."""
    seen = 0
    parent_id = span.parent_id
    while parent_id is not None and seen < 256:
        parent = trace.by_id.get(parent_id)
        if parent is None:
            break
        if parent.stage == names.STAGE_TURN:
            return f"{trace.trace_id}/{parent.span_id}"
        parent_id = parent.parent_id
        seen += 1
    return trace.trace_id


def _count(value: Any) -> int | None:
    return value if type(value) is int and value >= 0 else None


def _facts(span: Span, turn: str, weight: float, before: Span | None) -> dict[str, Any]:
    attributes = span.attributes
    operation = attributes.get(names.GEN_AI_OPERATION_NAME)
    operation = operation if isinstance(operation, str) else None
    conversation = attributes.get(names.GEN_AI_CONVERSATION_ID)
    limiter = attributes.get(names.LIMITER_NAME)
    return {
        "trace_id": span.trace_id,
        "span_id": span.span_id,
        "start_ns": span.start_ns,
        "end_ns": span.end_ns,
        "endpoint": ENDPOINT_OF_OPERATION.get(operation) if operation is not None else None,
        "operation": operation,
        "stream": attributes.get(names.GEN_AI_REQUEST_STREAM) is True,
        "input_tokens": _count(attributes.get(names.GEN_AI_USAGE_INPUT_TOKENS)),
        "output_tokens": _count(attributes.get(names.GEN_AI_USAGE_OUTPUT_TOKENS)),
        "cached_tokens": _count(attributes.get(names.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS)),
        "chunks": _count(attributes.get(names.STREAM_CHUNKS)),
        "max_tokens": _count(attributes.get(names.GEN_AI_REQUEST_MAX_TOKENS)),
        "conversation": conversation if isinstance(conversation, str) and conversation else None,
        "turn": turn,
        "after": before.span_id if before is not None else None,
        "gap_ns": span.start_ns - before.end_ns if before is not None else 0,
        "failed": span.error,
        "retries": _count(attributes.get(names.RETRY_COUNT)) or 0,
        "limiter": limiter if isinstance(limiter, str) else None,
        "limiter_cap": _count(attributes.get(names.LIMITER_CAP)),
        "buckets_ns": span.buckets_ns,
        "duration_ns": span.duration_ns,
        "weight": weight,
        "service": span.service,
    }


def recording_lines(recording: Recording) -> list[str]:
    """What the bounds and the source left out, in lines."""
    lines = []
    if recording.cut_by_limit:
        lines.append(
            f"{recording.found} LLM calls found; the replay sends the {recording.limit} earliest (--limit)"
        )
    if recording.cut_by_window:
        lines.append(
            f"{recording.cut_by_window} calls started more than {recording.window_s:g} s after the first: "
            "left out (--window)"
        )
    if recording.embeddings:
        lines.append(f"{recording.embeddings} embeddings calls are not replayed (not a generation)")
    return lines


def shown_calls(calls: Sequence[RecordedCall], most: int = 2) -> str:
    """Which calls, in words: how many, and the first few by their trace ids."""
    ids = ", ".join(f"{call.trace_id[:8]}…" for call in calls[:most])
    more = f" and {len(calls) - most} more" if len(calls) > most else ""
    noun = "call" if len(calls) == 1 else "calls"
    return f"{len(calls)} {noun} (traces {ids}{more})"
