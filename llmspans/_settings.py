"""What `instrument()` was asked for, shared by every call of one client, whatever its family.

The settings turn one request into a call record: the provider, budget, limiter, content capture,
vLLM sampler, attempt-span choice, prompt cap and hedge of the client, with the request's own model, stream
flag and sampling parameters (read by the wire format).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from llmspans import _cache, _content, _openai_wire, _telemetry
from llmspans._call import CallRecord
from llmspans._limiter import Limiter
from llmspans._prompt import PromptCap

if TYPE_CHECKING:
    from llmspans.vllm import ServerMetrics

ATTEMPT_SPANS = ("retries", "always")
_configured_attempt_spans = "retries"


def check_attempt_spans(value: object, what: str = "attempt_spans") -> str | None:
    """`"retries"` (an attempt span once a call retries), `"always"`, or None (the configured choice)."""
    for choice in ATTEMPT_SPANS:
        if value == choice:
            return choice
    if value is None:
        return None
    raise ValueError(
        f"{what} must be 'retries' (a span per attempt once a call retries) or 'always', got {value!r}"
    )


def set_configured_attempt_spans(value: str) -> None:
    """`configure(attempt_spans=...)`: the choice of every client that did not make its own."""
    global _configured_attempt_spans
    _configured_attempt_spans = value


class Sending(Protocol):
    """A lever that sends a client's calls itself, in place of the SDK's own request: a hedge
    (`_hedge.openai_glue.Hedging`, which sits above the adapters and is known to them only by this)."""

    def sender(self, client: Any, send: Callable[..., Any], limiter: Limiter | None) -> Callable[..., Any]:
        """What `client`'s adapter sends each call with; `send` is the SDK's own request, `limiter` the
        client's (a copy sent besides the call takes a slot of its own)."""


@dataclass(frozen=True)
class Settings:
    """What `instrument()` was asked for, shared by every call of one client."""

    provider: str
    budget: float | None
    capture_content: _content.CaptureSetting
    request_usage: bool
    limiter: Limiter | None = None
    server_metrics: ServerMetrics | None = None
    owns_server_metrics: bool = False
    attempt_spans: str | None = None  # None: configure()'s, else "retries"
    phase_spans: str | None = None  # None: configure()'s (`_phases`)
    prompt_cap: PromptCap | None = None
    hedge: Sending | None = None  # openai clients only (`instrument()` refuses it for a plain one)

    @property
    def acts(self) -> bool:
        """Whether a call of this client needs llmspans even when nothing records: a limiter's slot to hold,
        a prompt cap that may refuse it, a hedge that may send a copy."""
        return self.limiter is not None or self.prompt_cap is not None or self.hedge is not None

    def close(self) -> None:
        """Stop what instrument() started for this client (a sampler it made)."""
        if self.owns_server_metrics and self.server_metrics is not None:
            self.server_metrics.close()

    def new_record(
        self, operation: str, body: Mapping[str, Any], stream: bool, url: Any, called_ns: int | None = None,
        sinks: Any = _telemetry.LOOK_UP,
    ) -> CallRecord:  # fmt: skip
        """A call record for one request of this client, from its JSON body and the server's URL;
        `called_ns` is when the app called the client library, if earlier than now; `sinks` what the
        caller found to record into (`_telemetry.recording_sinks`), if it looked."""
        model = body.get("model")
        record = CallRecord(
            operation=operation,
            model=model if isinstance(model, str) else None,
            provider=self.provider,
            stream=stream,
            server_address=url.host,
            server_port=url.port or (443 if url.scheme == "https" else 80),
            budget=self.budget,
            attempt_spans_always=(self.attempt_spans or _configured_attempt_spans) == "always",
            called_ns=called_ns,
            sinks=sinks,
        )
        if record.recording:  # what the request asked for, only for a span someone will see
            record.span.set_attributes(_openai_wire.request_attributes(body))
        if self.phase_spans is not None:
            record.phase_spans = self.phase_spans
        cap = self.prompt_cap
        if cap is not None:
            cap.apply(record, body)  # raises PromptTooLarge (the call ended) for a prompt it refuses
        durations = _cache.durations
        if durations is not None:  # a cache's hits are measured against calls like this one
            record.levers += (durations,)
        sampler = self.server_metrics
        if sampler is not None:
            record.server_state = sampler
            if self.limiter is None:  # admitted at once: it goes to the server now
                record.watch_server()
        return record
