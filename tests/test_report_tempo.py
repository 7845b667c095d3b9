"""`llmspans report --tempo URL`: the report from Tempo's HTTP API equals the report from the file that was
sent to Tempo, over real HTTP against a Tempo stand-in on 127.0.0.1 (tests/support/tempo.py) that serves
that same file: the search, both trace-by-id paths, 404s, a tenant, a bearer token, a slow answer."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from llmspans import _names as names
from llmspans.report._sources.tempo import CONCURRENCY, fetch_tempo
from llmspans.report._spans import ReportInputError
from tests.support.local_http import serving
from tests.support.tempo import TempoHandler, tempo_server
from tests.test_report import _closed_port, run_cli

FIXTURES = Path(__file__).parent / "fixtures"
RECORDED = [FIXTURES / "embedded-default.jsonl", FIXTURES / "vllm-server.jsonl"]
SERVICE = "llmspans-demo-queue"
OTHER = "other-app"
WEIGHT = "llmspans.sample.weight"  # issue "Keep every slow trace": kept spans say their weight
SECRET = "s3cr3t-t0ken-never-printed"


def _shifted(paths: list[Path], to_ns: int) -> list[dict[str, Any]]:
    """The recorded lines, moved in time so that the last span ends at `to_ns`."""
    lines = [json.loads(line) for path in paths for line in path.read_text().splitlines() if line.strip()]
    spans = [
        s for d in lines for rs in d.get("resourceSpans", []) for ss in rs["scopeSpans"] for s in ss["spans"]
    ]
    shift = to_ns - max(int(span["endTimeUnixNano"]) for span in spans)
    for span in spans:
        for key in ("startTimeUnixNano", "endTimeUnixNano"):
            span[key] = str(int(span[key]) + shift)
        for event in span.get("events", []):
            event["timeUnixNano"] = str(int(event["timeUnixNano"]) + shift)
    return lines


def _weigh(lines: list[dict[str, Any]]) -> None:
    """Every span of every other trace says it stands for 10 (a tail sampler's kept share)."""
    traces = sorted({s["traceId"] for d in lines for rs in d.get("resourceSpans", []) for ss in rs["scopeSpans"]
                     for s in ss["spans"]})  # fmt: skip
    weighed = set(traces[::2])
    for d in lines:
        for rs in d.get("resourceSpans", []):
            for ss in rs["scopeSpans"]:
                for span in ss["spans"]:
                    if span["traceId"] in weighed:
                        span.setdefault("attributes", []).append(
                            {"key": WEIGHT, "value": {"doubleValue": 10.0}}
                        )


def _other_service_trace(at_ns: int) -> dict[str, Any]:
    """One slow trace of another service: in Tempo, but never in this service's report."""
    trace_id, ms = "00000000000000000000000000abcdef", 1_000_000
    spans = [
        {"traceId": trace_id, "spanId": "00000000000000a1", "parentSpanId": "", "name": "turn chat", "kind": 1,
         "startTimeUnixNano": str(at_ns), "endTimeUnixNano": str(at_ns + 9000 * ms),
         "attributes": [{"key": names.STAGE, "value": {"stringValue": "turn"}}], "status": {}},
        {"traceId": trace_id, "spanId": "00000000000000a2", "parentSpanId": "00000000000000a1", "name": "chat m",
         "kind": 3, "startTimeUnixNano": str(at_ns), "endTimeUnixNano": str(at_ns + 8000 * ms),
         "attributes": [{"key": names.STAGE, "value": {"stringValue": names.STAGE_LLM}},
                        *({"key": names.BUCKET_PREFIX + b, "value": {"doubleValue": 8.0 if b == "stream" else 0.0}}
                          for b in names.BUCKETS)],
         "status": {"code": 2}},
    ]  # fmt: skip
    return {"resourceSpans": [{"resource": {"attributes": [{"key": "service.name", "value": {"stringValue": OTHER}}]},
                               "scopeSpans": [{"scope": {"name": "llmspans"}, "spans": spans}]}]}  # fmt: skip


@pytest.fixture(scope="module")
def traces_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The file an app and its vLLM server sent to Tempo: the demo's queue run and vLLM's spans, ended a
    minute ago, half the traces weighted, plus another service's trace. Its spans only: Tempo keeps no
    metric points, and a weighted file that has them takes its counts from them (tests/test_report_sampled.py)."""
    now_ns = time.time_ns()
    lines = [line for line in _shifted(RECORDED, now_ns - 60 * 10**9) if "resourceSpans" in line]
    _weigh(lines)
    lines.append(_other_service_trace(now_ns - 120 * 10**9))
    path = tmp_path_factory.mktemp("tempo") / "traces.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.fixture
def tempo(traces_file: Path) -> Iterator[ThreadingHTTPServer]:
    with tempo_server([traces_file]) as server:
        yield server


def url_of(server: ThreadingHTTPServer) -> str:
    return str(server.url)  # type: ignore[attr-defined]


def _without_source(report: dict[str, Any]) -> dict[str, Any]:
    report = dict(report)
    report.pop("sources")
    return report


def _text_body(text: str) -> str:
    """The text report without its 'from SOURCE' lines (the one thing that differs by design)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("quantiles:"))
    return "\n".join([lines[0], *lines[start:]])


