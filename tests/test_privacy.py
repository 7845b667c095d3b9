"""Secrets and privacy: nothing private leaves the process unless the user asked.

An app plants secrets everywhere a real one has them: the prompt and system prompt, the model's
answer (the simulator's reply text and a tool call's arguments), a tool's argument, result and
error message, the API key (`Authorization: Bearer`), Azure's `api-key` header, a plain client's
`Authorization` and `api-key` headers, an `x-api-key` default header, and credentials in URLs
(user info, query keys). It runs a turn with stages, a tool and streamed and non-streamed calls over
the openai SDK (sync, async, Azure) and a plain httpx client, exporting through `configure()` to the
embedded file, with every log record of every logger captured and one internal error provoked. Then
every exported span, event, metric line and every llmspans / OpenTelemetry log line is scanned for
each secret. With capture on, the redaction hook must run before export and the content is capped.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from llmspans import _content
from llmspans import _names as names

SECRETS = {
    "system": "SYSTEM-PROMPT-SECRET-1f3a",
    "prompt": "USER-PROMPT-SECRET-9c2e",
    "tool_arg": "TOOL-ARGUMENT-SECRET-77ab",
    "tool_result": "TOOL-RESULT-SECRET-0d4c",
    "tool_error": "TOOL-ERROR-SECRET-5e6f",
    "retrieval_query": "RETRIEVAL-QUERY-SECRET-a1b2",
    "api_key": "sk-API-KEY-SECRET-3b5d",
    "azure_key": "AZURE-API-KEY-SECRET-8e8e",
    "x_api_key": "X-API-KEY-SECRET-4242",
    "bearer": "BEARER-TOKEN-SECRET-6c6c",
    "httpx_api_key": "HTTPX-API-KEY-SECRET-2d2d",
    "url_password": "URL-PASSWORD-SECRET-9f9f",
    "query_key": "QUERY-API-KEY-SECRET-1a1a",
    "query_token": "QUERY-TOKEN-SECRET-7b7b",
}
URL_USER = "url-user"
# The simulator's answer: its text ("Hello, this is a simulated reply.") and, with tool calls,
# the same words inside the function call's JSON arguments.
COMPLETION = "simulated reply"

APP = """
import asyncio, json, logging, sys
log = logging.FileHandler(LOG_FILE)
log.setFormatter(logging.Formatter("%(name)s|%(levelname)s|%(message)s"))
logging.getLogger().addHandler(log)
logging.getLogger().setLevel(logging.DEBUG)
import httpx, openai, llmspans
from llmspans import _guard
from llmspans.tools.simulator import Behavior, SimulatedServer

llmspans.configure(service_name="privacy", traces_file=TRACES, attempt_spans="always", **CONFIGURE)  # url.full scanned too
S = SECRETS

@llmspans.retrieval
def search(query):
    return ["a document about " + query]

@llmspans.stage("guardrail")
def check(prompt):
    return S["prompt"] in prompt

@llmspans.tool
def lookup(city):
    if city == S["tool_error"]:
        raise ValueError("no weather for " + city)
    return "sunny in " + city + " " + S["tool_result"]

messages = [{"role": "system", "content": S["system"]}, {"role": "user", "content": S["prompt"]}]
tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]

