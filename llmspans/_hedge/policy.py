"""The public `Hedge`: when a call's backup is sent, to which client, and which calls may be sent twice."""

from __future__ import annotations

import bisect
import collections
import math
import threading
from collections.abc import Mapping
from typing import Any

from llmspans import _openai_wire
from llmspans._adapters.openai_sdk import ADAPTER
from llmspans._budget import Percentile, parse_duration

WINDOW = 200  # first-token times per model a percentile `after` is taken over
MIN_SAMPLES = 20  # fewer than this, and a percentile `after` sends no backup: p95 of 19 is their maximum
_MODELS = 64  # models with a window of their own, per Hedge


class Hedge:
    """Send a second copy of an LLM call that is slow to start, and keep whichever answers first.

    `after`: how long the first copy may go without its first content chunk (a stream) or its response
    headers (otherwise) before the second is sent: seconds (`0.15`), a duration (`"150ms"`), or a percentile
    of the model's own recent times (`"p95"`, over the last 200 calls of that model through this Hedge; no
    second copy is sent until 20 were seen). `backup`: the client that sends the second copy, another openai
    client of the same kind (sync or async; instrumented or not), or None for the same client.
    """

    __slots__ = ("_after_ns", "_lock", "_quantile", "_windows", "after", "backup", "learns")

    def __init__(self, after: float | str = "p95", backup: Any = None) -> None:
        after_s, self._quantile = _parse_after(after)
        self.learns = self._quantile is not None  # `after` is a percentile of what it observes
        self._after_ns = None if after_s is None else round(after_s * 1e9)
        _check_backup(backup)
        self.after = after
        self.backup = backup
        self._windows: dict[str, _Window] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        backup = "the same client" if self.backup is None else type(self.backup).__qualname__
        return f"Hedge(after={self.after!r}, backup={backup})"

    def after_ns(self, model: str | None) -> int | None:
        """When to send the backup of a call of `model`, in ns after the primary left; None: not yet known."""
        if self._quantile is None:
            return self._after_ns
        with self._lock:
            window = self._windows.get(model or "")
            return None if window is None else window.quantile(self._quantile)

    def observed(self, model: str | None, elapsed_ns: int) -> None:
        """A call of `model` got its first token (or headers) `elapsed_ns` after its primary left."""
        if self._quantile is None:
            return
        key = model or ""
        with self._lock:
            window = self._windows.get(key)
            if window is None:
                if len(self._windows) >= _MODELS:
                    return
                window = self._windows[key] = _Window()
            window.add(elapsed_ns)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()


def _parse_after(after: object) -> tuple[float | None, float | None]:
    """(seconds, None) or (None, quantile), or an error that says what to pass (`_budget.parse_duration`)."""
    found = parse_duration(after, what="Hedge(after=...)", percentiles=True)
    if isinstance(found, Percentile):
        return None, found.q
    return found, None


def _check_backup(backup: object) -> None:
    if backup is None or ADAPTER.matches(backup):
        return
    kind = f"{type(backup).__module__}.{type(backup).__qualname__}"
    if isinstance(backup, type):
        raise TypeError(
            f"Hedge(backup=...) takes a client, not a class: pass an instance, e.g. openai.OpenAI(...); got {kind}"
        )
    if any(base.__module__.split(".")[0] in ("httpx", "httpx2") for base in type(backup).__mro__):
        raise TypeError(
            "Hedge(backup=...) must be an openai client (openai.OpenAI or AsyncOpenAI), not a plain HTTP client: "
            f"wrap it, openai.OpenAI(base_url=..., http_client=...); got {kind}"
        )
    raise TypeError(f"Hedge(backup=...) must be an openai client or None (the same client); got {kind}")


def check(hedge: object) -> None:
    """`instrument()`'s `hedge` argument, or an error that says what to pass."""
    if hedge is not None and not isinstance(hedge, Hedge):
        raise TypeError(
            f"hedge must be an llmspans.Hedge, e.g. hedge=llmspans.Hedge(after='150ms'); got {hedge!r}"
        )


def check_client(hedge: Hedge | None, target: Any) -> None:
    """A hedge fits `target` (a client or a client class): an openai one, of its backup's kind."""
    if hedge is None:
        return
    cls = target if isinstance(target, type) else type(target)
    if not ADAPTER.matches_class(cls):
        raise TypeError(
            "hedge= needs an openai client: a plain httpx/httpx2 client hands the app the raw response bytes, "
            "which llmspans cannot take back once a copy has lost. Instrument the openai client instead: "
            "llmspans.instrument(openai.OpenAI(http_client=...), hedge=...)"
        )
    if hedge.backup is not None and is_async(cls) != is_async(type(hedge.backup)):
        kinds = ("an async", "a sync")
        raise TypeError(
            f"the hedge's backup is {kinds[not is_async(type(hedge.backup))]} client and "
            f"{cls.__qualname__} is {kinds[not is_async(cls)]} one: a backup must be of the client's kind "
            "(openai.OpenAI with openai.OpenAI, AsyncOpenAI with AsyncOpenAI)"
        )


def is_async(cls: type) -> bool:
    """Whether an openai client class is an `AsyncOpenAI`."""
    return any(base.__name__ == "AsyncOpenAI" for base in cls.__mro__)


def eligible(method: str, url: str, body: Mapping[str, Any]) -> bool:
    """Whether a call may be sent twice: it must change nothing on the server. Chat completions, completions
    and embeddings may, unless chat asks the server to store the completion (`store=True`); a Responses call
    only with `store=False` (the API stores responses unless told not to), without `background` and
    without a `conversation` (which the response is added to)."""
    kind = _kinds.get(url)
    if kind is None:
        kind = _kind_of(url)
    if kind == _NEVER or (method != "POST" and method.lower() != "post"):
        return False
    if kind == _RESPONSES:
        return body.get("store") is False and not body.get("background") and not body.get("conversation")
    return body.get("store") is not True


_NEVER, _COMPLETIONS, _RESPONSES = 0, 1, 2
_kinds: dict[str, int] = {}  # by URL path: looked at on every call of a hedged client


def _kind_of(url: str) -> int:
    kind = (
        _NEVER if _openai_wire.operation_for(url) is None
        else _RESPONSES if _openai_wire.is_responses_path(url)
        else _COMPLETIONS
    )  # fmt: skip
    if len(_kinds) >= _MODELS:
        _kinds.clear()
    _kinds[url] = kind
    return kind


class _Window:
    """The last `WINDOW` times of one model, in arrival order and sorted, for a quantile in O(1)."""

    __slots__ = ("arrived", "ordered")

    def __init__(self) -> None:
        self.arrived: collections.deque[int] = collections.deque()
        self.ordered: list[int] = []

    def add(self, value: int) -> None:
        if len(self.arrived) >= WINDOW:
            oldest = self.arrived.popleft()
            del self.ordered[bisect.bisect_left(self.ordered, oldest)]
        self.arrived.append(value)
        bisect.insort(self.ordered, value)

    def quantile(self, q: float) -> int | None:
        """Nearest rank, as the report computes percentiles; None below `MIN_SAMPLES`."""
        ordered = self.ordered
        n = len(ordered)
        if n < MIN_SAMPLES:
            return None
        return ordered[max(1, math.ceil(q * n)) - 1]
