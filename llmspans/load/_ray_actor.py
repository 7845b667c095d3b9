"""One generator of `llmspans load --ray`: a Ray actor with its own event loop, client and exporter.

The driver (`_ray.py`) makes this class a Ray actor (`ray.remote`) and hands it parts of levels, as the
runner hands worker processes theirs: it drives them on its own `Generator` as a worker process does
(`_part.py`: the same code that sends a request on one machine, so a request records the same call span
wherever it ran) and streams its requests' raw records back as they end, then its level's spans as the
report reads them and its CPU.
Its times are its own `perf_counter_ns()`: the driver converts a part's times into this clock before
sending it and the records' stamps back, with the offset it measured (`clock`).

Ray is imported only inside `identity()`, so importing this module needs no Ray; it runs inside a Ray
worker process, one per actor, which the driver kills when the run ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import llmspans
from llmspans import _names as names
from llmspans.load._generator import Generator
from llmspans.load._part import Ended, send_part, set_up, shut_down, warm_up
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
        limiter = llmspans.Limiter(setup.limiter_cap, name="load") if setup.limiter_cap else None
        self.generator, self.server_metrics = set_up(
            run, sender="generator", to_file=setup.file_export, limiter=limiter
        )
        who = identity(setup.name)
        self.attribute = who.attribute
        self.generator.stamper.generator = who.attribute
        await warm_up(self.generator)
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
        ended = Ended(records)
        cpu = time.process_time()
        running = asyncio.ensure_future(send_part(self.generator, part, records, stop))
        while not running.done():
            await asyncio.wait({running}, timeout=SHIP_EVERY_S)
            yield Batch(self._stamped(ended.take()), _in_flight(records))
        loop_lag = running.result()  # its own failure is raised here, to the driver
        spans = self.generator.level_spans(part.level, records)
        yield PartDone(self._stamped(ended.rest()), spans, time.process_time() - cpu, loop_lag)

    def _stamped(self, records: list[RequestRecord]) -> list[RequestRecord]:
        """The records named by this generator (`llmspans.load.generator`), for the driver's table."""
        for record in records:
            record.generator = self.attribute
        return records

    async def close(self) -> None:
        """The client closed, and every span and metric exported (into the spans file, or over OTLP)."""
        await shut_down(self.generator, self.server_metrics)
        self.generator = None
        self.server_metrics = None

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


def _in_flight(records: list[RequestRecord]) -> tuple[int, ...]:
    return tuple(record.index for record in records if record.issued_ns and not record.done_ns)
