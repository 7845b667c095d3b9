"""`llmspans report` under tail sampling names the bottleneck the whole run has, or says it cannot tell.

Issue 37's scenario (tests/support/sampled_scenario.py): 2,000 turns of a retrieval stage (7 % 30 ms, else
1 ms) and one non-streamed LLM call (2 % 250 ms, else 4 ms) against the simulator over real HTTP, with
`configure(traces_file=..., tail_sampling=TailSampling(ratio=0.01, slower_than="200ms"))` and a plain
processor writing every span to a second file, the truth. The run is recorded once per module (seed 1: the
slow turns and the trace ids); 5 %, 10 % and `slower_than="p95"` are the same run tail-sampled again
offline by the real `TailSamplingProcessor`, fed the recorded spans in the order they ended, with the live
run's metric points (which counted every call, whatever was kept). A replay at the live settings keeps
exactly what the live run kept, trace for trace: the offline runs are the live one's equals.

What each sampled report must show, against the whole recording's:
- counts within 1 % of the turns run (from the metric points in the same file);
- the verdict is the whole recording's, or `cannot tell`, never another part;
- each stage's and bucket's p95 within its stated interval, or within 1.5x of the whole recording's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

import llmspans
from llmspans import _names as names
from llmspans.__main__ import main
from llmspans.report._analysis import analyse_batches
from llmspans.report._sources.file import FileSource
from llmspans.report._sources.jaeger import JAEGER_TRACES_PATH
from tests.support import sampled_scenario as scenario
from tests.support.local_http import QuietHandler, serving
from tests.support.prometheus import SCRAPE_INTERVAL_S, cued_app, prometheus_server
from tests.support.realservers import free_ports

ROOT = Path(__file__).resolve().parents[1]
SEED = 1
TURNS = scenario.TURNS
# name -> the tail sampling of that report (the first is the live run's own)
SAMPLINGS = {
    "1%": llmspans.TailSampling(ratio=0.01, slower_than="200ms"),
    "5%": llmspans.TailSampling(ratio=0.05, slower_than="200ms"),
    "10%": llmspans.TailSampling(ratio=0.10, slower_than="200ms"),
    "p95": llmspans.TailSampling(ratio=0.01, slower_than="p95"),
}


@dataclass(frozen=True)
class Run:
    folder: Path
    whole: Path
    sampled: dict[str, Path]  # by SAMPLINGS' names

    def metric_lines(self) -> list[str]:
        return scenario.metric_lines(self.sampled["1%"])


def _record(folder: Path, *extra: str, turns: int = TURNS) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tests.support.sampled_scenario", str(folder), "--seed", str(SEED),
         "--turns", str(turns), *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    folder = tmp_path_factory.mktemp("sampled")
    _record(folder, "--ratio", "0.01", "--slower-than", "200ms")
    whole = folder / "whole.jsonl"
    sampled = {"1%": folder / "sampled.jsonl"}
    spans = list(scenario.readable_spans(whole))
    for name, sampling in [*list(SAMPLINGS.items())[1:], ("live", SAMPLINGS["1%"])]:
        sampled[name] = scenario.replay(spans, sampling, folder / f"replayed-{name}.jsonl", sampled["1%"])
    return Run(folder, whole, sampled)


def report_of(*paths: Path, **options: Any) -> dict[str, Any]:
    """`llmspans report PATHS --json`, as the command builds it (in this process: cheaper than a child)."""
    source = FileSource(list(paths), progress=False)
    report = analyse_batches(
        source.batches, sources=source.sources, skipped=lambda: tuple(source.skipped),
        metrics=lambda: source.metrics, **options,
    )  # fmt: skip
    return json.loads(json.dumps(report.to_dict()))  # as --json prints it


_reports: dict[tuple[str, ...], dict[str, Any]] = {}


def cached(*paths: Path) -> dict[str, Any]:
    key = tuple(map(str, paths))
    if key not in _reports:
        _reports[key] = report_of(*paths)
    return _reports[key]


def _verdict(report: dict[str, Any]) -> tuple[str, str] | None:
    triage = report["triage"]
    return (triage["dominant_kind"], triage["dominant"]) if triage["told"] else None


def _check_verdict(sampled: dict[str, Any], whole: dict[str, Any]) -> None:
    expected = _verdict(whole)
    assert expected is not None  # the whole recording always names one (its figures are every value's)
    got = _verdict(sampled)
    if got is None:
        assert sampled["triage"]["finding"] == "cannot_tell"
        assert "cannot tell" in sampled["triage"]["message"]
    else:
        assert got == expected, (sampled["triage"]["message"], whole["triage"]["message"])


def _check_p95(row: dict[str, Any], whole_p95: float, what: str) -> None:
    """Within the stated interval, or within 1.5x of the whole recording's (either way round)."""
    p95 = row["p95"]
    interval = next((i for i in row.get("intervals", ()) if i["quantile"] == "p95"), None)
    inside = interval is not None and interval["low"] - 1e-6 <= whole_p95 <= interval["high"] + 1e-6
    near = whole_p95 / 1.5 - 1e-4 <= p95 <= whole_p95 * 1.5 + 1e-4  # 0.1 ms: figures of 0 and 20 µs agree
    assert inside or near, (what, p95, interval, whole_p95)


