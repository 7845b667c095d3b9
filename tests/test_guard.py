"""Every guard site, failing on purpose: the app sees what it would have seen, the site is logged once.

`llmspans._sites` names every place where llmspans catches its own failure. Each gets a fault here:
injected by name where the site checks for one (`guarded`, `swallow`, `check_fault`), or by making
the hook behind it raise where it only reports. A site missing from the table below, or a site
spelt as a literal in the code instead of through `_sites`, fails this file.
"""

from __future__ import annotations

import ast
import asyncio
import gc
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from opentelemetry.sdk.trace import Span as SdkSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import llmspans
from llmspans import _call, _deferred, _guard, _prompt, _transport
from llmspans import _sites as sites
from llmspans._adapters import openai_sdk
from llmspans._held_span import HeldSpan
from llmspans.testing import Captured, settle
from llmspans.tools.simulator import Behavior, SimulatedServer

PACKAGE = Path(llmspans.__file__).resolve().parent
GUARD_CALLS = {"guarded", "swallow", "report", "check_fault", "InjectedFault", "inject_faults"}
MESSAGES = [{"role": "user", "content": "hi"}]
SERVER_BEHAVIOR = Behavior(chunks=3)


def test_no_site_is_spelt_outside_the_sites_module() -> None:
    literals = []
    for path in PACKAGE.rglob("*.py"):
        if path.name in ("_guard.py", "_sites.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and node.args:
                name = getattr(node.func, "id", getattr(node.func, "attr", None))
                if name in GUARD_CALLS and isinstance(node.args[0], ast.Constant):
                    literals.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.args[0].value!r}")
    assert literals == [], "name guard sites through llmspans._sites"


# --- the scenarios: small real runs against the simulated server ------------------------------------


def openai_call(url: str, **instrument: Any) -> Any:
    client = llmspans.instrument(openai.OpenAI(base_url=url, api_key="k", max_retries=0), **instrument)
    return client.chat.completions.create(model="m", messages=MESSAGES).choices[0].message.content


def openai_stream(url: str, **instrument: Any) -> Any:
    client = llmspans.instrument(openai.OpenAI(base_url=url, api_key="k", max_retries=0), **instrument)
    return [
        c.choices[0].delta.content
        for c in client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        if c.choices
    ]


def openai_raw(url: str) -> Any:
    client = llmspans.instrument(openai.OpenAI(base_url=url, api_key="k", max_retries=0))
    return (
        client.chat.completions.with_raw_response.create(model="m", messages=MESSAGES)
        .parse()
        .choices[0]
        .message.content
    )


def openai_copy(url: str) -> Any:
    client = llmspans.instrument(openai.OpenAI(base_url=url, api_key="k", max_retries=0))
    return (
        client.with_options(timeout=5)
        .chat.completions.create(model="m", messages=MESSAGES)
        .choices[0]
        .message.content
    )


def class_level_call(url: str) -> Any:
    llmspans.instrument(openai.OpenAI)
    try:
        client = openai.OpenAI(base_url=url, api_key="k", max_retries=0)
        return client.chat.completions.create(model="m", messages=MESSAGES).choices[0].message.content
    finally:
        llmspans.uninstrument(openai.OpenAI)


def limited_call(url: str) -> Any:
    return openai_call(url, limiter=llmspans.Limiter(2, name="guard"))


def with_limiter_block(url: str) -> Any:
    limiter = llmspans.Limiter(2, name="guard-block")
    with llmspans.turn("block"), limiter:
        return 42


def plain_call(url: str, **instrument: Any) -> Any:
    with llmspans.instrument(httpx.Client(base_url=url), **instrument) as client:
        return client.post("/chat/completions", json={"model": "m", "messages": MESSAGES}).json()["choices"][
            0
        ]["message"]["content"]


def plain_stream(url: str) -> Any:
    with llmspans.instrument(httpx.Client(base_url=url)) as client:
        body = {"model": "m", "messages": MESSAGES, "stream": True}
        with client.stream("POST", "/chat/completions", json=body) as response:
            return response.read().count(b"data:")


def plain_collected(url: str) -> Any:
    client = llmspans.instrument(httpx.Client(base_url=url))
    body = {"model": "m", "messages": MESSAGES, "stream": True}
    response = client.send(client.build_request("POST", "/chat/completions", json=body), stream=True)
    first = next(response.iter_bytes())[:5]
    del response
    gc.collect()
    settle()
    return first


def plain_preread(url: str) -> Any:
    """A client on a MockTransport, whose answers come whole (`content=`) and already read."""
    answer = {"choices": [{"index": 0, "message": {"content": "whole"}, "finish_reason": "stop"}]}
    transport = httpx.MockTransport(lambda request: httpx.Response(200, json=answer))
    with llmspans.instrument(httpx.Client(base_url=url, transport=transport)) as client:
        content = client.post("/chat/completions", json={"model": "m", "messages": MESSAGES}).json()
    return content["choices"][0]["message"]["content"], len(_call._open_calls)


