"""The levels, run on one event loop through one instrumented `openai.AsyncOpenAI`.

Closed loop: `concurrency` workers, each sending its next request when its last one is done. Open loop:
one dispatcher sleeps until each request is due and starts it as its own task, whatever is still in
flight; the request's record keeps when it was due and when the runner called `create()`, so the lag is
measured, never hidden. Each request consumes its stream as an app would and stamps each content chunk as
it arrives. A level stops issuing after its request count or `level_seconds`; the run stops after
`max_requests` or `max_seconds`, or when `stop` is set (Ctrl-C): what is in flight then is cancelled (its
spans end `cancelled`) and the levels so far are returned.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry.sdk.trace import TracerProvider

import llmspans
from llmspans import _deferred, _suppress
from llmspans.load._model import SHAPE_CONCURRENCY, Level, LevelStats
from llmspans.load._requests import CURRENT, LevelStamper, RequestRecord
from llmspans.load._schedule import Sweep, arrivals
from llmspans.load._server import LevelSampler
from llmspans.load._stats import level_stats
from llmspans.load._workload import Plan, Workload
from llmspans.report._analysis import analyse
from llmspans.report._spans import spans_of_readable
from llmspans.vllm import ServerMetrics

PROGRESS_EVERY_S = 0.5
# An open loop starts its first arrival this long after the dispatcher is ready (its set-up is not lag).
OPEN_LOOP_LEAD_S = 0.01
SETTLE_S = 2.0

Progress = Callable[[Level, Sequence[RequestRecord], int, bool], None]  # level, records, planned, final


class LoadError(Exception):
    """The run cannot start (the target does not answer, the model is unknown); one line saying why."""


@dataclass
class RunOutcome:
    levels: list[LevelStats]
    interrupted: bool
    notes: list[str]
    records: dict[str, list[RequestRecord]]  # each level's requests, by `Level.label`


def new_run_id() -> str:
    return uuid.uuid4().hex[:16]


class Runner:
    def __init__(
        self,
        workload: Workload,
        plan: Plan,
        *,
        base_url: str,
        tracer_provider: TracerProvider,
        api_key: str = "none",
        provider: str | None = None,
        limiter: llmspans.Limiter | None = None,
        server_metrics: ServerMetrics | None = None,
        max_retries: int = 2,
        timeout: float = 60.0,
        run_id: str | None = None,
        progress: Progress | None = None,
    ) -> None:
        self.workload = workload
        self.plan = plan
        self.base_url = base_url
        self.api_key = api_key
        self.provider = provider
        self.limiter = limiter
        self.server_metrics = server_metrics
        self.max_retries = max_retries
        self.timeout = timeout
        self.run_id = run_id or new_run_id()
        self.progress = progress
        self.stamper = LevelStamper(self.run_id)
        tracer_provider.add_span_processor(self.stamper)
        self._issued = 0
        self._records: dict[str, list[RequestRecord]] = {}
        self._rng = random.Random(workload.seed)

    async def run(self, stop: asyncio.Event | None = None) -> RunOutcome:
        """Every level of the plan (or of the sweep) until done, capped, or `stop` is set."""
        stop = stop or asyncio.Event()
        notes: list[str] = []
        try:
            import openai
        except ImportError as error:
            raise LoadError("llmspans load needs the openai SDK: pip install 'llmspans[openai]'") from error
        client = openai.AsyncOpenAI(
            base_url=self.base_url, api_key=self.api_key, max_retries=self.max_retries, timeout=self.timeout
        )
        llmspans.instrument(
            client, provider=self.provider, limiter=self.limiter, request_usage=self.workload.stream,
            server_metrics=self.server_metrics or False,
        )  # fmt: skip
        self._create = _creator(client, self.workload.endpoint)
        sampler = LevelSampler(self.server_metrics) if self.server_metrics is not None else None
        levels: list[LevelStats] = []
        try:
            await self._warm_up()
            if self.server_metrics is not None and not self.server_metrics.wait_for_sample(2.0):
                notes.append(f"vLLM's /metrics at {self.server_metrics.metrics_url} could not be read")
            deadline = time.monotonic() + self.plan.max_seconds
            sweep = (
                Sweep(self.plan.levels[0], self.plan.knee_factor, dict(self.plan.slo))
                if self.plan.sweep
                else None
            )
            queue = list(self.plan.levels)
            while not stop.is_set():
                level = sweep.next_level(levels) if sweep is not None else (queue.pop(0) if queue else None)
                if level is None:
                    break
                left = self.plan.max_requests - self._issued
                if left <= 0 or time.monotonic() >= deadline:
                    notes.append(_capped(self.plan, level, left <= 0))
                    break
                levels.append(
                    await self._level(
                        level, min(left, self.plan.requests_for(level)), deadline, stop, sampler
                    )
                )
        finally:
            self.stamper.shutdown()
            await client.close()
        return RunOutcome(levels, stop.is_set(), notes, self._records)

    async def _warm_up(self) -> None:
        """One request no span records: the SDK's one-off set-up is not in the first level, and a target
        that does not answer is said before any level starts."""
        with _suppress.suppressing():
            try:
                response = await self._create(**self.workload.request(0))
                if self.workload.stream:
                    async for _ in response:
                        pass
            except Exception as error:
                raise LoadError(
                    f"the warm-up request to {self.base_url} failed: {_error_name(error)}: {error}"
                ) from None

    # --- one level ----------------------------------------------------------------------------

    async def _level(
        self, level: Level, count: int, deadline: float, stop: asyncio.Event, sampler: LevelSampler | None
    ) -> LevelStats:
        records = self._records[level.label] = []
        level_deadline = min(deadline, time.monotonic() + self.plan.level_seconds)
        started = time.monotonic()
        watching = asyncio.Event()
        tasks = [asyncio.ensure_future(self._report_progress(level, records, count, watching))]
        if sampler is not None:
            tasks.append(asyncio.ensure_future(sampler.watch(watching)))
        try:
            if level.shape == SHAPE_CONCURRENCY:
                work = self._closed(level, count, records, level_deadline, stop)
            else:
                work = self._open(level, count, records, level_deadline, stop)
            await _until(work, stop, deadline)
        finally:
            watching.set()
            await asyncio.gather(*tasks, return_exceptions=True)
        if any(record.ok and not record.recorded for record in records):
            _deferred.settle(SETTLE_S)  # a span ended from a finalizer is ended on llmspans' worker thread
        issued = [record.issued_ns for record in records if record.issued_ns]
        done = [record.done_ns for record in records if record.done_ns]
        duration_s = (max(done) - min(issued)) / 1e9 if issued and done else 0.0
        spans = spans_of_readable(self.stamper.spans_of(level.label))
        report = analyse(spans, top=0, sources=[f"llmspans load, {level.words}"])
        server = sampler.level_figures(started) if sampler is not None else None
        stats = level_stats(
            level, records, duration_s=duration_s, slo=self.plan.slo, server=server, report=report
        )
        if self.progress is not None:
            self.progress(level, records, count, True)
        return stats

    async def _closed(
        self, level: Level, count: int, records: list[RequestRecord], until: float, stop: asyncio.Event
    ) -> None:
        async def user() -> None:
            while not stop.is_set() and len(records) < count and time.monotonic() < until:
                record = self._record(level)
                records.append(record)
                await self._one(record)

        await asyncio.gather(*(user() for _ in range(int(level.value))))

    async def _open(
        self, level: Level, count: int, records: list[RequestRecord], until: float, stop: asyncio.Event
    ) -> None:
        offsets = arrivals(level.value, count, self.plan.burstiness, self._rng)
        start = time.perf_counter_ns() + int(OPEN_LOOP_LEAD_S * 1e9)
        in_flight: set[asyncio.Task[None]] = set()
        for offset in offsets:
            due = start + int(offset * 1e9)
            wait = (due - time.perf_counter_ns()) / 1e9
            if wait > 0:
                await asyncio.sleep(wait)
            if stop.is_set() or time.monotonic() >= until:
                break
            record = self._record(level)
            record.scheduled_ns = due
            records.append(record)
            task = asyncio.ensure_future(self._one(record))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
        try:
            if in_flight:
                await asyncio.gather(*in_flight)
        finally:
            for task in in_flight:
                task.cancel()

    def _record(self, level: Level) -> RequestRecord:
        index = self._issued
        self._issued += 1
        return RequestRecord(index=index, level=level.label)

    async def _one(self, record: RequestRecord) -> None:
        """One request, consumed as an app would; what it measured lands on `record`."""
        token = CURRENT.set(record)
        content = _CONTENT[self.workload.endpoint]
        try:
            record.issued_ns = time.perf_counter_ns()
            response = await self._create(**self.workload.request(record.index))
            if self.workload.stream:
                async for item in response:
                    if content(item):
                        record.chunk_ns.append(time.perf_counter_ns())
        except asyncio.CancelledError:
            record.cancelled = True
            raise
        except Exception as error:
            record.error = _error_name(error)
        finally:
            record.done_ns = time.perf_counter_ns()
            CURRENT.reset(token)

    async def _report_progress(
        self, level: Level, records: list[RequestRecord], planned: int, done: asyncio.Event
    ) -> None:
        if self.progress is None:
            return
        while not done.is_set():
            self.progress(level, records, planned, False)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(done.wait(), PROGRESS_EVERY_S)


async def _until(work: Any, stop: asyncio.Event, deadline: float) -> None:
    """Run `work` to its end, or cancel it when `stop` is set or the run's deadline passes."""
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait(
            {task, stopped},
            timeout=max(0.0, deadline - time.monotonic()),
            return_when=asyncio.FIRST_COMPLETED,
        )
    finally:
        stopped.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, stopped, return_exceptions=True)


