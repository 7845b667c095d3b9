"""How close each bucket comes to what a server with known delays actually did.

Runs streamed and non-streamed calls through the openai SDK (sync and async) against the
simulated server, and prints, per bucket, the error of the client's figure against the
server's own stamps (same clock) and against the delays it was told to use: median, p95
and max in milliseconds. Usage: python benchmarks/timing_accuracy.py [--calls N]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/support/openai_clients.py

import llmspans
from llmspans import _names as names
from llmspans.testing import capture
from llmspans.tools.simulator import Behavior, SimulatedServer
from tests.support.openai_clients import read_through

FIRST, GAP, CHUNKS, RETRY_AFTER = 0.08, 0.02, 6, 0.04
MESSAGES = [{"role": "user", "content": "hi"}]


def quantiles(errors: list[float]) -> str:
    ordered = sorted(abs(e) * 1000 for e in errors)
    p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
    return f"median {statistics.median(ordered):6.3f}  p95 {p95:6.3f}  max {ordered[-1]:6.3f}"


def bucket(span: object, name: str) -> float:
    return float(span.attributes[names.BUCKET_PREFIX + name])  # type: ignore[attr-defined]


def measure(calls: int, use_async: bool) -> dict[str, list[float]]:
    errors: dict[str, list[float]] = {}
    add = lambda key, value: errors.setdefault(key, []).append(value)  # noqa: E731
    with (
        SimulatedServer(Behavior(first_chunk_delay=FIRST, chunk_gap=GAP, chunks=CHUNKS)) as server,
        capture() as cap,
    ):
        if use_async:
            client: object = llmspans.instrument(openai.AsyncOpenAI(base_url=server.base_url, api_key="k"))
        else:
            client = llmspans.instrument(openai.OpenAI(base_url=server.base_url, api_key="k"))

        async def one(stream: bool, retries: int) -> None:
            server.enqueue(*[Behavior(status=429, retry_after_ms=RETRY_AFTER * 1000)] * retries)
            create = client.chat.completions.create  # type: ignore[attr-defined]
            await read_through(create(model="m", messages=MESSAGES, stream=stream), stream, use_async)

        async def run() -> None:
            await one(False, 0)  # warm-up
            for index in range(calls):
                cap.clear()
                server.clear()
                retries = 2 if index % 4 == 3 else 0
                await one(True, retries)
                server.wait_idle()
                (span,) = [s for s in cap.spans if s.name == "chat m"]
                served = server.requests
                final = served[-1]
                sent = final.chunk_sent_ns
                add(
                    "first_token vs server", bucket(span, "first_token") - (sent[0] - final.arrived_ns) * 1e-9
                )
                add("first_token vs told", bucket(span, "first_token") - FIRST)
                add("stream vs server", bucket(span, "stream") - (sent[-1] - sent[0]) * 1e-9)
                add("stream vs told", bucket(span, "stream") - GAP * (CHUNKS - 1))
                add("itl.p50 vs told", span.attributes[names.ITL_P50] - GAP)
                add("connect (reused: 0)", bucket(span, "connect"))
                if retries:
                    add(
                        "retry vs server",
                        bucket(span, "retry") - (final.arrived_ns - served[0].arrived_ns) * 1e-9,
                    )
                    add("retry vs told", bucket(span, "retry") - RETRY_AFTER * retries)
                total = sum(bucket(span, b) for b in names.BUCKETS)
                add("sum of buckets vs duration", total - (span.end_time - span.start_time) * 1e-9)

        asyncio.run(run())
    return errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=40)
    args = parser.parse_args()
    for use_async in (False, True):
        print(
            f"\nopenai {openai.__version__} {'async' if use_async else 'sync'}: |error| in ms over {args.calls} calls"
        )
        for key, values in measure(args.calls, use_async).items():
            print(f"  {key:28s} {quantiles(values)}  (n={len(values)})")


if __name__ == "__main__":
    main()
