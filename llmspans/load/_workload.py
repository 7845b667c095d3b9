"""What a load run sends and at which levels: the workload (prompts, endpoint, lengths) and the plan.

Everything is decided up front from the arguments and a seed, so two runs with the same arguments send
the same requests in the same order. A synthetic prompt is N words drawn from a fixed vocabulary (a word
is about a token; the server's usage says the real count); `--shared-prefix` makes every prompt start
with the same words, to exercise a prefix cache. Bad values raise ValueError saying what to pass.
"""

from __future__ import annotations

import functools
import json
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmspans import _names as names
from llmspans._budget import parse_budgets
from llmspans.load._model import SHAPE_CONCURRENCY, SHAPE_RATE, SHAPE_SPEED, Level

ENDPOINTS = ("chat", "completions", "responses")
SLO_METRICS = ("ttft", "tpot", "e2e")
DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16)
DEFAULT_MAX_TOKENS = 64
DEFAULT_PROMPT_TOKENS = 128
DEFAULT_SEED = 7
DEFAULT_LEVEL_SECONDS = 60.0
DEFAULT_MAX_REQUESTS = 2000
DEFAULT_MAX_SECONDS = 600.0
DEFAULT_KNEE_FACTOR = 2.0
# A level runs this many requests unless --requests says otherwise: enough for a p95 (20 at least), and
# for an open loop about ten seconds of arrivals.
MIN_LEVEL_REQUESTS = 20
REQUESTS_PER_USER = 4
OPEN_LOOP_SECONDS = 10.0
MAX_DEFAULT_LEVEL_REQUESTS = 1000

_VOCABULARY = (
    "the", "request", "model", "token", "server", "queue", "batch", "cache", "latency", "stream", "answer",
    "question", "context", "prompt", "decode", "prefill", "memory", "client", "network", "time", "load",
    "level", "first", "last", "slow", "fast", "budget", "trace", "span", "retry", "connect", "window",
)  # fmt: skip
Messages = list[dict[str, Any]]


@dataclass(frozen=True)
class Shape:
    """What a request is besides its body: the endpoint it goes to and whether it streams."""

    endpoint: str
    stream: bool


@dataclass(frozen=True)
class Workload:
    model: str
    endpoint: str = "chat"
    stream: bool = True
    max_tokens: int = DEFAULT_MAX_TOKENS
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS
    prompt_stddev: float = 0.0
    shared_prefix: int = 0
    seed: int = DEFAULT_SEED
    prompts: tuple[Messages, ...] = field(default=(), repr=False)  # given prompts, used in turn
    prompts_source: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("--model must name the model the server serves, e.g. --model llama-3-8b")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        _positive_int(self.max_tokens, "--max-tokens")
        _positive_int(self.prompt_tokens, "--prompt-tokens")
        if not math.isfinite(self.prompt_stddev) or self.prompt_stddev < 0:
            raise ValueError(f"--prompt-tokens' stddev must be 0 or more, got {self.prompt_stddev!r}")
        if self.shared_prefix < 0:
            raise ValueError(f"--shared-prefix must be 0 or more words, got {self.shared_prefix}")

    def messages(self, index: int) -> Messages:
        """Request `index`'s messages: the given prompts in turn, else a synthetic prompt."""
        if self.prompts:
            return self.prompts[index % len(self.prompts)]
        return [{"role": "user", "content": self._synthetic(index)}]

    def _synthetic(self, index: int) -> str:
        rng = random.Random(self.seed * 1_000_003 + index)
        count = self.prompt_tokens
        if self.prompt_stddev:
            count = max(1, round(rng.gauss(self.prompt_tokens, self.prompt_stddev)))
        prefix = _words(random.Random(self.seed), min(self.shared_prefix, count))
        return " ".join(prefix + _words(rng, count - len(prefix)))

    @functools.cached_property
    def _shape(self) -> Shape:
        return Shape(self.endpoint, self.stream)

    def shape(self, index: int) -> Shape:
        """Request `index`'s endpoint and streaming: the workload's own for every request (a replay's vary)."""
        return self._shape

    def span_attributes(self, index: int) -> Mapping[str, str] | None:
        """What the load stamps on request `index`'s call span besides its level and run (a replay: where
        its recorded call came from); None: nothing."""
        return None

    def request(self, index: int) -> dict[str, Any]:
        """The keyword arguments of request `index`'s `create()` call."""
        messages = self.messages(index)
        if self.endpoint == "chat":
            return {
                "model": self.model,
                "messages": messages,
                "max_tokens": self.max_tokens,
                "stream": self.stream,
            }
        text = "\n".join(_text(message.get("content")) for message in messages)
        if self.endpoint == "completions":
            return {"model": self.model, "prompt": text, "max_tokens": self.max_tokens, "stream": self.stream}
        return {
            "model": self.model,
            "input": text,
            "max_output_tokens": self.max_tokens,
            "stream": self.stream,
        }

    def describe(self) -> str:
        if self.prompts:
            prompts = f"{len(self.prompts)} prompts from {self.prompts_source}"
        else:
            spread = f"±{self.prompt_stddev:g}" if self.prompt_stddev else ""
            shared = f", the first {self.shared_prefix} shared" if self.shared_prefix else ""
            prompts = f"prompts of {self.prompt_tokens}{spread} words{shared}"
        mode = "streamed" if self.stream else "not streamed"
        return f"{self.endpoint} ({mode}), {prompts}, max {self.max_tokens} output tokens, seed {self.seed}"


