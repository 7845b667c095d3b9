"""Class-level instrumentation (llmspans/_classes.py), `instrument_all()`, the OpenTelemetry instrumentor
(`opentelemetry-instrument`), and the errors that say what to pass: over real HTTP against the simulator.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

import llmspans
from llmspans import _names as names
from llmspans.testing import Captured
from llmspans.tools.simulator import SimulatedServer
from tests.support.openai_clients import MESSAGES

ORIGINAL_INITS = {
    cls: cls.__dict__.get("__init__") for cls in (openai.OpenAI, openai.AsyncOpenAI, httpx.Client)
}


@pytest.fixture(autouse=True)
def no_class_left_instrumented() -> Iterator[None]:
    yield
    llmspans.uninstrument_all()
    for cls, init in ORIGINAL_INITS.items():
        assert cls.__dict__.get("__init__") is init, cls


def call_spans(captured: Captured) -> list[Any]:
    return [s for s in captured.spans if (s.attributes or {}).get(names.STAGE) == names.STAGE_LLM]


def test_a_class_instruments_the_clients_built_from_it_and_those_alive(
    server: SimulatedServer, captured: Captured
) -> None:
    before = openai.OpenAI(base_url=server.base_url, api_key="x")  # built before: instrumented at once
    assert llmspans.instrument(openai.OpenAI, budget=5) is openai.OpenAI
    after = openai.OpenAI(base_url=server.base_url, api_key="x")
    azure = openai.AzureOpenAI(
        azure_endpoint=server.url, api_key="x", api_version="2024-06-01", max_retries=0
    )
    before.chat.completions.create(model="tiny", messages=MESSAGES)
    after.chat.completions.create(model="tiny", messages=MESSAGES)
    with pytest.raises(openai.NotFoundError):  # the simulator has no Azure deployment paths
        azure.chat.completions.create(model="tiny", messages=MESSAGES)
    spans = call_spans(captured)
    assert len(spans) == 3
    assert all(span.attributes[names.BUDGET] == 5 for span in spans)
    assert spans[2].attributes[names.GEN_AI_PROVIDER_NAME] == names.PROVIDER_AZURE_OPENAI


def test_looking_for_live_clients_never_wakes_a_lazy_proxy(captured: Captured) -> None:
    """Finding the clients alive asks each object's type, not its `__class__`: a lazy proxy that imports
    what it stands for when asked (as the openai SDK's resource proxies do) is left asleep."""
    asked: list[str] = []

    class LazyProxy:
        @property  # type: ignore[misc]
        def __class__(self) -> type:
            asked.append("__class__")
            return openai.OpenAI

    proxy = LazyProxy()
    llmspans.instrument(openai.OpenAI)
    assert asked == []
    del proxy  # alive through the walk


def test_instrumented_both_ways_a_call_has_one_span_with_the_apps_own_settings(
    server: SimulatedServer, captured: Captured
) -> None:
    client = llmspans.instrument(openai.OpenAI(base_url=server.base_url, api_key="x"), budget=1)
    llmspans.instrument(openai.OpenAI, budget=9)
    llmspans.instrument(openai.OpenAI, budget=9)  # idempotent
    later = llmspans.instrument(openai.OpenAI(base_url=server.base_url, api_key="x"), budget=3)
    client.chat.completions.create(model="tiny", messages=MESSAGES)
    later.chat.completions.create(model="tiny", messages=MESSAGES)
    first, second = call_spans(captured)
    assert first.attributes[names.BUDGET] == 1  # the app's own settings, whichever came first
    assert second.attributes[names.BUDGET] == 3


async def test_async_clients_and_uninstrument_put_the_class_back(
    server: SimulatedServer, captured: Captured
) -> None:
    llmspans.instrument(openai.AsyncOpenAI)
    mine = llmspans.instrument(openai.AsyncOpenAI(base_url=server.base_url, api_key="x"), budget=2)
    theirs = openai.AsyncOpenAI(base_url=server.base_url, api_key="x")
    await theirs.chat.completions.create(model="tiny", messages=MESSAGES)
    assert len(call_spans(captured)) == 1
    llmspans.uninstrument(openai.AsyncOpenAI)
    assert openai.AsyncOpenAI.__dict__.get("__init__") is ORIGINAL_INITS[openai.AsyncOpenAI]
    captured.clear()
    await theirs.chat.completions.create(model="tiny", messages=MESSAGES)  # the class's: undone
    await openai.AsyncOpenAI(base_url=server.base_url, api_key="x").chat.completions.create(
        model="tiny", messages=MESSAGES
    )
    await mine.chat.completions.create(model="tiny", messages=MESSAGES)  # the app's own: kept
    (span,) = call_spans(captured)
    assert span.attributes[names.BUDGET] == 2


def test_instrument_all_takes_the_openai_classes_and_httpx_only_when_asked(
    server: SimulatedServer, captured: Captured
) -> None:
    assert set(llmspans.instrument_all()) == {openai.OpenAI, openai.AsyncOpenAI}
    with httpx.Client(base_url=server.base_url) as plain:
        plain.post("/chat/completions", json={"model": "tiny", "messages": MESSAGES})
    assert call_spans(captured) == []  # plain clients carry non-LLM traffic too: not without asking
    llmspans.uninstrument_all()
    classes = llmspans.instrument_all(httpx=True)
    assert httpx.Client in classes
    with httpx.Client(base_url=server.base_url) as plain:
        plain.post("/chat/completions", json={"model": "tiny", "messages": MESSAGES})
    # An openai client sends through its own httpx/httpx2 client: instrumented both ways, one span.
    openai.OpenAI(base_url=server.base_url, api_key="x").chat.completions.create(
        model="tiny", messages=MESSAGES
    )
    assert len(call_spans(captured)) == 2


class ChatFramework:
    """What LangChain's ChatOpenAI looks like to instrument(): an object that holds a client."""

    def __init__(self) -> None:
        self.root_client = openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="x")


