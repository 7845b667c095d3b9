"""`instrument()` and `uninstrument()`: pick the adapter for a client and install it once."""

from __future__ import annotations

from typing import Any, TypeVar

from llmspans import _budget, _content, _transport
from llmspans._openai import _MARK, OpenAIInstrumentation, Settings

C = TypeVar("C")
_SUPPORTED = (
    "openai.OpenAI, openai.AsyncOpenAI (and their Azure subclasses), httpx.Client, httpx.AsyncClient, "
    "httpx2.Client or httpx2.AsyncClient"
)
_PLAIN_MARK = "_llmspans_plain"


def _kind(client: Any) -> str | None:
    for cls in type(client).__mro__:
        module = cls.__module__.split(".")[0]
        if module == "openai" and cls.__name__ in ("OpenAI", "AsyncOpenAI"):
            return "openai"
        if module in ("httpx", "httpx2") and cls.__name__ in ("Client", "AsyncClient"):
            return "http"
    return None


def instrument(
    client: C,
    *,
    provider: str | None = None,
    limiter: Any = None,
    budget: float | str | None = None,
    capture_content: Any = None,
    request_usage: bool = False,
) -> C:
    """Instrument an LLM client in place and return it: `client = llmspans.instrument(OpenAI())`."""
    kind = _kind(client)
    if kind is None:
        raise TypeError(
            f"llmspans.instrument() supports {_SUPPORTED}; got {type(client).__module__}.{type(client).__qualname__}"
        )
    if provider is not None and (not isinstance(provider, str) or not provider.strip()):
        raise ValueError(f"provider must be a non-empty string such as 'openai' or 'vllm', got {provider!r}")
    if limiter is not None:
        raise TypeError(f"limiter must be None until llmspans.Limiter is available, got {limiter!r}")
    if not isinstance(request_usage, bool):
        raise TypeError(f"request_usage must be True or False, got {request_usage!r}")
    settings = Settings(
        provider=provider or "openai",
        budget=None if budget is None else _budget.parse_seconds(budget, what="budget for the LLM call"),
        capture_content=_content.check(capture_content),
        request_usage=request_usage,
    )
    if kind == "openai":
        if getattr(client, _MARK, None) is None:
            OpenAIInstrumentation(client, settings).install()
    else:
        from llmspans._httpx_client import PlainClientCalls

        if _transport.install(client, PlainClientCalls(settings)):
            setattr(client, _PLAIN_MARK, True)
    return client


def uninstrument(client: C) -> C:
    """Undo `instrument()`; harmless on a client that is not instrumented."""
    kind = _kind(client)
    if kind is None:
        raise TypeError(f"llmspans.uninstrument() supports {_SUPPORTED}; got {type(client).__qualname__}")
    if kind == "openai":
        installed = getattr(client, _MARK, None)
        if installed is not None:
            installed.uninstall()
    elif getattr(client, _PLAIN_MARK, False):
        _transport.remove(client)
        delattr(client, _PLAIN_MARK)
    return client