def refused(url: str) -> Any:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = llmspans.instrument(
        openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0)
    )
    try:
        client.chat.completions.create(model="m", messages=MESSAGES)
    except openai.APIConnectionError as error:
        return type(error).__name__
    return None


def stage_and_turn(url: str) -> Any:
    @llmspans.stage("guarded-stage")
    def work() -> int:
        return 7

    with llmspans.turn("guarded"):
        return work()


def tail_sampled_turn(url: str) -> Any:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider

    from llmspans import _telemetry

    provider = TracerProvider()
    provider.add_span_processor(
        llmspans.TailSamplingProcessor(SimpleSpanProcessor(InMemorySpanExporter()), ratio=1.0)
    )
    meter_provider = MeterProvider()
    try:
        with _telemetry.use_providers(provider, meter_provider), llmspans.turn("sampled"):
            return openai_call(url)
    finally:
        provider.shutdown()
        meter_provider.shutdown()


def server_state(url: str) -> Any:
    from llmspans.vllm import ServerMetrics

    with ServerMetrics(url, interval=60) as sampler:
        return openai_call(url, provider="vllm", server_metrics=sampler)


def exit_hooks(url: str) -> Any:
    # An attempt with a span of its own: the exit hook visits attempts that have something to end.
    client = llmspans.instrument(
        openai.OpenAI(base_url=url, api_key="k", max_retries=0), attempt_spans="always"
    )
    stream = client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
    first = next(iter(stream)).id is not None
    _transport.end_open_attempts()  # what the exit hooks run, before the providers flush
    _call.end_open_calls()
    return first


def capped_call(url: str) -> Any:
    """A capped call whose server reports usage: estimated before, compared after."""
    return openai_call(url, max_prompt_tokens=1000)


def capped_call_loading(url: str) -> Any:
    """A capped call whose model's tokenizer the default choice looks up in the background."""
    _prompt.forget()
    answer = openai_call(url, max_prompt_tokens=1000)
    assert _prompt.loaded("m", timeout=30)
    return answer


def cache_lookup_call(url: str) -> Any:
    @llmspans.cache("guarded", hit=lambda found: found == "x")
    def look() -> str:
        return "x"

    return look()


def hedged_stream(url: str, quiet: bool = False) -> Any:
    """A sync hedged stream whose slow primary loses to its backup, then the same with an async client: every
    hedge site on the way, on both paths (the simulator of the test is shared by both runs, so the races
    have a server of their own)."""
    first = Behavior(chunks=0 if quiet else 3, usage="chunk", first_chunk_delay=0.4)
    request: dict[str, Any] = {
        "model": "m", "messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True}
    }  # fmt: skip
    with SimulatedServer(Behavior(chunks=0 if quiet else 3, usage="chunk")) as own:
        own.enqueue(first)
        client = llmspans.instrument(
            openai.OpenAI(base_url=own.base_url, api_key="k", max_retries=0), hedge=llmspans.Hedge(after=0.05)
        )
        with client:
            sync = [
                c.choices[0].delta.content for c in client.chat.completions.create(**request) if c.choices
            ]

        async def run_async() -> list[Any]:
            async with llmspans.instrument(
                openai.AsyncOpenAI(base_url=own.base_url, api_key="k", max_retries=0),
                hedge=llmspans.Hedge(after=0.05),
            ) as client:
                stream = await client.chat.completions.create(**request)
                return [c.choices[0].delta.content async for c in stream if c.choices]

        own.enqueue(first)
        return sync, asyncio.run(run_async())


class Work:
    """What a job handed to the worker does (the fault makes it raise)."""

    @staticmethod
    def run() -> None:
        pass


def deferred_job(url: str) -> Any:
    _deferred.start_worker()
    _deferred.defer(lambda: Work.run())
    return settle()


def _tiktoken_model() -> Any:
    return pytest.importorskip("tiktoken.model")


