"""The span report's figures, gathered one whole trace at a time in memory that does not hold spans.

`Analysis.add(trace)` folds a trace into running figures: the values the quantiles need (one
duration per stage span, one value per bucket per call, one total per part per trace, three
instants per limited call) and counts; the spans themselves are dropped. `Analysis.report()` then
builds the `Report`. Where the order of the input decides something (the order of the stage rows,
which of two equally common budgets is shown, ties between causes, the slowest traces), the first
appearance in the input decides, exactly as a whole-input pass would, whatever order traces were
handed on in. The method behind each figure: docs/report.md.
"""

from __future__ import annotations

import gc
import heapq
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

from llmspans import _names as names
from llmspans.report._estimates import apart, effective_size, weighted_distribution
from llmspans.report._levers import CacheCollector, HedgeCollector, PromptCapCollector
from llmspans.report._metric_points import Counted, MetricPoints
from llmspans.report._model import (
    KIND_BUCKET,
    KIND_LEVEL,
    KIND_OTHER,
    KIND_STAGE,
    NS,
    OVER_STREAMED,
    QUANTILE_METHOD,
    BucketRow,
    Churn,
    Connections,
    Distribution,
    LevelRow,
    LimiterRow,
    Part,
    Report,
    Retries,
    SkippedLine,
    SlowTrace,
    StageRow,
    Variability,
    WaterfallRow,
    seconds_of,
)
from llmspans.report._pressure import PressureCollector
from llmspans.report._server import ServerSplitter
from llmspans.report._spans import Span
from llmspans.report._traces import (
    Batches,
    LateSpan,
    Trace,
    exact_traces,
    number,
    optimistic_traces,
)
from llmspans.report._triage import (
    CANNOT_TELL_HISTOGRAMS,
    CANNOT_TELL_TRACES,
    CANNOT_TELL_UNIFORM,
    Figures,
    triage,
)

_APP_EXCLUDED = (names.STAGE_LLM, names.STAGE_TURN)
_BUDGET, _BUDGET_EXCEEDED, _LLM = names.BUDGET, names.BUDGET_EXCEEDED, names.STAGE_LLM
_CACHE, _OVER_CAP, _HEDGE_FIRED = names.STAGE_CACHE, names.PROMPT_OVER_CAP, names.HEDGE_FIRED
_KIND_ORDER = {KIND_STAGE: 0, KIND_BUCKET: 1, KIND_OTHER: 2}
_BUCKET_ORDER = {bucket: index for index, bucket in enumerate(names.BUCKETS)}
_FIRST_TOKEN, _STREAM = names.BUCKETS.index("first_token"), names.BUCKETS.index("stream")
Order = tuple[int, ...]  # where something first appeared in the input; smaller is earlier
QUANTILE_METHOD_SAMPLED = (
    "stages and buckets: from the metrics' histograms (every call; the nearest rank's bucket, placed inside "
    "it); per-trace parts: nearest-rank over the sampled traces, weighted; each with a 95 % interval"
)
QUANTILE_METHOD_SAMPLED_PARTS = (
    "stages, buckets and the per-trace parts (one span each in every trace): from the metrics' histograms "
    "(every call; the nearest rank's bucket, placed inside it); the time outside any stage: nearest-rank "
    "over the sampled traces, weighted; each with a 95 % interval"
)


def _call_failed(span: Span) -> bool:
    return span.error or names.ERROR_TYPE in span.attributes


def _first(seen: dict[str, Order], key: str, order: Order) -> None:
    if key not in seen or order < seen[key]:
        seen[key] = order


def _by_count(counts: Mapping[str, int], seen: Mapping[str, Order]) -> dict[str, int]:
    """Most common first; equals in the order they first appeared."""
    return {key: counts[key] for key in sorted(counts, key=lambda key: (-counts[key], seen[key]))}


@dataclass
class _Stage:
    first: Order
    durations: array[int] = field(default_factory=lambda: array("q"))
    errors: int = 0
    exceeded: int = 0
    budget_counts: dict[float, int] = field(default_factory=dict)
    budget_first: dict[float, Order] = field(default_factory=dict)


@dataclass
class _Limiter:
    first: Order
    cap: int = 0
    intervals: array[int] = field(default_factory=lambda: array("q"))  # queued_at, admitted, end per call
    queue_depths: list[float] = field(default_factory=list)


