"""The knee, and what grew there, in the report's words.

The knee is the first level (in order of load) where p95 TTFT or e2e is more than `knee_factor` times the
first level's, or where throughput grew by less than half of the load's increase (`_schedule.past_knee`).
What grew is the part of a request's time whose p95 rose most from the level under the knee to the knee:
a bucket (the level's own spans, as the report reads them) or, in an open loop, the client's lag behind
its schedule. The words come from the report's triage rules (`cause_of`), fed with the knee level's
figures and with vLLM's pressure as it changed from one level to the other.
"""

from __future__ import annotations

from collections.abc import Sequence

from llmspans import _names as names
from llmspans.load._model import Knee, LevelStats, Verdict
from llmspans.load._schedule import past_knee
from llmspans.report._estimates import apart
from llmspans.report._model import (
    FINDING_CANNOT_TELL,
    KIND_BUCKET,
    Distribution,
    Part,
    ServerPressure,
    format_seconds,
)
from llmspans.report._triage import (
    CANNOT_TELL_UNIFORM,
    FINDING_SERVER_QUEUE,
    Cause,
    Figures,
    cause_of,
    variability_of,
)

SCHEDULE_LAG = "schedule_lag"
# A part whose p95 moved less than this share (and less than 1 ms) is "unchanged" in the verdict.
UNCHANGED_SHARE = 0.25


def find_knee(levels: Sequence[LevelStats], knee_factor: float) -> Knee | None:
    ordered = sorted(levels, key=lambda stats: stats.level.value)
    for index in range(1, len(ordered)):
        reasons = past_knee(ordered, index, knee_factor)
        if reasons:
            return Knee(ordered[index - 1].level, ordered[index].level, reasons)
    return None


def verdict(levels: Sequence[LevelStats], knee: Knee) -> Verdict | None:
    by_level = {stats.level: stats for stats in levels}
    before, at = by_level[knee.before], by_level[knee.at]
    growth = {bucket: at.buckets_p95[bucket] - before.buckets_p95[bucket] for bucket in names.BUCKETS}
    if before.lag is not None and at.lag is not None:
        growth[SCHEDULE_LAG] = at.lag.p95 - before.lag.p95
    grew = max(growth, key=growth.__getitem__)
    if growth[grew] <= 0:
        return None
    value_before, value_after = _p95(before, grew), _p95(at, grew)
    head = f"from {knee.before.words} to {knee.at.words}, p95 {grew} went {format_seconds(value_before)} → {format_seconds(value_after)}"
    if grew != SCHEDULE_LAG and not _grew_beyond_its_interval(before, at, grew):
        return Verdict(
            grew, value_before, value_after, FINDING_CANNOT_TELL,
            f"{head}, within what the spans of these levels can tell apart (a sample of their calls: "
            f"{before.unrecorded + at.unrecorded} successful calls had no span): {CANNOT_TELL_UNIFORM}",
            (),
        )  # fmt: skip
    server = _server_change(before, at)
    unchanged = [
        bucket
        for bucket in ("first_token", "stream")
        if bucket != grew and _unchanged(before.buckets_p95[bucket], at.buckets_p95[bucket])
    ]
    steady = f"; {' and '.join(unchanged)} unchanged" if unchanged else ""
    if grew == SCHEDULE_LAG:
        return Verdict(
            grew, value_before, value_after, SCHEDULE_LAG,
            f"{head}{steady}: the load generator fell behind its own schedule (lag p99 "
            f"{format_seconds(at.lag.p99 if at.lag else 0.0)}), its limit, not the server's: run it on more "
            "--workers where the machine has idle CPUs, or at fewer requests/s",
            (),
        )  # fmt: skip
    cause = _cause(grew, before, at)
    said = f"{cause.seen}: {cause.advice}"
    notes = cause.notes
    if cause.finding == FINDING_SERVER_QUEUE and notes:
        said, notes = notes[0], notes[1:]  # the report's words for a queue on the server
        if (
            before.server is not None
            and at.server is not None
            and at.server.running_max <= before.server.running_max
        ):
            said += (
                f"; running stayed at {at.server.running_max}: every batch slot was busy (raise vLLM's "
                "--max-num-seqs if its KV cache has room, or add a replica)"
            )
    return Verdict(grew, value_before, value_after, cause.finding, f"{head}{server}{steady}: {said}", notes)


