"""`instrument()` and `uninstrument()`: pick the adapter for a client and install it once."""

from __future__ import annotations

import contextlib
import importlib
from typing import TYPE_CHECKING, Any, TypeVar

from llmspans import _budget, _classes, _content, _phases, _prompt
from llmspans._adapters import Adapter, openai_sdk, plain_http
from llmspans._hedge.openai_glue import Hedging
from llmspans._hedge.policy import Hedge, check_client
from llmspans._hedge.policy import check as check_hedge
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


def _not_a_client(target: Any, what: str) -> TypeError:
    """The error for something that is not a client: say what to pass instead, where that can be told."""
    kind = f"{type(target).__module__}.{type(target).__qualname__}"
    module = type(target).__module__.split(".")[0]
    if module == "openai" and type(target).__module__.startswith("openai.resources"):
        return TypeError(
            f"{what} takes the client, not one of its resources ({kind}): pass the openai.OpenAI (or "
            "AsyncOpenAI) client itself, e.g. llmspans.instrument(client), not client.chat.completions"
        )
    for attribute in ("root_client", "root_async_client", "client", "async_client", "_client"):
        inner = getattr(target, attribute, None) if not isinstance(target, type) else None
        if inner is not None and adapter_for(inner) is not None:
            return TypeError(
                f"{what} takes an LLM client, and {kind} is a framework object that holds one: instrument the "
                f"client class instead, llmspans.instrument(openai.OpenAI) (or llmspans.instrument_all()), "
                f'before the framework builds its client; see docs/clients.md, "Frameworks"'
            )
    return TypeError(f"{what} supports {_SUPPORTED} (a client, or one of those classes); got {kind}")


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
    max_prompt_tokens: int | None = None,
    on_exceed: str | None = None,
    prompt_tokenizer: str | None = None,
    hedge: Hedge | None = None,
) -> C:
    """Instrument an LLM client in place and return it: `client = llmspans.instrument(OpenAI())`.

    Given a client class (`llmspans.instrument(openai.OpenAI)`), every client of it built from then on,
    subclasses included, and those alive now, are instrumented with these settings: the one line for
    clients a framework builds inside. `uninstrument(openai.OpenAI)` undoes it.

    `server_metrics=True` (with a vLLM server) samples the server's Prometheus `/metrics` in the
    background and stamps its queue, batch and KV-cache state on each call span at admission;
    pass an `llmspans.vllm.ServerMetrics` to share one sampler between clients.
    `attempt_spans="always"` gives every HTTP attempt a span; by default ("retries", or what
    `configure(attempt_spans=...)` chose) only the attempts of a call that retried get one.
    `phase_spans` ("slow", "always" or "never"; by default what `configure()` chose, else "slow") says
    which calls get a child span per phase (queue wait, back-off, connect, first token, stream, post).
    `max_prompt_tokens=N` estimates each prompt's size before it is sent (with `prompt_tokenizer`: None
    for tiktoken's encoding of the OpenAI models it knows, `"hf:<name or path>"`, `"tiktoken:<encoding>"`
    or `"chars"`; characters/4 where none is available) and marks the calls over N; `on_exceed="error"`
    raises `llmspans.PromptTooLarge` for them instead, before anything is sent.
    `hedge=llmspans.Hedge(after=..., backup=...)` (openai clients only) sends a second copy of a call that has
    no first token (or, not streamed, no response headers) after `after`, keeps the first to answer and
    closes the other; only calls that change nothing on the server are ever sent twice (docs/hedging.md).
    """
    options: dict[str, Any] = {
        "provider": provider, "limiter": limiter, "budget": budget, "capture_content": capture_content,
        "request_usage": request_usage, "server_metrics": server_metrics, "attempt_spans": attempt_spans,
        "phase_spans": phase_spans, "max_prompt_tokens": max_prompt_tokens, "on_exceed": on_exceed,
        "prompt_tokenizer": prompt_tokenizer, "hedge": hedge,
    }  # fmt: skip
    if isinstance(client, type):
        if not any(adapter.matches_class(client) for adapter in ADAPTERS):
            raise _not_a_client(client, "llmspans.instrument()")
        _check(**options)
        check_client(hedge, client)
        _classes.instrument_class(client, options, instrument, _installed)
        return client
    adapter = adapter_for(client)
    if adapter is None:
        raise _not_a_client(client, "llmspans.instrument()")
    return _instrument_one(adapter, client, **options)


def _installed(client: Any) -> bool:
    adapter = adapter_for(client)
    return adapter is None or adapter.installed(client) is not None