# --- the offline sampling is the live one ------------------------------------------------------------


def _kept(path: Path) -> dict[str, float]:
    """trace id -> the weight its spans carry, of every trace in an OTLP-JSON lines file."""
    kept: dict[str, float] = {}
    for line in path.read_text().splitlines():
        for resource in json.loads(line).get("resourceSpans", []):
            for scope in resource["scopeSpans"]:
                for span in scope["spans"]:
                    for attribute in span["attributes"]:
                        if attribute["key"] == names.SAMPLE_WEIGHT:
                            kept[span["traceId"]] = attribute["value"]["doubleValue"]
    return kept


def test_a_replay_at_the_live_settings_keeps_what_the_live_run_kept(run: Run) -> None:
    live = _kept(run.sampled["1%"])
    assert _kept(run.sampled["live"]) == live
    assert 0 < sum(1 for weight in live.values() if weight == 100.0) < 0.03 * TURNS  # kept by chance: 1 %
    slow = sum(1 for plan in scenario.plans(SEED) if plan.answer_s == scenario.SLOW_ANSWER_S)
    assert sum(1 for weight in live.values() if weight == 1.0) >= slow  # every turn over 200 ms, kept whole


# --- what each sampled report must show ---------------------------------------------------------------


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_counts_come_from_what_counted_every_call(run: Run, sampling: str) -> None:
    report = cached(run.sampled[sampling])
    assert report["traces_read"] < TURNS / 2  # it was sampled
    stages = {row["stage"]: row["durations"]["count"] for row in report["stages"]}
    for count in (report["traces"], report["llm_calls"], stages["turn"], stages["retrieval"], stages["llm"]):
        assert abs(count - TURNS) <= 0.01 * TURNS, (sampling, count)
    assert all(abs(row["values"]["count"] - TURNS) <= 0.01 * TURNS for row in report["buckets"])
    assert report["notes"][0].startswith(f"sampled ({names.SAMPLE_WEIGHT}, tail sampling): counts and")


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_the_verdict_is_the_whole_recordings_or_cannot_tell(run: Run, sampling: str) -> None:
    _check_verdict(cached(run.sampled[sampling]), cached(run.whole))


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_each_p95_lies_in_its_interval_or_near_the_whole_recordings(run: Run, sampling: str) -> None:
    report, whole = cached(run.sampled[sampling]), cached(run.whole)
    whole_stages = {row["stage"]: row["durations"]["p95"] for row in whole["stages"]}
    for row in report["stages"]:
        _check_p95(row["durations"], whole_stages[row["stage"]], row["stage"])
    whole_buckets = {row["bucket"]: row["values"]["p95"] for row in whole["buckets"]}
    for row in report["buckets"]:
        _check_p95(row["values"], whole_buckets[row["bucket"]], row["bucket"])
    assert {row["stage"] for row in report["stages"]} == set(whole_stages)


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_the_parts_table_shows_the_figures_the_verdict_compared(run: Run, sampling: str) -> None:
    """Each trace here is one turn of one call and each stage once: the histograms give the per-trace parts,
    so "Where a request's time goes" says what the verdict weighed, not the kept traces' cruder estimate."""
    report = cached(run.sampled[sampling])
    parts = {(part["kind"], part["name"]): part["per_trace"] for part in report["parts"]}
    assert report["triage"]["compared"]
    for weighed in report["triage"]["compared"]:
        part = parts[(weighed["kind"], weighed["name"])]
        p95 = next(i for i in part["intervals"] if i["quantile"] == "p95")
        assert (part["p95"], p95["low"], p95["high"]) == (weighed["p95"], weighed["low"], weighed["high"])
    assert report["quantile_method"].startswith("stages, buckets and the per-trace parts")


