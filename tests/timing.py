"""Shared help for tests that compare client timings with a server's known delays."""

from __future__ import annotations

import functools
import inspect
import json
import sys
import time
from typing import Any

import pytest

from llmspans import _names as names
from llmspans.testing import Captured

# Each bucket is compared with what the server actually did (its own stamps, same clock):
# arrival-to-arrival figures (stream, gaps) within EXACT; figures that also hold the client's
# own work (building the request before it leaves, which first_token and retry include by
# design) from the server's figure up to CLIENT_SIDE more. And with the delays the server was
# told to use within TOLERANCE (a loaded 2-core box oversleeps; its stamps show by how much).


def retried(test: Any, attempt: int, error: AssertionError) -> None:
    """Say so when a run is retried (shown with `-s` or in a failure's captured output): a test that
    passes only on its second run is worth knowing about."""
    first_line = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
    # The process's own stderr: a test may capture and read its own output (capsys) for what it checks.
    print(
        f"\n[retry_timing] {test.__name__}: run {attempt + 1} failed, retried: {first_line}",
        file=sys.__stderr__ or sys.stderr,
    )


def retry_timing(test: Any) -> Any:
    """Run a timing test up to three times: a scheduler hiccup on a loaded 2-core machine can
    delay one stamp by several ms, but a systematic error (a stamp taken at the wrong point)
    fails every run. Fixtures are reused; the records are cleared between runs."""

    def reset(kwargs: dict[str, Any]) -> None:
        for fixture in ("captured", "server", "receiver"):
            if fixture in kwargs:
                kwargs[fixture].clear()

    def again(attempt: int, error: AssertionError, kwargs: dict[str, Any]) -> None:
        """A run failed: raise on the last, else say so and clear the records for the next."""
        if attempt == 2:
            raise error
        retried(test, attempt, error)
        reset(kwargs)

    if inspect.iscoroutinefunction(test):

        @functools.wraps(test)
        async def async_wrapper(*args: Any, **kwargs: Any) -> None:
            for attempt in range(3):
                try:
                    return await test(*args, **kwargs)
                except AssertionError as error:
                    again(attempt, error, kwargs)

        return async_wrapper

    @functools.wraps(test)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        for attempt in range(3):
            try:
                return test(*args, **kwargs)
            except AssertionError as error:
                again(attempt, error, kwargs)

    return wrapper


EXACT = 0.004
CLIENT_SIDE = 0.010
TOLERANCE = 0.030


def attempt_spans(captured: Captured) -> list[Any]:
    return [s for s in captured.spans if s.name == "POST"]


def bucket(span: Any, name: str) -> float:
    return float(span.attributes[names.BUCKET_PREFIX + name])


def assert_client_view(measured: float, server_view: float, observed: float = 0.0) -> None:
    """`measured` holds what the server did and the client's own work around it: at least the server's
    figure, at most it plus CLIENT_SIDE. `observed`: what more the test saw this run take, where it can
    see it: the client's time before the server saw the request (a cold client builds its first request
    slowly), how late a busy machine ran the server's own timed writes (`late`)."""
    assert server_view - 0.001 <= measured <= server_view + observed + CLIENT_SIDE, (
        measured, server_view, observed,
    )  # fmt: skip


class Arrivals:
    """When the app had each content chunk in its hands (`perf_counter_ns`): the latest instant the
    client can have stamped its arrival. With the server's due times (the earliest it can have been
    read), every stamp is bounded on both sides by what this very run did, busy machine or not."""

    def __init__(self) -> None:
        self.ns: list[int] = []

    def mark(self, count: int = 1) -> None:
        now = time.perf_counter_ns()
        self.ns.extend([now] * count)


def assert_stream_stamps(span: Any, served: Any, arrivals: Arrivals) -> None:
    """The span's stream bucket and inter-chunk figures lie where chunks stamped at their arrival put
    them: chunk i read no earlier than it was due (`served.chunk_due_ns`), no later than the app had it.
    On a quiet machine the two sides are a fraction of a millisecond apart; a stamp taken anywhere else
    (at the stream's end, at a later parse) falls outside."""
    due, got = served.chunk_due_ns, arrivals.ns
    assert len(got) == len(due), (len(got), len(due))
    ns = 1e-9
    stream = bucket(span, "stream")
    assert (due[-1] - got[0]) * ns - 1e-6 <= stream <= (got[-1] - due[0]) * ns + 1e-6, (stream, due, got)
    low = sorted(max(0, due[i + 1] - got[i]) for i in range(len(due) - 1))
    high = sorted(got[i + 1] - due[i] for i in range(len(due) - 1))
    attrs = span.attributes
    assert low[-1] * ns - 1e-6 <= attrs[names.ITL_MAX] <= high[-1] * ns + 1e-6
    middle = len(low) // 2  # the sketch's p50 is within 1/16 of the middle gap
    assert (
        low[middle] * ns * (1 - 1 / 16) - 1e-6
        <= attrs[names.ITL_P50]
        <= high[middle] * ns * (1 + 1 / 16) + 1e-6
    )


def content_events(buffer: bytearray, piece: bytes) -> int:
    """SSE content events completed by `piece` (appended to `buffer`): what a bytes reader counts."""
    buffer += piece
    *done, rest = bytes(buffer).split(b"\n\n")
    buffer[:] = rest
    return sum(1 for event in done if b'"content":"' in event and b'"content":""' not in event)


def late(served: Any) -> float:
    """Seconds by which a busy machine delayed the server's own timed writes in this exchange: the
    client's threads share the machine, so a figure compared across the two may be off by as much."""
    return float(getattr(served, "late_ns", 0)) * 1e-9


class Window:
    """The app's own view of a call: from just before it to just after it returned (a `with` block)."""

    start_ns = end_ns = 0

    def __enter__(self) -> Window:
        self.start_ns = time.perf_counter_ns()
        return self

    def __exit__(self, *_: object) -> None:
        self.end_ns = time.perf_counter_ns()

    def beyond(self, server_view: float) -> float:
        """Seconds the app's call took beyond the server's own figure: the client's work and, on a busy
        machine, its threads' wait for a core. A client-side figure may exceed the server's by as much."""
        return max(0.0, (self.end_ns - self.start_ns) * 1e-9 - server_view)


def assert_buckets_sum_to_duration(span: Any) -> None:
    total = sum(bucket(span, b) for b in names.BUCKETS)
    assert total == pytest.approx((span.end_time - span.start_time) * 1e-9, abs=2e-6)


def all_exported_text(captured: Captured) -> str:
    """Every span name, span and event attribute and metric attribute, as text to scan for secrets."""
    parts = []
    for span in captured.spans:
        parts.append(span.name)
        parts.append(json.dumps(dict(span.attributes or {}), default=str))
        for event in span.events:
            parts.append(json.dumps(dict(event.attributes or {}), default=str))
    for point in captured.metric_points():
        parts.append(json.dumps(dict(point.attributes), default=str))
    return "\n".join(parts)
