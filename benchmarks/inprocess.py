"""In-process A/B of llmspans' added client CPU, and where it goes (issue 8).

`overhead.py` measures over real loopback HTTP, which is what users run, but its baseline
moves by ±15 % between blocks on a shared machine: it resolves hundreds of µs per call, not
a µs per chunk. This harness removes the network: a plain and an llmspans-instrumented
openai 3.x client talk to the same in-memory httpx2 transport (canned JSON and SSE bodies,
iterated and closed as httpcore does), in one process, alternating A B B A, and it prints
the median of the paired differences.

`--ablate` switches parts of llmspans' output off in the instrumented client, one run per
setting, to show what each part costs:

- `metrics`: every histogram record and counter add is a no-op;
- `export`: spans are still made but the exporter drops them unencoded;
- `propagation`: no `traceparent` header injected;
- `gc`: the garbage collector is off in both clients.

`--hot-path` measures the per-chunk path alone: pre-parsed chunks through the stream proxy,
the chat reader and the call record, with a stamp per read as the transport makes it,
against the same chunks iterated bare.

    python benchmarks/inprocess.py --mode otlp
    python benchmarks/inprocess.py --mode otlp --what calls --ablate "" metrics export propagation
    python benchmarks/inprocess.py --hot-path
    python benchmarks/inprocess.py --mode otlp --providers app   # the app's own providers, instrument()
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import timeit
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

from overhead import _flush  # the same flush inside the measured window as the full benchmark

HERE = Path(__file__).resolve().parent
MESSAGES = [{"role": "user", "content": "hi"}]
MODEL = "gpt-4o-mini"


def bodies(chunks: int) -> tuple[bytes, list[bytes]]:
    """A non-streamed answer (16-ish tokens, usage) and the SSE events of a stream of `chunks` chunks."""
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": MODEL}
    message = {"role": "assistant", "content": "Hello, this is a simulated reply.", "refusal": None}
    full = {
        **base,
        "object": "chat.completion",
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13},
    }

    def event(delta: dict[str, Any], finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return b"data: " + json.dumps({**base, "choices": [choice]}).encode() + b"\n\n"

    events = [event({"role": "assistant"})]
    events += [event({"content": " tok"}) for _ in range(chunks)]
    events += [event({}, "stop"), b"data: [DONE]\n\n"]
    return json.dumps(full).encode(), events


def clients(chunks: int, peer: str = "llmspans") -> dict[str, Callable[[bool], Any]]:
    """Factories of sync and async openai clients on the in-memory transport (instrumented or not).

    With `peer="otel-v2"` both factories give plain clients: that instrumentation patches the SDK's
    classes, and `paired` switches it on and off around the instrumented arm.
    """
    import httpx2
    import openai

    import llmspans

    full, events = bodies(chunks)

    class _AsyncBody:
        def __init__(self, parts: list[bytes]) -> None:
            self._parts = parts

        async def __aiter__(self) -> AsyncIterator[bytes]:
            for part in self._parts:
                yield part

    def respond(request: Any, body_of: Callable[[list[bytes]], Any]) -> Any:
        streamed = json.loads(request.content).get("stream")
        kind = "text/event-stream" if streamed else "application/json"
        return httpx2.Response(
            200, headers={"content-type": kind}, content=body_of(events if streamed else [full])
        )

    class SyncTransport(httpx2.BaseTransport):  # type: ignore[misc]
        def handle_request(self, request: Any) -> Any:
            return respond(request, iter)

    class AsyncTransport(httpx2.AsyncBaseTransport):  # type: ignore[misc]
        async def handle_async_request(self, request: Any) -> Any:
            return respond(request, _AsyncBody)

    def sync_client(instrumented: bool) -> Any:
        http = openai.DefaultHttpxClient(transport=SyncTransport())
        client = openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="k", max_retries=0, http_client=http)
        return llmspans.instrument(client) if instrumented and peer == "llmspans" else client

    def async_client(instrumented: bool) -> Any:
        http = openai.DefaultAsyncHttpxClient(transport=AsyncTransport())
        client = openai.AsyncOpenAI(
            base_url="http://127.0.0.1:9/v1", api_key="k", max_retries=0, http_client=http
        )
        return llmspans.instrument(client) if instrumented and peer == "llmspans" else client

    return {"sync": sync_client, "async": async_client}


def workloads(loop: asyncio.AbstractEventLoop) -> dict[str, tuple[str, Callable[[Any, int], float]]]:
    """name -> (client kind, run(client, n) -> CPU seconds per call or per chunk, export flushed)."""

    def calls(client: Any, n: int) -> float:
        started = time.process_time()
        for _ in range(n):
            client.chat.completions.create(model=MODEL, messages=MESSAGES)
        _flush()
        return (time.process_time() - started) / n

    def streams(client: Any, n: int) -> float:
        started, items = time.process_time(), 0
        for _ in range(n):
            for _chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True):
                items += 1
        _flush()
        return (time.process_time() - started) / items

    async def acalls_(client: Any, n: int) -> float:
        started = time.process_time()
        for _ in range(n):
            await client.chat.completions.create(model=MODEL, messages=MESSAGES)
        _flush()
        return (time.process_time() - started) / n

    async def astreams_(client: Any, n: int) -> float:
        started, items = time.process_time(), 0
        for _ in range(n):
            async for _chunk in await client.chat.completions.create(
                model=MODEL, messages=MESSAGES, stream=True
            ):
                items += 1
        _flush()
        return (time.process_time() - started) / items

    return {
        "calls": ("sync", calls),
        "streams": ("sync", streams),
        "acalls": ("async", lambda client, n: loop.run_until_complete(acalls_(client, n))),
        "astreams": ("async", lambda client, n: loop.run_until_complete(astreams_(client, n))),
    }


def ablate(parts: list[str]) -> None:
    """Switch parts of llmspans' output off (after configure, before any client is made)."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace.export import SpanExportResult

    import llmspans._telemetry as telemetry
    import llmspans._transport as transport

    if "gc" in parts:
        gc.disable()
    if "metrics" in parts:

        class _NoRecorder:
            def sample(self, *args: Any) -> None:
                return None

            def add(self, *args: Any) -> None:
                pass

            def add_distribution(self, *args: Any) -> None:
                pass

            def chunk_recorder(self, *args: Any) -> None:
                return None

        telemetry._global = (telemetry.tracer(), _NoRecorder())  # type: ignore[assignment]
    if "export" in parts:
        for processor in trace.get_tracer_provider()._active_span_processor._span_processors:  # type: ignore[attr-defined]
            processor._batch_processor._exporter.export = lambda spans: SpanExportResult.SUCCESS
    if "propagation" in parts:

        class _NoPropagation:
            def inject(self, *args: Any, **kwargs: Any) -> None:
                pass

        transport.propagate = _NoPropagation()  # type: ignore[assignment]


