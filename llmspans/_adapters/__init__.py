"""Client families, one module each, behind one small interface.

An adapter turns one family's requests, responses and streams into call-record events; it
never builds spans or metrics itself. `_instrument.ADAPTERS` lists them: a new family (the
anthropic SDK, say) is one module here and one line there.
"""

from __future__ import annotations

from typing import Any, Protocol

from llmspans._settings import Settings


class Adapter(Protocol):
    """What `instrument()` needs of a client family."""

    name: str
    """How `instrument()`'s error message names the clients it takes ("openai.OpenAI, ...")."""

    def matches(self, target: Any) -> bool:
        """Whether `target` is a client of this family."""

    def matches_class(self, cls: type) -> bool:
        """Whether `cls` is a client class of this family (for class-level instrumentation)."""

    def default_provider(self, client: Any) -> str:
        """`gen_ai.provider.name` when `instrument()` is not told one."""

    def install(self, client: Any, settings: Settings) -> None:
        """Instrument `client` in place (called only when `installed(client)` is None)."""

    def uninstall(self, client: Any) -> None:
        """Put `client` back as it was; harmless when it is not instrumented."""

    def installed(self, client: Any) -> Settings | None:
        """The settings `client` was instrumented with, or None."""


def derives_from(cls: type, libraries: tuple[str, ...], classes: tuple[str, ...]) -> bool:
    """Whether `cls` is, or derives from, one of `classes` of one of `libraries` (matched by name: an adapter
    never imports its client library to recognise it)."""
    return any(
        base.__module__.split(".")[0] in libraries and base.__name__ in classes for base in cls.__mro__
    )
