"""Where one LLM call's `first_token` and `stream` went, from vLLM's own `llm_request` span.

Pure arithmetic for the report (no I/O, no report imports): `split()` takes the server span's
attributes and the client's buckets for the same call and returns the parts of each bucket. The
last part of each bucket is the residual (network and client), so the parts add up to the bucket
exactly.

The figures come from three clocks (docs/report.md, "The server split", has the measured figures):
the client's buckets from its monotonic clock at the moments bytes arrived; vLLM's `time_to_first_token`
and `e2e` from its front end's wall clock, from the request's arrival to the moment the front end
handled the first (last) token; its queue, prefill and decode from its engine's monotonic clock, at the
moments the engine scheduled the request and produced the tokens. first_token's residual compares the
client with the front end over an interval the client's contains (`first_token - time_to_first_token`;
for a call that did not stream `first_token - e2e`), so it is never below zero by more than the wall
clock's drift. The stream's residual compares the client's first-to-last chunk with the engine's
first-to-last token: it is the last token's delay from engine to client minus the first token's, and
goes negative when the first token reached the client late (vLLM's front end busy) and the rest
caught up.

Both of vLLM's engines are handled. From 0.11 the newer engine's span has prefill and decode, and
its queue time runs from when the engine queued the request, so the server's front end
(tokenising, chat template, hand-off) is `time_to_first_token - queue - prefill`. On 0.8.5 to
0.10.x, tracing runs the older engine: no prefill or decode attribute, and a queue time that runs
from the arrival (the front end is inside it). There prefill is derived as `time_to_first_token -
time_in_queue` and decode as `e2e - time_to_first_token`, each part says it was derived, and
`notes` say so in words the report can print.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from llmspans import _names as names

__all__ = [
    "ENGINE_NEWER",
    "ENGINE_OLDER",
    "NETWORK_AND_CLIENT",
    "PREFILL",
    "SERVER_DECODE",
    "SERVER_FRONT_END",
    "SERVER_QUEUE",
    "Part",
    "ServerSplit",
    "by_part",
    "split",
]

# Part names, in the order a bucket's parts are listed.
SERVER_QUEUE = "server_queue"
PREFILL = "prefill"
SERVER_FRONT_END = "server_front_end"
SERVER_DECODE = "server_decode"
NETWORK_AND_CLIENT = "network_and_client"

ENGINE_NEWER = "newer"  # vLLM 0.11 and later
ENGINE_OLDER = "older"  # vLLM 0.8.5 to 0.10.x started with --otlp-traces-endpoint

NOTE_PREFILL_DERIVED = (
    "prefill derived as time_to_first_token - time_in_queue: the older engine (vLLM 0.8.5 to 0.10.x "
    "with tracing) has no prefill attribute"
)
NOTE_FRONT_END_IN_QUEUE = (
    "the older engine counts time_in_queue from the request's arrival, so the server's front end "
    "(tokenising, chat template) is inside the server queue"
)
NOTE_DECODE_DERIVED = (
    "server decode derived as e2e - time_to_first_token: the older engine has no decode attribute"
)


@dataclass(frozen=True)
class Part:
    """One part of a bucket, in seconds; `derived` when computed rather than read from the span."""

    name: str
    seconds: float
    derived: bool = False


@dataclass(frozen=True)
class ServerSplit:
    """One call's buckets split with its server span.

    `first_token` lists server queue, prefill, the server's front end and network and client (for a
    call that did not stream, the server's decode too, before network and client, and the front end
    is then everything from the arrival to the last token's handling that the engine did not spend
    queueing, prefilling or decoding); `stream`
    lists the server's decode and what the network and the client's reading added, and is empty
    for a call that did not stream or a span without what decode needs. `time_in_scheduler`,
    `time_in_model_forward` and `time_in_model_execute` are the older engine's extra figures (the
    last two with `--collect-detailed-traces`), None when absent.
    """

    engine: str
    first_token: tuple[Part, ...]
    stream: tuple[Part, ...]
    notes: tuple[str, ...]
    time_in_scheduler: float | None = None
    time_in_model_forward: float | None = None
    time_in_model_execute: float | None = None

    def seconds(self, bucket: str, part: str) -> float | None:
        """The part's seconds in `first_token` or `stream`, None when that bucket has no such part."""
        for found in self.first_token if bucket == "first_token" else self.stream:
            if found.name == part:
                return found.seconds
        return None


