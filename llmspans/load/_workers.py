"""Worker processes, for a level one event loop cannot keep: who sends what, and how it comes back.

Each worker (`python -m llmspans.load._worker`) has its own event loop, instrumented client and exporter
(`_worker.py`). The runner deals it part of the level (`deal_open`, `deal_closed`), every worker on the
same epoch of `time.perf_counter_ns()`, the one monotonic clock every process of the machine reads
(CLOCK_MONOTONIC on Linux; checked when a worker starts); the worker sends its requests' records back
over its stdout pipe as they end, then its level's spans as the report reads them. The messages are
pickled frames between processes of the same installation, behind a 4-byte length.

Spans go where `configure()` would send them: over OTLP each worker exports to the same endpoint; with
the embedded default's traces file each worker writes its own file beside it, `<traces file>.<run id>.worker<N>`,
which the pool appends whole, line by line, into the traces file when the workers have exited (so two
processes never write into one file). A worker that dies, or cannot start, is a `WorkerFailed` that names
it, never a wait: its pipe closes, or its level runs past its deadline by `GRACE_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import pickle
import signal
import struct
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import llmspans
from llmspans import _exporters
from llmspans.load._generator import LoadError
from llmspans.load._model import Level
from llmspans.load._requests import RequestRecord
from llmspans.load._workload import Workload
from llmspans.report._spans import Span

# One event loop keeps this many requests/s of streamed calls with room to spare (about a quarter of its
# time busy at the ~5 ms of CPU a request costs; docs/load.md, "What the generator costs").
RATE_PER_WORKER = 50.0
# A worker that has not said it is ready after this long (its imports and warm-up request) is not coming.
START_TIMEOUT_S = 120.0
# The epoch of a level is this far ahead of the moment its parts are sent, so every worker has its part.
LEAD_S = 0.1
# A worker sends the records that ended, this often.
SHIP_EVERY_S = 0.25
# A worker whose level is not done this long after its deadline is stuck: it is stopped and named.
GRACE_S = 30.0
# Closing: a worker has this long to flush its spans and exit once its pipe closes, then it is killed.
EXIT_TIMEOUT_S = 15.0

_HEADER = struct.Struct(">I")
_PACKAGE_ROOT = str(Path(llmspans.__file__).resolve().parents[1])


# --- what goes over the pipes ----------------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    index: int
    workload: Workload
    base_url: str
    api_key: str
    provider: str | None
    max_retries: int
    timeout: float
    run_id: str
    service_name: str | None
    traces_file: str | None  # the worker's own file, with the embedded default; None: OTLP as configured
    vllm_interval: float | None  # --provider vllm: the worker samples /metrics for its own call spans
    client: str = "httpx"  # the generator's client: "httpx" (plain, lean) or "openai" (the SDK)


@dataclass(frozen=True)
class Ready:
    pid: int
    clock_ns: int  # the worker's `time.perf_counter_ns()` when it said so


@dataclass(frozen=True)
class Failed:
    message: str


@dataclass(frozen=True)
class Part:
    """A worker's part of a level: an open loop's `schedule` ((index, due) pairs, `perf_counter_ns()`), a
    closed loop's `users` sharing `indices`, or a replay's turns (`schedule` their first calls, `follows` the
    rest); it stops issuing at `until_ns` and ends by `deadline_ns`."""

    level: Level
    start_ns: int
    until_ns: int
    deadline_ns: int
    schedule: tuple[tuple[int, int], ...] = ()
    users: int = 0
    indices: tuple[int, ...] = ()
    follows: tuple[tuple[int, int, int], ...] = ()  # a replay: (index, the index it waits for, gap ns)


@dataclass(frozen=True)
class StopLevel:
    pass


@dataclass(frozen=True)
class Records:
    records: list[RequestRecord]


@dataclass(frozen=True)
class PartDone:
    records: list[RequestRecord]  # those not sent before
    spans: list[Span]
    cpu_s: float  # the worker's CPU time over its part, its exporter's thread included
    loop_lag_ns: list[int] = field(default_factory=list)  # how late its event loop woke (`_host.LoopLag`)


@dataclass(frozen=True)
class _Gone:
    """The worker's pipe closed (it exited or died)."""


