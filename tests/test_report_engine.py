"""The streaming report gives the old report's answer: the same JSON on every file, to the nanosecond.

The old path (`tests/support/report_reference/`, the report as it was before issue 16) read every span
into memory and analysed the whole list; the new one reads a line at a time and folds in each trace
once it is complete. Seconds may differ below the nanosecond (the old path summed floats, the new one
adds integer nanoseconds), and a skipped line's reason names the JSON parser's own error in its own words;
nothing else may differ: not a count, an order, a tie or a word of the triage.
"""

from __future__ import annotations

import gc
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llmspans.report._cli import _Options, _span_report
from llmspans.report._sources.file import FileSource
from llmspans.testing import capture
from llmspans.tools.demo import SCENARIOS, run
from tests.support import report_reference

FIXTURES = Path(__file__).parent / "fixtures"
RECORDED = FIXTURES / "embedded-default.jsonl"
VLLM = FIXTURES / "vllm-server.jsonl"
JAEGER = FIXTURES / "jaeger-find-traces.json"


# What the report learned after the old path was frozen (issue 17: the server split on every vLLM release,
# the server's pressure): compared on the keys both have, these new keys left out of the comparison.
# (issue 24: the split's labelled rows, variability over the streamed calls, churn by kind of call).
ADDED_SINCE = {
    "$": {"server_pressure", "server_histograms"},
    "$.server": {
        "server_front_end", "network_and_client", "streamed_calls", "stream", "server_decode",
        "stream_network_and_client", "engines", "notes", "rows",
    },
    "$.variability": {"calls", "over"},
    "$.connections": {"streamed", "not_streamed", "closed_before_end"},
}  # fmt: skip


def _without_added(report: dict[str, Any]) -> dict[str, Any]:
    report = {key: value for key, value in report.items() if key not in ADDED_SINCE["$"]}
    for key in ("server", "variability", "connections"):
        if isinstance(report.get(key), dict):
            report[key] = {k: v for k, v in report[key].items() if k not in ADDED_SINCE[f"$.{key}"]}
    return report


def _new(paths: list[Path]) -> dict[str, Any]:
    report = _span_report(FileSource(paths, progress=False), _Options(None, 5, None, None))
    return _without_added(dict(json.loads(json.dumps(report.to_dict()))))


def _old(paths: list[Path]) -> dict[str, Any]:
    loaded = report_reference.read_files(paths)
    report = report_reference.analyse(loaded.spans, sources=loaded.sources, skipped=loaded.skipped)
    return dict(json.loads(json.dumps(report.to_dict())))


def _differences(old: Any, new: Any, where: str = "$") -> Iterator[str]:
    if isinstance(old, float) or isinstance(new, float):
        if not isinstance(new, (int, float)) or not isinstance(old, (int, float)) or abs(old - new) > 1e-9:
            yield f"{where}: {old!r} != {new!r}"
    elif isinstance(old, dict) and isinstance(new, dict):
        if old.keys() != new.keys():
            yield f"{where}: keys {sorted(old.keys() ^ new.keys())}"
        for key in old.keys() & new.keys():
            yield from _differences(old[key], new[key], f"{where}.{key}")
    elif isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        for index, (first, second) in enumerate(zip(old, new, strict=True)):
            yield from _differences(first, second, f"{where}[{index}]")
    elif where.endswith(".reason") and isinstance(old, str) and isinstance(new, str):
        if old.split(" (")[0] != new.split(" (")[0]:  # the JSON parser's own words differ (json, msgspec)
            yield f"{where}: {old!r} != {new!r}"
    elif old != new:
        yield f"{where}: {str(old)[:200]} != {str(new)[:200]}"


@pytest.fixture(scope="module")
def demo_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Path]]:
    """A retries run (attempt spans, failures, retried calls), written the way a batch exporter does:
    spans in the order they ended, several lines of them, metric lines in between; and 6 copies of it
    with new trace ids, shifted in time and exported interleaved, so durations tie and traces split
    across lines."""
    folder = tmp_path_factory.mktemp("engine")
    with capture() as captured:
        run(SCENARIOS["retries"], requests=16, concurrency=4, seed=5)
    gc.collect()  # the run's limiter: until collected it reports gauges into later tests' captures
    from opentelemetry.exporter.otlp.json.common.trace_encoder import encode_spans

    ended = sorted(captured.spans, key=lambda span: span.end_time or 0)
    batches = [
        json.dumps(encode_spans(ended[start : start + 23]).to_dict()) for start in range(0, len(ended), 23)
    ]
    metric_line = json.dumps({"resourceMetrics": [{"scopeMetrics": []}]})
    single = folder / "retries.jsonl"
    single.write_text("\n".join([batches[0], metric_line, *batches[1:], "{truncated"]) + "\n")
    copies = []
    shift = 0
    for copy in range(6):
        shift += 10**9 * (1 + copy)
        for line in batches:
            document = json.loads(line)
            for span in document["resourceSpans"][0]["scopeSpans"][0]["spans"]:
                span["traceId"] = f"{copy:02x}{span['traceId'][2:]}"
                for key in ("startTimeUnixNano", "endTimeUnixNano"):
                    span[key] = str(int(span[key]) + shift)
            copies.append(json.dumps(document))
    random.Random(16).shuffle(copies)  # late spans: some traces end up in exact mode
    replicated = folder / "replicated.jsonl"
    replicated.write_text("\n".join(copies) + "\n")
    return {"retries": [single], "replicated": [replicated], "both": [single, replicated, RECORDED, VLLM]}


@pytest.mark.parametrize(
    "files",
    [
        pytest.param([RECORDED, VLLM], id="client-then-server"),
        pytest.param([VLLM, RECORDED], id="server-then-client"),
        pytest.param([JAEGER], id="jaeger-document"),
        pytest.param("retries", id="demo-retries"),
        pytest.param("replicated", id="replicated-shuffled"),
        pytest.param("both", id="four-files"),
    ],
)
def test_the_streaming_report_gives_the_old_reports_json(
    files: list[Path] | str, demo_files: dict[str, list[Path]]
) -> None:
    paths = demo_files[files] if isinstance(files, str) else files
    old, new = _old(paths), _new(paths)
    assert old["traces"] > 0
    assert list(_differences(old, new)) == []


@pytest.mark.parametrize("scenario", ["retries", "queue"])
def test_spans_held_in_memory_are_read_as_their_otlp_json_encoding_would_be(scenario: str) -> None:
    """`spans_of_readable` (what `llmspans load` and the demo read their spans with) skips the encoding
    step; what it gives is what the embedded default's file gives for the same spans: every field, every
    reported attribute, with attempt spans, failures, limiter and budget attributes among them."""
    from opentelemetry.exporter.otlp.json.common.trace_encoder import encode_spans

    from llmspans.report._spans import spans_of_json, spans_of_readable

    with capture() as captured:
        run(SCENARIOS[scenario], requests=8, concurrency=4, seed=5)
        spans = list(captured.spans)
    gc.collect()  # the run's limiter: until collected it reports gauges into later tests' captures
    encoded = spans_of_json(json.dumps(encode_spans(spans).to_dict()))
    assert encoded is not None
    direct = spans_of_readable(spans)
    assert len(direct) == len(spans) > 8
    assert {span.kind for span in direct} >= {1, 3}  # internal stages and client calls
    assert any(span.error for span in direct) == (scenario == "retries")
    by_id = {span.span_id: span for span in encoded}
    for span in direct:
        assert span == by_id[span.span_id]
