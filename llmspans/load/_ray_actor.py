"""One generator of `llmspans load --ray`: a Ray actor with its own event loop, client and exporter.

The driver (`_ray.py`) makes this class a Ray actor (`ray.remote`) and hands it parts of levels, as the
runner hands worker processes theirs: it drives them on its own `Generator` (the same code that sends a
request on one machine, so a request records the same call span wherever it ran) and streams its
requests' raw records back as they end, then its level's spans as the report reads them and its CPU.
Its times are its own `perf_counter_ns()`: the driver converts a part's times into this clock before
sending it and the records' stamps back, with the offset it measured (`clock`).

Ray is imported only inside `identity()`, so importing this module needs no Ray; it runs inside a Ray
worker process, one per actor, which the driver kills when the run ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import socket
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider

import llmspans
from llmspans import _names as names
from llmspans.load._generator import Generator, LoadError, on_schedule, until_done
from llmspans.load._host import LoopLag
from llmspans.load._requests import RequestRecord
from llmspans.load._workers import SHIP_EVERY_S, Part, PartDone, Setup
from llmspans.vllm import ServerMetrics

# The spans file comes back to the driver in pieces of at most this many bytes.
SPANS_PIECE_BYTES = 4 << 20


@dataclass(frozen=True)
class GeneratorSetup:
    """What one generator needs: a worker process's `Setup` (the workload, the target, the run), plus its
    name, the limiter cap (each generator's own), and the driver's `OTEL_*`/`LLMSPANS_*` variables, so
    that its `configure()` sends spans where the driver's does. `file_export`: the spans go to the
    embedded default's file, written on the generator's node and brought back by the driver at the end."""

    setup: Setup
    name: str
    limiter_cap: int | None
    environment: dict[str, str]
    file_export: bool


@dataclass(frozen=True)
class Identity:
    """Who and where a generator is."""

    name: str
    node_id: str
    node_ip: str
    actor_id: str
    pid: int
    hostname: str

    @property
    def node(self) -> str:
        return f"{self.node_ip}:{self.node_id[:8]}"

    @property
    def attribute(self) -> str:
        """Its `llmspans.load.generator` value: `g2@127.0.0.1:3f2a1b9c/5e6f7a8b`."""
        return f"{self.name}@{self.node}/{self.actor_id[:8]}"


@dataclass(frozen=True)
class Batch:
    """Records that ended since the last batch, and the indices still in flight (for the driver's count of
    what was lost should this generator be)."""

    records: list[RequestRecord]
    in_flight: tuple[int, ...]


def identity(name: str) -> Identity:
    import ray  # inside a Ray worker process: Ray is there

    context = ray.get_runtime_context()
    return Identity(
        name=name,
        node_id=context.get_node_id(),
        node_ip=ray.util.get_node_ip_address(),
        actor_id=context.get_actor_id() or "",
        pid=os.getpid(),
        hostname=socket.gethostname(),
    )


class GeneratorActor:
    """The actor's methods, called by the driver in this order: `start`, then per level `clock` (a few
    times) and `part` (with `stop` when the run is stopped), then `close` and `spans`."""

    def __init__(self) -> None:
        self.generator: Generator | None = None
        self.server_metrics: ServerMetrics | None = None
        self.traces_file: Path | None = None
        self.attribute = ""
        self._stop: asyncio.Event | None = None

    async def start(self, setup: GeneratorSetup) -> Identity:
        """`configure()` and the instrumented client, warmed up with one request no span records;
        LoadError (one line) when the target does not answer from this node."""
        os.environ.update(setup.environment)
        os.environ.pop(names.ENV_TRACES_FILE, None)
        run = setup.setup
        if setup.file_export:
            self.traces_file = Path(tempfile.gettempdir()) / f"llmspans-load-{run.run_id}-{setup.name}.jsonl"
            os.environ[names.ENV_TRACES_FILE] = str(self.traces_file)
        configuration = llmspans.configure(service_name=run.service_name)
        provider = trace.get_tracer_provider()
        if not isinstance(provider, TracerProvider):
            raise LoadError("the global tracer provider is not the OpenTelemetry SDK's")
        if setup.file_export and configuration.mode != "file":
            raise LoadError(
                f"configure() sends this generator's spans over {configuration.mode}, not to a file"
            )
        if run.vllm_interval is not None:
            self.server_metrics = ServerMetrics(run.base_url, interval=run.vllm_interval)
        limiter = llmspans.Limiter(setup.limiter_cap, name="load") if setup.limiter_cap else None
        who = identity(setup.name)
        self.attribute = who.attribute
        self.generator = Generator(
            run.workload, base_url=run.base_url, tracer_provider=provider, run_id=run.run_id,
            api_key=run.api_key, provider=run.provider, limiter=limiter, server_metrics=self.server_metrics,
            max_retries=run.max_retries, timeout=run.timeout, client=run.client,
        )  # fmt: skip
        self.generator.stamper.generator = who.attribute
        await self.generator.start()
        gc.collect()
        gc.freeze()  # what start-up made is never garbage: no collection walks it again
        return who

    async def clock(self) -> tuple[int, int]:
        """This process's `perf_counter_ns()` and `time_ns()`, for the driver's offsets."""
        return time.perf_counter_ns(), time.time_ns()

    async def stop(self) -> None:
        """Stop the part in progress: what is in flight is cancelled, and the part ends with what it had."""
        if self._stop is not None:
            self._stop.set()

    async def part(self, part: Part) -> AsyncIterator[Batch | PartDone]:
        """A part of a level (times in this process's clock): a `Batch` every `SHIP_EVERY_S`, then the
        `PartDone`. A streaming Ray generator: the driver reads each item as it is yielded."""
        assert self.generator is not None
        stop = self._stop = asyncio.Event()
        records: list[RequestRecord] = []
        seen, waiting = 0, []

        def ended() -> list[RequestRecord]:
            """The records that will not change any more (done, their call span read), not sent before."""
            nonlocal seen, waiting
            waiting.extend(records[seen:])
            seen = len(records)
            final = [record for record in waiting if record.done_ns and record.recorded]
            waiting = [record for record in waiting if not (record.done_ns and record.recorded)]
            for record in final:
                record.generator = self.attribute
            return final

        def in_flight() -> tuple[int, ...]:
            return tuple(record.index for record in records if record.issued_ns and not record.done_ns)

        cpu = time.process_time()
        running = asyncio.ensure_future(self._run(part, records, stop))
        while not running.done():
            await asyncio.wait({running}, timeout=SHIP_EVERY_S)
            yield Batch(ended(), in_flight())
        loop_lag = running.result()  # its own failure is raised here, to the driver
        spans = self.generator.level_spans(part.level, records)
        rest = ended() + waiting
        for record in rest:
            record.generator = self.attribute
        yield PartDone(rest, spans, time.process_time() - cpu, loop_lag)

    async def _run(self, part: Part, records: list[RequestRecord], stop: asyncio.Event) -> list[int]:
        assert self.generator is not None
        lag = LoopLag()
        lag.start()
        try:
            with on_schedule():
                wait = (part.start_ns - time.perf_counter_ns()) / 1e9
                if wait > 0:
                    await asyncio.sleep(wait)
                until = _monotonic(part.until_ns)
                if part.schedule:
                    work = self.generator.open(part.level, part.schedule, records, stop, until)
                else:
                    work = self.generator.closed(part.level, part.users, part.indices, records, stop, until)
                await until_done(work, stop, _monotonic(part.deadline_ns))
        finally:
            samples = await lag.stop()
        return samples

    async def close(self) -> None:
        """The client closed, and every span and metric exported (into the spans file, or over OTLP)."""
        if self.generator is not None:
            await self.generator.close()
            self.generator = None
        if self.server_metrics is not None:
            self.server_metrics.close()
            self.server_metrics = None
        provider = trace.get_tracer_provider()
        if isinstance(provider, TracerProvider):
            provider.shutdown()
        meter_provider = metrics.get_meter_provider()
        if isinstance(meter_provider, MeterProvider):
            meter_provider.shutdown()

    async def spans(self, offset: int) -> tuple[bytes, bool]:
        """The spans file from `offset`, one piece, and whether that was its end (then it is removed)."""
        if self.traces_file is None:
            return b"", True
        try:
            with open(self.traces_file, "rb") as lines:  # noqa: ASYNC230 - a local file, after the run
                lines.seek(offset)
                piece = lines.read(SPANS_PIECE_BYTES)
        except FileNotFoundError:
            return b"", True
        last = len(piece) < SPANS_PIECE_BYTES
        if last:
            with contextlib.suppress(OSError):
                self.traces_file.unlink()
        return piece, last


def _monotonic(perf_ns: int) -> float:
    return time.monotonic() + (perf_ns - time.perf_counter_ns()) / 1e9
