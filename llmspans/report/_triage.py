"""The triage: which part of a request's time dominates at p95, and what DESIGN §1 says to do about it.

Shared by every source: the span report and the Prometheus report fill the same `Figures` and
`Part`s, so the same dominant part names the same rule and advice whichever way it was measured.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from llmspans.report._estimates import apart, interval_of
from llmspans.report._model import (
    FINDING_CANNOT_TELL,
    FINDING_QUEUE,
    FINDING_STALLED,
    KIND_BUCKET,
    KIND_OTHER,
    KIND_STAGE,
    OVER_ALL,
    UNMARKED,
    BucketRow,
    Connections,
    Estimate,
    LimiterRow,
    Part,
    PromptCaps,
    Retries,
    ServerHistograms,
    ServerPressure,
    ServerSplit,
    StageRow,
    Triage,
    Variability,
    format_quantile,
    format_seconds,
)

# What `cause_of` names a first_token part when the server's pressure says where the wait is.
FINDING_MEMORY_BOUND = "memory_bound"
FINDING_SERVER_QUEUE = "server_queue"

# A limiter whose backlog time is at least this share in gap reads as a stalled scheduler.
STALL_GAP_FRACTION = 0.25
# ... noted (when queue does not dominate) only if calls waited during this share of its window.
MATERIAL_BACKLOG_SHARE = 0.05
# "Varies much more": first_token's p95/p50 over stream's p95/p50.
VARIES_MORE = 2.0
# A stage is within budget when at most this share of its spans exceeded it (p95 within budget).
WITHIN_BUDGET_SHARE = 0.05
# vLLM's KV cache at this share or more reads as full (it preempts or stops admitting).
KV_CACHE_NEAR_FULL = 0.9
# Waiting requests "rise" by at least this many (later half's mean over the earlier's).
WAITING_RISE = 1.0
# Prefix-cache hits "fall" by at least this share.
PREFIX_HITS_FALL = 0.2
# Calls over the prompt cap "wait longer for their first token" at this p95 over the rest's, or more.
OVER_CAP_SLOWER = 1.5
# New connections per successful call above which churn is worth a note.
CHURN = 0.5
# What would tell the two largest parts apart when their intervals overlap, by where the figures came from.
CANNOT_TELL_HISTOGRAMS = (
    "their p95s lie within each other's histogram buckets: at this resolution neither stands apart from "
    "the other, so neither alone is the bottleneck"
)
CANNOT_TELL_TRACES = (
    "the metrics would tell (configure() writes the metric points beside the spans, and the report then "
    "reads every call's figures from them), or a higher tail-sampling ratio"
)
CANNOT_TELL_UNIFORM = "spans of more of the calls would tell (a higher sampling ratio, or more requests)"


def variability_of(buckets: Sequence[BucketRow]) -> Variability:
    """How much more first_token's tail stretches (p95/p50) than stream's, over every call the bucket rows
    hold (the Prometheus path, whose histograms do not tell streamed calls apart; the span path compares
    the streamed calls alone, `_analysis`)."""
    by_name = {row.bucket: row.values for row in buckets}
    first = by_name["first_token"].spread if "first_token" in by_name else None
    stream = by_name["stream"].spread if "stream" in by_name else None
    ratio = first / stream if first is not None and stream is not None and stream > 0 else None
    return Variability(first, stream, ratio, over=OVER_ALL)


def _varies(variability: Variability) -> str:
    """`varies 3.6x more than stream (over its 12 streamed calls)`, as the advice says it."""
    over = (
        f"the {variability.calls} {variability.over}" if variability.calls is not None else variability.over
    )
    return f"varies {variability.ratio:.1f}x more than stream (over {over})"


def _causes_text(causes: Mapping[str, int]) -> str:
    return ", ".join(f"{cause} ×{count}" for cause, count in causes.items()) or "none recorded"


def within_budget(stages: Sequence[StageRow]) -> bool | None:
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


def _rule(part: Part, figures: Figures) -> tuple[str, str, str]:
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
        wasted = (
            f"; {retries.wasted_output_tokens} output tokens wasted"
            if retries.wasted_output_tokens is not None
            else ""
        )
        return (
            name,
            "retry dominates",
            (
                f"fix retry budgets and timeouts before concurrency ({amplification}; causes: "
                f"{_causes_text(retries.causes)}{wasted})"
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
            f" and {_varies(variability)}"
            if variability.ratio is not None and variability.ratio >= VARIES_MORE
            else ""
        )
        server = figures.server
        split = _server_side(server) if server is not None else _from_histograms(figures.histograms)
        bound = memory_bound(figures.pressure)
        if bound is not None:
            return (
                name,
                f"first_token dominates and the server is memory-bound ({bound})",
                (
                    "the server is out of KV cache, not slow at prefill: more replicas, shorter contexts or a "
                    f"larger KV cache{split}"
                ),
            )
        return (
            name,
            f"first_token dominates{varies}",
            (f"look at server queueing, connection reuse and prompt length{split}"),
        )
    if name == "stream":
        bound = memory_bound(figures.pressure)
        if bound is not None:
            return (
                name,
                f"stream dominates and the server is memory-bound ({bound})",
                (
                    "the server is out of KV cache and preempts running requests, which stall mid-stream while "
                    "they are computed again: more replicas, shorter contexts or a larger KV cache"
                ),
            )
        return name, "stream dominates", "decode speed (quantisation, kernels, speculative decoding)"
    return (
        name,
        "post dominates",
        ("move work off the hot path (the caller's own work on the stream after its last token)"),
    )


@dataclass(frozen=True)
class Figures:
    variability: Variability
    retries: Retries
    connections: Connections
    limiters: tuple[LimiterRow, ...]
    server: ServerSplit | None
    pressure: ServerPressure | None = None
    histograms: tuple[ServerHistograms, ...] = ()
    prompt_caps: PromptCaps | None = None
    # What would tell two parts apart when their intervals overlap (the source's own words).
    cannot_tell: str = CANNOT_TELL_HISTOGRAMS


def _server_side(server: ServerSplit) -> str:
    """first_token's parts at p95 from the server spans, every row named as the split table names it."""
    if not server.rows:  # a split made before the rows existed
        return (
            f" (server side at p95: queue {format_seconds(server.server_queue.p95)}, prefill "
            f"{format_seconds(server.prefill.p95)}, network/other {format_seconds(server.network_other.p95)})"
        )
    parts = ", ".join(
        f"{row.label} {format_seconds(row.values.p95)}"
        for row in server.rows
        if row.bucket == "first_token" and row.part != "client"
    )
    return f" (server side at p95: {parts})"


