"""Stages, tools, retrieval and turns, on every kind of callable."""

from __future__ import annotations

import asyncio
import gc
import inspect
import time
from collections.abc import AsyncIterator, Callable, Iterator

import pytest

import llmspans
from llmspans import _budget
from llmspans import _names as names
from llmspans.testing import Captured
from tests.timing import retry_timing


def attrs(captured: Captured, name: str) -> dict[str, object]:
    return dict(captured.span(name).attributes or {})


def test_sync_function_span_and_metadata_are_preserved(captured: Captured) -> None:
    @llmspans.stage("rerank", budget=1)
    def rerank(docs: list[str], *, top: int = 2) -> list[str]:
        """Rerank documents."""
        return docs[:top]

    assert rerank(["a", "b", "c"]) == ["a", "b"]
    assert rerank.__name__ == "rerank"
    assert rerank.__doc__ == "Rerank documents."
    assert str(inspect.signature(rerank)) == "(docs: 'list[str]', *, top: 'int' = 2) -> 'list[str]'"
    span_attrs = attrs(captured, "rerank")  # the function is named like its stage: no repeat
    assert span_attrs[names.STAGE] == "rerank"
    assert span_attrs[names.BUDGET] == 1.0
    assert span_attrs[names.BUDGET_EXCEEDED] is False
    (point,) = captured.metric_points(names.METRIC_STAGE_DURATION)
    assert point.attributes == {names.STAGE: "rerank"}
    assert point.count == 1


async def test_async_function_keeps_iscoroutinefunction_and_nests(captured: Captured) -> None:
    @llmspans.retrieval
    async def search(query: str) -> list[str]:
        await asyncio.sleep(0.01)
        return [query]

    @llmspans.stage("answer")
    async def answer(query: str) -> list[str]:
        return await search(query)

    assert inspect.iscoroutinefunction(search)
    assert await answer("q") == ["q"]
    inner = captured.span("retrieval test_async_function_keeps_iscoroutinefunction_and_nests.<locals>.search")
    outer = captured.span("answer")
    assert inner.parent is not None
    assert inner.parent.span_id == outer.context.span_id
    assert (inner.attributes or {})[names.GEN_AI_OPERATION_NAME] == "retrieval"
    assert (inner.end_time or 0) - (inner.start_time or 0) >= 9_000_000


def test_tool_follows_the_genai_convention(captured: Captured) -> None:
    @llmspans.tool
    def get_weather(city: str) -> str:
        return "sunny"

    @llmspans.tool(name="lookup", budget="10ms")
    def other() -> int:
        time.sleep(0.02)
        return 1

    get_weather("Paris")
    other()
    weather = attrs(captured, "execute_tool get_weather")
    assert weather[names.GEN_AI_OPERATION_NAME] == "execute_tool"
    assert weather[names.GEN_AI_TOOL_NAME] == "get_weather"
    assert weather[names.GEN_AI_TOOL_TYPE] == "function"
    assert weather[names.STAGE] == "tool"
    lookup = attrs(captured, "execute_tool lookup")
    assert lookup[names.BUDGET_EXCEEDED] is True
    # The overrun is what the tool took (a 20 ms sleep: at least that, more on a busy machine) past 10 ms.
    span = captured.span("execute_tool lookup")
    took = ((span.end_time or 0) - (span.start_time or 0)) / 1e9
    assert lookup[names.BUDGET_OVERRUN] >= 0.01 - 1e-6
    assert lookup[names.BUDGET_OVERRUN] == pytest.approx(took - 0.01, abs=0.002)
    (exceeded,) = captured.metric_points(names.METRIC_BUDGET_EXCEEDED)
    assert exceeded.attributes == {names.STAGE: "tool"}


def test_exception_is_the_same_object_with_its_traceback(captured: Captured) -> None:
    @llmspans.stage("guardrail")
    def check() -> None:
        raise failure

    failure = KeyError("missing")
    with pytest.raises(KeyError) as info:
        check()
    assert info.value is failure
    frames = [entry.name for entry in info.traceback]
    assert frames[-1] == "check"
    span = captured.spans[0]
    assert span.status.status_code.name == "ERROR"
    assert (span.attributes or {})[names.ERROR_TYPE] == "KeyError"
    assert "missing" not in repr(
        [dict(e.attributes or {}) for e in span.events]
    )  # messages may hold private text


