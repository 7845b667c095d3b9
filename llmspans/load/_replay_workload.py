"""What a replay sends: one request per recorded call, of the call's shape, on the recorded schedule.

Each request goes to the call's endpoint, streams as it did, carries a synthetic prompt of as many tokens
as the call's input (words of the load's vocabulary, sized by what the server counts per word:
`_replay_probe.py`) and asks for the call's output tokens as `max_tokens` (with `ignore_eos` where the
server takes it). Calls that shared a prompt prefix get synthetic prompts that share one of the same
length (`prefix_partners`): a prompt is the first words of its partner's prompt, then words of its own,
so the server's prefix cache sees what it saw when the calls were recorded. With `--prompts-from`, a call
whose content was captured is sent with it instead.

The schedule: the first call of each turn at its recorded offset divided by the speed; each later call
of a turn when the call it waited for is done, after the recorded gap divided by the speed (`schedule`).
Where the recording lacks a fact, what was assumed is one line per cause (`Assumptions`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from llmspans import _names as names
from llmspans.load._replay import RecordedCall, Recording, shown_calls
from llmspans.load._workload import ENDPOINTS, Messages, Shape, Workload, _words

# How far back a call's cached prefix is looked for among earlier calls, when neither its turn nor its
# conversation holds a call long enough: enough for a chat app's concurrent users, and a bound.
PARTNER_SEARCH = 512
CHAT, COMPLETIONS = "chat", "completions"

# The rules that say two calls shared a prefix, strongest first (docs/load-replay.md).
RULE_CACHED = "cached"  # the recorded server found the call's first N tokens in its prefix cache
RULE_CONVERSATION = "conversation"  # the same gen_ai.conversation.id: an earlier turn's prompt
RULE_TURN = "turn"  # a later call of the same turn whose prompt holds the earlier call's prompt and answer


@dataclass(frozen=True)
class ServerFacts:
    """What the target counts and takes (`_replay_probe.py`): tokens per synthetic word, the template's own
    tokens per endpoint, and whether it takes `ignore_eos` (vLLM and the llmspans simulator do)."""

    tokens_per_word: float = 1.0
    overhead: Mapping[str, float] = field(default_factory=dict)
    ignore_eos: bool = False
    measured: bool = False
    words: str = ""  # what was measured, in words

    def words_for(self, tokens: int, endpoint: str) -> int:
        """Synthetic words for a prompt of `tokens` tokens as the server counts them (at least one)."""
        return max(1, round((tokens - self.overhead.get(endpoint, 0.0)) / self.tokens_per_word))


@dataclass(frozen=True)
class ReplayRequest:
    """One request of the replay; `prefix_from` is the number of the request whose prompt this one's
    starts with (-1: none), for `prefix_words` words; `after` the request of its turn it waits for (-1)."""

    endpoint: str
    stream: bool
    words: int
    max_tokens: int
    input_tokens: int | None  # as recorded, to compare
    output_tokens: int | None
    offset_ns: int
    after: int
    gap_ns: int
    prefix_from: int
    prefix_words: int
    trace_id: str
    span_id: str
    messages: tuple[dict[str, Any], ...] | None = None  # captured content, with --prompts-from


@dataclass(frozen=True)
class ReplayWorkload(Workload):
    """A `Workload` whose request `index` is recorded call `index % len(requests)` (the runner gives each
    level indices from a multiple of that: `first_index`). The words of a synthetic prompt are drawn from the
    seed, the call and the level (`index // len(requests)`): no level finds the one before it in the server's
    prefix cache, and neither does the warm-up request (index 0, which no level sends)."""

    requests: tuple[ReplayRequest, ...] = field(default=(), repr=False)
    source: str = ""
    described: str = ""
    ignore_eos: bool = False
    span_ns: int = 0
    salt: int = 0  # the run's own (from its id): no run finds an earlier run's prompts in the server's cache

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.requests:
            raise ValueError("a replay needs at least one recorded call")

    def _request(self, index: int) -> ReplayRequest:
        return self.requests[index % len(self.requests)]

    def shape(self, index: int) -> Shape:
        request = self._request(index)
        return Shape(request.endpoint, request.stream)

    def span_attributes(self, index: int) -> Mapping[str, str] | None:
        request = self._request(index)
        return {
            names.LOAD_REPLAY_SOURCE: self.source,
            names.LOAD_REPLAY_TRACE_ID: request.trace_id,
            names.LOAD_REPLAY_SPAN_ID: request.span_id,
        }

    def prompt_words(self, number: int, count: int | None = None, epoch: int = 1) -> list[str]:
        """The first `count` words (all of them by default) of call `number`'s synthetic prompt in level
        `epoch`: its partner's first words, then its own, drawn from a generator seeded by the run's seed, the
        epoch and the call's number."""
        requests = self.requests
        wanted = requests[number].words if count is None else count
        pieces: list[tuple[int, int, int]] = []  # (request, from word, to word), last piece first
        while wanted > 0:
            request = requests[number]
            shared = min(request.prefix_words, wanted) if request.prefix_from >= 0 else 0
            if wanted > shared:
                pieces.append((number, shared, wanted))
            if not shared:
                break
            number, wanted = request.prefix_from, shared
        words: list[str] = []
        base = ((self.seed * 1_000_003 + self.salt) * 1_000_003 + epoch) * 1_000_003
        for owner, start, end in reversed(pieces):
            words += _words(random.Random(base + owner), end)[start:]
        return words

    def messages(self, index: int) -> Messages:
        request = self._request(index)
        if request.messages is not None:
            return [dict(message) for message in request.messages]
        count = len(self.requests)
        return [{"role": "user", "content": " ".join(self.prompt_words(index % count, epoch=index // count))}]

    def request(self, index: int) -> dict[str, Any]:
        request = self._request(index)
        messages = self.messages(index)
        body: dict[str, Any]
        if request.endpoint == CHAT:
            body = {"model": self.model, "messages": messages, "max_tokens": request.max_tokens}
        else:
            text = "\n".join(str(message.get("content") or "") for message in messages)
            if request.endpoint == COMPLETIONS:
                body = {"model": self.model, "prompt": text, "max_tokens": request.max_tokens}
            else:
                body = {"model": self.model, "input": text, "max_output_tokens": request.max_tokens}
        body["stream"] = request.stream
        if self.ignore_eos:
            body["extra_body"] = {"ignore_eos": True}  # the openai SDK's name for fields it does not know
        return body

    def describe(self) -> str:
        return self.described

    def rate(self, speed: float) -> float:
        """Requests per second at `speed` (over the recorded span; at least one second's worth)."""
        return len(self.requests) / max(self.span_ns / 1e9 / speed, 1.0)

    def first_index(self, issued: int) -> int:
        """A level's first request index: the first multiple of the calls' count after `issued` (the warm-up
        request is index 0, of none), so index `i` is call `i % count` on every process."""
        count = len(self.requests)
        return (-(-issued // count) + 1) * count

    def schedule(
        self, speed: float, count: int, start_ns: int, first: int
    ) -> tuple[list[tuple[int, int]], dict[int, tuple[int, int]]]:
        """The first `count` calls at `speed` from `start_ns` (`perf_counter_ns()`): each turn's first call
        `(index, due)` in time order, and each later call `index: (the index it waits for, gap in ns)`."""
        heads: list[tuple[int, int]] = []
        follows: dict[int, tuple[int, int]] = {}
        for number, request in enumerate(self.requests[:count]):
            index = first + number
            if request.after >= 0:
                follows[index] = (first + request.after, round(request.gap_ns / speed))
            else:
                heads.append((index, start_ns + round(request.offset_ns / speed)))
        return heads, follows


def deal_replay(
    heads: Sequence[tuple[int, int]], follows: Mapping[int, tuple[int, int]], workers: int
) -> list[tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int, int], ...]]]:
    """A replay level dealt to workers: turns' first calls round-robin in time order, each later call to
    the worker of its turn's first call (a turn's calls wait for one another: one process sends them)."""
    worker_of: dict[int, int] = {}
    parts: list[tuple[list[tuple[int, int]], list[tuple[int, int, int]]]] = [([], []) for _ in range(workers)]
    for number, (index, due) in enumerate(heads):
        worker_of[index] = number % workers
        parts[number % workers][0].append((index, due))
    for index in sorted(follows):
        previous, gap = follows[index]
        worker = worker_of.get(previous)
        if worker is None:  # its turn's first call is not in this level
            continue
        worker_of[index] = worker
        parts[worker][1].append((index, previous, gap))
    return [(tuple(head), tuple(follow)) for head, follow in parts]


# --- from the recording to the requests ---------------------------------------------------------------


class Assumptions:
    """Where the recording lacks a fact: per cause, the calls, and one line saying what was assumed."""

    def __init__(self) -> None:
        self._calls: dict[str, list[RecordedCall]] = {}
        self._said: dict[str, str] = {}

    def add(self, cause: str, call: RecordedCall, said: str) -> None:
        self._calls.setdefault(cause, []).append(call)
        self._said.setdefault(cause, said)

    def lines(self) -> list[str]:
        return [f"{shown_calls(calls)}: {self._said[cause]}" for cause, calls in self._calls.items()]

    def calls(self, cause: str) -> list[RecordedCall]:
        return self._calls.get(cause, [])


def prefix_partners(calls: Sequence[RecordedCall], assumed: Assumptions) -> dict[int, tuple[int, int, str]]:
    """Which earlier call each call shares a prompt prefix with, of how many tokens, by which rule.

    1. The recorded server found the call's first N tokens in its prefix cache (`cache_read.input_tokens`
       above 0): it shares N tokens with an earlier call: of its turn, else of its conversation, else the
       latest one whose prompt was as long (the partner that ran before it, which its cache held).
    2. The same conversation id: an earlier turn's whole prompt, when this one is at least as long.
    3. A later call of the same turn whose prompt is at least the earlier call's prompt and answer: it
       re-sent that conversation (an agent's loop); assumed, and said.
    Where the server found no cached tokens for any call (a server with no prefix cache, or none reported),
    rules 2 and 3 apply; where it found some for other calls, a call it found none for shares nothing.
    """
    partners: dict[int, tuple[int, int, str]] = {}
    cache_seen = any(call.cached_tokens for call in calls)
    last_of_conversation: dict[str, RecordedCall] = {}
    for call in calls:
        found = _partner(call, calls, last_of_conversation, cache_seen)
        if found is not None:
            partners[call.number] = found
            if found[2] == RULE_TURN:
                assumed.add(
                    "turn_prefix", call,
                    "each holds the prompt and answer of the call before it in its turn (its input tokens are at "
                    "least theirs): assumed to re-send that conversation, so it shares that call's prompt",
                )  # fmt: skip
        elif call.cached_tokens:
            assumed.add(
                "cached_elsewhere", call,
                "the recorded server found part of each prompt in its prefix cache, but no call before it in the "
                "replay is that long (its prefix was sent before the window): sent without a shared prefix",
            )  # fmt: skip
        elif not cache_seen:
            assumed.add(
                "no_prefix_signal", call,
                "nothing in the trace shows their prompts sharing a prefix with earlier calls' (no cached-token "
                "count above 0, no conversation id, no earlier call of their turn whose prompt they hold): sent "
                "with prompts that share none",
            )  # fmt: skip
        if call.conversation is not None:
            last_of_conversation[call.conversation] = call
    return partners


def _partner(
    call: RecordedCall, calls: Sequence[RecordedCall], last_of_conversation: Mapping[str, RecordedCall],
    cache_seen: bool,
) -> tuple[int, int, str] | None:  # fmt: skip
    if call.cached_tokens:
        wanted = call.cached_tokens
        nearby = [calls[call.after]] if call.after is not None else []
        if call.conversation in last_of_conversation:
            nearby.append(last_of_conversation[call.conversation])  # type: ignore[index]
        for other in nearby:
            if (other.input_tokens or 0) >= wanted:
                return other.number, wanted, RULE_CACHED
        for other in reversed(calls[max(0, call.number - PARTNER_SEARCH) : call.number]):
            if (other.input_tokens or 0) >= wanted:
                return other.number, wanted, RULE_CACHED
        return None
    if cache_seen or call.input_tokens is None:
        return None
    previous = last_of_conversation.get(call.conversation) if call.conversation is not None else None
    if previous is not None and previous.input_tokens and call.input_tokens >= previous.input_tokens:
        return previous.number, previous.input_tokens, RULE_CONVERSATION
    if call.after is not None:
        before = calls[call.after]
        if (
            before.input_tokens
            and before.output_tokens is not None
            and call.input_tokens >= before.input_tokens + before.output_tokens
        ):
            return before.number, before.input_tokens, RULE_TURN
    return None


@dataclass(frozen=True)
class Built:
    workload: ReplayWorkload
    assumptions: list[str]
    partners: dict[int, tuple[int, int, str]]


def build_workload(
    recording: Recording, *, model: str, facts: ServerFacts, seed: int, prompt_tokens: int, max_tokens: int,
    shared_prefixes: bool = True, endpoint: str | None = None,
    captured: Mapping[tuple[str, str], Messages] | None = None, captured_source: str | None = None, salt: int = 0,
) -> Built:  # fmt: skip
    """The replay's requests from the recorded calls. `prompt_tokens` and `max_tokens` stand in where a call's
    token counts are missing (said); `endpoint` sends every chat call there instead (`--endpoint`);
    `captured` holds the calls' captured messages by (trace id, span id) (`--prompts-from`)."""
    if endpoint is not None and endpoint not in ENDPOINTS:
        raise ValueError(f"--endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}")
    calls = recording.calls
    assumed = Assumptions()
    partners = prefix_partners(calls, assumed) if shared_prefixes else {}
    requests: list[ReplayRequest] = []
    words_of: list[int] = []
    for call in calls:
        kind = call.endpoint or CHAT
        if call.endpoint is None:
            assumed.add("endpoint", call, "the span names no operation: sent as chat completions")
        if endpoint is not None and kind == CHAT:
            kind = endpoint
        tokens = call.input_tokens
        if tokens is None:
            assumed.add(
                "input", call,
                f"no input token count (the server reported no usage): sent prompts of {prompt_tokens} words "
                "(--prompt-tokens)",
            )  # fmt: skip
            words = prompt_tokens
        else:
            words = facts.words_for(tokens, kind)
        words_of.append(words)
        prefix_from, prefix_words = -1, 0
        if call.number in partners:
            partner, shared, _ = partners[call.number]
            prefix_from = partner
            prefix_words = min(words, words_of[partner], facts.words_for(shared, kind))
        messages = None
        if captured is not None:
            found = captured.get((call.trace_id, call.span_id))
            if found is None:
                assumed.add(
                    "content", call,
                    f"no captured content in {captured_source}: sent with synthetic prompts",
                )  # fmt: skip
            else:
                messages = tuple(found)
        requests.append(
            ReplayRequest(
                endpoint=kind, stream=call.stream, words=words, max_tokens=_output(call, max_tokens, assumed),
                input_tokens=call.input_tokens, output_tokens=call.output_tokens, offset_ns=call.offset_ns,
                after=call.after if call.after is not None else -1, gap_ns=call.gap_ns, prefix_from=prefix_from,
                prefix_words=prefix_words, trace_id=call.trace_id, span_id=call.span_id, messages=messages,
            )
        )  # fmt: skip
    _recording_notes(recording, assumed)
    inputs = [request.input_tokens for request in requests if request.input_tokens is not None]
    outputs = [request.max_tokens for request in requests]
    workload = ReplayWorkload(
        model=model, endpoint=requests[0].endpoint, stream=any(request.stream for request in requests),
        max_tokens=max(1, math.ceil(sum(outputs) / len(outputs))),
        prompt_tokens=max(1, math.ceil(sum(inputs) / len(inputs))) if inputs else prompt_tokens,
        seed=seed, requests=tuple(requests), source=recording.source,
        described=_describe(recording, requests, facts, partners, seed), ignore_eos=facts.ignore_eos,
        span_ns=recording.span_ns, salt=salt,
    )  # fmt: skip
    lines = assumed.lines()
    if not facts.ignore_eos:
        lines.append(
            "the server may stop a request before its max_tokens (it takes no ignore_eos: not vLLM or the llmspans "
            "simulator as far as its /models says): the replayed output tokens are compared below"
        )
    return Built(workload, lines, partners)


def _output(call: RecordedCall, default: int, assumed: Assumptions) -> int:
    """The output tokens asked for: as recorded, else what the span shows, else `--max-tokens` (said)."""
    if call.output_tokens:
        return call.output_tokens
    if call.output_tokens == 0:
        assumed.add(
            "output_zero", call, "recorded with 0 output tokens: asked for 1 (the least a server takes)"
        )
        return 1
    if call.chunks:
        assumed.add(
            "output_chunks", call,
            "no output token count (no usage): asked for as many tokens as the content chunks they streamed "
            "(a token a chunk)",
        )  # fmt: skip
        return call.chunks
    if call.max_tokens:
        assumed.add(
            "output_max", call, "no output token count (no usage): asked for their recorded max_tokens"
        )
        return call.max_tokens
    assumed.add(
        "output_default", call, f"no output token count (no usage): asked for {default} (--max-tokens)"
    )  # fmt: skip
    return default


def _recording_notes(recording: Recording, assumed: Assumptions) -> None:
    for call in recording.calls:
        if call.failed:
            assumed.add(
                "failed", call,
                "failed when recorded: sent all the same (the load was there), asking for the output assumed "
                "above",
            )  # fmt: skip
        if call.retries:
            assumed.add(
                "retried", call,
                "were retried when recorded: sent once each (the replay's client retries as --max-retries says)",
            )  # fmt: skip
        if call.limiter is not None:
            cap = f" (cap {call.limiter_cap})" if call.limiter_cap is not None else ""
            again = f"; --limiter-cap {call.limiter_cap} puts one" if call.limiter_cap else ""
            assumed.add(
                f"limiter:{call.limiter}", call,
                f"waited for the app's limiter {call.limiter!r}{cap}, which the replay does not re-create (their "
                f"queue bucket is the app's){again} in front of the replay",
            )  # fmt: skip
        if call.weight > 1:
            assumed.add(
                "weighted", call,
                "each stands for more than one call (a tail-sampled source: llmspans.sample.weight); the replay "
                "sends the kept calls once each, a lighter load than the one recorded",
            )  # fmt: skip


def _describe(
    recording: Recording, requests: Sequence[ReplayRequest], facts: ServerFacts,
    partners: Mapping[int, tuple[int, int, str]], seed: int,
) -> str:  # fmt: skip
    kinds: dict[str, int] = {}
    for request in requests:
        key = f"{request.endpoint} {'streamed' if request.stream else 'not streamed'}"
        kinds[key] = kinds.get(key, 0) + 1
    shapes = ", ".join(f"{count} {key}" for key, count in kinds.items())
    inputs = [request.input_tokens for request in requests if request.input_tokens is not None]
    outputs = [request.max_tokens for request in requests]
    tokens = f"prompts of {_span_of(inputs)} tokens, " if inputs else ""
    shared = len(partners)
    prefixes = (
        f"{shared} sharing a prompt prefix with an earlier call" if shared else "no shared prompt prefix"
    )
    service = f", service {recording.service}" if recording.service else ""
    return (
        f"replay of {len(requests)} LLM calls recorded over {recording.span_ns / 1e9:.1f} s ({recording.described}"
        f"{service}): {shapes}; {tokens}{_span_of(outputs)} output tokens; {prefixes}; "
        f"{facts.words or 'a synthetic word taken as one token'}; seed {seed}"
    )


def _span_of(values: Sequence[int]) -> str:
    low, high = min(values), max(values)
    return str(low) if low == high else f"{low}-{high}"