def _from_histograms(histograms: tuple[ServerHistograms, ...]) -> str:
    """The server's own queue and prefill at p95 from vLLM's histograms, when no server span split it."""
    said = [
        f"{h.model}: queue {format_quantile(h.queue, 'p95')}, prefill {format_quantile(h.prefill, 'p95')}"
        for h in histograms
        if h.queue is not None and h.prefill is not None
    ]
    return f" (vLLM's histograms at p95: {'; '.join(said)})" if said else ""


def memory_bound(pressure: ServerPressure | None) -> str | None:
    """What says vLLM ran out of KV cache: usage near full and preemptions rising (or going on)."""
    if pressure is None or pressure.kv_cache_usage_max is None:
        return None
    after = pressure.preemption_rate_after or 0.0
    before = pressure.preemption_rate_before or 0.0
    if pressure.kv_cache_usage_max < KV_CACHE_NEAR_FULL or after <= 0 or after < before:
        return None
    return f"KV-cache usage reached {pressure.kv_cache_usage_max:.0%} and preemptions rose to {after:.2f}/s"


def _pressure_notes(pressure: ServerPressure | None, queue_small: bool) -> list[str]:
    notes: list[str] = []
    if pressure is None:
        return notes
    before, after = pressure.waiting_before, pressure.waiting_after
    if queue_small and before is not None and after is not None and after >= before + WAITING_RISE:
        notes.append(
            f"vLLM's waiting requests rose from {before:.1f} to {after:.1f} while the client's queue bucket "
            "stayed small: the queue is on the server (more replicas or a smaller batch, not a larger client cap)"
        )
    hits_before, hits_after = pressure.prefix_cache_hit_ratio_before, pressure.prefix_cache_hit_ratio_after
    if hits_before is not None and hits_after is not None and hits_before - hits_after >= PREFIX_HITS_FALL:
        notes.append(
            f"vLLM's prefix-cache hits fell from {hits_before:.0%} to {hits_after:.0%}: prompts stopped sharing "
            "a prefix (a changed system prompt or template, or per-user text moved to the front)"
        )
    return notes


def _notes(dominant: Part, parts: Sequence[Part], figures: Figures) -> list[str]:
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
            f"first_token {_varies(figures.variability)}: look at server queueing, connection reuse "
            "and prompt length"
        )
    note = _long_prompts(figures.prompt_caps)
    if (
        note is not None
        and first_token is not None
        and first_token.per_trace.p95 >= 0.25 * dominant.per_trace.p95
    ):
        notes.append(note)
    queue = by_key.get((KIND_BUCKET, "queue"))
    queue_small = (
        queue is None or first_token is None or queue.per_trace.p95 <= 0.1 * first_token.per_trace.p95
    )
    notes += _pressure_notes(figures.pressure, queue_small)
    churn = figures.connections.per_success
    if dominant.name != "connect" and churn is not None and churn > CHURN:
        notes.append(_churn_note(figures.connections, churn))
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