def test_methods_get_spans(captured: Captured) -> None:
    class Store:
        @llmspans.retrieval(data_source="docs-v1")
        def fetch(self, n: int) -> list[int]:
            return list(range(n))

    assert Store().fetch(3) == [0, 1, 2]
    span_attrs = attrs(captured, "retrieval test_methods_get_spans.<locals>.Store.fetch")
    assert span_attrs[names.GEN_AI_DATA_SOURCE_ID] == "docs-v1"


def test_generator_span_covers_the_whole_iteration(captured: Captured) -> None:
    @llmspans.stage("chunker")
    def chunks() -> Iterator[int]:
        for i in range(3):
            time.sleep(0.01)
            yield i

    assert inspect.isgeneratorfunction(chunks)
    iterator = chunks()
    assert captured.spans == []  # nothing runs until iteration starts
    assert list(iterator) == [0, 1, 2]
    span = captured.spans[0]
    assert (span.end_time or 0) - (span.start_time or 0) >= 30_000_000


def test_generator_abandoned_after_two_items_ends_its_span(captured: Captured) -> None:
    @llmspans.stage("chunker")
    def chunks() -> Iterator[int]:
        yield from range(10)

    for i in chunks():
        if i == 1:
            break
    gc.collect()
    assert len(captured.spans) == 1

    iterator = chunks()
    next(iterator)
    next(iterator)
    iterator.close()
    assert len(captured.spans) == 2

    iterator = chunks()
    next(iterator)
    del iterator
    gc.collect()
    assert len(captured.spans) == 3
    assert all(span.status.status_code.name == "UNSET" for span in captured.spans)


def test_generator_send_and_throw_reach_the_inner_generator(captured: Captured) -> None:
    @llmspans.stage("echo")
    def echo() -> Iterator[object]:
        received: object = None
        while True:
            try:
                received = yield received
            except ValueError:
                received = "recovered"

    gen = echo()
    next(gen)
    assert gen.send("hello") == "hello"
    assert gen.throw(ValueError()) == "recovered"
    gen.close()
    assert len(captured.spans) == 1


def test_context_is_not_left_attached_between_yields(captured: Captured) -> None:
    from opentelemetry import trace

    @llmspans.stage("producer")
    def produce() -> Iterator[int]:
        yield 1
        yield 2

    outside = trace.get_current_span()
    for _ in produce():
        assert trace.get_current_span() is outside


async def test_async_generator_break_and_aclose_end_spans(captured: Captured) -> None:
    @llmspans.stage("tokens")
    async def tokens() -> AsyncIterator[int]:
        for i in range(5):
            await asyncio.sleep(0)
            yield i

    assert inspect.isasyncgenfunction(tokens)
    assert [i async for i in tokens()] == [0, 1, 2, 3, 4]
    agen = tokens()
    async for i in agen:
        if i == 1:
            break
    await agen.aclose()
    assert len(captured.spans) == 2


async def test_async_generator_abandoned_in_another_task_ends_its_span(captured: Captured) -> None:
    @llmspans.stage("tokens")
    async def tokens() -> AsyncIterator[int]:
        for i in range(5):
            yield i

    agen = tokens()
    assert await agen.__anext__() == 0

    async def finish_elsewhere() -> None:
        await agen.aclose()

    await asyncio.create_task(finish_elsewhere())
    assert len(captured.spans) == 1


@retry_timing
async def test_cancel_on_exceed_stops_the_work_at_the_budget(captured: Captured) -> None:
    reached_end = False

    @llmspans.stage("slow_tool", budget=0.05, on_exceed="cancel")
    async def slow() -> str:
        nonlocal reached_end
        await asyncio.sleep(1)
        reached_end = True
        return "late"

    started = time.perf_counter()
    with pytest.raises(llmspans.BudgetExceeded) as info:
        await slow()
    elapsed = time.perf_counter() - started
    assert elapsed < 0.08
    assert info.value.budget == 0.05
    assert not reached_end
    span_attrs = dict(captured.spans[0].attributes or {})
    assert span_attrs[names.BUDGET_CUT] is True
    assert span_attrs[names.BUDGET_EXCEEDED] is True
    assert span_attrs[names.ERROR_TYPE] == "BudgetExceeded"


