"""Stages and turns: the app's own time around the model.

`@stage`, `@retrieval` and `@tool` wrap sync and async functions, generators and async
generators. The span covers the work (a generator's whole iteration), the OpenTelemetry
context is attached only while the wrapped code runs (never across a `yield`, so a
generator closed from another task cannot trip "Failed to detach context"), and the
user's exceptions pass through as the same object.

`turn()` is the root span of one interaction; stages and LLM calls inside it add their
time to its per-stage totals, so the turn names its dominant stage.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import re
import threading
import time
from collections.abc import AsyncGenerator, Callable, Generator, Mapping
from types import MappingProxyType, TracebackType
from typing import Any, TypeVar, overload

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind, Status, StatusCode
from opentelemetry.util.types import AttributeValue

from llmspans import _budget, _deferred, _guard, _held_span, _openinference, _suppress, _telemetry
from llmspans import _metrics as metric
from llmspans import _names as names
from llmspans import _sites as sites
from llmspans._budget import seconds
from llmspans._guard import check_fault, guarded, report
from llmspans._held_span import HeldSpan

F = TypeVar("F", bound=Callable[..., Any])
MISSING: Any = object()
"""No `fallback=` given. It, `check_name`, `stage_labels`, `Scope` and `StageSpec` are how another kind of
stage (a cache lookup: `_cache`) is built on this one: it subclasses the scope and the spec."""


class TurnTotals:
    """Seconds per stage name inside one turn; shared by the tasks and threads the turn spawns."""

    __slots__ = ("_lock", "totals_ns")

    def __init__(self) -> None:
        self.totals_ns: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, stage: str, elapsed_ns: int) -> None:
        with self._lock:
            self.totals_ns[stage] = self.totals_ns.get(stage, 0) + elapsed_ns


current_turn: contextvars.ContextVar[TurnTotals | None] = contextvars.ContextVar(
    "llmspans_turn", default=None
)


@functools.lru_cache(maxsize=256)
def stage_labels(stage: str) -> metric.Labels:
    """The metric attributes of a stage name, built once."""
    return metric.Labels({names.STAGE: stage})


_TURN_LABELS = stage_labels(names.STAGE_TURN)


def _record_exception(span: Any, error_type: str) -> None:
    """The exception's type only: its message may quote prompts or tool arguments."""
    span.add_event(names.EVENT_EXCEPTION, {names.EXCEPTION_TYPE: error_type})
    span.set_status(Status(StatusCode.ERROR, error_type))
    span.set_attribute(names.ERROR_TYPE, error_type)


_ENDED_CONTEXT = otel_context.Context()  # what a scope whose held span ended holds as its context


