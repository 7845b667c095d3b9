"""OpenInference for Arize Phoenix, opt-in: the span kinds Phoenix cannot infer, and the project.

Phoenix derives a span's kind from the GenAI attributes (`chat` is LLM, `retrieval` RETRIEVER,
`execute_tool` TOOL) and shows every other span as "unknown". With `configure(openinference=True)`
or `LLMSPANS_OPENINFERENCE=true`, turns and app stages say theirs in `openinference.span.kind`
(turn → CHAIN, a `guardrail` stage → GUARDRAIL, any other stage → CHAIN), and `configure()` names
the Phoenix project after the service (`openinference.project.name` on the resource). Nothing else
changes; off by default, since the attribute means nothing to other backends.
"""

from __future__ import annotations

import os

from llmspans import _names as names

_TRUE = ("1", "true", "yes", "on")

# Read as each stage or turn starts (one module attribute lookup); `configure()` sets it.
enabled = os.environ.get(names.ENV_OPENINFERENCE, "").strip().lower() in _TRUE


def configure(on: bool) -> None:
    global enabled
    enabled = on


def reset() -> None:
    """Back to the environment's setting (tests)."""
    global enabled
    enabled = os.environ.get(names.ENV_OPENINFERENCE, "").strip().lower() in _TRUE


def stage_kind(stage: str, operation: str | None) -> str | None:
    """The kind of a stage span, or None where Phoenix infers it from the GenAI operation (tools, retrieval)."""
    if operation is not None:
        return None
    if stage == names.STAGE_GUARDRAIL:
        return names.OPENINFERENCE_KIND_GUARDRAIL
    return names.OPENINFERENCE_KIND_CHAIN


def project_attributes(service_name: str | None) -> dict[str, str]:
    """The resource attributes that put the service's spans in a Phoenix project of its name, unless the
    resource already names one (`OTEL_RESOURCE_ATTRIBUTES=openinference.project.name=...`)."""
    if not enabled or not service_name:
        return {}
    if names.OPENINFERENCE_PROJECT_NAME + "=" in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", ""):
        return {}
    return {names.OPENINFERENCE_PROJECT_NAME: service_name}