@dataclass
class _Level:
    """The calls of one `llmspans load` level of one run."""

    first: Order
    durations: array[int] = field(default_factory=lambda: array("q"))
    buckets: tuple[array[int], ...] = field(default_factory=lambda: tuple(array("q") for _ in names.BUCKETS))
    failed: int = 0


def _level_value(level: str) -> float:
    """`concurrency=8` -> 8.0, to order a run's levels by load (unreadable values last)."""
    try:
        return float(level.rpartition("=")[2])
    except ValueError:
        return float("inf")


def _queued_interval(call: Span) -> tuple[int, int]:
    """When the call waited for its slot: from its start (or, when the limiter measured the wait
    itself, that long before admission) to its `llmspans.admitted` event."""
    admitted = call.start_ns
    for event in call.events:
        if event.name == names.EVENT_ADMITTED:
            admitted = min(max(event.time_ns, call.start_ns), call.end_ns)
            break
    wait = call.attributes.get(names.LIMITER_WAIT)
    if isinstance(wait, (int, float)) and not isinstance(wait, bool):
        return max(call.start_ns, admitted - round(wait * 1e9)), admitted
    return call.start_ns, admitted


class Analysis:
    """The span report, one trace at a time; `budgets` (seconds per stage name) replace the spans' own,
    `service` and `cutoff_ns` keep only the traces that involve that service and started after it."""

    def __init__(
        self,
        *,
        budgets: Mapping[str, float] | None = None,
        top: int = 5,
        service: str | None = None,
        cutoff_ns: int | None = None,
        population: int | None = None,
    ) -> None:
        self.overrides = dict(budgets or {})
        self.top = max(0, top)
        self.service = service
        self.cutoff_ns = cutoff_ns
        # How many traces the input is a uniform sample of, when the caller knows (`llmspans load`: the
        # requests of a level, some of whose spans a head sampler dropped).
        self.population = population
        self._effective: float | None = None  # the effective sample size while the report is built
        self._rooted_in_turns = True  # every trace read has a turn at its root
        # Every trace read: each part from one span (`Trace.one_span_per_part`).
        self._one_span_per_part = True
        self.traces = 0  # weighted: the traces the input stands for
        self.spans = 0
        self.read = 0  # the traces read
        self._weight_sum = self._weight_squares = 0.0
        self._stages: dict[str, _Stage] = {}
        self._buckets: dict[str, array[int]] = {bucket: array("q") for bucket in names.BUCKETS}
        self._bucket_values = tuple(self._buckets.values())
        self._parts: dict[tuple[str, str], array[int]] = {}
        self._part_first: dict[tuple[str, str], Order] = {}
        self._calls = self._successful = self._new_connections = self._reused = 0
        # Streamed calls alone: their first_token and stream (the variability), and churn by kind of call.
        self._streamed_first_token: array[int] = array("q")
        self._streamed_stream: array[int] = array("q")
        # streamed -> [calls, successful, new connections]
        self._by_kind = {True: [0, 0, 0], False: [0, 0, 0]}
        self._closed_before_end = 0
        self._attempts = self._wasted = self._retried = 0
        self._causes: dict[str, int] = {}
        self._cause_first: dict[str, Order] = {}
        self._errors: dict[str, int] = {}
        self._error_first: dict[str, Order] = {}
        self._limiters: dict[tuple[str, str], _Limiter] = {}
        self._levels: dict[tuple[str, str], _Level] = {}  # by (run id, level)
        self._server = ServerSplitter()
        self._pressure = PressureCollector()
        self._prompt_caps = PromptCapCollector()
        self._caches = CacheCollector()
        self._lookups: list[Span] = []  # the cache lookups of the trace being added
        self._hedges = HedgeCollector()
        self._hedged: list[Span] = []  # the hedged calls of the trace being added
        self._slowest: list[tuple[int, int, SlowTrace]] = []  # heap of (duration, -index, trace): worst first

    def _wanted(self, trace: Trace) -> bool:
        if not trace.marked:
            return False
        if self.service is not None and not any(span.service == self.service for span in trace.spans):
            return False
        return self.cutoff_ns is None or min(span.start_ns for span in trace.spans) >= self.cutoff_ns

    def add(self, trace: Trace) -> None:
        """Fold a trace in, as many times as it stands for (`Trace.copies`: 1 unless tail sampling gave
        it a weight), so every count and quantile below is weighted; the slowest list takes it once."""
        if not self._wanted(trace):
            return
        weight = trace.weight
        self.read += 1
        if self._rooted_in_turns and trace.marked[0].stage != names.STAGE_TURN:  # the earliest, longest span
            self._rooted_in_turns = False
        self._weight_sum += weight
        self._weight_squares += weight * weight
        copies = trace.copies() if weight != 1.0 else 1
        if not copies:
            return
        totals = trace.parts()  # once: every copy has the same
        self._one_span_per_part = self._one_span_per_part and trace.one_span_per_part
        for _ in range(copies):
            self._fold(trace, totals)
        self._consider_slowest(trace, totals)

    def _fold(self, trace: Trace, totals: dict[tuple[str, str], int]) -> None:
        self.traces += 1
        self.spans += len(trace.spans)
        index = trace.index
        for position, span in enumerate(trace.marked):
            self._add_span(span, index, position)
        if self._lookups:
            self._caches.add(trace, self._lookups)
            self._lookups.clear()
        if self._hedged:
            self._hedges.add(trace, self._hedged)
            self._hedged.clear()
        parts, part_first = self._parts, self._part_first
        for position, (key, value) in enumerate(totals.items()):
            values = parts.get(key)
            if values is None:
                values = parts[key] = array("q")
                part_first[key] = (index, position)
            elif index <= part_first[key][0] and (index, position) < part_first[key]:
                part_first[key] = (index, position)
            values.append(value)
        self._server.add(trace)

    def _add_span(self, span: Span, index: int, position: int) -> None:
        stage = span.stage
        start = span.start_ns
        row = self._stages.get(stage)  # type: ignore[arg-type]
        if row is None:
            row = self._stages[stage] = _Stage((start, index, position))  # type: ignore[index]
        elif start <= row.first[0]:
            row.first = min(row.first, (start, index, position))
        row.durations.append(span.duration_ns)
        if span.error:
            row.errors += 1
        attributes = span.attributes
        flag = attributes.get(_BUDGET_EXCEEDED)
        if _BUDGET in attributes:
            budget = attributes[_BUDGET]
            if isinstance(budget, bool) or not isinstance(budget, (int, float)):
                budget = 0.0
            budget = float(budget)
            if isinstance(flag, bool):
                row.exceeded += flag
            elif budget > 0 and span.duration_ns / 1e9 > budget:
                row.exceeded += 1
            count = row.budget_counts.get(budget)
            if count is None:
                row.budget_counts[budget] = 1
                row.budget_first[budget] = (start, index, position)
            else:
                row.budget_counts[budget] = count + 1
                if start <= row.budget_first[budget][0]:
                    row.budget_first[budget] = min(row.budget_first[budget], (start, index, position))
        elif isinstance(flag, bool):
            row.exceeded += flag
        if stage == _LLM:
            self._add_call(span, (index, position))
        elif stage == _CACHE:
            self._lookups.append(span)

    def _add_call(self, call: Span, where: tuple[int, int]) -> None:
        self._calls += 1
        if names.VLLM_NUM_REQUESTS_WAITING in call.attributes:  # stamped by a vLLM sampler
            self._pressure.add(call)
        for values, value in zip(self._bucket_values, call.buckets_ns, strict=True):
            values.append(value)
        failed = _call_failed(call)
        self._successful += not failed
        attributes = call.attributes
        if _OVER_CAP in attributes:
            self._prompt_caps.add(call, failed)
        if _HEDGE_FIRED in attributes:
            self._hedged.append(call)
        level = attributes.get(names.LOAD_LEVEL)
        if isinstance(level, str):
            self._add_level(call, level, failed, where)
        opened = int(number(call, names.CONNECT_NEW))
        self._new_connections += opened
        streamed = attributes.get(names.GEN_AI_REQUEST_STREAM) is True
        kind = self._by_kind[streamed]
        kind[0] += 1
        kind[1] += not failed
        kind[2] += opened
        if streamed:
            self._closed_before_end += attributes.get(names.STREAM_CLOSED_BEFORE_END) is True
            buckets = call.buckets_ns
            self._streamed_first_token.append(buckets[_FIRST_TOKEN])
            self._streamed_stream.append(buckets[_STREAM])
        self._reused += attributes.get(names.CONNECT_REUSED) is True
        failed_attempts = int(number(call, names.RETRY_COUNT))
        self._attempts += failed_attempts + 1
        self._retried += failed_attempts > 0
        self._wasted += int(number(call, names.RETRY_WASTED_OUTPUT_TOKENS))
        listed = attributes.get(names.RETRY_CAUSES)
        if isinstance(listed, list):
            for offset, cause in enumerate(map(str, listed)):
                self._causes[cause] = self._causes.get(cause, 0) + 1
                _first(self._cause_first, cause, (*where, offset))
        if failed:
            error = str(attributes.get(names.ERROR_TYPE, "error"))
            self._errors[error] = self._errors.get(error, 0) + 1
            _first(self._error_first, error, where)
        name = attributes.get(names.LIMITER_NAME)
        if isinstance(name, str):
            limiter = self._limiters.get((call.process, name))
            if limiter is None:
                limiter = self._limiters[(call.process, name)] = _Limiter(where)
            limiter.cap = max(limiter.cap, int(number(call, names.LIMITER_CAP)))
            queued_at, admitted = _queued_interval(call)
            limiter.intervals.extend((queued_at, admitted, call.end_ns))
            limiter.queue_depths.append(number(call, names.LIMITER_QUEUE_DEPTH))

    def _add_level(self, call: Span, level: str, failed: bool, where: tuple[int, int]) -> None:
        run = str(call.attributes.get(names.LOAD_RUN_ID, ""))
        row = self._levels.get((run, level))
        if row is None:
            row = self._levels[(run, level)] = _Level(where)
        row.durations.append(call.duration_ns)
        for values, value in zip(row.buckets, call.buckets_ns, strict=True):
            values.append(value)
        row.failed += failed

    def _consider_slowest(self, trace: Trace, totals: Mapping[tuple[str, str], int]) -> None:
        if not self.top:
            return
        key = (trace.duration_ns, -trace.index)  # longer first; of equals, the earlier in the input
        if len(self._slowest) >= self.top and key <= self._slowest[0][:2]:
            return
        entry = (*key, _slow_trace(trace, totals))
        if len(self._slowest) < self.top:
            heapq.heappush(self._slowest, entry)
        else:
            heapq.heapreplace(self._slowest, entry)

    # --- the report ---------------------------------------------------------------------------

    def report(
        self,
        *,
        sources: Sequence[str] = (),
        skipped: Sequence[SkippedLine] = (),
        metrics: Callable[[], MetricPoints | None] | None = None,
    ) -> Report:
        """The report. When the traces are a sample (tail sampling's weights, or fewer than `population`),
        every quantile read from them carries its interval; with `metrics` (the points read with them, asked
        for only then) the counts and the stage and bucket distributions come from the metrics, which counted
        every call, and the traces give what only traces carry (docs/sampling.md)."""
        weighted = self._weight_squares != self._weight_sum  # some weight was not 1
        uniform = not weighted and self.population is not None and self.population > self.read > 0
        self._effective = (
            effective_size(self._weight_sum, self._weight_squares)
            if weighted
            else float(self.read)
            if uniform
            else None
        )
        points = metrics() if weighted and metrics is not None else None
        counted = Counted.of(points, self.service) if points else None
        stages = self._stage_rows(counted)
        buckets = self._bucket_rows(counted) if self._calls or (counted is not None and counted.calls) else ()
        parts = self._part_rows()
        retries, connections = self._retries(counted), self._connections(counted)
        figures = Figures(
            variability=self._variability(),
            retries=retries,
            connections=connections,
            limiters=self._limiter_rows(),
            server=self._server.result(),
            pressure=self._pressure.result(),
            prompt_caps=self._prompt_caps.result(),
            cannot_tell=CANNOT_TELL_HISTOGRAMS
            if counted is not None
            else CANNOT_TELL_TRACES
            if weighted
            else CANNOT_TELL_UNIFORM,
        )
        notes = tuple(
            f"--budgets names stage '{stage}', which no span has"
            for stage in self.overrides
            if stage not in self._stages and (counted is None or stage not in counted.stages)
        )
        traces = self.traces
        if counted is not None and self._rooted_in_turns and names.STAGE_TURN in counted.stages:
            # Every trace read is a turn: the metrics counted every turn.
            traces = counted.stages[names.STAGE_TURN].count
        if counted is not None:
            # Where each part of a trace is one span's, the histograms give the per-trace parts too.
            from_traces = "the time outside any stage" if self._one_span_per_part else "the per-trace parts"
            notes = (
                f"sampled ({names.SAMPLE_WEIGHT}, tail sampling): counts and the stage and bucket distributions "
                f"come from the metric points read with the spans, which counted every call; the {self.read} "
                f"traces read give {from_traces}, the slowest traces and what else only traces carry, "
                f"as estimates of the whole run with 95 % intervals (effective sample size "
                f"{self._effective or 0:.0f})",
                *notes,
            )
        elif weighted:
            notes = (
                f"weighted by {names.SAMPLE_WEIGHT} (tail sampling): the {self.read} traces read stand for "
                f"{self.traces}; counts are estimated, and quantiles are estimates of the whole run with 95 % "
                f"intervals (effective sample size {self._effective or 0:.0f}); the input holds no metric "
                "points, which would count every call (configure() writes them beside the spans)",
                *notes,
            )
        elif uniform:
            notes = (
                f"sampled: {self.read} of {self.population} requests have spans; quantiles are estimates with "
                "95 % intervals",
                *notes,
            )
        levels = self._level_rows()
        decide_on = parts
        if counted is not None and self._one_span_per_part:
            decide_on = self._decided_on(counted, parts, traces)
        elif counted is not None:
            notes = (
                *notes,
                "the dominant part is per trace and a trace here holds several calls or nested stages, which the "
                "metrics count per span: it is decided on the kept traces' estimates",
            )
            figures = replace(figures, cannot_tell=CANNOT_TELL_TRACES)
        samples: dict[tuple[str, str], tuple[float, ...]] = {}
        if counted is None:
            samples = {(KIND_STAGE, row.stage): _seconds(self._stages[row.stage].durations) for row in stages}
            samples.update(
                {(KIND_BUCKET, bucket): _seconds(self._buckets[bucket]) for bucket in names.BUCKETS}
            )
        samples.update(
            {
                (KIND_LEVEL, row.label): _seconds(self._levels[(row.run_id, row.level)].durations)
                for row in levels
            }
        )
        report = Report(
            sources=tuple(sources),
            skipped=tuple(skipped),
            spans=self.spans,
            traces=traces,
            llm_calls=retries.calls,
            quantile_method=QUANTILE_METHOD
            if counted is None
            else QUANTILE_METHOD_SAMPLED_PARTS
            if decide_on is not parts
            else QUANTILE_METHOD_SAMPLED,
            stages=stages,
            buckets=buckets,
            parts=decide_on,  # the parts the verdict compares: from the histograms where they can say them
            triage=triage(decide_on, stages, figures),
            variability=figures.variability,
            connections=connections,
            retries=retries,
            limiters=figures.limiters,
            server=figures.server,
            server_pressure=figures.pressure,
            slowest=tuple(entry[2] for entry in sorted(self._slowest, reverse=True)),
            notes=notes,
            levels=levels,
            prompt_caps=figures.prompt_caps,
            caches=self._caches.result(),
            hedging=self._hedges.result(),
            samples=(self._thinned(samples) if weighted else samples) if self.traces else {},
            traces_read=self.read if weighted else None,
        )
        self._effective = None
        return report

    def _distribution(self, values_ns: Iterable[int]) -> Distribution:
        """A distribution of values read from the traces: with intervals when they are a sample."""
        return self._distribution_of(_seconds(values_ns))

    def _distribution_of(self, ordered: Sequence[float]) -> Distribution:
        """The same, of seconds already in order."""
        if self._effective is None:
            return Distribution.of_sorted(ordered)
        return weighted_distribution(ordered, self._effective)

    def _decided_on(self, counted: Counted, parts: Sequence[Part], traces: int) -> tuple[Part, ...]:
        """The parts the verdict compares when the metrics counted every call and each part of a trace is one
        span's (`Trace.one_span_per_part`, in every trace read): each app stage and each bucket from the
        histograms, with a 0 for every trace that had none of it (as the per-trace parts count it), and what
        only traces give (time outside any stage in a turn) from the traces; each with its interval."""
        found = [
            Part(KIND_STAGE, stage, counted.part(KIND_STAGE, stage, traces))
            for stage in counted.stages
            if stage not in _APP_EXCLUDED
        ]
        if counted.buckets:
            found += [
                Part(KIND_BUCKET, bucket, counted.part(KIND_BUCKET, bucket, traces))
                for bucket in names.BUCKETS
                if (KIND_BUCKET, bucket) in counted.histograms
            ]
        order = {(part.kind, part.name): index for index, part in enumerate(parts)}
        found.sort(key=lambda part: order.get((part.kind, part.name), len(order)))  # as the parts table
        found += [part for part in parts if part.kind == KIND_OTHER]
        return tuple(found)

    def _retries(self, counted: Counted | None) -> Retries:
        calls, successful = self._calls, self._successful
        attempts, causes = self._attempts, _by_count(self._causes, self._cause_first)
        errors = _by_count(self._errors, self._error_first)
        if counted is not None and counted.calls:
            calls, errors = counted.calls, counted.errors
            successful = calls - sum(errors.values())
            causes = counted.causes
            attempts = calls + sum(causes.values())
        return Retries(
            calls=calls,
            successful=successful,
            failed=calls - successful,
            attempts=attempts,
            attempts_per_success=attempts / successful if successful else None,
            retried_calls=self._retried,
            causes=causes,
            wasted_output_tokens=self._wasted,
            error_types=errors,
        )

    def _connections(self, counted: Counted | None) -> Connections:
        calls, successful, opened = self._calls, self._successful, self._new_connections
        if counted is not None and counted.calls:
            # What the metrics do not say (reuse, the kinds of call) is left unsaid, as from Prometheus.
            calls = counted.calls
            successful = calls - sum(counted.errors.values())
            opened = counted.new_connections
            return Connections(calls, successful, opened, opened / successful if successful else None, None)
        return Connections(
            calls,
            successful,
            opened,
            opened / successful if successful else None,
            self._reused,
            streamed=_churn(*self._by_kind[True]),
            not_streamed=_churn(*self._by_kind[False]),
            closed_before_end=self._closed_before_end,
        )

    def _thinned(
        self, samples: dict[tuple[str, str], tuple[float, ...]]
    ) -> dict[tuple[str, str], tuple[float, ...]]:
        """A weighted run's samples cut to their effective size, for `--baseline`'s intervals.

        A trace counted 20 times is one observation, not 20: each sample keeps its distribution but
        only Kish's effective share of its values (sum(w)^2 / sum(w^2) over sum(w), over the traces
        read), evenly spaced in rank, so a comparison's bootstrap interval is as wide as the evidence."""
        share = self._weight_sum / self._weight_squares
        thinned = {}
        for key, values in samples.items():
            if not values:
                thinned[key] = values
                continue
            size = max(1, round(len(values) * share))
            step = len(values) / size
            thinned[key] = tuple(values[min(len(values) - 1, int((i + 0.5) * step))] for i in range(size))
        return thinned

    def _variability(self) -> Variability:
        """first_token against stream over the streamed calls only: a call that did not stream has its
        whole answer in first_token and nothing in stream, so mixing the two kinds would read decode as
        first_token's spread."""
        first = Distribution.of_nanoseconds(self._streamed_first_token).spread
        stream = Distribution.of_nanoseconds(self._streamed_stream).spread
        ratio = first / stream if first is not None and stream is not None and stream > 0 else None
        return Variability(first, stream, ratio, calls=len(self._streamed_first_token), over=OVER_STREAMED)

    def _stage_rows(self, counted: Counted | None = None) -> tuple[StageRow, ...]:
        ordered = sorted(self._stages, key=lambda stage: self._stages[stage].first)
        if counted is not None:  # stages only the metrics saw (no kept trace had one), after the others
            ordered += sorted(stage for stage in counted.stages if stage not in self._stages)
        order = [stage for stage in ordered if stage not in _APP_EXCLUDED]
        order += [stage for stage in _APP_EXCLUDED if stage in ordered]
        rows = []
        for stage in order:
            row = self._stages.get(stage) or _Stage((0, 0, 0))
            durations = _seconds(row.durations)
            distribution = self._distribution_of(durations)
            from_metrics = counted is not None and stage in counted.stages
            if from_metrics:
                assert counted is not None
                distribution = counted.stages[stage]
            if stage in self.overrides:
                budget = self.overrides[stage]
                exceeded = sum(1 for value in durations if value > budget)
                budgeted = len(durations)
                if from_metrics:  # the traces' share over the budget, of every span the metrics counted
                    exceeded = round(exceeded * distribution.count / budgeted) if budgeted else 0
                    budgeted = distribution.count
                rows.append(StageRow(stage, distribution, budget, False, budgeted, exceeded, row.errors))
                continue
            counts, first = row.budget_counts, row.budget_first
            common = min(counts, key=lambda budget: (-counts[budget], first[budget]), default=None)
            budgeted, exceeded = sum(counts.values()), row.exceeded
            if from_metrics:
                assert counted is not None
                budgeted = distribution.count if common is not None else 0
                exceeded = counted.exceeded.get(stage, 0)
            rows.append(
                StageRow(stage, distribution, common, len(counts) > 1, budgeted, exceeded, row.errors)
            )
        return tuple(rows)

    def _bucket_rows(self, counted: Counted | None = None) -> tuple[BucketRow, ...]:
        values = {bucket: self._distribution(self._buckets[bucket]) for bucket in names.BUCKETS}
        if counted is not None and counted.buckets:
            values = {
                bucket: counted.buckets.get(bucket, Distribution(0, 0.0, 0.0, 0.0, 0.0))
                for bucket in names.BUCKETS
            }
        total = sum(row.p95 for row in values.values())
        return tuple(
            BucketRow(bucket, values[bucket], values[bucket].p95 / total if total > 0 else 0.0)
            for bucket in names.BUCKETS
        )

    def _part_rows(self) -> tuple[Part, ...]:
        keys = sorted(self._parts, key=lambda key: self._part_first[key])
        keys.sort(key=lambda key: (_KIND_ORDER[key[0]], _BUCKET_ORDER.get(key[1], 0)))
        # Every bucket is a part whenever there are calls, so charts always show all six.
        if any(key[0] == KIND_BUCKET for key in keys):
            stages = [key for key in keys if key[0] == KIND_STAGE]
            others = [key for key in keys if key[0] == KIND_OTHER]
            keys = stages + [(KIND_BUCKET, bucket) for bucket in names.BUCKETS] + others
        parts = []
        for kind, name in keys:
            values = self._parts.get((kind, name), array("q"))
            zeros = [0] * (self.traces - len(values))  # a trace without this part spent nothing in it
            parts.append(Part(kind, name, self._distribution([*zeros, *values])))
        return tuple(parts)

    def _level_rows(self) -> tuple[LevelRow, ...]:
        """Runs in the order they appeared, each run's levels by load."""
        runs: dict[str, Order] = {}
        for (run, _), row in self._levels.items():
            runs[run] = min(runs.get(run, row.first), row.first)
        keys = sorted(
            self._levels, key=lambda key: (runs[key[0]], _level_value(key[1]), self._levels[key].first)
        )
        several = len(runs) > 1
        rows = []
        for run, level in keys:
            row = self._levels[(run, level)]
            distributions = {
                bucket: self._distribution(values)
                for bucket, values in zip(names.BUCKETS, row.buckets, strict=True)
            }
            p95 = {bucket: distribution.p95 for bucket, distribution in distributions.items()}
            dominant = max(names.BUCKETS, key=p95.__getitem__)
            runner_up = max((b for b in names.BUCKETS if b != dominant), key=p95.__getitem__)
            if self._effective is not None and not apart(distributions[dominant], distributions[runner_up]):
                dominant = f"cannot tell ({dominant} or {runner_up})"
            rows.append(
                LevelRow(
                    label=f"{level} (run {run[:8]})" if several else level,
                    run_id=run,
                    level=level,
                    calls=len(row.durations),
                    failed=row.failed,
                    durations=self._distribution(row.durations),
                    buckets_p95=p95,
                    dominant=dominant,
                )
            )
        return tuple(rows)

    def _limiter_rows(self) -> tuple[LimiterRow, ...]:
        rows = []
        for (process, name), limiter in sorted(self._limiters.items(), key=lambda item: item[1].first):
            rows.append(_limiter_row(process, name, limiter))
        rows.sort(key=lambda row: -row.backlog_s)
        return tuple(rows)