def raising(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("llmspans bug")


@contextmanager
def patched(target: Any, attribute: str, value: Any) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(target, attribute, value)
        yield


@contextmanager
def span_end_raising() -> Iterator[None]:
    """Either span llmspans makes raises at its end: an SDK span, or one held and built at its end (a
    processor at the span's end is where a real failure would come from)."""
    with patched(SdkSpan, "end", raising), patched(HeldSpan, "end", raising):
        yield


# site -> (the scenario that reaches it, how the fault is made: None = injected by name)
SITES: dict[str, tuple[Callable[..., Any], Callable[[], Any] | None]] = {
    sites.CACHE_HIT: (cache_lookup_call, None),
    sites.CALL_ADMITTED: (limited_call, None),
    sites.CALL_CHUNK_METRIC: (openai_stream, lambda: patched(_call._telemetry, "recorder", raising)),
    sites.CALL_EXIT: (exit_hooks, lambda: patched(_call.CallRecord, "finish", raising)),
    sites.CALL_FINISH: (openai_call, None),
    sites.CALL_RELEASE: (limited_call, None),
    sites.CALL_SERVER_STATE: (server_state, None),
    sites.CALL_SPAN_END: (openai_call, span_end_raising),
    sites.CLASS_INSTRUMENT: (class_level_call, None),
    sites.CONTENT_CHUNK: (lambda url: openai_stream(url, capture_content=True), None),
    sites.DEFERRED_WORK: (deferred_job, lambda: patched(Work, "run", raising)),
    sites.HEDGE_BEGIN: (hedged_stream, None),
    sites.HEDGE_CLOSE: (hedged_stream, None),
    sites.HEDGE_CONNECTION: (hedged_stream, None),
    sites.HEDGE_FINISH: (hedged_stream, None),
    sites.HEDGE_FIRE: (hedged_stream, None),
    sites.HEDGE_READ: (lambda url: hedged_stream(url, quiet=True), None),
    sites.HEDGE_SPAN: (hedged_stream, None),
    sites.HTTPX_BEGIN: (plain_call, None),
    sites.HTTPX_CONTENT: (lambda url: plain_call(url, capture_content=True), None),
    sites.LIMITER_RECORD: (with_limiter_block, None),
    sites.OPENAI_BEGIN: (openai_call, None),
    sites.OPENAI_CONTENT: (lambda url: openai_call(url, capture_content=True), None),
    sites.OPENAI_COPY: (openai_copy, None),
    sites.OPENAI_RAW: (openai_raw, None),
    sites.OPENAI_RESULT: (openai_call, None),
    sites.PROMPT_COMPARE: (capped_call, None),
    sites.PROMPT_ESTIMATE: (capped_call, None),
    sites.PROMPT_TOKENIZER: (
        capped_call_loading,
        lambda: patched(_tiktoken_model(), "encoding_name_for_model", raising),
    ),
    sites.STAGE_FINISH: (stage_and_turn, None),
    sites.STAGE_SPAN_END: (stage_and_turn, span_end_raising),
    sites.STREAM_CHUNK: (openai_stream, lambda: patched(openai_sdk, "_chat_item", raising)),
    sites.STREAM_END: (openai_stream, lambda: patched(openai_sdk, "_finish", raising)),
    sites.TAIL_SAMPLING_DECIDE: (tail_sampled_turn, None),
    sites.TAIL_SAMPLING_EXPORT: (tail_sampled_turn, lambda: patched(SimpleSpanProcessor, "on_end", raising)),
    sites.TRANSPORT_ATTEMPT: (openai_call, None),
    sites.TRANSPORT_BEGIN: (openai_call, None),
    sites.TRANSPORT_CLOSE: (openai_call, lambda: patched(_transport._AttemptScope, "close", raising)),
    sites.TRANSPORT_EXIT: (exit_hooks, lambda: patched(_transport._AttemptScope, "close", raising)),
    sites.TRANSPORT_FAILED: (refused, None),
    sites.TRANSPORT_GC: (plain_collected, None),
    sites.TRANSPORT_INJECT: (openai_call, None),
    sites.TRANSPORT_OBSERVE: (plain_stream, None),
    sites.TRANSPORT_OBSERVER: (plain_stream, None),
    sites.TRANSPORT_READ_BODY: (plain_preread, None),
    sites.TRANSPORT_RESPONSE: (openai_call, None),
    sites.TRANSPORT_SPAN_END: (lambda url: openai_call(url, attempt_spans="always"), None),
    sites.TRANSPORT_TRACE: (openai_call, None),
    sites.TRANSPORT_WATCHER: (openai_call, None),
    sites.TRANSPORT_WRAP_BODY: (openai_call, None),
    sites.TURN_FINISH: (stage_and_turn, None),
    sites.TURN_SPAN_END: (stage_and_turn, span_end_raising),
}


def test_every_site_has_a_fault_here() -> None:
    assert set(SITES) == set(sites.ALL)


@pytest.mark.parametrize("site", sorted(SITES))
def test_a_fault_at_each_site_leaves_the_app_as_it_was(
    site: str, server: SimulatedServer, captured: Captured, caplog: pytest.LogCaptureFixture
) -> None:
    scenario, fault = SITES[site]
    expected = scenario(server.base_url)
    settle()
    _guard.forget_reported()
    with caplog.at_level(logging.WARNING, logger="llmspans"):
        with _guard.inject_faults(site) if fault is None else fault():
            got = scenario(server.base_url)
        settle()
    assert got == expected
    said = [r for r in caplog.records if r.getMessage().startswith(f"llmspans: internal error in {site},")]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
