"""Load and soak: thousands of concurrent streams and dozens of threads, round after round.

The simulated server runs in a process of its own, so this process measures only the client. Each
round runs, at the same time, `--streams` async streams on one `AsyncOpenAI` client (every one of
them open at once: each reads its first content chunk, then waits until all have) and `--threads`
threads making `--calls` sync calls each on one `OpenAI` client. A third of the streams and calls
are abandoned early (`break`, then `del`), some async ones are cancelled (mid-stream, or before
the headers came), the rest are read to the end (and a quarter of the sync calls are not
streamed). After each round it checks, from a span processor that sees every start and end:

- every span started was ended exactly once, and there is one call span per call, with the
  outcome its kind must give (`completed`, `abandoned`, `cancelled`);
- no warning or error was logged, warned, raised in a thread or left unraisable, beyond what the
  same workload produces without llmspans (a baseline round measured first);
- no task, thread or file descriptor is left over, and RSS after each round (after a collection).

Usage: python benchmarks/soak.py [--rounds 8] [--streams 2000] [--threads 64] [--calls 20] [--json]
The bounded form runs in tests/test_soak.py.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import gc
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import openai
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from overhead import _wait_or_kill  # the benchmarks' one way to stop a child

import llmspans
from llmspans import _deferred, _telemetry
from llmspans import _names as names

MESSAGES = [{"role": "user", "content": "hi"}]
CHUNKS = 8
# Streams open at once while their headers are on the way: the simulator listens with a backlog
# of 128, and a burst beyond it is reset by the kernel (with or without llmspans).
OPENING = 50
# The cancelled kinds ask the simulator (per request, `x_sim`) to stall, so the cancellation
# lands while the task waits for a chunk, or for the headers.
STALL = 600.0
# Streams per AsyncOpenAI client: its connection pool scans every connection for each request, so
# one pool of 2,000 would spend most of the round there (with or without llmspans).
STREAMS_PER_CLIENT = 100

if hasattr(openai, "DefaultAsyncHttpx2Client"):  # openai 3.x sends through httpx2
    import httpx2 as http_library

    make_async_http: Callable[..., Any] = openai.DefaultAsyncHttpx2Client
    make_sync_http: Callable[..., Any] = openai.DefaultHttpx2Client
else:  # pragma: no cover - openai 1.x/2.x
    import httpx as http_library

    make_async_http = openai.DefaultAsyncHttpxClient
    make_sync_http = openai.DefaultHttpxClient


# --- what the client process sees ------------------------------------------------------------


class SpanLedger(SpanProcessor):
    """Every span start and end, by span id: an end without a start, or two ends, shows here."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.started: dict[int, str] = {}
        self.ends: collections.Counter[int] = collections.Counter()
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.calls = 0

    def on_start(self, span: Span, parent_context: Any = None) -> None:
        with self._lock:
            self.started[span.context.span_id] = span.name

    def on_end(self, span: ReadableSpan) -> None:
        attributes = span.attributes or {}
        with self._lock:
            self.ends[span.context.span_id] += 1
            if attributes.get(names.STAGE) == names.STAGE_LLM:
                self.calls += 1
                self.outcomes[str(attributes.get(names.STREAM_OUTCOME, "not-streamed"))] += 1

    def unended(self) -> list[str]:
        with self._lock:
            return [name for span_id, name in self.started.items() if span_id not in self.ends]

    def clear(self) -> None:
        with self._lock:
            self.started.clear()
            self.ends.clear()
            self.outcomes.clear()
            self.calls = 0


