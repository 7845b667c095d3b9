"""What a report says, as plain frozen data: the figures every source fills and every renderer reads.

Seconds here are computed from integer nanoseconds (`ns / 1e9`), so they carry no float noise.
The method behind each figure is in docs/report.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

QUANTILES = (0.5, 0.95, 0.99)
QUANTILE_METHOD = "nearest-rank: the q-quantile of n values is the value at rank ceil(q*n)"
KIND_STAGE = "stage"
KIND_BUCKET = "bucket"
KIND_OTHER = "other"
KIND_LEVEL = "level"  # a load level's calls (`llmspans load`), in comparisons
UNMARKED = "unmarked"
FINDING_QUEUE = "queue"
FINDING_STALLED = "stalled_scheduler"
NS = 1_000_000_000


def seconds_of(nanoseconds: int) -> float:
    """Integer nanoseconds as seconds without float noise (one correctly rounded division)."""
    return nanoseconds / NS


def nanoseconds_of(seconds: float) -> int:
    """Seconds read from an attribute, to the nanosecond (what the SDK's clock resolves)."""
    return round(seconds * NS)


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile of ascending values (0 for none)."""
    if not sorted_values:
        return 0.0
    return sorted_values[rank(len(sorted_values), q) - 1]


def rank(count: int, q: float) -> int:
    """The 1-based nearest rank of the q-quantile among `count` values."""
    return min(max(1, math.ceil(q * count - 1e-9)), count)


@dataclass(frozen=True)
class Bound:
    """A quantile read from a histogram that fell in a bucket wider than the figure itself (every
    quantile in the first bucket, which starts at 0): interpolating inside it would invent a figure,
    so the quantile is only known to lie between `lower` and `upper` (the value reported is `upper`)."""

    quantile: str  # "p50", "p95" or "p99"
    lower: float
    upper: float

    @property
    def first_bucket(self) -> bool:
        return self.lower <= 0


@dataclass(frozen=True)
class Interval:
    """Where an estimated quantile lies: between `low` and `high`, as far as the evidence says. From a
    histogram, the bucket that holds the quantile's rank (narrowed by the recorded min and max); from
    sampled traces, the values at the ranks the effective sample size allows (`_estimates.py`)."""

    quantile: str  # "p50", "p95" or "p99"
    low: float
    high: float
    # A histogram bucket's lower boundary is not in it (a value on a boundary counts in the bucket below):
    # the quantile is then above `low`, not at it.
    open_low: bool = False


@dataclass(frozen=True)
class Distribution:
    count: int
    p50: float
    p95: float
    p99: float
    max: float | None  # None where the source cannot know it (Prometheus histograms)
    bounds: tuple[Bound, ...] = ()  # from histograms: the quantiles that are only bounds (see `Bound`)
    intervals: tuple[Interval, ...] = ()  # estimated quantiles: where each lies (see `Interval`)

    @classmethod
    def of(cls, values: Iterable[float]) -> Distribution:
        ordered = sorted(values)
        return cls.of_sorted(ordered)

    @classmethod
    def of_sorted(cls, ordered: Sequence[float]) -> Distribution:
        return cls(
            len(ordered),
            quantile(ordered, 0.5),
            quantile(ordered, 0.95),
            quantile(ordered, 0.99),
            ordered[-1] if ordered else 0.0,
        )

    @classmethod
    def of_nanoseconds(cls, values: Iterable[int]) -> Distribution:
        return cls.of_sorted([value / NS for value in sorted(values)])  # seconds_of, inlined

    def at(self, q: float) -> float:
        return {0.5: self.p50, 0.95: self.p95, 0.99: self.p99}[q]

    def interval(self, quantile: str) -> Interval | None:
        """Where an estimated quantile (`"p95"`) lies; None when it is a figure of every value."""
        for interval in self.intervals:
            if interval.quantile == quantile:
                return interval
        return None

    def bound(self, quantile: str) -> Bound | None:
        """The bucket a quantile (`"p95"`) is only bounded by, None when it is a figure."""
        for bound in self.bounds:
            if bound.quantile == quantile:
                return bound
        return None

    @property
    def spread(self) -> float | None:
        """p95 over p50: how much the tail stretches; None when p50 is 0."""
        return self.p95 / self.p50 if self.p50 > 0 else None


@dataclass(frozen=True)
class StageRow:
    """One stage's spans: durations against the budget they carried (or the one given)."""

    stage: str
    durations: Distribution
    budget: float | None
    budget_varies: bool
    budgeted: int
    exceeded: int
    errors: int


@dataclass(frozen=True)
class BucketRow:
    bucket: str
    values: Distribution
    share_p95: float  # this bucket's p95 over the sum of the buckets' p95s


@dataclass(frozen=True)
class Part:
    """One part of a request's time (an app stage's own time, an LLM bucket, unmarked time)."""

    kind: str
    name: str
    per_trace: Distribution

    @property
    def label(self) -> str:
        return part_label(self.kind, self.name)


def part_label(kind: str, name: str) -> str:
    if kind == KIND_BUCKET:
        return f"{name} (llm bucket)"
    if kind == KIND_OTHER:
        return "unmarked time in turns"
    return f"{name} (stage)"


@dataclass(frozen=True)
class Estimate:
    """A part's p95 as the triage compared it, and the interval it lies in (`low == high` for a figure of
    every value)."""

    kind: str
    name: str
    p95: float
    low: float
    high: float

    @property
    def label(self) -> str:
        return part_label(self.kind, self.name)


FINDING_CANNOT_TELL = "cannot_tell"


@dataclass(frozen=True)
class Triage:
    """The dominant part and what to do about it. `told` is False when the largest part at p95 does not
    stand apart from the runner-up beyond their intervals (estimates from sampled traces or histogram
    buckets): the finding is then `cannot_tell`, the message says so and what would tell, and `dominant`
    is only the larger estimate; `compared` holds the two estimates whenever either had an interval."""

    dominant_kind: str
    dominant: str
    dominant_p95: float
    finding: str
    within_budget: bool | None
    message: str
    notes: tuple[str, ...]
    told: bool = True
    compared: tuple[Estimate, ...] = ()


OVER_STREAMED = "streamed calls"
OVER_ALL = "all calls (the metrics do not tell streamed calls apart)"


@dataclass(frozen=True)
class Variability:
    """first_token's spread against stream's, over the calls `over` says (`calls` of them where known):
    the streamed calls on the span path, since a call that did not stream has its whole answer in
    first_token and no stream."""

    first_token_spread: float | None
    stream_spread: float | None
    ratio: float | None  # first_token spread over stream spread
    calls: int | None = None
    over: str = OVER_ALL


@dataclass(frozen=True)
class Churn:
    """New connections opened by one kind of call (streamed, or not), per successful call of that kind."""

    calls: int
    successful: int
    new_connections: int
    per_success: float | None


@dataclass(frozen=True)
class Connections:
    calls: int
    successful: int
    new_connections: int
    per_success: float | None
    reused_final: int | None  # None where the source does not record it (Prometheus)
    # By the kind of call that opened them; None where the source does not tell (Prometheus).
    streamed: Churn | None = None
    not_streamed: Churn | None = None
    # Streamed calls whose response was closed before its body's end (the openai SDK's streamed path):
    # each leaves the pool without its connection over HTTP/1.1. None where not recorded (Prometheus).
    closed_before_end: int | None = None


@dataclass(frozen=True)
class Retries:
    calls: int
    successful: int
    failed: int
    attempts: int
    attempts_per_success: float | None
    retried_calls: int | None  # None where the source does not record it (Prometheus)
    causes: dict[str, int]
    wasted_output_tokens: int | None
    error_types: dict[str, int]


@dataclass(frozen=True)
class LimiterRow:
    name: str
    process: str
    cap: int
    calls: int | None  # None from Prometheus (no metric counts calls per limiter)
    window_s: float
    backlog_s: float
    gap_s: float
    gap_fraction: float
    mean_queue_depth: float
    max_queue_depth: int
    mean_in_flight: float
    queue_depth_on_entry: Distribution | None  # None from Prometheus (the gauges are sampled, not per call)


CALLS_ALL = "all"
CALLS_STREAMED = "streamed"
CALLS_NOT_STREAMED = "not_streamed"


@dataclass(frozen=True)
class SplitRow:
    """One labelled row of the server split: a part of `bucket` (`first_token` or `stream`) over the calls
    `calls` names (`all`, `streamed`, `not_streamed`); `part` is `client` for the bucket itself."""

    bucket: str
    part: str
    label: str
    calls: str
    values: Distribution
    derived: bool


@dataclass(frozen=True)
class ServerSplit:
    """vLLM's view of the calls whose traces hold its `llm_request` span (see `_server.py`).

    `rows` is the split as printed, every part labelled: first_token (client) into server queue, prefill,
    the server's front end, the server's decode (calls that did not stream: their whole answer is in
    first_token) and network and client; a streamed call's stream into the server's decode and network
    and client. The flat fields are the same figures as before the rows existed: `first_token`,
    `server_queue`, `prefill`, `server_front_end` and `network_and_client` over all calls
    (`network_other` is first_token less queue and prefill: front end, network and client, and the
    decode of calls that did not stream), `stream`, `server_decode` and `stream_network_and_client` over
    the streamed ones. `engines` says which of vLLM's engines made the spans (`newer`: 0.11 and later;
    `older`: 0.8.5 to 0.10.x with tracing) and `notes` what was derived rather than read.
    """

    calls: int
    first_token: Distribution
    server_queue: Distribution
    prefill: Distribution
    network_other: Distribution
    server_front_end: Distribution | None = None
    network_and_client: Distribution | None = None
    streamed_calls: int = 0
    stream: Distribution | None = None
    server_decode: Distribution | None = None
    stream_network_and_client: Distribution | None = None
    engines: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    rows: tuple[SplitRow, ...] = ()


@dataclass(frozen=True)
class ServerPressure:
    """vLLM's pressure signals as stamped on the call spans (see `_pressure.py`): the KV cache's peak, and
    the earlier and later half's mean of the preemption rate, waiting requests and prefix-cache hits."""

    calls: int
    kv_cache_usage_max: float | None
    preemption_rate_before: float | None
    preemption_rate_after: float | None
    waiting_before: float | None
    waiting_after: float | None
    prefix_cache_hit_ratio_before: float | None
    prefix_cache_hit_ratio_after: float | None


@dataclass(frozen=True)
class ServerHistograms:
    """vLLM's own histograms over the window, per model (Prometheus source): the server-side view of
    queue, prefill, time to first token and time between tokens when no server spans are traced.
    `inter_token_metric` names the series read (`vllm:inter_token_latency_seconds` from 0.11, else
    `vllm:time_per_output_token_seconds`)."""

    model: str
    queue: Distribution | None
    prefill: Distribution | None
    time_to_first_token: Distribution | None
    inter_token: Distribution | None
    inter_token_metric: str | None


@dataclass(frozen=True)
class ServerGauges:
    """vLLM's load as llmspans' sampler exported it (Prometheus source): max and mean over the window."""

    server: str
    waiting_max: float | None
    waiting_mean: float | None
    running_max: float | None
    running_mean: float | None
    kv_cache_usage_max: float | None


@dataclass(frozen=True)
class WaterfallRow:
    name: str
    stage: str | None
    depth: int
    offset_s: float
    duration_s: float
    buckets: dict[str, float]  # LLM call spans only, in bucket order
    error: bool


@dataclass(frozen=True)
class SlowTrace:
    trace_id: str
    root: str
    duration_s: float
    dominant_kind: str
    dominant: str
    dominant_s: float
    start_ns: int
    rows: tuple[WaterfallRow, ...]


@dataclass(frozen=True)
class Exemplar:
    """A trace a histogram's exemplar points to (Prometheus source): where to look instead of a slowest list."""

    series: str
    value_s: float
    trace_id: str
    link: str | None


@dataclass(frozen=True)
class LevelRow:
    """The calls `llmspans load` made at one level (`llmspans.load.level`) of one run: their durations,
    each bucket's p95, and the bucket largest at p95. `label` is the level, with the run when the input
    holds several runs."""

    label: str
    run_id: str
    level: str
    calls: int
    failed: int
    durations: Distribution
    buckets_p95: dict[str, float]
    dominant: str


@dataclass(frozen=True)
class PromptCaps:
    """The calls of clients with a prompt cap (`max_prompt_tokens`): how many were over it and how many it
    refused (`on_exceed="error"`); the first_token of the calls sent over the cap and answered, against
    those under it (the prefill cost of long prompts); the estimate over the server's input tokens."""

    calls: int
    over: int
    refused: int
    first_token_over: Distribution | None
    first_token_under: Distribution | None
    estimate_ratio: Distribution | None  # a ratio, not seconds; calls whose server reported input tokens
    estimators: tuple[str, ...]

    @property
    def share_over(self) -> float:
        return self.over / self.calls if self.calls else 0.0


@dataclass(frozen=True)
class CacheRow:
    """One cache's lookups: hits, the LLM time the hits saved (the sum of their estimates, each the p50 of
    the process's own recent calls), the lookups' own time, and the requests (the turn holding the lookup,
    else its trace) that had a hit against those that had only misses."""

    name: str
    lookups: int
    hits: int
    errors: int
    saved_s: float
    hits_estimated: int
    lookup: Distribution | None  # None from Prometheus (one histogram for every cache's lookups)
    with_hit: Distribution | None  # None from Prometheus (metrics do not join lookups to requests)
    with_miss: Distribution | None

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


@dataclass(frozen=True)
class Hedging:
    """The calls of hedged clients that could be sent twice (`instrument(client, hedge=...)`): on how many the
    backup was sent and won, the first_token of those hedged, their primaries' own time to a first token, and
    the input and output tokens the losing copies cost. A primary the backup beat was stopped before its
    first token: its own time is unknown, and what is known is how long it had waited without one."""

    calls: int
    fired: int
    backup_won: int
    skipped: int  # the backup came due, but the limiter had no free slot
    after: Distribution | None  # the `after` the calls went by (None while a percentile had too few calls)
    first_token: Distribution | None  # the first_token bucket of the calls whose backup was sent
    primaries_first: Distribution | None  # of those, the primaries that got there first: their own time
    primaries_cut: Distribution | None  # and those the backup beat: how long they had waited when stopped
    input_tokens: int  # of every call counted here that reported its input tokens
    wasted_input_tokens: int
    wasted_output_tokens: int

    @property
    def share_fired(self) -> float:
        return self.fired / self.calls if self.calls else 0.0

    @property
    def share_won(self) -> float:
        """The calls the backup won, of all the calls counted (as "fired on 8 % and won 6 %" reads)."""
        return self.backup_won / self.calls if self.calls else 0.0

    @property
    def extra_input(self) -> float | None:
        """The wasted input tokens over the input tokens the calls needed; None when none reported any."""
        return self.wasted_input_tokens / self.input_tokens if self.input_tokens else None


@dataclass(frozen=True)
class Report:
    sources: tuple[str, ...]
    skipped: tuple[SkippedLine, ...]
    spans: int
    traces: int
    llm_calls: int
    quantile_method: str
    stages: tuple[StageRow, ...]
    buckets: tuple[BucketRow, ...]
    parts: tuple[Part, ...]
    triage: Triage | None
    variability: Variability
    connections: Connections
    retries: Retries
    limiters: tuple[LimiterRow, ...]
    server: ServerSplit | None
    slowest: tuple[SlowTrace, ...]
    notes: tuple[str, ...] = field(default_factory=tuple)
    # The Prometheus source only: vLLM gauges and exemplar traces (the span source leaves them empty).
    server_gauges: tuple[ServerGauges, ...] = ()
    exemplars: tuple[Exemplar, ...] = ()
    server_pressure: ServerPressure | None = None
    server_histograms: tuple[ServerHistograms, ...] = ()
    levels: tuple[LevelRow, ...] = ()  # calls made by `llmspans load`, per level
    prompt_caps: PromptCaps | None = None  # the levers (docs/levers.md), where the app used them
    caches: tuple[CacheRow, ...] = ()
    hedging: Hedging | None = None
    traces_read: int | None = None  # a weighted (tail-sampled) input: the traces read; `traces` is weighted
    # The sorted samples behind each stage, bucket and part (seconds), for comparisons; not in the JSON.
    samples: dict[tuple[str, str], tuple[float, ...]] = field(default_factory=dict, compare=False, repr=False)

    @property
    def from_histograms(self) -> bool:
        return self.quantile_method != QUANTILE_METHOD

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data (the `--json` document). A distribution lists `bounds` only when it has
        some (quantiles from histograms that are only bounds; see `Bound`)."""
        data = asdict(replace(self, samples={}))
        data.pop("samples")
        if not self.server_gauges and not self.exemplars:
            data.pop("server_gauges")
            data.pop("exemplars")
        if not self.levels:
            data.pop("levels")
        if self.traces_read is None:
            data.pop("traces_read")
        if self.prompt_caps is None:
            data.pop("prompt_caps")
        else:
            data["prompt_caps"]["share_over"] = self.prompt_caps.share_over
        if self.hedging is None:
            data.pop("hedging")
        else:
            hedging = data["hedging"]
            hedging.update(
                share_fired=self.hedging.share_fired, share_won=self.hedging.share_won,
                extra_input=self.hedging.extra_input,
            )  # fmt: skip
        if not self.caches:
            data.pop("caches")
        else:
            for row, cache in zip(data["caches"], self.caches, strict=True):
                row["hit_rate"] = cache.hit_rate
        data["parts"] = [{**asdict(part), "label": part.label} for part in self.parts]
        _drop_empty_bounds(data)
        return data


def _drop_empty_bounds(data: Any) -> None:
    if isinstance(data, dict):
        if "bounds" in data and not data["bounds"] and "p95" in data:
            del data["bounds"]
        if "intervals" in data and not data["intervals"] and "p95" in data:
            del data["intervals"]
        if "compared" in data and not data["compared"] and "told" in data:
            del data["compared"]
        for value in data.values():
            _drop_empty_bounds(value)
    elif isinstance(data, (list, tuple)):
        for value in data:
            _drop_empty_bounds(value)


@dataclass(frozen=True)
class SkippedLine:
    source: str
    line: int
    reason: str


def format_seconds(value: float) -> str:
    """A duration the way the report prints it: `0.4 ms`, `85 ms`, `1.23 s`."""
    if value >= 1:
        return f"{value:.2f} s"
    if value >= 0.01:
        return f"{value * 1e3:.0f} ms"
    return f"{value * 1e3:.1f} ms"


def format_quantile(distribution: Distribution, quantile: str, *, short: bool = False) -> str:
    """A quantile (`"p95"`) as the report prints it: the figure, or for one that is only bounded by its
    histogram bucket `≤ 300 ms (first bucket)` (`≤ 300 ms` in a table cell, `short`)."""
    value = {"p50": distribution.p50, "p95": distribution.p95, "p99": distribution.p99}[quantile]
    bound = distribution.bound(quantile)
    if bound is None:
        return format_seconds(value)
    if short:
        return f"≤ {format_seconds(bound.upper)}"
    if bound.first_bucket:
        return f"≤ {format_seconds(bound.upper)} (first bucket)"
    return f"≤ {format_seconds(bound.upper)} (bucket from {format_seconds(bound.lower)})"
