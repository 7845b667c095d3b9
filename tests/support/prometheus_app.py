"""One demo scenario's app with its metrics served for a real Prometheus to scrape, its spans kept for the
span report: `python -m tests.support.prometheus_app SCENARIO METRICS_PORT SPANS_FILE`.

The metrics go through the app's own MeterProvider with `opentelemetry-exporter-prometheus`'s reader (a
scrape, as Debian's Prometheus 2.42 has no OTLP receiver), served on 127.0.0.1. A few warm-up turns come
first, against the same simulated server (same port, so the same `server_port` label), so that every
series exists before the measured run: Prometheus' `increase()` cannot count what a series held when it
was first scraped. Then, on stdin's cue:

    ready            (printed: warm-up done, series exist)
    go               (read: run the measured turns)
    done N           (printed: N turns run, their spans written to SPANS_FILE as one OTLP-JSON line)
    <end of stdin>   (the app exits)
"""

from __future__ import annotations

import gc
import itertools
import json
import socket
import sys
from pathlib import Path
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.exporter.otlp.json.common.trace_encoder import encode_spans
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import start_http_server

from llmspans.tools import demo as _demo
from llmspans.tools.demo import SCENARIOS, run
from llmspans.tools.simulator import SimulatedServer

WARM_UP_TURNS = 4
TURNS = 20
CONCURRENCY = 4
SEED = 11


def serve_metrics_keep_spans(port: int) -> InMemorySpanExporter:
    """The app's global providers: metrics served on 127.0.0.1:`port` for Prometheus, spans kept in memory."""
    metrics.set_meter_provider(MeterProvider(metric_readers=[PrometheusMetricReader()]))
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    trace.set_tracer_provider(provider)
    start_http_server(port, addr="127.0.0.1")
    return spans


def main() -> int:
    scenario, port, spans_file = SCENARIOS[sys.argv[1]], int(sys.argv[2]), Path(sys.argv[3])
    spans = serve_metrics_keep_spans(port)
    # Both runs' simulated servers on the same ports: each run starts its own (one per replica, in order), and
    # the port is a metric label.
    llm_ports = []
    for _ in range(scenario.replicas):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            llm_ports.append(probe.getsockname()[1])
    started = itertools.count()

    def simulated_server(*args: Any, **kwargs: Any) -> SimulatedServer:
        return SimulatedServer(*args, port=llm_ports[next(started) % len(llm_ports)], **kwargs)

    _demo.SimulatedServer = simulated_server  # type: ignore[misc]

    run(scenario, requests=WARM_UP_TURNS, concurrency=CONCURRENCY, seed=SEED + 1)
    gc.collect()  # the warm-up's limiter: a collected limiter stops reporting its gauges
    spans.clear()
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 1
    run(scenario, requests=TURNS, concurrency=CONCURRENCY, seed=SEED)
    spans_file.write_text(json.dumps(encode_spans(spans.get_finished_spans()).to_dict()) + "\n")
    print(f"done {TURNS}", flush=True)
    sys.stdin.read()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