# --- the same report --------------------------------------------------------------------------------


@pytest.mark.parametrize("v2", [True, False], ids=["v2", "v1-fallback"])
def test_the_report_from_tempo_equals_the_report_from_the_file(
    traces_file: Path, capsys: pytest.CaptureFixture[str], v2: bool
) -> None:
    with tempo_server([traces_file], v2=v2) as tempo:
        for output in (["--json"], []):
            code, from_file, err = run_cli(capsys, "report", str(traces_file), "--service", SERVICE, *output)
            assert code == 0, err
            code, from_tempo, err = run_cli(
                capsys, "report", "--tempo", url_of(tempo), "--service", SERVICE, "--since", "1h", *output
            )
            assert (code, err) == (0, ""), err
            if output:
                file_report, tempo_report = json.loads(from_file), json.loads(from_tempo)
                assert _without_source(file_report) == _without_source(tempo_report)
                assert tempo_report["sources"] == [
                    f"Tempo {url_of(tempo)} (service {SERVICE!r}, last 1h: 10 of 10 traces found)"
                ]
                # what the equality covers: every figure of a real run, its server split and its slowest
                # half the traces stand for ten each (weight 10): 5 + 5 x 10, read from 10
                assert (file_report["traces_read"], file_report["traces"]) == (10, 55)
                assert file_report["triage"]["dominant"] == "queue"
                assert file_report["server"]["calls"] == 55
                assert len(file_report["slowest"]) == 5
            else:
                assert _text_body(from_file) == _text_body(from_tempo)
                # 10 traces read, half standing for ten: an estimate, but queue stands apart beyond its interval
                assert (
                    "Dominant at p95: queue (llm bucket), 570 ms per request (540 ms to 668 ms)" in from_tempo
                )
                assert f"from Tempo {url_of(tempo)}" in from_tempo
        paths = [path for path, _, _ in tempo.requests]  # type: ignore[attr-defined]
    assert paths.count("/api/search") == 2  # one search per report
    v2_asked = sum(path.startswith("/api/v2/traces/") for path in paths)
    v1_asked = sum(path.startswith("/api/traces/") for path in paths)
    if v2:
        assert (v2_asked, v1_asked) == (20, 0)
    else:  # a Tempo before 2.6: after v2's 404 and v1's answer, only v1 is asked
        assert v1_asked == 20
        assert 1 <= v2_asked <= 2 * CONCURRENCY


