"""`llmspans report --baseline`: per stage and bucket, how p50 and p95 moved, with a bootstrap interval
that tells a real change from noise."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest

from llmspans import _names as names
from llmspans.__main__ import main
from llmspans.report._compare import FASTER, NOISE, SLOWER, _replicate, interval
from llmspans.report._model import rank
from tests.test_report import Trace, _keys, document


def _run(path: Path, *, stream_ms: float, seed: int, turns: int = 60) -> Path:
    """Turns with a retrieval stage and one streamed call; stream takes about `stream_ms`."""
    rng = random.Random(seed)
    traces = []
    for _ in range(turns):
        trace = Trace()
        retrieval = rng.uniform(20, 40)
        stream = stream_ms * rng.uniform(0.8, 1.2)
        turn = trace.span("turn chat", 0, retrieval + 60 + stream, **_keys({names.STAGE: names.STAGE_TURN}))
        trace.span("retrieval", 0, retrieval, turn, **_keys({names.STAGE: "retrieval"}))
        trace.call(retrieval, parent=turn, first_token=60, stream=stream)
        traces.append(trace)
    path.write_text(json.dumps(document(*traces)) + "\n")
    return path


def test_the_bootstrap_draws_the_order_statistic_a_resample_would_give() -> None:
    values = [float(v) for v in range(30)]
    q = 0.95
    shortcut, resampled = Counter(), Counter()
    rng = random.Random(1)
    for _ in range(20_000):
        shortcut[_replicate(values, q, rng)] += 1
        sample = sorted(rng.choice(values) for _ in values)
        resampled[sample[rank(len(values), q) - 1]] += 1
    distance = sum(abs(shortcut[v] - resampled[v]) for v in values) / 2 / 20_000
    assert distance < 0.03  # total variation: the same distribution, up to sampling noise


def test_the_interval_excludes_zero_for_a_real_change_and_straddles_it_for_none() -> None:
    rng = random.Random(2)
    before = sorted(rng.gauss(0.1, 0.01) for _ in range(200))
    slower = sorted(value + 0.02 for value in before)
    same = sorted(rng.gauss(0.1, 0.01) for _ in range(200))
    low, high = interval(before, slower, 0.5)
    assert 0 < low < 0.02 < high
    low, high = interval(before, same, 0.5)
    assert low < 0 < high


def test_baseline_a_b_says_which_changes_are_real(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = _run(tmp_path / "before.jsonl", stream_ms=100, seed=1)
    after = _run(tmp_path / "after.jsonl", stream_ms=200, seed=2)
    assert main(["report", "--baseline", str(before), str(after), "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    changes = {(c["kind"], c["name"], c["quantile"]): c for c in document["comparison"]["changes"]}
    stream = changes[("bucket", "stream", "p95")]
    assert stream["verdict"] == SLOWER
    assert stream["real"]
    assert stream["low_s"] > 0.05
    assert stream["change_s"] == pytest.approx(0.1, abs=0.03)
    assert changes[("stage", "retrieval", "p50")]["verdict"] == NOISE
    assert (
        changes[("bucket", "first_token", "p50")]["verdict"] == "unchanged"
        or not changes[("bucket", "first_token", "p50")]["real"]
    )
    assert document["comparison"]["dominant_after"] == "stream (llm bucket)"

    assert main(["report", str(before), "--baseline", str(after)]) == 0
    text = capsys.readouterr().out
    assert f"Compared with {after} (before) → this run (after)" in " ".join(text.split())
    assert "real changes: " in text
    assert "stream p50 faster by" in text
    assert all(len(line) <= 100 for line in text.splitlines())

    page = tmp_path / "report.html"
    assert main(["report", "--baseline", str(before), str(after), "--html", str(page)]) == 0
    capsys.readouterr()
    html = page.read_text()
    assert 'data-name="stream" data-quantile="p95" data-verdict="slower"' in html
    assert f'data-verdict="{FASTER}"' not in html


def test_a_baseline_window_needs_prometheus(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    current = _run(tmp_path / "now.jsonl", stream_ms=100, seed=1)
    assert main(["report", str(current), "--baseline", "1h@1d"]) == 2
    assert "needs --prometheus URL" in capsys.readouterr().err
