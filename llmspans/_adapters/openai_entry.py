"""Where the app called the openai SDK: a call's span starts there, not where the request leaves.

The SDK builds a request inside `create()` before it reaches `client.request()` (the one place the
adapter sees every operation): it validates and transforms the arguments, which costs 0.5 to 1 ms
a call and tens of milliseconds on a process's first call. That is the app's wait too, so the
resource methods that start an LLM call stamp the instant they are entered in a context variable,
and the request wrapper starts the call's record at that instant (the time counts in
`first_token`, as the README's bucket table says).

The stamp is set on the class, once per process, for every client of the SDK: instrumented or not,
it only sets and resets a context variable (about 0.2 µs). The outermost method wins, so a helper
that calls `create()` inside (`stream()`) keeps its own, earlier stamp. A method the installed SDK
does not have is skipped: older and newer SDKs keep working, their calls starting at `request()`.
"""

from __future__ import annotations

import contextvars
import importlib
import time
from typing import Any

import wrapt

# (module, classes, methods): every operation `_openai_wire.operation_for` knows, sync and async.
# `stream()` helpers call `create()` when their block is entered, so that is where they start.
_ENTRY_POINTS = (
    ("openai.resources.chat.completions", ("Completions", "AsyncCompletions"), ("create", "parse")),
    ("openai.resources.completions", ("Completions", "AsyncCompletions"), ("create",)),
    ("openai.resources.embeddings", ("Embeddings", "AsyncEmbeddings"), ("create",)),
    ("openai.resources.responses", ("Responses", "AsyncResponses"), ("create", "parse")),
)

called_at: contextvars.ContextVar[int | None] = contextvars.ContextVar("llmspans_called_at", default=None)

_installed = False


def _stamp_sync(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if called_at.get() is not None:  # an outer entry point already stamped this call
        return wrapped(*args, **kwargs)
    token = called_at.set(time.perf_counter_ns())
    try:
        return wrapped(*args, **kwargs)
    finally:
        called_at.reset(token)


async def _stamp_async(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # Stamped when awaited: the SDK builds the request inside the coroutine, and a coroutine made
    # now and awaited later (`AsyncResponses.stream()` makes one for its block) starts at the await.
    if called_at.get() is not None:
        return await wrapped(*args, **kwargs)
    token = called_at.set(time.perf_counter_ns())
    try:
        return await wrapped(*args, **kwargs)
    finally:
        called_at.reset(token)


def install() -> None:
    """Stamp the SDK's entry points (once per process; from the caller's thread: it imports)."""
    global _installed
    if _installed:
        return
    _installed = True
    for module_name, class_names, methods in _ENTRY_POINTS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for class_name in class_names:
            cls = getattr(module, class_name, None)
            if cls is None:
                continue
            stamp = _stamp_async if class_name.startswith("Async") else _stamp_sync
            for method in methods:
                original = cls.__dict__.get(method)
                if original is None or isinstance(original, wrapt.FunctionWrapper):
                    continue
                setattr(cls, method, wrapt.FunctionWrapper(original, stamp))
