"""`llmspans demo`: a small RAG chat app against the simulated LLM server, with one bottleneck injected.

Each chat turn runs retrieval, prompt building, a guardrail, a tool, a streamed LLM call
and post-processing inside `llmspans.turn`, every stage with a budget, the LLM call behind
a `Limiter`. The model is llmspans' built-in *simulated* OpenAI-compatible server on
127.0.0.1 (started and stopped here; two of them, replicas the app calls in turn, for the
`slow-replica` scenario); a scenario sets its timings and failures and the app's, so exactly
one part of the request is the bottleneck, and the report printed at the end should name it.
`hedge=True` hedges each LLM call (to the other replica, or the same server) after `HEDGE_AFTER`.
Timings are drawn from a seeded generator: the same seed gives the same mix of delays (their
order across concurrent users still depends on scheduling).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TextIO, cast

import httpx

import llmspans
from llmspans import _suppress
from llmspans.tools.simulator import Behavior, SimulatedServer

DEFAULT_REQUESTS = 40
DEFAULT_CONCURRENCY = 4
DEFAULT_SEED = 7
MODEL = "sim-llm"
SERVICE_PREFIX = "llmspans-demo-"
LIMITER_NAME = "chat"

OnStart = Callable[[str, str, int, int], None]

# Budgets in seconds, in the spirit of a 1 s chat turn.
BUDGETS = {"retrieval": 0.1, "prompt": 0.02, "guardrail": 0.05, "tool": 0.1, "llm": 0.5, "post": 0.05}
TURN_BUDGET = 1.0
HEDGE_AFTER = 0.15  # about three times a healthy first token here, far below a slow replica's


@dataclass(frozen=True)
class Scenario:
    """One demo run's knobs; `expected` is the triage finding the report should name."""

    name: str
    injects: str
    expected: str
    expected_within_budget: bool = False
    tool_s: tuple[float, float] = (0.015, 0.04)
    prefill_median_s: float = 0.05
    prefill_sigma: float = 0.25
    chunk_gap_s: float = 0.015
    chunks: int = 12
    failure_rate: float = 0.0
    cap_share: float = 1.0  # limiter cap as a share of the concurrency
    idle_share: float = 0.0  # share of the cap a background job holds without calling the model
    replicas: int = 1  # servers the app calls in turn; the first is the slow one
    slow_share: float = 0.0  # share of the first replica's answers whose first token is late
    slow_s: tuple[float, float] = (1.0, 1.6)

    def cap(self, concurrency: int) -> int:
        return max(1, round(concurrency * self.cap_share))

    def idle_slots(self, cap: int) -> int:
        return min(cap - 1, math.ceil(cap * self.idle_share)) if self.idle_share else 0


SCENARIOS: dict[str, Scenario] = {
    scenario.name: scenario
    for scenario in (
        Scenario("healthy", "nothing: every stage within its budget", "stream", expected_within_budget=True),
        Scenario("queue", "a limiter cap too low for the load (a quarter of the users)", "queue", cap_share=0.25),
        Scenario(
            "retries", "429s and 503s with retry-after on 45% of attempts (the openai SDK retries)", "retry",
            failure_rate=0.45,
        ),
        Scenario(
            "slow-prefill", "a long, variable time to first token (long prompts, a busy server)", "first_token",
            prefill_median_s=0.35, prefill_sigma=0.7,
        ),
        Scenario("slow-decode", "slow token generation (80 ms between tokens)", "stream", chunk_gap_s=0.08),
        Scenario("slow-tool", "a tool that takes 0.35-0.8 s", "tool", tool_s=(0.35, 0.8)),
        Scenario(
            "stalled-scheduler", "a background job holding 3 of every 4 limiter slots without calling the model",
            "stalled_scheduler", idle_share=0.75,
        ),
        Scenario(
            "slow-replica", "two replicas called in turn, one sending 30% of its first tokens after 1.0-1.6 s "
            "(--hedge: hedge each call to the other replica after 150 ms)", "first_token", replicas=2,
            slow_share=0.3, cap_share=2.0,
        ),
    )
}  # fmt: skip


