"""What the levers did, from the spans: prompt caps (`max_prompt_tokens`), cache lookups and hedged requests.

A capped call carries `llmspans.prompt.over_cap` (and, once the server counted its prompt, the estimate
over that count); a cache lookup is a `cache` stage span with its cache's name, hit or miss and, on a hit,
the estimate of the LLM time it saved; a call a hedge could send twice carries `llmspans.hedge.fired`, and
each of its copies is an attempt span under it with its role and its own time to a first token. The
figures and their method: docs/report.md.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from llmspans import _names as names
from llmspans.report._model import CacheRow, Distribution, Hedging, PromptCaps
from llmspans.report._spans import Span
from llmspans.report._traces import Trace

_FIRST_TOKEN = names.BUCKETS.index("first_token")
_NUMBERS = (int, float)


@dataclass
class PromptCapCollector:
    """The capped calls, one at a time."""

    calls: int = 0
    over: int = 0
    refused: int = 0
    first_token_over: array[int] = field(default_factory=lambda: array("q"))
    first_token_under: array[int] = field(default_factory=lambda: array("q"))
    ratios: list[float] = field(default_factory=list)
    estimators: set[str] = field(default_factory=set)

    def add(self, call: Span, failed: bool) -> None:
        attributes = call.attributes
        over = attributes.get(names.PROMPT_OVER_CAP)
        if not isinstance(over, bool):
            return
        self.calls += 1
        self.over += over
        if attributes.get(names.ERROR_TYPE) == names.ERROR_PROMPT_TOO_LARGE:
            self.refused += 1
        elif not failed:  # sent and answered: its first_token is the server's prefill and queue
            (self.first_token_over if over else self.first_token_under).append(call.buckets_ns[_FIRST_TOKEN])
        ratio: Any = attributes.get(names.PROMPT_ESTIMATE_RATIO)
        if type(ratio) in _NUMBERS:
            self.ratios.append(float(ratio))
        estimator = attributes.get(names.PROMPT_ESTIMATOR)
        if isinstance(estimator, str):
            self.estimators.add(estimator)

    def result(self) -> PromptCaps | None:
        if not self.calls:
            return None
        return PromptCaps(
            calls=self.calls,
            over=self.over,
            refused=self.refused,
            first_token_over=_distribution(self.first_token_over),
            first_token_under=_distribution(self.first_token_under),
            estimate_ratio=Distribution.of(self.ratios) if self.ratios else None,
            estimators=tuple(sorted(self.estimators)),
        )


def _distribution(values: array[int]) -> Distribution | None:
    return Distribution.of_nanoseconds(values) if values else None


@dataclass
class _Cache:
    lookups: int = 0
    hits: int = 0
    errors: int = 0
    saved_ns: int = 0
    hits_estimated: int = 0
    durations: array[int] = field(default_factory=lambda: array("q"))
    # The request each lookup ran in (its turn, else its trace): its duration, and whether it had a hit.
    requests: dict[str, tuple[int, bool]] = field(default_factory=dict)


class CacheCollector:
    """Every cache's lookups, one trace at a time; the caches with the most lookups first (then by name, so
    the order traces are handed on in changes nothing)."""

    def __init__(self) -> None:
        self._caches: dict[str, _Cache] = {}

    def add(self, trace: Trace, lookups: Sequence[Span]) -> None:
        for lookup in lookups:
            attributes = lookup.attributes
            name = attributes.get(names.CACHE_NAME)
            if not isinstance(name, str):
                continue
            cache = self._caches.get(name)
            if cache is None:
                cache = self._caches[name] = _Cache()
            hit = attributes.get(names.CACHE_HIT) is True
            cache.lookups += 1
            cache.hits += hit
            cache.errors += lookup.error
            cache.durations.append(lookup.duration_ns)
            saved: Any = attributes.get(names.CACHE_SAVED_ESTIMATE)
            if hit and type(saved) in _NUMBERS:
                cache.hits_estimated += 1
                cache.saved_ns += round(saved * 1e9)
            key, duration = _request(trace, lookup)
            seen = cache.requests.get(key)
            cache.requests[key] = (duration, hit or (seen is not None and seen[1]))

    def result(self) -> tuple[CacheRow, ...]:
        rows = []
        for name, cache in sorted(self._caches.items(), key=lambda item: (-item[1].lookups, item[0])):
            with_hit = [duration for duration, hit in cache.requests.values() if hit]
            with_miss = [duration for duration, hit in cache.requests.values() if not hit]
            rows.append(
                CacheRow(
                    name=name,
                    lookups=cache.lookups,
                    hits=cache.hits,
                    errors=cache.errors,
                    saved_s=cache.saved_ns / 1e9,
                    hits_estimated=cache.hits_estimated,
                    lookup=Distribution.of_nanoseconds(cache.durations),
                    with_hit=Distribution.of_nanoseconds(with_hit) if with_hit else None,
                    with_miss=Distribution.of_nanoseconds(with_miss) if with_miss else None,
                )
            )
        return tuple(rows)


@dataclass
class HedgeCollector:
    """The calls of hedged clients, one trace at a time."""

    calls: int = 0
    fired: int = 0
    backup_won: int = 0
    skipped: int = 0
    input_tokens: int = 0
    wasted_input: int = 0
    wasted_output: int = 0
    after: list[float] = field(default_factory=list)
    first_token: array[int] = field(default_factory=lambda: array("q"))
    primaries_first: array[int] = field(default_factory=lambda: array("q"))
    primaries_cut: array[int] = field(default_factory=lambda: array("q"))

    def add(self, trace: Trace, calls: Sequence[Span]) -> None:
        children: dict[str, list[Span]] | None = None
        for call in calls:
            attributes = call.attributes
            fired = attributes.get(names.HEDGE_FIRED)
            if not isinstance(fired, bool):
                continue
            self.calls += 1
            self.input_tokens += _count(attributes.get(names.GEN_AI_USAGE_INPUT_TOKENS))
            after: Any = attributes.get(names.HEDGE_AFTER)
            if type(after) in _NUMBERS:
                self.after.append(float(after))
            self.skipped += isinstance(attributes.get(names.HEDGE_SKIPPED), str)
            if not fired:
                continue
            self.fired += 1
            self.backup_won += attributes.get(names.HEDGE_WON_BY) == names.HEDGE_ROLE_BACKUP
            self.wasted_input += _count(attributes.get(names.HEDGE_WASTED_INPUT_TOKENS))
            self.wasted_output += _count(attributes.get(names.HEDGE_WASTED_OUTPUT_TOKENS))
            self.first_token.append(call.buckets_ns[_FIRST_TOKEN])
            if children is None:
                children = {}
                for span in trace.spans:
                    if span.parent_id is not None and names.HEDGE_ROLE in span.attributes:
                        children.setdefault(span.parent_id, []).append(span)
            own = _primary_own(children.get(call.span_id, ()))
            if own is not None:
                (self.primaries_cut if own[1] else self.primaries_first).append(own[0])

    def result(self) -> Hedging | None:
        if not self.calls:
            return None
        return Hedging(
            calls=self.calls, fired=self.fired, backup_won=self.backup_won, skipped=self.skipped,
            after=Distribution.of(self.after) if self.after else None,
            first_token=_distribution(self.first_token), primaries_first=_distribution(self.primaries_first),
            primaries_cut=_distribution(self.primaries_cut), input_tokens=self.input_tokens,
            wasted_input_tokens=self.wasted_input, wasted_output_tokens=self.wasted_output,
        )  # fmt: skip


def _count(value: Any) -> int:
    return value if type(value) is int and value > 0 else 0


def _primary_own(copies: Sequence[Span]) -> tuple[int, bool] | None:
    """A hedged call's primary, its own time to a first token in ns, and whether it was cut before one (then
    the time it had waited, from its first attempt's start to its last attempt's end)."""
    primaries = [span for span in copies if span.attributes.get(names.HEDGE_ROLE) == names.HEDGE_ROLE_PRIMARY]
    if not primaries:
        return None
    for span in primaries:
        reached: Any = span.attributes.get(names.HEDGE_FIRST_TOKEN)
        if type(reached) in _NUMBERS:
            return round(reached * 1e9), False
    return max(span.end_ns for span in primaries) - min(span.start_ns for span in primaries), True


def _request(trace: Trace, lookup: Span) -> tuple[str, int]:
    """The request a lookup ran in: the outermost turn above it, else its whole trace."""
    turn: Span | None = None
    ancestor = trace.marked_ancestor(lookup)
    while ancestor is not None:
        if ancestor.stage == names.STAGE_TURN:
            turn = ancestor
        ancestor = trace.marked_ancestor(ancestor)
    if turn is not None:
        return turn.span_id, turn.duration_ns
    return trace.trace_id, trace.duration_ns