class Scope:
    """One stage execution: starts its span, and on finish writes budget, totals and metrics once.

    Its span's end (`write_span`) is written at its finish on an SDK span, and only when it is built on a
    held one (`_held_span`): for a stage in a trace tail sampling drops, never. What it is written from
    (`error_type`, `cut`, `elapsed_ns`) is set at the finish of a span that records.
    """

    __slots__ = (
        "budget", "context", "cut", "done", "elapsed_ns", "error_type", "keeps_trace", "labels", "sinks",
        "span", "stage", "started_ns", "suppressed", "turn",
    )  # fmt: skip
    error_type: str | None
    cut: bool
    elapsed_ns: int
    keeps_trace: bool

    def __init__(
        self, stage: str, span_name: str, attributes: Mapping[str, AttributeValue], budget: float | None,
        labels: metric.Labels, openinference_attributes: Mapping[str, AttributeValue],
        sinks: _telemetry.Sinks | None = None,
    ) -> None:  # fmt: skip
        if _openinference.enabled:
            attributes = openinference_attributes
        self.stage = stage
        self.labels = labels
        self.budget = _budget.registry.resolve(stage, budget)
        self.turn = current_turn.get()
        self.done = False
        outer = (
            otel_context.get_current()
        )  # looked up once: the suppress switch, the parent, the span's context
        self.suppressed = suppressed = sinks is None or _suppress.suppressed_in(outer)
        self.sinks = sinks
        self.span = (
            _suppress.NOOP_TRACER.start_span(span_name, context=outer)
            if suppressed
            else _held_span.start_span(sinks[0], span_name, outer, SpanKind.INTERNAL, attributes)  # type: ignore[index]
        )
        self.context = trace.set_span_in_context(self.span, outer)
        self.started_ns = time.perf_counter_ns()

    def finish(
        self, error: BaseException | None = None, *, cut: bool = False, at_ns: int | None = None
    ) -> None:
        if self.done:
            return
        if (
            _deferred.collecting_thread and _deferred.collecting()
        ):  # a generator closed by the collector: a finalizer (see `_deferred`)
            _deferred.defer(
                functools.partial(self.finish, error, cut=cut, at_ns=at_ns or time.perf_counter_ns())
            )
            return
        self.done = True
        elapsed_ns = (at_ns if at_ns is not None else time.perf_counter_ns()) - self.started_ns
        try:
            if _guard.faults:
                check_fault(sites.STAGE_FINISH)
            if not self.suppressed:
                self._write(elapsed_ns, error, cut)
        except Exception as failure:  # what @guarded does, without its extra frame on every call
            report(sites.STAGE_FINISH, failure)
        finally:
            span = self.span
            try:
                span.end()
            except Exception as failure:  # a span processor that raises must not reach the app
                report(sites.STAGE_SPAN_END, failure)
            if type(span) is HeldSpan:  # it holds this scope for its end: let go of it (no cycle)
                self.span = INVALID_SPAN
                self.context = _ENDED_CONTEXT

    def _write(self, elapsed_ns: int, error: BaseException | None, cut: bool) -> None:
        span = self.span
        recording = span.is_recording()
        exceeded = self.budget is not None and _budget.exceeded(self.budget, elapsed_ns)
        if recording:
            self.error_type = None if error is None else type(error).__qualname__
            self.cut = cut
            self.elapsed_ns = elapsed_ns
            if type(span) is HeldSpan:
                self.keeps_trace = error is not None or exceeded
                span.mark_facts(self)
            else:
                self.write_span(span)
        _record_stage(span, self.labels, elapsed_ns, exceeded, self.sinks[1], recording)  # type: ignore[index]
        if self.turn is not None:
            self.turn.add(self.stage, elapsed_ns)

    def compact(self) -> Scope:
        return self

    def write_span(self, span: Any) -> None:
        """The stage span's end: the exception's type, a cut, the budget (`_held_span.SpanFacts`)."""
        if self.error_type is not None:
            _record_exception(span, self.error_type)
        if self.cut:
            span.set_attribute(names.BUDGET_CUT, True)
        _budget.record_on_span(span, self.budget, self.elapsed_ns)


def _record_stage(
    span: Span,
    labels: metric.Labels,
    elapsed_ns: int,
    exceeded: bool,
    recorder: metric.Recorder | None = None,
    recording: bool | None = None,
) -> None:
    """A stage's or turn's duration (and an overrun), with the span's exemplar (a span that does not
    record gives none where exemplars come from sampled spans only)."""
    if recorder is None:
        recorder = _telemetry.recorder()
    if recording is None:
        recording = span.is_recording()
    sample = recorder.sample(span, time.time_ns()) if recording or not recorder.trace_based else None
    recorder.add_call(
        _stage_metrics(labels, exceeded), (elapsed_ns / 1e9, 1) if exceeded else (elapsed_ns / 1e9,), sample
    )


@functools.lru_cache(maxsize=512)
def _stage_metrics(labels: metric.Labels, exceeded: bool) -> metric.CallMetrics:
    """The series of a stage (and of its overrun), built once per stage name."""
    members = [(metric.STAGE_DURATION, labels)]
    if exceeded:
        members.append((metric.BUDGET_EXCEEDED, labels))
    return metric.CallMetrics(members)


_WORD = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|[0-9]+")


def _same_word(one: str, other: str) -> bool:
    """`post` and `postprocess`, `retrieve` and `retrieval`: equal, or sharing a stem of at least four
    letters that is all of the shorter word, or all but its last letter."""
    if one == other:
        return True
    shared = 0
    for left, right in zip(one, other, strict=False):
        if left != right:
            break
        shared += 1
    return shared >= 4 and shared >= min(len(one), len(other)) - 1


