"""The metrics llmspans emits (DESIGN §3), and the two ways they are recorded.

Every histogram and counter is described once here (`InstrumentSpec`). The call record, stages
and turns hand their values to a `Recorder`, a call's dozen values in one `add`:

- `_aggregation.Aggregation`, when `configure()` built the metrics pipeline: llmspans aggregates
  them itself, at about a microsecond a value;
- `SdkRecorder`, on a MeterProvider the application set up itself (or a test's): the values go
  through the SDK's instruments, with the call's own span as the exemplars' context.

Both export the same names, attributes, boundaries, counts, sums and exemplars. The gauges (budgets,
limiters, vLLM) are the SDK's observable gauges on either path: `register_gauges`.

Attribute sets are built once per kind of call or stage (`Labels`) and reused: recording does no
dictionary building.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.util.types import AttributeValue

from llmspans import _budget, _limiter
from llmspans import _names as names

HISTOGRAM = "histogram"
COUNTER = "counter"

LATENCY_BOUNDARIES: tuple[float, ...] = tuple(float(f"{0.01 * 2 ** (k / 4):.4g}") for k in range(-24, 53))
"""The boundaries of llmspans' own histograms in seconds (`llmspans.bucket.duration`, `llmspans.stage.duration`,
`llmspans.cache.saved_estimate`): a quarter of a doubling apart (each bucket 19 % wider than the one below),
0.16 ms to 81.92 s, 77 in all. The conventions' duration boundaries (0.01 s doubling to 81.92 s), which the
`gen_ai.*` histograms keep, are every fourth of them, so a series on either merges with the other exactly on
the conventions' grid. Why this resolution, and what it costs: docs/sampling.md."""


@dataclass(frozen=True)
class InstrumentSpec:
    """One histogram or counter: its name, unit and boundaries, and its place in `INSTRUMENTS`."""

    index: int
    name: str
    unit: str
    description: str
    kind: str
    boundaries: tuple[float, ...] = ()
    integer: bool = False  # token counts and counters are whole numbers