def _seconds(attributes: Mapping[str, Any], key: str) -> float | None:
    value = attributes.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def split(server: Mapping[str, Any], buckets: Mapping[str, float], *, streamed: bool) -> ServerSplit | None:
    """Split a call's `first_token` (and `stream` when `streamed`) with its server span's attributes.

    `buckets` holds the call's `first_token` and `stream` seconds (`llmspans.bucket.*`). None when the
    span lacks `time_to_first_token` or `time_in_queue`, the two every release has.
    """
    ttft = _seconds(server, names.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN)
    queue = _seconds(server, names.GEN_AI_LATENCY_TIME_IN_QUEUE)
    if ttft is None or queue is None:
        return None
    first_token = float(buckets.get("first_token", 0.0))
    stream = float(buckets.get("stream", 0.0))
    prefill = _seconds(server, names.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL)
    decode = _seconds(server, names.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE)
    e2e = _seconds(server, names.GEN_AI_LATENCY_E2E)
    notes: list[str] = []
    if prefill is not None:
        engine = ENGINE_NEWER
        parts = [
            Part(SERVER_QUEUE, queue),
            Part(PREFILL, prefill),
            Part(SERVER_FRONT_END, ttft - queue - prefill, derived=True),
        ]
    else:
        engine = ENGINE_OLDER
        parts = [
            Part(SERVER_QUEUE, queue),
            Part(PREFILL, ttft - queue, derived=True),
            Part(SERVER_FRONT_END, 0.0, derived=True),
        ]
        notes += [NOTE_PREFILL_DERIVED, NOTE_FRONT_END_IN_QUEUE]
    decode_part: Part | None = None
    if decode is not None:
        decode_part = Part(SERVER_DECODE, decode)
    elif e2e is not None:
        decode_part = Part(SERVER_DECODE, e2e - ttft, derived=True)
        notes.append(NOTE_DECODE_DERIVED)
    stream_parts: list[Part] = []
    if not streamed and decode_part is not None:
        # The whole answer arrived at once: decode is inside first_token, and the front end's own time
        # runs to the last token's handling (e2e), which the body's arrival comes after.
        if e2e is not None and engine == ENGINE_NEWER:
            engine_time = parts[0].seconds + parts[1].seconds + decode_part.seconds
            parts[2] = Part(SERVER_FRONT_END, e2e - engine_time, derived=True)
        parts.append(decode_part)
    elif streamed and decode_part is not None:
        stream_parts = [decode_part, Part(NETWORK_AND_CLIENT, stream - decode_part.seconds, derived=True)]
    parts.append(Part(NETWORK_AND_CLIENT, first_token - sum(part.seconds for part in parts), derived=True))
    return ServerSplit(
        engine=engine,
        first_token=tuple(parts),
        stream=tuple(stream_parts),
        notes=tuple(notes),
        time_in_scheduler=_seconds(server, names.GEN_AI_LATENCY_TIME_IN_SCHEDULER),
        time_in_model_forward=_seconds(server, names.GEN_AI_LATENCY_TIME_IN_MODEL_FORWARD),
        time_in_model_execute=_seconds(server, names.GEN_AI_LATENCY_TIME_IN_MODEL_EXECUTE),
    )


def by_part(splits: Iterable[ServerSplit], bucket: str) -> dict[str, list[float]]:
    """Each part's seconds across calls, for one bucket, parts in their listed order (for quantiles)."""
    found: dict[str, list[float]] = {}
    for one in splits:
        for part in one.first_token if bucket == "first_token" else one.stream:
            found.setdefault(part.name, []).append(part.seconds)
    return found
