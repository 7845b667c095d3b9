"""Cache lookups (`@llmspans.cache`, `llmspans.cache_lookup`): a span per lookup with hit or miss, and on a
hit the LLM time it saved, estimated from this process's own calls to the simulated server."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import openai
import pytest

import llmspans
from llmspans import _cache
from llmspans import _names as names
from llmspans.testing import Captured
from llmspans.tools.simulator import Behavior, SimulatedServer

SERVER_BEHAVIOR = Behavior(chunks=2, usage="finish")


def lookups(captured: Captured) -> list[Any]:
    return [span for span in captured.spans if (span.attributes or {}).get(names.STAGE) == names.STAGE_CACHE]


def assert_a_failed_miss(captured: Captured, look_up: Callable[[], object], error: Exception) -> None:
    """`look_up` raises `error`: the very exception reaches the caller, and the one lookup span is a miss
    that names its type."""
    with pytest.raises(type(error)) as raised:
        look_up()
    assert raised.value is error
    (span,) = lookups(captured)
    assert span.attributes[names.CACHE_HIT] is False
    assert span.attributes[names.ERROR_TYPE] == type(error).__name__


def calls(captured: Captured) -> list[Any]:
    return [span for span in captured.spans if (span.attributes or {}).get(names.STAGE) == names.STAGE_LLM]


def hits(captured: Captured) -> list[bool]:
    return [span.attributes[names.CACHE_HIT] for span in lookups(captured)]


class Missing(Exception):
    pass


# --- the decorator, on every kind of function ------------------------------------------------------------


def test_a_sync_lookup_hits_when_it_returns_something(captured: Captured) -> None:
    store = {"known": "answer"}

    @llmspans.cache
    def answers(question: str) -> str | None:
        return store.get(question)

    assert answers("known") == "answer"
    assert answers("unknown") is None
    first, second = lookups(captured)
    assert first.name == "cache answers"
    assert first.attributes[names.CACHE_NAME] == "answers"
    assert first.attributes[names.CODE_FUNCTION].endswith("answers")
    assert hits(captured) == [True, False]
    assert names.CACHE_SAVED_ESTIMATE not in second.attributes


async def test_an_async_lookup_with_its_own_name_model_and_hit_rule(captured: Captured) -> None:
    @llmspans.cache("semantic", model="gpt-4o-mini", hit=lambda found: bool(found))
    async def nearest(question: str) -> list[str]:
        await asyncio.sleep(0)
        return ["similar"] if question == "close" else []

    assert await nearest("close") == ["similar"]
    assert await nearest("far") == []
    first, _ = lookups(captured)
    assert first.name == "cache semantic"
    assert first.attributes[names.CACHE_MODEL] == "gpt-4o-mini"
    assert hits(captured) == [True, False]


def test_a_generator_lookup_is_judged_by_its_first_item_and_keeps_send_and_close(captured: Captured) -> None:
    closed = []

    @llmspans.cache("replay")
    def replay(chunks: list[str]) -> Iterator[str]:
        try:
            for chunk in chunks:
                received = yield chunk
                if received is not None:
                    yield f"got {received}"
        finally:
            closed.append(True)

    assert list(replay(["a", "b"])) == ["a", "b"]
    assert list(replay([])) == []
    stream = replay(["x", "y", "z"])
    assert next(stream) == "x"
    assert stream.send("hello") == "got hello"
    stream.close()
    assert hits(captured) == [True, False, True]
    assert closed == [True, True, True]


async def test_an_async_generator_lookup_is_judged_by_its_first_item(captured: Captured) -> None:
    @llmspans.cache("replay", hit=lambda first: first != "")
    async def replay(chunks: list[str]) -> AsyncIterator[str]:
        for chunk in chunks:
            yield chunk

    assert [chunk async for chunk in replay(["a", "b"])] == ["a", "b"]
    assert [chunk async for chunk in replay([])] == []
    assert [chunk async for chunk in replay(["", "b"])] == ["", "b"]
    stream = replay(["x", "y"])
    assert await stream.__anext__() == "x"
    await stream.aclose()
    assert hits(captured) == [True, False, False, True]


def test_a_lookup_that_raises_is_a_miss_with_its_error_and_the_error_reaches_the_app(
    captured: Captured,
) -> None:
    error = Missing("backend down")

    @llmspans.cache("semantic")
    def broken() -> str:
        raise error

    assert_a_failed_miss(captured, broken, error)
    (point,) = captured.metric_points(names.METRIC_CACHE_LOOKUPS)
    assert dict(point.attributes) == {
        names.CACHE_NAME: "semantic",
        names.CACHE_HIT: False,
        names.ERROR_TYPE: "Missing",
    }


def test_a_hit_rule_that_raises_makes_a_miss_logged_once_never_the_apps_failure(
    captured: Captured, caplog: pytest.LogCaptureFixture
) -> None:
    @llmspans.cache("strict", hit=lambda found: found["missing key"])
    def lookup() -> dict[str, str]:
        return {"value": "x"}

    with caplog.at_level(logging.WARNING, logger="llmspans"):
        assert lookup() == {"value": "x"}
        assert lookup() == {"value": "x"}
    assert hits(captured) == [False, False]
    assert len([r for r in caplog.records if "cache.hit" in r.getMessage()]) == 1


async def test_a_lookup_cut_at_its_budget_returns_the_fallback_as_a_miss(captured: Captured) -> None:
    @llmspans.cache("slow", budget="20ms", on_exceed="cancel", fallback=None)
    async def slow() -> str:
        await asyncio.sleep(5)
        return "late"

    assert await slow() is None
    (span,) = lookups(captured)
    assert span.attributes[names.CACHE_HIT] is False
    assert span.attributes[names.BUDGET_CUT] is True


@pytest.mark.parametrize(
    ("arguments", "error"),
    [((42,), TypeError), (("",), TypeError), ((), None)],
)
def test_the_decorator_takes_a_name_or_a_function(arguments: tuple[Any, ...], error: type | None) -> None:
    if error is not None:
        with pytest.raises(error, match="cache"):
            llmspans.cache(*arguments)
    else:
        assert callable(llmspans.cache(*arguments))
    with pytest.raises(TypeError, match="model"):
        llmspans.cache("x", model="")
    with pytest.raises(TypeError, match="hit must be"):
        llmspans.cache("x", hit="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="decorates"):
        llmspans.cache("x")(42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="budget"):
        llmspans.cache("x", budget=-1)


# --- the context manager --------------------------------------------------------------------------------


def test_a_block_says_hit_and_is_a_miss_unless_it_does(captured: Captured) -> None:
    with llmspans.cache_lookup("semantic", model="gpt-4o-mini") as lookup:
        lookup.hit = True
    with llmspans.cache_lookup("semantic"):
        pass
    with llmspans.cache_lookup("semantic") as lookup:
        lookup.model = "late-model"  # the model a hit stands for, known once the entry was found
        lookup.hit = True
    first, second, third = lookups(captured)
    assert first.name == "cache semantic"
    assert hits(captured) == [True, False, True]
    assert first.attributes[names.CACHE_MODEL] == "gpt-4o-mini"
    assert names.CACHE_MODEL not in second.attributes
    assert third.attributes[names.CACHE_MODEL] == "late-model"


async def test_one_lookup_object_entered_by_several_tasks_at_once_makes_one_span_each(
    captured: Captured,
) -> None:
    semantic = llmspans.cache_lookup("semantic")
    started = asyncio.Event()

    async def look(hit: bool) -> None:
        async with semantic as lookup:
            await started.wait()
            lookup.hit = hit

    tasks = [asyncio.create_task(look(index % 2 == 0)) for index in range(4)]
    await asyncio.sleep(0)
    started.set()
    await asyncio.gather(*tasks)
    assert sorted(hits(captured)) == [False, False, True, True]
    assert len({span.context.span_id for span in lookups(captured)}) == 4


def test_a_block_that_raises_is_a_miss_and_the_exception_passes_unchanged(captured: Captured) -> None:
    error = KeyError("vector store")

    def look_up() -> None:
        with llmspans.cache_lookup("semantic") as lookup:
            lookup.hit = True  # set before the failure: a lookup that failed did not answer
            raise error

    assert_a_failed_miss(captured, look_up, error)


def test_spans_inside_a_lookup_are_its_children_and_a_turn_counts_its_time(captured: Captured) -> None:
    @llmspans.stage("embed")
    def embed() -> list[float]:
        return [0.0]

    with llmspans.turn("chat"), llmspans.cache_lookup("semantic") as lookup:
        embed()
        lookup.hit = True
    (lookup_span,) = lookups(captured)
    (embed_span,) = [span for span in captured.spans if span.name == "embed"]
    (turn,) = [span for span in captured.spans if span.name == "turn chat"]
    assert embed_span.parent.span_id == lookup_span.context.span_id
    assert lookup_span.parent.span_id == turn.context.span_id
    assert turn.attributes[names.TURN_STAGE_PREFIX + names.STAGE_CACHE] > 0


@pytest.mark.parametrize(
    ("arguments", "error", "says"),
    [(("",), TypeError, "needs a stage name"), ((3,), TypeError, "needs a stage name")],
)
def test_bad_lookup_arguments_say_what_to_pass(arguments: tuple[Any, ...], error: type, says: str) -> None:
    with pytest.raises(error, match=says):
        llmspans.cache_lookup(*arguments)
    with pytest.raises(TypeError, match="gpt-4o-mini"):
        llmspans.cache_lookup("semantic", model=3)  # type: ignore[arg-type]


# --- the time a hit saved ------------------------------------------------------------------------------


def ask(client: openai.OpenAI, model: str, delay: float, **behavior: Any) -> None:
    client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "q"}],
        extra_body={"x_sim": {"header_delay": delay, **behavior}},
    )  # fmt: skip


def nearest_rank_p50(durations_ns: list[int]) -> float:
    ordered = sorted(durations_ns)
    return ordered[(len(ordered) + 1) // 2 - 1] / 1e9


def test_a_hit_saves_the_p50_of_this_processs_calls_of_its_model(
    server: SimulatedServer, captured: Captured
) -> None:
    """Calls of a slow and a fast model, with the server's known delays; the estimate is the nearest-rank
    p50 of the call spans' own durations (a call made before any cache was declared is not in it, nor a
    failed one)."""
    client = llmspans.instrument(openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0))
    ask(client, "slow", 0.01)  # before the first cache: no window yet
    semantic = llmspans.cache_lookup("semantic")
    for _ in range(5):
        ask(client, "slow", 0.12)
        ask(client, "fast", 0.02)
    with pytest.raises(openai.InternalServerError):
        ask(client, "slow", 0.0, status=503)

    for model in ("slow", "fast", None, "never-called"):
        with semantic as lookup:
            lookup.model = model
            lookup.hit = True
    with semantic:
        pass  # a miss: no estimate

    durations = {model: [span.end_time - span.start_time for span in calls(captured)[1:11]
                         if span.attributes[names.GEN_AI_REQUEST_MODEL] == model] for model in ("slow", "fast")}  # fmt: skip
    slow, fast, either, never, miss = lookups(captured)
    assert slow.attributes[names.CACHE_SAVED_ESTIMATE] == nearest_rank_p50(durations["slow"])
    assert fast.attributes[names.CACHE_SAVED_ESTIMATE] == nearest_rank_p50(durations["fast"])
    assert either.attributes[names.CACHE_SAVED_ESTIMATE] == nearest_rank_p50(
        durations["slow"] + durations["fast"]
    )
    assert slow.attributes[names.CACHE_SAVED_ESTIMATE] >= 0.12  # the server's own delay bounds it below
    assert names.CACHE_SAVED_ESTIMATE not in never.attributes
    assert names.CACHE_SAVED_ESTIMATE not in miss.attributes

    saved = captured.metric_points(names.METRIC_CACHE_SAVED_ESTIMATE)
    assert sum(point.count for point in saved) == 3
    assert sum(point.sum for point in saved) == pytest.approx(
        sum(span.attributes[names.CACHE_SAVED_ESTIMATE] for span in (slow, fast, either)), abs=1e-9
    )
    counted = {(p.attributes[names.CACHE_NAME], p.attributes[names.CACHE_HIT]): p.value
               for p in captured.metric_points(names.METRIC_CACHE_LOOKUPS)}  # fmt: skip
    assert counted == {("semantic", True): 4, ("semantic", False): 1}


def test_a_capped_call_counts_in_the_window_too(server: SimulatedServer, captured: Captured) -> None:
    client = llmspans.instrument(
        openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0), max_prompt_tokens=1000
    )
    with llmspans.cache_lookup("semantic"):
        pass
    ask(client, "capped", 0.05)
    with llmspans.cache_lookup("semantic", model="capped") as lookup:
        lookup.hit = True
    (call,) = calls(captured)
    assert (
        lookups(captured)[1].attributes[names.CACHE_SAVED_ESTIMATE] == (call.end_time - call.start_time) / 1e9
    )


class _Record:
    """What the window reads of a finished call."""

    error_type = None

    def __init__(self, model: str) -> None:
        self.shape = type("Shape", (), {"span_attributes": {names.GEN_AI_REQUEST_MODEL: model}})()


def test_the_window_holds_the_last_calls_of_each_model_only() -> None:
    window = _cache.CallDurations()
    for duration in range(1, 301):  # 300 calls: the first 44 have left the window
        window.finished(_Record("m"), names.OUTCOME_COMPLETED, duration)
    window.finished(_Record("m"), names.OUTCOME_ABANDONED, 10_000)
    assert window.median_ns("m") == sorted(range(45, 301))[(256 + 1) // 2 - 1]
    assert window.median_ns(None) == window.median_ns("m")
    assert window.median_ns("other") is None
    for index in range(100):  # models past the 64th get no window of their own, but count in all
        window.finished(_Record(f"model-{index}"), names.OUTCOME_COMPLETED, 7)
    assert window.median_ns("model-62") == 7
    assert window.median_ns("model-63") is None