with SimulatedServer(Behavior(chunks=8, usage="finish")) as server:
    host = server.url.split("//", 1)[1]
    with_credentials = f"http://{URL_USER}:{S['url_password']}@{host}/v1"
    sync_client = llmspans.instrument(openai.OpenAI(
        base_url=with_credentials, api_key=S["api_key"], max_retries=0, default_headers={"x-api-key": S["x_api_key"]},
    ))
    async_client = llmspans.instrument(openai.AsyncOpenAI(base_url=server.base_url, api_key=S["api_key"], max_retries=0))
    azure = llmspans.instrument(openai.AzureOpenAI(
        azure_endpoint=server.url, api_key=S["azure_key"], api_version="2024-06-01", max_retries=0,
    ))
    plain = llmspans.instrument(httpx.Client(
        base_url=with_credentials, headers={"Authorization": "Bearer " + S["bearer"], "api-key": S["httpx_api_key"]},
    ))

    async def async_calls():
        async for _ in await async_client.chat.completions.create(model="sim", messages=messages, stream=True):
            pass
        await async_client.chat.completions.create(model="sim", messages=messages)
        await async_client.close()

    with llmspans.turn("chat"):
        search(S["retrieval_query"])
        check(S["prompt"])
        for _ in sync_client.chat.completions.create(model="sim", messages=messages, stream=True, tools=tools):
            pass
        sync_client.chat.completions.create(model="sim", messages=messages, tools=tools)
        for _ in sync_client.chat.completions.create(
            model="sim", messages=messages, stream=True, tools=tools, extra_body={"x_sim": {"tool_calls": True}}
        ):
            pass
        sync_client.completions.create(model="sim", prompt=S["prompt"])
        sync_client.embeddings.create(model="sim", input=S["prompt"])
        lookup(S["tool_arg"])
        try:
            lookup(S["tool_error"])
        except ValueError:
            pass
        asyncio.run(async_calls())
        try:
            azure.chat.completions.create(model="deployment", messages=messages)
        except openai.NotFoundError:
            pass  # the simulator has no Azure deployment paths: a failed call is exported too
        query = f"?api-key={S['query_key']}&token={S['query_token']}"
        with plain.stream("POST", "/chat/completions" + query, json={"model": "sim", "messages": messages, "stream": True}) as r:
            r.read()
        plain.post("/chat/completions" + query, json={"model": "sim", "messages": messages})
        plain.post("/chat/completions", json={"model": "sim", "messages": messages, "x_sim": {"status": 400}})
        # An internal error is logged with its traceback: that must not quote the secrets either.
        with _guard.inject_faults("openai.result", "call.finish"):
            sync_client.chat.completions.create(model="sim", messages=messages)
