"""`python -m llmspans.load._worker`: one worker process of `llmspans load` (the pool is `_workers.py`).

It reads its set-up and then its parts of levels from stdin, and answers on stdout, in `_workers`' frames;
its own fd 1 points at stderr meanwhile, so nothing a library prints can break a frame. It calls
`configure()` as the command does (with its own traces file when the spans go to the embedded default's
file), drives its parts on its own `Generator`, and at the end of its pipe stops what it was doing, flushes
its spans and exits. Ctrl-C is the runner's to handle: the worker runs in a session of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import sys
import time

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider

import llmspans
from llmspans import _names as names
from llmspans.load._generator import Generator, LoadError, on_schedule, until_done
from llmspans.load._host import LoopLag
from llmspans.load._model import SHAPE_SPEED
from llmspans.load._replay_send import send_replay
from llmspans.load._requests import RequestRecord
from llmspans.load._workers import (
    SHIP_EVERY_S,
    Failed,
    Part,
    PartDone,
    Ready,
    Records,
    Setup,
    StopLevel,
    frame,
    read_frame,
)
from llmspans.vllm import ServerMetrics


class _Worker:
    def __init__(self, setup: Setup, writer: asyncio.StreamWriter) -> None:
        self.setup = setup
        self.writer = writer
        self.generator: Generator | None = None
        self.server_metrics: ServerMetrics | None = None

    def send(self, message: object) -> None:
        if not self.writer.is_closing():
            self.writer.write(frame(message))

    async def start(self) -> None:
        setup = self.setup
        if setup.traces_file is not None:
            os.environ[names.ENV_TRACES_FILE] = setup.traces_file  # configure()'s own rules, another file
        configuration = llmspans.configure(service_name=setup.service_name)
        provider = trace.get_tracer_provider()
        if not isinstance(provider, TracerProvider):
            raise LoadError("the global tracer provider is not the OpenTelemetry SDK's")
        if setup.traces_file is not None and configuration.mode != "file":
            raise LoadError(f"configure() sends this worker's spans over {configuration.mode}, not to a file")
        if setup.vllm_interval is not None:
            self.server_metrics = ServerMetrics(setup.base_url, interval=setup.vllm_interval)
        self.generator = Generator(
            setup.workload, base_url=setup.base_url, tracer_provider=provider, run_id=setup.run_id,
            api_key=setup.api_key, provider=setup.provider, server_metrics=self.server_metrics,
            max_retries=setup.max_retries, timeout=setup.timeout, client=setup.client,
        )  # fmt: skip
        await self.generator.start()
        gc.collect()
        gc.freeze()  # what start-up made is never garbage: no collection walks it again

    async def part(self, part: Part, stop: asyncio.Event) -> None:
        """Its part of a level; a failure of its own is sent as one line (the runner names the worker)."""
        try:
            await self._part(part, stop)
        except Exception as error:
            self.send(Failed(f"{type(error).__name__}: {error}"))

    async def _part(self, part: Part, stop: asyncio.Event) -> None:
        assert self.generator is not None
        records: list[RequestRecord] = []
        cpu = time.process_time()
        seen, waiting = 0, []

        def ended() -> list[RequestRecord]:
            """The records that will not change any more (done, their call span read), not sent before."""
            nonlocal seen, waiting
            waiting.extend(records[seen:])
            seen = len(records)
            final = [record for record in waiting if record.done_ns and record.recorded]
            waiting = [record for record in waiting if not (record.done_ns and record.recorded)]
            return final

        async def ship() -> None:
            while True:
                await asyncio.sleep(SHIP_EVERY_S)
                final = ended()
                if final:
                    self.send(Records(final))

        until = _monotonic(part.until_ns)
        shipping = asyncio.ensure_future(ship())
        lag = LoopLag()
        lag.start()
        try:
            with on_schedule():
                wait = (part.start_ns - time.perf_counter_ns()) / 1e9
                if wait > 0:
                    await asyncio.sleep(wait)
                if part.level.shape == SHAPE_SPEED:
                    work = send_replay(
                        self.generator, part.level, part.schedule, part.follows, records, stop, until
                    )
                elif part.schedule:
                    work = self.generator.open(part.level, part.schedule, records, stop, until)
                else:
                    work = self.generator.closed(part.level, part.users, part.indices, records, stop, until)
                await until_done(work, stop, _monotonic(part.deadline_ns))
        finally:
            shipping.cancel()
            await asyncio.gather(shipping, return_exceptions=True)
            loop_lag = await lag.stop()
        spans = self.generator.level_spans(part.level, records)
        self.send(PartDone(ended() + waiting, spans, time.process_time() - cpu, loop_lag))
        await self.writer.drain()

    async def close(self) -> None:
        if self.generator is not None:
            await self.generator.close()
        if self.server_metrics is not None:
            self.server_metrics.close()
        provider = trace.get_tracer_provider()
        if isinstance(provider, TracerProvider):
            provider.shutdown()  # its spans into its file (or over OTLP) before the process ends
        meter_provider = metrics.get_meter_provider()
        if isinstance(meter_provider, MeterProvider):
            meter_provider.shutdown()


def _monotonic(perf_ns: int) -> float:
    return time.monotonic() + (perf_ns - time.perf_counter_ns()) / 1e9


async def _serve(fd_in: int, fd_out: int) -> int:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd_in, "rb", buffering=0)
    )
    transport, protocol = await loop.connect_write_pipe(
        asyncio.streams.FlowControlMixin, os.fdopen(fd_out, "wb", buffering=0)
    )
    writer = asyncio.StreamWriter(transport, protocol, reader, loop)
    setup = await read_frame(reader)
    if not isinstance(setup, Setup):
        return 2
    worker = _Worker(setup, writer)
    try:
        try:
            await worker.start()
        except LoadError as error:
            worker.send(Failed(str(error)))
            return 1
        except Exception as error:
            worker.send(Failed(f"{type(error).__name__}: {error}"))
            return 1
        worker.send(Ready(os.getpid(), time.perf_counter_ns()))
        stop = asyncio.Event()
        running: asyncio.Task[None] | None = None
        while True:
            message = await read_frame(reader)
            if message is None:  # the runner is done with us, or gone
                stop.set()
                break
            if isinstance(message, Part):
                if running is not None:
                    await running
                stop = asyncio.Event()
                running = asyncio.ensure_future(worker.part(message, stop))
            elif isinstance(message, StopLevel):
                stop.set()
        if running is not None:
            await asyncio.gather(running, return_exceptions=True)
        return 0
    finally:
        await worker.close()
        if not writer.is_closing():
            with contextlib.suppress(ConnectionError):
                await writer.drain()
            writer.close()


def main() -> int:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the runner stops its workers itself
    fd_in, fd_out = os.dup(0), os.dup(1)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return asyncio.run(_serve(fd_in, fd_out))


if __name__ == "__main__":
    raise SystemExit(main())
