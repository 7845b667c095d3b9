"""Finalizers hand their work to the worker: the collector firing inside an SDK lock cannot hang the app.

Each scenario runs in a child process under a watchdog: the collector is forced to run while the
OpenTelemetry SDK holds a non-reentrant lock (creating a metric aggregation, and inside the span
exporter), with abandoned streams, unclosed bodies, dropped limiter slots and half-read stage
generators waiting in reference cycles, so only that collection can free them. Before the fix a
finalizer recorded a metric or ended a span right there and waited on the lock forever.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

_CHILD = textwrap.dedent(
    r"""
    import asyncio, faulthandler, gc, sys, threading
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)  # a hang prints every thread's stack

    import httpx, openai
    from opentelemetry.sdk.metrics import Counter, Histogram, MeterProvider
    from opentelemetry.sdk.metrics._internal import _view_instrument_match
    from opentelemetry.sdk.metrics.export import AggregationTemporality, InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    import llmspans
    from llmspans import _deferred, _telemetry
    from llmspans.tools.simulator import Behavior, SimulatedServer

    # Delta temporality: every measurement is aggregated under the view's lock. The collections are of
    # the youngest generation, where the cycles below wait: the one a real allocation sets off most.
    reader = InMemoryMetricReader(
        preferred_temporality={Histogram: AggregationTemporality.DELTA, Counter: AggregationTemporality.DELTA}
    )
    meters = MeterProvider(metric_readers=[reader])
    exporter = InMemorySpanExporter()
    tracers = TracerProvider()
    tracers.add_span_processor(SimpleSpanProcessor(exporter))

    if "metric" in SITES:
        create = _view_instrument_match._ViewInstrumentMatch._get_or_create_aggregation

        def collect_inside_metric_lock(self, *args):
            gc.collect(0)  # as if an allocation here set off the collector, the view's lock held
            return create(self, *args)

        _view_instrument_match._ViewInstrumentMatch._get_or_create_aggregation = collect_inside_metric_lock
    if "span" in SITES:
        export = InMemorySpanExporter.export

        def collect_inside_exporter_lock(self, spans):
            with self._lock:
                gc.collect(0)  # the exporter's lock held, as in any exporter that locks its buffer
            return export(self, spans)

        InMemorySpanExporter.export = collect_inside_exporter_lock

    MESSAGES = [{"role": "user", "content": "hi"}]
    abandoned = 0

    def in_a_cycle(obj):
        cycle = [obj]
        cycle.append(cycle)  # only the collector can free it

    limiter = llmspans.Limiter(64, name="lane")

    @llmspans.stage("rerank")
    def ranked():
        yield 1
        yield 2

    def abandon_sync(client, plain):
        # Everything made here is unreachable once this returns, but for its cycle.
        global abandoned
        stream = client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        next(iter(stream))
        in_a_cycle(stream)
        response = plain.send(plain.build_request("POST", "/v1/chat/completions",
                              json={"model": "m", "messages": MESSAGES, "stream": True}), stream=True)
        next(response.iter_bytes())
        in_a_cycle(response)
        in_a_cycle(limiter.acquire())
        generator = ranked()
        next(generator)
        in_a_cycle(generator)
        abandoned += 2

    def sync_round(client, plain):
        abandon_sync(client, plain)
        client.chat.completions.create(model="m", messages=MESSAGES)  # its records set off the collector

    async def abandon_async(client):
        stream = await client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        await stream.__anext__()
        in_a_cycle(stream)
        in_a_cycle(await limiter.acquire_async())

    async def async_round(client):
        await abandon_async(client)
        await client.chat.completions.create(model="m", messages=MESSAGES)

    gc.disable()  # collections come only from the patched critical sections
    with SimulatedServer(Behavior(chunks=20)) as server, _telemetry.use_providers(tracers, meters):
        client = llmspans.instrument(openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0))
        aclient = llmspans.instrument(openai.AsyncOpenAI(base_url=server.base_url, api_key="k", max_retries=0))
        plain = llmspans.instrument(httpx.Client(base_url=server.url))

        def worker():
            for _ in range(ROUNDS):
                sync_round(client, plain)

        threads = [threading.Thread(target=worker) for _ in range(THREADS)]
        for thread in threads:
            thread.start()

        async def tasks():
            await asyncio.gather(*(async_round(aclient) for _ in range(THREADS * ROUNDS)))

        asyncio.run(tasks())
        for thread in threads:
            thread.join()
        gc.enable()
        gc.collect()
        assert _deferred.settle(), "the deferred work did not run"
        calls = [s for s in exporter.get_finished_spans() if s.attributes.get("llmspans.stage") == "llm"]
        outcomes = [s.attributes.get("llmspans.stream.outcome") for s in calls]
        stages = [s for s in exporter.get_finished_spans() if s.attributes.get("llmspans.stage") == "rerank"]
        print("calls", len(calls), "abandoned", outcomes.count("abandoned"), "stages", len(stages),
              "slots", limiter._holding)
    """
)


def _run(sites: str, threads: int, rounds: int) -> str:
    watchdog = 60
    code = f"SITES = {sites!r}\nTHREADS = {threads}\nROUNDS = {rounds}\nWATCHDOG_S = {watchdog}\n" + _CHILD
    try:
        result = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=watchdog + 30
        )
    except subprocess.TimeoutExpired as expired:  # the watchdog inside did not fire either
        pytest.fail(f"the app hung with the collector inside the SDK's {sites} lock: {expired.stderr!r}")
    assert result.returncode == 0, f"the app hung or failed ({sites}):\n{result.stderr[-6000:]}"
    return result.stdout


@pytest.mark.parametrize("sites", ["metric", "span", "metric,span"])
def test_collector_inside_an_sdk_lock_never_hangs_the_app(sites: str) -> None:
    threads, rounds = 4, 5
    line = _run(sites, threads, rounds).split()
    figures = dict(zip(line[::2], map(int, line[1::2]), strict=True))
    per_round_sync = 2 + 1  # a stream and a plain response abandoned, then one finished call
    expected_calls = threads * rounds * per_round_sync + threads * rounds * 2
    assert figures["calls"] == expected_calls  # every call span ended, the abandoned ones too
    assert figures["abandoned"] == threads * rounds * 2 + threads * rounds
    assert figures["stages"] == threads * rounds  # every half-read generator's span ended
    assert figures["slots"] == 0  # every dropped admission gave its slot back