# EXTRA
print("done", flush=True)
"""


def run_app(
    tmp_path: Path, configure: str = "{}", prelude: str = "", extra: str = ""
) -> tuple[str, str, str]:
    """Run the app (`configure` is the source of configure()'s extra arguments, `prelude` runs before
    it and `extra` at the end); returns what it exported (the traces file), its log file and stderr."""
    traces, log_file = tmp_path / "traces.jsonl", tmp_path / "app.log"
    head = (
        f"SECRETS = {SECRETS!r}\nURL_USER = {URL_USER!r}\nTRACES = {str(traces)!r}\n"
        f"LOG_FILE = {str(log_file)!r}\n{textwrap.dedent(prelude)}\nCONFIGURE = {configure}\n"
    )
    app = textwrap.dedent(APP).replace("# EXTRA\n", textwrap.dedent(extra))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLMSPANS_"))}
    result = subprocess.run(
        [sys.executable, "-c", head + app], env=env, capture_output=True, text=True, timeout=90
    )
    assert result.returncode == 0, result.stderr
    assert "done" in result.stdout
    return traces.read_text(), log_file.read_text(), result.stderr


def our_log_lines(log: str) -> list[str]:
    """The lines llmspans and the OpenTelemetry SDK logged (tracebacks included). Other libraries'
    own logs (openai's and httpx's DEBUG request dumps quote the prompt) are theirs, not ours."""
    kept, keeping = [], False
    for line in log.splitlines():
        if "|" in line and line.split("|", 1)[0].replace(".", "").replace("_", "").isalnum():
            keeping = line.startswith(("llmspans", "opentelemetry"))
        if keeping:
            kept.append(line)
    return kept


def forms(secret: str) -> list[str]:
    return [secret, json.dumps(secret)[1:-1], base64.b64encode(secret.encode()).decode()]


def spans_in(exported: str) -> list[dict[str, Any]]:
    found = []
    for line in exported.splitlines():
        for resource_spans in json.loads(line).get("resourceSpans", []):
            for scope_spans in resource_spans["scopeSpans"]:
                for span in scope_spans["spans"]:
                    attributes = {
                        a["key"]: next(iter(a["value"].values())) for a in span.get("attributes", [])
                    }
                    found.append({"name": span["name"], "attributes": attributes})
    return found


def test_with_capture_off_no_secret_leaves_the_process(tmp_path: Path) -> None:
    exported, log, stderr = run_app(tmp_path)
    spans = spans_in(exported)
    names_seen = {span["name"] for span in spans}
    # The scan is not vacuous: everything the app did was exported, and llmspans did log.
    assert {
        "turn chat",
        "retrieval search",
        "guardrail check",
        "execute_tool lookup",
        "chat sim",
        "POST",
    } <= names_seen
    assert {"text_completion sim", "embeddings sim", "chat deployment"} <= names_seen
    assert sum(1 for s in spans if s["attributes"].get(names.STAGE) == "llm") == 12
    assert '"resourceMetrics"' in exported
    ours = our_log_lines(log)
    assert any("internal error" in line for line in ours), ours
    basic = base64.b64encode(f"{URL_USER}:{SECRETS['url_password']}".encode()).decode()
    for where, text in (
        ("exported spans and metrics", exported),
        ("log", "\n".join(ours)),
        ("stderr", stderr),
    ):
        for label, secret in SECRETS.items():
            for form in forms(secret):
                assert form not in text, f"{label} ({form}) in the {where}"
        assert basic not in text, f"the Basic credentials in the {where}"
        assert COMPLETION not in text, f"the completion in the {where}"
        assert "Bearer" not in text, f"an Authorization header in the {where}"
    for span in spans:
        url = span["attributes"].get(names.URL_FULL)
        if url:
            assert "@" not in url or "://REDACTED:REDACTED@" in url, url  # user info as the conventions say
            assert URL_USER not in url, url
    assert not any(key in exported.lower() for key in ('"authorization"', '"api-key"', '"x-api-key"'))


REDACTOR = """
def redact(messages):
    text = json.dumps(messages).replace(SECRETS["prompt"], "[removed]").replace("simulated", "[removed]")
    return json.loads(text)
"""
HUGE = "A" * 50_000


def test_with_capture_on_the_redaction_hook_runs_before_export_and_content_is_capped(tmp_path: Path) -> None:
    huge_call = f"""
    with SimulatedServer(Behavior(chunks=6000)) as big:
        client = llmspans.instrument(openai.OpenAI(base_url=big.base_url, api_key=S["api_key"], max_retries=0))
        client.chat.completions.create(model="huge", messages=[{{"role": "user", "content": {HUGE!r}}}])
    """
    exported, log, stderr = run_app(
        tmp_path, configure='{"capture_content": redact}', prelude="import json\n" + REDACTOR, extra=huge_call
    )
    # The hook removed these before export: they appear nowhere.
    for text in (exported, "\n".join(our_log_lines(log)), stderr):
        assert SECRETS["prompt"] not in text
        assert COMPLETION not in text
        for label in (
            "api_key",
            "azure_key",
            "x_api_key",
            "bearer",
            "httpx_api_key",
            "url_password",
            "query_key",
        ):
            assert SECRETS[label] not in text, label
    calls = [s for s in spans_in(exported) if s["attributes"].get(names.STAGE) == "llm"]
    inputs = [
        c["attributes"][names.GEN_AI_INPUT_MESSAGES]
        for c in calls
        if names.GEN_AI_INPUT_MESSAGES in c["attributes"]
    ]
    outputs = [
        c["attributes"][names.GEN_AI_OUTPUT_MESSAGES]
        for c in calls
        if names.GEN_AI_OUTPUT_MESSAGES in c["attributes"]
    ]
    # Content was captured (the opt-in works), through the hook, on the openai and the plain paths.
    assert sum("[removed]" in text for text in inputs) >= 8, inputs
    assert any("[removed] reply" in text for text in outputs), outputs
    assert SECRETS["system"] in "".join(inputs)  # what the hook kept is there
    # Capped: a 50,000-character prompt and a 6,000-token answer stay within the documented length, and
    # stay JSON: the long text is cut, and says by how much.
    (huge,) = [c for c in calls if c["attributes"].get(names.GEN_AI_REQUEST_MODEL) == "huge"]
    assert _content.MAX_CONTENT_CHARS == 16_384
    assert max(len(text) for text in inputs + outputs) <= _content.MAX_CONTENT_CHARS
    (prompt,) = json.loads(huge["attributes"][names.GEN_AI_INPUT_MESSAGES])
    assert prompt["parts"][0]["content"].startswith("A" * 16_000)
    assert prompt["parts"][0]["content"].endswith(" chars]")
    (reply,) = json.loads(huge["attributes"][names.GEN_AI_OUTPUT_MESSAGES])
    assert len(reply["parts"][0]["content"]) > 16_000
    assert reply["parts"][0]["content"].endswith(" chars]")


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_an_unreachable_endpoint_is_logged_without_its_credentials(tmp_path: Path) -> None:
    endpoint = f"http://collector:{SECRETS['url_password']}@127.0.0.1:{closed_port()}"
    code = f"""
    import logging, sys
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s|%(levelname)s|%(message)s")
    import llmspans
    from opentelemetry import trace
    llmspans.configure(service_name="privacy", endpoint={endpoint!r})

    @llmspans.stage("work")
    def work():
        pass

    work()
    trace.get_tracer_provider().force_flush(10_000)
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLMSPANS_"))}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=60
    )
    ours = [line for line in result.stderr.splitlines() if line.startswith("llmspans|")]
    assert any("could not export spans" in line for line in ours), result.stderr
    assert not any(SECRETS["url_password"] in line for line in ours), ours