def _check(**options: Any) -> None:
    """Check `instrument()`'s arguments before anything is changed (a class checks them once, up front)."""
    provider, limiter = options["provider"], options["limiter"]
    request_usage, server_metrics = options["request_usage"], options["server_metrics"]
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
    check_attempt_spans(options["attempt_spans"])
    _phases.check(options["phase_spans"])
    if options["budget"] is not None:
        _budget.parse_seconds(options["budget"], what="budget for the LLM call")
    _content.check(options["capture_content"])
    _prompt.check(options["max_prompt_tokens"], options["on_exceed"], options["prompt_tokenizer"])
    check_hedge(options["hedge"])


def _instrument_one(
    adapter: Adapter, client: C, *, provider: str | None, limiter: Limiter | None, budget: float | str | None,
    capture_content: Any, request_usage: bool, server_metrics: Any, attempt_spans: str | None,
    phase_spans: str | None, max_prompt_tokens: int | None, on_exceed: str | None, prompt_tokenizer: str | None,
    hedge: Hedge | None,
) -> C:  # fmt: skip
    _check(
        provider=provider, limiter=limiter, budget=budget, capture_content=capture_content,
        request_usage=request_usage, server_metrics=server_metrics, attempt_spans=attempt_spans,
        phase_spans=phase_spans, max_prompt_tokens=max_prompt_tokens, on_exceed=on_exceed,
        prompt_tokenizer=prompt_tokenizer, hedge=hedge,
    )  # fmt: skip
    check_client(hedge, client)
    attempt_spans = check_attempt_spans(attempt_spans)
    phase_spans = _phases.check(phase_spans)
    budget_seconds = None if budget is None else _budget.parse_seconds(budget, what="budget for the LLM call")
    capture = _content.check(capture_content)
    if adapter.installed(client) is not None:
        if not _classes.release(client):
            return client
        adapter.uninstall(client)  # instrumented by its class: the app's own settings take over
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
        prompt_cap=None
        if max_prompt_tokens is None
        else _prompt.PromptCap(max_prompt_tokens, on_exceed, prompt_tokenizer),
        hedge=None if hedge is None else Hedging(hedge, client),
    )
    adapter.install(client, settings)
    return client


def uninstrument(client: C) -> C:
    """Undo `instrument()`; harmless on a client (or class) that is not instrumented."""
    if isinstance(client, type):
        if not any(adapter.matches_class(client) for adapter in ADAPTERS):
            raise _not_a_client(client, "llmspans.uninstrument()")
        _classes.uninstrument_class(client, uninstrument)
        return client
    adapter = adapter_for(client)
    if adapter is None:
        raise _not_a_client(client, "llmspans.uninstrument()")
    adapter.uninstall(client)
    return client


def instrument_all(*, httpx: bool = False, **settings: Any) -> list[type]:
    """Instrument the openai SDK's client classes that can be imported (and, with `httpx=True`, the plain
    httpx/httpx2 client classes, which carry non-LLM traffic too): every client built from then on, and
    those that exist. `settings` are `instrument()`'s. Returns the classes instrumented."""
    if not isinstance(httpx, bool):
        raise TypeError(f"httpx must be True or False, got {httpx!r}")
    hedge = settings.get("hedge")
    if hedge is not None:
        check_hedge(hedge)
        if httpx or hedge.backup is not None:
            raise TypeError(
                "instrument_all(hedge=...) hedges the openai classes with the same client as backup (backup=None): "
                "a backup client is of one kind, and a plain httpx client cannot be hedged; instrument the one class "
                "instead, llmspans.instrument(openai.AsyncOpenAI, hedge=...)"
            )
    classes: list[type] = []
    wanted = [("openai", ("OpenAI", "AsyncOpenAI"))]
    if httpx:
        wanted += [("httpx", ("Client", "AsyncClient")), ("httpx2", ("Client", "AsyncClient"))]
    for module_name, class_names in wanted:
        with contextlib.suppress(ImportError):  # a library not installed: nothing of it to instrument
            module = importlib.import_module(module_name)
            for cls in (getattr(module, class_name, None) for class_name in class_names):
                if isinstance(cls, type):
                    instrument(cls, **settings)
                    classes.append(cls)
    return classes


def uninstrument_all() -> list[type]:
    """Undo class-level instrumentation of every class (`instrument_all()` and `instrument(cls)`)."""
    classes = _classes.patched_classes()
    for cls in classes:
        uninstrument(cls)
    return classes
