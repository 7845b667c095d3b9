"""Figures that are estimates, and how far each can be trusted: from histograms that counted every call,
and from tail-sampled traces that stand for the calls they did not keep.

A histogram knows every value's bucket: the q-quantile's nearest rank falls in one bucket, so the quantile
lies in that bucket (narrowed by the recorded min and max), and the figure given is placed inside it by the
rank's position there. Sampled traces know only the values they kept: each trace counts as often as its
weight (Horvitz-Thompson, `_analysis.py`), and how far the q-quantile of those copies can be from the whole
run's is the binomial spread of a rank among Kish's effective sample size, n_eff = (sum w)^2 / sum w^2:
the quantile lies between the values at q -/+ `Z` * sqrt(q (1 - q) / n_eff). Whether one part stands apart
from another is then a question of their intervals not overlapping (`apart`). The method: docs/sampling.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from llmspans.report._model import Bound, Distribution, Interval, quantile, rank

Z = 1.96  # a 95 % interval for a rank read from sampled traces
_QUANTILES = ((0.5, "p50"), (0.95, "p95"), (0.99, "p99"))


@dataclass(frozen=True)
class Histogram:
    """One explicit-bucket histogram, merged over every series and process that counted a part: a value
    on a boundary counts in the bucket below it, as OpenTelemetry's do. `minimum`/`maximum` are None when
    the points did not carry them."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    total: float
    minimum: float | None
    maximum: float | None

    @property
    def count(self) -> int:
        return sum(self.counts)


def merged(histograms: Sequence[Histogram]) -> Histogram:
    """Several histograms as one. Where their boundaries differ (points from an older llmspans, on the
    conventions' coarser boundaries) they are summed on the boundaries they share: every bucket of each is
    then a whole number of the shared ones, so no count is split."""
    if len(histograms) == 1:
        return histograms[0]
    shared = set(histograms[0].bounds)
    for histogram in histograms[1:]:
        shared &= set(histogram.bounds)
    bounds = tuple(sorted(shared))
    counts = [0] * (len(bounds) + 1)
    for histogram in histograms:
        at = 0
        for index, count in enumerate(histogram.counts):
            upper = histogram.bounds[index] if index < len(histogram.bounds) else math.inf
            while at < len(bounds) and bounds[at] < upper:
                at += 1
            counts[at] += count
    minima = [h.minimum for h in histograms if h.minimum is not None and h.count]
    maxima = [h.maximum for h in histograms if h.maximum is not None and h.count]
    known = len(minima) == sum(1 for h in histograms if h.count)
    return Histogram(
        bounds,
        tuple(counts),
        sum(h.total for h in histograms),
        min(minima) if minima and known else None,
        max(maxima) if maxima and known else None,
    )


def histogram_distribution(histogram: Histogram) -> Distribution:
    """p50, p95 and p99 of a histogram, each with the interval it lies in (`Interval`). A quantile whose
    interval is wider than the figure itself (the first bucket, from 0) is only that bound (`Bound`), as the
    Prometheus report says it; the max is the recorded one."""
    count = histogram.count
    figures: dict[str, float] = {}
    intervals: list[Interval] = []
    bounds: list[Bound] = []
    for q, name in _QUANTILES:
        low, high, value, open_low = (
            _bucket_of_rank(histogram, rank(count, q)) if count else (0.0, 0.0, 0.0, False)
        )
        figures[name] = value
        if count:
            intervals.append(Interval(name, low, high, open_low))
            if high - low > value:
                bounds.append(Bound(name, low, high))
                figures[name] = high
    return Distribution(
        count, figures["p50"], figures["p95"], figures["p99"],
        histogram.maximum if histogram.maximum is not None else None, tuple(bounds), tuple(intervals),
    )  # fmt: skip


def _bucket_of_rank(histogram: Histogram, wanted: int) -> tuple[float, float, float, bool]:
    """The interval of the value at rank `wanted` (1-based), a figure inside it, and whether the interval's
    low end is a boundary not in it: the bucket that holds the rank, narrowed by min and max, with the rank
    placed at its position among the bucket's values."""
    below = 0
    bounds, counts = histogram.bounds, histogram.counts
    for index, count in enumerate(counts):
        if below + count >= wanted:
            lower = bounds[index - 1] if index > 0 else 0.0
            open_low = index > 0
            upper = bounds[index] if index < len(bounds) else math.inf
            if histogram.minimum is not None and histogram.minimum > lower:
                lower, open_low = histogram.minimum, False
            if histogram.maximum is not None:
                upper = min(upper, histogram.maximum)
            if not math.isfinite(upper):
                upper = lower  # above the last boundary with no max known: the boundary is all there is
            upper = max(upper, lower)
            position = (wanted - below - 0.5) / count
            return lower, upper, lower + (upper - lower) * position, open_low and upper > lower
        below += count
    top = histogram.maximum if histogram.maximum is not None else (bounds[-1] if bounds else 0.0)
    return top, top, top, False


def effective_size(weight_sum: float, weight_squares: float) -> float:
    """Kish's effective sample size of traces with these weights: how many unweighted traces they are worth."""
    return weight_sum * weight_sum / weight_squares if weight_squares > 0 else 0.0


def weighted_distribution(ordered: Sequence[float], effective: float) -> Distribution:
    """The quantiles of a weighted sample's copies (ascending; each trace as often as its weight), with the
    interval of each from the effective sample size."""
    base = Distribution.of_sorted(ordered)
    if not ordered:
        return base
    intervals = tuple(Interval(name, *rank_interval(ordered, q, effective)) for q, name in _QUANTILES)
    return Distribution(base.count, base.p50, base.p95, base.p99, base.max, (), intervals)


def rank_interval(ordered: Sequence[float], q: float, effective: float) -> tuple[float, float]:
    """The values at q -/+ Z standard deviations of a rank among `effective` independent draws."""
    if effective <= 0:
        return ordered[0], ordered[-1]
    spread = Z * math.sqrt(q * (1 - q) / effective)
    low_q, high_q = q - spread, q + spread
    low = ordered[0] if low_q <= 0 else quantile(ordered, low_q)
    high = ordered[-1] if high_q >= 1 else quantile(ordered, high_q)
    return low, high


def apart(leader: Distribution, other: Distribution, name: str = "p95") -> bool:
    """Whether `leader`'s quantile stands above `other`'s beyond both their intervals (a figure of every
    value is its own interval). Two histogram buckets that share a boundary are apart: the upper one does
    not hold its lower boundary."""
    low, high = _low(leader, name), _high(other, name)
    interval = leader.interval(name)
    return low > high or (low == high and interval is not None and interval.open_low)


def _low(distribution: Distribution, name: str) -> float:
    interval = distribution.interval(name)
    return interval.low if interval is not None else distribution.at(_Q[name])


def _high(distribution: Distribution, name: str) -> float:
    interval = distribution.interval(name)
    return interval.high if interval is not None else distribution.at(_Q[name])


def interval_of(distribution: Distribution, name: str = "p95") -> tuple[float, float]:
    return _low(distribution, name), _high(distribution, name)


_Q = {name: q for q, name in _QUANTILES}