def _churn(calls: int, successful: int, opened: int) -> Churn | None:
    if not calls:
        return None
    return Churn(calls, successful, opened, opened / successful if successful else None)


def _seconds(values: Iterable[int]) -> tuple[float, ...]:
    return tuple([value / NS for value in sorted(values)])  # seconds_of, inlined: this runs per span


def _limiter_row(process: str, name: str, limiter: _Limiter) -> LimiterRow:
    """gap_fraction and the rest, rebuilt from the calls' queued/admitted/end instants."""
    cap = limiter.cap or 1
    deltas: dict[int, list[int]] = {}  # time -> [queued change, in-flight change]
    intervals = limiter.intervals
    for index in range(0, len(intervals), 3):
        queued_at, admitted, end = intervals[index : index + 3]
        for at, queued, running in ((queued_at, 1, 0), (admitted, -1, 1), (end, 0, -1)):
            change = deltas.setdefault(at, [0, 0])
            change[0] += queued
            change[1] += running
    queued = running = max_queued = 0
    backlog = gap = queue_area = running_area = 0
    times = sorted(deltas)
    for at, following in zip(times, times[1:] + times[-1:], strict=True):
        queued += deltas[at][0]
        running += deltas[at][1]
        max_queued = max(max_queued, queued)
        span_ns = following - at
        queue_area += queued * span_ns
        running_area += running * span_ns
        if queued > 0:
            backlog += span_ns
            if running < cap:
                gap += span_ns
    window = times[-1] - times[0] if times else 0
    return LimiterRow(
        name=name,
        process=process,
        cap=cap,
        calls=len(limiter.queue_depths),
        window_s=seconds_of(window),
        backlog_s=seconds_of(backlog),
        gap_s=seconds_of(gap),
        gap_fraction=gap / backlog if backlog else 0.0,
        mean_queue_depth=queue_area / window if window else 0.0,
        max_queue_depth=max_queued,
        mean_in_flight=running_area / window if window else 0.0,
        queue_depth_on_entry=Distribution.of(limiter.queue_depths),
    )


