"""Process life: `os.fork()` after `configure()`, interpreter exit with streams still open, and
`uninstrument()` while calls are in flight.

Fork and exit run in fresh interpreters (global providers are set once per process, and exit is
what is tested); they export through `configure()` to the embedded file or to a local OTLP/HTTP
receiver, and the test reads back every span, counting them by span id.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import re
import subprocess
import sys
import textwrap
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

import llmspans
from llmspans import _names as names
from llmspans.testing import Captured
from llmspans.tools.simulator import Behavior, SimulatedServer

MESSAGES = [{"role": "user", "content": "hi"}]


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLMSPANS_"))}


def run_python(code: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=clean_env(), capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


def attribute_value(value: dict[str, Any]) -> Any:
    (kind, inner), *_ = value.items()
    if kind == "arrayValue":
        return [attribute_value(v) for v in inner.get("values", [])]
    return int(inner) if kind == "intValue" else inner


def spans_of(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every span of OTLP-JSON trace requests: name, id and attributes (flattened)."""
    found = []
    for request in requests:
        for resource_spans in request.get("resourceSpans", []):
            for scope_spans in resource_spans.get("scopeSpans", []):
                for span in scope_spans.get("spans", []):
                    attributes = {a["key"]: attribute_value(a["value"]) for a in span.get("attributes", [])}
                    found.append({"name": span["name"], "id": span["spanId"], "attributes": attributes})
    return found