# --- the app ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TurnPlan:
    """The app-side delays of one turn, drawn up front from the seeded generator."""

    question: str
    retrieval_s: float
    guardrail_s: float
    tool_s: float
    post_s: float


@llmspans.retrieval(budget=BUDGETS["retrieval"], data_source="demo-docs")
async def retrieve(question: str, delay_s: float) -> list[str]:
    await asyncio.sleep(delay_s)
    return [f"passage {n} about {question}" for n in range(3)]


@llmspans.stage("prompt", budget=BUDGETS["prompt"])
def build_prompt(question: str, passages: Sequence[str]) -> list[dict[str, str]]:
    context = "\n".join(passages)
    return [
        {"role": "system", "content": f"Answer from the context.\n{context}"},
        {"role": "user", "content": question},
    ]


@llmspans.stage("guardrail", budget=BUDGETS["guardrail"])
async def guardrail(messages: Sequence[dict[str, str]], delay_s: float) -> bool:
    await asyncio.sleep(delay_s)
    return all("forbidden" not in message["content"] for message in messages)


@llmspans.tool(name="order_status", budget=BUDGETS["tool"])
async def order_status(delay_s: float) -> str:
    await asyncio.sleep(delay_s)
    return "order 1234 shipped yesterday"


@llmspans.stage("post", budget=BUDGETS["post"])
async def postprocess(text: str, delay_s: float) -> str:
    await asyncio.sleep(delay_s)
    return text.strip()


class ChatModel(Protocol):
    async def complete(self, messages: list[dict[str, str]]) -> str: ...
    async def aclose(self) -> None: ...


class OpenAIChat:
    """The openai SDK's AsyncOpenAI, instrumented, one client per replica, called in turn; its own retry
    loop honours retry-after. With `hedge`, each client hedges to the next replica's (or to itself)."""

    name = "openai SDK (AsyncOpenAI)"

    def __init__(self, base_urls: Sequence[str], limiter: llmspans.Limiter, hedge: bool = False) -> None:
        import openai

        plain = [openai.AsyncOpenAI(base_url=url, api_key="simulated", max_retries=3) for url in base_urls]
        self._clients = [
            llmspans.instrument(
                client,
                limiter=limiter,
                budget=BUDGETS["llm"],
                request_usage=True,  # the stream's token counts, so tokens and tokens/s show
                hedge=llmspans.Hedge(after=HEDGE_AFTER, backup=plain[(n + 1) % len(plain)])
                if hedge
                else None,
            )
            for n, client in enumerate(plain)
        ]
        self._next = itertools.cycle(self._clients)

    async def complete(self, messages: list[dict[str, str]]) -> str:
        stream = await next(self._next).chat.completions.create(
            model=MODEL,
            messages=cast(Any, messages),  # plain dicts: the SDK's message types are TypedDicts
            stream=True,
        )
        parts = []
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
        return "".join(parts)

    async def aclose(self) -> None:
        for client in self._clients:
            await client.close()