OPERATION_DURATION = InstrumentSpec(
    0, names.METRIC_OPERATION_DURATION, "s", "GenAI operation duration.", HISTOGRAM, names.DURATION_BOUNDARIES
)
TOKEN_USAGE = InstrumentSpec(
    1, names.METRIC_TOKEN_USAGE, "{token}", "Number of input and output tokens used.", HISTOGRAM,
    names.TOKEN_BOUNDARIES, integer=True,
)  # fmt: skip
TIME_TO_FIRST_CHUNK = InstrumentSpec(
    2, names.METRIC_TIME_TO_FIRST_CHUNK, "s",
    "Time from issuing the request (after any limiter) to the first content chunk of a streamed response.",
    HISTOGRAM, names.DURATION_BOUNDARIES,
)  # fmt: skip
TIME_PER_OUTPUT_CHUNK = InstrumentSpec(
    3, names.METRIC_TIME_PER_OUTPUT_CHUNK, "s",
    "Time between consecutive content chunks of a streamed response, one measurement per chunk after the first.",
    HISTOGRAM, names.DURATION_BOUNDARIES,
)  # fmt: skip
BUCKET_DURATION = InstrumentSpec(
    4, names.METRIC_BUCKET_DURATION, "s", "Time an LLM call spent in each bucket.", HISTOGRAM,
    LATENCY_BOUNDARIES,
)  # fmt: skip
STAGE_DURATION = InstrumentSpec(
    5, names.METRIC_STAGE_DURATION, "s", "Duration of each stage, LLM call and turn.", HISTOGRAM,
    LATENCY_BOUNDARIES,
)  # fmt: skip
BUDGET_EXCEEDED = InstrumentSpec(
    6, names.METRIC_BUDGET_EXCEEDED, "{span}", "Spans that overran their budget.", COUNTER, integer=True
)
RETRY_ATTEMPTS = InstrumentSpec(
    7, names.METRIC_RETRY_ATTEMPTS, "{attempt}", "Failed attempts that were retried.", COUNTER, integer=True
)
CONNECT_NEW = InstrumentSpec(
    8, names.METRIC_CONNECT_NEW, "{connection}", "Connections opened by LLM calls.", COUNTER, integer=True
)
STREAM_OUTPUT_SPEED = InstrumentSpec(
    9, names.METRIC_STREAM_OUTPUT_SPEED, "{token}/s",
    "Output tokens per second while streaming: the tokens after the first over the stream bucket, one "
    "measurement per streamed call that reported its output tokens.",
    HISTOGRAM, names.SPEED_BOUNDARIES,
)  # fmt: skip
# The levers' own (docs/levers.md): recorded only where a prompt cap or a cache lookup is used.
PROMPT_ESTIMATE_RATIO = InstrumentSpec(
    10, names.METRIC_PROMPT_ESTIMATE_RATIO, "1",
    "A capped call's estimated prompt tokens over the input tokens the server reported.",
    HISTOGRAM, names.RATIO_BOUNDARIES,
)  # fmt: skip
CACHE_LOOKUPS = InstrumentSpec(
    11, names.METRIC_CACHE_LOOKUPS, "{lookup}", "Cache lookups, hit or miss.", COUNTER, integer=True
)
CACHE_SAVED_ESTIMATE = InstrumentSpec(
    12, names.METRIC_CACHE_SAVED_ESTIMATE, "s",
    "On a cache hit, the LLM call time it saved, estimated as the p50 of this process's recent calls.",
    HISTOGRAM, LATENCY_BOUNDARIES,
)  # fmt: skip
HEDGE_FIRED = InstrumentSpec(
    13, names.METRIC_HEDGE_FIRED, "{call}", "Hedged calls whose backup copy was sent.", COUNTER, integer=True
)
HEDGE_BACKUP_WON = InstrumentSpec(
    14, names.METRIC_HEDGE_BACKUP_WON, "{call}", "Hedged calls the backup copy won.", COUNTER, integer=True
)
HEDGE_WASTED_TOKENS = InstrumentSpec(
    15, names.METRIC_HEDGE_WASTED_TOKENS, "{token}",
    "Tokens of the copy a hedged call threw away: its input, and the output it had received.", COUNTER,
    integer=True,
)  # fmt: skip
SAMPLE_OVERFLOW = InstrumentSpec(
    16, names.METRIC_SAMPLE_OVERFLOW, "{trace}",
    "Traces tail sampling decided before their local root ended, because a memory cap was reached.",
    COUNTER, integer=True,
)  # fmt: skip
INSTRUMENTS: tuple[InstrumentSpec, ...] = (
    OPERATION_DURATION, TOKEN_USAGE, TIME_TO_FIRST_CHUNK, TIME_PER_OUTPUT_CHUNK, BUCKET_DURATION,
    STAGE_DURATION, BUDGET_EXCEEDED, RETRY_ATTEMPTS, CONNECT_NEW, STREAM_OUTPUT_SPEED, PROMPT_ESTIMATE_RATIO,
    CACHE_LOOKUPS, CACHE_SAVED_ESTIMATE, HEDGE_FIRED, HEDGE_BACKUP_WON, HEDGE_WASTED_TOKENS, SAMPLE_OVERFLOW,
)  # fmt: skip
# The per-chunk gaps are counted on these boundaries in nanoseconds while the stream runs.
CHUNK_BOUNDARIES_NS: tuple[int, ...] = tuple(round(bound * 1e9) for bound in TIME_PER_OUTPUT_CHUNK.boundaries)


class Labels:
    """One attribute set, built once and shared: the attributes, and a key our aggregation finds it by.

    The key is a string, so its hash is computed once; the attributes are read-only.
    """

    __slots__ = ("attributes", "key")

    def __init__(self, attributes: Mapping[str, AttributeValue]) -> None:
        self.attributes: Mapping[str, AttributeValue] = MappingProxyType(dict(attributes))
        self.key = "\x1f".join(f"{key}={value!r}" for key, value in sorted(attributes.items()))

    def __repr__(self) -> str:
        return f"Labels({dict(self.attributes)!r})"


class Sample:
    """Where the exemplars of one call, stage or turn come from: its span, at the moment it ended.

    `span` is for the SDK's instruments, which take exemplars from a context; llmspans' own aggregation
    needs only the ids and passes None: an exemplar lives until the next collection, and a span held for
    it would keep its attributes and events alive that long (hundreds of spans, more after a slow spell
    fills more buckets)."""

    __slots__ = ("_context", "span", "span_id", "time_ns", "trace_id")

    def __init__(self, span: trace.Span | None, span_id: int, trace_id: int, time_ns: int) -> None:
        self.span = span
        self.span_id = span_id
        self.trace_id = trace_id
        self.time_ns = time_ns
        self._context: otel_context.Context | None = None

    @property
    def context(self) -> otel_context.Context:
        """A context holding the span: what the SDK's instruments take their exemplar from."""
        if self._context is None:
            span = self.span if self.span is not None else trace.INVALID_SPAN
            self._context = trace.set_span_in_context(span, otel_context.Context())
        return self._context