class _Switch:
    """Turns a class-patching instrumentation (otel-v2) on for the instrumented arm, off for the plain one."""

    def __init__(self, instrumentor: Any = None) -> None:
        self._instrumentor = instrumentor

    def on(self) -> None:
        if self._instrumentor is not None and not self._instrumentor.is_instrumented_by_opentelemetry:
            self._instrumentor.instrument()

    def off(self) -> None:
        if self._instrumentor is not None and self._instrumentor.is_instrumented_by_opentelemetry:
            self._instrumentor.uninstrument()


def paired(
    run: Callable[[Any, int], float], plain: Any, instrumented: Any, n: int, repeats: int,
    switch: _Switch | None = None,
) -> list[float]:  # fmt: skip
    """Added seconds per unit, one figure per repetition, the order alternating (A B, B A, ...)."""
    switch = switch or _Switch()

    def arm(client: Any, count: int, on: bool) -> float:
        switch.on() if on else switch.off()
        return run(client, count)

    arm(plain, max(1, n // 10), False)
    arm(instrumented, max(1, n // 10), True)
    added = []
    for repeat in range(repeats):
        if repeat % 2:
            with_instrumentation = arm(instrumented, n, True)
            without = arm(plain, n, False)
        else:
            without = arm(plain, n, False)
            with_instrumentation = arm(instrumented, n, True)
        added.append(with_instrumentation - without)
    return added


def _peer_providers(mode: str, metric_interval_ms: float | None = None) -> None:
    """What a user of another instrumentation (or of llmspans without `configure()`) sets up: SDK
    providers, batch spans, periodic metrics, with the sampler OTEL_TRACES_SAMPLER names."""
    from opentelemetry import metrics, trace
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    if mode == "file":
        from opentelemetry.exporter.otlp.json.file import FileMetricExporter, FileSpanExporter

        stream = open(os.path.join(os.environ.get("TMPDIR", "/tmp"), "inprocess-peer.jsonl"), "a")  # noqa: SIM115
        span_exporter: Any = FileSpanExporter(stream=stream)
        metric_exporter: Any = FileMetricExporter(stream=stream)
    else:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        span_exporter, metric_exporter = OTLPSpanExporter(), OTLPMetricExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(BatchSpanProcessor(span_exporter))
    trace.set_tracer_provider(tracer_provider)
    reader = PeriodicExportingMetricReader(metric_exporter, export_interval_millis=metric_interval_ms)
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))


def hot_path(chunks: int) -> None:
    """Per chunk, the instrumented stream's own work on pre-parsed chunks, against iterating them bare."""
    from openai.types.chat import ChatCompletionChunk

    from llmspans._adapters import openai_sdk as _openai
    from llmspans._call import Attempt, CallRecord
    from llmspans._stream import SyncStreamProxy

    payload = {
        "id": "c1", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
        "choices": [{"index": 0, "delta": {"content": " tok"}, "logprobs": None, "finish_reason": None}],
    }  # fmt: skip
    items = [ChatCompletionChunk.model_validate(payload) for _ in range(chunks)]

    def reads(attempt: Attempt | None) -> Iterator[Any]:
        clock = time.perf_counter_ns
        for item in items:
            if attempt is not None:
                attempt.bytes_at_ns = clock()  # what the transport does per network read
            yield item

    try:  # the reader the adapter picks for a call that captures no content
        chat_reader = _openai._item_reader("/chat/completions", False)
    except TypeError:  # an llmspans before issue 22 had one reader for every chat call
        chat_reader = _openai._item_reader("/chat/completions")

    def bare() -> None:
        for _ in reads(None):
            pass

    def instrumented() -> None:
        record = CallRecord(operation="chat", model=MODEL, provider="openai", stream=True)
        attempt = record.attempt(time.perf_counter_ns())  # the one the transport would make
        call = _openai._Reading(record, "/chat/completions", False, False)
        reader = functools.partial(chat_reader, call)  # what the adapter picks for a call like it
        for _ in SyncStreamProxy(reads(attempt), record, reader, lambda outcome, error, at_ns: None):
            pass
        record.finished = True  # not ended: the call's fixed cost is measured by the A/B

    def best(function: Callable[[], None]) -> float:
        return min(timeit.repeat(function, number=10, repeat=30)) / 10 / chunks

    from opentelemetry.sdk.trace import TracerProvider

    from llmspans import _telemetry
    from llmspans._aggregation import Aggregation

    # A sampled call whose metrics llmspans aggregates, as configure() sets it up: the most a chunk
    # costs (the inter-token sketch of a span that records).
    previous = _telemetry._override
    _telemetry._override = (TracerProvider().get_tracer("hot-path"), Aggregation())  # type: ignore[assignment]
    try:
        added = best(instrumented) - best(bare)
    finally:
        _telemetry._override = previous
    print(f"hot path: {added * 1e9:.0f} ns added per chunk "
          f"(stamp per read, proxy, chat reader, call record of a sampled call; best of 30)")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("none", "file", "otlp"), default="otlp",
                        help="no provider, the embedded default file, or OTLP/HTTP to a local sink")  # fmt: skip
    parser.add_argument("--what", nargs="+", default=["calls", "streams", "acalls", "astreams"],
                        choices=("calls", "streams", "acalls", "astreams"))  # fmt: skip
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--calls", type=int, default=200, help="non-streamed calls per repetition")
    parser.add_argument("--streams", type=int, default=1, help="streams per repetition")
    parser.add_argument("--chunks", type=int, default=2000, help="content chunks per stream")
    parser.add_argument("--ablate", nargs="*", default=[""],
                        help="comma-separated parts to switch off, one run per setting ('' for none)")  # fmt: skip
    parser.add_argument("--hot-path", action="store_true", help="only the per-chunk hot path")
    parser.add_argument("--peer", choices=("llmspans", "otel-v2"), default="llmspans",
                        help="which instrumentation the instrumented arm runs")  # fmt: skip
    parser.add_argument("--providers", choices=("configure", "app"), default="configure",
                        help="configure() sets up export, or the app builds its own TracerProvider and "
                        "MeterProvider (batch spans, periodic metrics) and calls instrument()")  # fmt: skip
    parser.add_argument("--sampler", choices=("always_on", "always_off", "ratio"), default="always_on",
                        help="the tracer provider's sampler (ratio: parentbased_traceidratio at 0.01)")  # fmt: skip
    parser.add_argument("--one", help=argparse.SUPPRESS)  # one ablation setting, in a fresh process
    args = parser.parse_args(argv)

    if args.hot_path:
        hot_path(args.chunks)
        return 0
    if (
        args.one is None
    ):  # each setting in a process of its own: configure() and ablation are once per process
        for setting in args.ablate:
            command = [sys.executable, __file__, "--one", setting, "--mode", args.mode, "--what", *args.what,
                       "--repeats", str(args.repeats), "--calls", str(args.calls),
                       "--streams", str(args.streams), "--chunks", str(args.chunks), "--peer", args.peer,
                       "--sampler", args.sampler, "--providers", args.providers]  # fmt: skip
            subprocess.run(command, check=True)
        return 0

    if args.mode == "otlp":
        sink = subprocess.Popen(
            [sys.executable, str(HERE / "overhead.py"), "--serve-otlp"], stdout=subprocess.PIPE, text=True
        )
        assert sink.stdout is not None
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = sink.stdout.readline().strip()
        atexit.register(sink.terminate)  # before configure(): runs after the providers' last export
    if args.sampler == "always_off":
        os.environ["OTEL_TRACES_SAMPLER"] = "always_off"
    elif args.sampler == "ratio":
        os.environ["OTEL_TRACES_SAMPLER"] = "parentbased_traceidratio"
        os.environ["OTEL_TRACES_SAMPLER_ARG"] = "0.01"
    import llmspans

    switch = _Switch()
    if args.peer == "otel-v2":
        from opentelemetry.instrumentation.openai_v2 import OpenAIInstrumentor

        if args.mode != "none":
            _peer_providers(args.mode)
        switch = _Switch(OpenAIInstrumentor())
    elif args.providers == "app" and args.mode != "none":
        _peer_providers(args.mode)
    elif args.mode == "file":
        llmspans.configure(traces_file=os.path.join(os.environ.get("TMPDIR", "/tmp"), "inprocess.jsonl"))
    elif args.mode == "otlp":
        llmspans.configure()
    ablate([part for part in args.one.split(",") if part])
    loop = asyncio.new_event_loop()
    factories = clients(args.chunks, args.peer)
    for name in args.what:
        kind, run = workloads(loop)[name]
        n = args.calls if "calls" in name else args.streams
        added = paired(run, factories[kind](False), factories[kind](True), n, args.repeats, switch)
        low, _, high = statistics.quantiles(added, n=4)
        unit = "call" if "calls" in name else "chunk"
        who = args.peer if args.providers == "configure" else f"{args.peer}+app"
        print(f"{who:8} {args.mode:5} {args.sampler:10} off={args.one or '-':12} {name:9} added "
              f"{statistics.median(added) * 1e6:8.2f} µs/{unit}  IQR {low * 1e6:.2f}..{high * 1e6:.2f}",
              flush=True)  # fmt: skip
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
