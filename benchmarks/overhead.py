"""What llmspans costs the application, side by side with no instrumentation and the other instrumentations.

The simulated OpenAI-compatible server runs in processes of its own (one answers non-streamed calls, one
streams `--chunks` content chunks at zero delay), so its CPU is never counted; so does the OTLP receiver
(a tiny OTLP/HTTP sink, or Phoenix with `--receiver phoenix`). Each variant runs in its own worker
process, because global providers and instrumentations can be set up only once per process:

    none                 the openai SDK alone (the baseline)
    llmspans-file        llmspans.configure(traces_file=...): the embedded default, OTLP-JSON lines
    llmspans-otlp        llmspans.configure() with OTLP/HTTP to the local receiver
    llmspans-noprovider  llmspans.instrument() with no provider configured (instrumented, not exporting)
    llmspans-app         the app's own TracerProvider (batch, OTLP) and MeterProvider (periodic reader,
                         OTLP), as the other instrumentations get, and llmspans.instrument()
    llmspans-unsampled   llmspans-otlp with OTEL_TRACES_SAMPLER=always_off (spans dropped, metrics kept)
    llmspans-ratio       llmspans-otlp with parentbased_traceidratio at 0.01 (one trace in a hundred)
    llmspans-tail        llmspans-otlp with configure(tail_sampling=TailSampling(ratio=0.01)): every call
                         recorded, an ordinary one dropped at its end (its slowest 5 % and 1 % by chance kept)
    openllmetry          opentelemetry-instrumentation-openai, when importable
    otel-v2              opentelemetry-instrumentation-openai-v2, when importable

The other instrumentations get what their users set up: an SDK TracerProvider with a BatchSpanProcessor
and an SDK MeterProvider with a periodic reader, exporting OTLP/HTTP to the same receiver
(`--others-exporter file` gives them llmspans' file exporter instead).

The workers run one block each in turn (A B C ... then C B A ..., so machine drift cancels). A block
measures, sync then async: `--calls` non-streamed calls and `--streams` streams read to their end. Client
CPU is `time.process_time()` of the worker, which includes the exporters' background threads (spans are
flushed inside the measured window, so their export is paid for); wall time is `perf_counter`. Per
chunk means per item the caller iterated over. Time to first chunk is from `create()` to the first item
in the caller's hands. The llmspans workers also time `@llmspans.stage` on a trivial function (minus the
bare call), and a final pass measures what one open stream holds in memory (tracemalloc) after a few
chunks and near its end.

Printed: per variant the median and interquartile range over blocks, the added cost (median of the
per-round differences to the baseline's block of the same round), each other instrumentation's added
cost as a multiple of llmspans', and the targets of DESIGN §5 (issue 22).

Usage:
    python benchmarks/overhead.py               # full run, about 10 minutes on 2 cores
    python benchmarks/overhead.py --quick       # CI: tiny counts, only checks that it runs (< 60 s)
    python benchmarks/overhead.py --soak llmspans-otlp --seconds 30   # a steady load to attach py-spy to
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

LLMSPANS_VARIANTS = (
    "llmspans-file",
    "llmspans-otlp",
    "llmspans-noprovider",
    "llmspans-app",
    "llmspans-unsampled",
    "llmspans-ratio",
    "llmspans-tail",
)
# The sampler each unsampled variant runs with (OTEL_TRACES_SAMPLER, OTEL_TRACES_SAMPLER_ARG).
SAMPLERS = {
    "llmspans-unsampled": ("always_off", None),
    "llmspans-ratio": ("parentbased_traceidratio", "0.01"),
}
OTHER_VARIANTS = {
    "openllmetry": "opentelemetry.instrumentation.openai",
    "otel-v2": "opentelemetry.instrumentation.openai_v2",
}
ALL_VARIANTS = ("none", *LLMSPANS_VARIANTS, *OTHER_VARIANTS)
DESCRIPTIONS = {
    "none": "openai SDK, no instrumentation",
    "llmspans-file": "llmspans, embedded default (file exporter)",
    "llmspans-otlp": "llmspans, OTLP/HTTP to a local receiver",
    "llmspans-noprovider": "llmspans, no provider configured",
    "llmspans-app": "llmspans, the app's own TracerProvider and MeterProvider (OTLP), no configure()",
    "llmspans-unsampled": "llmspans, OTLP, the app's sampler says no (always_off)",
    "llmspans-ratio": "llmspans, OTLP, parentbased_traceidratio 0.01",
    "llmspans-tail": "llmspans, OTLP, tail sampling at 0.01 (slower than p95 kept)",
    "openllmetry": "opentelemetry-instrumentation-openai (OpenLLMetry)",
    "otel-v2": "opentelemetry-instrumentation-openai-v2",
}
MODEL = "gpt-4o-mini"
MESSAGES = [{"role": "user", "content": "Where does the time of an LLM request go?"}]
SPAN_FLUSH_BATCH = 256  # stage calls between span flushes, so the export keeps up and nothing is dropped

# Whose allocations count as the instrumentation's own in the memory figures.
_MEMORY_OWNERS = ("llmspans", "opentelemetry", "wrapt")

# The performance budget (DESIGN §5, issue 22), in seconds.
TARGET_CHUNK_S = 1.5e-6  # per streamed chunk, end to end
TARGET_TAIL_OVER_UNSAMPLED_S = 20e-6  # a tail-sampled call over an unsampled one (issue 31)
TARGET_OWN_CALL_S = 20e-6  # llmspans-noprovider: our own work
TARGET_FILE_OVER_OTLP = 1.3
TARGET_APP_OVER_OTLP = 1.3  # the app's own providers against configure()
TARGET_UNSAMPLED_CALL_S = 20e-6
TARGET_STAGE_CALLER_S = 15e-6
TARGET_STAGE_S = 25e-6


# --- servers in their own processes ---------------------------------------------------------------


class _OtlpSink(BaseHTTPRequestHandler):
    """Takes OTLP/HTTP exports and answers 200 with an empty (valid) protobuf response."""

    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        self.rfile.read(length)
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def serve_otlp() -> int:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _OtlpSink)
    server.daemon_threads = True
    print(f"http://127.0.0.1:{server.server_address[1]}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()
    return 0


def _die_with_parent() -> None:
    """In a child, before it runs: get SIGTERM if this process dies, so no server outlives a killed run."""
    if sys.platform == "linux":
        import ctypes
        import signal

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _wait_or_kill(popen: subprocess.Popen[str], seconds: float) -> None:
    """Give a child that was asked to stop `seconds` to do so, then kill it."""
    try:
        popen.wait(seconds)
    except subprocess.TimeoutExpired:
        popen.kill()
        popen.wait()


def _stream_figures(cpu: float, wall: float, items: int, first: list[float], n: int) -> dict[str, float]:
    """Per-chunk CPU and wall time since (`cpu`, `wall`), median time to first chunk, chunks per stream."""
    return {
        "chunk.cpu": (time.process_time() - cpu) / items,
        "chunk.wall": (time.perf_counter() - wall) / items,
        "ttfc": statistics.median(first),
        "items": items / n,
    }


class _Process:
    """A child process whose first line of output is the URL it serves on."""

    def __init__(self, argv: list[str], what: str) -> None:
        self.what = what
        self.popen = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, preexec_fn=_die_with_parent)
        assert self.popen.stdout is not None
        self.url = self.popen.stdout.readline().strip()
        if not self.url:
            raise RuntimeError(f"{what} did not start (exit code {self.popen.wait()})")

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            _wait_or_kill(self.popen, 5)


@dataclass
class Servers:
    calls_url: str
    streams_url: str
    traces_url: str
    metrics_url: str
    receiver: str


@contextlib.contextmanager
def servers(chunks: int, receiver: str) -> Iterator[Servers]:
    started: list[_Process] = []
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: [process.stop() for process in reversed(started)])
        simulator = [sys.executable, "-m", "llmspans.tools.simulator", "--port", "0"]
        started.append(_Process([*simulator, "--chunks", "16"], "the simulated server (calls)"))
        started.append(_Process([*simulator, "--chunks", str(chunks)], "the simulated server (streams)"))
        started.append(_Process([sys.executable, __file__, "--serve-otlp"], "the OTLP receiver"))
        sink = started[-1].url
        traces_url = f"{sink}/v1/traces"
        if receiver == "phoenix":
            sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
            from tests.support.realservers import phoenix_server

            phoenix = stack.enter_context(phoenix_server())
            traces_url = phoenix.traces_url  # Phoenix takes traces only: metrics still go to the sink
        yield Servers(
            calls_url=started[0].url,
            streams_url=started[1].url,
            traces_url=traces_url,
            metrics_url=f"{sink}/v1/metrics",
            receiver="Phoenix (traces) + OTLP sink (metrics)" if receiver == "phoenix" else "OTLP/HTTP sink",
        )


# --- the worker: one variant, set up once, measured block by block ---------------------------------


def _flush() -> None:
    """Export every finished span now (inside the measured window, so the export is paid for)."""
    from opentelemetry import trace

    provider = trace.get_tracer_provider()
    flush = getattr(provider, "force_flush", None)
    if flush is not None:
        flush()


def _sdk_providers(exporter_kind: str, traces_file: str) -> None:
    """What a user of another instrumentation sets up: SDK providers, batch spans, periodic metrics."""
    from opentelemetry import metrics, trace
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    if exporter_kind == "file":
        from opentelemetry.exporter.otlp.json.file import FileMetricExporter, FileSpanExporter

        stream = open(traces_file, "a", encoding="utf-8")  # noqa: SIM115 - lives as long as the worker
        span_exporter: Any = FileSpanExporter(stream=stream)
        metric_exporter: Any = FileMetricExporter(stream=stream)
    else:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        span_exporter, metric_exporter = OTLPSpanExporter(), OTLPMetricExporter()  # the OTEL_* variables
    resource = Resource.create({"service.name": "overhead-benchmark"})
    tracer_provider = TracerProvider(resource=resource)
    tracer_provider.add_span_processor(BatchSpanProcessor(span_exporter))
    trace.set_tracer_provider(tracer_provider)
    reader = PeriodicExportingMetricReader(metric_exporter)
    metrics.set_meter_provider(MeterProvider(resource=resource, metric_readers=[reader]))


class Worker:
    def __init__(self, variant: str, calls_url: str, streams_url: str, traces_file: str, others: str) -> None:
        import openai

        self.variant = variant
        if variant in ("llmspans-file", "llmspans-otlp", "llmspans-tail", *SAMPLERS):
            import llmspans

            if variant in SAMPLERS:
                sampler, argument = SAMPLERS[variant]
                os.environ["OTEL_TRACES_SAMPLER"] = sampler
                if argument is not None:
                    os.environ["OTEL_TRACES_SAMPLER_ARG"] = argument
            if variant == "llmspans-file":
                llmspans.configure(traces_file=traces_file)
            elif variant == "llmspans-tail":
                llmspans.configure(tail_sampling=llmspans.TailSampling(ratio=0.01))
            else:
                llmspans.configure()  # the OTEL_EXPORTER_OTLP_*_ENDPOINT variables name the receiver
        elif variant == "llmspans-app":
            _sdk_providers(others, traces_file)  # what the app sets up itself; llmspans.instrument() below
        elif variant == "openllmetry":
            _sdk_providers(others, traces_file)
            from opentelemetry.instrumentation.openai import OpenAIInstrumentor

            OpenAIInstrumentor().instrument()
        elif variant == "otel-v2":
            _sdk_providers(others, traces_file)
            from opentelemetry.instrumentation.openai_v2 import OpenAIInstrumentor as V2Instrumentor

            V2Instrumentor().instrument()

        def client(cls: Any, url: str) -> Any:
            made = cls(base_url=url, api_key="benchmark", max_retries=0)
            if variant.startswith("llmspans"):
                import llmspans

                return llmspans.instrument(made)
            return made

        self.calls = client(openai.OpenAI, calls_url)
        self.streams = client(openai.OpenAI, streams_url)
        self.async_calls = client(openai.AsyncOpenAI, calls_url)
        self.async_streams = client(openai.AsyncOpenAI, streams_url)
        self.loop = asyncio.new_event_loop()
        self.staged: tuple[Callable[..., Any], Callable[..., Any]] | None = None
        if variant.startswith("llmspans"):
            import llmspans

            @llmspans.stage("benchmark")
            def staged(value: int) -> int:
                return value

            @llmspans.stage("benchmark")
            async def astaged(value: int) -> int:
                return value

            self.staged = (staged, astaged)

    # one measurement: CPU and wall per unit, spans flushed inside the window

    def _sync_calls(self, n: int) -> dict[str, float]:
        create = self.calls.chat.completions.create
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(n):
            create(model=MODEL, messages=MESSAGES)
        _flush()
        return {"call.cpu": (time.process_time() - cpu) / n, "call.wall": (time.perf_counter() - wall) / n}

    def _sync_streams(self, n: int) -> dict[str, float]:
        create = self.streams.chat.completions.create
        items = 0
        first: list[float] = []
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(n):
            started = time.perf_counter()
            stream = create(model=MODEL, messages=MESSAGES, stream=True)
            iterator = iter(stream)
            next(iterator)
            first.append(time.perf_counter() - started)
            items += 1
            for _chunk in iterator:
                items += 1
        _flush()
        return _stream_figures(cpu, wall, items, first, n)

    async def _async_calls(self, n: int) -> dict[str, float]:
        create = self.async_calls.chat.completions.create
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(n):
            await create(model=MODEL, messages=MESSAGES)
        _flush()
        return {"call.cpu": (time.process_time() - cpu) / n, "call.wall": (time.perf_counter() - wall) / n}

    async def _async_streams(self, n: int) -> dict[str, float]:
        create = self.async_streams.chat.completions.create
        items = 0
        first: list[float] = []
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(n):
            started = time.perf_counter()
            stream = await create(model=MODEL, messages=MESSAGES, stream=True)
            iterator = stream.__aiter__()
            await iterator.__anext__()
            first.append(time.perf_counter() - started)
            items += 1
            async for _chunk in iterator:
                items += 1
        _flush()
        return _stream_figures(cpu, wall, items, first, n)

    def _stage(self, n: int) -> dict[str, float]:
        """`@llmspans.stage` on a trivial function, minus the bare function, per call."""
        assert self.staged is not None
        staged, astaged = self.staged

        def bare(value: int) -> int:
            return value

        async def abare(value: int) -> int:
            return value

        def run_sync(func: Callable[[int], int]) -> tuple[float, float]:
            cpu, caller = time.process_time(), 0.0
            for start in range(0, n, SPAN_FLUSH_BATCH):
                own = time.thread_time()
                for value in range(start, min(n, start + SPAN_FLUSH_BATCH)):
                    func(value)
                caller += time.thread_time() - own
                _flush()
            return (time.process_time() - cpu) / n, caller / n

        async def run_async(func: Callable[[int], Any]) -> tuple[float, float]:
            cpu, caller = time.process_time(), 0.0
            for start in range(0, n, SPAN_FLUSH_BATCH):
                own = time.thread_time()
                for value in range(start, min(n, start + SPAN_FLUSH_BATCH)):
                    await func(value)
                caller += time.thread_time() - own
                _flush()
            return (time.process_time() - cpu) / n, caller / n

        sync_cpu, sync_own = run_sync(staged)
        bare_cpu, bare_own = run_sync(bare)
        async_cpu, async_own = self.loop.run_until_complete(run_async(astaged))
        abare_cpu, abare_own = self.loop.run_until_complete(run_async(abare))
        return {
            "stage.sync.cpu": sync_cpu - bare_cpu,
            "stage.sync.caller": sync_own - bare_own,
            "stage.async.cpu": async_cpu - abare_cpu,
            "stage.async.caller": async_own - abare_own,
        }

    def block(self, calls: int, streams: int, stage_calls: int) -> dict[str, float]:
        result: dict[str, float] = {}
        result.update({f"sync.{k}": v for k, v in self._sync_calls(calls).items()})
        result.update({f"sync.{k}": v for k, v in self._sync_streams(streams).items()})
        result.update(
            {f"async.{k}": v for k, v in self.loop.run_until_complete(self._async_calls(calls)).items()}
        )
        streamed = self.loop.run_until_complete(self._async_streams(streams))
        result.update({f"async.{k}": v for k, v in streamed.items()})
        if self.staged is not None and stage_calls:
            result.update(self._stage(stage_calls))
        return result

    def memory(self, chunks: int) -> dict[str, float]:
        """What one open stream holds (tracemalloc) after a few chunks and a few chunks before its end.

        "owned" counts only blocks allocated by llmspans, OpenTelemetry or wrapt code (the
        instrumentation's share); "total" is everything the process allocated and still holds.
        """
        import tracemalloc

        early, late = min(10, chunks // 4), max(1, chunks - 10)
        owners = [tracemalloc.Filter(True, f"*{os.sep}{name}{os.sep}*") for name in _MEMORY_OWNERS]

        def measure() -> tuple[int, int]:
            gc.collect()
            snapshot = tracemalloc.take_snapshot()
            owned = sum(stat.size for stat in snapshot.filter_traces(owners).statistics("filename"))
            return owned, tracemalloc.get_traced_memory()[0]

        _flush()
        tracemalloc.start()
        try:
            before = measure()
            stream = self.streams.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True)
            held: dict[int, tuple[int, int]] = {}
            for index, _chunk in enumerate(stream, start=1):
                if index in (early, late):
                    del _chunk
                    held[index] = measure()
                    if index == late:
                        break
            stream.close()
        finally:
            tracemalloc.stop()
        return {
            "memory.owned.early": held[early][0] - before[0],
            "memory.owned.late": held[late][0] - before[0],
            "memory.total.early": held[early][1] - before[1],
            "memory.total.late": held[late][1] - before[1],
            "memory.early": early,
            "memory.late": late,
        }

    def close(self) -> None:
        for client in (self.async_calls, self.async_streams):
            self.loop.run_until_complete(client.close())
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()

    def warm_up(self) -> None:
        self._sync_calls(5)
        self._sync_streams(1)
        self.loop.run_until_complete(self._async_calls(5))
        self.loop.run_until_complete(self._async_streams(1))
        if self.staged is not None:
            self._stage(SPAN_FLUSH_BATCH)


def worker_main(args: argparse.Namespace) -> int:
    worker = Worker(args.worker, args.calls_url, args.streams_url, args.traces_file, args.others_exporter)
    worker.warm_up()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        try:
            if command["cmd"] == "block":
                reply: dict[str, Any] = worker.block(command["calls"], command["streams"], command["stage"])
            elif command["cmd"] == "memory":
                reply = worker.memory(command["chunks"])
            else:
                break
        except Exception:
            traceback.print_exc()
            return 1
        print(json.dumps(reply), flush=True)
    worker.close()
    return 0


class WorkerProcess:
    def __init__(self, variant: str, srv: Servers, workdir: Path, others: str) -> None:
        self.variant = variant
        env = {
            **os.environ,
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": srv.traces_url,
            "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": srv.metrics_url,
            "OTEL_SERVICE_NAME": "overhead-benchmark",
        }
        for variable in ("OTEL_EXPORTER_OTLP_ENDPOINT", "LLMSPANS_TRACES_FILE", "LLMSPANS_BUDGETS"):
            env.pop(variable, None)
        argv = [
            sys.executable, __file__, "--worker", variant, "--calls-url", srv.calls_url,
            "--streams-url", srv.streams_url, "--traces-file", str(workdir / f"{variant}.jsonl"),
            "--others-exporter", others,
        ]  # fmt: skip
        self.popen = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=workdir,
            preexec_fn=_die_with_parent,
        )  # fmt: skip

    def wait_ready(self) -> None:
        self._read()

    def ask(self, **command: Any) -> dict[str, float]:
        assert self.popen.stdin is not None
        self.popen.stdin.write(json.dumps(command) + "\n")
        self.popen.stdin.flush()
        return self._read()

    def _read(self) -> dict[str, Any]:
        assert self.popen.stdout is not None
        line = self.popen.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.variant} died (exit code {self.popen.wait()})")
        return dict(json.loads(line))

    def stop(self) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(OSError):
                assert self.popen.stdin is not None
                self.popen.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.popen.stdin.close()
            _wait_or_kill(self.popen, 20)


# --- the coordinator ----------------------------------------------------------------------------------


@dataclass
class Results:
    variants: list[str]
    blocks: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    memory: dict[str, dict[str, float]] = field(default_factory=dict)

    def values(self, variant: str, key: str) -> list[float]:
        return [block[key] for block in self.blocks[variant] if key in block]

    def added(self, variant: str, key: str) -> list[float]:
        """Per round, this variant's block minus the baseline's block of the same round."""
        return [
            mine[key] - base[key]
            for mine, base in zip(self.blocks[variant], self.blocks["none"], strict=True)
            if key in mine and key in base
        ]


def quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, median, q3


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def us(seconds: float) -> str:
    return f"{seconds * 1e6:.2f}"


def _importable(module: str) -> bool:
    """find_spec raises for a dotted name whose parent package is absent: treat that as absent too."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def run(args: argparse.Namespace) -> int:
    variants = [v for v in ALL_VARIANTS if v in args.variants]
    missing = [v for v in variants if v in OTHER_VARIANTS and not _importable(OTHER_VARIANTS[v])]
    for variant in missing:
        print(f"(skipping {variant}: {OTHER_VARIANTS[variant]} is not importable here)")
    variants = [v for v in variants if v not in missing]
    if "none" not in variants:
        variants.insert(0, "none")
    receiver = args.receiver
    if receiver == "auto":
        receiver = "phoenix" if os.environ.get("LLMSPANS_REAL_SERVERS_DIR") and not args.quick else "sink"
    started = time.monotonic()
    results = Results(variants=variants)
    with (
        servers(args.chunks, receiver) as srv,
        tempfile.TemporaryDirectory(prefix="llmspans-overhead-") as tmp,
    ):
        workers = [WorkerProcess(v, srv, Path(tmp), args.others_exporter) for v in variants]
        try:
            for worker in workers:
                worker.wait_ready()
            print(
                f"{len(variants)} workers ready in {time.monotonic() - started:.1f} s; {args.rounds} rounds of "
                f"{args.calls} calls + {args.streams} streams of {args.chunks} chunks (sync and async) each; "
                f"receiver: {srv.receiver}",
                flush=True,
            )
            for round_index in range(args.rounds):
                order = workers if round_index % 2 == 0 else list(reversed(workers))
                for worker in order:
                    block = worker.ask(
                        cmd="block", calls=args.calls, streams=args.streams, stage=args.stage_calls
                    )
                    results.blocks.setdefault(worker.variant, []).append(block)
                print(
                    f"  round {round_index + 1}/{args.rounds} done ({time.monotonic() - started:.0f} s)",
                    flush=True,
                )
            for worker in workers:
                if worker.variant in ("none", "llmspans-file", "llmspans-noprovider") or args.memory_all:
                    results.memory[worker.variant] = worker.ask(cmd="memory", chunks=args.chunks)
        finally:
            for worker in workers:
                worker.stop()
    report(results, args, srv.receiver, time.monotonic() - started)
    if args.json:
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "blocks": results.blocks, "memory": results.memory})
        )
    return 0


