"""The server's side of `first_token`: what vLLM's own `llm_request` span says about a call.

vLLM (started with `--otlp-traces-endpoint`) records one SERVER span per request, under the span
whose `traceparent` the client sent: the attempt span when the call retried, the call span itself
otherwise. Its `gen_ai.latency.*` attributes split the client's `first_token` bucket into the time
the request waited in the server's queue, the prefill, and the rest (network, the server's front
end, the client's own work). This is the one place that reads them: a per-release split (prefill
derived where an older vLLM lacks it, front-end time, decode against network) belongs here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmspans import _names as names
from llmspans.report._model import Distribution, ServerSplit, nanoseconds_of
from llmspans.report._spans import KIND_SERVER, Span
from llmspans.report._traces import Trace, bucket_nanoseconds, is_call, number


def is_server_span(span: Span) -> bool:
    return (
        span.name == names.VLLM_SERVER_SPAN and span.kind == KIND_SERVER
    ) or names.GEN_AI_LATENCY_TIME_IN_QUEUE in span.attributes


@dataclass
class ServerSplitter:
    """Collects, call by call, the client's first_token and the server's queue and prefill (ns)."""

    first_token: list[int] = field(default_factory=list)
    queue: list[int] = field(default_factory=list)
    prefill: list[int] = field(default_factory=list)
    other: list[int] = field(default_factory=list)

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
            first_token = bucket_nanoseconds(trace.by_id[call_id])["first_token"]
            in_queue = nanoseconds_of(number(server, names.GEN_AI_LATENCY_TIME_IN_QUEUE))
            in_prefill = nanoseconds_of(number(server, names.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL))
            self.first_token.append(first_token)
            self.queue.append(in_queue)
            self.prefill.append(in_prefill)
            self.other.append(max(0, first_token - in_queue - in_prefill))

    def result(self) -> ServerSplit | None:
        if not self.first_token:
            return None
        return ServerSplit(
            len(self.first_token),
            Distribution.of_nanoseconds(self.first_token),
            Distribution.of_nanoseconds(self.queue),
            Distribution.of_nanoseconds(self.prefill),
            Distribution.of_nanoseconds(self.other),
        )
