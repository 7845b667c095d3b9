"""Before and after: per stage, per bucket and per load level, how p50 and p95 moved, and whether the move is real.

On the span path each side keeps its samples (`Report.samples`), so each change gets a bootstrap
95 % confidence interval: both samples are resampled with replacement, the nearest-rank quantile of
each resample taken, and the change's 2.5th and 97.5th percentiles over `REPLICATES` rounds form the
interval. The k-th smallest of n values drawn with replacement from sorted values x is x[floor(n*U)]
where U is the k-th smallest of n uniforms, which is Beta(k, n-k+1): so a round costs one Beta draw
per side, not a resample and a sort. A change whose interval excludes 0 is real (`slower`/`faster`)
unless it is too small to matter (under both 1 ms and 5 %: `negligible`); one whose interval straddles 0
is `noise`. A side whose quantiles come from histograms (Prometheus, or a sampled file's metric points) has
no samples but knows the bucket each quantile lies in (`Distribution.intervals`): where both sides know
theirs, the change lies between the after-interval's low less the before-interval's high and the other way
round, and the same rules give the verdict (`BUCKET_INTERVAL`); otherwise the change carries no interval.
The random generator is seeded: the same two inputs give the same intervals.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from llmspans.report._model import KIND_BUCKET, KIND_LEVEL, KIND_STAGE, Distribution, Report, part_label, rank

REPLICATES = 2000
CONFIDENCE = 0.95
SEED = 16
COMPARED_QUANTILES = (0.5, 0.95)
SLOWER = "slower"
FASTER = "faster"
NOISE = "noise"
NEGLIGIBLE = "negligible"
UNCHANGED = "unchanged"
MATERIAL_S = (
    0.001  # a real change smaller than this and than MATERIAL_SHARE of the before figure is negligible
)
MATERIAL_SHARE = 0.05
NO_INTERVAL = "no interval (histogram quantiles)"
BUCKET_INTERVAL = "from the histogram buckets each quantile lies in"


@dataclass(frozen=True)
class Change:
    kind: str  # stage, bucket, or level (a load level's call durations)
    name: str
    quantile: str  # p50 or p95
    before_s: float
    after_s: float
    change_s: float
    low_s: float | None  # the confidence interval of the change; None without samples on both sides
    high_s: float | None
    verdict: str

    @property
    def real(self) -> bool:
        return self.verdict in (SLOWER, FASTER)


@dataclass(frozen=True)
class Comparison:
    before: str
    after: str
    method: str
    dominant_before: str | None
    dominant_after: str | None
    changes: tuple[Change, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "changes": [{**asdict(change), "real": change.real} for change in self.changes],
        }


def _replicate(values: Sequence[float], q: float, rng: random.Random) -> float:
    count = len(values)
    k = rank(count, q)
    return values[min(count - 1, int(count * rng.betavariate(k, count - k + 1)))]


def interval(
    before: Sequence[float],
    after: Sequence[float],
    q: float,
    *,
    replicates: int = REPLICATES,
    seed: int = SEED,
) -> tuple[float, float]:
    """The bootstrap `CONFIDENCE` interval of after's q-quantile minus before's (both sorted, not empty)."""
    rng = random.Random(seed)
    changes = sorted(_replicate(after, q, rng) - _replicate(before, q, rng) for _ in range(replicates))
    tail = (1 - CONFIDENCE) / 2
    return changes[int(tail * (replicates - 1))], changes[round((1 - tail) * (replicates - 1))]


def _rows(report: Report, kind: str) -> dict[str, Distribution]:
    if kind == KIND_STAGE:
        return {row.stage: row.durations for row in report.stages}
    if kind == KIND_LEVEL:
        return {row.label: row.durations for row in report.levels}
    return {row.bucket: row.values for row in report.buckets}


def _within(distribution: Distribution, q: float) -> tuple[float, float] | None:
    """Where a side's q-quantile lies: its interval; the figure itself when it is one of every value (a span
    report of whole traces); None when it is an estimate whose interval is not known."""
    found = distribution.interval(f"p{round(q * 100)}")
    if found is not None:
        return found.low, found.high
    if not distribution.intervals and not distribution.bounds and distribution.max is not None:
        return distribution.at(q), distribution.at(q)
    return None


def _change(kind: str, name: str, q: float, before: Report, after: Report) -> Change:
    first, second = _rows(before, kind)[name].at(q), _rows(after, kind)[name].at(q)
    label = f"p{round(q * 100)}"
    samples_before, samples_after = before.samples.get((kind, name)), after.samples.get((kind, name))
    if samples_before and samples_after:
        low, high = interval(samples_before, samples_after, q)
    else:
        within_before, within_after = (
            _within(_rows(before, kind)[name], q),
            _within(_rows(after, kind)[name], q),
        )
        if within_before is None or within_after is None:
            return Change(kind, name, label, first, second, second - first, None, None, NO_INTERVAL)
        low, high = within_after[0] - within_before[1], within_after[1] - within_before[0]
    if first == second and low == high == 0:
        verdict = UNCHANGED
    elif low <= 0 <= high:
        verdict = NOISE
    elif abs(second - first) < MATERIAL_S and abs(second - first) < MATERIAL_SHARE * first:
        verdict = NEGLIGIBLE
    else:
        verdict = SLOWER if low > 0 else FASTER
    return Change(kind, name, label, first, second, second - first, low, high, verdict)


def compare(before: Report, after: Report, *, before_name: str, after_name: str) -> Comparison:
    """Every stage, bucket and load level both runs have, at p50 and p95, in the after-run's order."""
    changes: list[Change] = []
    for kind in (KIND_STAGE, KIND_BUCKET, KIND_LEVEL):
        earlier = _rows(before, kind)
        for name in _rows(after, kind):
            if name in earlier:
                changes.extend(_change(kind, name, q, before, after) for q in COMPARED_QUANTILES)
    sampled = bool(before.samples) and bool(after.samples)
    bucketed = any(change.low_s is not None for change in changes)
    method = (
        f"bootstrap {CONFIDENCE:.0%} interval of the change ({REPLICATES} rounds, nearest-rank quantiles); "
        "real when the interval excludes 0, negligible when it is also under both 1 ms and 5 %"
        if sampled
        else f"interval of the change {BUCKET_INTERVAL} on each side; real when it excludes 0, negligible "
        "when the change is also under both 1 ms and 5 %"
        if bucketed
        else "no confidence interval: at least one side is histogram quantiles with no bucket known"
    )

    def dominant(report: Report) -> str | None:
        if report.triage is None:
            return None
        if not report.triage.told:
            first, second = report.triage.compared
            return f"cannot tell ({first.label} or {second.label})"
        return part_label(report.triage.dominant_kind, report.triage.dominant)

    return Comparison(before_name, after_name, method, dominant(before), dominant(after), tuple(changes))
