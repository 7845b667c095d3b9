"""When requests go: open-loop arrival times, and the sweep that picks the next level.

Open loop: inter-arrival gaps are gamma-distributed with shape `burstiness` and mean `1/rate` (shape 1 is
exponential: Poisson arrivals; below 1 burstier, above 1 more regular), drawn from a seeded generator, as
`vllm bench serve` draws them. The closed loop needs no schedule: each user sends when its last request
is done.

The sweep (`--sweep`) doubles the load from where it starts until a level is past the knee (p95 TTFT or
e2e more than `knee_factor` times the first level's, throughput no longer growing with the load) or
breaks an SLO, then runs up to `BETWEEN` levels evenly spaced between the last good level and that one.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from llmspans.load._model import SHAPE_CONCURRENCY, Level, LevelStats

BETWEEN = 2
MAX_CONCURRENCY = 1024
MAX_RATE = 10_000.0
# Throughput "stops growing" when less than this share of the load's increase turns into throughput.
GROWTH_SHARE = 0.5


def arrivals(rate: float, count: int, burstiness: float, rng: random.Random) -> list[float]:
    """`count` arrival offsets in seconds from the level's start, the first one at 0."""
    mean = 1.0 / rate
    offsets, at = [], 0.0
    for _ in range(count):
        offsets.append(at)
        at += rng.gammavariate(burstiness, mean / burstiness)
    return offsets


def past_knee(levels: Sequence[LevelStats], index: int, knee_factor: float) -> tuple[str, ...]:
    """Why `levels[index]` is past the knee (empty when it is not): against the first level's p95 TTFT and
    e2e, and against the previous level's throughput."""
    if index == 0:
        return ()
    first, previous, level = levels[0], levels[index - 1], levels[index]
    reasons = []
    for name in ("ttft", "e2e"):
        low, now = getattr(first, name), getattr(level, name)
        if low is not None and now is not None and low.p95 > 0 and now.p95 > knee_factor * low.p95:
            reasons.append(
                f"p95 {name.upper() if name == 'ttft' else name} {now.p95 / low.p95:.1f}x its low-load value"
            )
    load_growth = level.level.value / previous.level.value
    if previous.requests_per_s > 0 and load_growth > 1 and previous.completed and level.completed:
        grown = level.requests_per_s / previous.requests_per_s
        if grown - 1 < GROWTH_SHARE * (load_growth - 1):
            reasons.append(
                f"throughput {previous.requests_per_s:.1f} → {level.requests_per_s:.1f} requests/s while the load "
                f"grew {load_growth:.1f}x"
            )
    return tuple(reasons)


def slo_broken(level: LevelStats, slo: dict[str, float]) -> str | None:
    """The first SLO whose p95 the level missed, in words; None when all held."""
    for name, limit in slo.items():
        figures = getattr(level, name)
        if figures is not None and figures.p95 > limit:
            return f"p95 {name} {figures.p95:.3f} s over the SLO of {limit:g} s"
    return None


class Sweep:
    """Chooses the sweep's levels one at a time from what the levels so far showed."""

    def __init__(self, start: Level, knee_factor: float, slo: dict[str, float]) -> None:
        self.start = start
        self.knee_factor = knee_factor
        self.slo = slo
        self._between: list[Level] | None = None

    def next_level(self, done: Sequence[LevelStats]) -> Level | None:
        if not done:
            return self.start
        if self._between is not None:
            return self._between.pop(0) if self._between else None
        ordered = sorted(done, key=lambda stats: stats.level.value)
        last = ordered[-1]
        bad = (
            bool(past_knee(ordered, len(ordered) - 1, self.knee_factor))
            or slo_broken(last, self.slo) is not None
        )
        if not bad:
            value = last.level.value * 2
            if value > (MAX_CONCURRENCY if last.level.shape == SHAPE_CONCURRENCY else MAX_RATE):
                return None
            return Level(last.level.shape, value)
        if len(ordered) < 2:
            self._between = []
            return None
        self._between = _between(ordered[-2].level, last.level)
        return self._between.pop(0) if self._between else None


def _between(good: Level, bad: Level) -> list[Level]:
    """Up to `BETWEEN` levels evenly spaced strictly between two; whole numbers for concurrency."""
    values: list[float] = []
    for step in range(1, BETWEEN + 1):
        value = good.value + (bad.value - good.value) * step / (BETWEEN + 1)
        value = float(round(value)) if good.shape == SHAPE_CONCURRENCY else float(f"{value:.3g}")
        if good.value < value < bad.value and value not in values and not math.isclose(value, bad.value):
            values.append(value)
    return [Level(good.shape, value) for value in values]