def report(results: Results, args: argparse.Namespace, receiver: str, elapsed: float) -> None:
    variants = results.variants
    width = max(len(v) for v in variants)
    print(
        f"\nClient overhead, openai SDK against a local zero-delay server ({args.rounds} interleaved rounds, "
        f"{args.calls} calls and {args.streams} x {args.chunks}-chunk streams per block; median [IQR] over "
        f"blocks; 'added' = median of per-round differences to the baseline; µs unless marked)\n"
    )
    for mode in ("sync", "async"):
        header = (
            f"{'variant':<{width}}  {'CPU/call':>17}  {'added':>7}  {'wall/call':>9}  {'added':>7}  "
            f"{'CPU/chunk':>15}  {'added':>6}  {'wall/chunk':>10}  {'added':>6}  {'TTFC ms':>7}  {'added':>7}"
        )
        print(f"[{mode}]")
        print(header)
        print("-" * len(header))
        for variant in variants:
            row = [f"{variant:<{width}}"]
            for key, digits in (("call.cpu", 1), ("call.wall", 1), ("chunk.cpu", 2), ("chunk.wall", 2)):
                q1, mid, q3 = quartiles(results.values(variant, f"{mode}.{key}"))
                fmt = f"{{:.{digits}f}}"
                spread = f"{fmt.format(mid * 1e6)} [{fmt.format(q1 * 1e6)}-{fmt.format(q3 * 1e6)}]"
                if key.endswith("cpu"):
                    row.append(f"{spread:>{17 if key == 'call.cpu' else 15}}")
                else:
                    row.append(f"{fmt.format(mid * 1e6):>{9 if key == 'call.wall' else 10}}")
                added = median(results.added(variant, f"{mode}.{key}")) if variant != "none" else 0.0
                row.append(f"{fmt.format(added * 1e6):>{7 if key.startswith('call') else 6}}")
            ttfc = median(results.values(variant, f"{mode}.ttfc"))
            ttfc_added = median(results.added(variant, f"{mode}.ttfc")) if variant != "none" else 0.0
            row.append(f"{ttfc * 1e3:>7.3f}  {ttfc_added * 1e3:>+7.3f}")
            print("  ".join(row))
        print()

    others = [v for v in variants if v in OTHER_VARIANTS]
    reference = "llmspans-otlp" if args.others_exporter == "otlp" else "llmspans-file"
    if others and reference in variants:
        print(
            f"Added client CPU of each other instrumentation as a multiple of {reference}'s (same exporter kind):"
        )
        for mode in ("sync", "async"):
            for key, what in (("call.cpu", "per call"), ("chunk.cpu", "per chunk")):
                ours = median(results.added(reference, f"{mode}.{key}"))
                parts = [
                    f"{other} {median(results.added(other, f'{mode}.{key}')) / ours:.1f}x"
                    if ours > 0
                    else f"{other} n/a"
                    for other in others
                ]
                print(f"  {mode:<5} {what:<9}  llmspans {us(ours)} µs;  " + ", ".join(parts))
        print()

    staged = [v for v in variants if any("stage.sync.cpu" in b for b in results.blocks.get(v, []))]
    if staged:
        print(
            "@llmspans.stage on a trivial function, added per call (µs, median [IQR]; process CPU incl. export / caller thread only):"
        )
        for variant in staged:
            cells = []
            for key in ("stage.sync.cpu", "stage.sync.caller", "stage.async.cpu", "stage.async.caller"):
                q1, mid, q3 = quartiles(results.values(variant, key))
                cells.append(f"{key[6:]} {us(mid)} [{us(q1)}-{us(q3)}]")
            print(f"  {variant:<{width}}  " + ";  ".join(cells))
        print()

    if results.memory:
        print("Memory held by one open stream (tracemalloc, bytes, after gc; owned = allocated by llmspans,")
        print(
            "OpenTelemetry or wrapt code; total = everything the process still holds, the SDK's buffers included):"
        )
        for variant, memory in results.memory.items():
            print(
                f"  {variant:<{width}}  owned {memory['memory.owned.early']:>8,.0f} after "
                f"{memory['memory.early']:.0f} chunks, {memory['memory.owned.late']:>8,.0f} after "
                f"{memory['memory.late']:.0f} (growth {_growth(memory, 'owned'):+,.0f});  total "
                f"{memory['memory.total.early']:>8,.0f} -> {memory['memory.total.late']:>8,.0f}"
            )
        print()

    verdicts = targets(results, args, others)
    if verdicts:
        print("Targets (DESIGN §5, issue 22):")
        for line in verdicts:
            print(f"  {line}")
        print()
    print(f"Done in {elapsed:.0f} s.")