@retry_timing
async def test_cancel_on_exceed_returns_the_fallback(captured: Captured) -> None:
    @llmspans.stage("slow_tool", budget=0.05, on_exceed="cancel", fallback="cached answer")
    async def slow() -> str:
        await asyncio.sleep(1)
        return "late"

    started = time.perf_counter()
    assert await slow() == "cached answer"
    assert time.perf_counter() - started < 0.08
    span_attrs = dict(captured.spans[0].attributes or {})
    assert span_attrs[names.BUDGET_CUT] is True
    assert names.ERROR_TYPE not in span_attrs


async def test_cancel_within_budget_returns_the_result(captured: Captured) -> None:
    @llmspans.stage("quick", budget=0.5, on_exceed="cancel")
    async def quick() -> int:
        await asyncio.sleep(0.01)
        return 7

    assert await quick() == 7
    assert names.BUDGET_CUT not in dict(captured.spans[0].attributes or {})


async def test_cancelling_the_caller_cancels_the_stage(captured: Captured) -> None:
    started = asyncio.Event()

    @llmspans.stage("slow", budget=5, on_exceed="cancel")
    async def slow() -> None:
        started.set()
        await asyncio.sleep(5)

    task = asyncio.create_task(slow())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert dict(captured.spans[0].attributes or {})[names.ERROR_TYPE] == "CancelledError"


def test_configured_budgets_apply_by_stage_name(captured: Captured) -> None:
    _budget.registry.configure({"retrieval": 0.001})

    @llmspans.retrieval
    def search() -> None:
        time.sleep(0.005)

    search()
    span_attrs = dict(captured.spans[0].attributes or {})
    assert span_attrs[names.BUDGET] == 0.001
    assert span_attrs[names.BUDGET_EXCEEDED] is True
    gauge = {p.attributes[names.STAGE]: p.value for p in captured.metric_points(names.METRIC_STAGE_BUDGET)}
    assert gauge["retrieval"] == 0.001


def test_turn_totals_and_dominant_stage(captured: Captured) -> None:
    """Each stage's total is what its calls took: at least the time slept inside them, at most the time
    the caller saw them take (a busy machine stretches both, never one without the other)."""
    inside = {"retrieval": 0.0, "prompt": 0.0}
    outside = {"retrieval": 0.0, "prompt": 0.0}

    def slept(stage: str, seconds: float) -> None:
        started = time.perf_counter()
        time.sleep(seconds)
        inside[stage] += time.perf_counter() - started

    @llmspans.retrieval
    def search() -> None:
        slept("retrieval", 0.03)

    @llmspans.stage("prompt")
    def build() -> None:
        slept("prompt", 0.01)

    def timed(stage: str, work: Callable[[], None]) -> None:
        started = time.perf_counter()
        work()
        outside[stage] += time.perf_counter() - started

    with llmspans.turn("chat", budget=2.5):
        timed("retrieval", search)
        timed("prompt", build)
        timed("prompt", build)
    turn_span = captured.span("turn chat")
    turn_attrs = dict(turn_span.attributes or {})
    assert turn_attrs[names.STAGE] == "turn"
    for stage in ("retrieval", "prompt"):
        assert inside[stage] <= turn_attrs[names.TURN_STAGE_PREFIX + stage] <= outside[stage], stage
    totals = {stage: turn_attrs[names.TURN_STAGE_PREFIX + stage] for stage in ("retrieval", "prompt")}
    assert turn_attrs[names.TURN_DOMINANT_STAGE] == max(totals, key=totals.__getitem__)
    assert turn_attrs[names.BUDGET] == 2.5
    for span in captured.spans:
        if span is not turn_span:
            assert span.parent is not None
            assert span.parent.span_id == turn_span.context.span_id


