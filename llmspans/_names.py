"""Every span, attribute, event and metric name llmspans emits, in one place.

These names are public API (DESIGN §2-3): dashboards, the report and users' queries
depend on them. Nothing else in the package spells one of them as a literal.
"""

from __future__ import annotations

from typing import Final

INSTRUMENTATION_NAME: Final = "llmspans"

# --- OpenTelemetry GenAI semantic conventions -------------------------------------------
GEN_AI_OPERATION_NAME: Final = "gen_ai.operation.name"
GEN_AI_PROVIDER_NAME: Final = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL: Final = "gen_ai.request.model"
GEN_AI_REQUEST_STREAM: Final = "gen_ai.request.stream"
GEN_AI_REQUEST_MAX_TOKENS: Final = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE: Final = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P: Final = "gen_ai.request.top_p"
GEN_AI_RESPONSE_ID: Final = "gen_ai.response.id"
GEN_AI_RESPONSE_MODEL: Final = "gen_ai.response.model"
GEN_AI_RESPONSE_FINISH_REASONS: Final = "gen_ai.response.finish_reasons"
GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK: Final = "gen_ai.response.time_to_first_chunk"
GEN_AI_USAGE_INPUT_TOKENS: Final = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS: Final = "gen_ai.usage.output_tokens"
GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: Final = "gen_ai.usage.cache_read.input_tokens"
GEN_AI_INPUT_MESSAGES: Final = "gen_ai.input.messages"
GEN_AI_OUTPUT_MESSAGES: Final = "gen_ai.output.messages"
GEN_AI_SYSTEM_INSTRUCTIONS: Final = "gen_ai.system_instructions"  # opt-in, like the messages
GEN_AI_REQUEST_CHOICE_COUNT: Final = "gen_ai.request.choice.count"  # only when n != 1
GEN_AI_REQUEST_STOP_SEQUENCES: Final = "gen_ai.request.stop_sequences"
GEN_AI_REQUEST_FREQUENCY_PENALTY: Final = "gen_ai.request.frequency_penalty"
GEN_AI_REQUEST_PRESENCE_PENALTY: Final = "gen_ai.request.presence_penalty"
GEN_AI_REQUEST_SEED: Final = "gen_ai.request.seed"
GEN_AI_REQUEST_ENCODING_FORMATS: Final = "gen_ai.request.encoding_formats"
GEN_AI_OUTPUT_TYPE: Final = "gen_ai.output.type"
GEN_AI_EMBEDDINGS_DIMENSION_COUNT: Final = "gen_ai.embeddings.dimension.count"
GEN_AI_CONVERSATION_ID: Final = "gen_ai.conversation.id"
GEN_AI_USAGE_CACHE_CREATION_INPUT_TOKENS: Final = "gen_ai.usage.cache_creation.input_tokens"
GEN_AI_USAGE_REASONING_OUTPUT_TOKENS: Final = "gen_ai.usage.reasoning.output_tokens"
OPENAI_REQUEST_SERVICE_TIER: Final = "openai.request.service_tier"
OPENAI_RESPONSE_SERVICE_TIER: Final = "openai.response.service_tier"
OPENAI_RESPONSE_SYSTEM_FINGERPRINT: Final = "openai.response.system_fingerprint"
GEN_AI_TOOL_NAME: Final = "gen_ai.tool.name"
GEN_AI_TOOL_TYPE: Final = "gen_ai.tool.type"
GEN_AI_DATA_SOURCE_ID: Final = "gen_ai.data_source.id"
GEN_AI_TOKEN_TYPE: Final = "gen_ai.token.type"

OPERATION_CHAT: Final = "chat"
OPERATION_TEXT_COMPLETION: Final = "text_completion"
OPERATION_EMBEDDINGS: Final = "embeddings"
OPERATION_EXECUTE_TOOL: Final = "execute_tool"
OPERATION_RETRIEVAL: Final = "retrieval"

# --- stable HTTP / general conventions ----------------------------------------------------
ERROR_TYPE: Final = "error.type"
SERVER_ADDRESS: Final = "server.address"
SERVER_PORT: Final = "server.port"
HTTP_REQUEST_METHOD: Final = "http.request.method"
HTTP_RESPONSE_STATUS_CODE: Final = "http.response.status_code"
HTTP_REQUEST_RESEND_COUNT: Final = "http.request.resend_count"
URL_FULL: Final = "url.full"