def _capped(plan: Plan, level: Level, by_requests: bool) -> str:
    if by_requests:
        return f"stopped before {level.words}: --max-requests {plan.max_requests} reached"
    return f"stopped before {level.words}: --max-seconds {plan.max_seconds:g} reached"


def _error_name(error: BaseException) -> str:
    status = getattr(error, "status_code", None)
    if isinstance(status, int):
        return f"HTTP {status}"
    return type(error).__name__


def _creator(client: Any, endpoint: str) -> Callable[..., Any]:
    if endpoint == "chat":
        return client.chat.completions.create  # type: ignore[no-any-return]
    if endpoint == "completions":
        return client.completions.create  # type: ignore[no-any-return]
    return client.responses.create  # type: ignore[no-any-return]


def _chat_content(chunk: Any) -> bool:
    choices = getattr(chunk, "choices", None)
    if not choices:
        return False
    delta = getattr(choices[0], "delta", None)
    return bool(
        delta is not None
        and (
            getattr(delta, "content", None)
            or getattr(delta, "tool_calls", None)
            or getattr(delta, "reasoning_content", None)
        )
    )


def _completion_content(chunk: Any) -> bool:
    choices = getattr(chunk, "choices", None)
    return bool(choices and getattr(choices[0], "text", None))


def _responses_content(event: Any) -> bool:
    return getattr(event, "type", None) == "response.output_text.delta" and bool(
        getattr(event, "delta", None)
    )


_CONTENT: dict[str, Callable[[Any], bool]] = {
    "chat": _chat_content,
    "completions": _completion_content,
    "responses": _responses_content,
}
