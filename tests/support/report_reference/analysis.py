"""The report's figures: where the recorded requests' time went, and the triage rule it triggers.

`analyse(spans)` turns the spans of llmspans-instrumented traces into a `Report`: per app
stage and per LLM-call bucket the count, p50, p95, p99 and max against budgets; the
dominant part of a request at p95 and the rule of DESIGN §1 it triggers; time-to-first-token
against stream variability; connection churn; retry amplification; per-limiter gap_fraction
rebuilt from the call spans; the server-side split of first_token when vLLM's
`llm_request` spans joined the traces; the slowest traces.

Method, so the figures can be checked by hand:

- **Quantiles are nearest-rank** everywhere: the q-quantile of n values is the value at
  rank ceil(q·n) in ascending order (so every reported figure is an observed value, and
  p100 is the max). Never means, except where a mean is named as one.
- **Stage and bucket tables are per span**: a stage's row is the distribution of its spans'
  durations, a bucket's row the distribution of that bucket over LLM call spans.
- **The dominant part is per trace**: each trace (one request, one turn) is split into
  parts: each app stage's own time (its spans' durations minus the llmspans spans nested in
  them, so a tool that calls the model is not counted twice), each LLM-call bucket summed
  over the trace's calls, and, inside a turn, the time outside any marked stage. The part
  with the largest p95 across traces dominates.
- **gap_fraction is rebuilt from the call spans** of each limiter (per process and limiter
  name): a call is queued until its `llmspans.admitted` event (from its span's start, or from
  `llmspans.limiter.wait` before admission when the limiter measured the wait itself, so the
  client's own set-up is not a backlog) and in flight from there to its end; the cap is `llmspans.limiter.cap`. gap_fraction is the
  share of the time with a backlog (some call queued) during which fewer calls than the
  cap were in flight. Only LLM calls count as in flight here, so a slot held by work that
  is not a model call reads as idle capacity; `Limiter.stats()` counts any holder.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from llmspans import _names as names
from tests.support.report_reference.input import KIND_SERVER, SkippedLine, Span

QUANTILES = (0.5, 0.95, 0.99)
QUANTILE_METHOD = "nearest-rank: the q-quantile of n values is the value at rank ceil(q*n)"
# A limiter whose backlog time is at least this share in gap reads as a stalled scheduler.
STALL_GAP_FRACTION = 0.25
# ... noted (when queue does not dominate) only if calls waited during this share of its window.
MATERIAL_BACKLOG_SHARE = 0.05
# "Varies much more": first_token's p95/p50 over stream's p95/p50.
VARIES_MORE = 2.0
# A stage is within budget when at most this share of its spans exceeded it (p95 within budget).
WITHIN_BUDGET_SHARE = 0.05
_APP_EXCLUDED = (names.STAGE_LLM, names.STAGE_TURN)
KIND_STAGE = "stage"
KIND_BUCKET = "bucket"
KIND_OTHER = "other"
UNMARKED = "unmarked"

FINDING_QUEUE = "queue"
FINDING_STALLED = "stalled_scheduler"


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile of ascending values (0 for none)."""
    if not sorted_values:
        return 0.0
    rank = max(1, math.ceil(q * len(sorted_values) - 1e-9))
    return sorted_values[min(rank, len(sorted_values)) - 1]


@dataclass(frozen=True)
class Distribution:
    count: int
    p50: float
    p95: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Distribution:
        ordered = sorted(values)
        return cls(
            len(ordered),
            quantile(ordered, 0.5),
            quantile(ordered, 0.95),
            quantile(ordered, 0.99),
            ordered[-1] if ordered else 0.0,
        )

    def at(self, q: float) -> float:
        return {0.5: self.p50, 0.95: self.p95, 0.99: self.p99}[q]

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
class Triage:
    dominant_kind: str
    dominant: str
    dominant_p95: float
    finding: str
    within_budget: bool | None
    message: str
    notes: tuple[str, ...]