# --- llmspans: stages, buckets, stream, retries, connections, limiter, budgets --------------
STAGE: Final = "llmspans.stage"
STAGE_LLM: Final = "llm"
STAGE_TURN: Final = "turn"
STAGE_TOOL: Final = "tool"
STAGE_RETRIEVAL: Final = "retrieval"

BUCKETS: Final = ("queue", "retry", "connect", "first_token", "stream", "post")
BUCKET_PREFIX: Final = "llmspans.bucket."
BUCKET_ATTRIBUTES: Final = tuple(BUCKET_PREFIX + bucket for bucket in BUCKETS)
# The largest bucket of the call (ties go to the earlier one), so a tag search finds calls by cause.
BUCKET_DOMINANT: Final = "llmspans.bucket.dominant"

# Phase spans: children of a slow call's span, one per bucket that took time, made at its end.
# `llmspans.phase` names the bucket; the span names read as a sentence down a waterfall.
PHASE: Final = "llmspans.phase"
PHASE_SPAN_PREPARE: Final = "preparing the request"  # the client's own time before sending
PHASE_SPAN_QUEUE: Final = "waiting for a slot"
PHASE_SPAN_BACKOFF: Final = "backing off after {cause}"
PHASE_SPAN_CONNECT: Final = "connecting"
PHASE_SPAN_FIRST_TOKEN: Final = "waiting for the first token"
PHASE_SPAN_RESPONSE: Final = "waiting for the response"  # first_token of a call that does not stream
PHASE_SPAN_STREAM: Final = "streaming"
PHASE_SPAN_POST: Final = "after the last token"
PHASE_SPAN_POST_RESPONSE: Final = "after the response"  # post of a call that does not stream
PHASE_SPANS_SLOW: Final = "slow"
PHASE_SPANS_ALWAYS: Final = "always"
PHASE_SPANS_NEVER: Final = "never"

STREAM_CHUNKS: Final = "llmspans.stream.chunks"
STREAM_OUTCOME: Final = "llmspans.stream.outcome"
# True when the caller closed the response before its body's end was read (the openai SDK does, at
# `data: [DONE]`): over HTTP/1.1 its connection cannot go back to the pool. Absent otherwise.
STREAM_CLOSED_BEFORE_END: Final = "llmspans.stream.closed_before_end"
ITL_P50: Final = "llmspans.itl.p50"
ITL_P95: Final = "llmspans.itl.p95"
ITL_MAX: Final = "llmspans.itl.max"
OUTPUT_TOKENS_PER_SECOND: Final = "llmspans.output_tokens_per_second"

OUTCOME_COMPLETED: Final = "completed"
OUTCOME_ABANDONED: Final = "abandoned"
OUTCOME_ERROR: Final = "error"
OUTCOME_CANCELLED: Final = "cancelled"
# error.type of a stream that ended with neither its end marker nor any finish reason.
ERROR_INCOMPLETE_STREAM: Final = "incomplete_stream"

RETRY_COUNT: Final = "llmspans.retry.count"
RETRY_CAUSES: Final = "llmspans.retry.causes"
RETRY_WASTED_OUTPUT_TOKENS: Final = "llmspans.retry.wasted_output_tokens"
RETRY_CAUSE: Final = (
    "llmspans.retry.cause"  # one failed attempt's cause (retry events, back-off spans, metrics)
)
RETRY_BACKOFF: Final = "llmspans.retry.backoff"  # seconds from a failed attempt's end to the next one's start

CONNECT_NEW: Final = "llmspans.connect.new"
CONNECT_REUSED: Final = "llmspans.connect.reused"
CONNECT_DURATION: Final = "llmspans.connect.duration"

LIMITER_NAME: Final = "llmspans.limiter.name"
LIMITER_CAP: Final = "llmspans.limiter.cap"
LIMITER_IN_FLIGHT: Final = "llmspans.limiter.in_flight"
LIMITER_QUEUE_DEPTH: Final = "llmspans.limiter.queue_depth"
LIMITER_WAIT: Final = "llmspans.limiter.wait"

BUDGET: Final = "llmspans.budget"
BUDGET_EXCEEDED: Final = "llmspans.budget.exceeded"
BUDGET_OVERRUN: Final = "llmspans.budget.overrun"
BUDGET_CUT: Final = "llmspans.budget.cut"