def _grew_beyond_its_interval(before: LevelStats, at: LevelStats, bucket: str) -> bool:
    """Whether the bucket's p95 at the knee stands above the level under it beyond both their intervals;
    True when the levels' figures are every call's (no interval)."""
    rows = []
    for stats in (before, at):
        report = stats.report
        row = (
            next((row for row in report.buckets if row.bucket == bucket), None)
            if report is not None
            else None
        )
        if row is None:
            return True
        rows.append(row.values)
    return apart(rows[1], rows[0])


def summary(
    knee: Knee | None, verdict_: Verdict | None, levels: Sequence[LevelStats], knee_factor: float
) -> str:
    if not levels:
        return "no level ran"
    if knee is None:
        top = max(levels, key=lambda stats: stats.level.value).level
        return (
            f"no knee up to {top.words}: p95 TTFT and e2e stayed within {knee_factor:g}x of the first level's "
            "and throughput kept growing with the load"
        )
    head = f"knee between {knee.before.words} and {knee.at.words} ({'; '.join(knee.reasons)})"
    return f"{head}. {verdict_.message[0].upper()}{verdict_.message[1:]}" if verdict_ is not None else head


def _p95(stats: LevelStats, part: str) -> float:
    if part == SCHEDULE_LAG:
        return stats.lag.p95 if stats.lag is not None else 0.0
    return stats.buckets_p95[part]


def _unchanged(before: float, after: float) -> bool:
    return abs(after - before) < 0.001 or abs(after - before) <= UNCHANGED_SHARE * max(before, after)


def _server_change(before: LevelStats, at: LevelStats) -> str:
    if before.server is None or at.server is None:
        return ""
    said = [
        f"vLLM waiting {before.server.waiting_mean:.1f} → {at.server.waiting_mean:.1f}",
        f"running {before.server.running_mean:.1f} → {at.server.running_mean:.1f}",
    ]
    if at.server.kv_cache_usage_max is not None:
        said.append(f"KV cache up to {at.server.kv_cache_usage_max:.0%}")
    if at.server.preemption_rate_mean:
        said.append(f"{at.server.preemption_rate_mean:.1f} preemptions/s")
    return f" ({', '.join(said)})"


def _cause(bucket: str, before: LevelStats, at: LevelStats) -> Cause:
    """The report's rule for `bucket` at the knee level: its limiter, retries and connections, and vLLM's
    pressure from the level under the knee (before) to the knee (after)."""
    report = at.report
    pressure = None
    if before.server is not None and at.server is not None:
        pressure = ServerPressure(
            calls=at.completed,
            kv_cache_usage_max=at.server.kv_cache_usage_max,
            preemption_rate_before=before.server.preemption_rate_mean,
            preemption_rate_after=at.server.preemption_rate_mean,
            waiting_before=before.server.waiting_mean,
            waiting_after=at.server.waiting_mean,
            prefix_cache_hit_ratio_before=before.server.prefix_cache_hit_ratio_mean,
            prefix_cache_hit_ratio_after=at.server.prefix_cache_hit_ratio_mean,
        )
    if report is None:
        raise ValueError("a level's report is needed for its verdict")
    figures = Figures(
        variability=variability_of(report.buckets),
        retries=report.retries,
        connections=report.connections,
        limiters=report.limiters,
        server=report.server,
        pressure=pressure,
    )
    value = at.buckets_p95[bucket]
    part = Part(KIND_BUCKET, bucket, Distribution(at.completed, value, value, value, value))
    return cause_of(part, figures)