def test_the_vllm_sampler_logs_its_url_without_credentials(caplog: pytest.LogCaptureFixture) -> None:
    import logging
    import time

    from llmspans.vllm import ServerMetrics

    port = closed_port()
    with caplog.at_level(logging.DEBUG, logger="llmspans"):
        sampler = ServerMetrics(f"http://user:{SECRETS['url_password']}@127.0.0.1:{port}/v1", interval=0.05)
        try:
            deadline = time.monotonic() + 5
            while "cannot read vLLM metrics" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.02)
        finally:
            sampler.close()
    assert "cannot read vLLM metrics" in caplog.text
    assert SECRETS["url_password"] not in caplog.text


@pytest.mark.parametrize(
    "key",
    [
        "x-api-key", "access-token", "api_token", "private_token", "client-secret",
        "AWSAccessKeyId", "Signature", "sig", "X-Goog-Signature",
    ],
)  # fmt: skip
def test_secret_looking_query_values_are_redacted_in_any_common_spelling(key: str) -> None:
    import httpx

    from llmspans._transport import safe_url

    url = httpx.URL(f"http://127.0.0.1:8000/v1/chat/completions?{key}={SECRETS['query_key']}&api-version=1")
    assert SECRETS["query_key"] not in safe_url(url)


def test_user_info_in_url_full_is_redacted_as_the_conventions_say() -> None:
    import httpx

    from llmspans._transport import safe_url

    url = httpx.URL(f"https://alice:{SECRETS['url_password']}@example.test/v1/chat/completions?api-version=1")
    assert safe_url(url) == "https://REDACTED:REDACTED@example.test/v1/chat/completions?api-version=1"
    presigned = httpx.URL(
        f"https://bucket.test/o?AWSAccessKeyId={SECRETS['query_key']}&Expires=1&Signature={SECRETS['query_key']}"
    )
    assert safe_url(presigned) == "https://bucket.test/o?AWSAccessKeyId=REDACTED&Expires=1&Signature=REDACTED"
    assert (
        safe_url(httpx.URL("http://127.0.0.1:8000/v1/chat/completions"))
        == "http://127.0.0.1:8000/v1/chat/completions"
    )
