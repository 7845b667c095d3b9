"""OTLP-JSON files: the embedded default's lines, or one saved document (a Jaeger response).

The embedded default writes one export per line, spans and metric points alike; such a file is read
a line at a time, each line one batch of spans for `_traces.py`, so a file of any size is never held
whole. A file whose first line alone is not JSON but whose whole text is (pretty-printed JSON, a saved
Jaeger page) is read whole. A line that cannot be read in an otherwise good file is skipped and listed
in `skipped`, never fatal; a file with no good line at all is a `ReportInputError`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

import msgspec

from llmspans.report._metric_points import MetricPoints, read_metrics
from llmspans.report._model import SkippedLine
from llmspans.report._progress import Progress
from llmspans.report._sources import short
from llmspans.report._spans import NotOtlp, ReportInputError, Span, decode, spans_of_json

_BUFFER = 1 << 20  # the embedded default's lines are exports of up to 512 spans: a few hundred KB each
_BLOCK = 4 << 20


class FileSource:
    """Spans of one or more files, read afresh on every call of `batches()`; the lines that hold metric
    points are noted as they go by, and read only when `metrics` is asked for (a sampled input)."""

    def __init__(self, paths: Sequence[Path], *, progress: bool = True, since_ns: int | None = None) -> None:
        self.paths = list(paths)
        self.sources = [str(path) for path in self.paths]
        self.progress = progress
        self.skipped: list[SkippedLine] = []
        self.since_ns = since_ns  # the metrics count only what came after it (--since)
        self._metric_lines: list[tuple[Path, int, int]] = []  # file, offset, length
        self._metrics: MetricPoints | None = None

    @property
    def metrics(self) -> MetricPoints:
        """The metric points of the lines the last pass noted, read once."""
        if self._metrics is None:
            self._metrics = read_metrics(self._read_metric_lines(), self.since_ns)
        return self._metrics

    def _read_metric_lines(self) -> Iterator[bytes]:
        opened: dict[Path, BinaryIO] = {}
        try:
            for path, offset, length in self._metric_lines:
                file = opened.get(path)
                if file is None:
                    file = opened[path] = _opened(path)
                file.seek(offset)
                yield file.read(length)
        finally:
            for file in opened.values():
                file.close()

    def check(self) -> None:
        """The one-line error a missing or unreadable file gives, before any reading starts."""
        for path in self.paths:
            with _opened(path):
                pass

    def batches(self) -> Iterator[list[Span]]:
        self.skipped = []
        self._metric_lines = []
        self._metrics = None
        total = sum(_size(path) for path in self.paths)
        bar = Progress(total, "llmspans report: reading") if self.progress else None
        done = 0
        try:
            for path in self.paths:
                for batch, read in _batches(path, self.skipped, self._metric_lines):
                    if bar is not None:
                        bar.update(done + read)
                    yield batch
                done += _size(path)
        finally:
            if bar is not None:
                bar.finish()


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _opened(path: Path) -> BinaryIO:
    source = str(path)
    try:
        return path.open("rb", buffering=_BUFFER)
    except FileNotFoundError:
        raise ReportInputError(f"{source}: no such file") from None
    except IsADirectoryError:
        raise ReportInputError(f"{source}: is a directory, not an OTLP-JSON file") from None
    except OSError as error:
        raise ReportInputError(f"{source}: cannot be read ({error.strerror or short(error)})") from None


def _batches(
    path: Path, skipped: list[SkippedLine], metric_lines: list[tuple[Path, int, int]]
) -> Iterator[tuple[list[Span], int]]:
    """(spans of one line, bytes read so far) for each good line of one file; where the lines that hold
    metric points are, to `metric_lines`."""
    source = str(path)
    bad: list[SkippedLine] = []
    good = blank = 0
    with _opened(path) as file:
        number = read = 0
        for line in _lines(file):
            number += 1
            read += len(line) + 1
            if not line.strip():
                blank += 1
                continue
            try:
                spans, has_metrics = decode(line)
            except msgspec.DecodeError as error:
                if not good and not bad:
                    whole = _whole_document(line, file, read)
                    if whole is not None:
                        yield _whole(source, whole), read
                        return
                bad.append(SkippedLine(source, number, f"not JSON ({short(error)})"))
                continue
            except NotOtlp as error:
                bad.append(SkippedLine(source, number, f"not OTLP JSON ({error})"))
                continue
            good += 1
            if has_metrics:
                metric_lines.append((path, read - len(line) - 1, len(line)))
            if spans:
                yield spans, read
    if not good:
        if not bad:
            raise ReportInputError(f"{source}: empty file, no OTLP-JSON lines in it")
        first = bad[0]
        more = f" (and {len(bad) - 1} more lines like it)" if len(bad) > 1 else ""
        raise ReportInputError(f"{source}: not OTLP JSON: line {first.line} is {first.reason}{more}")
    skipped.extend(bad)


def _lines(file: BinaryIO) -> Iterator[bytes]:
    """The file's lines without their line ends, read in large blocks (faster than `readline` on
    lines of a few hundred KB); a caller may `seek` between lines, and reading goes on from there."""
    rest = b""
    while True:
        block = file.read(_BLOCK)
        if not block:
            break
        lines = (rest + block).split(b"\n")
        rest = lines.pop()
        for line in lines:
            position = file.tell()
            yield line
            if file.tell() != position:  # the caller moved: drop what was buffered
                rest = b""
                break
    if rest:
        yield rest


def _whole_document(first: bytes, file: BinaryIO, read: int) -> bytes | None:
    """The whole file when its first line alone is not JSON but the whole text is (pretty-printed JSON);
    else None, and the file is left at the line after the first."""
    file.seek(read)
    rest = file.read()
    if not rest.strip():
        file.seek(read)
        return None
    text = first + b"\n" + rest
    try:
        msgspec.json.decode(text)
    except msgspec.DecodeError:
        file.seek(read)
        return None
    return text


def _whole(source: str, text: bytes) -> list[Span]:
    try:
        return spans_of_json(text) or []
    except NotOtlp as error:
        raise ReportInputError(f"{source}: not OTLP JSON ({error})") from None
