"""Before a replay: what the target counts per synthetic word, and whether it takes `ignore_eos`.

A recorded call's input tokens are the server's count, template included; a synthetic prompt is words
of the load's vocabulary. Two untraced requests per endpoint the replay uses (prompts of `SHORT` and
`LONG` words, one output token, not streamed) give the tokens a word costs and the template's own tokens,
from the usage the server answers with, so each prompt is sized to the recorded count (the simulator
counts a word a token and adds nothing; a real tokenizer and chat template do). `ignore_eos` (ask for
`max_tokens` whatever the model would end with) is vLLM's: sent when `--provider vllm` says so, or when
`GET /models` names vLLM or the llmspans simulator as the owner. Nothing here raises: a target that does
not answer leaves the defaults (a word a token, no template), and the run says so.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Any

import httpx

from llmspans import _suppress
from llmspans.load._replay_workload import ServerFacts
from llmspans.load._workload import _words

SHORT, LONG = 16, 48
TAKES_IGNORE_EOS = ("vllm", "llmspans-simulator")  # `owned_by` in GET /models
_PATHS = {"chat": "chat/completions", "completions": "completions", "responses": "responses"}


def probe(
    base_url: str, model: str, endpoints: Iterable[str], *, api_key: str = "none", provider: str | None = None,
    timeout_s: float = 10.0,
) -> ServerFacts:  # fmt: skip
    """What the target at `base_url` counts per word for each of `endpoints`, and whether it takes ignore_eos."""
    base = base_url.rstrip("/") + "/"
    headers = {"authorization": f"Bearer {api_key}"}
    with _suppress.suppressing(), httpx.Client(timeout=timeout_s, headers=headers) as client:
        owner = _owner(client, base)
        ignore_eos = provider == "vllm" or owner in TAKES_IGNORE_EOS
        overhead: dict[str, float] = {}
        per_word: list[float] = []
        failed: list[str] = []
        for endpoint in dict.fromkeys(endpoints):
            counts = [_count(client, base, endpoint, model, words, ignore_eos) for words in (SHORT, LONG)]
            short, long = counts
            if short is None or long is None or long <= short:
                failed.append(endpoint)
                continue
            slope = (long - short) / (LONG - SHORT)
            per_word.append(slope)
            overhead[endpoint] = short - SHORT * slope
    if not per_word:
        return ServerFacts(
            ignore_eos=ignore_eos,
            words="the server's tokens per word could not be read (no usage in its answers): a synthetic word "
            "taken as one token",
        )
    tokens_per_word = sum(per_word) / len(per_word)
    template = ", ".join(f"{endpoint} +{value:.0f}" for endpoint, value in overhead.items())
    said = f"the server counts {tokens_per_word:.2f} tokens a synthetic word (template tokens: {template})"
    if failed:
        said += f"; {', '.join(failed)} not measured, taken alike"
    return ServerFacts(tokens_per_word, overhead, ignore_eos, True, said)


def _owner(client: httpx.Client, base: str) -> str | None:
    try:
        response = client.get(base + "models")
        data = response.json().get("data") if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    owners = {item.get("owned_by") for item in data or () if isinstance(item, dict)}
    return next((owner for owner in owners if owner in TAKES_IGNORE_EOS), None)


def _count(
    client: httpx.Client, base: str, endpoint: str, model: str, words: int, ignore_eos: bool
) -> int | None:
    """The prompt tokens the server counts for `words` synthetic words on `endpoint`; None if it says none."""
    text = " ".join(_words(random.Random(words), words))
    body: dict[str, Any] = {"model": model, "stream": False}
    if endpoint == "chat":
        body.update(messages=[{"role": "user", "content": text}], max_tokens=1)
    elif endpoint == "completions":
        body.update(prompt=text, max_tokens=1)
    else:
        body.update(input=text, max_output_tokens=1)
    if ignore_eos:
        body["ignore_eos"] = True
    try:
        response = client.post(base + _PATHS[endpoint], json=body)
        usage = response.json().get("usage") if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    if not isinstance(usage, dict):
        return None
    value = usage.get("input_tokens" if endpoint == "responses" else "prompt_tokens")
    return value if type(value) is int else None