@dataclass(frozen=True)
class Variability:
    first_token_spread: float | None
    stream_spread: float | None
    ratio: float | None  # first_token spread over stream spread


@dataclass(frozen=True)
class Connections:
    calls: int
    successful: int
    new_connections: int
    per_success: float | None
    reused_final: int


@dataclass(frozen=True)
class Retries:
    calls: int
    successful: int
    failed: int
    attempts: int
    attempts_per_success: float | None
    retried_calls: int
    causes: dict[str, int]
    wasted_output_tokens: int
    error_types: dict[str, int]


@dataclass(frozen=True)
class LimiterRow:
    name: str
    process: str
    cap: int
    calls: int
    window_s: float
    backlog_s: float
    gap_s: float
    gap_fraction: float
    mean_queue_depth: float
    max_queue_depth: int
    mean_in_flight: float
    queue_depth_on_entry: Distribution


@dataclass(frozen=True)
class ServerSplit:
    """vLLM's view of the calls whose traces hold its `llm_request` span."""

    calls: int
    first_token: Distribution
    server_queue: Distribution
    prefill: Distribution
    network_other: Distribution


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

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data (the `--json` document)."""
        data = asdict(self)
        data["parts"] = [{**asdict(part), "label": part.label} for part in self.parts]
        return data


# --- reading the spans ---------------------------------------------------------------------------


def _number(span: Span, attribute: str) -> float:
    value = span.attributes.get(attribute)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0.0
    return float(value)


def _buckets(span: Span) -> dict[str, float]:
    return {
        bucket: max(0.0, _number(span, attribute))
        for bucket, attribute in zip(names.BUCKETS, names.BUCKET_ATTRIBUTES, strict=True)
    }


def _is_call(span: Span) -> bool:
    return span.stage == names.STAGE_LLM


def _is_server(span: Span) -> bool:
    return (
        span.name == names.VLLM_SERVER_SPAN and span.kind == KIND_SERVER
    ) or names.GEN_AI_LATENCY_TIME_IN_QUEUE in span.attributes


def _call_failed(span: Span) -> bool:
    return span.error or names.ERROR_TYPE in span.attributes


class _Trace:
    """The spans of one trace, with the parent links the analysis walks."""

    def __init__(self, trace_id: str, spans: list[Span]) -> None:
        self.trace_id = trace_id
        self.spans = sorted(spans, key=lambda span: (span.start_ns, -span.end_ns))
        self.by_id = {span.span_id: span for span in spans}
        self.marked = [span for span in self.spans if span.stage is not None]

    def marked_ancestor(self, span: Span) -> Span | None:
        """The nearest ancestor carrying `llmspans.stage` (attempt spans are walked through)."""
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

    def parts(self) -> dict[tuple[str, str], float]:
        """Seconds of this trace per part: app stages' own time, buckets, unmarked turn time."""
        totals: dict[tuple[str, str], float] = {}
        nested: dict[str, float] = {}
        for span in self.marked:
            parent = self.marked_ancestor(span)
            if parent is not None:
                nested[parent.span_id] = nested.get(parent.span_id, 0.0) + span.duration_s
        for span in self.marked:
            stage = span.stage
            if stage == names.STAGE_LLM:
                for bucket, seconds in _buckets(span).items():
                    key = (KIND_BUCKET, bucket)
                    totals[key] = totals.get(key, 0.0) + seconds
            elif stage == names.STAGE_TURN:
                if self.marked_ancestor(span) is None:
                    key = (KIND_OTHER, UNMARKED)
                    own = max(0.0, span.duration_s - nested.get(span.span_id, 0.0))
                    totals[key] = totals.get(key, 0.0) + own
            elif stage is not None:
                key = (KIND_STAGE, stage)
                own = max(0.0, span.duration_s - nested.get(span.span_id, 0.0))
                totals[key] = totals.get(key, 0.0) + own
        return totals

    @property
    def duration_s(self) -> float:
        start = min(span.start_ns for span in self.marked)
        end = max(span.end_ns for span in self.marked)
        return (end - start) / 1e9

    def root(self) -> Span:
        roots = [span for span in self.marked if self.marked_ancestor(span) is None]
        return max(roots or self.marked, key=lambda span: span.duration_s)

    def waterfall(self) -> tuple[WaterfallRow, ...]:
        start = min(span.start_ns for span in self.marked)
        depth: dict[str, int] = {}
        rows = []
        for span in self.marked:
            parent = self.marked_ancestor(span)
            level = depth.get(parent.span_id, -1) + 1 if parent is not None else 0
            depth[span.span_id] = level
            rows.append(
                WaterfallRow(
                    name=span.name,
                    stage=span.stage,
                    depth=level,
                    offset_s=(span.start_ns - start) / 1e9,
                    duration_s=span.duration_s,
                    buckets=_buckets(span) if _is_call(span) else {},
                    error=span.error,
                )
            )
        return tuple(rows)


