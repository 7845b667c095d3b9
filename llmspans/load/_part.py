"""A part of a level sent from a process of its own: a worker process (`_worker.py`) or a Ray generator
(`_ray_actor.py`).

Both set up as the command does (`configure()`, the instrumented client on its tracer provider, warmed
up), send their part on their own `Generator` as one event loop sends a level on the runner's process, and
hand each request's record back once it will not change any more. What carries the part in and the records
back (pipes, Ray's actor calls) is theirs.
"""

from __future__ import annotations

import asyncio
import gc
import time

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider

import llmspans
from llmspans.load._generator import Generator, LoadError, on_schedule, until_done
from llmspans.load._host import LoopLag
from llmspans.load._model import SHAPE_SPEED
from llmspans.load._replay_send import send_replay
from llmspans.load._requests import RequestRecord
from llmspans.load._workers import Part, Setup
from llmspans.vllm import ServerMetrics


def set_up(
    setup: Setup, *, sender: str, to_file: bool, limiter: llmspans.Limiter | None = None
) -> tuple[Generator, ServerMetrics | None]:
    """`configure()` as the command calls it, and the generator on its tracer provider (not started: see
    `warm_up`). `sender` names this process in a LoadError ("worker", "generator"); `to_file`: its spans
    must go to the embedded default's file."""
    configuration = llmspans.configure(service_name=setup.service_name)
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        raise LoadError("the global tracer provider is not the OpenTelemetry SDK's")
    if to_file and configuration.mode != "file":
        raise LoadError(f"configure() sends this {sender}'s spans over {configuration.mode}, not to a file")
    server_metrics = None
    if setup.vllm_interval is not None:
        server_metrics = ServerMetrics(setup.base_url, interval=setup.vllm_interval)
    generator = Generator(
        setup.workload, base_url=setup.base_url, tracer_provider=provider, run_id=setup.run_id,
        api_key=setup.api_key, provider=setup.provider, limiter=limiter, server_metrics=server_metrics,
        max_retries=setup.max_retries, timeout=setup.timeout, client=setup.client,
    )  # fmt: skip
    return generator, server_metrics


async def warm_up(generator: Generator) -> None:
    """The generator's warm-up request (`Generator.start`), then what start-up made frozen: it is never
    garbage, so no collection walks it again."""
    await generator.start()
    gc.collect()
    gc.freeze()


async def send_part(
    generator: Generator, part: Part, records: list[RequestRecord], stop: asyncio.Event
) -> list[int]:
    """The part (its times in this process's clock) sent on `generator` until it is done, `stop` is set or
    its deadline passes; how late the event loop woke meanwhile (`LoopLag`'s samples)."""
    lag = LoopLag()
    lag.start()
    try:
        with on_schedule():
            wait = (part.start_ns - time.perf_counter_ns()) / 1e9
            if wait > 0:
                await asyncio.sleep(wait)
            until = _monotonic(part.until_ns)
            if part.level.shape == SHAPE_SPEED:
                work = send_replay(generator, part.level, part.schedule, part.follows, records, stop, until)
            elif part.schedule:
                work = generator.open(part.level, part.schedule, records, stop, until)
            else:
                work = generator.closed(part.level, part.users, part.indices, records, stop, until)
            await until_done(work, stop, _monotonic(part.deadline_ns))
    finally:
        samples = await lag.stop()
    return samples


async def shut_down(generator: Generator | None, server_metrics: ServerMetrics | None) -> None:
    """The client closed, and every span and metric exported (into the spans file, or over OTLP) before
    the process ends."""
    if generator is not None:
        await generator.close()
    if server_metrics is not None:
        server_metrics.close()
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        provider.shutdown()
    meter_provider = metrics.get_meter_provider()
    if isinstance(meter_provider, MeterProvider):
        meter_provider.shutdown()


class Ended:
    """A part's records as they end, each handed back once: `take` gives those that will not change any more
    (done, their call span read) and were not given before; `rest`, at the part's end, all not given."""

    def __init__(self, records: list[RequestRecord]) -> None:
        self.records = records
        self._seen = 0
        self._waiting: list[RequestRecord] = []

    def take(self) -> list[RequestRecord]:
        self._waiting.extend(self.records[self._seen :])
        self._seen = len(self.records)
        final = [record for record in self._waiting if record.done_ns and record.recorded]
        self._waiting = [record for record in self._waiting if not (record.done_ns and record.recorded)]
        return final

    def rest(self) -> list[RequestRecord]:
        final = self.take()
        return final + self._waiting


def _monotonic(perf_ns: int) -> float:
    return time.monotonic() + (perf_ns - time.perf_counter_ns()) / 1e9
