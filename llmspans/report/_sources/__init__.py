"""Where the report's input comes from: files, Jaeger and Tempo give spans, Prometheus the figures.

A span source has `sources` (what to name in the report), `skipped` (lines it could not read) and
`batches()`, which reads the input afresh on every call and yields lists of spans (see `_traces.py`).
The Prometheus source (`prometheus.py`) answers with a whole `Report` instead: the aggregation happens
where the metrics live.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import Protocol

from llmspans.report._metric_points import MetricPoints
from llmspans.report._model import SkippedLine
from llmspans.report._spans import Span

_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(s|m|h|d)\s*$")
_DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


class SpanSource(Protocol):
    sources: list[str]
    skipped: list[SkippedLine]

    @property
    def metrics(self) -> MetricPoints | None:
        """The metric points read with the spans (a file's); None where the source has none."""

    def batches(self) -> Iterator[list[Span]]: ...


class MemorySource:
    """Spans already in memory (the demo's own run)."""

    def __init__(self, spans: Sequence[Span], source: str) -> None:
        self.spans = list(spans)
        self.sources = [source]
        self.skipped: list[SkippedLine] = []
        self.metrics: MetricPoints | None = None

    def batches(self) -> Iterator[list[Span]]:
        yield self.spans


def short(error: BaseException) -> str:
    """An error as a source's one-line message says it: its first line, or its type's name."""
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def parse_duration(value: str, option: str = "--since") -> float:
    """`"90s"`, `"30m"`, `"1h"`, `"2d"` as seconds; ValueError says what to pass."""
    match = _DURATION.match(value)
    seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2)] if match else 0.0
    if seconds <= 0:
        raise ValueError(
            f"{option} must be a positive duration like '90s', '30m', '1h' or '2d', got {value!r}"
        )
    return seconds