def _words(rng: random.Random, count: int) -> list[str]:
    return rng.choices(_VOCABULARY, k=max(0, count))  # one call: a word per token costs 1 µs, not 5


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, Mapping))
    return ""


def _positive_int(value: object, option: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{option} must be a positive whole number, got {value!r}")
    return value


# --- prompts from files ------------------------------------------------------------------------------


def prompts_from_file(path: str) -> tuple[Messages, ...]:
    """`--prompts FILE`: JSON lines, each a list of chat messages, `{"messages": [...]}`, a string, or
    `{"prompt": "..."}` (`vllm bench serve`'s `custom` dataset: the same file drives both tools)."""
    prompts: list[Messages] = []
    for number, line in enumerate(_lines(path, "--prompts"), 1):
        try:
            item = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"--prompts {path}: line {number} is not JSON ({error.msg})") from None
        if isinstance(item, Mapping):
            item = item.get("messages", item.get("prompt"))
        if isinstance(item, str):
            item = [{"role": "user", "content": item}]
        if not (isinstance(item, list) and item and all(_is_message(m) for m in item)):
            raise ValueError(
                f"--prompts {path}: line {number} must be a list of messages like "
                '[{"role": "user", "content": "..."}], {"messages": [...]}, {"prompt": "..."} or a string'
            )
        prompts.append(item)
    if not prompts:
        raise ValueError(f"--prompts {path} holds no prompt")
    return tuple(prompts)


def prompts_from_traces(path: str) -> tuple[Messages, ...]:
    """`--prompts-from FILE`: the input messages of the call spans in a traces file (OTLP-JSON lines)
    recorded with content capture on, in the GenAI conventions' form, turned back into chat messages."""
    prompts = tuple(messages for _, messages in _captured(path))
    if not prompts:
        raise ValueError(_NOTHING_CAPTURED.format(path=path))
    return prompts


def captured_prompts(path: str) -> dict[tuple[str, str], Messages]:
    """`--prompts-from FILE` with `--replay`: each call span's captured input messages by (trace id, span id)
    (hex), so a replayed call is sent with its own recorded content."""
    found = dict(_captured(path))
    if not found:
        raise ValueError(_NOTHING_CAPTURED.format(path=path))
    return found


_NOTHING_CAPTURED = (
    f"--prompts-from {{path}}: no call span there carries {names.GEN_AI_INPUT_MESSAGES}; record with content "
    f"capture on (configure(capture_content=True) or {names.ENV_CAPTURE_CONTENT}=true), or pass --prompts FILE"
)