def _waterfall(trace: Trace) -> tuple[WaterfallRow, ...]:
    start = trace.start_ns
    depth: dict[str, int] = {}
    rows = []
    for span in trace.marked:
        parent = trace.marked_ancestor(span)
        level = depth.get(parent.span_id, -1) + 1 if parent is not None else 0
        depth[span.span_id] = level
        buckets = {
            bucket: seconds_of(value) for bucket, value in zip(names.BUCKETS, span.buckets_ns, strict=False)
        }  # () for non-calls
        rows.append(
            WaterfallRow(
                name=span.name,
                stage=span.stage,
                depth=level,
                offset_s=seconds_of(span.start_ns - start),
                duration_s=seconds_of(span.duration_ns),
                buckets=buckets,
                error=span.error,
            )
        )
    return tuple(rows)


def _slow_trace(trace: Trace, totals: Mapping[tuple[str, str], int]) -> SlowTrace:
    (kind, name), value = (
        max(totals.items(), key=lambda item: item[1]) if totals else ((KIND_OTHER, "unmarked"), 0)
    )
    root = trace.root()
    return SlowTrace(
        trace.trace_id,
        root.name,
        seconds_of(trace.duration_ns),
        kind,
        name,
        seconds_of(value),
        root.start_ns,
        _waterfall(trace),
    )


