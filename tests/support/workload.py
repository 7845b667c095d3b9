"""One run that makes the package emit every kind of span, attribute, event and metric it has.

Checks that cross-check names against "what the SDK emits" (the integrations' dashboards and queries,
the telemetry reference in docs/) read it from this run instead of a list kept by hand: a name the run
does not produce cannot be vouched for, so each path that adds attributes is exercised once here.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

import httpx
import openai
from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import llmspans
from llmspans import _names as names
from llmspans import _openinference, _phases
from llmspans.load._requests import CURRENT, LevelStamper, RequestRecord
from llmspans.testing import capture
from llmspans.tools.simulator import Behavior, SimulatedServer
from tests.support.vllm_sim import FAMILIES, EngineConfig, VLLMSimulator


@dataclass(frozen=True)
class Exercised:
    spans: list[ReadableSpan]
    metrics: Any  # an OTLP ExportMetricsServiceRequest: names, units and instrument kinds as exported


class _Failed(Exception):
    pass


def _replayed(index: int) -> dict[str, str]:
    """What `llmspans load --replay` stamps besides: where the recorded call came from, and its ids."""
    return {
        names.LOAD_REPLAY_SOURCE: "recorded.jsonl",
        names.LOAD_REPLAY_TRACE_ID: "0af7651916cd43dd8448eb211c80319c",
        names.LOAD_REPLAY_SPAN_ID: "b7ad6b7169203331",
    }


def exercise() -> Exercised:
    """A turn with every stage kind, retried/laned/failed/captured calls, the levers (prompt caps, cache
    lookups, hedged requests), and a vLLM server sampled."""
    floor, _phases.FLOOR_NS = _phases.FLOOR_NS, 0  # every phase gets its span, however short on loopback
    try:
        return _exercise()
    finally:
        _phases.FLOOR_NS = floor


def _exercise() -> Exercised:
    fast = Behavior(chunks=4, usage="finish", chunk_gap=0.001)
    with SimulatedServer(fast) as server, capture() as captured:
        server.enqueue(Behavior(status=429, retry_after_ms=1), fast)
        client = llmspans.instrument(
            openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=2), phase_spans="always"
        )  # every call's phases, the retried one's back-off included

        @llmspans.retrieval(budget="1us", data_source="docs")  # always over: violations are emitted too
        def search() -> list[str]:
            return ["doc"]

        @llmspans.stage("guardrail", budget=5)
        def check() -> bool:
            return True

        @llmspans.stage("moderation")
        def refuse() -> None:
            raise _Failed

        @llmspans.tool(budget=5)
        def weather(city: str) -> str:
            return "sunny"

        @llmspans.tool(budget="5ms", on_exceed="cancel", fallback="unknown")
        async def slow_lookup() -> str:
            await asyncio.sleep(5)
            return "found"

        with llmspans.turn("chat", budget=30):
            search()
            _openinference.configure(True)  # what configure(openinference=True) adds, on one stage
            try:
                check()
            finally:
                _openinference.reset()
            with contextlib.suppress(_Failed):
                refuse()
            stream = client.chat.completions.create(
                model="sim-model", messages=[{"role": "user", "content": "hi"}], stream=True
            )
            list(stream)
            weather("Lyon")
            asyncio.run(slow_lookup())
            client.chat.completions.create(
                model="sim-model", messages=[{"role": "user", "content": "again"}], n=2, stop=["END"],
                seed=1, frequency_penalty=0.1, presence_penalty=0.2, response_format={"type": "json_object"},
                service_tier="flex",
            )  # fmt: skip
            client.responses.create(
                model="sim-model", input="usage with cached tokens", conversation="conv_1"
            )

        # The levers: a cache declared (its window of call durations starts now), a capped client over
        # and under its cap, one refusing; a hit with a saved-time estimate, a miss, a lookup that fails.
        @llmspans.cache("answers", model="sim-model")
        def cached(question: str) -> str | None:
            return "cached answer" if question == "known" else None

        capped = llmspans.instrument(
            openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0), max_prompt_tokens=20
        )
        strict = llmspans.instrument(
            openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0), max_prompt_tokens=20,
            on_exceed="error", prompt_tokenizer="chars",
        )  # fmt: skip
        with llmspans.turn("levers"):
            capped.chat.completions.create(model="sim-model", messages=[{"role": "user", "content": "short"}])
            capped.chat.completions.create(
                model="sim-model", messages=[{"role": "user", "content": "long " * 40}]
            )
            with contextlib.suppress(llmspans.PromptTooLarge):
                strict.chat.completions.create(
                    model="sim-model", messages=[{"role": "user", "content": "long " * 40}]
                )
            cached("known")
            with llmspans.cache_lookup("semantic") as lookup:
                lookup.hit = False
            with contextlib.suppress(_Failed), llmspans.cache_lookup("semantic"):
                raise _Failed

        # A hedged client: a slow primary beaten by its backup (the hedge's event, both copies' attempt
        # spans, the loser's tokens), and a call whose hedge the full limiter skipped.
        hedged = llmspans.instrument(
            openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0),
            hedge=llmspans.Hedge(after=0.05),
        )
        server.enqueue(Behavior(chunks=4, usage="finish", first_chunk_delay=0.5), fast)
        list(
            hedged.chat.completions.create(
                model="sim-model", messages=[{"role": "user", "content": "hedged"}], stream=True
            )
        )
        alone = llmspans.Limiter(1, name="alone")
        skipped = llmspans.instrument(
            openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0), hedge=llmspans.Hedge(after=0.05),
            limiter=alone,
        )  # fmt: skip
        server.enqueue(Behavior(header_delay=0.2))
        skipped.chat.completions.create(model="sim-model", messages=[{"role": "user", "content": "no slot"}])

        lane = llmspans.Limiter(2, name="interactive")
        laned = llmspans.instrument(
            openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0),
            limiter=lane,
            budget=30,
            capture_content=True,
            phase_spans="always",
        )
        list(
            laned.chat.completions.create(
                model="sim-model", messages=[{"role": "user", "content": "lane"}], stream=True
            )
        )
        with llmspans.turn("batch"), lane:  # the `with limiter:` form around the app's own code
            pass
        laned.responses.create(model="sim-model", input="captured", instructions="Answer briefly.")
        laned.embeddings.create(
            model="sim-embed", input=["one", "two"], dimensions=4, encoding_format="float"
        )  # fmt: skip
        server.enqueue(
            Behavior(chunks=4, drop_after=2)
        )  # an error after content: error.type on chunk metrics
        with contextlib.suppress(openai.APIError, httpx.HTTPError):
            list(
                laned.chat.completions.create(
                    model="sim-model", messages=[{"role": "user", "content": "drop"}], stream=True
                )
            )
        # A call `llmspans load` made: its stamper writes the level and the run on the call span, a replay's
        # recorded ids, and under `--ray` its generator.
        stamper = LevelStamper("0123456789abcdef", stamps=_replayed)
        stamper.generator = "g1@127.0.0.1:3f2a1b9c/5e6f7a8b"
        captured.tracer_provider.add_span_processor(stamper)
        token = CURRENT.set(RequestRecord(index=0, level="concurrency=1"))
        try:
            client.chat.completions.create(model="sim-model", messages=[{"role": "user", "content": "load"}])
        finally:
            CURRENT.reset(token)
            stamper.shutdown()
        server.enqueue(Behavior(status=503))
        with contextlib.suppress(openai.APIStatusError):
            laned.chat.completions.create(model="sim-model", messages=[{"role": "user", "content": "fails"}])
        # Tail sampling beside the capture: a trace at its span cap is counted (the weighted copies it
        # exports go to a processor of their own, so the captured spans stay as recorded).
        tail = llmspans.TailSamplingProcessor(
            SimpleSpanProcessor(InMemorySpanExporter()), ratio=0.5, max_spans_per_trace=1
        )
        captured.tracer_provider.add_span_processor(tail)
        with llmspans.turn("sampled"):
            search()
        tail.shutdown()

        # vLLM 0.32 exposes every signal the sampler reads. The rates and the prefix-cache ratio need
        # two samples with a prompt looked up between them: a warm-up request, then a fresh sample. The
        # call decodes slowly enough (0.6 s) for the sampler to read the server while it waits.
        with VLLMSimulator(EngineConfig(version=FAMILIES["0.32/0.33"], decode_per_token=0.2)) as vllm:
            sampled = llmspans.instrument(
                openai.OpenAI(base_url=vllm.base_url, api_key="x", max_retries=0),
                provider="vllm",
                server_metrics=True,
            )
            sampler = sampled._llmspans_instrumentation.settings.server_metrics  # type: ignore[attr-defined]
            if not sampler.wait_for_sample(5.0):
                raise RuntimeError("the vLLM simulator's /metrics was never sampled")
            with httpx.Client(base_url=vllm.base_url) as plain:  # not instrumented: no span of its own
                warm_up = {"model": EngineConfig().model, "messages": [{"role": "user", "content": "w"}]}
                plain.post("/chat/completions", json=warm_up | {"max_tokens": 1}).raise_for_status()
            if not sampler.wait_for_sample(5.0):
                raise RuntimeError("the vLLM simulator's /metrics was not sampled again")
            sampled.chat.completions.create(
                model=EngineConfig().model, messages=[{"role": "user", "content": "count"}], max_tokens=3,
                temperature=0.5, top_p=0.9, extra_body={"top_k": 5},
            )  # fmt: skip
            metrics = encode_metrics(captured._reader.get_metrics_data())  # while the sampler is live
            llmspans.uninstrument(sampled)
        return Exercised(spans=captured.spans, metrics=metrics)
