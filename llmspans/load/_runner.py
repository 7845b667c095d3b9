"""The levels of a run: which ones, in what order, on how many processes, and their figures.

A level one event loop keeps runs on this process's own `Generator`; a level that needs more (an open
loop past `RATE_PER_WORKER` requests/s, or `--workers N`) runs on worker processes (`_workers.py`), each
sending its share of the same schedule, dealt from the same seeded draws. A level stops issuing after its
request count or `level_seconds`; the run stops after `max_requests` or `max_seconds`, or when `stop` is
set (Ctrl-C): what is in flight then is cancelled (its spans end `cancelled`) and the levels so far are
returned. A worker that dies stops the run too, with the levels finished before and the worker named.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from opentelemetry.sdk.trace import TracerProvider

import llmspans
from llmspans.load._generator import Generator, LoadError, on_schedule, until_done
from llmspans.load._host import LoopLag, SharedHost, shared_host
from llmspans.load._model import SHAPE_CONCURRENCY, SHAPE_RATE, SHAPE_SPEED, GeneratorStats, Level, LevelStats
from llmspans.load._replay_send import send_replay
from llmspans.load._replay_workload import ReplayWorkload, deal_replay
from llmspans.load._requests import RequestRecord
from llmspans.load._schedule import Sweep, arrivals
from llmspans.load._server import LevelSampler
from llmspans.load._stats import level_stats
from llmspans.load._workers import (
    LEAD_S,
    Part,
    Setup,
    WorkerExport,
    WorkerFailed,
    WorkerPool,
    deal_closed,
    deal_open,
    workers_for,
)
from llmspans.load._workload import Plan, Workload
from llmspans.report._analysis import analyse
from llmspans.report._spans import Span
from llmspans.vllm import ServerMetrics

if TYPE_CHECKING:
    from llmspans.load._ray import Fleet

__all__ = ["LoadError", "RunOutcome", "Runner", "new_run_id"]

PROGRESS_EVERY_S = 0.5
# An open loop starts its first arrival this long after the dispatcher is ready (its set-up is not lag).
OPEN_LOOP_LEAD_S = 0.01

Progress = Callable[[Level, Sequence[RequestRecord], int, bool], None]  # level, records, planned, final
Notice = Callable[[str], None]


@dataclass
class RunOutcome:
    levels: list[LevelStats]
    interrupted: bool
    notes: list[str]
    records: dict[str, list[RequestRecord]]  # each level's requests, by `Level.label`
    failure: str | None = None  # why the run stopped early (a worker died), in one line
    workers: list[int] = field(default_factory=list)  # the worker processes' pids, in their order
    generators: tuple[GeneratorStats, ...] = ()  # `--ray`: each generator over the run


def new_run_id() -> str:
    return uuid.uuid4().hex[:16]


class Runner:
    """`workers`: how many processes send a level's requests; 1 (this one), N, or None to choose by
    itself (`workers_for`). Worker processes need `export`, where `configure()` sends their spans.
    `fleet`: every level on a Ray cluster's generators instead (`_ray.py`), each with its own limiter."""

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
        workers: int | None = 1,
        export: WorkerExport | None = None,
        notice: Notice | None = None,
        client: str = "httpx",
        fleet: Fleet | None = None,
    ) -> None:
        if fleet is not None and limiter is not None:
            raise ValueError(
                "on Ray each generator has its own limiter: give the fleet the cap, not a Limiter"
            )
        if fleet is not None and plan.shape == SHAPE_SPEED:
            raise ValueError(
                "a replay (speed levels) runs on this machine's processes, not on a Ray fleet yet"
            )
        if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
            raise ValueError(
                f"workers must be a positive whole number or None (chosen per level), got {workers!r}"
            )
        if workers != 1 and export is None:
            raise ValueError("worker processes need export=WorkerExport(...): where their spans go")
        if workers not in (1, None) and limiter is not None:
            raise ValueError(
                "a Limiter is one process's: it needs workers=1 (each worker would have its own)"
            )
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
        self.workers = workers
        self.export = export
        self.notice = notice
        self.client = client
        self.fleet = fleet
        self.generator = Generator(
            workload, base_url=base_url, tracer_provider=tracer_provider, run_id=self.run_id, api_key=api_key,
            provider=provider, limiter=limiter, server_metrics=server_metrics, max_retries=max_retries,
            timeout=timeout, client=client,
        )  # fmt: skip
        self.stamper = self.generator.stamper
        self._issued = 0
        self._records: dict[str, list[RequestRecord]] = {}
        self._rng = random.Random(workload.seed)
        self._pool: WorkerPool | None = None
        self.host: SharedHost | None = None  # the target on this machine, sharing the generator's CPUs

    def workers_for(self, level: Level, count: int) -> int:
        if level.shape == SHAPE_SPEED:  # a replay: as an open loop of the rate it sends at that speed
            level = Level(SHAPE_RATE, self._replay().rate(level.value))
        # A client Limiter is one process's: its cap would apply per worker.
        return workers_for(level, count, self.workers, one_process_only=self.limiter is not None)

    async def run(self, stop: asyncio.Event | None = None) -> RunOutcome:
        """Every level of the plan (or of the sweep) until done, capped, or `stop` is set."""
        stop = stop or asyncio.Event()
        notes: list[str] = []
        failure = None
        sampler = LevelSampler(self.server_metrics) if self.server_metrics is not None else None
        levels: list[LevelStats] = []
        try:
            if self.fleet is not None:  # the generators warm up, each from its own node
                await self.fleet.start(stop)
            else:
                self.host = shared_host(self.base_url)
                await self.generator.start()
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
                count = min(left, self.plan.requests_for(level))
                workers = self.workers_for(level, count)
                stats: LevelStats | None
                try:
                    if self.fleet is not None:
                        stats = await self._level_on_ray(self.fleet, level, count, deadline, stop, sampler)
                    elif workers == 1:
                        stats = await self._level_here(level, count, deadline, stop, sampler)
                    else:
                        stats = await self._level_in_workers(level, count, workers, deadline, stop, sampler)
                except WorkerFailed as error:
                    failure = str(error)
                    notes.append(f"{level.words} is not reported: {failure}")
                    break
                except LoadError as error:  # every generator on Ray was lost
                    if self.fleet is None:
                        raise
                    failure = str(error)
                    notes.append(f"{level.words} is not reported: {failure}")
                    break
                if stats is not None:
                    levels.append(stats)
        finally:
            await self.generator.close()
            if self._pool is not None:
                closed = await self._pool.close()
                notes += closed.notes
            if self.fleet is not None:
                notes += await self.fleet.close(self.export.traces_file if self.export is not None else None)
        pids = [worker.process.pid for worker in self._pool.workers] if self._pool is not None else []
        generators = self.fleet.stats() if self.fleet is not None else ()
        return RunOutcome(levels, stop.is_set(), notes, self._records, failure, pids, generators)

    # --- one level ----------------------------------------------------------------------------

    async def _level_here(
        self, level: Level, count: int, deadline: float, stop: asyncio.Event, sampler: LevelSampler | None
    ) -> LevelStats:
        records = self._records[level.label] = []
        level_deadline = min(deadline, time.monotonic() + self.plan.level_seconds)
        indices = range(self._issued, self._issued + count)
        async with self._watching(level, records, count, sampler) as started:
            cpu = time.process_time()
            lag = LoopLag()
            lag.start()
            with on_schedule():
                if level.shape == SHAPE_CONCURRENCY:
                    work = self.generator.closed(
                        level, int(level.value), indices, records, stop, level_deadline
                    )
                elif level.shape == SHAPE_SPEED:
                    start = time.perf_counter_ns() + int(OPEN_LOOP_LEAD_S * 1e9)
                    heads, follows = self._replay_schedule(level, count, start)
                    work = send_replay(
                        self.generator, level, heads, [(index, *wait) for index, wait in follows.items()],
                        records, stop, level_deadline,
                    )  # fmt: skip
                else:
                    start = time.perf_counter_ns() + int(OPEN_LOOP_LEAD_S * 1e9)
                    schedule = self._schedule(level, count, start)
                    work = self.generator.open(level, schedule, records, stop, level_deadline)
                await until_done(work, stop, deadline)
            loop_lag = await lag.stop()
            cpu = time.process_time() - cpu
        self._issued += len(records)
        spans = self.generator.level_spans(level, records)
        return self._stats(
            level, records, spans, sampler, started, workers=1, cpu_s=cpu, planned=count, loop_lag=loop_lag
        )

    async def _level_in_workers(
        self, level: Level, count: int, workers: int, deadline: float, stop: asyncio.Event,
        sampler: LevelSampler | None,
    ) -> LevelStats | None:  # fmt: skip
        pool = self._worker_pool()
        starting = len(pool.workers) < workers
        await pool.ensure(workers, stop)
        if starting and self.notice is not None:
            pids = ", ".join(str(worker.process.pid) for worker in pool.workers)
            self.notice(f"{len(pool.workers)} worker processes ready (pids {pids})")
        if stop.is_set():
            return None
        records: list[RequestRecord] = []
        self._records[level.label] = records
        parts = self._parts(level, count, workers, LEAD_S, deadline)
        async with self._watching(level, records, count, sampler) as started:
            cpu = time.process_time()
            done = await pool.run_level(parts, stop, records.extend)
            cpu = time.process_time() - cpu + sum(part.cpu_s for part in done)
        records.sort(key=lambda record: record.index)
        self._issued += len(records)
        spans = [span for part in done for span in part.spans]
        loop_lag = [sample for part in done for sample in part.loop_lag_ns]
        return self._stats(
            level,
            records,
            spans,
            sampler,
            started,
            workers=workers,
            cpu_s=cpu,
            planned=count,
            loop_lag=loop_lag,
        )

    async def _level_on_ray(
        self, fleet: Fleet, level: Level, count: int, deadline: float, stop: asyncio.Event,
        sampler: LevelSampler | None,
    ) -> LevelStats | None:  # fmt: skip
        """A level on the Ray generators still alive, dealt as worker processes are dealt theirs."""
        from llmspans.load._ray import LEAD_S as RAY_LEAD_S

        members = fleet.share(int(level.value) if level.shape == SHAPE_CONCURRENCY else None)
        await fleet.measure_clocks()
        if stop.is_set():
            return None
        records: list[RequestRecord] = []
        self._records[level.label] = records
        parts = self._parts(level, count, len(members), RAY_LEAD_S, deadline)
        async with self._watching(level, records, count, sampler) as started:
            cpu = time.process_time()  # the driver's share, as the runner's is counted with worker processes
            outcome = await fleet.run_level(members, parts, stop, records.extend)
            cpu = time.process_time() - cpu + sum(part.cpu_s for part in outcome.done)
        records.sort(key=lambda record: record.index)
        self._issued += len(records) + outcome.lost
        return self._stats(
            level, records, [span for part in outcome.done for span in part.spans], sampler, started,
            workers=len(members), cpu_s=cpu, planned=count,
            loop_lag=[sample for part in outcome.done for sample in part.loop_lag_ns], lost=outcome.lost,
            lost_generators=outcome.lost_generators,
        )  # fmt: skip

    def _parts(self, level: Level, count: int, shares: int, lead_s: float, deadline: float) -> list[Part]:
        """The level dealt into `shares` parts, one a process, all on one epoch `lead_s` from now (time for
        every process to have its part): a closed loop's users and requests, an open loop's schedule, or a
        replay's turns. Each part stops issuing after `level_seconds` and ends by `deadline`."""
        now_ns = time.perf_counter_ns()
        until_ns = now_ns + int(max(0.0, min(deadline - time.monotonic(), self.plan.level_seconds)) * 1e9)
        deadline_ns = now_ns + int(max(0.0, deadline - time.monotonic()) * 1e9)
        start = now_ns + int(lead_s * 1e9)
        if level.shape == SHAPE_CONCURRENCY:
            indices = range(self._issued, self._issued + count)
            return [
                Part(level, start, until_ns, deadline_ns, users=users, indices=share)
                for users, share in deal_closed(int(level.value), indices, shares)
            ]
        if level.shape == SHAPE_SPEED:
            return [
                Part(level, start, until_ns, deadline_ns, schedule=heads, follows=follows)
                for heads, follows in deal_replay(*self._replay_schedule(level, count, start), shares)
            ]
        return [
            Part(level, start, until_ns, deadline_ns, schedule=share)
            for share in deal_open(self._schedule(level, count, start), shares)
        ]

    def _worker_pool(self) -> WorkerPool:
        if self._pool is None:
            assert self.export is not None
            export = self.export

            def setup(index: int, traces_file: str | None) -> Setup:
                return Setup(
                    index=index, workload=self.workload, base_url=self.base_url, api_key=self.api_key,
                    provider=self.provider, max_retries=self.max_retries, timeout=self.timeout, run_id=self.run_id,
                    service_name=export.service_name, traces_file=traces_file,
                    vllm_interval=self.server_metrics.interval if self.server_metrics is not None else None,
                    client=self.client,
                )  # fmt: skip

            self._pool = WorkerPool(setup, export, self.run_id)
        return self._pool

    def _replay(self) -> ReplayWorkload:
        if not isinstance(self.workload, ReplayWorkload):
            raise ValueError("a speed level replays recorded calls: it needs a ReplayWorkload (--replay)")
        return self.workload

    def _replay_schedule(
        self, level: Level, count: int, start: int
    ) -> tuple[list[tuple[int, int]], dict[int, tuple[int, int]]]:
        """A replay level's first calls of turns `(index, due)` and later calls `index: (waits for, gap)`."""
        replay = self._replay()
        return replay.schedule(level.value, count, start, replay.first_index(self._issued))

    def _schedule(self, level: Level, count: int, start: int) -> list[tuple[int, int]]:
        """The level's arrivals from `start` (`perf_counter_ns()`), with the requests' indices."""
        offsets = arrivals(level.value, count, self.plan.burstiness, self._rng)
        return [(self._issued + number, start + int(offset * 1e9)) for number, offset in enumerate(offsets)]

    @contextlib.asynccontextmanager
    async def _watching(
        self, level: Level, records: list[RequestRecord], count: int, sampler: LevelSampler | None
    ) -> AsyncIterator[float]:
        """Progress lines and vLLM's /metrics for the length of a level; yields when it started."""
        started = time.monotonic()
        watching = asyncio.Event()
        tasks = [asyncio.ensure_future(self._report_progress(level, records, count, watching))]
        if sampler is not None:
            tasks.append(asyncio.ensure_future(sampler.watch(watching)))
        try:
            yield started
        finally:
            watching.set()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _stats(
        self, level: Level, records: list[RequestRecord], spans: list[Span], sampler: LevelSampler | None,
        started: float, *, workers: int, cpu_s: float, planned: int, loop_lag: list[int], lost: int = 0,
        lost_generators: Sequence[str] = (),
    ) -> LevelStats:  # fmt: skip
        issued = [record.issued_ns for record in records if record.issued_ns]
        done = [record.done_ns for record in records if record.done_ns]
        duration_s = (max(done) - min(issued)) / 1e9 if issued and done else 0.0
        # A head sampler may have kept only some of the calls' spans: the level's figures from them are then
        # estimates of every call made, each with its interval (docs/sampling.md).
        made = sum(1 for record in records if record.issued_ns and not record.cancelled)
        report = analyse(spans, top=0, sources=[f"llmspans load, {level.words}"], population=made)
        server = sampler.level_figures(started) if sampler is not None else None
        stats = level_stats(
            level, records, duration_s=duration_s, slo=self.plan.slo, server=server, report=report,
            workers=workers, generator_cpu_s=cpu_s, loop_lag_ns=loop_lag, host=self.host, lost=lost,
            lost_generators=lost_generators,
        )  # fmt: skip
        if self.progress is not None:
            self.progress(level, records, planned, True)
        return stats

    async def _report_progress(
        self, level: Level, records: list[RequestRecord], planned: int, done: asyncio.Event
    ) -> None:
        if self.progress is None:
            return
        while not done.is_set():
            self.progress(level, records, planned, False)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(done.wait(), PROGRESS_EVERY_S)


def _capped(plan: Plan, level: Level, by_requests: bool) -> str:
    if by_requests:
        return f"stopped before {level.words}: --max-requests {plan.max_requests} reached"
    return f"stopped before {level.words}: --max-seconds {plan.max_seconds:g} reached"