def frame(message: object) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader) -> Any:
    """The next message; None at the end of the pipe."""
    try:
        header = await reader.readexactly(_HEADER.size)
        (size,) = _HEADER.unpack(header)
        return pickle.loads(await reader.readexactly(size))  # our own child's frames
    except asyncio.IncompleteReadError:
        return None


# --- who sends what ------------------------------------------------------------------------------


def deal_open(schedule: Sequence[tuple[int, int]], workers: int) -> list[tuple[tuple[int, int], ...]]:
    """An open loop's arrivals dealt round-robin in time order: each worker gets every `workers`-th one."""
    return [tuple(schedule[worker::workers]) for worker in range(workers)]


def deal_closed(users: int, indices: Sequence[int], workers: int) -> list[tuple[int, tuple[int, ...]]]:
    """A closed loop's users split as evenly as whole users go, and its requests in proportion to them
    (every request to exactly one worker, in index order within each)."""
    shares = [users // workers + (worker < users % workers) for worker in range(workers)]
    counts = [len(indices) * share // users for share in shares]
    for worker in range(len(indices) - sum(counts)):  # the remainder, one each to the first workers
        counts[worker % workers] += 1
    parts, start = [], 0
    for share, count in zip(shares, counts, strict=True):
        parts.append((share, tuple(indices[start : start + count])))
        start += count
    return parts


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# --- the pool ------------------------------------------------------------------------------------


class WorkerFailed(LoadError):
    """A worker died, hung or could not start: the run stops, with the levels it finished."""


@dataclass
class _Worker:
    index: int
    process: asyncio.subprocess.Process
    traces_file: Path | None
    stderr_path: Path
    started_ns: int  # `perf_counter_ns()` before it was started: its first word must read a later time
    reader: asyncio.Task[None] | None = None
    ready: bool = False

    @property
    def name(self) -> str:
        return f"worker {self.index + 1} (pid {self.process.pid})"

    def send(self, message: object) -> None:
        stdin = self.process.stdin
        if stdin is not None and not stdin.is_closing():
            stdin.write(frame(message))


@dataclass
class WorkerExport:
    """Where the workers' spans go: `traces_file`, the embedded default's file they are appended to at the
    end, or None when `configure()` sends spans over OTLP (each worker does the same)."""

    service_name: str | None
    traces_file: Path | None


@dataclass
class PoolOutcome:
    merged: int = 0  # lines appended into the traces file
    notes: list[str] = field(default_factory=list)


class WorkerPool:
    """Worker processes started as levels need them and kept for the levels after."""

    def __init__(self, setup: Callable[[int, str | None], Setup], export: WorkerExport, run_id: str) -> None:
        self._setup = setup
        self.export = export
        self.run_id = run_id
        self.workers: list[_Worker] = []
        self._inbox: asyncio.Queue[tuple[_Worker, Any]] = asyncio.Queue()
        self._scratch = Path(tempfile.mkdtemp(prefix="llmspans-load-"))

    async def ensure(self, count: int, stop: asyncio.Event) -> list[_Worker]:
        """The first `count` workers, ready (started now if they were not); WorkerFailed if one cannot."""
        new = [await self._spawn(index) for index in range(len(self.workers), count)]
        deadline = time.monotonic() + START_TIMEOUT_S
        while any(not worker.ready for worker in new):
            if stop.is_set():
                break
            worker, message = await self._next(min(1.0, deadline - time.monotonic()), stop)
            if worker is None:
                if time.monotonic() >= deadline:
                    late = next(worker for worker in new if not worker.ready)
                    raise WorkerFailed(f"{late.name} did not start within {START_TIMEOUT_S:g} s")
                continue
            if isinstance(message, Ready):
                if not worker.started_ns <= message.clock_ns <= time.perf_counter_ns():
                    raise WorkerFailed(
                        f"{worker.name} does not read this process's monotonic clock: run with --workers 1"
                    )
                worker.ready = True
            elif isinstance(message, Failed):
                raise WorkerFailed(f"{worker.name}: {message.message}")
            elif isinstance(message, _Gone):
                raise await self._died(worker, "while starting")
        return self.workers[:count]

    async def _spawn(self, index: int) -> _Worker:
        traces_file = None
        if self.export.traces_file is not None:
            traces_file = self.export.traces_file.with_name(
                f"{self.export.traces_file.name}.{self.run_id}.worker{index + 1}"
            )
        stderr_path = self._scratch / f"worker{index + 1}.stderr"
        environment = dict(os.environ)
        # The child imports this very llmspans, wherever it was imported from here.
        environment["PYTHONPATH"] = os.pathsep.join(
            filter(None, [_PACKAGE_ROOT, environment.get("PYTHONPATH")])
        )
        started_ns = time.perf_counter_ns()
        with open(stderr_path, "wb") as stderr:  # noqa: ASYNC230 - a new empty file, at start-up
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "llmspans.load._worker", stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=stderr, env=environment,
                start_new_session=True,  # Ctrl-C reaches the runner alone, which stops the workers
            )  # fmt: skip
        worker = _Worker(index, process, traces_file, stderr_path, started_ns)
        worker.reader = asyncio.ensure_future(self._read(worker))
        self.workers.append(worker)
        worker.send(self._setup(index, str(traces_file) if traces_file is not None else None))
        return worker

    async def _read(self, worker: _Worker) -> None:
        assert worker.process.stdout is not None
        while True:
            message = await read_frame(worker.process.stdout)
            await self._inbox.put((worker, message if message is not None else _Gone()))
            if message is None:
                return

    async def _next(self, timeout: float, stop: asyncio.Event | None = None) -> tuple[Any, Any]:
        """The next message from any worker, or (None, None) after `timeout` or once `stop` is set."""
        if not self._inbox.empty():
            return self._inbox.get_nowait()
        getting = asyncio.ensure_future(self._inbox.get())
        waiters: set[asyncio.Future[Any]] = {getting}
        stopping = None
        if stop is not None:
            stopping = asyncio.ensure_future(stop.wait())
            waiters.add(stopping)
        try:
            await asyncio.wait(waiters, timeout=max(0.0, timeout), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if stopping is not None:
                stopping.cancel()
            if not getting.done():
                getting.cancel()
        if getting.done() and not getting.cancelled():
            return getting.result()
        return None, None

    async def run_level(
        self, parts: Sequence[Part], stop: asyncio.Event, on_records: Callable[[list[RequestRecord]], None]
    ) -> list[PartDone]:
        """Each ready worker its part (the first `len(parts)` workers); their results when all are done.
        `stop` set: each stops its part and sends what it had. WorkerFailed when one dies or hangs."""
        workers = self.workers[: len(parts)]
        for worker, part in zip(workers, parts, strict=True):
            worker.send(part)
        done: dict[int, PartDone] = {}
        stopped = False
        deadline_ns = max(part.deadline_ns for part in parts) + int(GRACE_S * 1e9)
        while len(done) < len(workers):
            if stop.is_set() and not stopped:
                stopped = True
                for worker in workers:
                    worker.send(StopLevel())
            left = (deadline_ns - time.perf_counter_ns()) / 1e9
            if left <= 0:
                stuck = next(worker for worker in workers if worker.index not in done)
                with contextlib.suppress(ProcessLookupError):
                    stuck.process.kill()
                raise WorkerFailed(
                    f"{stuck.name} did not finish {parts[0].level.label} {GRACE_S:g} s after its deadline: stopped"
                )
            worker, message = await self._next(min(left, 1.0), None if stopped else stop)
            if worker is None:
                continue
            if isinstance(message, Records):
                on_records(message.records)
            elif isinstance(message, PartDone):
                on_records(message.records)
                done[worker.index] = message
            elif isinstance(message, Failed):
                raise WorkerFailed(f"{worker.name}: {message.message}")
            elif isinstance(message, _Gone):
                raise await self._died(worker, f"during {parts[0].level.label}")
        return [done[worker.index] for worker in workers]

    async def _died(self, worker: _Worker, when: str) -> WorkerFailed:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(worker.process.wait(), EXIT_TIMEOUT_S)
        code = worker.process.returncode
        if code is None:
            how = "closed its pipe"
        elif code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
        else:
            how = f"exited with code {code}"
        last = _last_line(worker.stderr_path)
        return WorkerFailed(f"{worker.name} {how} {when}" + (f": {last}" if last else ""))

    async def close(self) -> PoolOutcome:
        """Every worker told to finish (its pipe closed), waited for (killed past `EXIT_TIMEOUT_S`), its
        stderr passed on, and its traces file appended into the traces file."""
        outcome = PoolOutcome()
        for worker in self.workers:
            stdin = worker.process.stdin
            if stdin is not None and not stdin.is_closing():
                stdin.close()
        for worker in self.workers:
            try:
                await asyncio.wait_for(worker.process.wait(), EXIT_TIMEOUT_S)
            except asyncio.TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    worker.process.kill()
                await worker.process.wait()
                outcome.notes.append(f"{worker.name} did not exit within {EXIT_TIMEOUT_S:g} s: killed")
            if worker.reader is not None:
                worker.reader.cancel()
                await asyncio.gather(worker.reader, return_exceptions=True)
        for worker in self.workers:
            for line in _lines(worker.stderr_path):
                print(f"llmspans load: {worker.name}: {line}", file=sys.stderr)
            with contextlib.suppress(OSError):
                worker.stderr_path.unlink()
        with contextlib.suppress(OSError):
            self._scratch.rmdir()
        target = self.export.traces_file
        for worker in self.workers:
            if target is None or worker.traces_file is None or not worker.traces_file.exists():
                continue
            try:
                outcome.merged += _exporters.append_whole_lines(target, worker.traces_file)
                worker.traces_file.unlink()
            except OSError as error:
                outcome.notes.append(
                    f"{worker.name}'s spans are left in {worker.traces_file}: cannot append them to {target} "
                    f"({error.strerror or error})"
                )
        return outcome


def workers_for(level: Level, requests: int, asked: int | None, *, one_process_only: bool = False) -> int:
    """How many workers a level runs on: `asked` (`--workers N`) as far as the level has users or
    requests to share, or by itself (None) one per `RATE_PER_WORKER` requests/s of an open loop, at most
    one per CPU this process may use; a closed loop on one (its users wait for their answers, so the load
    it can make is the server's, and the run says when its loop was busy all the time)."""
    if one_process_only:
        return 1
    share = int(level.value) if level.shape == "concurrency" else requests
    if asked is not None:
        return max(1, min(asked, share))
    if level.shape == "concurrency":
        return 1
    return max(1, min(available_cpus(), math.ceil(level.value / RATE_PER_WORKER), share))


def workers_words(asked: int | None) -> str:
    """`--workers` in words, for the plan lines."""
    if asked == 1:
        return "workers: this process alone (--workers 1)"
    if asked is not None:
        return f"workers: {asked} processes per level (as far as its users or requests go)"
    return (
        f"workers: this process up to {RATE_PER_WORKER:g} requests/s and for a closed loop; above, one process per "
        f"{RATE_PER_WORKER:g} requests/s, at most {available_cpus()} (the CPUs here)"
    )


def _lines(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if line.strip()]


def _last_line(path: Path) -> str:
    lines = _lines(path)
    return lines[-1].strip() if lines else ""
