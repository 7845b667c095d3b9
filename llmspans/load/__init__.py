"""`llmspans load`: the latency curve under load, every request split into its buckets, and the knee named.

An offline tool like `llmspans/report/`, never imported by the instrumentation runtime. It drives an
OpenAI-compatible endpoint through an instrumented `openai.AsyncOpenAI`, so each request gets the call
span an app gets, and reads its figures back from that span. One module per job: `_workload.py` (the
arguments: what to send and at which levels), `_schedule.py` (closed loop, open-loop arrivals, the
sweep), `_requests.py` (one request's record, filled from its call span), `_generator.py` (one event loop
sending requests), `_runner.py` (the levels, on this process or on worker processes), `_workers.py` and
`_worker.py` (the worker processes, both sides of their pipes), `_ray.py` and `_ray_actor.py` (`--ray`:
the generators as Ray actors, the driver's side and the actor's; Ray imported only there), `_server.py`
(vLLM's `/metrics` over a level), `_stats.py` (per-level figures), `_verdict.py` (the knee and what grew there, in the report's
words), `_text.py`/`_html.py` (and JSON from `Result.to_dict()`); `_cli.py` ties them to the command line.
Definitions and choices: docs/load.md.
"""