# --- the figures -------------------------------------------------------------------------------


def _stage_rows(spans: Sequence[Span], overrides: Mapping[str, float]) -> tuple[StageRow, ...]:
    by_stage: dict[str, list[Span]] = {}
    for span in sorted(spans, key=lambda span: span.start_ns):
        if span.stage is not None:
            by_stage.setdefault(span.stage, []).append(span)
    order = [stage for stage in by_stage if stage not in _APP_EXCLUDED]
    order += [stage for stage in _APP_EXCLUDED if stage in by_stage]
    rows = []
    for stage in order:
        stage_spans = by_stage[stage]
        durations = Distribution.of(span.duration_s for span in stage_spans)
        errors = sum(1 for span in stage_spans if span.error)
        if stage in overrides:
            budget = overrides[stage]
            rows.append(
                StageRow(stage, durations, budget, False, len(stage_spans),
                         sum(1 for span in stage_spans if span.duration_s > budget), errors)
            )  # fmt: skip
            continue
        budgets = [_number(span, names.BUDGET) for span in stage_spans if names.BUDGET in span.attributes]
        exceeded = sum(1 for span in stage_spans if _exceeded(span))
        common = Counter(budgets).most_common(1)
        rows.append(
            StageRow(stage, durations, common[0][0] if common else None, len(set(budgets)) > 1,
                     len(budgets), exceeded, errors)
        )  # fmt: skip
    return tuple(rows)


def _exceeded(span: Span) -> bool:
    flag = span.attributes.get(names.BUDGET_EXCEEDED)
    if isinstance(flag, bool):
        return flag
    budget = _number(span, names.BUDGET)
    return budget > 0 and span.duration_s > budget


def _bucket_rows(calls: Sequence[Span]) -> tuple[BucketRow, ...]:
    values = {bucket: Distribution.of(_buckets(call)[bucket] for call in calls) for bucket in names.BUCKETS}
    total = sum(row.p95 for row in values.values())
    return tuple(
        BucketRow(bucket, values[bucket], values[bucket].p95 / total if total > 0 else 0.0)
        for bucket in names.BUCKETS
    )


def _parts(traces: Sequence[_Trace]) -> tuple[tuple[Part, ...], list[dict[tuple[str, str], float]]]:
    per_trace = [trace.parts() for trace in traces]
    keys: list[tuple[str, str]] = []
    for totals in per_trace:
        for key in totals:
            if key not in keys:
                keys.append(key)
    kind_order = {KIND_STAGE: 0, KIND_BUCKET: 1, KIND_OTHER: 2}
    bucket_order = {bucket: index for index, bucket in enumerate(names.BUCKETS)}
    keys.sort(key=lambda key: (kind_order[key[0]], bucket_order.get(key[1], 0)))
    # Every bucket is a part whenever there are calls, so charts always show all six.
    if any(key[0] == KIND_BUCKET for key in keys):
        stages = [key for key in keys if key[0] == KIND_STAGE]
        others = [key for key in keys if key[0] == KIND_OTHER]
        keys = stages + [(KIND_BUCKET, bucket) for bucket in names.BUCKETS] + others
    parts = tuple(
        Part(kind, name, Distribution.of(totals.get((kind, name), 0.0) for totals in per_trace))
        for kind, name in keys
    )
    return parts, per_trace