# `llmspans load` (llmspans/load/): on each call span the load tool made, the level it ran at and the run,
# so `llmspans report` splits a traces file by level and `--baseline` compares two load runs.
LOAD_LEVEL: Final = "llmspans.load.level"  # e.g. "concurrency=8" or "rate=4" (requests/s)
LOAD_RUN_ID: Final = "llmspans.load.run_id"
# `llmspans load --ray`: the generator (a Ray actor) that sent the call, `g2@127.0.0.1:3f2a1b9c/5e6f7a8b`:
# its number in the run, its node (address and the node id's first 8 hex digits) and its actor id's.
LOAD_GENERATOR: Final = "llmspans.load.generator"
# `llmspans load --replay` (issue 41): on each replayed call span, where the recorded call came from (a traces
# file, `tempo <url>` or `jaeger <url>`) and the recorded call's trace and span ids, to set it beside its original.
LOAD_REPLAY_SOURCE: Final = "llmspans.load.replay.source"
LOAD_REPLAY_TRACE_ID: Final = "llmspans.load.replay.trace_id"
LOAD_REPLAY_SPAN_ID: Final = "llmspans.load.replay.span_id"

# Levers (docs/telemetry.md, docs/levers.md): a prompt cap on an instrumented client, and cache lookups.
# A capped call's prompt size as estimated before sending, by what, against which cap, and the estimate over
# the server's own count once it answered (`gen_ai.usage.input_tokens`).
PROMPT_ESTIMATED_TOKENS: Final = "llmspans.prompt.estimated_tokens"
PROMPT_ESTIMATOR: Final = "llmspans.prompt.estimator"  # `chars/4`, `tiktoken:<encoding>`, `hf:<name>`
PROMPT_CAP: Final = "llmspans.prompt.cap"
PROMPT_OVER_CAP: Final = "llmspans.prompt.over_cap"  # also on a capped call's metrics
PROMPT_ESTIMATE_RATIO: Final = "llmspans.prompt.estimate_ratio"
ESTIMATOR_CHARS: Final = "chars/4"
ERROR_PROMPT_TOO_LARGE: Final = "PromptTooLarge"  # error.type of a call a cap refused to send
# A cache lookup: a stage span (`llmspans.stage` = `cache`) with the cache's name, hit or miss, and on a
# hit the LLM time it saved as estimated from this process's own calls.
STAGE_CACHE: Final = "cache"
CACHE_NAME: Final = "llmspans.cache.name"
CACHE_HIT: Final = "llmspans.cache.hit"
CACHE_MODEL: Final = "llmspans.cache.model"
CACHE_SAVED_ESTIMATE: Final = "llmspans.cache.saved_estimate"
# Hedged requests (`instrument(client, hedge=llmspans.Hedge(...))`): on the call span, whether the backup copy
# was sent, after how long, which copy won and the loser's tokens; on each copy's attempt span its role,
# whether it won and its own time to its first token (streamed) or response headers (not streamed).
HEDGE_FIRED: Final = "llmspans.hedge.fired"
HEDGE_AFTER: Final = "llmspans.hedge.after"
HEDGE_WON_BY: Final = "llmspans.hedge.won_by"
HEDGE_SKIPPED: Final = "llmspans.hedge.skipped"
HEDGE_WASTED_INPUT_TOKENS: Final = "llmspans.hedge.wasted_input_tokens"
HEDGE_WASTED_OUTPUT_TOKENS: Final = "llmspans.hedge.wasted_output_tokens"
HEDGE_ROLE: Final = "llmspans.hedge.role"
HEDGE_WON: Final = "llmspans.hedge.won"
HEDGE_FIRST_TOKEN: Final = "llmspans.hedge.first_token"
HEDGE_ROLE_PRIMARY: Final = "primary"
HEDGE_ROLE_BACKUP: Final = "backup"
HEDGE_SKIPPED_LIMITER: Final = "limiter_full"  # the hedge came due, but the client's limiter had no free slot

TURN_STAGE_PREFIX: Final = "llmspans.turn.stage."
TURN_DOMINANT_STAGE: Final = "llmspans.turn.dominant_stage"

CODE_FUNCTION: Final = "code.function.name"

EVENT_ADMITTED: Final = "llmspans.admitted"
EVENT_FIRST_TOKEN: Final = "llmspans.first_token"
EVENT_LAST_TOKEN: Final = "llmspans.last_token"
EVENT_RETRY: Final = "llmspans.retry"
EVENT_BUDGET_EXCEEDED: Final = "llmspans.budget.exceeded"
EVENT_HEDGE: Final = "llmspans.hedge"  # the backup copy of a hedged call was sent
# Seconds from the call's start to an event's instant (some UIs show event times coarsely).
ELAPSED: Final = "llmspans.elapsed"
# The semantic conventions' exception event; llmspans writes its type, never its message.
EVENT_EXCEPTION: Final = "exception"
EXCEPTION_TYPE: Final = "exception.type"