def _captured(path: str) -> list[tuple[tuple[str, str], Messages]]:
    """Each call span's ((trace id, span id), captured messages) in a traces file, in file order."""
    found = []
    for line in _lines(path, "--prompts-from"):
        try:
            document = json.loads(line)
        except json.JSONDecodeError:
            continue  # a bad line is the report's to name; here it holds no prompt
        for resource in document.get("resourceSpans") or () if isinstance(document, Mapping) else ():
            for scope in resource.get("scopeSpans") or ():
                for span in scope.get("spans") or ():
                    messages = _captured_messages(span)
                    if messages:
                        ids = (str(span.get("traceId", "")).lower(), str(span.get("spanId", "")).lower())
                        found.append((ids, messages))
    return found


def _captured_messages(span: Mapping[str, Any]) -> Messages | None:
    attributes = {item.get("key"): item.get("value", {}) for item in span.get("attributes") or ()}
    stage = attributes.get(names.STAGE, {}).get("stringValue")
    raw = attributes.get(names.GEN_AI_INPUT_MESSAGES, {}).get("stringValue")
    if stage != names.STAGE_LLM or not isinstance(raw, str):
        return None
    try:
        captured = json.loads(raw)
    except json.JSONDecodeError:
        return None
    messages = []
    for message in captured if isinstance(captured, list) else ():
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            continue
        messages.append(
            _chat_message(message["role"], [p for p in message.get("parts") or () if isinstance(p, Mapping)])
        )
    return messages or None