def _variability(buckets: Sequence[BucketRow]) -> Variability:
    by_name = {row.bucket: row.values for row in buckets}
    first = by_name["first_token"].spread if "first_token" in by_name else None
    stream = by_name["stream"].spread if "stream" in by_name else None
    ratio = first / stream if first is not None and stream is not None and stream > 0 else None
    return Variability(first, stream, ratio)


def _connections(calls: Sequence[Span]) -> Connections:
    successful = sum(1 for call in calls if not _call_failed(call))
    new = sum(int(_number(call, names.CONNECT_NEW)) for call in calls)
    reused = sum(1 for call in calls if call.attributes.get(names.CONNECT_REUSED) is True)
    return Connections(len(calls), successful, new, new / successful if successful else None, reused)


def _retries(calls: Sequence[Span]) -> Retries:
    successful = sum(1 for call in calls if not _call_failed(call))
    causes: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    attempts = wasted = retried = 0
    for call in calls:
        failed_attempts = int(_number(call, names.RETRY_COUNT))
        attempts += failed_attempts + 1
        retried += failed_attempts > 0
        wasted += int(_number(call, names.RETRY_WASTED_OUTPUT_TOKENS))
        listed = call.attributes.get(names.RETRY_CAUSES)
        if isinstance(listed, list):
            causes.update(str(cause) for cause in listed)
        if _call_failed(call):
            errors[str(call.attributes.get(names.ERROR_TYPE, "error"))] += 1
    return Retries(
        calls=len(calls),
        successful=successful,
        failed=len(calls) - successful,
        attempts=attempts,
        attempts_per_success=attempts / successful if successful else None,
        retried_calls=retried,
        causes=dict(causes.most_common()),
        wasted_output_tokens=wasted,
        error_types=dict(errors.most_common()),
    )


def _queued_interval(call: Span) -> tuple[int, int]:
    """When the call waited for its slot: from its start (or, when the limiter measured the wait
    itself, that long before admission) to its `llmspans.admitted` event."""
    admitted = call.start_ns
    for event in call.events:
        if event.name == names.EVENT_ADMITTED:
            admitted = min(max(event.time_ns, call.start_ns), call.end_ns)
            break
    wait = call.attributes.get(names.LIMITER_WAIT)
    if isinstance(wait, (int, float)) and not isinstance(wait, bool):
        return max(call.start_ns, admitted - round(wait * 1e9)), admitted
    return call.start_ns, admitted


def _limiters(calls: Sequence[Span]) -> tuple[LimiterRow, ...]:
    groups: dict[tuple[str, str], list[Span]] = {}
    for call in calls:
        name = call.attributes.get(names.LIMITER_NAME)
        if isinstance(name, str):
            groups.setdefault((call.process, name), []).append(call)
    rows = []
    for (process, name), members in groups.items():
        cap = max(int(_number(call, names.LIMITER_CAP)) for call in members) or 1
        deltas: dict[int, list[int]] = {}  # time -> [queued change, in-flight change]
        for call in members:
            queued_at, admitted = _queued_interval(call)
            for at, queued, running in ((queued_at, 1, 0), (admitted, -1, 1), (call.end_ns, 0, -1)):
                change = deltas.setdefault(at, [0, 0])
                change[0] += queued
                change[1] += running
        queued = running = max_queued = 0
        backlog = gap = queue_area = running_area = 0
        times = sorted(deltas)
        for at, following in zip(times, times[1:] + times[-1:], strict=True):
            queued += deltas[at][0]
            running += deltas[at][1]
            max_queued = max(max_queued, queued)
            span_ns = following - at
            queue_area += queued * span_ns
            running_area += running * span_ns
            if queued > 0:
                backlog += span_ns
                if running < cap:
                    gap += span_ns
        window = times[-1] - times[0] if times else 0
        rows.append(
            LimiterRow(
                name=name,
                process=process,
                cap=cap,
                calls=len(members),
                window_s=window / 1e9,
                backlog_s=backlog / 1e9,
                gap_s=gap / 1e9,
                gap_fraction=gap / backlog if backlog else 0.0,
                mean_queue_depth=queue_area / window if window else 0.0,
                max_queue_depth=max_queued,
                mean_in_flight=running_area / window if window else 0.0,
                queue_depth_on_entry=Distribution.of(
                    _number(call, names.LIMITER_QUEUE_DEPTH) for call in members
                ),
            )
        )
    rows.sort(key=lambda row: -row.backlog_s)
    return tuple(rows)