def test_the_weights_arrive_unchanged(
    traces_file: Path, tempo: ThreadingHTTPServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The weight attribute of issue "Keep every slow trace" reaches the analysis as the file has it: the
    same spans with the same attributes, read from base64 ids and Tempo's JSON mapping. (Read here even
    before the weighted report reads it, so that this holds whichever branch lands first.)"""
    from llmspans.report import _spans
    from tests.support.report_files import read_spans

    monkeypatch.setattr(_spans, "REPORTED_ATTRIBUTES", _spans.REPORTED_ATTRIBUTES | {WEIGHT})
    from_tempo = fetch_tempo(url_of(tempo), SERVICE, 3600)
    tempo_spans = sorted((s for t in from_tempo.traces for s in t), key=lambda s: s.span_id)
    read = {t[0].trace_id for t in from_tempo.traces}
    file_spans = sorted(
        (s for s in read_spans([traces_file]).spans if s.trace_id in read), key=lambda s: s.span_id
    )
    assert len(tempo_spans) == len(file_spans) == 90
    assert tempo_spans == file_spans
    weighed = [s for s in tempo_spans if s.attributes.get(WEIGHT) == 10.0]
    assert 0 < len(weighed) < len(tempo_spans)
    assert {s.trace_id for s in weighed} == {
        s.trace_id for s in file_spans if s.attributes.get(WEIGHT) == 10.0
    }


def test_the_search_asks_tempo_for_one_service_window_and_limit(
    tempo: ThreadingHTTPServer, capsys: pytest.CaptureFixture[str]
) -> None:
    before = time.time()
    code, out, err = run_cli(capsys, "report", "--tempo", url_of(tempo) + "/", "--service", SERVICE, "--json")
    after = time.time()
    assert (code, err) == (0, "")
    assert json.loads(out)["traces_read"] == 10  # the other service's trace is not asked for
    (search,) = [(p, q) for p, q, _ in tempo.requests if p == "/api/search"]  # type: ignore[attr-defined]
    query = search[1]
    assert query["q"] == f'{{ resource.service.name = "{SERVICE}" }}'
    assert query["limit"] == "500"
    assert before - 3600 - 1 <= int(query["start"]) <= after - 3600
    assert before <= int(query["end"]) <= after + 2


def test_limit_reads_at_most_that_many_traces_the_most_recent(
    traces_file: Path, tempo: ThreadingHTTPServer, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out, err = run_cli(capsys, "report", "--tempo", url_of(tempo), "--service", SERVICE, "--limit", "3",
                             "--json")  # fmt: skip
    assert (code, err) == (0, "")
    report = json.loads(out)
    assert report["traces_read"] == 3
    assert report["sources"][0].endswith(
        "last 1h: 3 of 3 traces found; the search's limit, the window may hold more (--limit N))"
    )
    searches = [q for p, q, _ in tempo.requests if p == "/api/search"]  # type: ignore[attr-defined]
    assert [q["limit"] for q in searches] == ["3"]
    fetched = [p for p, _, _ in tempo.requests if p.startswith("/api/v2/traces/")]  # type: ignore[attr-defined]
    assert len(fetched) == 3
    # the same three traces, written to a file of their own, give the same report
    newest = {t.trace_id for t in tempo.found(SERVICE, 0, 2**40)[:3]}  # type: ignore[attr-defined]
    kept = []
    for line in traces_file.read_text().splitlines():
        document = json.loads(line)
        for rs in document.get("resourceSpans", []):
            for ss in rs["scopeSpans"]:
                ss["spans"] = [s for s in ss["spans"] if s["traceId"] in newest]
        kept.append(json.dumps(document))
    subset = tmp_path / "three.jsonl"
    subset.write_text("\n".join(kept) + "\n")
    code, from_file, _ = run_cli(capsys, "report", str(subset), "--service", SERVICE, "--json")
    assert code == 0
    file_report = json.loads(from_file)
    assert _without_source(file_report) == _without_source(report)


def test_a_trace_gone_from_tempo_is_counted_and_skipped(
    traces_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with tempo_server([traces_file]) as tempo:
        found = tempo.found(SERVICE, 0, 2**40)  # type: ignore[attr-defined]
        tempo.vanished = {found[0].trace_id, found[4].trace_id}  # type: ignore[attr-defined]
        code, out, err = run_cli(capsys, "report", "--tempo", url_of(tempo), "--service", SERVICE, "--json")
    assert (code, err) == (0, "")
    report = json.loads(out)
    assert report["traces_read"] == 8
    assert report["sources"][0].endswith("last 1h: 8 of 10 traces found)")
    assert (
        "2 of the 10 traces Tempo's search found were gone when fetched (HTTP 404): skipped"
        in report["notes"]
    )
    with tempo_server([traces_file], v2=False) as tempo:  # a gone trace on a Tempo before 2.6: 404 on both
        tempo.vanished = {found[0].trace_id}  # type: ignore[attr-defined]
        code, out, err = run_cli(capsys, "report", "--tempo", url_of(tempo), "--service", SERVICE, "--json")
    assert (code, err) == (0, "")
    assert json.loads(out)["traces_read"] == 9


def test_a_search_that_finds_nothing_is_an_empty_report_not_an_error(
    tempo: ThreadingHTTPServer, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(capsys, "report", "--tempo", url_of(tempo), "--service", "nobody")
    assert (code, err) == (0, "")
    assert "No llmspans traces found: nothing to report." in out
    assert """note: Tempo's search found no trace of service 'nobody' in the last 1h""" in out
    code, out, err = run_cli(capsys, "report", "--tempo", url_of(tempo), "--service", "nobody", "--json")
    assert (code, err) == (0, "")
    assert json.loads(out)["traces"] == 0


