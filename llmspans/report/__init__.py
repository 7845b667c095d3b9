"""`llmspans report`: where the recorded requests' time went, and what to fix first.

An offline tool, never imported by the instrumentation runtime: sources (`_sources/`: OTLP-JSON files,
Jaeger's query API, Prometheus), the analysis (`_traces.py` whole traces out of a span stream,
`_analysis.py` the figures, `_server.py` vLLM's split of first_token, `_triage.py` the rule,
`_compare.py` before and after) and the renderings (`_text.py`, `_html.py`, JSON from
`Report.to_dict()`); `_cli.py` ties them to the command line. The method behind every figure, the
engine choice and how the Prometheus answer differs: docs/report.md.
"""