class Trouble(logging.Handler):
    """Warnings and errors from anywhere: log records, `warnings`, thread and unraisable exceptions."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.kinds: collections.Counter[str] = collections.Counter()

    def emit(self, record: logging.LogRecord) -> None:
        self.note(record.name, record.getMessage())

    def note(self, source: str, message: str) -> None:
        first_line = (message.strip().splitlines() or [""])[0]
        self.kinds[f"{source}: {re.sub(r'0x[0-9a-f]+', '0x?', first_line)[:160]}"] += 1


@contextlib.contextmanager
def trapped(trouble: Trouble) -> Iterator[None]:
    root = logging.getLogger()
    root.addHandler(trouble)
    logging.captureWarnings(True)
    previous = (threading.excepthook, sys.unraisablehook)

    def thread_hook(args: Any) -> None:
        trouble.note("thread", f"{args.exc_type.__name__}: {args.exc_value}")

    def unraisable_hook(unraisable: Any) -> None:
        trouble.note("unraisable", f"{type(unraisable.exc_value).__name__}: {unraisable.exc_value}")

    threading.excepthook, sys.unraisablehook = thread_hook, unraisable_hook
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            yield
    finally:
        threading.excepthook, sys.unraisablehook = previous
        logging.captureWarnings(False)
        root.removeHandler(trouble)


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@contextlib.contextmanager
def simulator() -> Iterator[str]:
    """The simulated server in a process of its own; yields its base URL."""
    command = [
        sys.executable, "-m", "llmspans.tools.simulator", "--port", "0", "--chunks", str(CHUNKS),
        "--first-chunk-delay", "0.02", "--chunk-gap", "0.005",
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        base_url = process.stdout.readline().strip()
        if not base_url.startswith("http://127.0.0.1:"):
            raise RuntimeError(f"the simulator did not start: {base_url!r}")
        yield base_url
    finally:
        process.terminate()
        _wait_or_kill(process, 10)
        if process.stdout is not None:
            process.stdout.close()


# --- the workload ----------------------------------------------------------------------------


def is_content(chunk: Any) -> bool:
    return bool(chunk.choices and chunk.choices[0].delta and chunk.choices[0].delta.content)


def async_kind(index: int) -> str:
    if index % 3 == 0:
        return "abandoned"
    if index % 50 == 1:
        return "cancelled_mid_stream"
    if index % 100 == 2:
        return "cancelled_before_headers"
    return "completed"


def sync_kind(index: int) -> str:
    if index % 3 == 0:
        return "abandoned"
    if index % 4 == 1:
        return "not_streamed"
    return "completed"


OUTCOME_OF = {
    "abandoned": "abandoned",
    "cancelled_mid_stream": "cancelled",
    "cancelled_before_headers": "cancelled",
    "completed": "completed",
    "not_streamed": "not-streamed",
}


@dataclass
class Round:
    """What one round did and what it left behind."""

    instrumented: bool
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    calls: int = 0
    peak_open_streams: int = 0
    expected_outcomes: dict[str, int] = field(default_factory=dict)
    outcomes: dict[str, int] = field(default_factory=dict)
    spans_started: int = 0
    spans_ended: int = 0
    spans_ended_twice: int = 0
    unended: list[str] = field(default_factory=list)
    unexpected_errors: list[str] = field(default_factory=list)
    tasks_left: int = 0
    threads_after: int = 0
    fds_after: int = 0
    rss_after: int = 0
    blocks_after: int = 0
    """Python objects' memory blocks alive after the round and a collection: a leak of objects shows
    here, free of the allocator's own growth that RSS also shows (with or without llmspans)."""


