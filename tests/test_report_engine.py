"""The report reads spans held in memory as it reads their OTLP-JSON encoding.

(The streaming report's answers on fixed inputs are pinned by tests/test_report_golden.py.)
"""

from __future__ import annotations

import gc
import json

import pytest

from llmspans.testing import capture
from llmspans.tools.demo import SCENARIOS, run


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
