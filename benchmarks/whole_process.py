"""What llmspans adds to a whole process on httpx2's own HTTP/1.1 stack: every thread, export included.

`floor.py` counts between two points of one process, on an in-memory transport that hands the openai
SDK whole responses. This harness counts what a user's app pays: the openai SDK sends through
`httpx2.HTTPTransport`, over an httpcore2 connection pool whose network backend answers from memory
(so httpcore's HTTP/1.1 parser, its connection pool and its `trace` hooks run as on a socket; a stream
arrives one SSE event per read, chunked, as from a server that flushes each event), and every set-up
exports to the OTLP-JSON file (`configure(traces_file=...)`, or the official file exporters behind the
app's own providers for otel-v2). Each figure is the difference of two run lengths of whole processes:
a process makes N1 calls, another N2, and (count(N2) - count(N1)) / (N2 - N1) is one call's share of
everything the process did, the batch processor's thread, the export at exit and the collector included;
the plain client's difference, in the same run, is taken off.

    none        the openai SDK alone, no provider
    kept        `configure(traces_file=...)`: every call exported
    unsampled   the same with OTEL_TRACES_SAMPLER=always_off
    tail        `configure(traces_file=..., tail_sampling=TailSampling(ratio=0.01))`: almost all dropped
    tail-sdk    the same with `TailSampling(ratio=0.01, defer=False)`: held as SDK spans (where supported)
    otel-v2     the app's providers (batch spans and periodic metrics to the same file exporters) and
                opentelemetry-instrumentation-openai-v2

Work per process: `calls` (non-streamed), `streams` (a stream of `--long` and of `--short` chunks; a
chunk is the difference over the chunks between them), `stage` (`@llmspans.stage` on a trivial function).

    python benchmarks/whole_process.py --instructions      # callgrind, every process (about 15 minutes)
    python benchmarks/whole_process.py                     # CPU time of each whole process (rusage)
    python benchmarks/whole_process.py --instructions --setups none kept --what calls
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SETUPS = ("none", "kept", "unsampled", "tail", "tail-sdk", "otel-v2")
WHAT = ("calls", "streams", "stage")
MODEL = "gpt-4o-mini"
MESSAGES = [{"role": "user", "content": "hi"}]
HOST = "llm.invalid"  # never resolved: the network backend answers from memory


# --- the server, in memory ------------------------------------------------------------------------------


def _bodies(chunks: int) -> tuple[bytes, list[bytes]]:
    """A non-streamed answer and a stream's SSE events (a role chunk, `chunks` content chunks, the finish
    chunk with usage, `[DONE]`), as the simulator sends them."""
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": MODEL}
    message = {"role": "assistant", "content": "Hello, this is a simulated reply.", "refusal": None}
    full = {
        **base, "object": "chat.completion",
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13},
    }  # fmt: skip

    def event(delta: dict[str, Any], finish: str | None = None, usage: Any = None) -> bytes:
        payload: dict[str, Any] = {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                        "finish_reason": finish}]}  # fmt: skip
        if usage is not None:
            payload["usage"] = usage
        return b"data: " + json.dumps(payload).encode() + b"\n\n"

    events = [event({"role": "assistant", "content": ""})]
    events += [event({"content": " tok"}) for _ in range(chunks)]
    events += [
        event({}, "stop", {"prompt_tokens": 5, "completion_tokens": chunks, "total_tokens": chunks + 5}),
        b"data: [DONE]\n\n",
    ]
    return json.dumps(full).encode(), events


def _responses(chunks: int) -> tuple[list[bytes], list[bytes]]:
    """The wire bytes of one answer, as the reads that deliver them: (non-streamed, streamed)."""
    full, events = _bodies(chunks)
    whole = [
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
        + str(len(full)).encode() + b"\r\n\r\n" + full
    ]  # fmt: skip
    streamed = [b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"]
    streamed += [b"%x\r\n%s\r\n" % (len(event), event) for event in events]
    streamed.append(b"0\r\n\r\n")
    return whole, streamed


class _Answers:
    """The reads one connection returns: whole requests written to it are answered in order."""

    def __init__(self, chunks: int) -> None:
        self._whole, self._streamed = _responses(chunks)
        self._pending = b""
        self.reads: list[bytes] = []

    def written(self, data: bytes) -> None:
        pending = self._pending + data
        while True:
            head_end = pending.find(b"\r\n\r\n")
            if head_end < 0:
                break
            head = pending[:head_end].lower()
            length = 0
            for line in head.split(b"\r\n"):
                if line.startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            end = head_end + 4 + length
            if len(pending) < end:
                break
            body = pending[head_end + 4 : end]
            pending = pending[end:]
            streamed = b'"stream":true' in body or b'"stream": true' in body
            self.reads.extend(self._streamed if streamed else self._whole)
        self._pending = pending


def memory_backends(chunks: int) -> tuple[Any, Any]:
    """A sync and an async httpcore2 network backend whose connections answer from memory."""
    import httpcore2

    class Stream(httpcore2.NetworkStream):  # type: ignore[misc]
        def __init__(self) -> None:
            self._answers = _Answers(chunks)

        def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
            reads = self._answers.reads
            return reads.pop(0) if reads else b""

        def write(self, buffer: bytes, timeout: float | None = None) -> None:
            self._answers.written(buffer)

        def close(self) -> None:
            pass

        def get_extra_info(self, info: str) -> Any:
            return None

    class Backend(httpcore2.NetworkBackend):  # type: ignore[misc]
        def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: Any = None,
                        socket_options: Any = None) -> Any:  # fmt: skip
            return Stream()

    class AsyncStream(httpcore2.AsyncNetworkStream):  # type: ignore[misc]
        def __init__(self) -> None:
            self._answers = _Answers(chunks)

        async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
            reads = self._answers.reads
            return reads.pop(0) if reads else b""

        async def write(self, buffer: bytes, timeout: float | None = None) -> None:
            self._answers.written(buffer)

        async def aclose(self) -> None:
            pass

        def get_extra_info(self, info: str) -> Any:
            return None

    class AsyncBackend(httpcore2.AsyncNetworkBackend):  # type: ignore[misc]
        async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                              local_address: Any = None, socket_options: Any = None) -> Any:  # fmt: skip
            return AsyncStream()

    return Backend(), AsyncBackend()


def client(chunks: int, instrumented: bool) -> Any:
    """An openai client on httpx2.HTTPTransport over an httpcore2 pool on the memory backend."""
    import httpcore2
    import httpx2
    import openai

    backend, _ = memory_backends(chunks)
    transport = httpx2.HTTPTransport()
    transport._pool = httpcore2.ConnectionPool(network_backend=backend)
    http = openai.DefaultHttpxClient(transport=transport)
    made = openai.OpenAI(base_url=f"http://{HOST}:8000/v1", api_key="k", max_retries=0, http_client=http)
    if instrumented:
        import llmspans

        return llmspans.instrument(made)
    return made


# --- one process ------------------------------------------------------------------------------------------


def set_up(setup: str, traces_file: str) -> bool:
    """Providers and instrumentation for one set-up; True where llmspans instruments the client."""
    if setup == "none":
        return False
    if setup == "otel-v2":
        from opentelemetry import metrics, trace
        from opentelemetry.exporter.otlp.json.file import FileMetricExporter, FileSpanExporter
        from opentelemetry.instrumentation.openai_v2 import OpenAIInstrumentor
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        stream = open(traces_file, "a")  # noqa: SIM115 - open for the life of the process, as an app's
        tracer_provider = TracerProvider()
        tracer_provider.add_span_processor(BatchSpanProcessor(FileSpanExporter(stream=stream)))
        trace.set_tracer_provider(tracer_provider)
        reader = PeriodicExportingMetricReader(
            FileMetricExporter(stream=stream), export_interval_millis=3_600_000
        )
        metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
        OpenAIInstrumentor().instrument()
        return False
    import llmspans

    sampling: Any = None
    if setup == "tail":
        sampling = llmspans.TailSampling(ratio=0.01)
    elif setup == "tail-sdk":
        try:
            sampling = llmspans.TailSampling(ratio=0.01, defer=False)  # type: ignore[call-arg]
        except TypeError:  # before deferred spans: every held span is an SDK span
            sampling = llmspans.TailSampling(ratio=0.01)
    llmspans.configure(traces_file=traces_file, metric_interval=3600, tail_sampling=sampling)
    return True


def work(what: str, instrumented: bool, chunks: int) -> Callable[[int], None]:
    """run(n): n calls, n streams of `chunks` chunks, or n stage calls."""
    if what == "stage":
        import llmspans

        def bare(value: int) -> int:
            return value

        staged = llmspans.stage("benchmark")(bare) if instrumented else bare

        def stages(n: int) -> None:
            for value in range(n):
                staged(value)

        return stages
    made = client(chunks, instrumented)
    create = made.chat.completions.create
    if what == "calls":

        def calls(n: int) -> None:
            for _ in range(n):
                create(model=MODEL, messages=MESSAGES)

        return calls

    def streams(n: int) -> None:
        for _ in range(n):
            for _chunk in create(model=MODEL, messages=MESSAGES, stream=True):
                pass

    return streams


def one_process(args: argparse.Namespace) -> None:
    """Set up, warm up, then (under callgrind) start counting and do `--n` units; the exit is counted too."""
    instrumented = set_up(args.one, args.traces_file)
    if args.what == "stage" and args.one in ("none", "otel-v2"):
        instrumented = False
    run = work(args.what, instrumented, args.chunks)
    run(args.warm_up)
    from opentelemetry import trace

    flush = getattr(trace.get_tracer_provider(), "force_flush", None)
    if flush is not None:
        flush()
    gc.collect()
    if args.shim:
        import ctypes

        shim = ctypes.CDLL(args.shim)
        shim.llmspans_start()
        shim.llmspans_zero()
    started = time.process_time()
    run(args.n)
    print(json.dumps({"cpu_in_run": time.process_time() - started}), flush=True)
    # The process ends here: the providers' shutdown (the batch processor's last export, the metrics'
    # export) and the interpreter's own exit are counted, as an app's are.


# --- the coordinator ---------------------------------------------------------------------------------------


def measure(setup: str, what: str, n: int, chunks: int, args: argparse.Namespace, workdir: Path) -> float:
    """Instructions (callgrind) or CPU seconds (rusage) of one whole process doing n units."""
    traces_file = workdir / f"{setup}-{what}-{n}-{chunks}.jsonl"
    command = [sys.executable, __file__, "--one", setup, "--what", what, "--n", str(n), "--chunks", str(chunks),
               "--warm-up", str(args.warm_up), "--traces-file", str(traces_file)]  # fmt: skip
    environment = {**os.environ}
    for variable in list(environment):
        if variable.startswith("OTEL_"):
            del environment[variable]
    if setup == "unsampled":
        environment["OTEL_TRACES_SAMPLER"] = "always_off"
    out_file = workdir / f"{setup}-{what}-{n}-{chunks}.callgrind"
    if args.instructions:
        command += ["--shim", str(args.shim)]
        command = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out_file}",
                   *command]  # fmt: skip
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment
    )
    _, status, usage = os.wait4(process.pid, 0)
    stdout = process.stdout.read() if process.stdout else ""
    stderr = process.stderr.read() if process.stderr else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{setup} {what} n={n} failed:\n{stderr[-4000:]}")
    if not args.instructions:
        return usage.ru_utime + usage.ru_stime
    total = _callgrind_total(out_file)
    if args.keep:
        shutil.copy(out_file, Path(args.keep) / out_file.name)
    for leftover in workdir.glob(f"{out_file.name}*"):
        leftover.unlink()
    del stdout
    return total


def _callgrind_total(out_file: Path) -> float:
    with open(out_file) as dump:
        for line in dump:
            if line.startswith(("summary:", "totals:")):
                return float(line.split()[1])
    raise RuntimeError(f"callgrind wrote no summary in {out_file}")


def figures(args: argparse.Namespace, workdir: Path) -> dict[str, dict[str, float]]:
    """Per set-up and kind of work: the units' difference, per unit, over the two run lengths."""
    plans: dict[str, tuple[tuple[int, int], tuple[int, int], int]] = {
        # what: ((n1, chunks1), (n2, chunks2), units between them)
        "calls": ((args.calls, args.short), (args.calls * 3, args.short), args.calls * 2),
        "streams": ((args.streams, args.short), (args.streams, args.long), args.streams * (args.long - args.short)),
        "stage": ((args.stages, 0), (args.stages * 3, 0), args.stages * 2),
    }  # fmt: skip
    results: dict[str, dict[str, float]] = {}
    for setup in args.setups:
        results[setup] = {}
        for what in args.what:
            if what == "stage" and setup == "otel-v2":
                continue
            (n1, c1), (n2, c2), units = plans[what]
            started = time.monotonic()
            low = measure(setup, what, n1, c1, args, workdir)
            high = measure(setup, what, n2, c2, args, workdir)
            results[setup][what] = (high - low) / units
            print(f"  {setup} {what}: {results[setup][what]:,.1f} per unit ({time.monotonic() - started:.0f} s)",
                  flush=True)  # fmt: skip
    return results