# --- metrics --------------------------------------------------------------------------------
METRIC_OPERATION_DURATION: Final = "gen_ai.client.operation.duration"
METRIC_TOKEN_USAGE: Final = "gen_ai.client.token.usage"
METRIC_TIME_TO_FIRST_CHUNK: Final = "gen_ai.client.operation.time_to_first_chunk"
METRIC_TIME_PER_OUTPUT_CHUNK: Final = "gen_ai.client.operation.time_per_output_chunk"
METRIC_BUCKET_DURATION: Final = "llmspans.bucket.duration"
METRIC_STREAM_OUTPUT_SPEED: Final = "llmspans.stream.output_speed"  # {token}/s, streamed calls only
METRIC_STAGE_DURATION: Final = "llmspans.stage.duration"
METRIC_STAGE_BUDGET: Final = "llmspans.stage.budget"
METRIC_BUDGET_EXCEEDED: Final = "llmspans.budget.exceeded"
METRIC_RETRY_ATTEMPTS: Final = "llmspans.retry.attempts"
METRIC_CONNECT_NEW: Final = "llmspans.connect.new"
METRIC_LIMITER_IN_FLIGHT: Final = "llmspans.limiter.in_flight"
METRIC_LIMITER_QUEUE_DEPTH: Final = "llmspans.limiter.queue_depth"
METRIC_LIMITER_CAP: Final = "llmspans.limiter.cap"
METRIC_PROMPT_ESTIMATE_RATIO: Final = PROMPT_ESTIMATE_RATIO
METRIC_CACHE_LOOKUPS: Final = "llmspans.cache.lookups"
METRIC_CACHE_SAVED_ESTIMATE: Final = CACHE_SAVED_ESTIMATE
METRIC_HEDGE_FIRED: Final = HEDGE_FIRED
METRIC_HEDGE_BACKUP_WON: Final = "llmspans.hedge.backup_won"
METRIC_HEDGE_WASTED_TOKENS: Final = "llmspans.hedge.wasted_tokens"

# The SDK's attribute set for points beyond an instrument's cardinality limit (llmspans' own aggregation too).
METRIC_OVERFLOW: Final = "otel.metric.overflow"
METRIC_ATTR_BUCKET: Final = "llmspans.bucket"
METRIC_ATTR_RETRY_CAUSE: Final = RETRY_CAUSE
TOKEN_TYPE_INPUT: Final = "input"
TOKEN_TYPE_OUTPUT: Final = "output"

# Bucket boundaries from the GenAI semantic conventions.
DURATION_BOUNDARIES: Final = (
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
)  # fmt: skip
TOKEN_BOUNDARIES: Final = (
    1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864,
)  # fmt: skip
# The conventions' per-output-token boundaries, used for time per output chunk.
# Output tokens per second of streaming: from a slow CPU model to a fast speculative decoder.
SPEED_BOUNDARIES: Final = (
    1.0,
    2.0,
    5.0,
    10.0,
    20.0,
    50.0,
    100.0,
    200.0,
    500.0,
    1000.0,
    2000.0,
    5000.0,
    10000.0,
)
# The prompt estimate over the server's count: 1 is exact, below 1 the estimate was low.
RATIO_BOUNDARIES: Final = (0.5, 0.67, 0.8, 0.9, 0.95, 1.0, 1.05, 1.1, 1.25, 1.5, 2.0)
CHUNK_BOUNDARIES: Final = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)

# --- OpenInference (Arize Phoenix), opt-in: configure(openinference=True) or LLMSPANS_OPENINFERENCE ------
OPENINFERENCE_SPAN_KIND: Final = "openinference.span.kind"
OPENINFERENCE_PROJECT_NAME: Final = "openinference.project.name"  # a resource attribute
OPENINFERENCE_KIND_CHAIN: Final = "CHAIN"
OPENINFERENCE_KIND_GUARDRAIL: Final = "GUARDRAIL"
STAGE_GUARDRAIL: Final = "guardrail"

