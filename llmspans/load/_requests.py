"""One request's record, filled from the call span an app would get, and the span processor that fills it.

The load tool adds `LevelStamper` to the tracer provider llmspans records into. When a call span starts
inside a request the runner is making (the `CURRENT` context variable names its record), the stamper
writes `llmspans.load.level` and `llmspans.load.run_id` on it; when it ends, the record reads the span's
buckets, token counts, retries, error and first/last-token events, and the stamper keeps every span of
that request's trace for the level's report. The spans go on to the traces file or OTLP exporter as
`configure()` decided, untouched otherwise.

Times on a record are nanoseconds from the call's start (the span's own clock, so they add up with its
buckets), except `scheduled_ns`, `issued_ns` and `chunk_ns`, which are the load tool's
`perf_counter_ns()` stamps: when an open-loop request was due, when the runner called `create()`, and when
each content chunk reached the runner.
"""

from __future__ import annotations

import contextvars
import itertools
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor

from llmspans import _names as names

CURRENT: contextvars.ContextVar[RequestRecord | None] = contextvars.ContextVar(
    "llmspans_load_request", default=None
)
_NUMBERS = (int, float)


@dataclass(eq=False)
class RequestRecord:
    index: int
    level: str
    scheduled_ns: int | None = None  # open loop: when it was due
    issued_ns: int = 0
    done_ns: int = 0
    chunk_ns: list[int] = field(default_factory=list)  # each content chunk's arrival at the runner
    error: str | None = None  # the exception the call raised, by type
    cancelled: bool = False
    observed: bool = False  # llmspans' reader of its body stamps `chunk_ns` (the plain client: `watching`)
    generator: str | None = None  # `--ray`: the generator that sent it (`llmspans.load.generator`)
    # From the call span:
    recorded: bool = False
    stream: bool = False
    duration_ns: int = 0
    buckets_ns: dict[str, int] = field(default_factory=dict)
    first_token_ns: int | None = None  # from the call's start
    last_token_ns: int | None = None
    output_tokens: int | None = None
    input_tokens: int | None = None
    retries: int = 0
    error_type: str | None = None

    # As the plain adapter's `ChunkListener`: each content chunk at the very stamp its call span takes.
    def watching(self) -> None:
        self.observed = True

    def chunk(self, now_ns: int) -> None:
        self.chunk_ns.append(now_ns)

    @property
    def ok(self) -> bool:
        return not self.cancelled and self.error is None and self.error_type is None

    @property
    def start_offset_ns(self) -> int:
        """Open loop: the client's lag behind the schedule, counted into every latency; 0 in a closed loop."""
        if self.scheduled_ns is None:
            return 0
        return max(0, self.issued_ns - self.scheduled_ns)

    @property
    def ttft_ns(self) -> int | None:
        """From the request's start (its scheduled time in an open loop) to the first content chunk."""
        if self.first_token_ns is None:
            return None
        return self.start_offset_ns + self.first_token_ns

    @property
    def e2e_ns(self) -> int | None:
        """From the request's start to the last content chunk (to the response read when not streamed)."""
        if not self.recorded:
            return None
        if self.last_token_ns is not None:
            return self.start_offset_ns + self.last_token_ns
        return self.start_offset_ns + self.duration_ns - self.buckets_ns.get("post", 0)

    @property
    def tokens(self) -> int:
        """Output tokens as the server reported them, else the content chunks that arrived."""
        return self.output_tokens if self.output_tokens is not None else len(self.chunk_ns)

    @property
    def tpot_ns(self) -> float | None:
        """`vllm bench serve`'s TPOT: (e2e - TTFT) / (output tokens - 1), for more than one token."""
        ttft, e2e, tokens = self.ttft_ns, self.e2e_ns, self.tokens
        if ttft is None or e2e is None or tokens < 2:
            return None
        return (e2e - ttft) / (tokens - 1)

    @property
    def itl_ns(self) -> list[int]:
        """The gaps between consecutive content chunks as they reached the runner."""
        stamps = self.chunk_ns
        return [later - earlier for earlier, later in itertools.pairwise(stamps)]

    def read_span(self, span: ReadableSpan) -> None:
        attributes = span.attributes or {}
        start, end = span.start_time or 0, span.end_time or 0
        self.duration_ns = max(0, end - start)
        self.stream = attributes.get(names.GEN_AI_REQUEST_STREAM) is True
        self.buckets_ns = {
            bucket: _ns(attributes.get(attribute))
            for bucket, attribute in zip(names.BUCKETS, names.BUCKET_ATTRIBUTES, strict=True)
        }
        for event in span.events:
            if event.name == names.EVENT_FIRST_TOKEN:
                self.first_token_ns = max(0, event.timestamp - start)
            elif event.name == names.EVENT_LAST_TOKEN:
                self.last_token_ns = max(0, event.timestamp - start)
        self.output_tokens = _count(attributes.get(names.GEN_AI_USAGE_OUTPUT_TOKENS))
        self.input_tokens = _count(attributes.get(names.GEN_AI_USAGE_INPUT_TOKENS))
        self.retries = _count(attributes.get(names.RETRY_COUNT)) or 0
        error = attributes.get(names.ERROR_TYPE)
        self.error_type = str(error) if error is not None else None
        self.recorded = True


def _ns(value: Any) -> int:
    return max(0, round(value * 1e9)) if type(value) in _NUMBERS else 0


def _count(value: Any) -> int | None:
    return value if type(value) is int and value >= 0 else None


class LevelStamper(SpanProcessor):
    """Stamps the load's level and run on each call span the runner makes, and reads it back at its end.

    Never raises into the call: a failure leaves that request unrecorded (counted, never hidden).
    """

    def __init__(self, run_id: str, stamps: Callable[[int], Mapping[str, str] | None] | None = None) -> None:
        self.run_id = run_id
        self.generator: str | None = None  # `--ray`: this generator's `llmspans.load.generator`, stamped too
        self.stamps = stamps  # request index -> more attributes for its call span (a replay's recorded ids)
        self.active = True
        self._records: dict[int, RequestRecord] = {}  # by call span id
        self._levels: dict[int, str] = {}  # by trace id: the level of the request that trace is
        self._spans: dict[str, list[ReadableSpan]] = {}
        self._lock = threading.Lock()
        self.failures = 0

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        try:
            record = CURRENT.get()
            if (
                record is None
                or not self.active
                or (span.attributes or {}).get(names.STAGE) != names.STAGE_LLM
            ):
                return
            span.set_attributes({names.LOAD_LEVEL: record.level, names.LOAD_RUN_ID: self.run_id})
            if self.generator is not None:
                span.set_attribute(names.LOAD_GENERATOR, self.generator)
                record.generator = self.generator
            more = self.stamps(record.index) if self.stamps is not None else None
            if more:
                span.set_attributes(more)
            context = span.get_span_context()
            with self._lock:
                self._records[context.span_id] = record
                self._levels[context.trace_id] = record.level
        except Exception:
            self.failures += 1

    def on_end(self, span: ReadableSpan) -> None:
        try:
            context = span.get_span_context()
            if context is None:
                return
            with self._lock:
                level = self._levels.get(context.trace_id)
                record = self._records.pop(context.span_id, None)
                if level is not None:
                    self._spans.setdefault(level, []).append(span)
            if record is not None:
                record.read_span(span)
        except Exception:
            self.failures += 1

    def take(self, level: str) -> Sequence[ReadableSpan]:
        """Every ended span of the level's requests' traces (call, attempt and phase spans), forgotten here."""
        with self._lock:
            return self._spans.pop(level, [])

    def shutdown(self) -> None:
        self.active = False

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
