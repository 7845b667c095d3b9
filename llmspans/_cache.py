"""Cache lookups: a span per lookup with hit or miss, and on a hit the LLM time it saved, as an estimate.

`@llmspans.cache` marks a lookup function (a stage of kind `cache`, on sync and async functions,
generators and async generators, like `@llmspans.retrieval`): what it returns decides hit or miss
(`hit=`, by default "not None"; a generator's first item). `with llmspans.cache_lookup(name) as lookup:`
marks a block, and the block says `lookup.hit = True`. A lookup that raises is a miss with its error.

The saved time is an estimate from this process's own LLM calls (`CallDurations`): from the first cache
declared on, every call that completes hands its duration over, and a hit is worth the median of the
last 256 of them for the model the lookup names (all models when it names none). What the report makes
of it: docs/report.md.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import os
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Generator, Iterator
from types import MappingProxyType
from typing import Any, TypeVar, overload

from opentelemetry import context as otel_context
from opentelemetry.util.types import AttributeValue

from llmspans import _budget, _openinference, _telemetry
from llmspans import _metrics as metric
from llmspans import _names as names
from llmspans import _sites as sites
from llmspans._budget import seconds
from llmspans._guard import swallow
from llmspans._stages import MISSING, Scope, StageSpec, check_name, stage_labels

F = TypeVar("F", bound=Callable[..., Any])

WINDOW = 256  # calls per model (and across models) a saved-time estimate is taken over
_MODELS = 64  # models with a window of their own
_LOOKUP = otel_context.create_key("llmspans-cache-lookup")  # the lookup a decorated function runs in


class CallDurations:
    """The durations of the last `WINDOW` LLM calls that completed, per model and across models.

    A call hands its duration over as it finishes (a `_call.Lever` of each call), in whichever thread ends it; the
    lock is held for an append or a copy, never from a finalizer (a call ended by the collector is
    finished on llmspans' worker thread).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._all: deque[int] = deque(maxlen=WINDOW)
        self._by_model: dict[str, deque[int]] = {}
        self._medians: dict[str | None, int] = {}  # until the next call: hits between calls sort nothing

    def finished(self, record: Any, outcome: str, duration_ns: int) -> None:
        if outcome != names.OUTCOME_COMPLETED or record.error_type is not None:
            return  # a failed call's time is not what a hit saves
        model = record.shape.span_attributes.get(names.GEN_AI_REQUEST_MODEL)
        with self._lock:
            self._all.append(duration_ns)
            if self._medians:
                self._medians.clear()
            if isinstance(model, str):
                window = self._by_model.get(model)
                if window is None:
                    if len(self._by_model) >= _MODELS:
                        return
                    window = self._by_model[model] = deque(maxlen=WINDOW)
                window.append(duration_ns)

    def median_ns(self, model: str | None) -> int | None:
        """The nearest-rank p50 of the window for `model` (all models for None); None when it is empty."""
        with self._lock:
            median = self._medians.get(model)
            if median is not None:
                return median
            window = self._all if model is None else self._by_model.get(model)
            if not window:
                return None
            values = sorted(window)
            median = self._medians[model] = values[(len(values) + 1) // 2 - 1]
        return median

    def after_fork(self) -> None:
        self._lock = threading.Lock()


# None until a cache is declared: until then no call pays for the window (`Settings.new_record`).
durations: CallDurations | None = None
_watch_lock = threading.Lock()


def watch() -> CallDurations:
    """Start keeping call durations for the caches' estimates (idempotent)."""
    global durations
    if durations is None:
        with _watch_lock:
            if durations is None:
                durations = CallDurations()
    return durations


def stop_watching() -> None:
    """Forget the window and stop keeping one (`llmspans.testing.reset`)."""
    global durations
    durations = None


def _after_fork() -> None:
    global _watch_lock
    _watch_lock = threading.Lock()
    if durations is not None:
        durations.after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


class CacheLookup:
    """One lookup: set `hit` to True when the cache answered (a miss otherwise). `model` names the model whose
    calls a hit stands for, if not given to `cache_lookup()` already."""

    __slots__ = ("hit", "model", "name")

    def __init__(self, name: str, model: str | None = None) -> None:
        self.name = name
        self.model = model
        self.hit = False

    def __repr__(self) -> str:
        return f"CacheLookup(name={self.name!r}, model={self.model!r}, hit={self.hit!r})"


@functools.lru_cache(maxsize=512)
def _lookup_labels(cache: str, hit: bool, error_type: str | None) -> metric.Labels:
    attributes: dict[str, AttributeValue] = {names.CACHE_NAME: cache, names.CACHE_HIT: hit}
    if error_type is not None:
        attributes[names.ERROR_TYPE] = error_type
    return metric.Labels(attributes)


@functools.lru_cache(maxsize=512)
def _saved_labels(cache: str, model: str | None) -> metric.Labels:
    attributes: dict[str, AttributeValue] = {names.CACHE_NAME: cache}
    if model is not None:
        attributes[names.CACHE_MODEL] = model
    return metric.Labels(attributes)


class _LookupScope(Scope):
    """A stage scope that is also a lookup: at its end it writes hit or miss and the time a hit saved."""

    __slots__ = ("lookup",)

    def __init__(
        self, stage: str, span_name: str, attributes: Any, budget: float | None, labels: metric.Labels,
        openinference_attributes: Any, sinks: _telemetry.Sinks | None = None, lookup: CacheLookup | None = None,
    ) -> None:  # fmt: skip
        super().__init__(stage, span_name, attributes, budget, labels, openinference_attributes, sinks)
        model = attributes.get(names.CACHE_MODEL)
        self.lookup = lookup or CacheLookup(
            str(attributes[names.CACHE_NAME]), model if isinstance(model, str) else None
        )
        self.context = otel_context.set_value(_LOOKUP, self.lookup, self.context)

    def _write(self, elapsed_ns: int, error: BaseException | None, cut: bool) -> None:
        lookup = self.lookup
        hit = bool(lookup.hit) and error is None and not cut
        model = lookup.model if isinstance(lookup.model, str) and lookup.model else None
        window = durations
        saved = window.median_ns(model) if hit and window is not None else None
        span = self.span
        if span.is_recording():
            attributes: dict[str, AttributeValue] = {names.CACHE_HIT: hit}
            if model is not None:
                attributes[names.CACHE_MODEL] = model
            if saved is not None:
                attributes[names.CACHE_SAVED_ESTIMATE] = seconds(saved)
            span.set_attributes(attributes)
        records: list[metric.Record] = [
            (
                metric.CACHE_LOOKUPS,
                1,
                _lookup_labels(lookup.name, hit, None if error is None else type(error).__qualname__),
            )
        ]
        if saved is not None:
            records.append((metric.CACHE_SAVED_ESTIMATE, seconds(saved), _saved_labels(lookup.name, model)))
        recorder = _telemetry.recorder()
        recorder.add(records, recorder.sample(span, time.time_ns()))
        super()._write(elapsed_ns, error, cut)


# --- the decorator ---------------------------------------------------------------------------------------


def _judge(hit: Callable[[Any], object], value: Any) -> None:
    """Say hit or miss on the lookup the decorated function runs in, from what it returned (or yielded first)."""
    lookup = otel_context.get_value(_LOOKUP)
    if isinstance(lookup, CacheLookup):
        with swallow(sites.CACHE_HIT):  # a `hit=` that raises makes a miss, never the app's failure
            lookup.hit = bool(hit(value))


class _Watched:
    """A generator as `yield from` drives it, judging the first item it produces."""

    __slots__ = ("_generator", "_judge")

    def __init__(self, generator: Generator[Any, Any, Any], judge: Callable[[Any], None]) -> None:
        self._generator = generator
        self._judge: Callable[[Any], None] | None = judge

    def __iter__(self) -> Iterator[Any]:
        return self

    def _seen(self, item: Any) -> Any:
        judge = self._judge
        if judge is not None:
            self._judge = None
            judge(item)
        return item

    def __next__(self) -> Any:
        return self._seen(next(self._generator))

    def send(self, value: Any) -> Any:
        return self._seen(self._generator.send(value))

    def throw(self, error: BaseException) -> Any:
        return self._seen(self._generator.throw(error))

    def close(self) -> None:
        self._generator.close()


def _judged(func: Callable[..., Any], hit: Callable[[Any], object]) -> Callable[..., Any]:
    """`func`, of the same kind (so the stage wrappers treat it alike), saying hit or miss as it returns."""
    judge = functools.partial(_judge, hit)
    if inspect.isasyncgenfunction(func):

        async def judged_async_gen(*args: Any, **kwargs: Any) -> AsyncGenerator[Any, Any]:
            inner = func(*args, **kwargs)
            try:
                item = await inner.__anext__()
            except StopAsyncIteration:
                return
            judge(item)
            while True:
                try:
                    sent = yield item
                except GeneratorExit:
                    await inner.aclose()
                    raise
                except BaseException as error:
                    try:
                        item = await inner.athrow(error)
                    except StopAsyncIteration:
                        return
                    continue
                try:
                    item = await inner.asend(sent)
                except StopAsyncIteration:
                    return

        return functools.wraps(func)(judged_async_gen)
    if inspect.isgeneratorfunction(func):

        def judged_gen(*args: Any, **kwargs: Any) -> Generator[Any, Any, Any]:
            return (yield from _Watched(func(*args, **kwargs), judge))

        return functools.wraps(func)(judged_gen)
    if inspect.iscoroutinefunction(func):

        async def judged_async(*args: Any, **kwargs: Any) -> Any:
            result = await func(*args, **kwargs)
            judge(result)
            return result

        return functools.wraps(func)(judged_async)

    def judged(*args: Any, **kwargs: Any) -> Any:
        result = func(*args, **kwargs)
        judge(result)
        return result

    return functools.wraps(func)(judged)


def _found(result: Any) -> bool:
    return result is not None


class _CacheSpec(StageSpec):
    """`@llmspans.cache`: a stage of kind `cache` whose function's result says hit or miss."""

    scope_class = _LookupScope

    def __init__(
        self, name: str | None, model: str | None, hit: Callable[[Any], object], budget: float | None,
        on_exceed: _budget.OnExceed, fallback: Any,
    ) -> None:  # fmt: skip
        super().__init__(names.STAGE_CACHE, budget, on_exceed, fallback)
        self.cache_name = name
        self.model = model
        self.hit = hit

    def naming(self, func: Callable[..., Any], qualname: str) -> tuple[str, dict[str, AttributeValue]]:
        _, attributes = super().naming(func, qualname)
        name = self.cache_name or getattr(func, "__name__", None) or names.STAGE_CACHE
        attributes[names.CACHE_NAME] = name
        if self.model is not None:
            attributes[names.CACHE_MODEL] = self.model
        return f"{names.STAGE_CACHE} {name}", attributes

    def wrap(self, func: F) -> F:
        if not callable(func):
            raise TypeError(f"@llmspans.cache decorates a lookup function or method, got {func!r}")
        watch()
        return super().wrap(_judged(func, self.hit))  # type: ignore[return-value]


def _check_model(model: object, what: str) -> str | None:
    if model is not None and (not isinstance(model, str) or not model.strip()):
        raise TypeError(
            f"{what} model must be the model's name as the app asks for it, e.g. 'gpt-4o-mini'; got {model!r}"
        )
    return model


@overload
def cache(func: F, /) -> F: ...
@overload
def cache(
    name: str | None = None, /, *, model: str | None = None, hit: Callable[[Any], object] | None = None,
    budget: float | str | None = None, on_exceed: str = "record", fallback: Any = MISSING,
) -> Callable[[F], F]: ...  # fmt: skip
def cache(
    func: Any = None, /, *, model: str | None = None, hit: Callable[[Any], object] | None = None,
    budget: float | str | None = None, on_exceed: str = "record", fallback: Any = MISSING,
) -> Any:  # fmt: skip
    """Mark a cache lookup: `@llmspans.cache`, or `@llmspans.cache("semantic", model="gpt-4o-mini")`.

    The cache is named by the first argument, else after the function. What the function returns says
    hit or miss: `hit(result)` if given, else `result is not None`; a generator is judged by its first
    item (none: a miss). A hit stands for a call of `model` (any model when None) in the saved-time estimate.
    """
    name: str | None = None
    if isinstance(func, str) or func is None:
        name, func = (check_name(func, "@llmspans.cache") if func is not None else None), None
    elif not callable(func):
        raise TypeError(f"@llmspans.cache takes a cache name or decorates a function, got {func!r}")
    _check_model(model, "@llmspans.cache")
    if hit is not None and not callable(hit):
        raise TypeError(
            f"hit must be a function of the lookup's result that says whether it hit, got {hit!r}"
        )
    seconds_ = None if budget is None else _budget.parse_seconds(budget, what="budget for 'cache'")
    spec = _CacheSpec(name, model, hit or _found, seconds_, _budget.check_on_exceed(on_exceed), fallback)
    return spec.wrap(func) if func is not None else spec.wrap


# --- the context manager ---------------------------------------------------------------------------------


class cache_lookup:
    """`with llmspans.cache_lookup("semantic", model="gpt-4o-mini") as lookup: ...; lookup.hit = True`.

    A sync or async context manager; one object may be entered by several threads or tasks at once, each
    entry its own lookup. A block that raises is a miss, its exception recorded and passed on unchanged.
    """

    def __init__(self, name: str, *, model: str | None = None, budget: float | str | None = None) -> None:
        self.name = check_name(name, "llmspans.cache_lookup()")
        self.model = _check_model(model, "llmspans.cache_lookup()")
        self.budget = (
            None if budget is None else _budget.parse_seconds(budget, what=f"budget for cache {name!r}")
        )
        attributes: dict[str, AttributeValue] = {names.STAGE: names.STAGE_CACHE, names.CACHE_NAME: self.name}
        if model is not None:
            attributes[names.CACHE_MODEL] = model
        self._attributes = MappingProxyType(attributes)
        kind = _openinference.stage_kind(names.STAGE_CACHE, None)
        self._openinference_attributes = MappingProxyType({**attributes, names.OPENINFERENCE_SPAN_KIND: kind})
        # Each entry's state lives in the entering context (as a turn's): threads and tasks keep their own.
        self._state: contextvars.ContextVar[_Entry | None] = contextvars.ContextVar("llmspans_cache_lookup")
        watch()

    def _enter(self) -> CacheLookup:
        lookup = CacheLookup(self.name, self.model)
        scope = _LookupScope(
            names.STAGE_CACHE, f"{names.STAGE_CACHE} {self.name}", self._attributes, self.budget,
            stage_labels(names.STAGE_CACHE), self._openinference_attributes, _telemetry.sinks(), lookup,
        )  # fmt: skip
        context_token = otel_context.attach(scope.context)
        entry = _Entry(scope, context_token)
        entry.state_token = self._state.set(entry)
        return lookup

    def _exit(self, error: BaseException | None) -> None:
        entry = self._state.get(None)
        if entry is not None:  # else entered by another task's copy of the context: not this block's
            self._state.reset(entry.state_token)
            otel_context.detach(entry.context_token)
            entry.scope.finish(error)

    def __enter__(self) -> CacheLookup:
        return self._enter()

    def __exit__(self, *exc_info: Any) -> None:
        self._exit(exc_info[1])

    async def __aenter__(self) -> CacheLookup:
        return self._enter()

    async def __aexit__(self, *exc_info: Any) -> None:
        self._exit(exc_info[1])


class _Entry:
    __slots__ = ("context_token", "scope", "state_token")

    def __init__(self, scope: _LookupScope, context_token: Any) -> None:
        self.scope = scope
        self.context_token = context_token
        self.state_token: Any = None