# --- environment ------------------------------------------------------------------------------
ENV_TRACES_FILE: Final = "LLMSPANS_TRACES_FILE"
ENV_BUDGETS: Final = "LLMSPANS_BUDGETS"
ENV_CAPTURE_CONTENT: Final = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
DEFAULT_TRACES_FILE: Final = "llmspans-traces.jsonl"
ENV_PHASE_SPANS: Final = "LLMSPANS_PHASE_SPANS"
ENV_SLOW_AFTER: Final = "LLMSPANS_SLOW_AFTER"
ENV_OPENINFERENCE: Final = "LLMSPANS_OPENINFERENCE"

# --- providers (`gen_ai.provider.name`) ---------------------------------------------------------
PROVIDER_OPENAI: Final = "openai"
PROVIDER_AZURE_OPENAI: Final = "azure.ai.openai"  # the conventions' value for Azure OpenAI

# --- vLLM ---------------------------------------------------------------------------------------
PROVIDER_VLLM: Final = "vllm"
GEN_AI_REQUEST_TOP_K: Final = "gen_ai.request.top_k"

# Server state sampled from vLLM's /metrics (llmspans.vllm.ServerMetrics), stamped on call spans
# as they end and exported as gauges of the same names; each only when the server exposes its source.
VLLM_NUM_REQUESTS_WAITING: Final = "vllm.num_requests_waiting"
# The most requests waiting in any read taken between a call's sending and its first token (call spans only).
VLLM_NUM_REQUESTS_WAITING_MAX: Final = "vllm.num_requests_waiting_max"
VLLM_NUM_REQUESTS_RUNNING: Final = "vllm.num_requests_running"
VLLM_KV_CACHE_USAGE: Final = "vllm.kv_cache_usage"
VLLM_PREEMPTION_RATE: Final = "vllm.preemption_rate"  # per second, over the last sampling interval
VLLM_PREFIX_CACHE_HIT_RATIO: Final = "vllm.prefix_cache_hit_ratio"  # over the last sampling interval
VLLM_NUM_REQUESTS_WAITING_FOR_CAPACITY: Final = "vllm.num_requests_waiting_for_capacity"
VLLM_NUM_REQUESTS_WAITING_DEFERRED: Final = "vllm.num_requests_waiting_deferred"
VLLM_ADMISSION_REJECTION_RATE: Final = "vllm.admission_rejection_rate"  # per second, likewise
VLLM_METRICS_AGE: Final = "vllm.metrics.age"
METRIC_VLLM_NUM_REQUESTS_WAITING: Final = VLLM_NUM_REQUESTS_WAITING
METRIC_VLLM_NUM_REQUESTS_RUNNING: Final = VLLM_NUM_REQUESTS_RUNNING
METRIC_VLLM_KV_CACHE_USAGE: Final = VLLM_KV_CACHE_USAGE
METRIC_VLLM_PREEMPTION_RATE: Final = VLLM_PREEMPTION_RATE
METRIC_VLLM_PREFIX_CACHE_HIT_RATIO: Final = VLLM_PREFIX_CACHE_HIT_RATIO
METRIC_VLLM_NUM_REQUESTS_WAITING_FOR_CAPACITY: Final = VLLM_NUM_REQUESTS_WAITING_FOR_CAPACITY
METRIC_VLLM_NUM_REQUESTS_WAITING_DEFERRED: Final = VLLM_NUM_REQUESTS_WAITING_DEFERRED
METRIC_VLLM_ADMISSION_REJECTION_RATE: Final = VLLM_ADMISSION_REJECTION_RATE

