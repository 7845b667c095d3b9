"""`instrument()` and `uninstrument()`: pick the adapter for a client and install it once."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

from llmspans import _budget, _content, _phases
from llmspans._adapters import Adapter, openai_sdk, plain_http
from llmspans._limiter import Limiter
from llmspans._settings import Settings, check_attempt_spans

if TYPE_CHECKING:
    from llmspans.vllm import ServerMetrics

C = TypeVar("C")

# Every client family llmspans instruments, first match wins (an SDK client before a plain one).
ADAPTERS: tuple[Adapter, ...] = (openai_sdk.ADAPTER, plain_http.ADAPTER)
_SUPPORTED = ", ".join(adapter.name for adapter in ADAPTERS)


def adapter_for(client: Any) -> Adapter | None:
    return next((adapter for adapter in ADAPTERS if adapter.matches(client)), None)


def instrument(
    client: C,
    *,
    provider: str | None = None,
    limiter: Limiter | None = None,
    budget: float | str | None = None,
    capture_content: Any = None,
    request_usage: bool = False,
    server_metrics: bool | ServerMetrics = False,
    attempt_spans: str | None = None,
    phase_spans: str | None = None,
) -> C:
    """Instrument an LLM client in place and return it: `client = llmspans.instrument(OpenAI())`.

    `server_metrics=True` (with a vLLM server) samples the server's Prometheus `/metrics` in the
    background and stamps its queue, batch and KV-cache state on each call span at admission;
    pass an `llmspans.vllm.ServerMetrics` to share one sampler between clients.
    `attempt_spans="always"` gives every HTTP attempt a span; by default ("retries", or what
    `configure(attempt_spans=...)` chose) only the attempts of a call that retried get one.
    `phase_spans` ("slow", "always" or "never"; by default what `configure()` chose, else "slow") says
    which calls get a child span per phase (queue wait, back-off, connect, first token, stream, post).
    """
    adapter = adapter_for(client)
    if adapter is None:
        raise TypeError(
            f"llmspans.instrument() supports {_SUPPORTED}; got {type(client).__module__}.{type(client).__qualname__}"
        )
    if provider is not None and (not isinstance(provider, str) or not provider.strip()):
        raise ValueError(f"provider must be a non-empty string such as 'openai' or 'vllm', got {provider!r}")
    if limiter is not None and not isinstance(limiter, Limiter):
        raise TypeError(f"limiter must be an llmspans.Limiter, got {limiter!r}")
    if not isinstance(request_usage, bool):
        raise TypeError(f"request_usage must be True or False, got {request_usage!r}")
    if not isinstance(server_metrics, bool) and type(server_metrics).__name__ != "ServerMetrics":
        raise TypeError(
            f"server_metrics must be True, False or an llmspans.vllm.ServerMetrics, got {server_metrics!r}"
        )
    attempt_spans = check_attempt_spans(attempt_spans)
    phase_spans = _phases.check(phase_spans)
    budget_seconds = None if budget is None else _budget.parse_seconds(budget, what="budget for the LLM call")
    capture = _content.check(capture_content)
    if adapter.installed(client) is not None:
        return client
    sampler: ServerMetrics | None = None
    if server_metrics is True:
        from llmspans.vllm import ServerMetrics as Sampler

        sampler = Sampler(str(client.base_url))  # type: ignore[attr-defined]
    elif server_metrics is not False:
        sampler = server_metrics
    settings = Settings(
        provider=provider or adapter.default_provider(client),
        budget=budget_seconds,
        capture_content=capture,
        request_usage=request_usage,
        limiter=limiter,
        server_metrics=sampler,
        owns_server_metrics=server_metrics is True,
        attempt_spans=attempt_spans,
        phase_spans=phase_spans,
    )
    adapter.install(client, settings)
    return client


def uninstrument(client: C) -> C:
    """Undo `instrument()`; harmless on a client that is not instrumented."""
    adapter = adapter_for(client)
    if adapter is None:
        raise TypeError(f"llmspans.uninstrument() supports {_SUPPORTED}; got {type(client).__qualname__}")
    adapter.uninstall(client)
    return client
