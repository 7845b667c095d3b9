"""`llmspans demo`: each scenario's injected bottleneck is the one the report names, and nothing else."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmspans import _names as names
from llmspans.report._analysis import analyse
from llmspans.report._spans import spans_of_readable
from llmspans.testing import Captured
from llmspans.tools.demo import SCENARIOS, run

# Enough turns for a p95 that is not simply the max (nearest rank 19 of 20), few enough for seconds.
REQUESTS = 20
CONCURRENCY = 4


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_the_report_names_the_injected_bottleneck_and_no_other(name: str, captured: Captured) -> None:
    scenario = SCENARIOS[name]
    result = run(scenario, requests=REQUESTS, concurrency=CONCURRENCY, seed=11)
    assert result.turns == REQUESTS
    report = analyse(spans_of_readable(captured.spans))
    assert (report.traces, report.llm_calls) == (REQUESTS, REQUESTS)
    triage = report.triage
    assert triage is not None
    if name == "healthy" and triage.finding == "first_token":
        # Healthy injects nothing: stream (12 gaps of 15 ms) leads first_token (a 50 ms median) by 2.4x at
        # p95, and two 100 ms stalls of this process among 20 first tokens (rank 19 is the p95) close that
        # gap, as seen once with -n 2 at load 6-10. The design still shows in the medians.
        bucket = {part.name: part.per_trace for part in report.parts if part.kind == "bucket"}
        assert bucket["stream"].p50 >= 1.5 * bucket["first_token"].p50, bucket
        assert bucket["first_token"].p95 > bucket["stream"].p95, bucket
    else:
        assert triage.finding == scenario.expected, triage.message
    if name == "healthy" and not triage.within_budget:
        # Its budgets leave about 2x over each stage's design (the LLM call's 0.5 s over ~0.27 s at p95);
        # only a stall of this process past that margin in two turns of 20 puts a p95 over, as seen once
        # with -n 2 at load 29. Then the verdict says so because a stage's own spans say so.
        over = [row for row in report.stages if row.budget is not None and row.durations.p95 > row.budget]
        assert over, report.stages
        assert all(row.exceeded >= 1 for row in over), report.stages
    else:
        assert triage.within_budget is scenario.expected_within_budget, triage.message
    # No other part comes close: the dominant part's p95 is at least 1.5x every other part's median.
    # Not the others' p95: a shared 2-core CI host now and then stalls this process for 50-100 ms, and
    # the stall lands in whichever part is running; two such stalls among 20 turns move a p95 (rank 19)
    # but never a median. In the healthy scenario that took first_token's p95 from 0.077 s to 0.141 s.
    others = sorted(
        (
            part.per_trace.p50
            for part in report.parts
            if (part.kind, part.name) != (triage.dominant_kind, triage.dominant)
        ),
        reverse=True,
    )
    assert triage.dominant_p95 >= 1.5 * others[0], (triage.dominant, report.parts)
    # The two queue scenarios differ by gap_fraction: a backlog at the cap, or slots sitting idle.
    (limiter,) = report.limiters
    assert limiter.cap == scenario.cap(CONCURRENCY)
    if name == "queue":
        assert limiter.backlog_s > 0.5 * limiter.window_s
        assert limiter.gap_fraction < 0.05
    elif name == "stalled-scheduler":
        assert limiter.backlog_s > 0.5 * limiter.window_s
        assert limiter.gap_fraction > 0.9
    else:
        assert limiter.backlog_s < 0.01 * limiter.window_s
    # Budgets exceeded, counted exactly: the report's counts are the spans' own flags.
    for row in report.stages:
        flagged = [
            span for span in captured.spans
            if span.attributes and span.attributes.get(names.STAGE) == row.stage
            and span.attributes.get(names.BUDGET_EXCEEDED) is True
        ]  # fmt: skip
        assert row.exceeded == len(flagged), row.stage
        assert (
            row.budgeted
            == row.durations.count
            == sum(
                1
                for span in captured.spans
                if span.attributes and span.attributes.get(names.STAGE) == row.stage
            )
        )


def test_the_plain_httpx_client_gives_the_same_picture(captured: Captured) -> None:
    result = run(SCENARIOS["slow-decode"], requests=8, concurrency=CONCURRENCY, seed=3, client="httpx")
    assert result.client == "httpx"
    triage = analyse(spans_of_readable(captured.spans)).triage
    assert triage is not None
    assert triage.finding == "stream"


def test_retries_need_a_client_that_retries() -> None:
    with pytest.raises(ValueError, match="needs the openai SDK's retry loop"):
        run(SCENARIOS["retries"], requests=2, client="httpx")


def test_the_default_demo_command_writes_the_traces_file_and_reports_on_it(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLMSPANS_"))}
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "llmspans", "demo"], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stderr
    assert elapsed < 30
    out = " ".join(result.stdout.split())  # lines are wrapped at 100 columns
    assert max(len(line) for line in result.stdout.splitlines()) <= 100
    assert "SIMULATED OpenAI-compatible server" in out
    assert "40/40 turns" in result.stderr  # the progress bar
    traces_file = tmp_path / names.DEFAULT_TRACES_FILE
    assert f"spans written to {traces_file}" in out
    again = subprocess.run(
        [sys.executable, "-m", "llmspans", "report", "--service", "llmspans-demo-healthy", "--json"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    reread = json.loads(again.stdout)
    assert (reread["traces"], reread["llm_calls"]) == (40, 40)
    # The printed verdict is the file's: the part with the largest p95, said the same in text and JSON.
    triage = reread["triage"]
    parts = {part["name"]: part["per_trace"] for part in reread["parts"] if part["kind"] == "bucket"}
    largest = max(reread["parts"], key=lambda part: part["per_trace"]["p95"])
    assert (triage["dominant"], triage["dominant_kind"]) == (largest["name"], largest["kind"])
    assert f"Dominant at p95: {triage['dominant']} (llm bucket)" in out
    assert ("within budget:" in out) is triage["within_budget"]
    # The healthy design: 12 chunks 15 ms apart (180 ms of stream) over a 50 ms median first token, so
    # stream dominates. Medians show it on any host; the p95 (rank 38 of 40) is the report's to name: on
    # the 2-core CI host three stalls of 150 ms in the simulator's first tokens (a vLLM test on the other
    # worker) once took first_token's p95 past stream's, and the report rightly named first_token.
    assert parts["stream"]["p50"] >= 1.5 * parts["first_token"]["p50"], parts
    # At least 11 gaps after the first token, each drawn from 0.85-1.15 of 15 ms: sleeps, never shorter.
    assert parts["stream"]["p50"] >= 11 * 0.015 * 0.85
    assert triage["dominant"] in ("stream", "first_token"), triage


def test_demo_json_keeps_stdout_a_single_document(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLMSPANS_"))}
    result = subprocess.run(
        [sys.executable, "-m", "llmspans", "demo", "--scenario", "slow-tool", "--requests", "8", "--json",
         "--html", str(tmp_path / "demo.html")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["triage"]["dominant"] == "tool"
    assert "SIMULATED" in result.stderr
    assert "simulated LLM server" in (tmp_path / "demo.html").read_text()


def test_hedging_the_slow_replica_cuts_the_first_token_tail_and_the_report_says_what_it_cost(
    captured: Captured,
) -> None:
    """The same turns and the same replicas (one seed), without the hedge and with it."""
    scenario = SCENARIOS["slow-replica"]
    run(scenario, requests=REQUESTS, concurrency=CONCURRENCY, seed=11)
    plain = analyse(spans_of_readable(captured.spans))
    captured.clear()
    run(scenario, requests=REQUESTS, concurrency=CONCURRENCY, seed=11, hedge=True)
    hedged = analyse(spans_of_readable(captured.spans))
    assert plain.hedging is None
    plain_p95, hedged_p95 = (
        next(b for b in report.buckets if b.bucket == "first_token").values.p95 for report in (plain, hedged)
    )
    # Without the hedge a slow replica's first tokens (1.0-1.6 s) make the p95; with it, none waits past the
    # hedge's 150 ms plus the other replica's own first token, and a slow one never answers first.
    assert plain_p95 >= min(scenario.slow_s)
    assert hedged_p95 < min(scenario.slow_s) / 2
    hedging = hedged.hedging
    assert hedging is not None
    assert hedging.calls == REQUESTS
    assert 0 < hedging.backup_won <= hedging.fired < REQUESTS
    assert hedging.after is not None
    assert hedging.after.p50 == pytest.approx(0.15)
    assert hedging.extra_input is not None
    assert hedging.extra_input == pytest.approx(hedging.wasted_input_tokens / hedging.input_tokens)
    assert hedging.wasted_input_tokens > 0


def test_hedging_needs_the_openai_client() -> None:
    with pytest.raises(ValueError, match="--hedge needs the openai SDK client"):
        run(SCENARIOS["slow-replica"], requests=2, client="httpx", hedge=True)


def test_the_hedged_demo_command_says_what_the_hedge_did_and_refuses_a_client_it_cannot_hedge(
    tmp_path: Path,
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLMSPANS_"))}
    plain = subprocess.run(
        [sys.executable, "-m", "llmspans", "demo", "--scenario", "slow-replica", "--requests", "12"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert plain.returncode == 0, plain.stderr
    out = " ".join(plain.stdout.split())
    assert "2 SIMULATED OpenAI-compatible servers (replicas, called in turn)" in out
    assert "Hedging:" not in out
    assert "llmspans demo --scenario slow-replica --hedge" in out
    hedged = subprocess.run(
        [sys.executable, "-m", "llmspans", "demo", "--scenario", "slow-replica", "--requests", "12", "--hedge"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert hedged.returncode == 0, hedged.stderr
    out = " ".join(hedged.stdout.split())
    assert "each call hedged after 150 ms" in out
    assert "Hedging: fired on" in out
    assert "of 12 calls that could be hedged (after p50 150 ms)" in out
    assert "more input tokens" in out
    assert "--service llmspans-demo-slow-replica-hedged" in out
    refused = subprocess.run(
        [sys.executable, "-m", "llmspans", "demo", "--hedge", "--client", "httpx", "--requests", "2"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert refused.returncode == 2
    assert refused.stderr.startswith("llmspans demo: --hedge needs the openai SDK client")
    assert len(refused.stderr.strip().splitlines()) == 1  # one line, no traceback