Record = tuple[InstrumentSpec, float, Labels]


class CallMetrics:
    """The metric series one kind of call records into, in a fixed order, built once per call shape and
    result (`_call.CallShape.result`) and shared by every call of it.

    A call hands its values in the same order, one for each member, so a recorder can resolve each
    series once per kind of call, not once per value (`Recorder.add_call`). An instance is a key by
    identity.
    """

    __slots__ = ("__weakref__", "members")

    def __init__(self, members: Sequence[tuple[InstrumentSpec, Labels]]) -> None:
        self.members = tuple(members)


class Recorder(Protocol):
    """Where llmspans' histogram and counter values go (`_telemetry.recorder()` says which)."""

    trace_based: bool
    """Exemplars come only from sampled spans (so a span that does not record needs no `sample`)."""

    def sample(self, span: trace.Span, time_ns: int) -> Sample | None:
        """The exemplar source for values recorded for `span`, or None when none may be taken."""

    def add(self, records: Sequence[Record], sample: Sample | None) -> None:
        """Record a call's, stage's or turn's values together."""

    def add_call(self, metrics: CallMetrics, values: Sequence[float], sample: Sample | None) -> None:
        """Record one call's values, one per member of `metrics`."""

    def chunk_recorder(self, labels: Labels, sample: Sample | None) -> Callable[[int], None] | None:
        """A per-chunk recorder of gaps (ns) for `time_per_output_chunk`; None: the stream counts them
        itself and hands them over at its end with `add_distribution`."""

    def add_distribution(
        self, spec: InstrumentSpec, labels: Labels, counts: Sequence[int], total: float, low: float, high: float,
        lasts: Sequence[float], sample: Sample | None,
    ) -> None:  # fmt: skip
        """Merge measurements already counted on `spec`'s boundaries (a stream's gaps)."""


_EMPTY_CONTEXT = otel_context.Context()


class SdkRecorder:
    """Records through the SDK instruments of a meter: the application's own MeterProvider path."""

    trace_based = False  # the SDK's exemplar filter decides, from every call's context

    def __init__(self, meter: metrics.Meter) -> None:
        self._instruments: list[Any] = []
        for spec in INSTRUMENTS:
            if spec.kind == COUNTER:
                instrument: Any = meter.create_counter(
                    spec.name, unit=spec.unit, description=spec.description
                )
            else:
                instrument = meter.create_histogram(
                    spec.name, unit=spec.unit, description=spec.description,
                    explicit_bucket_boundaries_advisory=spec.boundaries,
                )  # fmt: skip
            self._instruments.append(instrument.add if spec.kind == COUNTER else instrument.record)
        register_gauges(meter)

    def sample(self, span: trace.Span, time_ns: int) -> Sample | None:
        span_context = span.get_span_context()
        if not span_context.is_valid:
            return None
        return Sample(span, span_context.span_id, span_context.trace_id, time_ns)  # the SDK's filter decides

    def add(self, records: Sequence[Record], sample: Sample | None) -> None:
        context = sample.context if sample is not None else _EMPTY_CONTEXT
        instruments = self._instruments
        for spec, value, labels in records:
            instruments[spec.index](value, labels.attributes, context=context)

    def add_call(self, metrics: CallMetrics, values: Sequence[float], sample: Sample | None) -> None:
        context = sample.context if sample is not None else _EMPTY_CONTEXT
        instruments = self._instruments
        for (spec, labels), value in zip(metrics.members, values, strict=True):
            instruments[spec.index](value, labels.attributes, context=context)

    def chunk_recorder(self, labels: Labels, sample: Sample | None) -> Callable[[int], None] | None:
        record = self._instruments[TIME_PER_OUTPUT_CHUNK.index]
        attributes = labels.attributes
        context = sample.context if sample is not None else _EMPTY_CONTEXT

        def gap(gap_ns: int) -> None:
            record(gap_ns / 1e9, attributes, context=context)

        return gap

    def add_distribution(
        self, spec: InstrumentSpec, labels: Labels, counts: Sequence[int], total: float, low: float, high: float,
        lasts: Sequence[float], sample: Sample | None,
    ) -> None:  # fmt: skip
        raise TypeError("the SDK path records each chunk as it comes (chunk_recorder)")


# --- gauges ------------------------------------------------------------------------------------


def _observe_budgets(_options: CallbackOptions) -> Iterable[Observation]:
    return [
        Observation(seconds, {names.STAGE: stage}) for stage, seconds in _budget.registry.current().items()
    ]


