"""The vLLM server's pressure signals across a run, from what the sampler stamped on each call span.

`llmspans.vllm.ServerMetrics` stamps a call span as it ends with the server's state: waiting and
running requests, KV-cache usage, the preemption rate and the prefix-cache hit ratio over the last
sampling interval (docs/telemetry.md says which release provides which), and the most requests waiting
in any read taken while the call waited for its first token. Read in the order the calls started, they
tell the triage apart what first_token alone cannot: a server out of KV cache (preempting), a queue
that is on the server rather than in the client, prompts that stopped sharing a prefix. Each trend
compares the first half of the run's calls with the second; a call's waiting requests are those seen
while it waited when a read was taken then, else the freshest sample at its end.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmspans import _names as names
from llmspans.report._model import ServerPressure
from llmspans.report._spans import Span

_SIGNALS = (
    names.VLLM_KV_CACHE_USAGE,
    names.VLLM_PREEMPTION_RATE,
    names.VLLM_NUM_REQUESTS_WAITING,
    names.VLLM_PREFIX_CACHE_HIT_RATIO,
)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _halves(samples: list[tuple[int, float]]) -> tuple[float | None, float | None]:
    """The mean of the earlier and of the later half, by the calls' start."""
    if len(samples) < 2:
        return None, None
    ordered = [value for _, value in sorted(samples)]
    middle = len(ordered) // 2
    return _mean(ordered[:middle]), _mean(ordered[middle:])


@dataclass
class PressureCollector:
    """Collects each signal with the start of the call it was stamped on."""

    samples: dict[str, list[tuple[int, float]]] = field(default_factory=lambda: {key: [] for key in _SIGNALS})

    def add(self, call: Span) -> None:
        attributes = call.attributes
        for key in _SIGNALS:
            value = attributes.get(key)
            if key == names.VLLM_NUM_REQUESTS_WAITING:
                value = attributes.get(names.VLLM_NUM_REQUESTS_WAITING_MAX, value)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.samples[key].append((call.start_ns, float(value)))

    def result(self) -> ServerPressure | None:
        if not any(self.samples.values()):
            return None
        kv = [value for _, value in self.samples[names.VLLM_KV_CACHE_USAGE]]
        preemptions_before, preemptions_after = _halves(self.samples[names.VLLM_PREEMPTION_RATE])
        waiting_before, waiting_after = _halves(self.samples[names.VLLM_NUM_REQUESTS_WAITING])
        hits_before, hits_after = _halves(self.samples[names.VLLM_PREFIX_CACHE_HIT_RATIO])
        return ServerPressure(
            calls=max(len(values) for values in self.samples.values()),
            kv_cache_usage_max=max(kv) if kv else None,
            preemption_rate_before=preemptions_before,
            preemption_rate_after=preemptions_after,
            waiting_before=waiting_before,
            waiting_after=waiting_after,
            prefix_cache_hit_ratio_before=hits_before,
            prefix_cache_hit_ratio_after=hits_after,
        )
