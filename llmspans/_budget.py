"""Budgets: time allowances per stage, LLM call or turn, and what happens when one is spent.

Budgets come from three places, most specific first: the `budget=` argument of a
decorator, `instrument()` or `turn()`; `configure(budgets=...)`; the `LLMSPANS_BUDGETS`
environment variable. They are seconds everywhere inside llmspans.
"""

from __future__ import annotations

import math
import os
import re
import threading
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple, overload

from llmspans import _names as names

OnExceed = Literal["record", "cancel"]
ON_EXCEED_CHOICES: tuple[OnExceed, ...] = ("record", "cancel")

_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "us": 1e-6, "µs": 1e-6}
_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(ms|us|µs|s|m)?\s*$")


class BudgetExceeded(Exception):
    """Raised by a stage with `on_exceed="cancel"` when its work outlives its budget."""

    def __init__(self, stage: str, budget: float, elapsed: float) -> None:
        super().__init__(f"stage '{stage}' exceeded its budget of {budget:g}s (cut at {elapsed:.3f}s)")
        self.stage = stage
        self.budget = budget
        self.elapsed = elapsed


class Percentile(NamedTuple):
    """A percentile of recent durations, as given: `"p95"` is `Percentile("p95", 0.95)`."""

    name: str
    q: float


class NotADuration(TypeError, ValueError):
    """A value that is no duration at all (None, a bool, a list): a TypeError, and the ValueError that
    budgets have always raised."""


_PERCENTILE = re.compile(r"^\s*[pP](\d+(?:\.\d+)?)\s*$")


@overload
def parse_duration(value: object, *, what: str, percentiles: Literal[False] = False) -> float: ...
@overload
def parse_duration(value: object, *, what: str, percentiles: bool) -> float | Percentile: ...
def parse_duration(value: object, *, what: str, percentiles: bool = False) -> float | Percentile:
    """Positive seconds from `0.3`, `300`, `"300ms"`, `"1.6s"`, `"250us"` or `"2m"`; with `percentiles`, also
    a percentile of recent durations from `"p50"` to `"p99.9"`. The one parser of every duration llmspans
    takes (budgets, `Hedge(after=...)`, `TailSampling(slower_than=...)`), with one error message."""
    if isinstance(value, str):
        if percentiles:
            found = _PERCENTILE.match(value)
            if found is not None:
                percentile = float(found.group(1))
                if 50 <= percentile < 100:
                    return Percentile(f"p{percentile:g}", percentile / 100)
                raise ValueError(_duration_error(value, what, percentiles))
        match = _DURATION.match(value)
        seconds = float(match.group(1)) * _UNITS[match.group(2) or "s"] if match else None
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise NotADuration(_duration_error(value, what, percentiles))
    if seconds is None or not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(_duration_error(value, what, percentiles))
    return seconds


def _duration_error(value: object, what: str, percentiles: bool) -> str:
    if percentiles:
        return (
            f"{what} must be seconds or a percentile: a positive number of seconds (2.5), a duration "
            f"('2500ms', '2.5s'), or a percentile of recent durations from p50 to p99.9 ('p95'); got {value!r}"
        )
    return (
        f"{what} must be a positive number of seconds (2.5) or a duration ('2500ms', '2.5s'); got {value!r}"
    )


def parse_seconds(value: object, *, what: str) -> float:
    """`parse_duration` where only a duration will do (a budget): positive seconds, or say what to pass."""
    return parse_duration(value, what=what)