def stage_span_name(stage: str, qualname: str) -> str:
    """`{stage} {function}`, or just the stage when the function is named like it.

    `@stage("guardrail") def guardrail` is `guardrail`, `@retrieval def retrieve` is `retrieval`,
    `@stage("post") def postprocess` is `post`; `@stage("prompt") def build_prompt` stays
    `prompt build_prompt` (a name that says more than the stage keeps all it says). The function's full
    name stays in `code.function.name`.
    """
    function = qualname.rpartition(".")[2]
    if not function.isidentifier():
        return f"{stage} {qualname}"
    stage_words = [word.lower() for word in _WORD.findall(stage)] or [stage.lower()]
    words = [word.lower() for word in _WORD.findall(function)]
    if words and all(any(_same_word(word, repeated) for repeated in stage_words) for word in words):
        return stage
    return f"{stage} {qualname}"


class StageSpec:
    """What a decorator was asked for; builds one `Scope` (or `scope_class`) per call."""

    scope_class: type[Scope] = Scope

    def __init__(
        self,
        stage: str,
        budget: float | None,
        on_exceed: _budget.OnExceed,
        fallback: Any,
        operation: str | None = None,
        tool_name: str | None = None,
        data_source: str | None = None,
    ) -> None:
        self.stage = stage
        self.budget = budget
        self.on_exceed = on_exceed
        self.fallback = fallback
        self.operation = operation
        self.tool_name = tool_name
        self.data_source = data_source

    def naming(self, func: Callable[..., Any], qualname: str) -> tuple[str, dict[str, AttributeValue]]:
        """The span name and opening attributes of the stage's spans, fixed at decoration time."""
        attributes: dict[str, AttributeValue] = {names.STAGE: self.stage, names.CODE_FUNCTION: qualname}
        if self.operation == names.OPERATION_EXECUTE_TOOL:
            tool = self.tool_name or getattr(func, "__name__", qualname)
            span_name = f"{names.OPERATION_EXECUTE_TOOL} {tool}"
            attributes.update(
                {
                    names.GEN_AI_OPERATION_NAME: self.operation,
                    names.GEN_AI_TOOL_NAME: tool,
                    names.GEN_AI_TOOL_TYPE: "function",
                }
            )
        else:
            span_name = stage_span_name(self.stage, qualname)
            if self.operation:
                attributes[names.GEN_AI_OPERATION_NAME] = self.operation
        if self.data_source:
            attributes[names.GEN_AI_DATA_SOURCE_ID] = self.data_source
        return span_name, attributes

    def wrap(self, func: F) -> F:
        if not callable(func):
            raise TypeError(f"@{self.stage} decorates a function or method, got {func!r}")
        qualname = getattr(func, "__qualname__", getattr(func, "__name__", repr(func)))
        span_name, attributes = self.naming(func, qualname)
        if self.on_exceed == "cancel" and not inspect.iscoroutinefunction(func):
            raise ValueError(
                f"on_exceed='cancel' needs an async function (work can only be stopped at an await); "
                f"{qualname} is not one: use on_exceed='record'"
            )
        # One scope per call, from what is fixed at decoration time (a partial: no Python frame of its own).
        kind = _openinference.stage_kind(self.stage, self.operation)
        openinference_attributes = {**attributes, names.OPENINFERENCE_SPAN_KIND: kind} if kind else attributes
        scope = functools.partial(
            self.scope_class,
            self.stage,
            span_name,
            MappingProxyType(attributes),
            self.budget,
            stage_labels(self.stage),
            MappingProxyType(openinference_attributes),
        )

        if inspect.isasyncgenfunction(func):
            return functools.wraps(func)(_async_gen_wrapper(func, scope))  # type: ignore[return-value]
        if inspect.isgeneratorfunction(func):
            return functools.wraps(func)(_gen_wrapper(func, scope))  # type: ignore[return-value]
        if inspect.iscoroutinefunction(func):
            if self.on_exceed == "cancel":
                return functools.wraps(func)(_cancelling_wrapper(func, scope, self))  # type: ignore[return-value]
            return functools.wraps(func)(_async_wrapper(func, scope))  # type: ignore[return-value]
        return functools.wraps(func)(_sync_wrapper(func, scope))  # type: ignore[return-value]


