"""Where calls record: nothing while no provider is installed, the providers the application installs later.

Global providers can be set once per process, so each case runs in a process of its own against the
simulated server.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

BEFORE_AND_AFTER = """
import json
import openai
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import llmspans
from llmspans.tools.simulator import SimulatedServer

MESSAGES = [{"role": "user", "content": "hi"}]
lane = llmspans.Limiter(1, name="quiet-lane")


@llmspans.stage("work")
def work():
    return 42


found = {}
with SimulatedServer() as server:
    client = llmspans.instrument(openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0))
    limited = llmspans.instrument(
        openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0), limiter=lane
    )
    # No provider anywhere: the calls and the stage work, nothing is sent, the limiter still admits.
    client.chat.completions.create(model="m", messages=MESSAGES)
    for _ in client.chat.completions.create(model="m", messages=MESSAGES, stream=True):
        pass
    limited.chat.completions.create(model="m", messages=MESSAGES)
    found["stage"] = work()
    found["limiter"] = {"admitted": lane.stats().admitted, "in_flight": lane.in_flight}
    found["traceparents_before"] = [r.headers.get("traceparent") for r in server.requests]

    # The application installs its providers now: the next calls record into them.
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    trace.set_tracer_provider(tracer_provider)
    reader = InMemoryMetricReader()
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
    asked = len(server.requests)
    client.chat.completions.create(model="m", messages=MESSAGES)
    work()
    found["spans_after"] = sorted(span.name for span in spans.get_finished_spans())
    found["traceparents_after"] = [bool(r.headers.get("traceparent")) for r in server.requests[asked:]]
    data = reader.get_metrics_data()
    found["metrics_after"] = sorted(
        {m.name for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    )
print(json.dumps(found))
"""


def test_no_provider_records_nothing_and_a_provider_installed_later_is_picked_up() -> None:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(BEFORE_AND_AFTER)], capture_output=True, text=True, timeout=110
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["stage"] == 42
    assert found["limiter"] == {"admitted": 1, "in_flight": 0}  # admitted, and the slot given back
    assert found["traceparents_before"] == [None, None, None]
    assert found["spans_after"] == ["chat m", "work"]
    assert found["traceparents_after"] == [True]
    assert {
        "gen_ai.client.operation.duration",
        "llmspans.bucket.duration",
        "llmspans.stage.duration",
        "gen_ai.client.token.usage",
    } <= set(found["metrics_after"])
