"""Phase spans: where a slow call's time went, drawn as bars under its span.

A call someone will look at (over its budget, or slower than `slow_after`) gets, at its end, one
INTERNAL child span per phase that lasted at least `FLOOR_NS`: waiting for a limiter slot, each
back-off between attempts, connecting, waiting for the first token, streaming, and the tail after
the last token. They are made after the fact from the call's own monotonic stamps (the instants the
buckets come from), with their real start and end, so nothing runs while the call is under way and
a fast call pays one comparison at its end. Each carries `llmspans.phase` (the bucket it shows) and
never `llmspans.stage`, so the report walks through them.

`phase_spans="slow"` (the default), `"always"` or `"never"`: per client (`instrument()`), for the
process (`configure()`), or from `LLMSPANS_PHASE_SPANS`; the threshold from `configure(slow_after=)`
or `LLMSPANS_SLOW_AFTER` (docs/telemetry.md).
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Sequence
from typing import Any, Protocol

from opentelemetry import trace
from opentelemetry.trace import SpanKind
from opentelemetry.util.types import AttributeValue

from llmspans import _budget, _telemetry
from llmspans import _names as names


class Timed(Protocol):
    """What phase spans are drawn from: a call record's instants, attempts and span (`_call.CallRecord`)."""

    @property
    def stream(self) -> bool: ...
    @property
    def span(self) -> Any: ...
    @property
    def attempts(self) -> Sequence[Any]: ...

    def instants_ns(self, released_ns: int, outcome: str = ...) -> tuple[int, ...]: ...
    def wall_ns(self, monotonic_ns: int) -> int: ...


logger = logging.getLogger("llmspans")

CHOICES = (names.PHASE_SPANS_SLOW, names.PHASE_SPANS_ALWAYS, names.PHASE_SPANS_NEVER)
FLOOR_NS = 1_000_000
"""A phase shorter than this (1 ms) gets no span: too short to see on a waterfall of a slow call."""
DEFAULT_SLOW_AFTER_S = 2.0
"""A call slower than this (without a budget, or within it) counts as slow."""


def check(value: object, what: str = "phase_spans") -> str | None:
    """One of `CHOICES` (the constant itself), None for "not said", or a ValueError saying what to pass."""
    if value is None:
        return None
    for choice in CHOICES:
        if value == choice:
            return choice
    raise ValueError(
        f"{what} must be 'slow' (phase spans for calls over their budget or slow_after), 'always' or "
        f"'never', got {value!r}"
    )


def check_slow_after(value: object, what: str = "slow_after") -> float | None:
    return None if value is None else _budget.parse_seconds(value, what=what)


def _from_environment() -> tuple[str, int]:
    """The environment's settings; a bad value is said once and the default used (never an import error)."""
    chosen, slow_after = names.PHASE_SPANS_SLOW, DEFAULT_SLOW_AFTER_S
    raw_mode = os.environ.get(names.ENV_PHASE_SPANS, "").strip().lower()
    raw_slow_after = os.environ.get(names.ENV_SLOW_AFTER, "").strip()
    try:
        chosen = check(raw_mode or None, names.ENV_PHASE_SPANS) or chosen
        slow_after = check_slow_after(raw_slow_after or None, names.ENV_SLOW_AFTER) or slow_after
    except ValueError as error:
        logger.warning("llmspans: %s; using the default", error)
    return chosen, round(slow_after * 1e9)


# Read on every call's end (module attributes: one lookup each). `configure()` sets them.
mode, slow_after_ns = _from_environment()


def configure(phase_spans: str | None, slow_after: float | None) -> None:
    """`configure(phase_spans=..., slow_after=...)`, checked already; None leaves a setting as it is."""
    global mode, slow_after_ns
    if phase_spans is not None:
        mode = phase_spans
    if slow_after is not None:
        slow_after_ns = round(slow_after * 1e9)


def reset() -> None:
    """Back to the environment's settings (tests)."""
    global mode, slow_after_ns
    mode, slow_after_ns = _from_environment()


_QUEUE, _RETRY, _CONNECT, _FIRST_TOKEN, _STREAM, _POST = names.BUCKETS  # a phase is named by its bucket


def write(record: Timed, outcome: str, released_ns: int) -> None:
    """The call's phase spans, children of its span, each at least `FLOOR_NS` long."""
    called, built, admitted, first_start, final_start, connected, first, last, released = record.instants_ns(
        released_ns, outcome
    )
    streamed = record.stream
    # The SDK building the request, and the client's own work between admission and the first attempt:
    # both in `first_token` (the client had not sent yet, but it was not a queue either). One bar when
    # no queue wait stands between them.
    phases: list[tuple[str, int, int, dict[str, AttributeValue]]]
    if admitted - built < FLOOR_NS:
        phases = [(names.PHASE_SPAN_PREPARE, called, first_start, {names.PHASE: _FIRST_TOKEN})]
    else:
        phases = [
            (names.PHASE_SPAN_PREPARE, called, built, {names.PHASE: _FIRST_TOKEN}),
            (names.PHASE_SPAN_QUEUE, built, admitted, {names.PHASE: _QUEUE}),
            (names.PHASE_SPAN_PREPARE, admitted, first_start, {names.PHASE: _FIRST_TOKEN}),
        ]
    attempts = record.attempts
    for failed, following in itertools.pairwise(attempts):
        if failed.ended_ns is None:
            continue
        cause = failed.cause or "unknown"
        attributes: dict[str, AttributeValue] = {names.PHASE: _RETRY, names.RETRY_CAUSE: cause}
        if failed.status is not None:
            attributes[names.HTTP_RESPONSE_STATUS_CODE] = failed.status
        phases.append(
            (names.PHASE_SPAN_BACKOFF.format(cause=cause), failed.ended_ns, following.started_ns, attributes)
        )
    phases += [
        (names.PHASE_SPAN_CONNECT, final_start, connected, {names.PHASE: _CONNECT}),
        (
            names.PHASE_SPAN_FIRST_TOKEN if streamed else names.PHASE_SPAN_RESPONSE,
            connected,
            first,
            {names.PHASE: _FIRST_TOKEN},
        ),
        (names.PHASE_SPAN_STREAM, first, last, {names.PHASE: _STREAM}),
        (
            names.PHASE_SPAN_POST if streamed else names.PHASE_SPAN_POST_RESPONSE,
            last,
            released,
            {names.PHASE: _POST},
        ),
    ]
    tracer = _telemetry.tracer()
    parent = trace.set_span_in_context(record.span)
    for name, start, end, attributes in phases:
        if end - start < FLOOR_NS:
            continue
        span = tracer.start_span(
            name,
            context=parent,
            kind=SpanKind.INTERNAL,
            attributes=attributes,
            start_time=record.wall_ns(start),
        )
        span.end(end_time=record.wall_ns(end))