def _server_split(traces: Sequence[_Trace]) -> ServerSplit | None:
    first, queue, prefill, other = [], [], [], []
    for trace in traces:
        latest: dict[str, Span] = {}
        for span in trace.spans:
            if not _is_server(span):
                continue
            call = trace.marked_ancestor(span)
            if call is None or not _is_call(call):
                continue
            if call.span_id not in latest or span.start_ns > latest[call.span_id].start_ns:
                latest[call.span_id] = span  # the final attempt's server span
        for call_id, server in latest.items():
            first_token = _buckets(trace.by_id[call_id])["first_token"]
            in_queue = _number(server, names.GEN_AI_LATENCY_TIME_IN_QUEUE)
            in_prefill = _number(server, names.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL)
            first.append(first_token)
            queue.append(in_queue)
            prefill.append(in_prefill)
            other.append(max(0.0, first_token - in_queue - in_prefill))
    if not first:
        return None
    return ServerSplit(len(first), Distribution.of(first), Distribution.of(queue), Distribution.of(prefill),
                       Distribution.of(other))  # fmt: skip


def _slowest(
    traces: Sequence[_Trace], per_trace: Sequence[Mapping[tuple[str, str], float]], top: int
) -> tuple[SlowTrace, ...]:
    ranked = sorted(zip(traces, per_trace, strict=True), key=lambda pair: -pair[0].duration_s)[: max(0, top)]
    slow = []
    for trace, totals in ranked:
        (kind, name), seconds = (
            max(totals.items(), key=lambda item: item[1]) if totals else ((KIND_OTHER, UNMARKED), 0.0)
        )
        root = trace.root()
        slow.append(
            SlowTrace(
                trace.trace_id,
                root.name,
                trace.duration_s,
                kind,
                name,
                seconds,
                root.start_ns,
                trace.waterfall(),
            )
        )
    return tuple(slow)


# --- triage ------------------------------------------------------------------------------------


def format_seconds(value: float) -> str:
    """A duration the way the report prints it: `0.4 ms`, `85 ms`, `1.23 s`."""
    if value >= 1:
        return f"{value:.2f} s"
    if value >= 0.01:
        return f"{value * 1e3:.0f} ms"
    return f"{value * 1e3:.1f} ms"


def _causes_text(causes: Mapping[str, int]) -> str:
    return ", ".join(f"{cause} ×{count}" for cause, count in causes.items()) or "none recorded"


def _within_budget(stages: Sequence[StageRow]) -> bool | None:
    """Every budgeted stage's p95 within its budget (with budgets that differ per span: at most 5 %
    of its spans over their own); None when nothing has a budget."""
    budgeted = [row for row in stages if row.budget is not None and row.budgeted]
    if not budgeted:
        return None
    return all(
        row.exceeded <= WITHIN_BUDGET_SHARE * row.budgeted
        if row.budget_varies or row.budgeted < row.durations.count
        else row.durations.p95 <= (row.budget or 0.0)
        for row in budgeted
    )