def _growth(memory: dict[str, float], kind: str) -> float:
    return memory[f"memory.{kind}.late"] - memory[f"memory.{kind}.early"]


def targets(results: Results, args: argparse.Namespace, others: list[str]) -> list[str]:
    """The performance budget of DESIGN §5 (issue 22), each figure a median of per-round differences."""
    lines: list[str] = []
    mine = [v for v in ("llmspans-file", "llmspans-otlp") if v in results.variants]

    def verdict(ok: bool) -> str:
        return "met   " if ok else "NOT met"

    def added(variant: str, key: str) -> float:
        return median(results.added(variant, key))

    v2 = "otel-v2" if "otel-v2" in results.variants else None
    for mode in ("sync", "async"):
        for key, limit, what in (
            ("chunk.cpu", TARGET_CHUNK_S, "per streamed chunk"),
            ("call.cpu", None, "per non-streamed call"),
        ):
            peer = added(v2, f"{mode}.{key}") if v2 else None
            for variant in mine:
                ours = added(variant, f"{mode}.{key}")
                if variant == "llmspans-file" and "llmspans-otlp" in results.variants and key == "call.cpu":
                    otlp = added("llmspans-otlp", f"{mode}.{key}")
                    lines.append(
                        f"{verdict(ours <= otlp * TARGET_FILE_OVER_OTLP)}  {mode:<5} {what:<22} {variant:<18} "
                        f"added {us(ours):>7} µs (<= {TARGET_FILE_OVER_OTLP} x llmspans-otlp's {us(otlp)})"
                    )
                    continue
                if limit is None and peer is None:
                    continue  # per call, the bar is otel-v2's in the same run
                ok = (limit is None or ours <= limit) and (peer is None or ours <= peer)
                bars = [f"<= {us(limit)}"] if limit is not None else []
                bars += [f"<= otel-v2's {us(peer)}"] if peer is not None else []
                lines.append(
                    f"{verdict(ok)}  {mode:<5} {what:<22} {variant:<18} added {us(ours):>7} µs ({', '.join(bars)})"
                )
        if "llmspans-noprovider" in results.variants:
            ours = added("llmspans-noprovider", f"{mode}.call.cpu")
            lines.append(
                f"{verdict(ours <= TARGET_OWN_CALL_S)}  {mode:<5} {'own work per call':<22} "
                f"{'llmspans-noprovider':<18} added {us(ours):>7} µs (<= {us(TARGET_OWN_CALL_S)})"
            )
        if "llmspans-app" in results.variants and "llmspans-otlp" in results.variants:
            for key, what in (("call.cpu", "per call"), ("chunk.cpu", "per chunk")):
                app, otlp = added("llmspans-app", f"{mode}.{key}"), added("llmspans-otlp", f"{mode}.{key}")
                lines.append(
                    f"{verdict(app <= otlp * TARGET_APP_OVER_OTLP)}  {mode:<5} {'app providers ' + what:<22} "
                    f"{'llmspans-app':<18} added {us(app):>7} µs (<= {TARGET_APP_OVER_OTLP} x llmspans-otlp's "
                    f"{us(otlp)})"
                )
    for variant in ("llmspans-unsampled", "llmspans-ratio"):
        if variant in results.variants:
            for mode in ("sync", "async"):
                ours = added(variant, f"{mode}.call.cpu")
                lines.append(
                    f"{verdict(ours <= TARGET_UNSAMPLED_CALL_S)}  {mode:<5} {'unsampled call':<22} {variant:<18} "
                    f"added {us(ours):>7} µs (<= {us(TARGET_UNSAMPLED_CALL_S)})"
                )
    if "llmspans-tail" in results.variants and "llmspans-unsampled" in results.variants:
        for mode in ("sync", "async"):
            tail, unsampled = (
                added("llmspans-tail", f"{mode}.call.cpu"),
                added("llmspans-unsampled", f"{mode}.call.cpu"),
            )
            lines.append(
                f"{verdict(tail <= unsampled + TARGET_TAIL_OVER_UNSAMPLED_S)}  {mode:<5} {'tail-sampled call':<22} "
                f"{'llmspans-tail':<18} added {us(tail):>7} µs (<= llmspans-unsampled's {us(unsampled)} + "
                f"{us(TARGET_TAIL_OVER_UNSAMPLED_S)})"
            )
    for variant in [*mine, *(v for v in ("llmspans-app",) if v in results.variants)]:
        for flavour in ("sync", "async"):
            for key, limit, what in (
                (f"stage.{flavour}.caller", TARGET_STAGE_CALLER_S, "caller's thread"),
                (f"stage.{flavour}.cpu", TARGET_STAGE_S, "with export"),
            ):
                values = results.values(variant, key)
                if values:
                    ours = median(values)
                    lines.append(
                        f"{verdict(ours <= limit)}  @stage {flavour:<5} {what:<15} {variant:<18} {us(ours):>7} µs "
                        f"(<= {us(limit)})"
                    )
    for variant in mine:
        for mode in ("sync", "async"):
            ttfc = added(variant, f"{mode}.ttfc")
            q1, _, q3 = quartiles(results.values("none", f"{mode}.ttfc"))
            lines.append(
                f"{verdict(abs(ttfc) <= q3 - q1)}  time to first chunk {mode:<5} {variant:<18} "
                f"{ttfc * 1e3:+.3f} ms (within the baseline's own spread, IQR {(q3 - q1) * 1e3:.3f} ms)"
            )
    for variant, memory in results.memory.items():
        if variant != "none":
            growth = _growth(memory, "owned")
            lines.append(
                f"{verdict(abs(growth) < 1024)}  memory per open stream constant in its length: {variant} "
                f"owns {growth:+,.0f} B more after {memory['memory.late']:.0f} chunks than after "
                f"{memory['memory.early']:.0f}"
            )
    return lines


