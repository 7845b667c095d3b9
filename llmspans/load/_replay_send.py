"""A replay level on one event loop: each turn's first call when due, each later call after the one it waits for.

The schedule is `ReplayWorkload.schedule`'s: `heads` (each turn's first call, `(index, due)` in
`perf_counter_ns()`, in time order) and `follows` (a later call: the index it waits for and the recorded gap,
divided by the speed). A head is started when due, whatever is in flight, as an open loop starts its
arrivals; a later call is due when the call it waits for is done plus its gap, so the calls of a turn go in
their recorded order with their recorded gaps however fast the server answers. Each record keeps when it was
due (`scheduled_ns`), so the lag behind the schedule is measured as in any open loop. Arguments are built
before a request is due. Nothing is sent after `until` (`time.monotonic()`) or once `stop` is set; a call
whose predecessor was cancelled is not sent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from typing import Any

from llmspans.load._generator import Generator, InFlight
from llmspans.load._model import Level
from llmspans.load._requests import RequestRecord


async def send_replay(
    generator: Generator,
    level: Level,
    heads: Sequence[tuple[int, int]],
    follows: Iterable[tuple[int, int, int]],
    records: list[RequestRecord],
    stop: asyncio.Event,
    until: float,
) -> None:
    """Send one replay level's part: `heads` when due, each of `follows` (`(index, waits for, gap ns)`) after."""
    after: dict[int, list[tuple[int, int]]] = {}
    for index, previous, gap in follows:
        after.setdefault(previous, []).append((index, gap))
    in_flight = InFlight()

    async def sent(record: RequestRecord, arguments: Any) -> None:
        await generator.send(record, arguments)
        if record.cancelled:
            return
        for index, gap in after.get(record.index, ()):
            in_flight.start(later(index, record.done_ns + gap))

    async def later(index: int, due: int) -> None:
        request = await generator.when_due(level, index, due, records, stop, until)
        if request is not None:
            await sent(*request)

    try:
        for index, due in heads:
            request = await generator.when_due(level, index, due, records, stop, until)
            if request is None:
                break
            in_flight.start(sent(*request))
        await in_flight.wait()
    finally:
        await in_flight.cancel()
