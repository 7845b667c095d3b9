"""An app whose models are called streamed and not, its metrics served for a real Prometheus to scrape:
`python -m tests.support.throughput_app METRICS_PORT`.

Model `both` is called both ways, model `plain` only without streaming: what the dashboard's output
tokens per second panel must tell apart. A warm-up round comes first so every series exists before the
measured one (Prometheus' `rate()` cannot count what a series held when it was first scraped). Then, on
stdin's cue:

    ready            (printed: warm-up done)
    go               (read: run the measured round)
    done {json}      (printed: the streamed calls' own `llmspans.output_tokens_per_second`, from their spans)
    <end of stdin>   (the app exits)
"""

from __future__ import annotations

import json
import sys

import openai

import llmspans
from llmspans import _names as names
from llmspans.tools.simulator import Behavior, SimulatedServer
from tests.support.prometheus_app import serve_metrics_keep_spans

CALLS_PER_ROUND = 3
MESSAGES = [{"role": "user", "content": "count"}]


def one_round(client: openai.OpenAI, server: SimulatedServer, chunk_gap: float) -> None:
    server.default = Behavior(chunks=12, chunk_gap=chunk_gap, usage="finish")
    for _ in range(CALLS_PER_ROUND):
        for _chunk in client.chat.completions.create(model="both", messages=MESSAGES, stream=True):
            pass
        client.chat.completions.create(model="both", messages=MESSAGES)
        client.chat.completions.create(model="plain", messages=MESSAGES)


def main() -> int:
    spans = serve_metrics_keep_spans(int(sys.argv[1]))
    with SimulatedServer() as server:
        client = llmspans.instrument(openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0))
        one_round(client, server, chunk_gap=0.004)
        print("ready", flush=True)
        if sys.stdin.readline().strip() != "go":
            return 1
        spans.clear()
        one_round(client, server, chunk_gap=0.012)  # a different speed: the warm-up must not count
        speeds = [
            span.attributes[names.OUTPUT_TOKENS_PER_SECOND]
            for span in spans.get_finished_spans()
            if span.attributes and names.OUTPUT_TOKENS_PER_SECOND in span.attributes
        ]
        print("done " + json.dumps(speeds), flush=True)
        sys.stdin.read()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
