"""Class-level instrumentation: `llmspans.instrument(openai.OpenAI)` covers clients the app never builds.

Frameworks (LangChain, LlamaIndex, LiteLLM, the Agents SDK) build their openai client inside. With the
class instrumented, every client of it built from then on, subclasses included (`AzureOpenAI`), is
instrumented as it is built, with the same settings as `instrument(client, ...)`; clients that already
exist are instrumented at once. A client instrumented both ways is instrumented once, one call span per
call: the app's own `instrument(client, ...)` settings replace the class's. `uninstrument(cls)` puts `__init__` back and uninstruments the
clients the class-level instrumentation instrumented (not those the app instrumented itself).

The class's `__init__` is wrapped (wrapt), never replaced by a copy: what the SDK does in it is untouched,
and the instrumentation runs after it, guarded, so a failure leaves the client working and plain.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable
from typing import Any

import wrapt

from llmspans import _sites as sites
from llmspans._guard import check_fault, swallow

_lock = threading.Lock()


class _Patch:
    """One instrumented class: its settings, its own `__init__` (if it had one) and the clients it did."""

    def __init__(self, cls: type, options: dict[str, Any]) -> None:
        self.cls = cls
        self.options = options
        self.own_init = cls.__dict__.get("__init__")
        self.clients: weakref.WeakSet[Any] = weakref.WeakSet()


_patched: dict[type, _Patch] = {}


def is_patched(cls: type) -> bool:
    return cls in _patched


def patched_classes() -> list[type]:
    with _lock:
        return list(_patched)


def instrument_class(
    cls: type, options: dict[str, Any], instrument_one: Callable[..., Any], installed: Callable[[Any], bool]
) -> None:
    """Wrap `cls.__init__` so each new instance is instrumented with `options` (`instrument_one`, unless
    `installed` says it already is); instrument those that exist. Idempotent: a class already
    instrumented keeps its first settings."""
    with _lock:
        if cls in _patched:
            return
        patch = _Patch(cls, options)

        def instrumented_init(
            wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> Any:
            result = wrapped(*args, **kwargs)
            if instance is not None:
                with swallow(sites.CLASS_INSTRUMENT):  # the client is built; a failure leaves it plain
                    _instrument(patch, instance, instrument_one, installed)
            return result

        cls.__init__ = wrapt.FunctionWrapper(cls.__init__, instrumented_init)  # type: ignore[misc]
        _patched[cls] = patch
    for existing in _instances_of(cls):
        with swallow(sites.CLASS_INSTRUMENT):
            _instrument(patch, existing, instrument_one, installed)


def _instrument(
    patch: _Patch, client: Any, instrument_one: Callable[..., Any], installed: Callable[[Any], bool]
) -> None:
    """Instrument one client of the class, unless it already is (by the app, or by another class)."""
    check_fault(sites.CLASS_INSTRUMENT)
    if installed(client):
        return
    instrument_one(client, **patch.options)
    patch.clients.add(client)


def _instances_of(cls: type) -> list[Any]:
    """The clients of `cls` alive now: one walk of the collector's objects, once per instrumented class.

    By each object's real type, not `isinstance`: that asks every object for `__class__`, and a lazy
    proxy (the openai SDK keeps one per resource module) answers by importing what it stands for, which
    took `instrument(openai.OpenAI)` 3-9 s and 1,500 modules.
    """
    return [obj for obj in gc.get_objects() if issubclass(type(obj), cls)]


def release(client: Any) -> bool:
    """The app instruments `client` itself: it leaves the class-level instrumentation (True when it was
    under it, so the caller replaces the class's settings with the app's own)."""
    with _lock:
        patches = list(_patched.values())
    for patch in patches:
        if client in patch.clients:
            patch.clients.discard(client)
            return True
    return False


def uninstrument_class(cls: type, uninstrument_one: Callable[[Any], Any]) -> None:
    """Undo `instrument_class`; harmless on a class that is not instrumented."""
    with _lock:
        patch = _patched.pop(cls, None)
        if patch is None:
            return
        if patch.own_init is not None:
            cls.__init__ = patch.own_init  # type: ignore[misc]
        else:
            del cls.__init__  # type: ignore[misc]  # it inherited its __init__: inherit it again
    for client in list(patch.clients):
        with swallow(sites.CLASS_INSTRUMENT):
            uninstrument_one(client)