# --- a traces-only pipeline ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def traces_only(run: Run) -> Path:
    """The 1 % file without its metric lines: an app that exports no metrics."""
    path = run.folder / "traces-only.jsonl"
    lines = run.sampled["1%"].read_text().splitlines()
    path.write_text("".join(line + "\n" for line in lines if not line.startswith('{"resourceMetrics"')))
    return path


def test_a_traces_only_pipeline_gets_estimates_with_intervals_and_says_counts_are_estimated(
    run: Run, traces_only: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report, whole = cached(traces_only), cached(run.whole)
    assert "counts are estimated" in report["notes"][0]
    assert report["traces"] != TURNS or report["traces_read"] < TURNS  # an estimate, from what was read
    _check_verdict(report, whole)
    whole_stages = {row["stage"]: row["durations"]["p95"] for row in whole["stages"]}
    for row in report["stages"]:
        assert row["durations"]["intervals"], row["stage"]
        _check_p95(row["durations"], whole_stages[row["stage"]], row["stage"])
    for part in report["parts"]:
        assert part["per_trace"]["intervals"], part["label"]
    code = main(["report", str(traces_only)])
    text = capsys.readouterr().out
    assert code == 0
    assert "counts are estimated" in " ".join(text.split())
    assert "p95 lies within:" in text
    assert max(len(line) for line in text.splitlines()) <= 100


# --- the same from several files, Jaeger, --baseline, HTML ---------------------------------------------


def test_spans_and_metrics_in_two_files_give_the_report_of_one(run: Run, tmp_path: Path) -> None:
    spans, metrics = tmp_path / "spans.jsonl", tmp_path / "metrics.jsonl"
    lines = run.sampled["1%"].read_text().splitlines()
    spans.write_text("".join(line + "\n" for line in lines if not line.startswith('{"resourceMetrics"')))
    metrics.write_text("".join(line + "\n" for line in lines if line.startswith('{"resourceMetrics"')))
    one, two = dict(cached(run.sampled["1%"])), report_of(spans, metrics)
    one.pop("sources")
    two.pop("sources")
    assert one == two


class _Jaeger(QuietHandler):
    def do_GET(self) -> None:
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        wanted = url.path == JAEGER_TRACES_PATH and query.get("query.serviceName") == [scenario.SERVICE]
        body = self.server.body if wanted else b'{"error":{"httpCode":404}}'  # type: ignore[attr-defined]
        self.reply(200 if wanted else 404, body, content_type=None)


def test_from_jaeger_the_kept_traces_give_the_traces_only_report(
    run: Run, traces_only: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    resource_spans = [
        resource
        for line in traces_only.read_text().splitlines()
        for resource in json.loads(line).get("resourceSpans", [])
    ]
    body = json.dumps({"result": {"resourceSpans": resource_spans}}).encode()
    with serving(_Jaeger, body=body) as jaeger:
        url = f"http://127.0.0.1:{jaeger.server_address[1]}"
        code = main(["report", "--jaeger", url, "--service", scenario.SERVICE, "--since", "2h", "--json"])
        from_jaeger = json.loads(capsys.readouterr().out)
    assert code == 0
    from_file = dict(cached(traces_only))
    assert from_jaeger.pop("sources") != from_file.pop("sources")
    assert from_jaeger == from_file
    _check_verdict(from_jaeger, cached(run.whole))


def test_the_baseline_of_the_whole_run_finds_no_change_in_its_sampled_self(
    run: Run, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same run both ways: every true change is 0, so none may come out real. The sampled side's
    stages and buckets come from histograms: each change's interval is the buckets' on that side."""
    code = main(["report", str(run.sampled["1%"]), "--baseline", str(run.whole), "--json"])
    compared = json.loads(capsys.readouterr().out)["comparison"]
    assert code == 0
    assert compared["changes"]
    for change in compared["changes"]:
        if change["kind"] in ("stage", "bucket"):
            assert change["low_s"] is not None, change
            assert change["verdict"] not in ("slower", "faster"), change
    whole = cached(run.whole)["triage"]
    assert (
        compared["dominant_before"]
        == f"{whole['dominant']} ({'llm bucket' if whole['dominant_kind'] == 'bucket' else 'stage'})"
    )


def test_the_html_page_says_what_the_text_says(run: Run, traces_only: Path, tmp_path: Path) -> None:
    for path in (run.sampled["1%"], traces_only):
        page = tmp_path / "report.html"
        assert main(["report", str(path), "--html", str(page), "--json"]) == 0
        html = page.read_text()
        report = cached(path)
        triage = report["triage"]
        assert f'data-finding="{triage["finding"]}"' in html
        if not triage["told"]:
            assert ">cannot tell</span>" in html
        assert 'class="interval"' in html  # where each estimated p95 lies
        assert report["notes"][0].split(":")[0] in html


# --- from Prometheus -----------------------------------------------------------------------------------

PROMETHEUS_TURNS = 400


def test_prometheus_gives_the_verdict_the_file_gives(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The scenario's app serves its metrics to a real Prometheus 2.42 (Debian's, scraping
    opentelemetry-exporter-prometheus every 0.5 s) and writes the same points to a file; its spans go through
    tail sampling to another. Both reports name the same part, or Prometheus cannot tell where the file's
    two largest parts lie within 1.5x of each other; never another part."""
    (port,) = free_ports(1)
    calls = 'sum(gen_ai_client_operation_duration_seconds_count{job="sampled"})'
    app_args = ["--seed", str(SEED), "--turns", str(PROMETHEUS_TURNS), "--metrics-file",
                str(tmp_path / "metrics.jsonl"), "--prometheus-port", str(port)]  # fmt: skip
    with (
        prometheus_server({"sampled": port}) as server,
        cued_app("tests.support.sampled_scenario", str(tmp_path), *app_args) as app,
    ):
        server.wait_for(calls, scenario.WARM_UP_TURNS)  # every series scraped before the measured turns
        started = time.time()
        app.stdin.write("go\n")
        app.stdin.flush()
        assert app.stdout.readline().strip() == "done"
        server.wait_for(calls, scenario.WARM_UP_TURNS + PROMETHEUS_TURNS)
        window = time.time() - started + SCRAPE_INTERVAL_S / 2
        # --tempo with --prometheus: Tempo is only where exemplars link to; the figures are Prometheus'
        code = main(["report", "--prometheus", server.url, "--service", "sampled", "--since", f"{window:.3f}s",
                     "--tempo", "http://127.0.0.1:9", "--json"])  # fmt: skip
        from_prometheus = json.loads(capsys.readouterr().out)
    assert code == 0
    from_file = report_of(tmp_path / "sampled.jsonl", tmp_path / "metrics.jsonl")
    assert (
        from_file["llm_calls"] == scenario.WARM_UP_TURNS + PROMETHEUS_TURNS
    )  # the metrics counted every call
    file_verdict, prometheus_verdict = _verdict(from_file), _verdict(from_prometheus)
    if file_verdict is not None and prometheus_verdict is not None:
        assert prometheus_verdict == file_verdict
    leader, runner_up = from_file["triage"]["compared"]
    if file_verdict is not None and leader["low"] > 1.5 * runner_up["high"]:
        assert prometheus_verdict == file_verdict, from_prometheus["triage"]["message"]
    if prometheus_verdict is None:
        assert "cannot tell" in from_prometheus["triage"]["message"]
    assert all(
        e["link"].startswith("http://127.0.0.1:9/api/v2/traces/")
        for e in from_prometheus.get("exemplars", [])
    )