def _rule(part: Part, figures: _Figures) -> tuple[str, str, str]:
    """The finding, what was seen, and the DESIGN §1 advice for the dominant part."""
    kind, name = part.kind, part.name
    variability, retries, connections = figures.variability, figures.retries, figures.connections
    if kind == KIND_STAGE:
        return name, f"the {name} stage dominates", "move work off the hot path, parallelise tools"
    if kind == KIND_OTHER:
        return (
            UNMARKED,
            "time in the turn outside any marked stage dominates",
            ("mark the slow code with @llmspans.stage(...) to see which part it is"),
        )
    if name == "queue":
        limiter = figures.limiters[0] if figures.limiters else None
        if limiter is None:
            return (
                FINDING_QUEUE,
                "queue dominates",
                (
                    "backlog or cap too low; the calls carry no limiter attributes, so whether in-flight stays at "
                    "the cap while calls wait cannot be checked"
                ),
            )
        where = f"limiter '{limiter.name}', cap {limiter.cap}"
        if limiter.gap_fraction >= STALL_GAP_FRACTION:
            return (
                FINDING_STALLED,
                (
                    f"queue dominates, yet in-flight stayed below the cap while calls waited (gap_fraction "
                    f"{limiter.gap_fraction:.2f}, {where}, mean in-flight {limiter.mean_in_flight:.1f})"
                ),
                (
                    "a stalled scheduler; find what holds slots without calling the model or keeps admission from "
                    "running (work inside `with limiter:` that is not the call, a blocked event loop)"
                ),
            )
        return (
            FINDING_QUEUE,
            "queue dominates",
            (
                f"backlog or cap too low; in-flight stayed at the cap while the queue was non-empty (gap_fraction "
                f"{limiter.gap_fraction:.2f}, {where}, mean queue depth {limiter.mean_queue_depth:.1f}): raise the cap "
                "if the server has headroom, or shed or shape the load"
            ),
        )
    if name == "retry":
        per_success = retries.attempts_per_success
        amplification = f"{per_success:.2f} attempts per success" if per_success is not None else "no success"
        return (
            name,
            "retry dominates",
            (
                f"fix retry budgets and timeouts before concurrency ({amplification}; causes: "
                f"{_causes_text(retries.causes)}; {retries.wasted_output_tokens} output tokens wasted)"
            ),
        )
    if name == "connect":
        churn = connections.per_success
        measured = f" ({churn:.2f} new connections per successful call)" if churn is not None else ""
        return (
            name,
            "connect dominates",
            (f"connection churn{measured}: reuse one client and its connection pool, keep connections alive"),
        )
    if name == "first_token":
        varies = (
            f" and varies {variability.ratio:.1f}x more than stream"
            if variability.ratio is not None and variability.ratio >= VARIES_MORE
            else ""
        )
        server = figures.server
        split = (
            f" (server side at p95: queue {format_seconds(server.server_queue.p95)}, prefill "
            f"{format_seconds(server.prefill.p95)}, network/other {format_seconds(server.network_other.p95)})"
            if server is not None
            else ""
        )
        return (
            name,
            f"first_token dominates{varies}",
            (f"look at server queueing, connection reuse and prompt length{split}"),
        )
    if name == "stream":
        return name, "stream dominates", "decode speed (quantisation, kernels, speculative decoding)"
    return (
        name,
        "post dominates",
        ("move work off the hot path (the caller's own work on the stream after its last token)"),
    )


@dataclass(frozen=True)
class _Figures:
    variability: Variability
    retries: Retries
    connections: Connections
    limiters: tuple[LimiterRow, ...]
    server: ServerSplit | None