async def test_async_turn_and_decorator_forms(captured: Captured) -> None:
    @llmspans.tool
    async def lookup() -> None:
        await asyncio.sleep(0.01)

    @llmspans.turn("agent")
    async def agent() -> str:
        await asyncio.gather(lookup(), lookup())
        return "done"

    assert inspect.iscoroutinefunction(agent)
    assert await agent() == "done"
    async with llmspans.turn("chat"):
        await lookup()
    agent_attrs = attrs(captured, "turn agent")
    # The turn's tool total is its two lookups' time (each at least its 10 ms sleep), as their spans say.
    agent = captured.span("turn agent")
    inside = [
        s
        for s in captured.spans_named("execute_tool lookup")
        if s.parent and s.parent.span_id == agent.context.span_id
    ]  # type: ignore[union-attr]
    assert len(inside) == 2
    took = sum((s.end_time or 0) - (s.start_time or 0) for s in inside) / 1e9
    assert agent_attrs[names.TURN_STAGE_PREFIX + "tool"] >= 0.02 - 1e-6
    assert agent_attrs[names.TURN_STAGE_PREFIX + "tool"] == pytest.approx(took, abs=0.002)
    assert attrs(captured, "turn chat")[names.TURN_DOMINANT_STAGE] == "tool"


async def test_one_turn_object_entered_by_concurrent_tasks(captured: Captured) -> None:
    shared = llmspans.turn("shared")

    @llmspans.stage("work")
    async def work(delay: float) -> None:
        await asyncio.sleep(delay)

    async def run(delay: float) -> None:
        async with shared:
            await work(delay)

    await asyncio.gather(run(0.02), run(0.01))
    turns = captured.spans_named("turn shared")
    assert len(turns) == 2
    works = captured.spans_named("work")
    assert {w.parent.span_id for w in works if w.parent} == {t.context.span_id for t in turns}


def test_turn_records_exceptions_and_reraises(captured: Captured) -> None:
    with pytest.raises(ZeroDivisionError), llmspans.turn("chat"):
        _ = 1 / 0
    assert captured.span("turn chat").status.status_code.name == "ERROR"


@pytest.mark.parametrize(
    ("make", "error", "fragment"),
    [
        (lambda: llmspans.stage(""), TypeError, "needs a stage name"),
        (lambda: llmspans.stage(123), TypeError, "needs a stage name"),  # type: ignore[arg-type]
        (lambda: llmspans.stage(lambda: None), TypeError, "needs a name"),  # type: ignore[arg-type]
        (lambda: llmspans.stage("x", budget=-3), ValueError, "budget for 'x' must be a positive number"),
        (lambda: llmspans.stage("x", budget="soon"), ValueError, "'soon'"),
        (lambda: llmspans.stage("x", on_exceed="explode"), ValueError, "on_exceed must be one of"),
        (
            lambda: llmspans.stage("x", budget=1, on_exceed="cancel")(lambda: None),
            ValueError,
            "needs an async",
        ),
        (lambda: llmspans.stage("x")(42), TypeError, "decorates a function"),
        (lambda: llmspans.turn("chat", budget=0), ValueError, "positive number"),
        (lambda: llmspans.tool(name=""), TypeError, "needs a stage name"),
    ],
)
def test_bad_arguments_raise_clear_errors(make: object, error: type[Exception], fragment: str) -> None:
    with pytest.raises(error, match=fragment):
        make()  # type: ignore[operator]


def test_works_without_any_provider_configured() -> None:
    """No capture, no configure: the global proxy provider makes non-recording spans."""

    @llmspans.stage("plain")
    def plain() -> int:
        return 1

    with llmspans.turn("chat"):
        assert plain() == 1


@pytest.mark.parametrize(
    ("stage", "qualname", "expected"),
    [
        ("guardrail", "guardrail", "guardrail"),
        ("retrieval", "retrieve", "retrieval"),
        ("post", "postprocess", "post"),
        ("post_process", "Pipeline.post_process", "post_process"),
        ("rerank", "test.<locals>.rerank", "rerank"),
        ("prompt", "build_prompt", "prompt build_prompt"),
        ("queued", "queued_at_the_fork", "queued queued_at_the_fork"),
        ("guardrail", "check", "guardrail check"),
        ("tool", "<lambda>", "tool <lambda>"),
        ("moderation", "moderate", "moderation"),
    ],
)
def test_a_function_named_like_its_stage_does_not_repeat_the_word(
    stage: str, qualname: str, expected: str
) -> None:
    from llmspans._stages import stage_span_name

    assert stage_span_name(stage, qualname) == expected


def test_the_span_name_drops_the_repeat_but_the_function_name_stays(captured: Captured) -> None:
    @llmspans.stage("guardrail")
    def guardrail() -> bool:
        return True

    guardrail()
    span = captured.span("guardrail")
    assert span.attributes[names.CODE_FUNCTION].endswith("guardrail")
