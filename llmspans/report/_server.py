"""The server's side of `first_token`: what vLLM's own `llm_request` span says about a call.

vLLM (started with `--otlp-traces-endpoint`) records one SERVER span per request, under the span
whose `traceparent` the client sent: the attempt span when the call retried, the call span itself
otherwise. Its `gen_ai.latency.*` attributes split the client's `first_token` bucket into the time
the request waited in the server's queue, the prefill, the server's front end and the network and
client, and a streamed call's `stream` into the server's decode and what the network and the client's
reading added, per release (`_vllm_split`: prefill and decode derived where the older engine lacks
them, and said so).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmspans import _names as names
from llmspans.report._model import (
    CALLS_ALL,
    CALLS_NOT_STREAMED,
    CALLS_STREAMED,
    Distribution,
    ServerSplit,
    SplitRow,
    format_seconds,
    nanoseconds_of,
)
from llmspans.report._spans import KIND_SERVER, Span
from llmspans.report._traces import Trace, bucket_nanoseconds, is_call
from llmspans.report._vllm_split import (
    NETWORK_AND_CLIENT,
    PREFILL,
    SERVER_DECODE,
    SERVER_FRONT_END,
    SERVER_QUEUE,
    split,
)
from llmspans.report._vllm_split import ServerSplit as SplitResult

CLIENT = "client"  # the row of the bucket itself, as the client measured it

# Every row the split can print, in order: (bucket, part, which calls have it, label).
_ROWS = (
    ("first_token", CLIENT, CALLS_ALL, "first_token (client)"),
    ("first_token", SERVER_QUEUE, CALLS_ALL, "server queue"),
    ("first_token", PREFILL, CALLS_ALL, "prefill"),
    ("first_token", SERVER_FRONT_END, CALLS_ALL, "server front end"),
    ("first_token", SERVER_DECODE, CALLS_NOT_STREAMED, "decode (not streamed)"),
    ("first_token", NETWORK_AND_CLIENT, CALLS_ALL, "network and client"),
    ("stream", CLIENT, CALLS_STREAMED, "stream (client)"),
    ("stream", SERVER_DECODE, CALLS_STREAMED, "server decode"),
    ("stream", NETWORK_AND_CLIENT, CALLS_STREAMED, "network and client"),
)
_DERIVED = {SERVER_FRONT_END, NETWORK_AND_CLIENT}  # by subtraction, on every release

# The stream's residual at p50 below this reads as the first token's late delivery, not clock granularity.
STREAM_RESIDUAL_NOTED = -0.001
NOTE_STREAM_RESIDUAL = (
    "the stream's network and client is below zero at p50 ({value}): the client's stream runs from its "
    "first content chunk to its last, the server's decode from the engine's first token to its last, so the "
    "residual is how much later the last token reached the client after the engine made it than the first "
    "did; below zero, the first token came late (vLLM's front end busy) and the rest caught up"
)


def is_server_span(span: Span) -> bool:
    return (
        span.name == names.VLLM_SERVER_SPAN and span.kind == KIND_SERVER
    ) or names.GEN_AI_LATENCY_TIME_IN_QUEUE in span.attributes


@dataclass
class ServerSplitter:
    """Collects, call by call, the client's buckets split by the server's span (ns), on every release:
    `_vllm_split.split` knows what each engine's span holds and derives what it lacks."""

    first_token: list[int] = field(default_factory=list)
    queue: list[int] = field(default_factory=list)
    prefill: list[int] = field(default_factory=list)
    front_end: list[int] = field(default_factory=list)
    network: list[int] = field(default_factory=list)
    other: list[int] = field(default_factory=list)
    stream: list[int] = field(default_factory=list)
    decode: list[int] = field(default_factory=list)
    stream_network: list[int] = field(default_factory=list)
    engines: set[str] = field(default_factory=set)
    notes: dict[str, None] = field(default_factory=dict)  # ordered, without repeats
    rows: dict[tuple[str, str], list[int]] = field(default_factory=dict)  # (bucket, part) -> ns per call
    derived: set[tuple[str, str]] = field(default_factory=set)  # rows derived on some call

    def add(self, trace: Trace) -> None:
        latest: dict[str, Span] = {}
        for span in trace.spans:
            if (
                span.stage is not None
                or not (span.attributes or span.kind == KIND_SERVER)
                or not is_server_span(span)
            ):
                continue  # the first two tests are cheap and rule out nearly every span
            call = trace.marked_ancestor(span)
            if call is None or not is_call(call):
                continue
            if call.span_id not in latest or span.start_ns > latest[call.span_id].start_ns:
                latest[call.span_id] = span  # the final attempt's server span
        for call_id, server in latest.items():
            call = trace.by_id[call_id]
            buckets = bucket_nanoseconds(call)
            streamed = call.attributes.get(names.GEN_AI_REQUEST_STREAM) is True
            found = split(
                server.attributes,
                {"first_token": buckets["first_token"] / 1e9, "stream": buckets["stream"] / 1e9},
                streamed=streamed,
            )
            if found is None:
                continue
            self.engines.add(found.engine)
            self.notes.update(dict.fromkeys(found.notes))
            self._add_rows(found, buckets)
            first_token = buckets["first_token"]
            queue = nanoseconds_of(found.seconds("first_token", SERVER_QUEUE) or 0.0)
            prefill = nanoseconds_of(found.seconds("first_token", PREFILL) or 0.0)
            self.first_token.append(first_token)
            self.queue.append(queue)
            self.prefill.append(prefill)
            self.front_end.append(nanoseconds_of(found.seconds("first_token", SERVER_FRONT_END) or 0.0))
            self.network.append(nanoseconds_of(found.seconds("first_token", NETWORK_AND_CLIENT) or 0.0))
            self.other.append(max(0, first_token - queue - prefill))
            decode = found.seconds("stream", SERVER_DECODE)
            if decode is not None:
                self.stream.append(buckets["stream"])
                self.decode.append(nanoseconds_of(decode))
                self.stream_network.append(nanoseconds_of(found.seconds("stream", NETWORK_AND_CLIENT) or 0.0))

    def _add_rows(self, found: SplitResult, buckets: dict[str, int]) -> None:
        for bucket, parts in (("first_token", found.first_token), ("stream", found.stream)):
            if not parts:
                continue
            self.rows.setdefault((bucket, CLIENT), []).append(buckets[bucket])
            for part in parts:
                key = (bucket, part.name)
                self.rows.setdefault(key, []).append(nanoseconds_of(part.seconds))
                if part.derived and part.name not in _DERIVED:
                    self.derived.add(key)

    def _rows(self) -> tuple[SplitRow, ...]:
        return tuple(
            SplitRow(bucket, part, label, calls, Distribution.of_nanoseconds(self.rows[(bucket, part)]),
                     derived=part in _DERIVED or (bucket, part) in self.derived)
            for bucket, part, calls, label in _ROWS
            if self.rows.get((bucket, part))
        )  # fmt: skip

    def result(self) -> ServerSplit | None:
        if not self.first_token:
            return None
        of = Distribution.of_nanoseconds
        notes = dict(self.notes)
        if self.stream_network:
            residual = of(self.stream_network).p50
            if residual < STREAM_RESIDUAL_NOTED:
                notes[NOTE_STREAM_RESIDUAL.format(value=format_seconds(residual))] = None
        return ServerSplit(
            len(self.first_token), of(self.first_token), of(self.queue), of(self.prefill), of(self.other),
            server_front_end=of(self.front_end), network_and_client=of(self.network),
            streamed_calls=len(self.stream),
            stream=of(self.stream) if self.stream else None,
            server_decode=of(self.decode) if self.decode else None,
            stream_network_and_client=of(self.stream_network) if self.stream else None,
            engines=tuple(sorted(self.engines)), notes=tuple(notes), rows=self._rows(),
        )  # fmt: skip
