"""Every place where llmspans catches its own failure before it reaches the app (`_guard`), by name.

Each is logged once under its name and can be made to fail on purpose (`_guard.inject_faults`):
tests/test_guard.py injects a fault at every one and checks the app is unharmed. The code names
sites only through these constants, so a misspelt site cannot escape that test (it checks this too).
"""

from __future__ import annotations

from typing import Final

CACHE_HIT: Final = "cache.hit"
CALL_ADMITTED: Final = "call.admitted"
CALL_CHUNK_METRIC: Final = "call.chunk_metric"
CALL_EXIT: Final = "call.exit"
CALL_FINISH: Final = "call.finish"
CALL_RELEASE: Final = "call.release"
CALL_SERVER_STATE: Final = "call.server_state"
CALL_SPAN_END: Final = "call.span_end"
CLASS_INSTRUMENT: Final = "class.instrument"
CONTENT_CHUNK: Final = "content.chunk"  # keeping a streamed chunk's content (capture on)
DEFERRED_WORK: Final = "deferred.work"
HEDGE_BEGIN: Final = "hedge.begin"  # deciding whether a call is hedged, and setting up its race
HEDGE_CLOSE: Final = "hedge.close"  # stopping a copy that lost, giving back its slot
HEDGE_CONNECTION: Final = "hedge.connection"  # finding a sync copy's connection, to stop it there
HEDGE_FINISH: Final = "hedge.finish"  # the hedge's attributes and metrics at the call's end
HEDGE_FIRE: Final = "hedge.fire"  # the alarm that sends a sync call's backup
HEDGE_READ: Final = "hedge.read"  # reading a copy's stream up to its first content chunk
HEDGE_SPAN: Final = "hedge.span"  # a copy's attempt span attributes, the call's hedge event
HTTPX_BEGIN: Final = "httpx.begin"
HTTPX_CONTENT: Final = "httpx.content"
LIMITER_RECORD: Final = "limiter.record"
OPENAI_BEGIN: Final = "openai.begin"
OPENAI_CONTENT: Final = "openai.content"
OPENAI_COPY: Final = "openai.copy"
OPENAI_RAW: Final = "openai.raw"
OPENAI_RESULT: Final = "openai.result"
PROMPT_COMPARE: Final = "prompt.compare"
PROMPT_ESTIMATE: Final = "prompt.estimate"
PROMPT_TOKENIZER: Final = "prompt.tokenizer"
STAGE_FINISH: Final = "stage.finish"
STAGE_SPAN_END: Final = "stage.span_end"
STREAM_CHUNK: Final = "stream.chunk"
STREAM_END: Final = "stream.end"
TAIL_SAMPLING_DECIDE: Final = "tail_sampling.decide"  # holding a span, deciding its trace, counting a cap
TAIL_SAMPLING_EXPORT: Final = "tail_sampling.export"  # handing a kept span to the wrapped processors
TRANSPORT_ATTEMPT: Final = "transport.attempt"
TRANSPORT_BEGIN: Final = "transport.begin"
TRANSPORT_CLOSE: Final = "transport.close"
TRANSPORT_EXIT: Final = "transport.exit"
TRANSPORT_FAILED: Final = "transport.failed"
TRANSPORT_GC: Final = "transport.gc"
TRANSPORT_INJECT: Final = "transport.inject"
TRANSPORT_OBSERVE: Final = "transport.observe"
TRANSPORT_OBSERVER: Final = "transport.observer"
TRANSPORT_READ_BODY: Final = "transport.read_body"
TRANSPORT_RESPONSE: Final = "transport.response"
TRANSPORT_SPAN_END: Final = "transport.span_end"
TRANSPORT_TRACE: Final = "transport.trace"
TRANSPORT_WATCHER: Final = "transport.watcher"  # telling an attempt's watcher it was answered, read or failed
TRANSPORT_WRAP_BODY: Final = "transport.wrap_body"
TURN_FINISH: Final = "turn.finish"
TURN_SPAN_END: Final = "turn.span_end"

ALL: Final = frozenset(
    {
        CACHE_HIT,
        CALL_ADMITTED,
        CALL_CHUNK_METRIC,
        CALL_EXIT,
        CALL_FINISH,
        CALL_RELEASE,
        CALL_SERVER_STATE,
        CALL_SPAN_END,
        CLASS_INSTRUMENT,
        CONTENT_CHUNK,
        DEFERRED_WORK,
        HEDGE_BEGIN,
        HEDGE_CLOSE,
        HEDGE_CONNECTION,
        HEDGE_FINISH,
        HEDGE_FIRE,
        HEDGE_READ,
        HEDGE_SPAN,
        HTTPX_BEGIN,
        HTTPX_CONTENT,
        LIMITER_RECORD,
        OPENAI_BEGIN,
        OPENAI_CONTENT,
        OPENAI_COPY,
        OPENAI_RAW,
        OPENAI_RESULT,
        PROMPT_COMPARE,
        PROMPT_ESTIMATE,
        PROMPT_TOKENIZER,
        STAGE_FINISH,
        STAGE_SPAN_END,
        STREAM_CHUNK,
        STREAM_END,
        TAIL_SAMPLING_DECIDE,
        TAIL_SAMPLING_EXPORT,
        TRANSPORT_ATTEMPT,
        TRANSPORT_BEGIN,
        TRANSPORT_CLOSE,
        TRANSPORT_EXIT,
        TRANSPORT_FAILED,
        TRANSPORT_GC,
        TRANSPORT_INJECT,
        TRANSPORT_OBSERVE,
        TRANSPORT_OBSERVER,
        TRANSPORT_READ_BODY,
        TRANSPORT_RESPONSE,
        TRANSPORT_SPAN_END,
        TRANSPORT_TRACE,
        TRANSPORT_WATCHER,
        TRANSPORT_WRAP_BODY,
        TURN_FINISH,
        TURN_SPAN_END,
    }
)
