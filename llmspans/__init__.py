"""llmspans: where an LLM request's time goes, as OpenTelemetry spans and metrics.

The whole public API is here; everything else in the package is private.
"""

from llmspans._budget import BudgetExceeded
from llmspans._cache import CacheLookup, cache, cache_lookup
from llmspans._hedge.policy import Hedge
from llmspans._instrument import instrument, instrument_all, uninstrument, uninstrument_all
from llmspans._limiter import Admission, Limiter, LimiterStats, LimiterTimeout
from llmspans._prompt import PromptTooLarge
from llmspans._setup import Configuration, configure
from llmspans._stages import retrieval, stage, tool, turn
from llmspans._tail_sampling import TailSampling, TailSamplingProcessor
from llmspans._version import __version__

__all__ = [
    "Admission",
    "BudgetExceeded",
    "CacheLookup",
    "Configuration",
    "Hedge",
    "Limiter",
    "LimiterStats",
    "LimiterTimeout",
    "PromptTooLarge",
    "TailSampling",
    "TailSamplingProcessor",
    "__version__",
    "cache",
    "cache_lookup",
    "configure",
    "instrument",
    "instrument_all",
    "retrieval",
    "stage",
    "tool",
    "turn",
    "uninstrument",
    "uninstrument_all",
]
