"""`llmspans report --prometheus`: a real Prometheus scrapes each demo scenario's app, and the triage it
computes from the metrics names the same dominant part as the span report of the same run.

Each scenario's app runs in a process of its own (tests/support/prometheus_app.py) with its metrics
served through `opentelemetry-exporter-prometheus`; Prometheus (Debian's 2.42) scrapes it every 0.5 s
under a job named after the scenario. Its spans go to a file, the span report's input.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from llmspans import _names as names
from llmspans.__main__ import main
from llmspans.report._compare import NO_INTERVAL
from llmspans.report._model import part_label
from llmspans.tools.demo import BUDGETS, SCENARIOS, TURN_BUDGET
from tests.support.local_http import QuietHandler, serving
from tests.support.prometheus import SCRAPE_INTERVAL_S, PrometheusServer, RunWindow, prometheus_server
from tests.support.prometheus_app import TURNS, WARM_UP_TURNS
from tests.support.realservers import free_ports

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class _App:
    """A scenario's app, warmed up and waiting for its cue."""

    scenario: str
    process: subprocess.Popen[str]
    spans: Path
    ready_at: float = 0.0
    """Wall clock when it said `ready`: its counters hold still from then until its cue."""


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[PrometheusServer, dict[str, _App]]]:
    """Prometheus, and every scenario's app started and warmed up at once (the warm-ups' timings do not
    matter); each test then runs one app's measured turns alone."""
    ports = dict(zip(SCENARIOS, free_ports(len(SCENARIOS)), strict=True))
    folder = tmp_path_factory.mktemp("prometheus-apps")
    with prometheus_server(ports) as server, contextlib.ExitStack() as stack:
        apps = {}
        for scenario, port in ports.items():
            spans = folder / f"{scenario}.jsonl"
            process = subprocess.Popen(
                [sys.executable, "-m", "tests.support.prometheus_app", scenario, str(port), str(spans)],
                cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            stack.callback(_stop, process)
            apps[scenario] = _App(scenario, process, spans)
        for app in apps.values():
            assert app.process.stdout is not None
            assert app.process.stdout.readline().strip() == "ready"
            app.ready_at = time.time()
        yield server, apps


def _stop(process: subprocess.Popen[str]) -> None:
    if process.stdin is not None:
        process.stdin.close()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _report(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    code = main(["report", *argv, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return dict(json.loads(out))


def _run(server: PrometheusServer, app: _App) -> RunWindow:
    """Run the app's measured turns once Prometheus has a scrape of its warm-up; the report window over
    them (`RunWindow`: a scrape from before them first in it, one from after them stored)."""
    stdin, stdout = app.process.stdin, app.process.stdout
    assert stdin is not None
    assert stdout is not None
    calls = f'gen_ai_client_operation_duration_seconds_count{{job="{app.scenario}"}}'
    window = server.window(calls, app.ready_at)
    stdin.write("go\n")
    stdin.flush()
    assert stdout.readline().split() == ["done", str(TURNS)]
    server.wait_for(f"sum({calls})", WARM_UP_TURNS + TURNS)
    return window


# The module's fixture starts Prometheus and every scenario's app, each warming up: 30 s quiet, over 120 s
# (pytest's default timeout here) at load 60. Only a bound on a hang.
@pytest.mark.timeout(600)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_prometheus_names_the_dominant_part_the_spans_name(
    scenario: str,
    scraped: tuple[PrometheusServer, dict[str, _App]],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    server, apps = scraped
    window = _run(server, apps[scenario])
    from_metrics = _report(
        capsys, "--prometheus", server.url, "--service", scenario, "--since", window.since()
    )
    stretch = window.stretch()
    from_spans = _report(capsys, str(apps[scenario].spans))

    assert from_spans["llm_calls"] == TURNS
    dominant = (from_spans["triage"]["dominant_kind"], from_spans["triage"]["dominant"])
    if from_metrics["triage"]["told"]:
        assert (from_metrics["triage"]["dominant_kind"], from_metrics["triage"]["dominant"]) == dominant, (
            from_metrics["triage"]["message"],
            from_spans["triage"]["message"],
        )
    else:  # the histograms' buckets could not tell the two largest apart: the spans' two largest are close
        first, second = sorted((part["per_trace"]["p95"] for part in from_spans["parts"]), reverse=True)[:2]
        assert first <= 1.5 * second, (from_metrics["triage"]["message"], from_spans["triage"]["message"])
        assert dominant in {(e["kind"], e["name"]) for e in from_metrics["triage"]["compared"]}
    # The run's whole rise, which increase() stretches towards the window's edges by at most `stretch`.
    most = math.ceil(TURNS * stretch)
    assert TURNS <= from_metrics["llm_calls"] <= most, stretch
    assert all(TURNS <= row["values"]["count"] <= most for row in from_metrics["buckets"]), stretch
    stages = {row["stage"]: row for row in from_metrics["stages"]}
    assert {stage: stages[stage]["budget"] for stage in BUDGETS} == BUDGETS
    assert stages[names.STAGE_TURN]["budget"] == TURN_BUDGET
    assert all(row["durations"]["max"] is None for row in from_metrics["stages"])  # histograms keep no max
    assert from_metrics["slowest"] == []
    (limiter,) = from_metrics["limiters"]
    assert limiter["cap"] == SCENARIOS[scenario].cap(4)
    if scenario == "retries":
        assert set(from_metrics["retries"]["causes"]) <= {"http_429", "http_503"}
        assert from_metrics["retries"]["attempts_per_success"] > 1.2
    if scenario == "queue":
        assert from_metrics["triage"]["finding"] == "queue"
        assert limiter["backlog_s"] > 0.5 * limiter["window_s"] * 0.5
        assert limiter["gap_fraction"] < 0.2
    if scenario == "healthy":  # the text and the page say where the figures came from
        page = tmp_path / "report.html"
        window_arg = f"{time.time() - window.start + 5:.3f}s"
        assert main(["report", "--prometheus", server.url, "--service", scenario, "--since", window_arg,
                     "--html", str(page)]) == 0  # fmt: skip
        text = capsys.readouterr().out
        assert "histogram_quantile over Prometheus histograms" in text
        assert "Slowest traces" not in text
        assert max(len(line) for line in text.splitlines()) <= 100
        html = page.read_text()
        assert html.count('class="stage-dist"') == len(from_metrics["stages"])
        assert 'class="max' not in html  # no max to draw
        # Two windows of one Prometheus, and a file against a window: each quantile lies in its bucket (a file's
        # figure is its own), so each change has the interval both sides allow (issue 37).
        for baseline in (f"{window_arg}@1s", str(apps[scenario].spans)):
            compared = _report(capsys, "--prometheus", server.url, "--service", scenario, "--since", window_arg,
                               "--baseline", baseline)["comparison"]  # fmt: skip
            stream = next(c for c in compared["changes"] if c["name"] == "stream" and c["quantile"] == "p95")
            assert stream["verdict"] != NO_INTERVAL
            assert stream["low_s"] <= stream["change_s"] <= stream["high_s"]
            assert stream["after_s"] > 0
            # The same run in a window 5 s longer: the part the metrics named for it (stream on a quiet
            # machine; first_token once a loaded machine delays the app's requests), or 'cannot tell' where
            # the histograms' buckets could not tell it from the runner-up.
            told = from_metrics["triage"]["told"]
            assert compared["dominant_after"] == part_label(*dominant) or (
                not told and compared["dominant_after"].startswith("cannot tell (")
            )
    if scenario == "stalled-scheduler":
        # The gauge's in-flight counts the idle holders too: Prometheus sees a full limiter, so it cannot
        # tell a stall from a cap too low; the span report, counting only LLM calls in flight, can.
        assert from_spans["triage"]["finding"] == "stalled_scheduler"
        assert from_metrics["triage"]["finding"] == "queue"


def test_the_queried_names_are_what_prometheus_makes_of_the_sdks() -> None:
    from llmspans.report._sources import prometheus as queried
    from tests.test_integrations import prometheus_label, prometheus_name

    histograms = {queried.STAGE_DURATION: names.METRIC_STAGE_DURATION,
                  queried.BUCKET_DURATION: names.METRIC_BUCKET_DURATION,
                  queried.OPERATION_DURATION: names.METRIC_OPERATION_DURATION}  # fmt: skip
    for name, metric in histograms.items():
        assert name == prometheus_name(metric, "s", "histogram")
    assert prometheus_name(names.METRIC_STAGE_BUDGET, "s", "gauge") == queried.STAGE_BUDGET
    for name, metric, unit in ((queried.BUDGET_EXCEEDED, names.METRIC_BUDGET_EXCEEDED, "{span}"),
                               (queried.RETRY_ATTEMPTS, names.METRIC_RETRY_ATTEMPTS, "{attempt}"),
                               (queried.CONNECT_NEW, names.METRIC_CONNECT_NEW, "{connection}")):  # fmt: skip
        assert name == prometheus_name(metric, unit, "counter")
    for name, metric in ((queried.LIMITER_IN_FLIGHT, names.METRIC_LIMITER_IN_FLIGHT),
                         (queried.LIMITER_CAP, names.METRIC_LIMITER_CAP),
                         (queried.VLLM_WAITING, names.METRIC_VLLM_NUM_REQUESTS_WAITING)):  # fmt: skip
        assert name == prometheus_name(metric, "{call}", "gauge")
    ratio = prometheus_name(names.METRIC_VLLM_KV_CACHE_USAGE, "1", "gauge")  # Prometheus 3 over OTLP
    assert re.fullmatch(queried.VLLM_KV_CACHE, ratio)
    assert re.fullmatch(queried.VLLM_KV_CACHE, ratio.removesuffix("_ratio"))  # a scrape of the exporter
    for label, key in ((queried.LABEL_STAGE, names.STAGE), (queried.LABEL_BUCKET, names.METRIC_ATTR_BUCKET),
                       (queried.LABEL_CAUSE, names.METRIC_ATTR_RETRY_CAUSE),
                       (queried.LABEL_LIMITER, names.LIMITER_NAME), (queried.LABEL_ERROR, names.ERROR_TYPE)):  # fmt: skip
        assert label == prometheus_label(key)


def test_an_unreachable_prometheus_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    (port,) = free_ports(1)
    code = main(["report", "--prometheus", f"http://127.0.0.1:{port}"])
    out, err = capsys.readouterr()
    assert (code, out, err.count("\n")) == (2, "", 1)
    assert err.startswith(f"llmspans report: cannot reach Prometheus at http://127.0.0.1:{port}")


class _ExemplarsOnly(QuietHandler):
    """A Prometheus API with five turns of 5 s and nothing else, and two exemplars in the shape of
    Prometheus' `query_exemplars` answer, so the report lists the traces behind them (their trace ids
    `server.trace_ids` when the server has them)."""

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        path, query = url.path, parse_qs(url.query).get("query", [""])[0]
        if path == "/api/v1/query_exemplars":
            first, second = getattr(self.server, "trace_ids", ("aa" * 16, "bb" * 16))
            data: Any = [{
                "seriesLabels": {"__name__": "llmspans_stage_duration_seconds_bucket", "llmspans_stage": "tool"},
                "exemplars": [
                    {"labels": {"trace_id": first}, "value": "2.5", "timestamp": 1.0},
                    {"labels": {"trace_id": second}, "value": "0.75", "timestamp": 2.0},
                ],
            }]  # fmt: skip
        elif path == "/api/v1/query_range":
            data = {"resultType": "matrix", "result": []}
        else:
            turns = [{"metric": {"llmspans_stage": "turn"}, "value": [1.0, "5"]}]
            data = {"resultType": "vector", "result": turns if "llmspans_stage_duration" in query else []}
        self.reply(200, json.dumps({"status": "success", "data": data}).encode())


def test_exemplars_stand_in_for_the_slowest_traces(capsys: pytest.CaptureFixture[str]) -> None:
    with serving(_ExemplarsOnly) as api:
        url = f"http://127.0.0.1:{api.server_address[1]}"
        code = main(["report", "--prometheus", url, "--jaeger", "http://jaeger:16686", "--since", "10m"])
    out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    assert "Slow requests (exemplars" in out
    slow = out.split("histogram points)\n", 1)[1].splitlines()
    assert slow[0].split() == ["2.50", "s", "tool", "(stage)", f"http://jaeger:16686/trace/{'aa' * 16}"]
    assert slow[1].split()[-1] == f"http://jaeger:16686/trace/{'bb' * 16}"


# --- vLLM's own histograms, without tracing ------------------------------------------------------------


@pytest.mark.parametrize("family", ["0.10", "0.32/0.33"])
def test_without_server_spans_vllms_own_histograms_give_the_server_side(family: str) -> None:
    """Prometheus scraping a vLLM server (the simulator, by release): the report reads vLLM's queue, prefill,
    time-to-first-token and between-token histograms over the window, per model, with the between-token
    series each release has (`inter_token_latency_seconds` from 0.11, `time_per_output_token_seconds`
    before), and says so in the triage's first_token advice when no server span split it."""
    import openai

    from llmspans.report._sources.prometheus import query_report
    from tests.support.vllm_sim import FAMILIES, EngineConfig, VLLMSimulator

    config = EngineConfig(version=FAMILIES[family], prefill_per_token=0.01, decode_per_token=0.005)
    with VLLMSimulator(config) as sim, prometheus_server({"vllm": sim.port}) as prometheus:
        client = openai.OpenAI(base_url=sim.base_url, api_key="x", max_retries=0)

        def ask(times: int) -> None:
            for _ in range(times):
                for _chunk in client.chat.completions.create(
                    model=config.model, messages=[{"role": "user", "content": "one two three four"}],
                    stream=True, max_tokens=4,
                ):  # fmt: skip
                    pass

        ask(1)  # the series exist before the measured calls: increase() counts from a first scrape
        served = "sum(vllm:request_queue_time_seconds_count)"
        prometheus.wait_for(served, 1)
        started = time.time()
        ask(5)
        prometheus.wait_for(served, 6)
        window_s = time.time() - started + SCRAPE_INTERVAL_S
        report = query_report(prometheus.url, service=None, window_s=window_s)
        # increase() stretches the rise between the window's first and last scrape towards its edges, by up
        # to 1.1 scrape intervals each side: with n scrapes in the window, by at most 1 + 2.2 / (n - 1). A
        # busy machine scrapes less often than asked, so the bound is read from the scrapes there were.
        ((_, scrapes),) = prometheus.query(
            f"max(count_over_time(vllm:request_queue_time_seconds_count[{round(window_s * 1000)}ms]))"
        )
    (histograms,) = report.server_histograms
    assert histograms.model == config.model
    most = 5 * (1 + 2.2 / max(1, scrapes - 2))  # one scrape fewer: the report's query ran a moment earlier
    for distribution in (histograms.queue, histograms.prefill, histograms.time_to_first_token):
        assert distribution is not None
        assert 5 <= distribution.count <= max(8, most), (distribution.count, scrapes)
    # Every request's queue and prefill (40 ms) fell in the first bucket (vLLM's are coarse: 0.3 s), where
    # histogram_quantile would interpolate figures of the bucket, not the data: each quantile is the bound.
    for distribution in (histograms.queue, histograms.prefill):
        assert distribution is not None
        assert (distribution.p50, distribution.p95, distribution.p99) == (0.3, 0.3, 0.3)
        assert [(b.quantile, b.lower, b.upper) for b in distribution.bounds] == [
            ("p50", 0.0, 0.3), ("p95", 0.0, 0.3), ("p99", 0.0, 0.3),
        ]  # fmt: skip
    assert histograms.inter_token is not None
    expected = (
        "vllm:time_per_output_token_seconds" if family == "0.10" else "vllm:inter_token_latency_seconds"
    )
    assert histograms.inter_token_metric == expected
    from llmspans.report._html import render as render_html
    from llmspans.report._text import render

    text = render(report)
    assert f"vLLM's own histograms for model {config.model}" in text
    (prefill,) = [line for line in text.splitlines() if line.startswith("  prefill")]
    assert prefill.split()[2:] == ["≤", "300", "ms"] * 3 + ["n/a"]
    assert "≤ X: the quantile falls in" in text
    bounds = report.to_dict()["server_histograms"][0]["prefill"]["bounds"]
    assert bounds[0] == {"quantile": "p50", "lower": 0.0, "upper": 0.3}
    page = render_html(report)
    assert '<td data-bound="0.300000">≤ 300 ms (first bucket)</td>' in page
    assert '<section id="server-histograms">' in page


def test_a_quantile_in_a_bucket_wider_than_itself_is_only_its_bound() -> None:
    """histogram_quantile's linear interpolation inside a bucket gives a figure of the bucket, not of the
    data, where the bucket is wider than the figure (always the first, which starts at 0); elsewhere the
    interpolation stands."""
    from llmspans.report._sources.prometheus import _bounded
    from llmspans.report._triage import _from_histograms

    edges = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0]
    prefill = _bounded(9, {0.5: 0.15, 0.95: 0.285, 0.99: 0.297}, edges)
    assert (prefill.p50, prefill.p95, prefill.p99) == (0.3, 0.3, 0.3)
    assert all(bound.first_bucket for bound in prefill.bounds)
    queue = _bounded(
        9, {0.5: 0.4, 0.95: 1.52, 0.99: 1.9}, edges
    )  # (0.3, 0.5] and (1.5, 2.0]: narrower than them
    assert (queue.p50, queue.p95, queue.p99, queue.bounds) == (0.4, 1.52, 1.9, ())
    ttft = _bounded(9, {0.5: 0.003, 0.95: 0.0035, 0.99: 0.02}, [0.001, 0.005, 0.01, 0.02, 0.04])
    assert [(b.quantile, b.lower, b.upper) for b in ttft.bounds] == [
        ("p50", 0.001, 0.005),
        ("p95", 0.001, 0.005),
    ]
    assert ttft.p99 == 0.02  # (0.01, 0.02] is narrower than 0.02
    from llmspans.report._model import ServerHistograms, format_quantile

    assert format_quantile(prefill, "p95") == "≤ 300 ms (first bucket)"
    assert format_quantile(ttft, "p50") == "≤ 5.0 ms (bucket from 1.0 ms)"
    assert format_quantile(queue, "p95", short=True) == "1.52 s"
    advice = _from_histograms((ServerHistograms("m", queue, prefill, None, None, None),))
    assert advice == " (vLLM's histograms at p95: m: queue 1.52 s, prefill ≤ 300 ms (first bucket))"