def file_requests(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def received_traces(receiver: ThreadingHTTPServer) -> list[dict[str, Any]]:
    """The trace requests an OTLP/HTTP receiver got, as OTLP JSON (the file export's shape)."""
    return [
        json_format.MessageToDict(ExportTraceServiceRequest.FromString(each.body))
        for each in receiver.received  # type: ignore[attr-defined]
        if each.path == "/v1/traces"
    ]


# --- fork after configure ----------------------------------------------------------------------------

FORK_APP = """
import os, sys, llmspans, openai
from opentelemetry import trace
from llmspans.tools.simulator import Behavior, SimulatedServer

llmspans.configure(service_name="forking", **CONFIGURE)
server = SimulatedServer(Behavior(chunks=3)).start()  # its threads stay in the parent and serve both
client = llmspans.instrument(openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0))

def stream(model, client):
    for _ in client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], stream=True):
        pass

@llmspans.stage("before")
def exported_before_the_fork(): pass

@llmspans.stage("queued")
def queued_at_the_fork(): pass

@llmspans.stage("child")
def in_the_child(): pass

@llmspans.stage("after")
def in_the_parent_after(): pass

for _ in range(5):
    exported_before_the_fork()
stream("parent-before", client)
assert trace.get_tracer_provider().force_flush(10_000)
for _ in range(7):  # still in the batch processor's queue when the process forks
    queued_at_the_fork()
pid = os.fork()
if pid == 0:
    for _ in range(3):
        in_the_child()
    # A connection pool must not be shared across a fork: the child makes its own client.
    stream("child", llmspans.instrument(openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0)))
    sys.exit(0)  # a normal exit: the child flushes what it made
for _ in range(2):
    in_the_parent_after()
stream("parent-after", client)
_, status = os.waitpid(pid, 0)
print("child exit status", os.waitstatus_to_exitcode(status), flush=True)
server.stop()
"""


@pytest.mark.parametrize("export", ["file", "otlp"])
def test_fork_after_configure_exports_each_span_once(
    export: str, tmp_path: Path, otlp_http_receiver: ThreadingHTTPServer
) -> None:
    path = tmp_path / "traces.jsonl"
    configure = (
        {"traces_file": str(path)}
        if export == "file"
        else {"endpoint": f"http://127.0.0.1:{otlp_http_receiver.server_address[1]}"}
    )
    result = run_python(f"CONFIGURE = {configure!r}\n" + textwrap.dedent(FORK_APP))
    assert result.returncode == 0, result.stderr
    assert "child exit status 0" in result.stdout
    assert "Traceback" not in result.stderr, result.stderr
    requests = file_requests(path) if export == "file" else received_traces(otlp_http_receiver)
    spans = spans_of(requests)
    ids = collections.Counter(span["id"] for span in spans)
    assert [span_id for span_id, n in ids.items() if n > 1] == []  # nothing exported twice
    counts = collections.Counter(span["name"] for span in spans)
    assert counts == {
        "before exported_before_the_fork": 5,
        "queued queued_at_the_fork": 7,  # by the parent only: the child's copy of the queue is emptied
        "child in_the_child": 3,  # by the child itself: nobody else ever had these spans
        "after in_the_parent_after": 2,
        "chat parent-before": 1,
        "chat child": 1,
        "chat parent-after": 1,
    }
    for span in spans:
        if span["name"].startswith("chat "):
            assert span["attributes"][names.STREAM_OUTCOME] == "completed"


def stage_counts(requests: list[dict[str, Any]]) -> list[tuple[str, dict[str, int]]]:
    """Per metric export: the exporter's `service.instance.id` and its `llmspans.stage.duration` counts by stage."""
    exports = []
    for request in requests:
        for resource_metrics in request.get("resourceMetrics", []):
            resource = {
                item["key"]: attribute_value(item["value"])
                for item in resource_metrics["resource"]["attributes"]
            }
            for scope_metrics in resource_metrics.get("scopeMetrics", []):
                for metric in scope_metrics.get("metrics", []):
                    if metric["name"] == names.METRIC_STAGE_DURATION:
                        exports.append((resource["service.instance.id"], {
                            attribute_value(point["attributes"][0]["value"]): int(point["count"])
                            for point in metric["histogram"]["dataPoints"]
                        }))  # fmt: skip
    return exports


def test_fork_after_configure_does_not_report_the_parents_metrics_again(tmp_path: Path) -> None:
    path = tmp_path / "traces.jsonl"
    result = run_python(f"CONFIGURE = {{'traces_file': {str(path)!r}}}\n" + textwrap.dedent(FORK_APP))
    assert result.returncode == 0, result.stderr
    exports = stage_counts(file_requests(path))
    child = [(instance, counts) for instance, counts in exports if "child" in counts]
    parent = [(instance, counts) for instance, counts in exports if "before" in counts]
    assert child, exports
    assert parent, exports
    # The child reports only what it did (3 stages, 1 call), as an instance of its own.
    assert child[-1][1] == {"child": 3, "llm": 1}, child
    assert {instance for instance, _ in child}.isdisjoint(instance for instance, _ in parent), exports
    # The parent's points are untouched by the fork: everything it did, before and after.
    assert parent[-1][1] == {"before": 5, "queued": 7, "after": 2, "llm": 2}, parent


FORK_MID_WRITE_APP = """
import os, sys, threading, time, llmspans
from opentelemetry import trace

llmspans.configure(service_name="forking", traces_file=TRACES)
processor = trace.get_tracer_provider()._active_span_processor._span_processors[0]
file_exporter = processor._batch_processor._exporter

@llmspans.stage("child")
def in_the_child(): pass

writing = threading.Event()

def batch_being_written():  # the batch worker's state while it writes a batch to the file
    with file_exporter._exporter._lock, file_exporter._exporter._stream._lock:
        writing.set()
        time.sleep(1.0)

threading.Thread(target=batch_being_written).start()
writing.wait()
pid = os.fork()
if pid == 0:
    for _ in range(3):
        in_the_child()
    sys.exit(0)
started = time.monotonic()
while time.monotonic() - started < CHILD_EXIT_WITHIN:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        print("child exited", round(time.monotonic() - started, 2), flush=True)
        break
    time.sleep(0.05)
else:
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    print("child hung", flush=True)
"""


def test_fork_while_the_file_exporter_writes_does_not_hang_the_child(tmp_path: Path) -> None:
    path = tmp_path / "traces.jsonl"
    code = f"TRACES = {str(path)!r}\nCHILD_EXIT_WITHIN = 6.0\n" + textwrap.dedent(FORK_MID_WRITE_APP)
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert "child exited" in result.stdout, result.stdout
    names_exported = [span["name"] for span in spans_of(file_requests(path))]
    assert names_exported.count("child in_the_child") == 3


# --- exit with streams still open --------------------------------------------------------------------

EXIT_APP = """
import asyncio, sys, tempfile
if FINALIZER_FIRST:
    # Anything that makes a weakref.finalize before configure() (here a temporary directory, as many
    # apps and libraries do at import) puts its atexit hook before the providers' flush.
    scratch = tempfile.TemporaryDirectory()
import httpx, llmspans, openai
from llmspans.tools.simulator import Behavior, SimulatedServer

if INSTRUMENT:
    llmspans.configure(service_name="exiting", traces_file=TRACES)
instrument = llmspans.instrument if INSTRUMENT else (lambda client: client)
server = SimulatedServer(Behavior(chunks=50, chunk_gap=0.05)).start()
client = instrument(openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0))
sync_stream = client.chat.completions.create(model="sync-open", messages=[{"role": "user", "content": "hi"}], stream=True)
next(sync_stream)
next(sync_stream)

async_client = instrument(openai.AsyncOpenAI(base_url=server.base_url, api_key="k", max_retries=0))

async def open_one():
    stream = await async_client.chat.completions.create(model="async-open", messages=[{"role": "user", "content": "hi"}], stream=True)
    await stream.__anext__()
    await stream.__anext__()
    return stream

loop = asyncio.new_event_loop()
async_stream = loop.run_until_complete(open_one())

plain = instrument(httpx.Client(base_url=server.base_url))
request = plain.build_request("POST", "/chat/completions", json={"model": "plain-open", "messages": [], "stream": True})
plain_response = plain.send(request, stream=True)
plain_lines = plain_response.iter_lines()
next(plain_lines)
print("streams open; exiting", flush=True)
"""


def exit_run(
    tmp_path: Path, instrument: bool, finalizer_first: bool
) -> tuple[subprocess.CompletedProcess[str], Path]:
    path = tmp_path / f"traces-{instrument}-{finalizer_first}.jsonl"
    code = f"TRACES = {str(path)!r}\nINSTRUMENT = {instrument}\nFINALIZER_FIRST = {finalizer_first}\n"
    result = run_python(code + textwrap.dedent(EXIT_APP))
    assert result.returncode == 0, result.stderr
    assert "streams open; exiting" in result.stdout
    return result, path


def normalised(stderr: str) -> list[str]:
    return sorted(re.sub(r"0x[0-9a-f]+", "0x?", line) for line in stderr.splitlines())


def check_exit(tmp_path: Path, finalizer_first: bool) -> None:
    uninstrumented, _ = exit_run(tmp_path, instrument=False, finalizer_first=finalizer_first)
    result, path = exit_run(tmp_path, instrument=True, finalizer_first=finalizer_first)
    assert "Traceback" not in result.stderr, result.stderr
    # Whatever the SDK and the event loop say at exit with streams open, llmspans adds nothing to it.
    assert normalised(result.stderr) == normalised(uninstrumented.stderr)
    spans = spans_of(file_requests(path)) if path.exists() else []
    calls = {
        span["name"]: span["attributes"] for span in spans if span["attributes"].get(names.STAGE) == "llm"
    }
    assert set(calls) == {"chat sync-open", "chat async-open", "chat plain-open"}, [s["name"] for s in spans]
    for attributes in calls.values():
        assert attributes[names.STREAM_OUTCOME] == "abandoned"
    assert (
        collections.Counter(span["name"] for span in spans)["POST"] == 0
    )  # one attempt each: no attempt span


def test_exit_with_open_streams_flushes_their_spans(tmp_path: Path) -> None:
    check_exit(tmp_path, finalizer_first=False)


def test_exit_with_open_streams_flushes_them_whatever_came_before_configure(tmp_path: Path) -> None:
    check_exit(tmp_path, finalizer_first=True)


# --- uninstrument while calls are in flight ----------------------------------------------------------


async def test_uninstrument_while_calls_are_in_flight(captured: Captured) -> None:
    behaviour = Behavior(chunks=6, chunk_gap=0.03)
    with SimulatedServer(behaviour) as server:
        sync_client = llmspans.instrument(openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0))
        async_client = llmspans.instrument(
            openai.AsyncOpenAI(base_url=server.base_url, api_key="k", max_retries=0)
        )
        plain = llmspans.instrument(httpx.Client(base_url=server.base_url))
        sync_stream = sync_client.chat.completions.create(model="sync-stream", messages=MESSAGES, stream=True)
        async_stream = await async_client.chat.completions.create(
            model="async-stream", messages=MESSAGES, stream=True
        )
        plain_response = plain.send(
            plain.build_request(
                "POST", "/chat/completions", json={"model": "plain", "messages": [], "stream": True}
            ),
            stream=True,
        )
        plain_raw = plain_response.iter_raw()
        first = [next(sync_stream), await async_stream.__anext__(), next(plain_raw)]
        assert all(first)
        slow = {"x_sim": {"header_delay": 0.3}}
        started = threading.Event()

        def slow_call() -> Any:
            started.set()
            return sync_client.chat.completions.create(model="in-flight", messages=MESSAGES, extra_body=slow)

        pending = asyncio.get_running_loop().run_in_executor(None, slow_call)
        started.wait(5)
        await asyncio.sleep(0.1)  # the non-streamed call is waiting for its headers
        for client in (sync_client, async_client, plain):
            assert llmspans.uninstrument(client) is client

        rest = [chunk.model_dump() for chunk in sync_stream]
        rest += [chunk.model_dump() async for chunk in async_stream]
        plain_rest = b"".join(plain_raw)
        plain_response.close()
        answer = await pending
        assert len(rest) == 2 * (1 + 6 + 1) - 2  # role, six tokens, finish; minus the two read before
        assert plain_rest.endswith(b"data: [DONE]\n\n")
        assert answer.choices[0].message.content
        # After uninstrument(): no spans at all.
        sync_client.chat.completions.create(model="after", messages=MESSAGES)
        await async_client.close()
        sync_client.close()
        plain.close()

    calls = {s.name: s for s in captured.spans if (s.attributes or {}).get(names.STAGE) == "llm"}
    assert set(calls) == {"chat sync-stream", "chat async-stream", "chat plain", "chat in-flight"}
    for name in ("chat sync-stream", "chat async-stream", "chat plain"):
        assert calls[name].attributes[names.STREAM_OUTCOME] == "completed", name
        assert calls[name].attributes[names.STREAM_CHUNKS] == 6, name
    assert calls["chat in-flight"].status.status_code.name == "UNSET"
    assert len([s for s in captured.spans if s.name == "POST"]) == 0  # one attempt each