# vLLM's own Prometheus names, as its /metrics serves them, with the releases that serve them
# (labels `model_name`, and `engine` on the newer engine; "the older engine" is 0.8.5-0.10.x started
# with --otlp-traces-endpoint; "0.32" is the release a real server in the test run shows them on, releases
# between 0.13 and 0.32 were not checked). Counters are named without the `_total` their samples carry.
PROMETHEUS_VLLM_NUM_REQUESTS_WAITING: Final = "vllm:num_requests_waiting"  # every release
PROMETHEUS_VLLM_NUM_REQUESTS_RUNNING: Final = "vllm:num_requests_running"  # every release
PROMETHEUS_VLLM_KV_CACHE_USAGE: Final = "vllm:kv_cache_usage_perc"  # 0.9.2 and later (newer engine)
# Up to 0.10.x and on the older engine; hidden behind --show-hidden-metrics-for-version in 0.11; gone in 0.12.
PROMETHEUS_VLLM_GPU_CACHE_USAGE: Final = "vllm:gpu_cache_usage_perc"
PROMETHEUS_VLLM_NUM_PREEMPTIONS: Final = "vllm:num_preemptions"  # counter, 0.9.2 and later, older engine
PROMETHEUS_VLLM_REQUEST_NUM_PREEMPTIONS: Final = "vllm:request_num_preemptions"  # per finished request, 0.32
PROMETHEUS_VLLM_PREFIX_CACHE_QUERIES: Final = "vllm:prefix_cache_queries"  # counter (tokens), 0.9.2 and later
PROMETHEUS_VLLM_PREFIX_CACHE_HITS: Final = "vllm:prefix_cache_hits"  # counter (tokens), 0.9.2 and later
PROMETHEUS_VLLM_GPU_PREFIX_CACHE_QUERIES: Final = "vllm:gpu_prefix_cache_queries"  # their names before 0.9.2
PROMETHEUS_VLLM_GPU_PREFIX_CACHE_HITS: Final = "vllm:gpu_prefix_cache_hits"
PROMETHEUS_VLLM_PROMPT_TOKENS: Final = "vllm:prompt_tokens"  # counter, every release
PROMETHEUS_VLLM_PROMPT_TOKENS_CACHED: Final = "vllm:prompt_tokens_cached"  # counter, 0.32
PROMETHEUS_VLLM_NUM_REQUESTS_WAITING_BY_REASON: Final = "vllm:num_requests_waiting_by_reason"  # 0.32
PROMETHEUS_VLLM_ADMISSION_REJECTIONS: Final = "vllm:admission_rejections"  # counter, 0.32 (no `engine` label)
PROMETHEUS_VLLM_REASON_CAPACITY: Final = "capacity"  # the `reason` label's values
PROMETHEUS_VLLM_REASON_DEFERRED: Final = "deferred"

# vLLM's server span (started with --otlp-traces-endpoint): one SERVER span per finished request,
# start time backdated to arrival; the report splits first_token and stream with these. The newer
# engine (0.11 and later) has prefill, decode and inference and counts time_in_queue from when the
# engine queued the request; the older one (0.8.5-0.10.x with tracing) has none of the three, counts
# time_in_queue from the arrival, and adds time_in_scheduler (and, with --collect-detailed-traces,
# time_in_model_forward and time_in_model_execute).
VLLM_SERVER_SPAN: Final = "llm_request"
GEN_AI_LATENCY_TIME_IN_QUEUE: Final = "gen_ai.latency.time_in_queue"
GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN: Final = "gen_ai.latency.time_to_first_token"
GEN_AI_LATENCY_E2E: Final = "gen_ai.latency.e2e"
GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL: Final = "gen_ai.latency.time_in_model_prefill"
GEN_AI_LATENCY_TIME_IN_MODEL_DECODE: Final = "gen_ai.latency.time_in_model_decode"
GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE: Final = "gen_ai.latency.time_in_model_inference"
GEN_AI_LATENCY_TIME_IN_SCHEDULER: Final = "gen_ai.latency.time_in_scheduler"
GEN_AI_LATENCY_TIME_IN_MODEL_FORWARD: Final = "gen_ai.latency.time_in_model_forward"
GEN_AI_LATENCY_TIME_IN_MODEL_EXECUTE: Final = "gen_ai.latency.time_in_model_execute"
GEN_AI_REQUEST_ID: Final = "gen_ai.request.id"
GEN_AI_REQUEST_N: Final = "gen_ai.request.n"
GEN_AI_USAGE_PROMPT_TOKENS: Final = "gen_ai.usage.prompt_tokens"
GEN_AI_USAGE_COMPLETION_TOKENS: Final = "gen_ai.usage.completion_tokens"

# Tail sampling (`configure(tail_sampling=llmspans.TailSampling(...))`, `llmspans.TailSamplingProcessor`):
# every exported span of a tail-sampled trace says how many traces it stands for (1 when kept by a rule,
# 1/ratio when kept by chance); the overflow counter counts traces decided early at a memory cap.
SAMPLE_WEIGHT: Final = "llmspans.sample.weight"
METRIC_SAMPLE_OVERFLOW: Final = "llmspans.sample.overflow"
SAMPLE_OVERFLOW_CAP: Final = "llmspans.sample.cap"  # trace_spans | held_spans | max_age
ENV_TRACES_SAMPLER: Final = "OTEL_TRACES_SAMPLER"
ENV_TAIL_SAMPLING: Final = "LLMSPANS_TAIL_SAMPLING"