@pytest.mark.parametrize(
    ("target", "says"),
    [
        (ChatFramework(), "llmspans.instrument(openai.OpenAI)"),
        (
            openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="x").chat.completions,
            "not client.chat.completions",
        ),
        (dict, "a client, or one of those classes"),
        ({}, "a client, or one of those classes"),
    ],
)
def test_what_is_not_a_client_gets_an_error_that_says_what_to_pass(target: Any, says: str) -> None:
    with pytest.raises(TypeError, match=r"llmspans\.instrument") as error:
        llmspans.instrument(target)
    assert says in str(error.value)


def test_bad_settings_on_a_class_are_refused_before_anything_changes() -> None:
    with pytest.raises(ValueError, match="phase_spans"):
        llmspans.instrument(openai.OpenAI, phase_spans="sometimes")
    assert openai.OpenAI.__dict__.get("__init__") is ORIGINAL_INITS[openai.OpenAI]


APP = """
import json, sys
import openai
import llmspans
from llmspans.tools.simulator import SimulatedServer

llmspans.configure(traces_file=sys.argv[1])
with SimulatedServer() as server:
    client = openai.OpenAI(base_url=server.base_url, api_key="x")  # the app never calls instrument()
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
"""


@pytest.mark.parametrize("disabled", [False, True])
def test_opentelemetry_instrument_runs_llmspans_with_no_code_change(tmp_path: Path, disabled: bool) -> None:
    """`opentelemetry-instrument python app.py` loads llmspans' instrumentor from its entry point, which
    instruments the openai client classes before the app builds its client; the standard
    OTEL_PYTHON_DISABLED_INSTRUMENTATIONS switches it off."""
    launcher = Path(sys.executable).with_name("opentelemetry-instrument")
    assert launcher.exists(), "opentelemetry-instrumentation is in the dev extra"
    app, spans_file = tmp_path / "app.py", tmp_path / "spans.jsonl"
    app.write_text(textwrap.dedent(APP))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLMSPANS_"))}
    env.update(OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none", OTEL_LOGS_EXPORTER="none")
    if disabled:
        env["OTEL_PYTHON_DISABLED_INSTRUMENTATIONS"] = "llmspans"
    subprocess.run(
        [str(launcher), sys.executable, str(app), str(spans_file)], env=env, check=True, timeout=120,
        capture_output=True, text=True,
    )  # fmt: skip
    lines = [json.loads(line) for line in spans_file.read_text().splitlines() if line.strip()]
    names_seen = {  # llmspans' own: other instrumentations the venv holds (openai-v2) run here too
        span["name"]
        for line in lines
        for resource in line.get("resourceSpans", [])
        for scope in resource.get("scopeSpans", [])
        if scope.get("scope", {}).get("name") == "llmspans"
        for span in scope.get("spans", [])
    }
    assert ("chat tiny" in names_seen) is not disabled