# --- entry points ---------------------------------------------------------------------------------


def analyse_batches(
    batches: Batches,
    *,
    budgets: Mapping[str, float] | None = None,
    top: int = 5,
    service: str | None = None,
    cutoff_ns: int | None = None,
    sources: Sequence[str] = (),
    skipped: Callable[[], Sequence[SkippedLine]] = tuple,
    metrics: Callable[[], MetricPoints | None] = lambda: None,
    population: int | None = None,
) -> Report:
    """The report of the spans `batches()` yields, one pass when the input allows (see `_traces.py`);
    `metrics()`, asked after the pass, gives the metric points read with them (see `Analysis.report`)."""

    def run(traces: Iterable[Trace]) -> Analysis:
        analysis = Analysis(
            budgets=budgets, top=top, service=service, cutoff_ns=cutoff_ns, population=population
        )
        for trace in traces:
            analysis.add(trace)
        return analysis

    with _without_cyclic_gc():
        try:
            analysis = run(optimistic_traces(batches()))
        except LateSpan:
            analysis = run(exact_traces(batches))
        return analysis.report(sources=sources, skipped=skipped(), metrics=metrics)


@contextmanager
def _without_cyclic_gc() -> Iterator[None]:
    """The read makes millions of short-lived objects and no reference cycles; the cyclic collector would
    only walk the survivors again and again (about a tenth of the time). Reference counting still frees
    everything; the collector is back on when the report is built."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def analyse(
    spans: Sequence[Span],
    *,
    budgets: Mapping[str, float] | None = None,
    top: int = 5,
    sources: Sequence[str] = (),
    skipped: Sequence[SkippedLine] = (),
    population: int | None = None,
) -> Report:
    """The report of spans already in memory (the demo's own, a Jaeger page, a test's, a load level's, with
    the `population` of requests they are a uniform sample of when some have no span)."""
    spans = list(spans)
    return analyse_batches(
        lambda: [spans], budgets=budgets, top=top, sources=sources, skipped=lambda: skipped,
        population=population,
    )  # fmt: skip
