"""A small RAG turn with stages and budgets, exported by the embedded default.

Run it, then look at the trace file it names: one `turn chat` span with the stages under it.
"""

from __future__ import annotations

import asyncio
import random

import llmspans


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


async def answer(question: str) -> str:
    async with llmspans.turn("chat", budget="500ms"):
        passages = await search(question)
        prompt = build_prompt(question, passages)
        if not await check(prompt):
            return "I can't help with that."
        return await weather("Paris")


def main() -> None:
    config = llmspans.configure(service_name="rag-example")
    for question in ("what is a span?", "why is it slow?", "where is my time?"):
        print(question, "->", asyncio.run(answer(question)))
    print(f"traces written to {config.traces_file} ({config.mode})")


if __name__ == "__main__":
    main()