def _long_prompts(caps: PromptCaps | None) -> str | None:
    """The prefill cost of long prompts, where a prompt cap measured it."""
    if caps is None or caps.first_token_over is None or caps.first_token_under is None:
        return None
    over, under = caps.first_token_over.p95, caps.first_token_under.p95
    if under <= 0 or over < OVER_CAP_SLOWER * under:
        return None
    return (
        f"calls over the prompt cap waited {over / under:.1f}x longer for their first token at p95 "
        f"({format_seconds(over)} against {format_seconds(under)}): long prompts cost prefill; shorten them "
        "(summarise the history, trim retrieval) or refuse them with on_exceed='error'"
    )


@dataclass(frozen=True)
class Cause:
    """What the triage rules say of one part, whether or not it dominates (`llmspans load` asks it of the
    part that grew at the knee): the finding, what was seen, the advice, and the server-pressure notes."""

    finding: str
    seen: str
    advice: str
    notes: tuple[str, ...]


def cause_of(part: Part, figures: Figures) -> Cause:
    """The rule for `part` with these figures. A first_token or stream part is named by the server's
    pressure when it says where the wait is: `memory_bound` (KV cache full and preempting: new requests
    wait, running ones are preempted mid-stream), and for first_token `server_queue` (vLLM's waiting
    requests rose while the client's queue did not); otherwise the part's own name."""
    finding, seen, advice = _rule(part, figures)
    notes = tuple(_pressure_notes(figures.pressure, part.name != "queue"))
    pressure = figures.pressure
    if (
        part.kind == KIND_BUCKET
        and part.name in ("first_token", "stream")
        and memory_bound(pressure) is not None
    ):
        finding = FINDING_MEMORY_BOUND
    elif (
        part.kind == KIND_BUCKET
        and part.name == "first_token"
        and (
            pressure is not None
            and pressure.waiting_before is not None
            and pressure.waiting_after is not None
            and pressure.waiting_after >= pressure.waiting_before + WAITING_RISE
        )
    ):
        finding = FINDING_SERVER_QUEUE
    return Cause(finding, seen, advice, notes)


def _churn_note(connections: Connections, churn: float) -> str:
    """Connection churn, and where it comes from when streamed calls closed before their body's end brought
    it: the openai SDK's own streamed path, which reusing the client does not change (docs/report.md)."""
    said = f"connection churn: {churn:.2f} new connections per successful call"
    closed = connections.closed_before_end
    streamed = connections.streamed
    if not closed or streamed is None:
        return f"{said}; reuse connections"
    rest = connections.new_connections - closed
    advice = "reusing the client does not change that" + (
        "" if rest <= 1 else "; for the rest, reuse connections"
    )
    return (
        f"{said}; {closed} of {streamed.calls} streamed calls closed their response before the body's end (the "
        "openai SDK stops reading at `data: [DONE]` and closes it; vLLM sends the body's end after that), so "
        f"over HTTP/1.1 each left the pool without its connection and a later call opened one: {advice}"
    )


def estimate(part: Part) -> Estimate:
    """A part's p95 and the interval it lies in (the figure itself when it is one of every value)."""
    low, high = interval_of(part.per_trace)
    return Estimate(part.kind, part.name, part.per_trace.p95, low, high)


def _interval_text(found: Estimate) -> str:
    if found.low == found.high:
        return format_seconds(found.p95)
    return f"{format_seconds(found.p95)} ({format_seconds(found.low)} to {format_seconds(found.high)})"


def triage(parts: Sequence[Part], stages: Sequence[StageRow], figures: Figures) -> Triage | None:
    """The part with the largest p95 and its rule. Where the figures are estimates (an interval on either of
    the two largest), the part is named only when its interval lies wholly above the runner-up's; otherwise
    the triage says it cannot tell them apart, and what would."""
    if not parts:
        return None
    ordered = sorted(parts, key=lambda part: -part.per_trace.p95)  # stable: first of equals, stages first
    dominant = ordered[0]
    finding, seen, advice = _rule(dominant, figures)
    within = within_budget(stages)
    compared: tuple[Estimate, ...] = ()
    told = True
    if len(ordered) > 1:
        runner_up = ordered[1]
        if dominant.per_trace.intervals or runner_up.per_trace.intervals:
            compared = (estimate(dominant), estimate(runner_up))
            told = apart(dominant.per_trace, runner_up.per_trace)
    if not told:
        leader, other = compared
        finding = FINDING_CANNOT_TELL
        message = (
            f"cannot tell {leader.label} from {other.label} at p95 at this sample: {_interval_text(leader)} "
            f"against {_interval_text(other)}; {figures.cannot_tell}"
        )
        if within:
            message = f"within budget: every budgeted stage's p95 is under its budget; {message}"
    elif within:
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
        told=told,
        compared=compared,
    )