def _chat_message(role: str, parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A captured message (the conventions' parts) as the chat API takes it: its text; a tool's answer with
    its call's id; an assistant's tool calls with theirs (reasoning is not sent back)."""
    text = "".join(str(part.get("content", "")) for part in parts if part.get("type") == "text")
    answers = [part for part in parts if part.get("type") == "tool_call_response"]
    if answers:
        response = answers[0].get("response")
        text += response if isinstance(response, str) else json.dumps(response, separators=(",", ":"))
        message: dict[str, Any] = {"role": role, "content": text}
        if isinstance(answers[0].get("id"), str):
            message["tool_call_id"] = answers[0]["id"]
        return message
    calls = [
        {
            "id": part.get("id"), "type": "function",
            "function": {"name": part.get("name"), "arguments": _arguments(part.get("arguments"))},
        }
        for part in parts
        if part.get("type") == "tool_call"
    ]  # fmt: skip
    if calls:
        return {"role": role, "content": text or None, "tool_calls": calls}
    return {"role": role, "content": text}


def _arguments(value: Any) -> str:
    return (
        value
        if isinstance(value, str)
        else json.dumps(value if value is not None else {}, separators=(",", ":"))
    )


def _is_message(value: Any) -> bool:
    return isinstance(value, Mapping) and isinstance(value.get("role"), str) and "content" in value


def _lines(path: str, option: str) -> list[str]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise ValueError(f"{option}: cannot read {path}: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{option}: {path} is not UTF-8 text") from None
    return [line for line in text.splitlines() if line.strip()]


# --- the plan ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """The levels to run (or, for a sweep, where it starts) and the bounds on the run."""

    shape: str
    levels: tuple[Level, ...]
    sweep: bool = False
    requests_per_level: int | None = None
    level_seconds: float = DEFAULT_LEVEL_SECONDS
    max_requests: int = DEFAULT_MAX_REQUESTS
    max_seconds: float = DEFAULT_MAX_SECONDS
    burstiness: float = 1.0
    knee_factor: float = DEFAULT_KNEE_FACTOR
    slo: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.shape not in (SHAPE_CONCURRENCY, SHAPE_RATE, SHAPE_SPEED):
            raise ValueError(
                f"shape must be {SHAPE_CONCURRENCY!r}, {SHAPE_RATE!r} or {SHAPE_SPEED!r}, got {self.shape!r}"
            )
        if not self.levels:
            raise ValueError("at least one level is needed (--concurrency 1,2,4 or --rate 1,2,4)")
        if self.requests_per_level is not None:
            _positive_int(self.requests_per_level, "--requests")
        _positive_int(self.max_requests, "--max-requests")
        for value, option in ((self.level_seconds, "--level-seconds"), (self.max_seconds, "--max-seconds")):
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"{option} must be a positive number of seconds, got {value!r}")
        if not math.isfinite(self.burstiness) or self.burstiness <= 0:
            raise ValueError(f"--burstiness must be a positive number (1: Poisson), got {self.burstiness!r}")
        if not math.isfinite(self.knee_factor) or self.knee_factor <= 1:
            raise ValueError(
                f"--knee-factor must be a number above 1 (2: twice the low-load p95), got {self.knee_factor!r}"
            )

    @property
    def open_loop(self) -> bool:
        return self.shape == SHAPE_RATE

    def requests_for(self, level: Level) -> int:
        if self.requests_per_level is not None:
            return self.requests_per_level
        if level.shape == SHAPE_CONCURRENCY:
            return max(MIN_LEVEL_REQUESTS, REQUESTS_PER_USER * int(level.value))
        return min(
            MAX_DEFAULT_LEVEL_REQUESTS, max(MIN_LEVEL_REQUESTS, math.ceil(OPEN_LOOP_SECONDS * level.value))
        )

    def planned_requests(self) -> int:
        """At most this many requests (for the question before a run against another host)."""
        if self.sweep:
            return self.max_requests
        return min(self.max_requests, sum(self.requests_for(level) for level in self.levels))


def parse_levels(spec: str, shape: str) -> tuple[Level, ...]:
    """`"1,2,4,8"` as levels of `shape`; concurrency takes whole numbers, rates any positive number."""
    option = {SHAPE_CONCURRENCY: "--concurrency", SHAPE_SPEED: "--speed"}.get(shape, "--rate")
    levels = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        try:
            value = float(item)
        except ValueError:
            value = math.nan
        whole = shape != SHAPE_CONCURRENCY or value.is_integer()
        if not math.isfinite(value) or value <= 0 or not whole:
            kind = {
                SHAPE_CONCURRENCY: "positive whole numbers",
                SHAPE_SPEED: "positive numbers (times the recorded pace)",
            }.get(shape, "positive numbers of requests/s")
            raise ValueError(
                f"{option} takes {kind} separated by commas, e.g. {option} 1,2,4,8; got {item!r}"
            )
        levels.append(Level(shape, value))
    if not levels:
        raise ValueError(f"{option} needs at least one level, e.g. {option} 1,2,4,8")
    return tuple(sorted(set(levels)))


def parse_slo(spec: str) -> dict[str, float]:
    """`"ttft=500ms,tpot=50ms,e2e=2s"` as seconds per metric."""
    slo = parse_budgets(spec, source="--slo")
    unknown = sorted(set(slo) - set(SLO_METRICS))
    if unknown:
        raise ValueError(
            f"--slo knows {', '.join(SLO_METRICS)}, not {', '.join(unknown)} (e.g. --slo ttft=500ms,e2e=2s)"
        )
    return slo


def parse_prompt_tokens(spec: str) -> tuple[int, float]:
    """`"128"` or `"128,32"` (mean, standard deviation) in words."""
    mean, _, spread = spec.partition(",")
    try:
        tokens = int(mean)
        stddev = float(spread) if spread else 0.0
    except ValueError:
        raise ValueError(f"--prompt-tokens takes N or N,STDDEV (e.g. 128 or 128,32), got {spec!r}") from None
    return tokens, stddev


def plan_words(plan: Plan, workload: Workload) -> Sequence[str]:
    """The plan in a few lines: shown before a run against another host, and at the top of the output."""
    if plan.sweep:
        levels = f"a sweep from {plan.levels[0].words} up until the knee"
    else:
        levels = ", ".join(level.words for level in plan.levels)
    loop = "open loop" if plan.open_loop else "closed loop"
    if plan.shape == SHAPE_SPEED:
        loop = "the recorded schedule (an open loop), each speed a level"
    burst = (
        ""
        if not plan.open_loop
        else (
            " (Poisson arrivals)"
            if plan.burstiness == 1
            else f" (gamma arrivals, burstiness {plan.burstiness:g})"
        )
    )
    tokens = plan.planned_requests() * (
        workload.max_tokens + (workload.prompt_tokens if not workload.prompts else 0)
    )
    return (
        f"{loop}{burst}: {levels}",
        f"at most {plan.planned_requests()} requests and {plan.max_seconds:g} s; up to about {tokens} tokens "
        f"(prompt words + max output tokens per request)",
        workload.describe(),
    )