async def async_streams(base_url: str, count: int, result: Round) -> None:
    clients = []
    for _ in range(max(1, count // STREAMS_PER_CLIENT)):
        limits = http_library.Limits(
            max_connections=STREAMS_PER_CLIENT * 2, max_keepalive_connections=STREAMS_PER_CLIENT * 2
        )
        client = openai.AsyncOpenAI(
            base_url=base_url, api_key="sk-soak", max_retries=0, http_client=make_async_http(limits=limits)
        )
        clients.append(llmspans.instrument(client, phase_spans="never") if result.instrumented else client)
    opening = asyncio.Semaphore(OPENING)
    reaching = sum(1 for i in range(count) if async_kind(i) != "cancelled_before_headers")
    all_open = asyncio.Event()
    open_now = 0

    def opened() -> None:
        nonlocal open_now
        open_now += 1
        result.peak_open_streams = max(result.peak_open_streams, open_now)
        if open_now >= reaching:
            all_open.set()

    def never_opened() -> None:
        """A stream that failed before it opened (its error is the round's finding): the others must not
        wait for it, or the round hangs (seen on a loaded machine, uninstrumented round included)."""
        nonlocal reaching
        reaching -= 1
        if open_now >= reaching:
            all_open.set()

    async def one(index: int) -> None:
        nonlocal open_now
        kind = async_kind(index)
        client = clients[index % len(clients)]
        extra: dict[str, Any] = {}
        if kind == "cancelled_mid_stream":
            extra = {"x_sim": {"chunk_gap": STALL}}
        elif kind == "cancelled_before_headers":
            extra = {"x_sim": {"header_delay": STALL}}
            await client.chat.completions.create(
                model="soak", messages=MESSAGES, stream=True, extra_body=extra
            )
            raise AssertionError("the headers of a stalled request came")
        try:
            async with opening:
                stream = await client.chat.completions.create(
                    model="soak", messages=MESSAGES, stream=True, extra_body=extra
                )
            async for chunk in stream:
                if is_content(chunk):
                    break
        except BaseException:
            never_opened()
            raise
        opened()
        await all_open.wait()
        if kind == "abandoned":
            del stream
            open_now -= 1
            return
        async for _ in stream:
            pass
        open_now -= 1

    tasks = [asyncio.create_task(one(i)) for i in range(count)]
    await all_open.wait()
    await asyncio.sleep(0.05)
    for index, task in enumerate(tasks):
        if async_kind(index).startswith("cancelled"):
            task.cancel()
    for index, outcome in enumerate(await asyncio.gather(*tasks, return_exceptions=True)):
        expected_cancel = async_kind(index).startswith("cancelled")
        if isinstance(outcome, asyncio.CancelledError) and expected_cancel:
            continue
        if outcome is not None or expected_cancel:
            result.unexpected_errors.append(f"async {async_kind(index)}: {outcome!r}")
    for client in clients:
        await client.close()
    for _ in range(5):  # abandoned streams' async generators are closed by tasks the collections start
        gc.collect()
        await asyncio.sleep(0.01)
    result.tasks_left = len([t for t in asyncio.all_tasks() if t is not asyncio.current_task()])


def sync_calls(base_url: str, threads: int, calls: int, result: Round) -> None:
    http = make_sync_http(
        limits=http_library.Limits(max_connections=threads + 4, max_keepalive_connections=threads + 4)
    )
    client = openai.OpenAI(base_url=base_url, api_key="sk-soak", max_retries=0, http_client=http)
    if result.instrumented:
        llmspans.instrument(client, phase_spans="never")

    def worker(thread_index: int) -> None:
        for call_index in range(calls):
            kind = sync_kind(thread_index * calls + call_index)
            if kind == "not_streamed":
                assert client.chat.completions.create(model="soak", messages=MESSAGES).choices
                continue
            stream = client.chat.completions.create(model="soak", messages=MESSAGES, stream=True)
            for chunk in stream:
                if kind == "abandoned" and is_content(chunk):
                    break
            del stream

    with ThreadPoolExecutor(threads, thread_name_prefix="soak") as pool:
        for future in [pool.submit(worker, i) for i in range(threads)]:
            error = future.exception()
            if error is not None:
                result.unexpected_errors.append(f"sync: {error!r}")
    client.close()


def run_round(
    base_url: str, streams: int, threads: int, calls: int, ledger: SpanLedger, instrumented: bool
) -> Round:
    result = Round(instrumented=instrumented)
    expected: collections.Counter[str] = collections.Counter()
    expected.update(OUTCOME_OF[async_kind(i)] for i in range(streams))
    expected.update(OUTCOME_OF[sync_kind(i)] for i in range(threads * calls))
    result.calls = streams + threads * calls
    result.expected_outcomes = dict(expected) if instrumented else {}
    ledger.clear()
    started, cpu = time.perf_counter(), time.process_time()
    sync_side = threading.Thread(target=sync_calls, args=(base_url, threads, calls, result), name="soak-sync")
    sync_side.start()
    asyncio.run(async_streams(base_url, streams, result))
    sync_side.join()
    result.seconds = time.perf_counter() - started
    result.cpu_seconds = time.process_time() - cpu
    gc.collect()
    result.outcomes = dict(ledger.outcomes)
    result.spans_started = len(ledger.started)
    result.spans_ended = len(ledger.ends)
    result.spans_ended_twice = sum(1 for count in ledger.ends.values() if count > 1)
    result.unended = sorted(collections.Counter(ledger.unended()).elements())[:20]
    result.threads_after = threading.active_count()
    result.fds_after = open_fds()
    result.rss_after = rss_bytes()
    result.blocks_after = sys.getallocatedblocks()
    return result


@dataclass
class Soak:
    streams: int
    threads: int
    calls_per_thread: int
    threads_before: int = 0
    fds_before: int = 0
    rss_before: int = 0
    baseline: Round | None = None
    baseline_trouble: dict[str, int] = field(default_factory=dict)
    rounds: list[Round] = field(default_factory=list)
    trouble: dict[str, int] = field(default_factory=dict)
    """Warnings and errors of the instrumented rounds that the baseline round did not have."""


def soak(
    rounds: int, streams: int, threads: int, calls: int, baseline_streams: int, instrumented: bool = True
) -> Soak:
    ledger = SpanLedger()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(ledger)
    reader = InMemoryMetricReader()
    report = Soak(streams=streams, threads=threads, calls_per_thread=calls)
    with (
        simulator() as base_url,
        _telemetry.use_providers(tracer_provider, MeterProvider(metric_readers=[reader])),
    ):
        # llmspans' one worker for what finalizers hand over lives as long as the process (like the
        # SDK's export threads): started here, it is in the "before" count, and any other is a leak.
        _deferred.start_worker()
        report.threads_before, report.fds_before = threading.active_count(), open_fds()
        baseline_trouble = Trouble()
        with trapped(baseline_trouble):
            report.baseline = run_round(
                base_url, baseline_streams, max(1, threads // 4), calls, ledger, instrumented=False
            )
        report.baseline_trouble = dict(baseline_trouble.kinds)
        gc.collect()
        report.rss_before = rss_bytes()
        trouble = Trouble()
        with trapped(trouble):
            for _ in range(rounds):
                report.rounds.append(run_round(base_url, streams, threads, calls, ledger, instrumented))
                reader.get_metrics_data()  # what a periodic reader does
        report.trouble = {kind: n for kind, n in trouble.kinds.items() if kind not in baseline_trouble.kinds}
    return report


def problems(report: Soak) -> list[str]:
    """What the soak promises and did not hold; empty when all is well."""
    found = [f"{kind} (x{n})" for kind, n in report.trouble.items()]
    for number, done in enumerate(report.rounds, 1):
        where = f"round {number}"
        if done.unexpected_errors:
            found.append(f"{where}: the app saw {done.unexpected_errors[:3]}")
        if done.peak_open_streams != sum(
            1 for i in range(report.streams) if async_kind(i) != "cancelled_before_headers"
        ):
            found.append(f"{where}: only {done.peak_open_streams} streams were open at once")
        if done.tasks_left:
            found.append(f"{where}: {done.tasks_left} tasks left")
        if done.threads_after != report.threads_before:
            found.append(f"{where}: {done.threads_after} threads, {report.threads_before} before")
        if done.fds_after != report.fds_before:
            found.append(f"{where}: {done.fds_after} file descriptors, {report.fds_before} before")
        if not done.instrumented:
            continue
        if done.outcomes != done.expected_outcomes:
            found.append(f"{where}: outcomes {done.outcomes}, expected {done.expected_outcomes}")
        # One call span per call; every call here is answered by its first attempt: no attempt span, and no
        # phase spans (instrumented with phase_spans="never": under this load every call is "slow").
        if done.spans_started != done.calls or done.spans_ended != done.spans_started:
            found.append(
                f"{where}: {done.spans_started} spans started, {done.spans_ended} ended, {done.calls} calls"
            )
        if done.unended:
            found.append(f"{where}: never ended: {done.unended}")
        if done.spans_ended_twice:
            found.append(f"{where}: {done.spans_ended_twice} spans ended twice")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--streams", type=int, default=2000, help="concurrent async streams per round")
    parser.add_argument("--threads", type=int, default=64, help="threads of sync calls per round")
    parser.add_argument("--calls", type=int, default=20, help="sync calls per thread per round")
    parser.add_argument(
        "--baseline-streams", type=int, default=300, help="streams of the uninstrumented round"
    )
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_argument(
        "--uninstrumented",
        action="store_true",
        help="the same rounds without llmspans, to compare RSS and time",
    )
    args = parser.parse_args(argv)
    report = soak(
        args.rounds, args.streams, args.threads, args.calls, args.baseline_streams, not args.uninstrumented
    )
    found = problems(report)
    if args.json:
        print(json.dumps({**asdict(report), "problems": found}))
        return 0
    mb = 1 / 1e6
    print(f"{args.streams} async streams + {args.threads} threads x {args.calls} sync calls per round")
    print(
        f"before: {report.threads_before} threads, {report.fds_before} fds, RSS {report.rss_before * mb:.1f} MB"
    )
    print(
        "round  seconds  cpu-s  calls  peak-open  spans(started/ended)  tasks  threads  fds  RSS MB  blocks"
    )
    for number, done in enumerate(report.rounds, 1):
        print(
            f"{number:5}  {done.seconds:7.1f}  {done.cpu_seconds:5.1f}  {done.calls:5}  {done.peak_open_streams:9}"
            f"  {done.spans_started:>9}/{done.spans_ended:<10}  {done.tasks_left:5}  {done.threads_after:7}"
            f"  {done.fds_after:3}  {done.rss_after * mb:6.1f}  {done.blocks_after:7}"
        )
    print(f"outcomes per round: {report.rounds[-1].outcomes}")
    if report.baseline_trouble:
        print(f"also without llmspans (not counted): {report.baseline_trouble}")
    print("problems: " + ("; ".join(found) if found else "none"))
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
