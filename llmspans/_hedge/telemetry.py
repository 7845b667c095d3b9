"""What a hedged call says: the `llmspans.hedge` event when its backup leaves, and at its end the hedge's
attributes on the call span, the copies' attempt spans and the hedge's metrics (docs/telemetry.md)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from opentelemetry.util.types import AttributeValue

from llmspans import _guard, _prompt, _telemetry, _transport
from llmspans import _metrics as metric
from llmspans import _names as names
from llmspans import _sites as sites
from llmspans._budget import seconds
from llmspans._call import CallRecord, CallShape
from llmspans._guard import check_fault, report, swallow
from llmspans._hedge.copies import Copy


class Race(Protocol):
    """What the telemetry reads of a race (`race.Race`, which calls it: hence a protocol, not an import)."""

    fired_ns: int | None
    after_ns: int | None
    skipped: str | None
    winner: Copy | None
    backup: Copy | None
    primary: Copy
    body: Mapping[str, Any]


_KEPT = 256


def launched(call: CallRecord, at_ns: int) -> None:
    """The backup really left (its thread or task started): an event on the call span, at that instant."""
    if call.recording and not call.finished:
        with swallow(sites.HEDGE_SPAN):
            call.span.add_event(
                names.EVENT_HEDGE, {names.ELAPSED: seconds(at_ns - call.queued_ns)}, call.wall_ns(at_ns)
            )


def write(race: Race, record: CallRecord) -> None:
    """The hedge's attributes on the call span and its metrics, once the call is written (`guarded`, inlined:
    it runs on every call of a hedged client)."""
    try:
        if _guard.faults:
            check_fault(sites.HEDGE_FINISH)
        fired = race.fired_ns is not None
        attributes: dict[str, AttributeValue] = {names.HEDGE_FIRED: fired}
        if race.after_ns is not None:
            attributes[names.HEDGE_AFTER] = race.after_ns / 1e9  # `seconds`, inlined
        if race.skipped is not None:
            attributes[names.HEDGE_SKIPPED] = race.skipped
        if fired:
            records: list[metric.Record] = []
            labels = _labels_of(record.shape)
            if record.recording:
                _span_primary(race, record)
            winner = race.winner
            records.append((metric.HEDGE_FIRED, 1, labels[0]))
            if winner is not None:
                attributes[names.HEDGE_WON_BY] = winner.role
                if winner is race.backup:
                    records.append((metric.HEDGE_BACKUP_WON, 1, labels[0]))
            loser = race.backup if winner is not race.backup else race.primary
            if loser is not None and loser.attempts:  # it was sent: its prompt was read, at least
                output, reported = loser.wasted or (loser.content_seen, loser.reported_input)
                wasted_input = _input_tokens(race, record, reported)
                attributes[names.HEDGE_WASTED_INPUT_TOKENS] = wasted_input
                attributes[names.HEDGE_WASTED_OUTPUT_TOKENS] = output
                records.append((metric.HEDGE_WASTED_TOKENS, wasted_input, labels[1]))
                if output:
                    records.append((metric.HEDGE_WASTED_TOKENS, output, labels[2]))
                opened = sum(1 for attempt in loser.attempts if attempt.new_connection)
                if opened:  # the loser's connections are the call's churn too
                    total = opened + sum(1 for attempt in record.attempts if attempt.new_connection)
                    attributes[names.CONNECT_NEW] = total
                    records.append((metric.CONNECT_NEW, opened, record.shape.metric_labels))
            recorder = _telemetry.recorder()
            recorder.add(
                records, recorder.sample(record.span, record.wall_ns(record.released_ns or record.queued_ns))
            )
        if record.recording:
            record.span.set_attributes(attributes)
    except Exception as failure:
        report(sites.HEDGE_FINISH, failure)


def _span_primary(race: Race, record: CallRecord) -> None:
    """The primary's attempts that ran without a span (the one under way when the backup left): their spans
    now, with their real start (and end, when over), as a retried call's first attempt gets."""
    primary = race.primary
    attempts = primary.attempts
    for attempt in attempts:
        if attempt.span is not None:
            continue
        with swallow(sites.HEDGE_SPAN):
            if attempt is attempts[-1]:  # what it did, before its span may end (its role it says already)
                extra: dict[str, AttributeValue] = dict(attempt.span_attributes or {})
                if race.winner is primary:
                    extra[names.HEDGE_WON] = True
                if primary.first_token_s is not None:
                    extra[names.HEDGE_FIRST_TOKEN] = primary.first_token_s
                attempt.span_attributes = extra
            _transport.span_attempt_after(record, attempt)  # ended now if over, else by the transport


def _input_tokens(race: Race, record: CallRecord, reported_by_loser: int | None) -> int:
    """The loser's prompt: the winner's count, else the loser's own, else the estimate made before the call
    was sent (a prompt cap's), else characters/4."""
    if record.input_tokens is not None:
        return record.input_tokens
    if reported_by_loser is not None:
        return reported_by_loser
    if record.estimated_input_tokens is not None:
        return record.estimated_input_tokens
    texts, tokens = _prompt.prompt_pieces(race.body)
    return _prompt.CHARACTERS.count(texts) + tokens


_label_sets: dict[str, tuple[metric.Labels, metric.Labels, metric.Labels]] = {}
_LABEL_KEYS = (names.GEN_AI_OPERATION_NAME, names.GEN_AI_PROVIDER_NAME, names.GEN_AI_REQUEST_MODEL)


def _labels_of(shape: CallShape) -> tuple[metric.Labels, metric.Labels, metric.Labels]:
    """By model: the counters' attributes, and the wasted tokens' for input and for output."""
    key = shape.metric_labels.key
    found = _label_sets.get(key)
    if found is None:
        attributes = shape.metric_labels.attributes
        common = {k: attributes[k] for k in _LABEL_KEYS if k in attributes}
        found = (
            metric.Labels(common),
            metric.Labels({**common, names.GEN_AI_TOKEN_TYPE: names.TOKEN_TYPE_INPUT}),
            metric.Labels({**common, names.GEN_AI_TOKEN_TYPE: names.TOKEN_TYPE_OUTPUT}),
        )
        if len(_label_sets) >= _KEPT:
            _label_sets.clear()
        _label_sets[key] = found
    return found
