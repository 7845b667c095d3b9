"""`instrument()` and `uninstrument()` (`llmspans/_instrument.py`): which clients, which arguments, once."""

from __future__ import annotations

import openai
import pytest

import llmspans
from llmspans import _names as names
from llmspans.testing import Captured
from llmspans.tools.simulator import SimulatedServer
from tests.support.openai_clients import MESSAGES, SECRET, call_span, sync_client
from tests.timing import (
    all_exported_text,
    attempt_spans,
)


def test_instrument_is_idempotent_and_reversible(server: SimulatedServer, captured: Captured) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key=SECRET)
    assert llmspans.instrument(client) is client
    assert llmspans.instrument(client) is client
    client.chat.completions.create(model="tiny", messages=MESSAGES)
    assert len(captured.spans) == 1  # one call span: not doubled
    copy = client.with_options(timeout=5)
    copy.chat.completions.create(model="tiny", messages=MESSAGES)
    assert len(captured.spans) == 2
    llmspans.uninstrument(client)
    llmspans.uninstrument(client)
    client.chat.completions.create(model="tiny", messages=MESSAGES)
    assert len(captured.spans) == 2
    assert "traceparent" not in server.requests[-1].headers


def test_non_llm_requests_pass_through(server: SimulatedServer, captured: Captured) -> None:
    client = sync_client(server)
    assert [m.id for m in client.models.list()]
    assert captured.spans == []


def test_unsupported_clients_and_bad_arguments() -> None:
    with pytest.raises(TypeError, match=r"supports openai\.OpenAI"):
        llmspans.instrument(object())
    client = openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key=SECRET)
    with pytest.raises(ValueError, match="provider must be a non-empty string"):
        llmspans.instrument(client, provider="")
    with pytest.raises(ValueError, match="budget for the LLM call"):
        llmspans.instrument(client, budget=-1)
    with pytest.raises(TypeError, match="capture_content"):
        llmspans.instrument(client, capture_content="yes")
    with pytest.raises(TypeError, match="request_usage"):
        llmspans.instrument(client, request_usage="yes")  # type: ignore[arg-type]


def test_azure_client_is_instrumented(server: SimulatedServer, captured: Captured) -> None:
    """Azure's deployment paths end in the same operation suffixes; the simulator answers them 404."""
    client = llmspans.instrument(
        openai.AzureOpenAI(
            azure_endpoint=server.url, api_key=SECRET, api_version="2024-06-01", max_retries=0
        ),
        attempt_spans="always",
    )
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="my-deployment", messages=MESSAGES)
    span = call_span(captured)
    assert span.name == "chat my-deployment"
    assert span.attributes[names.GEN_AI_PROVIDER_NAME] == "azure.ai.openai"  # the conventions' value
    assert span.attributes[names.ERROR_TYPE] == "NotFoundError"
    (attempt,) = attempt_spans(captured)
    assert "/openai/deployments/my-deployment/chat/completions" in attempt.attributes[names.URL_FULL]
    assert SECRET not in all_exported_text(captured)
