"""A scripted chat app that uses both levers, with known figures: the report's tests run it.

Twelve turns; each asks a cache first. Turns 0, 3, 6 and 9 hit and make no call. The other eight call the
simulated server through clients capped at `CAP` prompt tokens: turns 1, 5, 7 and 11 send a long prompt
(over the cap; the server answers it after `LONG_DELAY`, as a long prefill would), turns 2, 4, 8 and 10 a
short one (`SHORT_DELAY`). Turn 11's client says `on_exceed="error"`: its call is refused, never sent.

So: 12 lookups, 4 hits (the first before any call, so without a saved-time estimate); 8 capped calls, 4
over the cap, 1 refused; the simulator counts a prompt's words, and the prompts are words of four letters.
"""

from __future__ import annotations

import contextlib

import openai

import llmspans

TURNS = 12
HITS = (0, 3, 6, 9)
LONG = (1, 5, 7, 11)
REFUSED = (11,)
CAP = 200
LONG_WORDS, SHORT_WORDS = 200, 20  # chars/4: 257 and 32 tokens with the message's overhead
LONG_DELAY, SHORT_DELAY = 0.15, 0.02
CACHE = "answers"
MODEL = "sim-model"


def run(base_url: str) -> None:
    capped = llmspans.instrument(
        openai.OpenAI(base_url=base_url, api_key="k", max_retries=0), max_prompt_tokens=CAP
    )
    strict = llmspans.instrument(
        openai.OpenAI(base_url=base_url, api_key="k", max_retries=0), max_prompt_tokens=CAP, on_exceed="error"
    )

    @llmspans.cache(CACHE, model=MODEL)
    def cached(turn: int) -> str | None:
        return "a cached answer" if turn in HITS else None

    for turn in range(TURNS):
        with llmspans.turn("chat"):
            if cached(turn) is not None:
                continue
            long = turn in LONG
            words = LONG_WORDS if long else SHORT_WORDS
            client = strict if turn in REFUSED else capped
            with contextlib.suppress(llmspans.PromptTooLarge):
                client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": " ".join(["abcd"] * words)}],
                    extra_body={"x_sim": {"header_delay": LONG_DELAY if long else SHORT_DELAY}},
                )  # fmt: skip
