"""The levers' workload (tests/support/levers_workload.py) with its metrics served for a real Prometheus:
`python -m tests.support.prometheus_levers_app METRICS_PORT SPANS_FILE`.

As tests/support/prometheus_app.py: one warm-up run first (every series then exists, so `increase()`
counts all of the measured run), `ready`, then on `go` the measured run, its spans written to SPANS_FILE,
and `done`; the app exits at the end of stdin.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from opentelemetry.exporter.otlp.json.common.trace_encoder import encode_spans

from llmspans.tools.simulator import Behavior, SimulatedServer
from tests.support import levers_workload
from tests.support.prometheus_app import serve_metrics_keep_spans


def main() -> int:
    port, spans_file = int(sys.argv[1]), Path(sys.argv[2])
    spans = serve_metrics_keep_spans(port)
    with SimulatedServer(Behavior(chunks=2, usage="finish")) as server:
        levers_workload.run(server.base_url)
        spans.clear()
        print("ready", flush=True)
        if sys.stdin.readline().strip() != "go":
            return 1
        levers_workload.run(server.base_url)
        spans_file.write_text(json.dumps(encode_spans(spans.get_finished_spans()).to_dict()) + "\n")
        print("done", flush=True)
        sys.stdin.read()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