def report(results: dict[str, dict[str, float]], instructions: bool) -> list[str]:
    base = results.get("none", {})
    unit = "thousands of instructions" if instructions else "µs of CPU"

    def shown(value: float | None) -> str:
        if value is None:
            return "-"
        return f"{value / 1000:,.1f}" if instructions else f"{value * 1e6:,.2f}"

    lines = [f"Added per call, chunk or stage over the plain openai client ({unit}), whole processes:", ""]
    lines.append(f"{'set-up':<10} {'call':>10} {'chunk':>10} {'stage':>10}")
    added: dict[str, dict[str, float]] = {}
    for setup, found in results.items():
        if setup == "none":
            continue
        added[setup] = {what: value - base.get(what, 0.0) for what, value in found.items()}
        row = added[setup]
        lines.append(f"{setup:<10} {shown(row.get('calls')):>10} {shown(row.get('streams')):>10} "
                     f"{shown(row.get('stage')):>10}")  # fmt: skip
    lines.append("")

    def ratio(label: str, top: tuple[str, str], bottom: tuple[str, str]) -> None:
        a, b = added.get(top[0], {}).get(top[1]), added.get(bottom[0], {}).get(bottom[1])
        if a is not None and b:
            lines.append(f"{label}: {a / b:.2f}x")

    ratio("kept call / otel-v2 call", ("kept", "calls"), ("otel-v2", "calls"))
    ratio("dropped call / unsampled call", ("tail", "calls"), ("unsampled", "calls"))
    ratio("held-as-SDK call / unsampled call", ("tail-sdk", "calls"), ("unsampled", "calls"))
    ratio("kept chunk / otel-v2 chunk", ("kept", "streams"), ("otel-v2", "streams"))
    ratio("stage in a dropped trace / unsampled stage", ("tail", "stage"), ("unsampled", "stage"))
    return lines


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS))
    parser.add_argument("--what", nargs="+", choices=WHAT, default=list(WHAT))
    parser.add_argument("--instructions", action="store_true", help="count instructions under callgrind")
    parser.add_argument(
        "--calls", type=int, default=100, help="calls in the shorter process (the longer: 3x)"
    )
    parser.add_argument("--streams", type=int, default=10, help="streams per process")
    parser.add_argument("--long", type=int, default=200, help="chunks per stream, longer process")
    parser.add_argument("--short", type=int, default=40, help="chunks per stream, shorter process")
    parser.add_argument("--stages", type=int, default=200, help="stage calls in the shorter process")
    parser.add_argument("--warm-up", type=int, default=120, help="units before counting (tail sampling's "
                        "percentile warms up over 100 roots)")  # fmt: skip
    parser.add_argument("--keep", help="keep the callgrind files in this directory")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--one", choices=SETUPS, help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--chunks", type=int, default=40, help=argparse.SUPPRESS)
    parser.add_argument("--traces-file", help=argparse.SUPPRESS)
    parser.add_argument("--shim", help=argparse.SUPPRESS)
    parser.add_argument("--scale", type=int, default=None, help="multiply the counts (default: 1 under "
                        "callgrind, 10 for CPU time, whose noise needs longer processes)")  # fmt: skip
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.one is None:
        scale = args.scale or (1 if args.instructions else 10)
        args.calls, args.streams, args.stages = args.calls * scale, args.streams * scale, args.stages * scale
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
    if args.one is not None:
        args.what = args.what[0]
        one_process(args)
        return 0
    if args.instructions and (
        shutil.which("valgrind") is None or not os.path.exists("/usr/include/valgrind/callgrind.h")
    ):
        print("--instructions needs valgrind and its headers (apt-get install valgrind)", file=sys.stderr)
        return 2
    sys.path.insert(0, str(HERE))  # floor.py: the callgrind shim, and whether an optional module is there
    from floor import _build_shim, _importable

    if "otel-v2" in args.setups and not _importable("opentelemetry.instrumentation.openai_v2"):
        args.setups = [setup for setup in args.setups if setup != "otel-v2"]
    with tempfile.TemporaryDirectory(prefix="llmspans-whole-") as tmp:
        workdir = Path(tmp)
        if args.instructions:
            args.shim = _build_shim(workdir)
        results = figures(args, workdir)
    lines = report(results, args.instructions)
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                               "results": results}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