def _sync_wrapper(func: Callable[..., Any], scope: Callable[..., Scope]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        sinks = _telemetry.sinks()
        if sinks is None:  # nothing listens: nothing to time
            return func(*args, **kwargs)
        current = scope(sinks)
        token = otel_context.attach(current.context)
        try:
            result = func(*args, **kwargs)
        except BaseException as error:
            otel_context.detach(token)
            current.finish(error)
            raise
        otel_context.detach(token)
        current.finish()
        return result

    return wrapper


def _async_wrapper(func: Callable[..., Any], scope: Callable[..., Scope]) -> Callable[..., Any]:
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        sinks = _telemetry.sinks()
        if sinks is None:  # nothing listens: nothing to time
            return await func(*args, **kwargs)
        current = scope(sinks)
        token = otel_context.attach(current.context)
        try:
            result = await func(*args, **kwargs)
        except BaseException as error:
            otel_context.detach(token)
            current.finish(error)
            raise
        otel_context.detach(token)
        current.finish()
        return result

    return wrapper


def _cancelling_wrapper(
    func: Callable[..., Any], scope: Callable[..., Scope], spec: StageSpec
) -> Callable[..., Any]:
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        current = scope(_telemetry.sinks())
        budget = current.budget
        token = otel_context.attach(current.context)
        try:
            task = asyncio.ensure_future(func(*args, **kwargs))
        finally:
            otel_context.detach(token)
        try:
            if budget is None:
                result = await task
            else:
                done, _ = await asyncio.wait({task}, timeout=budget)
                if not done:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                    elapsed = seconds(time.perf_counter_ns() - current.started_ns)
                    if spec.fallback is not MISSING:
                        current.finish(cut=True)
                        return spec.fallback
                    error = _budget.BudgetExceeded(spec.stage, budget, elapsed)
                    current.finish(error, cut=True)
                    raise error
                result = task.result()
        except _budget.BudgetExceeded:
            raise
        except BaseException as error:
            if not task.done():  # we were cancelled ourselves: take the work down with us
                task.cancel()
            current.finish(error)
            raise
        current.finish()
        return result

    return wrapper


def _gen_wrapper(
    func: Callable[..., Generator[Any, Any, Any]], scope: Callable[..., Scope]
) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Generator[Any, Any, Any]:
        _deferred.start_worker()  # before a collected generator can need it
        current = scope(_telemetry.sinks())
        ctx = current.context
        inner: Generator[Any, Any, Any] | None = None
        to_send: Any = None
        to_throw: BaseException | None = None
        try:
            while True:
                token = otel_context.attach(ctx)
                try:
                    if inner is None:
                        inner = func(*args, **kwargs)
                    if to_throw is not None:
                        error, to_throw = to_throw, None
                        item = inner.throw(error)
                    else:
                        item = inner.send(to_send)
                except StopIteration as stop:
                    current.finish()
                    return stop.value
                except BaseException as error:
                    current.finish(error)
                    raise
                finally:
                    otel_context.detach(token)
                try:
                    to_send = yield item
                except GeneratorExit:
                    inner.close()
                    raise
                except BaseException as error:
                    to_throw = error
        finally:
            current.finish()  # closed early (break, close(), garbage collection): the span still ends

    return wrapper


def _async_gen_wrapper(
    func: Callable[..., AsyncGenerator[Any, Any]], scope: Callable[..., Scope]
) -> Callable[..., Any]:
    async def wrapper(*args: Any, **kwargs: Any) -> AsyncGenerator[Any, Any]:
        _deferred.start_worker()  # before a collected generator can need it
        current = scope(_telemetry.sinks())
        ctx = current.context
        inner: AsyncGenerator[Any, Any] | None = None
        to_send: Any = None
        to_throw: BaseException | None = None
        try:
            while True:
                token = otel_context.attach(ctx)
                try:
                    if inner is None:
                        inner = func(*args, **kwargs)
                    if to_throw is not None:
                        error, to_throw = to_throw, None
                        item = await inner.athrow(error)
                    else:
                        item = await inner.asend(to_send)
                except StopAsyncIteration:
                    current.finish()
                    return
                except BaseException as error:
                    current.finish(error)
                    raise
                finally:
                    otel_context.detach(token)
                try:
                    to_send = yield item
                except GeneratorExit:
                    await inner.aclose()
                    raise
                except BaseException as error:
                    to_throw = error
        finally:
            current.finish()

    return wrapper


# --- public decorators ----------------------------------------------------------------------


def check_name(name: object, what: str) -> str:
    """A stage's name as given, or a TypeError that says what `what` needs."""
    if not isinstance(name, str) or not name.strip():
        raise TypeError(f"{what} needs a stage name, e.g. @llmspans.stage('rerank'); got {name!r}")
    return name


def _spec(stage: str, budget: object, on_exceed: object, fallback: Any, **extra: Any) -> StageSpec:
    seconds = None if budget is None else _budget.parse_seconds(budget, what=f"budget for {stage!r}")
    return StageSpec(stage, seconds, _budget.check_on_exceed(on_exceed), fallback, **extra)


def stage(
    name: str, *, budget: float | str | None = None, on_exceed: str = "record", fallback: Any = MISSING
) -> Callable[[F], F]:
    """Mark a function as a stage of the app: `@llmspans.stage("rerank", budget=0.1)`."""
    if callable(name) and not isinstance(name, str):
        raise TypeError("@llmspans.stage needs a name: write @llmspans.stage('rerank'), not @llmspans.stage")
    spec = _spec(check_name(name, "@llmspans.stage"), budget, on_exceed, fallback)
    return spec.wrap


@overload
def retrieval(func: F, /) -> F: ...
@overload
def retrieval(
    *, budget: float | str | None = None, on_exceed: str = "record", fallback: Any = MISSING,
    data_source: str | None = None,
) -> Callable[[F], F]: ...  # fmt: skip
def retrieval(
    func: Any = None, /, *, budget: float | str | None = None, on_exceed: str = "record", fallback: Any = MISSING,
    data_source: str | None = None,
) -> Any:  # fmt: skip
    """Mark a retrieval step (the GenAI `retrieval` operation); bare or with arguments."""
    spec = _spec(
        names.STAGE_RETRIEVAL, budget, on_exceed, fallback, operation=names.OPERATION_RETRIEVAL,
        data_source=data_source,
    )  # fmt: skip
    return spec.wrap(func) if func is not None else spec.wrap


@overload
def tool(func: F, /) -> F: ...
@overload
def tool(
    *, name: str | None = None, budget: float | str | None = None, on_exceed: str = "record",
    fallback: Any = MISSING,
) -> Callable[[F], F]: ...  # fmt: skip
def tool(
    func: Any = None, /, *, name: str | None = None, budget: float | str | None = None, on_exceed: str = "record",
    fallback: Any = MISSING,
) -> Any:  # fmt: skip
    """Mark a tool the model can call (`execute_tool {name}`); bare or with arguments."""
    if name is not None:
        check_name(name, "@llmspans.tool(name=...)")
    spec = _spec(
        names.STAGE_TOOL, budget, on_exceed, fallback, operation=names.OPERATION_EXECUTE_TOOL, tool_name=name
    )
    return spec.wrap(func) if func is not None else spec.wrap


_TURN_ATTRIBUTES = MappingProxyType({names.STAGE: names.STAGE_TURN})
_TURN_OPENINFERENCE_ATTRIBUTES = MappingProxyType(
    {names.STAGE: names.STAGE_TURN, names.OPENINFERENCE_SPAN_KIND: names.OPENINFERENCE_KIND_CHAIN}
)


class _TurnEntry:
    """One entry into a turn: its span, its totals, and (once it ends) what its span's end is written from
    (`write_span`: at its exit on an SDK span, only when it is built on a held one)."""

    __slots__ = (
        "budget", "ctx_token", "elapsed_ns", "error_type", "keeps_trace", "span", "stage_totals", "started_ns",
        "state_token", "suppressed", "totals", "totals_token",
    )  # fmt: skip
    error_type: str | None
    stage_totals: dict[str, int]
    elapsed_ns: int
    keeps_trace: bool

    def __init__(
        self,
        span: Span,
        budget: float | None,
        totals: TurnTotals,
        totals_token: contextvars.Token[TurnTotals | None],
        suppressed: bool,
    ) -> None:
        self.span = span
        self.suppressed = suppressed
        self.budget = budget
        self.totals = totals
        self.totals_token = totals_token
        self.ctx_token: Any = None
        self.state_token: Any = None
        self.started_ns = time.perf_counter_ns()

    def compact(self) -> _TurnEntry:
        return self

    def write_span(self, span: Any) -> None:
        """The turn span's end: the exception's type, the seconds per stage, the dominant stage, the budget."""
        if self.error_type is not None:
            _record_exception(span, self.error_type)
        stage_totals = self.stage_totals
        span.set_attributes(
            {names.TURN_STAGE_PREFIX + stage: seconds(ns) for stage, ns in stage_totals.items()}
        )
        if stage_totals:
            span.set_attribute(names.TURN_DOMINANT_STAGE, max(stage_totals, key=stage_totals.__getitem__))
        _budget.record_on_span(span, self.budget, self.elapsed_ns)


class turn:
    """The root span of one interaction, as a sync or async context manager or a decorator."""

    def __init__(self, name: str = "turn", *, budget: float | str | None = None) -> None:
        self.name = check_name(name, "llmspans.turn()")
        self.budget = (
            None if budget is None else _budget.parse_seconds(budget, what=f"budget for turn {name!r}")
        )
        # One turn object may be entered by several tasks or threads at once (a shared
        # decorator, a module-level turn): each entry's state lives in the entering context.
        self._state: contextvars.ContextVar[_TurnEntry | None] = contextvars.ContextVar("llmspans_turn_entry")

    def _enter(self) -> Span:
        budget = _budget.registry.resolve(names.STAGE_TURN, self.budget)
        suppressed = _suppress.suppressed()
        span = _held_span.start_span(
            _suppress.NOOP_TRACER if suppressed else _telemetry.tracer(), f"{names.STAGE_TURN} {self.name}",
            None, SpanKind.INTERNAL,
            _TURN_OPENINFERENCE_ATTRIBUTES if _openinference.enabled else _TURN_ATTRIBUTES,
        )  # fmt: skip
        totals = TurnTotals()
        entry = _TurnEntry(span, budget, totals, current_turn.set(totals), suppressed)
        entry.ctx_token = otel_context.attach(trace.set_span_in_context(span))
        entry.state_token = self._state.set(entry)
        return span

    def _exit(self, error: BaseException | None) -> None:
        entry = self._state.get(None)
        if entry is None:
            return
        self._state.reset(entry.state_token)
        otel_context.detach(entry.ctx_token)
        current_turn.reset(entry.totals_token)
        try:
            if not entry.suppressed:
                self._write(entry, time.perf_counter_ns() - entry.started_ns, error)
        finally:
            span = entry.span
            try:
                span.end()
            except Exception as failure:
                report(sites.TURN_SPAN_END, failure)
            if type(span) is HeldSpan:  # it holds the entry for its end: let go of it (no cycle)
                entry.span = INVALID_SPAN

    @guarded(sites.TURN_FINISH, None)
    def _write(self, entry: _TurnEntry, elapsed_ns: int, error: BaseException | None) -> None:
        span = entry.span
        budget = entry.budget
        exceeded = budget is not None and _budget.exceeded(budget, elapsed_ns)
        if span.is_recording():
            entry.error_type = None if error is None else type(error).__qualname__
            entry.stage_totals = dict(entry.totals.totals_ns)  # as they stand at the turn's end
            entry.elapsed_ns = elapsed_ns
            if type(span) is HeldSpan:
                entry.keeps_trace = error is not None or exceeded
                span.mark_facts(entry)
            else:
                entry.write_span(span)
        _record_stage(span, _TURN_LABELS, elapsed_ns, exceeded)

    def __enter__(self) -> Span:
        return self._enter()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._exit(exc)

    async def __aenter__(self) -> Span:
        return self._enter()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._exit(exc)

    def __call__(self, func: F) -> F:
        if not callable(func):
            raise TypeError(f"llmspans.turn() decorates a function, got {func!r}")
        name, budget = self.name, self.budget
        if inspect.iscoroutinefunction(func):

            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                async with turn(name, budget=budget):
                    return await func(*args, **kwargs)

            return functools.wraps(func)(async_wrapper)  # type: ignore[return-value]

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with turn(name, budget=budget):
                return func(*args, **kwargs)

        return functools.wraps(func)(wrapper)  # type: ignore[return-value]