class HttpxChat:
    """A plain httpx.AsyncClient pointed at the OpenAI-compatible endpoint, instrumented, one per replica."""

    name = "plain httpx.AsyncClient"

    def __init__(self, base_urls: Sequence[str], limiter: llmspans.Limiter) -> None:
        self._clients = [
            llmspans.instrument(
                httpx.AsyncClient(base_url=url, timeout=30.0), limiter=limiter, budget=BUDGETS["llm"]
            )
            for url in base_urls
        ]
        self._next = itertools.cycle(self._clients)

    async def complete(self, messages: list[dict[str, str]]) -> str:
        body = {
            "model": MODEL,
            "stream": True,
            "messages": messages,
            "stream_options": {"include_usage": True},
        }
        parts = []
        async with next(self._next).stream("POST", "/chat/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                choices = json.loads(line[len("data: ") :]).get("choices") or [{}]
                content = (choices[0].get("delta") or {}).get("content")
                if content:
                    parts.append(content)
        return "".join(parts)

    async def aclose(self) -> None:
        for client in self._clients:
            await client.aclose()


async def chat_turn(model: ChatModel, plan: TurnPlan) -> str:
    """One user-visible chat turn: the app whose time the report explains."""
    async with llmspans.turn("chat", budget=TURN_BUDGET):
        passages = await retrieve(plan.question, plan.retrieval_s)
        messages = build_prompt(plan.question, passages)
        if not await guardrail(messages, plan.guardrail_s):
            return "I cannot help with that."
        facts = await order_status(plan.tool_s)
        messages[-1]["content"] += f"\nFacts: {facts}"
        answer = await model.complete(messages)
        return await postprocess(answer, plan.post_s)


# --- a run --------------------------------------------------------------------------------------------


def _plans(scenario: Scenario, requests: int, rng: random.Random) -> list[TurnPlan]:
    questions = ("where is my order?", "why is it slow?", "what is a span?", "can I get a refund?")
    return [
        TurnPlan(
            question=questions[n % len(questions)],
            retrieval_s=rng.uniform(0.02, 0.05),
            guardrail_s=rng.uniform(0.005, 0.015),
            tool_s=rng.uniform(*scenario.tool_s),
            post_s=rng.uniform(0.003, 0.01),
        )
        for n in range(requests)
    ]


def _arrivals(
    scenario: Scenario, requests: int, rng: random.Random, slow_share: float = 0.0
) -> list[Behavior]:
    """What a server does on each arriving request, in arrival order (failures and slow first tokens included)."""
    behaviors = []
    for _ in range(3 * requests + 8):
        if slow_share and rng.random() < slow_share:
            behaviors.append(
                Behavior(
                    first_chunk_delay=rng.uniform(*scenario.slow_s),
                    chunk_gap=scenario.chunk_gap_s,
                    chunks=scenario.chunks,
                )
            )
            continue
        if rng.random() < scenario.failure_rate:
            if rng.random() < 0.6:
                behaviors.append(Behavior(status=429, retry_after_ms=250.0))
            else:
                behaviors.append(Behavior(status=503, retry_after=0.35))
            continue
        prefill = min(5.0, rng.lognormvariate(math.log(scenario.prefill_median_s), scenario.prefill_sigma))
        behaviors.append(
            Behavior(
                first_chunk_delay=prefill,
                chunk_gap=scenario.chunk_gap_s * rng.uniform(0.85, 1.15),
                chunks=scenario.chunks,
            )
        )
    return behaviors


class Progress:
    """A one-line progress bar on a stream (stderr); redrawn in place on a terminal."""

    def __init__(self, total: int, stream: TextIO, label: str) -> None:
        self.total = total
        self.done = 0
        self.stream = stream
        self.label = label
        self.live = stream.isatty()
        self.started = time.monotonic()

    def advance(self) -> None:
        self.done += 1
        if self.live:
            self._draw("\r")

    def finish(self) -> None:
        self._draw("\r" if self.live else "")
        self.stream.write("\n")
        self.stream.flush()

    def _draw(self, prefix: str) -> None:
        width = 30
        filled = width * self.done // max(1, self.total)
        bar = "#" * filled + "." * (width - filled)
        elapsed = time.monotonic() - self.started
        self.stream.write(f"{prefix}{self.label} [{bar}] {self.done}/{self.total} turns {elapsed:5.1f} s")
        self.stream.flush()


@dataclass(frozen=True)
class RunResult:
    scenario: str
    turns: int
    failed: int
    elapsed_s: float
    server_url: str
    client: str
    cap: int
    idle_slots: int
    hedged: bool = False


def choose_client(kind: str) -> str:
    """`openai` when asked or when the SDK is importable (auto), else `httpx`."""
    if kind != "auto":
        return kind
    try:
        import openai  # noqa: F401
    except ImportError:
        return "httpx"
    return "openai"


async def _run(
    scenario: Scenario, requests: int, concurrency: int, seed: int, client: str, progress: Progress | None,
    on_start: OnStart | None, hedge: bool = False,
) -> RunResult:  # fmt: skip
    rng = random.Random(seed)
    plans = _plans(scenario, requests, rng)
    cap = scenario.cap(concurrency)
    limiter = llmspans.Limiter(cap, name=LIMITER_NAME)
    idle_slots = scenario.idle_slots(cap)
    with contextlib.ExitStack() as servers:
        replicas = [
            servers.enter_context(SimulatedServer(Behavior(chunks=scenario.chunks), record=False))
            for _ in range(scenario.replicas)
        ]
        urls = [server.base_url for server in replicas]
        model: ChatModel = (
            OpenAIChat(urls, limiter, hedge) if client == "openai" else HttpxChat(urls, limiter)
        )
        # A process's first openai call imports and builds the SDK's types with the event loop blocked
        # (50-150 ms), which would land in whatever stage the other turns were in. No scenario is about
        # that, so one untraced call (OpenTelemetry's suppress switch) per replica pays it before the first turn.
        with _suppress.suppressing():
            for _ in replicas:
                await model.complete([{"role": "user", "content": "warm-up"}])
        for number, server in enumerate(replicas):
            server.enqueue(*_arrivals(scenario, requests, rng, scenario.slow_share if number == 0 else 0.0))
        if on_start is not None:
            on_start(", ".join(urls), client, cap, idle_slots)
        release = asyncio.Event()
        holders = [asyncio.create_task(_hold_idle(limiter, release)) for _ in range(idle_slots)]
        await asyncio.sleep(0)  # let the background job take its slots first
        pending = iter(plans)
        failed = 0
        started = time.perf_counter()

        async def user() -> None:
            nonlocal failed
            for plan in pending:
                try:
                    await chat_turn(model, plan)
                except Exception:  # a failed turn is part of the picture, not the end of the demo
                    failed += 1
                if progress is not None:
                    progress.advance()

        try:
            await asyncio.gather(*(user() for _ in range(max(1, concurrency))))
        finally:
            release.set()
            await asyncio.gather(*holders, return_exceptions=True)
            await model.aclose()
        elapsed = time.perf_counter() - started
        url = ", ".join(urls)
    return RunResult(scenario.name, requests, failed, elapsed, url, client, cap, idle_slots, hedge)


async def _hold_idle(limiter: llmspans.Limiter, release: asyncio.Event) -> None:
    """The stalled-scheduler scenario's background job: takes a slot and sits on it."""
    async with limiter:
        await release.wait()


def run(
    scenario: Scenario, *, requests: int = DEFAULT_REQUESTS, concurrency: int = DEFAULT_CONCURRENCY,
    seed: int = DEFAULT_SEED, client: str = "auto", progress: Progress | None = None,
    on_start: OnStart | None = None, hedge: bool = False,
) -> RunResult:  # fmt: skip
    """Run the demo app once, recording into whatever providers llmspans is using.

    `on_start(base_url, client, cap, idle_slots)` is called once the simulated servers listen (their URLs
    joined by ", "). ValueError for arguments that cannot work; ImportError when `client="openai"` is not
    installed.
    """
    if requests < 1:
        raise ValueError(f"--requests must be at least 1, got {requests}")
    if concurrency < 1:
        raise ValueError(f"--concurrency must be at least 1, got {concurrency}")
    chosen = choose_client(client)
    if chosen == "httpx" and scenario.failure_rate:
        raise ValueError(
            f"the {scenario.name} scenario needs the openai SDK's retry loop (a plain httpx client does not "
            "retry): pip install 'llmspans[openai]', or pick another scenario"
        )
    if hedge and chosen == "httpx":
        raise ValueError(
            "--hedge needs the openai SDK client (a plain httpx client hands the app raw bytes, which cannot be "
            "taken back from a copy that lost): pip install 'llmspans[openai]', or leave --client httpx out"
        )
    return asyncio.run(_run(scenario, requests, concurrency, seed, chosen, progress, on_start, hedge))