def _notes(dominant: Part, parts: Sequence[Part], figures: _Figures) -> list[str]:
    """Secondary signals worth a look; never a second dominant part."""
    notes = []
    by_key = {(part.kind, part.name): part for part in parts}
    first_token = by_key.get((KIND_BUCKET, "first_token"))
    ratio = figures.variability.ratio
    if (
        dominant.name != "first_token"
        and ratio is not None
        and ratio >= 3 * VARIES_MORE / 2
        and first_token is not None
        and first_token.per_trace.p95 >= 0.25 * dominant.per_trace.p95
    ):
        notes.append(
            f"first_token varies {ratio:.1f}x more than stream: look at server queueing, connection reuse "
            "and prompt length"
        )
    churn = figures.connections.per_success
    if dominant.name != "connect" and churn is not None and churn > 0.5:
        notes.append(f"connection churn: {churn:.2f} new connections per successful call; reuse connections")
    per_success = figures.retries.attempts_per_success
    if dominant.name != "retry" and per_success is not None and per_success >= 1.2:
        notes.append(f"retry amplification: {per_success:.2f} attempts per success; check retry budgets")
    if figures.retries.failed:
        kinds = ", ".join(f"{kind} ×{count}" for kind, count in figures.retries.error_types.items())
        notes.append(f"{figures.retries.failed} of {figures.retries.calls} LLM calls failed ({kinds})")
    for limiter in figures.limiters:
        material = limiter.backlog_s >= MATERIAL_BACKLOG_SHARE * limiter.window_s > 0
        if dominant.name != "queue" and limiter.gap_fraction >= STALL_GAP_FRACTION and material:
            notes.append(
                f"limiter '{limiter.name}': in-flight below the cap during {limiter.gap_fraction:.0%} of the "
                "backlog (a stalled scheduler)"
            )
    return notes


def _triage(parts: Sequence[Part], stages: Sequence[StageRow], figures: _Figures) -> Triage | None:
    if not parts:
        return None
    dominant = max(parts, key=lambda part: part.per_trace.p95)  # first of equals: stages, then buckets
    finding, seen, advice = _rule(dominant, figures)
    within = _within_budget(stages)
    if within:
        message = (
            f"within budget: every budgeted stage's p95 is under its budget. The largest part at p95 is "
            f"{dominant.label}; to make it faster: {advice}"
        )
    else:
        message = f"{seen}: {advice}"
    return Triage(
        dominant_kind=dominant.kind,
        dominant=dominant.name,
        dominant_p95=dominant.per_trace.p95,
        finding=finding,
        within_budget=within,
        message=message,
        notes=tuple(_notes(dominant, parts, figures)),
    )


# --- entry point -------------------------------------------------------------------------------


def analyse(
    spans: Sequence[Span],
    *,
    budgets: Mapping[str, float] | None = None,
    top: int = 5,
    sources: Sequence[str] = (),
    skipped: Sequence[SkippedLine] = (),
) -> Report:
    """The report of these spans; `budgets` (seconds per stage name) replace the spans' own."""
    overrides = dict(budgets or {})
    by_trace: dict[str, list[Span]] = {}
    for span in spans:
        by_trace.setdefault(span.trace_id, []).append(span)
    traces = [_Trace(trace_id, members) for trace_id, members in by_trace.items()]
    traces = [trace for trace in traces if trace.marked]
    marked = [span for trace in traces for span in trace.marked]
    calls = [span for span in marked if _is_call(span)]
    stages = _stage_rows(marked, overrides)
    buckets = _bucket_rows(calls) if calls else ()
    parts, per_trace = _parts(traces)
    figures = _Figures(
        variability=_variability(buckets),
        retries=_retries(calls),
        connections=_connections(calls),
        limiters=_limiters(calls),
        server=_server_split(traces),
    )
    seen = {row.stage for row in stages}
    notes = tuple(
        f"--budgets names stage '{stage}', which no span has" for stage in overrides if stage not in seen
    )
    return Report(
        sources=tuple(sources),
        skipped=tuple(skipped),
        spans=sum(len(trace.spans) for trace in traces),
        traces=len(traces),
        llm_calls=len(calls),
        quantile_method=QUANTILE_METHOD,
        stages=stages,
        buckets=buckets,
        parts=parts,
        triage=_triage(parts, stages, figures),
        variability=figures.variability,
        connections=figures.connections,
        retries=figures.retries,
        limiters=figures.limiters,
        server=figures.server,
        slowest=_slowest(traces, per_trace, top),
        notes=notes,
    )