def test_the_tenant_header_from_the_option_or_the_environment(
    traces_file: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with tempo_server([traces_file], tenant="team-a") as tempo:
        code, out, err = run_cli(capsys, "report", "--tempo", url_of(tempo), "--service", SERVICE)
        assert (code, out) == (2, "")
        assert (
            err == f"llmspans report: Tempo at {url_of(tempo)} answered HTTP 401 to /api/search: no org id\n"
        )
        code, out, err = run_cli(
            capsys,
            "report",
            "--tempo",
            url_of(tempo),
            "--service",
            SERVICE,
            "--tempo-tenant",
            "team-a",
            "--json",
        )
        assert (code, err) == (0, "")
        assert json.loads(out)["traces_read"] == 10
        monkeypatch.setenv("LLMSPANS_TEMPO_TENANT", "team-a")
        code, out, err = run_cli(capsys, "report", "--tempo", url_of(tempo), "--service", SERVICE, "--json")
        assert (code, err) == (0, "")
        assert json.loads(out)["traces_read"] == 10
        tenants = {headers.get("X-Scope-OrgID") for _, _, headers in tempo.requests}  # type: ignore[attr-defined]
    assert tenants == {None, "team-a"}


def test_credentials_arrive_and_are_never_printed(
    traces_file: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with tempo_server([traces_file], token=SECRET) as tempo:
        url = url_of(tempo)
        code, out, err = run_cli(capsys, "report", "--tempo", url, "--service", SERVICE)
        assert (code, out) == (2, "")
        assert "answered HTTP 401 to /api/search: unauthorized" in err
        html = tmp_path / "report.html"
        for argv in (["--header", f"Authorization: Bearer {SECRET}"], []):
            if not argv:
                monkeypatch.setenv("LLMSPANS_TEMPO_HEADERS", f"authorization=Bearer%20{SECRET}")
            for output in (["--json"], ["--html", str(html)], []):
                code, out, err = run_cli(
                    capsys, "report", "--tempo", url, "--service", SERVICE, *argv, *output
                )
                assert code == 0, err
                assert "10 traces" in out or json.loads(out)["traces_read"] == 10
                assert SECRET not in out + err
            assert SECRET not in html.read_text()
        authorizations = {h.get("Authorization") for _, _, h in tempo.requests}  # type: ignore[attr-defined]
        assert authorizations == {None, f"Bearer {SECRET}"}
        # an answer that echoes the header back (a proxy's error page) is blanked before it is printed
        tempo.status, tempo.body = 502, f"bad gateway for Bearer {SECRET}".encode()  # type: ignore[attr-defined]
        code, out, err = run_cli(capsys, "report", "--tempo", url, "--service", SERVICE, "--header",
                                 f"Authorization: Bearer {SECRET}")  # fmt: skip
    assert (code, out) == (2, "")
    assert (
        err
        == f"llmspans report: Tempo at {url} answered HTTP 502 to /api/search: bad gateway for (redacted)\n"
    )


def test_a_slow_tempo_is_read_a_few_traces_at_a_time(
    traces_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with tempo_server([traces_file], delay_s=0.5) as tempo:
        code, out, err = run_cli(capsys, "report", "--tempo", url_of(tempo), "--service", SERVICE, "--json")
        most = tempo.most_in_flight  # type: ignore[attr-defined]
    assert (code, err) == (0, "")
    assert json.loads(out)["traces_read"] == 10
    assert 2 <= most <= CONCURRENCY  # fetched side by side, never more than the fixed concurrency


def test_an_answer_later_than_the_timeout_is_a_one_line_error(traces_file: Path) -> None:
    with tempo_server([traces_file], delay_s=2.0) as tempo, pytest.raises(ReportInputError) as raised:
        fetch_tempo(url_of(tempo), SERVICE, 3600, timeout_s=0.3)
    message = str(raised.value)
    assert re.fullmatch(
        rf"Tempo at {url_of(tempo)} did not answer /api/v2/traces/[0-9a-f]+ within 0\.3 s", message
    )


# --- errors: one line, exit code 2 ------------------------------------------------------------------


def test_unreachable_tempo_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    code, out, err = run_cli(capsys, "report", "--tempo", url, "--service", SERVICE)
    assert (code, out) == (2, "")
    assert err.count("\n") == 1
    assert err.startswith(f"llmspans report: cannot reach Tempo at {url}: ")


@pytest.mark.parametrize(
    ("status", "body", "problem"),
    [
        (
            500,
            b"internal error: querier unavailable\n",
            "answered HTTP 500 to /api/search: internal error: querier",
        ),
        (
            400,
            b"range specified by start and end exceeds 168h0m0s",
            "answered HTTP 400 to /api/search: range",
        ),
        (200, b"<html>Grafana</html>", "answered /api/search with something that is not JSON"),
        (200, b'{"data": {"result": []}, "status": "success"}', "JSON that is not a Tempo search result"),
        (200, b'{"traces": {"a": 1}}', "JSON that is not a Tempo search result"),
        (200, b'{"traces": [{"traceID": "not-hex!"}]}', "a trace id that is not hex: 'not-hex!'"),
    ],
)
def test_tempo_answering_an_error_or_something_else_is_a_one_line_error(
    tempo: ThreadingHTTPServer, capsys: pytest.CaptureFixture[str], status: int, body: bytes, problem: str
) -> None:
    tempo.status, tempo.body = status, body  # type: ignore[attr-defined]
    code, out, err = run_cli(capsys, "report", "--tempo", url_of(tempo), "--service", SERVICE)
    assert (code, out) == (2, "")
    assert err.count("\n") == 1
    assert err.startswith(f"llmspans report: Tempo at {url_of(tempo)} "), err
    assert problem in err, err


class _BrokenTraces(TempoHandler):
    """Tempo's search, and then a trace answer that is not Tempo's trace JSON."""

    def _trace(self, server: Any, trace_id: str, version: int) -> None:
        status, body = server.trace_answer
        if status == 404:  # a Tempo before 2.6, whose older path answers something else
            if version == 2:
                return self._send(404, b"404 page not found\n", "text/plain")
            status = 200
        self._send(status, body, "application/json")


@pytest.mark.parametrize(
    ("answer", "problem"),
    [
        ((500, b"boom"), "answered HTTP 500 to /api/v2/traces/<id>: boom"),
        ((503, b"busy"), "answered HTTP 503 to /api/v2/traces/<id>: busy"),
        ((200, b"not json"), "answered /api/v2/traces/"),
        ((200, b'{"spans": []}'), "with JSON that is not a Tempo trace"),
        ((200, b'{"trace": {"spans": 3}}'), "with JSON that is not OTLP"),
        ((404, b'{"nothing": 1}'), "answered /api/traces/"),
    ],
)
def test_a_trace_answer_that_is_not_tempos_is_a_one_line_error(
    traces_file: Path, capsys: pytest.CaptureFixture[str], answer: tuple[int, bytes], problem: str
) -> None:
    with tempo_server([traces_file], handler=_BrokenTraces, trace_answer=answer) as server:
        url = url_of(server)
        code, out, err = run_cli(capsys, "report", "--tempo", url, "--service", SERVICE)
    assert (code, out) == (2, "")
    assert err.count("\n") == 1, err
    assert err.startswith(f"llmspans report: Tempo at {url} "), err
    assert problem in err, err


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["--tempo", "http://x"], "--tempo needs --service NAME"),
        (["--tempo", "http://x", "--service", "s", "some.jsonl"], "pass no FILE or --jaeger with it"),
        (["--tempo", "http://x", "--service", "s", "--jaeger", "http://y"], "pass no FILE or --jaeger with it"),
        (["--tempo", "http://x", "--jaeger", "http://y", "--prometheus", "http://z"], "pass --jaeger URL or --tempo"),
        (["--tempo", "localhost:3200", "--service", "s"], "--tempo must be a URL like http://localhost:3200"),
        (["--tempo", "http://x", "--service", "s", "--limit", "0"], "--limit must be a whole number"),
        (["--tempo", "http://x", "--service", "s", "--limit", "many"], "--limit must be a whole number"),
        (["--tempo", "http://x", "--service", "s", "--header", "Bearer xyz"], "--header must look like"),
        (["--limit", "5", "some.jsonl"], "--limit goes with --tempo URL"),
        (["--jaeger", "http://y", "--service", "s", "--header", "A: b"], "--header goes with --tempo URL"),
        (["--prometheus", "http://z", "--tempo", "http://x", "--tempo-tenant", "t"],
         "--tempo-tenant goes with --tempo URL, when the report reads its traces from Tempo (with --prometheus"),
        (["--tempo", "http://x", "--service", "s", "--baseline", "a.jsonl", "b.jsonl"], "pass no FILE, --jaeger or"),
    ],
)  # fmt: skip
def test_usage_errors_are_one_line(capsys: pytest.CaptureFixture[str], argv: list[str], problem: str) -> None:
    code, out, err = run_cli(capsys, "report", *argv)
    assert (code, out, err.count("\n")) == (2, "", 1), (argv, err)
    assert problem in err, (argv, err)
    assert "xyz" not in err


