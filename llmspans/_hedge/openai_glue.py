"""A `Hedge` bound to one openai client: which of its calls are raced, what sends each copy, and what an SDK
item says (content or not). The adapter knows it only as `_settings.Sending`: it asks once per client for the
function that sends its calls."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping
from typing import Any

from llmspans import _guard, _internals, _openai_wire, _transport
from llmspans import _sites as sites
from llmspans._adapters.openai_sdk import original_request, raw_mode
from llmspans._call import CallRecord
from llmspans._guard import check_fault, report
from llmspans._hedge import runs
from llmspans._hedge.policy import Hedge, check_client, eligible, is_async
from llmspans._hedge.race import Race
from llmspans._limiter import Limiter


class Hedging:
    """A `Hedge` bound to one instrumented openai client (`Settings.hedge`, a `_settings.Sending`)."""

    def __init__(self, hedge: Hedge, client: Any) -> None:
        check_client(hedge, client)
        self.hedge = hedge
        self.is_async = is_async(type(client))
        backup = hedge.backup
        if backup is not None and backup is not client:
            # The backup's copies are watched by its transport as the primary's are (it records nothing of the
            # backup's own calls, which have no call of ours around them): that is how a sync one is stopped.
            http_client = _internals.openai_http_client(backup)
            if http_client is not None:
                _transport.install(http_client)

    def sender(self, client: Any, send: Callable[..., Any], limiter: Limiter | None) -> Callable[..., Any]:
        """What the adapter of `client` sends a call with, in place of `send` (the SDK's own request)."""
        if self.is_async:
            return functools.partial(_send_async, self, client, send, limiter)
        return functools.partial(_send_sync, self, client, send, limiter)

    def start(
        self, client: Any, send: Callable[..., Any], limiter: Limiter | None, args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Race | None:  # fmt: skip
        """The race of one call, or None: a call that must not be sent twice (`eligible`), or llmspans failed
        (`sites.HEDGE_BEGIN`: the call goes unhedged). It runs on every call of a hedged client: no guard
        wrapper, no abstract-class check where a plain dict is what comes."""
        try:
            if _guard.faults:
                check_fault(sites.HEDGE_BEGIN)
            call = _transport.active_call.get()
            options = args[1] if len(args) > 1 else kwargs.get("options")
            if call is None or type(call) is not CallRecord or options is None:
                return None
            url = getattr(options, "url", None)
            if type(url) is not str or raw_mode(options) is not None:
                return None  # a raw response the app reads itself
            data = options.json_data
            body: Mapping[str, Any] = data if type(data) is dict or isinstance(data, Mapping) else {}
            extra = getattr(options, "extra_json", None)
            if extra and isinstance(extra, Mapping):
                body = {**body, **extra}
            if not eligible(str(getattr(options, "method", "post")), url, body):
                return None
            is_content = (
                _openai_wire.carries_tokens if call.stream else _whole
            )  # a whole answer: at its headers
            return Race(
                self.hedge, call, send, functools.partial(self.backup_request, client, send), limiter, self.is_async,
                args, kwargs, body, is_content,
                time.perf_counter_ns(),
            )  # fmt: skip
        except Exception as failure:
            report(sites.HEDGE_BEGIN, failure)
            return None

    def backup_request(self, client: Any, send: Callable[..., Any]) -> Callable[..., Any]:
        """What sends the backup: the client's own request, or the backup client's (under llmspans' own
        instrumentation when it has one: no call of ours around the copy)."""
        backup = self.hedge.backup
        if backup is None or backup is client:
            return send
        return original_request(backup)


def _send_sync(hedging: Hedging, client: Any, send: Callable[..., Any], limiter: Limiter | None, *args: Any, **kwargs: Any) -> Any:  # fmt: skip
    race = hedging.start(client, send, limiter, args, kwargs)
    return send(*args, **kwargs) if race is None else runs.run_sync(race)


async def _send_async(hedging: Hedging, client: Any, send: Callable[..., Any], limiter: Limiter | None, *args: Any, **kwargs: Any) -> Any:  # fmt: skip
    race = hedging.start(client, send, limiter, args, kwargs)
    return await send(*args, **kwargs) if race is None else await runs.run_async(race)


# --- what an SDK item says ------------------------------------------------------------------------------


def _whole(item: Any) -> bool:
    return True