def parse_budgets(spec: str | Mapping[str, object], *, source: str = "budgets") -> dict[str, float]:
    """Parse `{"retrieval": 0.3}` or `"retrieval=300ms,llm=1.6s"` into seconds per stage name."""
    if isinstance(spec, str):
        items: list[tuple[object, object]] = []
        for entry in filter(None, (part.strip() for part in spec.split(","))):
            name, sep, value = entry.partition("=")
            if not sep or not name.strip():
                raise ValueError(f"{source}: entry {entry!r} must look like 'stage=300ms'")
            items.append((name.strip(), value.strip()))
    elif isinstance(spec, Mapping):
        items = list(spec.items())
    else:
        raise TypeError(
            f"{source} must be a mapping like {{'retrieval': 0.3}} or a string like 'retrieval=300ms', "
            f"got {type(spec).__name__}"
        )
    parsed: dict[str, float] = {}
    for key, amount in items:
        stage = key if isinstance(key, str) else ""
        if not stage:
            raise ValueError(f"{source}: stage names must be non-empty strings, got {key!r}")
        parsed[stage] = parse_seconds(amount, what=f"{source}: budget for {stage!r}")
    return parsed


def check_on_exceed(on_exceed: object) -> OnExceed:
    for choice in ON_EXCEED_CHOICES:
        if on_exceed == choice:
            return choice
    raise ValueError(f"on_exceed must be one of {ON_EXCEED_CHOICES}, got {on_exceed!r}")


class BudgetRegistry:
    """The budgets in force per stage name; also the source of the `llmspans.stage.budget` gauge."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._configured: dict[str, float] = {}
        self._env_loaded = False
        self._seen: dict[str, float] = {}

    def configure(self, budgets: Mapping[str, float]) -> None:
        with self._lock:
            self._configured.update(budgets)

    def _load_env(self) -> None:
        raw = os.environ.get(names.ENV_BUDGETS)
        env = parse_budgets(raw, source=names.ENV_BUDGETS) if raw else {}
        with self._lock:
            for stage, seconds in env.items():
                self._configured.setdefault(stage, seconds)
            self._env_loaded = True

    def resolve(self, stage: str, explicit: float | None) -> float | None:
        """The budget for one span: its own, else the configured one for its stage name."""
        if not self._env_loaded:
            self._load_env()
        budget = explicit if explicit is not None else self._configured.get(stage)
        if budget is not None and self._seen.get(stage) != budget:
            with self._lock:
                self._seen[stage] = budget
        return budget

    def current(self) -> dict[str, float]:
        """Every budget known: configured ones and those last used on a span, by stage name."""
        if not self._env_loaded:
            self._load_env()
        with self._lock:
            return {**self._seen, **self._configured}

    def reset(self) -> None:
        with self._lock:
            self._configured.clear()
            self._seen.clear()
            self._env_loaded = False


registry = BudgetRegistry()


def seconds(ns: int) -> float:
    """Seconds from nanoseconds with no float noise: `98314 ns` is `9.8314e-05`, not `9.831400000000001e-05`.

    Division by the exactly representable 1e9 rounds once, to the double nearest the decimal.
    """
    return ns / 1e9


def exceeded(budget: float, elapsed_ns: int) -> bool:
    """Whether `elapsed_ns` went over `budget` seconds (what `record_on_span` writes, without a span)."""
    return elapsed_ns > round(budget * 1e9)


def record_on_span(span: Any, budget: float | None, elapsed_ns: int) -> bool:
    """Write the budget attributes on `span` (when it records), and an event at the instant an exceeded
    budget ran out (a mark on the bar); True when the budget was exceeded. `span` may be what a held span
    collects its owner's end in (`_held_span.SpanFacts`)."""
    if budget is None:
        return False
    budget_ns = round(budget * 1e9)
    exceeded = elapsed_ns > budget_ns
    if span.is_recording():
        span.set_attributes(
            {
                names.BUDGET: budget,
                names.BUDGET_EXCEEDED: exceeded,
                names.BUDGET_OVERRUN: seconds(elapsed_ns - budget_ns) if exceeded else 0.0,
            }
        )
        started = getattr(span, "start_time", None)  # an SDK span's start, on the epoch clock
        if exceeded and isinstance(started, int):
            span.add_event(names.EVENT_BUDGET_EXCEEDED, {names.BUDGET: budget}, started + budget_ns)
    return exceeded