# --- a steady load for a profiler ----------------------------------------------------------------------


def soak(args: argparse.Namespace) -> int:
    """Stream (or call, with --calls-only) for `--seconds` in one process, for py-spy or cProfile to watch."""
    with servers(args.chunks, "sink") as srv, tempfile.TemporaryDirectory(prefix="llmspans-soak-") as tmp:
        os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = srv.traces_url
        os.environ["OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"] = srv.metrics_url
        worker = Worker(
            args.soak, srv.calls_url, srv.streams_url, str(Path(tmp) / "soak.jsonl"), args.others_exporter
        )
        worker.warm_up()
        deadline = time.monotonic() + args.seconds
        rounds = 0
        while time.monotonic() < deadline:
            if args.soak_what in ("streams", "both"):
                worker._sync_streams(1)
            if args.soak_what in ("calls", "both"):
                worker._sync_calls(50)
            if args.soak_what == "stage":
                worker._stage(5000)
            rounds += 1
        print(f"soak {args.soak}: {rounds} rounds", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny counts: only checks that it runs (CI)")
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument(
        "--calls", type=int, default=300, help="non-streamed calls per block (sync and async each)"
    )
    parser.add_argument("--streams", type=int, default=8, help="streams per block (sync and async each)")
    parser.add_argument("--chunks", type=int, default=2000, help="content chunks per stream")
    parser.add_argument("--stage-calls", type=int, default=5000, help="@stage calls per block")
    parser.add_argument("--variants", nargs="+", default=list(ALL_VARIANTS), choices=ALL_VARIANTS)
    parser.add_argument("--receiver", choices=("auto", "sink", "phoenix"), default="auto",
                        help="OTLP receiver for traces; auto = Phoenix when LLMSPANS_REAL_SERVERS_DIR is set")  # fmt: skip
    parser.add_argument("--others-exporter", choices=("otlp", "file"), default="otlp")
    parser.add_argument("--memory-all", action="store_true", help="measure memory in every worker")
    parser.add_argument("--json", help="also write the raw per-block figures to this file")
    parser.add_argument(
        "--soak", choices=ALL_VARIANTS, help="run one variant under steady load (for a profiler)"
    )
    parser.add_argument("--soak-what", choices=("streams", "calls", "both", "stage"), default="streams")
    parser.add_argument("--seconds", type=float, default=20.0)
    # internal: the processes this script starts
    parser.add_argument("--serve-otlp", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker", choices=ALL_VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--calls-url", help=argparse.SUPPRESS)
    parser.add_argument("--streams-url", help=argparse.SUPPRESS)
    parser.add_argument("--traces-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_otlp:
        return serve_otlp()
    if args.worker:
        return worker_main(args)
    if args.quick:
        args.rounds, args.calls, args.streams, args.chunks, args.stage_calls = 2, 5, 1, 200, 300
    if args.soak:
        return soak(args)
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
