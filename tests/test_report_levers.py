"""`llmspans report` on what the levers did: prompt caps and caches, from the spans of a scripted workload
(tests/support/levers_workload.py) and from its metrics as a real Prometheus scraped them; hedged requests,
from the spans of another (tests/support/hedge_workload.py)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.exporter.otlp.json.common.trace_encoder import encode_spans

from llmspans import _names as names
from llmspans.__main__ import main
from llmspans.report._model import format_seconds
from llmspans.testing import capture
from llmspans.tools.simulator import Behavior, SimulatedServer
from tests.support import hedge_workload
from tests.support import levers_workload as workload
from tests.support.prometheus import cued_app, prometheus_server
from tests.support.realservers import free_ports

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    """The workload's spans as the embedded default writes them (one OTLP-JSON line), and the spans."""
    path = tmp_path_factory.mktemp("levers") / "traces.jsonl"
    with SimulatedServer(Behavior(chunks=2, usage="finish")) as server, capture() as captured:
        workload.run(server.base_url)
        spans = captured.spans
    path.write_text(json.dumps(encode_spans(spans).to_dict()) + "\n")
    return path, spans


def _nearest_rank(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(1, -int(-q * len(ordered) // 1)) - 1]


def _p(values: list[int], q: float) -> float:
    ordered = sorted(values)
    rank = max(1, min(len(ordered), -(-int(q * 1000) * len(ordered) // 1000)))
    return ordered[rank - 1] / 1e9


def _report_json(path: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert main(["report", str(path), "--json"]) == 0
    return dict(json.loads(capsys.readouterr().out))


def test_the_report_counts_what_the_prompt_caps_did(
    recorded: tuple[Path, list[Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    path, spans = recorded
    caps = _report_json(path, capsys)["prompt_caps"]
    assert (caps["calls"], caps["over"], caps["refused"]) == (8, 4, 1)
    assert caps["share_over"] == 0.5
    assert caps["estimators"] == [names.ESTIMATOR_CHARS]

    calls = [s for s in spans if (s.attributes or {}).get(names.STAGE) == names.STAGE_LLM]
    first_token = names.BUCKET_PREFIX + "first_token"
    answered = [s for s in calls if names.ERROR_TYPE not in s.attributes]
    over = [round(s.attributes[first_token] * 1e9) for s in answered if s.attributes[names.PROMPT_OVER_CAP]]
    under = [
        round(s.attributes[first_token] * 1e9) for s in answered if not s.attributes[names.PROMPT_OVER_CAP]
    ]
    assert (len(over), len(under)) == (3, 4)
    assert caps["first_token_over"]["p95"] == _p(over, 0.95)
    assert caps["first_token_under"]["p95"] == _p(under, 0.95)
    assert caps["first_token_over"]["p50"] >= workload.LONG_DELAY  # the server held each long prompt so long
    # The simulator counts words: 200 four-letter words estimated as 257 tokens, 20 as 32.
    # 4 short prompts over 3 long ones: the p50 is a short one's ratio.
    assert caps["estimate_ratio"]["count"] == 7
    assert caps["estimate_ratio"]["p50"] == pytest.approx(32 / 20)
    assert caps["estimate_ratio"]["p95"] == pytest.approx(32 / 20)

    assert main(["report", str(path)]) == 0
    text = capsys.readouterr().out
    paragraph = " ".join(line.strip() for line in text.split("Prompt caps: ", 1)[1].splitlines())
    paragraph = paragraph.split("Cache '", 1)[0]
    assert paragraph.startswith("4 of 8 capped calls over the cap (50%), 1 of them refused before sending")
    assert (
        f"first_token p95 {format_seconds(_p(over, 0.95))} over the cap (3 answered) against "
        f"{format_seconds(_p(under, 0.95))} under it (4)"
    ) in paragraph
    assert "the estimate against the server's input tokens p50 1.60x, p95 1.60x (chars/4)" in paragraph
    # The triage says what long prompts cost when the calls over the cap waited 1.5x as long or more.
    slower = _p(over, 0.95) / _p(under, 0.95)
    said = "calls over the prompt cap waited" in " ".join(text.split())
    assert said is (slower >= 1.5)
    if said:
        assert f"waited {slower:.1f}x longer for their first token at p95" in " ".join(text.split())


def test_the_report_counts_what_each_cache_did(
    recorded: tuple[Path, list[Any]], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path, spans = recorded
    (cache,) = _report_json(path, capsys)["caches"]
    assert (cache["name"], cache["lookups"], cache["hits"], cache["errors"]) == (workload.CACHE, 12, 4, 0)
    assert cache["hit_rate"] == pytest.approx(1 / 3)
    lookups = [s for s in spans if (s.attributes or {}).get(names.STAGE) == names.STAGE_CACHE]
    saved = [
        s.attributes[names.CACHE_SAVED_ESTIMATE]
        for s in lookups
        if names.CACHE_SAVED_ESTIMATE in s.attributes
    ]
    assert len(saved) == cache["hits_estimated"] == 3  # the first hit came before any call to estimate from
    assert cache["saved_s"] == pytest.approx(sum(saved), abs=1e-9)
    turns = {s.context.span_id: s for s in spans if s.name == "turn chat"}
    hit_turns = [t.end_time - t.start_time for t in turns.values() if not _has_call(t, spans)]
    miss_turns = [t.end_time - t.start_time for t in turns.values() if _has_call(t, spans)]
    assert (cache["with_hit"]["count"], cache["with_miss"]["count"]) == (4, 8)
    assert cache["with_hit"]["p95"] == _p(hit_turns, 0.95)
    assert cache["with_miss"]["p50"] == _p(miss_turns, 0.5)
    assert cache["with_miss"]["p50"] >= workload.SHORT_DELAY  # a miss's turn waited on the server
    assert cache["lookup"]["count"] == 12

    assert main(["report", str(path)]) == 0
    text = " ".join(line.strip() for line in capsys.readouterr().out.splitlines())
    assert (
        f"Cache 'answers': 4 of 12 lookups hit (33%); saved about {format_seconds(sum(saved))} of LLM time "
        "(3 of 4 hits with an estimate: the p50 of the process's own recent calls)"
    ) in text
    assert f"requests with a hit p50 {format_seconds(_p(hit_turns, 0.5))}" in text
    assert f"p95 {format_seconds(_p(miss_turns, 0.95))} with only misses (8)" in text

    page = tmp_path / "report.html"
    assert main(["report", str(path), "--html", str(page)]) == 0
    html = page.read_text()
    assert 'data-cache="answers" data-lookups="12" data-hits="4"' in html
    assert 'class="prompt-caps" data-calls="8" data-over="4" data-refused="1"' in html


def _has_call(turn: Any, spans: list[Any]) -> bool:
    return any(
        (s.attributes or {}).get(names.STAGE) == names.STAGE_LLM and s.parent is not None
        and s.parent.span_id == turn.context.span_id
        for s in spans
    )  # fmt: skip


def test_a_report_without_levers_says_nothing_of_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import openai

    import llmspans

    with SimulatedServer(Behavior(chunks=2)) as server, capture() as captured:
        client = llmspans.instrument(openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0))
        with llmspans.turn("chat"):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        path = tmp_path / "plain.jsonl"
        path.write_text(json.dumps(encode_spans(captured.spans).to_dict()) + "\n")
    report = _report_json(path, capsys)
    assert not {"prompt_caps", "caches"} & set(report)
    assert main(["report", str(path)]) == 0
    text = capsys.readouterr().out
    assert "Prompt caps" not in text
    assert "Cache '" not in text


# --- from Prometheus -----------------------------------------------------------------------------------


def test_prometheus_counts_what_the_levers_did(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """The workload's metrics scraped by a real Prometheus (Debian's 2.42) from an app of its own: the
    same shares of calls over the cap and of lookups that hit, the refused call, the time saved. The
    window holds a scrape from before the run and one from after it (`RunWindow`), so increase() counts
    every call and at most stretches the count by what the scrapes in the window allow."""
    (port,) = free_ports(1)
    spans = tmp_path / "levers.jsonl"
    with (
        prometheus_server({"levers": port}) as server,
        cued_app("tests.support.prometheus_levers_app", str(port), str(spans)) as app,
    ):
        window = server.window('llmspans_cache_lookups_total{job="levers"}', settled_at=time.time())
        app.stdin.write("go\n")
        app.stdin.flush()
        assert app.stdout.readline().strip() == "done"
        server.wait_for('sum(llmspans_cache_lookups_total{job="levers"})', 2 * workload.TURNS)
        code = main(["report", "--prometheus", server.url, "--service", "levers", "--since", window.since(),
                     "--json"])  # fmt: skip
        stretch = window.stretch()
        out = capsys.readouterr().out
        assert code == 0
        text_code = main(["report", "--prometheus", server.url, "--service", "levers", "--since",
                          window.since()])  # fmt: skip
        text = capsys.readouterr().out
    assert text_code == 0
    report = json.loads(out)
    caps = report["prompt_caps"]
    # The run's whole rise, stretched by increase() at most as far as the window's scrapes allow; shares closer.
    assert 8 <= caps["calls"] <= math.ceil(8 * stretch), stretch
    assert caps["share_over"] == pytest.approx(0.5, abs=0.1)
    assert 1 <= caps["refused"] <= math.ceil(stretch), stretch  # one refused call, stretched alike
    assert caps["first_token_over"]["p95"] >= workload.LONG_DELAY * 0.9  # interpolated inside its bucket
    # Quantiles of one histogram, interpolated inside their bucket: on a loaded machine the client's own time
    # can put both sides' p95 in one bucket (0.32-0.64 s at load 32), where they tie.
    assert caps["first_token_over"]["p95"] >= caps["first_token_under"]["p95"]
    assert caps["estimators"] == [names.ESTIMATOR_CHARS]
    (cache,) = report["caches"]
    assert cache["name"] == workload.CACHE
    assert cache["hit_rate"] == pytest.approx(1 / 3, abs=0.1)
    assert (cache["lookup"], cache["with_hit"], cache["with_miss"]) == (None, None, None)  # those need spans
    assert cache["hits_estimated"] >= 3
    assert cache["saved_s"] > 0
    assert "Prompt caps:" in text
    assert "Cache 'answers':" in text
    assert "need the spans" in text


# --- hedged requests ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hedged(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    path = tmp_path_factory.mktemp("hedging") / "traces.jsonl"
    with SimulatedServer(Behavior(chunks=2, usage="chunk")) as server, capture() as captured:
        hedge_workload.run(server)
        spans = captured.spans
    path.write_text(json.dumps(encode_spans(spans).to_dict()) + "\n")
    return path, spans


def test_the_report_says_how_often_the_hedge_fired_and_won_and_what_it_cost(
    hedged: tuple[Path, list[Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    path, spans = hedged
    hedging = _report_json(path, capsys)["hedging"]
    w = hedge_workload
    assert (hedging["calls"], hedging["fired"], hedging["backup_won"], hedging["skipped"]) == (
        w.CALLS,
        w.FIRED,
        w.BACKUP_WON,
        w.SKIPPED,
    )
    assert (hedging["share_fired"], hedging["share_won"]) == (w.FIRED / w.CALLS, w.BACKUP_WON / w.CALLS)
    # Every call reported its prompt's words as input tokens; each backup sent wasted one prompt.
    assert (hedging["input_tokens"], hedging["wasted_input_tokens"]) == (w.CALLS * w.WORDS, w.FIRED * w.WORDS)
    assert hedging["extra_input"] == pytest.approx(w.FIRED / w.CALLS)
    assert hedging["wasted_output_tokens"] == 0
    assert hedging["after"]["p50"] == w.AFTER

    calls = [s for s in spans if (s.attributes or {}).get(names.HEDGE_FIRED) is True]
    first_token = [round(s.attributes[names.BUCKET_PREFIX + "first_token"] * 1e9) for s in calls]
    assert hedging["first_token"]["count"] == w.FIRED
    assert hedging["first_token"]["p95"] == _p(first_token, 0.95)
    # The primaries' own time: the one that got there first did after LATE; the two the backup beat were
    # stopped after about AFTER and the backup's own first token, never after SLOW.
    first, cut = hedging["primaries_first"], hedging["primaries_cut"]
    assert (first["count"], cut["count"]) == (w.FIRED - w.BACKUP_WON, w.BACKUP_WON)
    assert w.LATE <= first["max"] < w.SLOW
    # AFTER counts from the app's call, a primary's own time from its request: the SDK's building of the
    # request (a ms or two, more on a busy machine) lies between them.
    assert w.AFTER - 0.02 <= cut["p50"] < w.SLOW
    fired = {call.context.span_id for call in calls}
    primaries = [
        s for s in spans
        if (s.attributes or {}).get(names.HEDGE_ROLE) == names.HEDGE_ROLE_PRIMARY and s.parent.span_id in fired
    ]  # fmt: skip
    reached = [
        s.attributes[names.HEDGE_FIRST_TOKEN] for s in primaries if names.HEDGE_FIRST_TOKEN in s.attributes
    ]
    assert first["max"] == pytest.approx(max(reached))
    stopped = [
        (s.end_time - s.start_time) / 1e9 for s in primaries if names.HEDGE_FIRST_TOKEN not in s.attributes
    ]
    assert cut["max"] == pytest.approx(max(stopped))


def test_the_hedging_paragraph_reads_as_the_issue_asked(
    hedged: tuple[Path, list[Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = hedged
    assert main(["report", str(path)]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert (
        "Hedging: fired on 30% of 10 calls that could be hedged (after p50 300 ms) and the backup won 20%"
        in text
    )
    assert "p95 first_token of hedged calls" in text
    assert "their primaries' own time to a first token: p95" in text
    assert (
        "where they got there first (1); where the backup won (2), unknown: stopped with none yet after p50"
        in text
    )
    assert "(a lower bound)" in text
    assert "it cost 30% more input tokens (12 of 40)" in text
    assert "1 backup not sent: the limiter had no free slot" in text
    html = path.with_suffix(".html")
    assert main(["report", str(path), "--html", str(html)]) == 0
    page = html.read_text()
    assert 'class="hedging" data-calls="10" data-fired="3" data-backup-won="2" data-wasted-input="12"' in page
