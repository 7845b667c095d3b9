"""The levers a call is under (`_call.Lever`, `CallRecord.levers`): a prompt cap's estimate, the caches' window
of call durations, a hedge. Each acts alone; all three on one call act each as it does alone, over real HTTP:
none reads, chains or replaces another, so removing one changes none of the others.
"""

from __future__ import annotations

from typing import Any

import openai
import pytest

import llmspans
from llmspans import _names as names
from llmspans import _prompt
from llmspans.testing import Captured
from llmspans.tools.simulator import Behavior, SimulatedServer

MESSAGES = [{"role": "user", "content": "which levers does this call pull"}]
CASES = [("cap",), ("cache",), ("hedge",), ("cap", "cache", "hedge")]


def one_call(levers: tuple[str, ...], server: SimulatedServer, captured: Captured) -> dict[str, Any]:
    """One call under `levers`; what each lever made of it."""
    if "hedge" in levers:
        server.enqueue(Behavior(header_delay=0.6), Behavior())  # a slow primary, a fast backup
    lookup = llmspans.cache_lookup("semantic") if "cache" in levers else None  # declared: the window runs
    options: dict[str, Any] = {}
    if "cap" in levers:
        options.update(max_prompt_tokens=1000, prompt_tokenizer="chars")
    if "hedge" in levers:
        options["hedge"] = llmspans.Hedge(after=0.1)
    client = llmspans.instrument(
        openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0), **options
    )
    with client:
        result = client.chat.completions.create(model="sim-model", messages=MESSAGES)
    saved = None
    if lookup is not None:
        with lookup as looked:
            looked.model = "sim-model"
            looked.hit = True
        (found,) = [s for s in captured.spans if s.name.startswith("cache")]
        saved = (found.attributes or {})[names.CACHE_SAVED_ESTIMATE]
    (call,) = [s for s in captured.spans if (s.attributes or {}).get(names.STAGE) == names.STAGE_LLM]
    attributes = dict(call.attributes or {})
    assert result.usage is not None
    return {
        "attributes": attributes,
        "duration": (call.end_time - call.start_time) / 1e9,  # type: ignore[operator]
        "saved": saved,
        "prompt_tokens": result.usage.prompt_tokens,
        "ratios": captured.metric_points(names.METRIC_PROMPT_ESTIMATE_RATIO),
    }


@pytest.mark.parametrize("levers", CASES, ids=["+".join(case) for case in CASES])
def test_each_lever_acts_alone_and_all_three_on_one_call_as_each_does_alone(
    levers: tuple[str, ...], server: SimulatedServer, captured: Captured
) -> None:
    made = one_call(levers, server, captured)
    attributes = made["attributes"]
    texts, tokens = _prompt.prompt_pieces({"messages": MESSAGES})
    estimate = _prompt.CHARACTERS.count(texts) + tokens
    if "cap" in levers:  # estimated before sending, compared with the server's count after
        assert attributes[names.PROMPT_ESTIMATED_TOKENS] == estimate
        assert attributes[names.PROMPT_ESTIMATE_RATIO] == estimate / made["prompt_tokens"]
        assert [point.count for point in made["ratios"]] == [1]
    else:
        assert not [key for key in attributes if key.startswith("llmspans.prompt.")]
        assert made["ratios"] == []
    if "cache" in levers:  # the window holds this one call: a hit saves its duration
        assert made["saved"] == made["duration"]
    if "hedge" in levers:  # the backup won; the loser's prompt was read, as many tokens as the winner's
        assert (attributes[names.HEDGE_FIRED], attributes[names.HEDGE_WON_BY]) == (
            True,
            names.HEDGE_ROLE_BACKUP,
        )
        assert attributes[names.HEDGE_WASTED_INPUT_TOKENS] == made["prompt_tokens"]
    else:
        assert not [key for key in attributes if key.startswith("llmspans.hedge.")]