def test_a_header_in_the_url_or_a_bad_header_never_shows_its_secret(
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = f"http://user:{SECRET}@127.0.0.1:{_closed_port()}"
    code, out, err = run_cli(capsys, "report", "--tempo", url, "--service", SERVICE)
    assert (code, out) == (2, "")
    assert SECRET not in err
    assert "cannot reach Tempo at http://REDACTED:REDACTED@127.0.0.1:" in err
    code, out, err = run_cli(capsys, "report", "--tempo", "http://x", "--service", "s", "--header", SECRET)
    assert (code, out) == (2, "")
    assert SECRET not in err


# --- with --prometheus: Tempo is where exemplars link to ------------------------------------------


def test_with_prometheus_exemplars_link_to_the_trace_in_tempo(
    tempo: ThreadingHTTPServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--prometheus URL --tempo URL`: the report comes from Prometheus, Tempo is not asked, and each
    exemplar's trace id links to Tempo's trace-by-id API, which answers with that trace."""
    import httpx

    from tests.test_report_prometheus import _ExemplarsOnly

    first, second = (trace.trace_id for trace in tempo.found(SERVICE, 0, 2**40)[:2])  # type: ignore[attr-defined]
    with serving(_ExemplarsOnly, trace_ids=(first, second)) as prometheus:
        url = f"http://127.0.0.1:{prometheus.server_address[1]}"
        code, out, err = run_cli(
            capsys, "report", "--prometheus", url, "--tempo", url_of(tempo), "--since", "10m"
        )
        assert (code, err) == (0, "")
        link = f"{url_of(tempo)}/api/v2/traces/{first}"
        slow = out.split("histogram points)\n", 1)[1].splitlines()
        assert slow[0].split() == ["2.50", "s", "tool", "(stage)", link]
        assert slow[1].split()[-1] == f"{url_of(tempo)}/api/v2/traces/{second}"
        assert tempo.requests == []  # type: ignore[attr-defined]
        code, out, err = run_cli(
            capsys, "report", "--prometheus", url, "--tempo", url_of(tempo), "--since", "10m", "--json"
        )
        assert (code, err) == (0, "")
        assert [e["link"] for e in json.loads(out)["exemplars"]] == [
            link,
            f"{url_of(tempo)}/api/v2/traces/{second}",
        ]
    answer = httpx.get(link)
    assert answer.status_code == 200
    (span,) = [s for rs in answer.json()["trace"]["resourceSpans"] for ss in rs["scopeSpans"] for s in ss["spans"]
               if "parentSpanId" not in s]  # fmt: skip
    assert span["name"] == "turn chat"


def test_a_header_option_replaces_the_environments_header_of_the_same_name(
    traces_file: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLMSPANS_TEMPO_HEADERS", "authorization=Bearer%20stale-token,x-team=llm")
    with tempo_server([traces_file], token=SECRET) as tempo:
        code, out, err = run_cli(capsys, "report", "--tempo", url_of(tempo), "--service", SERVICE)
        assert (code, out) == (2, "")
        assert "stale-token" not in err
        code, out, err = run_cli(capsys, "report", "--tempo", url_of(tempo), "--service", SERVICE, "--json",
                                 "--header", f"Authorization: Bearer {SECRET}")  # fmt: skip
        assert (code, err) == (0, "")
        (_, _, headers) = tempo.requests[-1]  # type: ignore[attr-defined]
    assert headers["Authorization"] == f"Bearer {SECRET}"
    assert headers["x-team"] == "llm"


def test_a_service_name_with_quotes_is_a_traceql_string(
    tempo: ThreadingHTTPServer, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(
        capsys, "report", "--tempo", url_of(tempo), "--service", 'chat "api"\\2', "--json"
    )
    assert (code, err) == (0, "")
    assert json.loads(out)["traces"] == 0
    ((_, query, _),) = tempo.requests  # type: ignore[attr-defined]
    assert query["q"] == '{ resource.service.name = "chat \\"api\\"\\\\2" }'


@pytest.mark.parametrize(
    "body", [b"{}", b'{"traces": []}', b'{"traces": null}', b'{"metrics": {"totalJobs": 1}}']
)
def test_every_spelling_of_an_empty_search_is_an_empty_report(
    tempo: ThreadingHTTPServer, capsys: pytest.CaptureFixture[str], body: bytes
) -> None:
    tempo.status, tempo.body = 200, body  # type: ignore[attr-defined]
    code, out, err = run_cli(capsys, "report", "--tempo", url_of(tempo), "--service", SERVICE)
    assert (code, err) == (0, "")
    assert "No llmspans traces found: nothing to report." in out


def test_the_window_is_tempos_search_not_a_second_cut(capsys: pytest.CaptureFixture[str]) -> None:
    """As with --jaeger, the traces Tempo's search returns for the window are the report's: here a Tempo
    that returns the recorded traces (days old; a Tempo whose clock or block times differ from ours) gives
    the report of the recorded files, not an empty one."""
    from tests.support.tempo import load_traces

    traces = load_traces(RECORDED)

    def any_time(service: str, start_s: int, end_s: int) -> list[Any]:
        return sorted((t for t in traces.values() if service in t.services), key=lambda t: -t.start_ns)

    with tempo_server(RECORDED, found=any_time) as tempo:
        code, from_tempo, err = run_cli(
            capsys, "report", "--tempo", url_of(tempo), "--service", SERVICE, "--since", "2h", "--json"
        )
    assert (code, err) == (0, ""), err
    code, from_file, _ = run_cli(capsys, "report", *map(str, RECORDED), "--service", SERVICE, "--json")
    assert code == 0
    assert _without_source(json.loads(from_file)) == _without_source(json.loads(from_tempo))
    assert json.loads(from_tempo)["traces"] == 10