def _limiter_gauge(field: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
    """A gauge callback reading one field of every live limiter, labelled by its lane."""

    def observe(_options: CallbackOptions) -> Iterable[Observation]:
        return [
            Observation(getattr(r, field), {names.LIMITER_NAME: r.name}) for r in _limiter.live_readings()
        ]

    return observe


_vllm_readings: Callable[[], Iterable[tuple[Any, Mapping[str, AttributeValue]]]] | None = None


def read_vllm_samplers_with(
    readings: Callable[[], Iterable[tuple[Any, Mapping[str, AttributeValue]]]],
) -> None:
    """`llmspans.vllm`, when imported, hands over how to read its samplers' latest good samples: the gauges
    read them without this lower layer importing it (no sampler can run before something imported it)."""
    global _vllm_readings
    _vllm_readings = readings


def _vllm_gauge(field: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
    """A gauge callback reading one field of every running vLLM sampler's latest good sample."""

    def observe(_options: CallbackOptions) -> Iterable[Observation]:
        readings = _vllm_readings  # the metric reader's thread runs this
        if readings is None:
            return []
        return [Observation(value, attributes) for sample, attributes in readings()
                if (value := getattr(sample, field)) is not None]  # fmt: skip

    return observe


# The observable gauges: name, callback, unit, description (the SDK reads them at each collection).
_GAUGES: tuple[tuple[str, Callable[[CallbackOptions], Iterable[Observation]], str, str], ...] = (
    (
        names.METRIC_STAGE_BUDGET,
        _observe_budgets,
        "s",
        "The configured budget per stage, so dashboards can draw the line.",
    ),
    (
        names.METRIC_LIMITER_IN_FLIGHT,
        _limiter_gauge("in_flight"),
        "{call}",
        "Calls admitted and running per limiter (lane).",
    ),
    (
        names.METRIC_LIMITER_QUEUE_DEPTH,
        _limiter_gauge("queue_depth"),
        "{call}",
        "Calls waiting for admission per limiter (lane).",
    ),
    (
        names.METRIC_LIMITER_CAP,
        _limiter_gauge("cap"),
        "{call}",
        "The configured concurrency cap per limiter (lane).",
    ),
    (
        names.METRIC_VLLM_NUM_REQUESTS_WAITING,
        _vllm_gauge("num_requests_waiting"),
        "{request}",
        "Requests waiting in the vLLM server's queue, as last sampled from its /metrics.",
    ),
    (
        names.METRIC_VLLM_NUM_REQUESTS_RUNNING,
        _vllm_gauge("num_requests_running"),
        "{request}",
        "Requests in the vLLM server's running batch, as last sampled from its /metrics.",
    ),
    (
        names.METRIC_VLLM_KV_CACHE_USAGE,
        _vllm_gauge("kv_cache_usage"),
        "1",
        "The vLLM server's KV-cache usage (1 means full), as last sampled from its /metrics.",
    ),
    (
        names.METRIC_VLLM_PREEMPTION_RATE,
        _vllm_gauge("preemption_rate"),
        "{preemption}/s",
        "Preemptions per second in the vLLM server between its last two samples.",
    ),
    (
        names.METRIC_VLLM_PREFIX_CACHE_HIT_RATIO,
        _vllm_gauge("prefix_cache_hit_ratio"),
        "1",
        "The share of prompt tokens vLLM found in its prefix cache between its last two samples.",
    ),
    (
        names.METRIC_VLLM_NUM_REQUESTS_WAITING_FOR_CAPACITY,
        _vllm_gauge("num_requests_waiting_for_capacity"),
        "{request}",
        "Requests waiting in the vLLM server's queue for room in its batch or KV cache.",
    ),
    (
        names.METRIC_VLLM_NUM_REQUESTS_WAITING_DEFERRED,
        _vllm_gauge("num_requests_waiting_deferred"),
        "{request}",
        "Requests the vLLM server's scheduler deferred (a transient constraint, not capacity).",
    ),
    (
        names.METRIC_VLLM_ADMISSION_REJECTION_RATE,
        _vllm_gauge("admission_rejection_rate"),
        "{rejection}/s",
        "Requests per second the vLLM server rejected at admission.",
    ),
)


def register_gauges(meter: metrics.Meter) -> None:
    """The observable gauges, read by the SDK at each collection (whichever path records the rest)."""
    for name, callback, unit, description in _GAUGES:
        meter.create_observable_gauge(name, callbacks=[callback], unit=unit, description=description)
