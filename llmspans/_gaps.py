"""Constant-memory quantiles of inter-chunk gaps.

A stream of a million chunks must cost the same memory as one of ten, and adding a gap
must be a handful of integer operations. A log-linear histogram does both: 8 sub-buckets
per power of two bound the relative error of any quantile to 1/16 (about 6 %), and the
maximum is kept exactly.
"""

from __future__ import annotations

from bisect import bisect_left
from itertools import accumulate

# The sketch's layout: public, for `CallRecord`'s one table of gap buckets (`_call._FINE`), each sketch bucket a
# run of them.
SUB_BITS = 3
SUB = 1 << SUB_BITS  # sub-buckets per octave
LINEAR = SUB * 2  # values below this are counted exactly
MAX_BITS = 48  # ~78 hours in nanoseconds; longer gaps land in the last bucket
SIZE = LINEAR + (MAX_BITS - SUB_BITS - 1) * SUB


def bucket_index(value_ns: int) -> int:
    """Index of the bucket holding `value_ns`; kept in sync with the inlined copy in `GapSketch.add` and with
    `CallRecord`'s table of gap buckets (tests/test_gaps.py checks they agree)."""
    bits = value_ns.bit_length()
    if bits <= SUB_BITS + 1:
        return value_ns
    if bits > MAX_BITS:
        return SIZE - 1
    return LINEAR + (bits - SUB_BITS - 2) * SUB + ((value_ns >> (bits - SUB_BITS - 1)) & (SUB - 1))


def bucket_bounds(index: int) -> tuple[int, int]:
    """The [low, high) nanosecond range a bucket covers."""
    if index < LINEAR:
        return index, index + 1
    octave, sub = divmod(index - LINEAR, SUB)
    shift = octave + 1
    low = (SUB + sub) << shift
    return low, low + (1 << shift)


class GapSketch:
    """Counts of gaps per log-linear bucket, plus the exact maximum."""

    __slots__ = ("count", "counts", "max_ns")

    def __init__(self) -> None:
        self.counts = [0] * SIZE
        self.count = 0
        self.max_ns = 0

    def add(self, gap_ns: int) -> None:
        """Count one gap; `bucket_index` inlined, since this runs once per streamed chunk."""
        if gap_ns > self.max_ns:
            self.max_ns = gap_ns
        self.count += 1
        if gap_ns < LINEAR:
            self.counts[gap_ns if gap_ns > 0 else 0] += 1
            return
        bits = gap_ns.bit_length()
        if bits > MAX_BITS:
            self.counts[SIZE - 1] += 1
            return
        shift = bits - SUB_BITS - 1
        self.counts[LINEAR + (shift - 1) * SUB + ((gap_ns >> shift) & (SUB - 1))] += 1

    def quantile_ns(self, q: float) -> int:
        """The `q` quantile (0 < q <= 1), as the middle of its bucket, capped at the maximum."""
        return self.quantiles_ns(q)[0]

    def quantiles_ns(self, *qs: float) -> list[int]:
        """`quantile_ns` of each of `qs`, from one running sum of the counts (in C: a Python loop over the
        few hundred buckets cost a streamed call more than all its chunks' own work)."""
        count = self.count
        if count == 0:
            return [0 for _ in qs]
        running = list(accumulate(self.counts))
        found = []
        for q in qs:
            rank = max(1, min(count, round(q * count + 0.5 - 1e-9)))
            index = bisect_left(running, rank)
            if index >= len(running):  # pragma: no cover - counts always add up to count
                found.append(self.max_ns)
                continue
            low, high = bucket_bounds(index)
            found.append(min((low + high - 1) // 2 if high - low > 1 else low, self.max_ns))
        return found
