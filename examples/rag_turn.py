"""A small RAG turn with stages, budgets and a streamed LLM call, on the embedded default.

The LLM is llmspans' built-in *simulated* OpenAI-compatible server on 127.0.0.1 (about
80 ms to the first token, 20 ms between tokens), reached through a plain httpx client
wrapped in one line. Run it, then look at the trace file it names: one `turn chat` span
per question, with the stages and the `chat sim-llm` call (and its six buckets) under it.
"""

from __future__ import annotations

import asyncio
import json
import random

import httpx

import llmspans
from llmspans.tools.simulator import Behavior, SimulatedServer


@llmspans.retrieval(budget="120ms")
async def search(question: str) -> list[str]:
    await asyncio.sleep(random.uniform(0.03, 0.15))
    return [f"passage about {question}"]


@llmspans.stage("prompt", budget="20ms")
def build_prompt(question: str, passages: list[str]) -> str:
    return "\n".join([*passages, question])


@llmspans.stage("guardrail", budget="50ms")
async def check(prompt: str) -> bool:
    await asyncio.sleep(0.01)
    return "forbidden" not in prompt


@llmspans.tool(budget="80ms", on_exceed="cancel", fallback="weather unknown")
async def weather(city: str) -> str:
    await asyncio.sleep(random.choice([0.02, 0.2]))
    return f"sunny in {city}"


async def generate(client: httpx.AsyncClient, prompt: str) -> str:
    body = {"model": "sim-llm", "stream": True, "messages": [{"role": "user", "content": prompt}]}
    text = []
    async with client.stream("POST", "/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    text.append(choice["delta"].get("content") or "")
    return "".join(text)


async def answer(client: httpx.AsyncClient, question: str) -> str:
    async with llmspans.turn("chat", budget="500ms"):
        passages = await search(question)
        prompt = build_prompt(question, passages)
        if not await check(prompt):
            return "I can't help with that."
        reply = await generate(client, prompt)
        return f"{reply} ({await weather('Paris')})"


async def run() -> None:
    simulated = Behavior(first_chunk_delay=0.08, chunk_gap=0.02, chunks=8, usage="finish")
    with SimulatedServer(simulated) as llm:
        print(f"simulated LLM server (not a real model) at {llm.base_url}")
        async with httpx.AsyncClient(base_url=llm.base_url) as client:
            llmspans.instrument(client)  # the one line
            for question in ("what is a span?", "why is it slow?", "where is my time?"):
                print(question, "->", await answer(client, question))


def main() -> None:
    config = llmspans.configure(service_name="rag-example")
    asyncio.run(run())
    print(f"traces written to {config.traces_file} ({config.mode})")


if __name__ == "__main__":
    main()
