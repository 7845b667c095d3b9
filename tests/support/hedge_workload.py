"""A scripted run of a hedged client with known figures: the report's tests on hedging run it.

Ten streamed calls through clients hedged after `AFTER` (the same client as backup), on a server told what
each copy does, in the order they arrive: calls 0-5 are answered at once (no backup sent); calls 6 and 7
have a primary that sends no first token for `SLOW` and a backup answered at once (the backup wins, the
primary is cut); call 8 has a primary answered after `LATE` and a backup after `SLOW` (the primary wins,
the backup is cut); call 9's client has a limiter of one slot, held by the call itself, so its backup is
never sent though its primary is late. Every answer reports usage: each prompt is `WORDS` words, which is
what the simulator counts as its input tokens.

So: 10 calls, 3 with a backup sent, 2 won by it, 1 skipped; 3 prompts wasted, 3 of 10 (30 % more input).
"""

from __future__ import annotations

from typing import Any

import openai

import llmspans
from llmspans.tools.simulator import Behavior, SimulatedServer

# A call answered at once takes a few ms on loopback; AFTER leaves it 300 ms, so a busy machine's stall does not
# send its backup. The late primary beats its slow backup by AFTER + SLOW - LATE, the fast backups their slow
# primaries by SLOW - AFTER.
AFTER = 0.3
SLOW, LATE = 1.5, 0.6
WORDS = 4
CALLS, FIRED, BACKUP_WON, SKIPPED = 10, 3, 2, 1


def _behavior(first_chunk_delay: float = 0.0) -> Behavior:
    return Behavior(chunks=2, usage="chunk", first_chunk_delay=first_chunk_delay)


def run(server: SimulatedServer) -> None:
    hedged = llmspans.instrument(
        openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0), hedge=llmspans.Hedge(after=AFTER)
    )
    alone = llmspans.instrument(
        openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0),
        hedge=llmspans.Hedge(after=AFTER), limiter=llmspans.Limiter(1, name="alone"),
    )  # fmt: skip
    # A process's first openai call builds the SDK's types (50-150 ms of CPU): paid here, by a client without a
    # hedge and not instrumented, so no call of the plan waits for it.
    server.enqueue(_behavior())
    list(
        openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0).chat.completions.create(
            model="sim-model", messages=[{"role": "user", "content": "warm-up"}], stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    plan: list[tuple[Any, tuple[Behavior, ...]]] = [(hedged, (_behavior(),))] * 6
    plan += [(hedged, (_behavior(SLOW), _behavior()))] * 2
    plan += [(hedged, (_behavior(LATE), _behavior(SLOW))), (alone, (_behavior(LATE),))]
    for client, behaviors in plan:
        server.enqueue(*behaviors)
        stream = client.chat.completions.create(
            model="sim-model", messages=[{"role": "user", "content": "what is a hedge"}], stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        list(stream)
