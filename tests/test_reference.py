"""docs/telemetry.md is the contract: it lists exactly what a real run emits, no more and no less.

The run (tests/support/workload.py) exercises every path that adds a span, attribute, event or metric;
its spans and its metrics, encoded as OTLP, are compared with the tables of the page, span kind by span
kind. Every name on the page is also one `llmspans._names` defines, and every telemetry name defined
there is on the page, so neither can drift from the other.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind

from llmspans import _names as names
from tests.support.workload import Exercised, exercise

DOC = Path(__file__).resolve().parents[1] / "docs" / "telemetry.md"

CALL = "On the LLM call span"
ATTEMPT = "On an HTTP attempt span"
PHASE = "On a phase span"
STAGES = "On stage, retrieval, tool and turn spans"


def tables(text: str) -> dict[str, list[list[str]]]:
    """Each heading's table rows (cells stripped), header and rule rows left out."""
    found: dict[str, list[list[str]]] = {}
    heading = ""
    for line in text.splitlines():
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        elif line.startswith("|") and not re.fullmatch(r"\|[\s|:-]+\|", line):
            found.setdefault(heading, []).append([cell.strip() for cell in line.strip("|").split(" | ")])
    return {heading: rows[1:] for heading, rows in found.items()}  # rows[0] is the header


def quoted(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def pattern(documented: str) -> re.Pattern[str]:
    """`llmspans.turn.stage.{stage}` or `{operation} {model}` as a regular expression."""
    return re.compile(
        "".join(
            ".+" if part.startswith("{") else re.escape(part) for part in re.split(r"(\{\w+\})", documented)
        )
    )


def matches(documented: Iterable[str], emitted: str) -> bool:
    return any(pattern(name).fullmatch(emitted) for name in documented)


@pytest.fixture(scope="module")
def doc() -> dict[str, list[list[str]]]:
    return tables(DOC.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def run() -> Exercised:
    return exercise()


def is_call(span: ReadableSpan) -> bool:
    return (span.attributes or {}).get(names.STAGE) == names.STAGE_LLM


def is_attempt(span: ReadableSpan) -> bool:
    return span.kind is SpanKind.CLIENT and not is_call(span)


def is_phase(span: ReadableSpan) -> bool:
    return names.PHASE in (span.attributes or {})


def is_stage(span: ReadableSpan) -> bool:
    return span.kind is SpanKind.INTERNAL and not is_phase(span)


KINDS_OF_SPAN: dict[str, Callable[[ReadableSpan], bool]] = {
    CALL: is_call,
    ATTEMPT: is_attempt,
    PHASE: is_phase,
    STAGES: is_stage,
}


def documented_attributes(doc: dict[str, list[list[str]]], section: str) -> set[str]:
    return {name for row in doc[section] for name in quoted(row[0])}


@pytest.mark.parametrize("section", list(KINDS_OF_SPAN))
def test_each_kind_of_span_carries_exactly_the_attributes_documented_for_it(
    doc: dict[str, list[list[str]]], run: Exercised, section: str
) -> None:
    documented = documented_attributes(doc, section)
    spans = [span for span in run.spans if KINDS_OF_SPAN[section](span)]
    assert spans, section
    emitted = {key for span in spans for key in (span.attributes or {})}
    assert not {key for key in emitted if not matches(documented, key)}, "emitted, not documented"
    assert not {name for name in documented if not any(pattern(name).fullmatch(key) for key in emitted)}, (
        "documented, never emitted by the run: exercise it in tests/support/workload.py"
    )


def test_every_span_name_and_kind_is_documented(doc: dict[str, list[list[str]]], run: Exercised) -> None:
    rows = [(quoted(row[0])[0], row[1]) for row in doc["Spans"]]
    for span in run.spans:
        assert any(pattern(name).fullmatch(span.name) and kind == span.kind.name for name, kind in rows), (
            span.name,
            span.kind,
        )
    for name, kind in rows:
        assert any(pattern(name).fullmatch(span.name) and span.kind.name == kind for span in run.spans), name


def test_every_event_is_documented_with_its_attributes(
    doc: dict[str, list[list[str]]], run: Exercised
) -> None:
    documented = {quoted(row[0])[0]: set(quoted(row[2])) for row in doc["Events"]}
    emitted: dict[str, set[str]] = {}
    for span in run.spans:
        for event in span.events:
            emitted.setdefault(event.name, set()).update(event.attributes or {})
    assert emitted == documented


def metric_rows(doc: dict[str, list[list[str]]]) -> dict[str, tuple[str, str, set[str], set[str]]]:
    """name -> (kind, unit, attributes always present, attributes present when they apply)."""
    rows = {}
    for name, kind, unit, attributes, _what in doc["Metrics"]:
        always, _, optional = attributes.partition("(")
        rows[quoted(name)[0]] = (kind, unit, set(quoted(always)), set(quoted(optional)))
    return rows


def _kind(metric: Any) -> str:
    data = metric.WhichOneof("data")
    if data == "sum":
        return "counter" if metric.sum.is_monotonic else "updowncounter"
    return str(data)


def test_every_metric_has_its_documented_kind_unit_and_attributes(
    doc: dict[str, list[list[str]]], run: Exercised
) -> None:
    documented = metric_rows(doc)
    seen = set()
    for resource_metrics in run.metrics.resource_metrics:
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                seen.add(metric.name)
                kind, unit, always, optional = documented[metric.name]
                assert (_kind(metric), metric.unit) == (kind, unit), metric.name
                points = getattr(metric, metric.WhichOneof("data")).data_points
                for point in points:
                    keys = {attribute.key for attribute in point.attributes}
                    assert always <= keys <= always | optional, (metric.name, keys)
    assert seen == set(documented)


def telemetry_names() -> set[str]:
    """What `_names` defines that a span, event or metric is called or carries (not env vars, not
    Prometheus series, not values)."""
    return {
        value
        for key, value in vars(names).items()
        if key.isupper() and isinstance(value, str) and re.fullmatch(r"[a-z_]+(\.[a-z0-9_]+)+", value)
    }


def test_every_name_on_the_page_is_defined_and_every_defined_name_is_on_the_page() -> None:
    text = DOC.read_text(encoding="utf-8")
    on_page = {name for name in quoted(text) if re.fullmatch(r"[a-z_]+(\.[a-z0-9_{}]+)+", name)}
    defined = telemetry_names() | set(names.BUCKET_ATTRIBUTES)
    defined_patterns = {names.TURN_STAGE_PREFIX + "{stage}"}
    undefined = {name for name in on_page - defined - defined_patterns if not matches(defined_patterns, name)}
    assert undefined == set(), "on the page, not in llmspans._names"
    assert defined - on_page == set(), "in llmspans._names, not on the page"


def test_the_page_check_catches_an_undocumented_attribute(doc: dict[str, list[list[str]]]) -> None:
    """Guard for the parser: a name missing from the page is seen as missing."""
    documented = documented_attributes(doc, CALL)
    assert names.LIMITER_WAIT in documented
    assert names.BUCKET_PREFIX + "stream" in documented
    assert not matches(documented - {names.LIMITER_WAIT}, names.LIMITER_WAIT)
    assert matches(documented_attributes(doc, STAGES), names.TURN_STAGE_PREFIX + "retrieval")
    assert len(metric_rows(doc)) >= 16
