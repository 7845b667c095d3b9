"""Spans of OTLP-JSON files read whole, for tests that look at the spans themselves."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from llmspans.report._model import SkippedLine
from llmspans.report._sources.file import FileSource
from llmspans.report._spans import Span


@dataclass(frozen=True)
class Read:
    spans: list[Span]
    skipped: list[SkippedLine]


def read_spans(paths: Sequence[Path]) -> Read:
    source = FileSource(list(paths), progress=False)
    spans = [span for batch in source.batches() for span in batch]
    return Read(spans, source.skipped)
