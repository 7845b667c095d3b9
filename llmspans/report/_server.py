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
from llmspans.report._model import Distribution, ServerSplit, nanoseconds_of
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

    def result(self) -> ServerSplit | None:
        if not self.first_token:
            return None
        of = Distribution.of_nanoseconds
        return ServerSplit(
            len(self.first_token), of(self.first_token), of(self.queue), of(self.prefill), of(self.other),
            server_front_end=of(self.front_end), network_and_client=of(self.network),
            streamed_calls=len(self.stream),
            stream=of(self.stream) if self.stream else None,
            server_decode=of(self.decode) if self.decode else None,
            stream_network_and_client=of(self.stream_network) if self.stream else None,
            engines=tuple(sorted(self.engines)), notes=tuple(self.notes),
        )  # fmt: skip
