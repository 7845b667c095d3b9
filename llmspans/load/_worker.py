"""`python -m llmspans.load._worker`: one worker process of `llmspans load` (the pool is `_workers.py`).

It reads its set-up and then its parts of levels from stdin, and answers on stdout, in `_workers`' frames;
its own fd 1 points at stderr meanwhile, so nothing a library prints can break a frame. It calls
`configure()` as the command does (with its own traces file when the spans go to the embedded default's
file), drives its parts on its own `Generator` as a Ray generator does (`_part.py`), and at the end of its
pipe stops what it was doing, flushes its spans and exits. Ctrl-C is the runner's to handle: the worker
runs in a session of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time

from llmspans import _names as names
from llmspans.load._generator import Generator, LoadError
from llmspans.load._part import Ended, send_part, set_up, shut_down, warm_up
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
        self.generator, self.server_metrics = set_up(
            setup, sender="worker", to_file=setup.traces_file is not None
        )
        await warm_up(self.generator)

    async def part(self, part: Part, stop: asyncio.Event) -> None:
        """Its part of a level; a failure of its own is sent as one line (the runner names the worker)."""
        try:
            await self._part(part, stop)
        except Exception as error:
            self.send(Failed(f"{type(error).__name__}: {error}"))

    async def _part(self, part: Part, stop: asyncio.Event) -> None:
        assert self.generator is not None
        records: list[RequestRecord] = []
        ended = Ended(records)
        cpu = time.process_time()

        async def ship() -> None:
            while True:
                await asyncio.sleep(SHIP_EVERY_S)
                final = ended.take()
                if final:
                    self.send(Records(final))

        shipping = asyncio.ensure_future(ship())
        try:
            loop_lag = await send_part(self.generator, part, records, stop)
        finally:
            shipping.cancel()
            await asyncio.gather(shipping, return_exceptions=True)
        spans = self.generator.level_spans(part.level, records)
        self.send(PartDone(ended.rest(), spans, time.process_time() - cpu, loop_lag))
        await self.writer.drain()

    async def close(self) -> None:
        await shut_down(self.generator, self.server_metrics)


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
