"""The floor under llmspans' cost, measured in the same run: every figure printed as "floor + ours".

The floor is what the OpenTelemetry SDK alone costs for what llmspans records, with nothing of
llmspans running: for a sampled call, its span with the same start and end attributes (as a
warm-up call's span has them), the context attached while the request is sent, the `traceparent`
injected, `end()`, the batch processor and the OTLP protobuf encoding; unsampled, the sampler's
non-recording span with the same context handling; for a stage, its span with its two attributes.
A streamed chunk has no floor: the SDK does nothing per chunk. `Histogram.record` on the
application's MeterProvider is printed on its own line, for reference: what one value costs
through the SDK's instruments.

Each set-up runs in a process of its own (global providers are once per process), on the
in-memory openai transport of `inprocess.py`:

    none            `instrument()`, no provider anywhere
    configure       `configure()`, OTLP/HTTP to a local sink
    unsampled       the same with OTEL_TRACES_SAMPLER=always_off
    tail            `configure(tail_sampling=TailSampling(ratio=0.01))`: every span recorded, most dropped at
                    their end (the floor's spans go through tail sampling too: it is on the provider)
    app             the application's own TracerProvider (batch, OTLP) and MeterProvider (periodic
                    reader, OTLP), then `instrument()`
    app-unsampled   the same with an always-off sampler
    otel-v2         the application's providers and opentelemetry-instrumentation-openai-v2 (reference)

Two meters: CPU time (`time.process_time()`, paired A B / B A repetitions, median of the differences;
"stage, caller" counts the calling thread alone), or `--instructions`: every set-up under valgrind's
callgrind, instructions counted exactly between two points of the run (a tiny C shim issues
callgrind's client requests; it needs gcc and valgrind's headers). Instruction counts do not move
with the machine's load, which on a shared machine is the only way to see a few µs.

    python benchmarks/floor.py                          # CPU time, every set-up (about 4 minutes)
    python benchmarks/floor.py --instructions           # instructions (about 10 minutes)
    python benchmarks/floor.py --setups configure app --what calls
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import ctypes
import gc
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import inprocess
from overhead import _flush

HERE = Path(__file__).resolve().parent
SETUPS = ("none", "configure", "unsampled", "tail", "app", "app-unsampled", "otel-v2")
WHAT = ("calls", "acalls", "streams", "astreams", "stage", "astage")
STAGE_BATCH = 256  # stage calls between flushes, as overhead.py


# --- the meters ---------------------------------------------------------------------------------------

_SHIM = r"""
#include <valgrind/callgrind.h>
void llmspans_start(void) { CALLGRIND_START_INSTRUMENTATION; }
void llmspans_zero(void) { CALLGRIND_ZERO_STATS; }
void llmspans_dump(const char *label) { CALLGRIND_DUMP_STATS_AT(label); }
int llmspans_on_valgrind(void) { return RUNNING_ON_VALGRIND; }
"""


def _build_shim(directory: Path) -> Path:
    source, library = directory / "shim.c", directory / "shim.so"
    source.write_text(_SHIM)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", str(library), str(source)], check=True)
    return library


class Instructions:
    """Instructions executed by the whole process (every thread) while `fn` runs, from callgrind."""

    unit = "instr"

    def __init__(self, shim: str, out_file: str) -> None:
        self._lib = ctypes.CDLL(shim)
        if not self._lib.llmspans_on_valgrind():
            raise RuntimeError("--instructions runs its set-ups under valgrind; this one is not")
        self._out = out_file
        self._parts = 0
        self._lib.llmspans_start()  # started without instrumentation: the imports run at valgrind's pace

    def measure(self, fn: Callable[[], Any]) -> float:
        gc.collect()  # both arms start from the same heap: a full collection lands in neither by chance
        self._lib.llmspans_zero()
        fn()
        self._lib.llmspans_dump(b"measured")
        self._parts += 1
        with open(f"{self._out}.{self._parts}") as dump:
            for line in dump:
                if line.startswith("summary:"):
                    return float(line.split()[1])
        raise RuntimeError("callgrind wrote no summary")


class CpuTime:
    """Process CPU time (every thread: the exporters' too) while `fn` runs, in seconds."""

    unit = "s"

    def __init__(self, clock: Callable[[], float] = time.process_time) -> None:
        self._clock = clock

    def measure(self, fn: Callable[[], Any]) -> float:
        gc.collect()
        started = self._clock()
        fn()
        return self._clock() - started


def added(
    meter: Any, plain: Callable[[], Any], instrumented: Callable[[], Any], units: int, repeats: int
) -> float:
    """Median over paired repetitions (A B, B A, ...) of (instrumented - plain) per unit."""
    differences = []
    for repeat in range(repeats):
        if repeat % 2:
            mine = meter.measure(instrumented)
            base = meter.measure(plain)
        else:
            base = meter.measure(plain)
            mine = meter.measure(instrumented)
        differences.append((mine - base) / units)
    return statistics.median(differences)


# --- the set-ups ------------------------------------------------------------------------------------------


def set_up(setup: str) -> tuple[Any, inprocess._Switch]:
    """Providers and instrumentation for one set-up; the instrumented-client factory's peer and switch."""
    if setup in ("unsampled", "app-unsampled"):
        os.environ["OTEL_TRACES_SAMPLER"] = "always_off"
    import llmspans

    switch = inprocess._Switch()
    if setup in ("configure", "unsampled"):
        llmspans.configure(metric_interval=3600)  # a metric export costs per interval, not per call
    elif setup == "tail":
        llmspans.configure(metric_interval=3600, tail_sampling=llmspans.TailSampling(ratio=0.01))
    elif setup in ("app", "app-unsampled", "otel-v2"):
        inprocess._peer_providers("otlp", metric_interval_ms=3_600_000)
        if setup == "otel-v2":
            from opentelemetry.instrumentation.openai_v2 import OpenAIInstrumentor

            switch = inprocess._Switch(OpenAIInstrumentor())
    return ("otel-v2" if setup == "otel-v2" else "llmspans"), switch


def _call_span_shape(
    factories: dict[str, Callable[[bool], Any]],
) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """The name, start attributes and end attributes of the span llmspans makes for the benchmark's call."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON

    from llmspans import _names as names
    from llmspans import _telemetry

    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider(sampler=ALWAYS_ON)  # whatever the set-up samples: the span it would be
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    with _telemetry.use_providers(tracer_provider, MeterProvider()):
        factories["sync"](True).chat.completions.create(model=inprocess.MODEL, messages=inprocess.MESSAGES)
    spans = exporter.get_finished_spans()
    (span,) = [span for span in spans if (span.attributes or {}).get(names.STAGE) == names.STAGE_LLM]
    attributes = dict(span.attributes or {})
    start_keys = (names.GEN_AI_OPERATION_NAME, names.GEN_AI_PROVIDER_NAME, names.STAGE, names.GEN_AI_REQUEST_MODEL,
                  names.SERVER_ADDRESS, names.SERVER_PORT)  # fmt: skip
    start = {key: attributes.pop(key) for key in start_keys if key in attributes}
    return span.name, start, attributes


def floors(setup: str, shape: tuple[str, dict[str, Any], dict[str, Any]]) -> dict[str, Callable[[int], None]]:
    """name -> run(n): the SDK alone doing, n times, what llmspans asks of it for one call or stage."""
    from opentelemetry import context, metrics, propagate, trace
    from opentelemetry.trace import SpanKind

    name, start, end = shape
    tracer = trace.get_tracer("floor")

    def call_span(n: int) -> None:
        for _ in range(n):
            span = tracer.start_span(name, kind=SpanKind.CLIENT, attributes=start, start_time=time.time_ns())
            token = context.attach(trace.set_span_in_context(span))
            propagate.inject({})
            context.detach(token)
            if span.is_recording():
                span.set_attributes(end)
            span.end()
        _flush()

    def stage_span(n: int) -> None:
        attributes = {"llmspans.stage": "benchmark", "code.function.name": "staged"}
        for start_at in range(0, n, STAGE_BATCH):
            for _ in range(start_at, min(n, start_at + STAGE_BATCH)):
                span = tracer.start_span("benchmark staged", kind=SpanKind.INTERNAL, attributes=attributes)
                token = context.attach(trace.set_span_in_context(span))
                context.detach(token)
                span.end()
            _flush()

    found: dict[str, Callable[[int], None]] = {}
    if setup != "none":
        found["call"] = call_span
        found["stage"] = stage_span
    if setup in ("app", "app-unsampled"):
        histogram = metrics.get_meter("floor").create_histogram("floor.duration", unit="s")
        labels = {key: value for key, value in start.items() if key != "llmspans.stage"}
        span = tracer.start_span(name)
        inside = trace.set_span_in_context(span)

        def one_record(n: int) -> None:
            for _ in range(n):
                histogram.record(0.5, labels, context=inside)

        found["record"] = one_record
    return found


# --- the workloads ---------------------------------------------------------------------------------------


def stage_workloads(
    loop: asyncio.AbstractEventLoop,
) -> tuple[Callable[[int, bool], None], Callable[[int, bool], None]]:
    """(sync, async) run(n, staged): n calls of a trivial function, with @llmspans.stage or bare."""
    import llmspans

    def bare(value: int) -> int:
        return value

    async def abare(value: int) -> int:
        return value

    staged = llmspans.stage("benchmark")(bare)
    astaged = llmspans.stage("benchmark")(abare)

    def run(n: int, with_stage: bool) -> None:
        func = staged if with_stage else bare
        for start in range(0, n, STAGE_BATCH):
            for value in range(start, min(n, start + STAGE_BATCH)):
                func(value)
            _flush()

    async def arun_(n: int, with_stage: bool) -> None:
        func = astaged if with_stage else abare
        for start in range(0, n, STAGE_BATCH):
            for value in range(start, min(n, start + STAGE_BATCH)):
                await func(value)
            _flush()

    return run, lambda n, with_stage: loop.run_until_complete(arun_(n, with_stage))


def measure_setup(args: argparse.Namespace) -> dict[str, float]:
    """Every figure of one set-up, in the meter's unit per call, chunk or stage."""
    peer, switch = set_up(args.one)
    loop = asyncio.new_event_loop()
    factories = inprocess.clients(args.chunks, peer)
    shape = _call_span_shape(inprocess.clients(args.chunks, "llmspans")) if args.one != "otel-v2" else None
    if args.instructions:
        meter: Any = Instructions(args.shim, args.out_file)
        repeats = 1
    else:
        meter = CpuTime()
        repeats = args.repeats
    results: dict[str, float] = {}
    runs = inprocess.workloads(loop)
    clients_of = {"sync": (factories["sync"](False), factories["sync"](True)),
                  "async": (factories["async"](False), factories["async"](True))}  # fmt: skip
    for what in args.what:
        if what in ("calls", "acalls", "streams", "astreams"):
            kind, run = runs[what]
            plain, instrumented = clients_of[kind]
            n = args.calls if "calls" in what else 1
            units = n if "calls" in what else n * (args.chunks + 2)  # items the caller iterates over

            def arm(client: Any, on: bool, run: Any = run, n: int = n) -> Callable[[], None]:
                def go() -> None:
                    switch.on() if on else switch.off()
                    run(client, n)

                return go

            arm(plain, False)()
            arm(instrumented, True)()  # warm
            results[what] = added(meter, arm(plain, False), arm(instrumented, True), units, repeats)
        elif what in ("stage", "astage") and peer == "llmspans":
            sync_stage, async_stage = stage_workloads(loop)
            run_stage = sync_stage if what == "stage" else async_stage
            n = args.stage_calls
            run_stage(STAGE_BATCH, True)
            results[what] = added(
                meter, lambda r=run_stage, n=n: r(n, False), lambda r=run_stage, n=n: r(n, True), n, repeats
            )
            if not args.instructions:  # the caller's thread alone
                caller = CpuTime(time.thread_time)
                results[f"{what}.caller"] = added(
                    caller,
                    lambda r=run_stage, n=n: r(n, False),
                    lambda r=run_stage, n=n: r(n, True),
                    n,
                    repeats,
                )
    if shape is not None:
        for name, run_floor in floors(args.one, shape).items():
            n = args.stage_calls if name == "stage" else args.calls
            run_floor(min(n, 50))
            results[f"floor.{name}"] = added(meter, lambda: None, lambda r=run_floor, n=n: r(n), n, repeats)
            if name == "stage" and not args.instructions:  # the caller's thread alone
                caller = CpuTime(time.thread_time)
                results["floor.stage.caller"] = added(
                    caller, lambda: None, lambda r=run_floor, n=n: r(n), n, repeats
                )
    loop.close()
    return results


# --- the coordinator ---------------------------------------------------------------------------------------


def run_setup(setup: str, args: argparse.Namespace, workdir: Path) -> dict[str, float]:
    command = [sys.executable, __file__, "--one", setup, "--what", *args.what, "--calls", str(args.calls),
               "--chunks", str(args.chunks), "--stage-calls", str(args.stage_calls), "--repeats", str(args.repeats)]  # fmt: skip
    environment = {**os.environ}
    for variable in ("OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        environment.pop(variable, None)
    if args.instructions:
        # The batch processor exports only when flushed (inside each measured block, for both arms alike),
        # not whenever its timer fires in a run slowed fifty times by valgrind.
        environment["OTEL_BSP_SCHEDULE_DELAY"] = "600000"
        out_file = str(workdir / f"{setup}.callgrind")
        command += ["--instructions", "--shim", str(args.shim), "--out-file", out_file]
        command = [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            f"--callgrind-out-file={out_file}",
            *command,
        ]
    done = subprocess.run(command, capture_output=True, text=True, env=environment, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"set-up {setup} failed:\n{done.stderr[-4000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def report(results: dict[str, dict[str, float]], instructions: bool) -> None:
    def shown(value: float | None) -> str:
        if value is None:
            return "-"
        return f"{value / 1000:,.1f}k" if instructions else f"{value * 1e6:.2f}"

    unit = "instructions" if instructions else "µs of CPU"
    print(f"\nAdded per call, chunk or stage ({unit}): total = floor (the OpenTelemetry SDK alone) + ours\n")
    header = f"{'set-up':<14} {'what':<22} {'total':>10} {'floor':>10} {'ours':>10}"
    print(header)
    print("-" * len(header))
    rows = (("calls", "call, sync", "call"), ("acalls", "call, async", "call"), ("streams", "chunk, sync", None),
            ("astreams", "chunk, async", None), ("stage", "stage, sync", "stage"), ("astage", "stage, async", "stage"),
            ("stage.caller", "stage, sync, caller", "stage.caller"),
            ("astage.caller", "stage, async, caller", "stage.caller"))  # fmt: skip
    for setup, figures in results.items():
        for key, label, floor_key in rows:
            if key not in figures:
                continue
            total = figures[key]
            floor = figures.get(f"floor.{floor_key}", 0.0) if floor_key else 0.0
            if setup == "otel-v2":
                print(f"{setup:<14} {label:<22} {shown(total):>10} {'':>10} {'':>10}")
                continue
            print(f"{setup:<14} {label:<22} {shown(total):>10} {shown(floor):>10} {shown(total - floor):>10}")
        if "floor.record" in figures:
            print(
                f"{setup:<14} {'Histogram.record (1)':<22} {'':>10} {shown(figures['floor.record']):>10} {'':>10}"
            )
    print()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--setups", nargs="+", choices=SETUPS, default=[s for s in SETUPS if s != "otel-v2"] + ["otel-v2"]
    )
    parser.add_argument("--what", nargs="+", choices=WHAT, default=list(WHAT))
    parser.add_argument("--instructions", action="store_true", help="count instructions under callgrind")
    parser.add_argument("--calls", type=int, default=None, help="non-streamed calls per repetition")
    parser.add_argument("--chunks", type=int, default=2000, help="content chunks per stream")
    parser.add_argument("--stage-calls", type=int, default=None, help="@stage calls per repetition")
    parser.add_argument("--repeats", type=int, default=11, help="paired repetitions (CPU time only)")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--one", choices=SETUPS, help=argparse.SUPPRESS)
    parser.add_argument("--shim", help=argparse.SUPPRESS)
    parser.add_argument("--out-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.calls is None:
        args.calls = 200
    if args.stage_calls is None:
        args.stage_calls = 2 * STAGE_BATCH if args.instructions else 2048

    if args.one is not None:  # one set-up, in this process
        sink = subprocess.Popen(
            [sys.executable, str(HERE / "overhead.py"), "--serve-otlp"], stdout=subprocess.PIPE, text=True
        )
        assert sink.stdout is not None
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = sink.stdout.readline().strip()
        atexit.register(sink.terminate)
        print(json.dumps(measure_setup(args)), flush=True)
        return 0

    setups = [
        s for s in args.setups if s != "otel-v2" or _importable("opentelemetry.instrumentation.openai_v2")
    ]
    with tempfile.TemporaryDirectory(prefix="llmspans-floor-") as tmp:
        workdir = Path(tmp)
        if args.instructions:
            if shutil.which("valgrind") is None or not os.path.exists("/usr/include/valgrind/callgrind.h"):
                print(
                    "--instructions needs valgrind and its headers (apt-get install valgrind)",
                    file=sys.stderr,
                )
                return 2
            args.shim = _build_shim(workdir)
        results: dict[str, dict[str, float]] = {}
        for setup in setups:
            started = time.monotonic()
            results[setup] = run_setup(setup, args, workdir)
            print(f"  {setup} measured ({time.monotonic() - started:.0f} s)", flush=True)
            for leftover in glob.glob(str(workdir / f"{setup}.callgrind*")):
                os.remove(leftover)
    report(results, args.instructions)
    if args.json:
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "results": results}, indent=1, default=str)
        )
    return 0


def _importable(module: str) -> bool:
    try:
        import importlib.util

        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


if __name__ == "__main__":
    raise SystemExit(main())
