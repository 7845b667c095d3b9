"""Did the test bench reproduce production? The recorded calls against their replay at 1x speed.

Per bucket and per stage (`llm`: the call as a whole), the p50 and p95 of the recorded calls against the
same calls replayed at speed 1, over the calls that succeeded on each side, nearest rank as everywhere in
llmspans; and one line naming the largest difference (the part and quantile whose replayed value moved
furthest from its recorded one). The replayed requests' token counts are held against the recorded ones
(input and output, request by request), and so is the order of each turn's calls.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from llmspans import _names as names
from llmspans.load._model import Level
from llmspans.load._replay import RecordedCall, Recording
from llmspans.load._requests import RequestRecord
from llmspans.report._model import format_seconds, quantile

STAGE_CALL = names.STAGE_LLM  # the call span's own duration: the one stage a replay sends
NS = 1e9


@dataclass(frozen=True)
class ComparedRow:
    part: str  # a bucket, or `llm` (the call as a whole)
    kind: str  # "bucket" or "stage"
    recorded_count: int
    recorded_p50: float
    recorded_p95: float
    replayed_count: int
    replayed_p50: float
    replayed_p95: float


@dataclass(frozen=True)
class TokenMatch:
    """Replayed requests whose server counts equal the recorded call's (both sides known)."""

    compared_input: int
    input_exact: int
    input_most_off: int  # the largest |replayed - recorded| input tokens
    compared_output: int
    output_exact: int
    output_most_off: int


@dataclass(frozen=True)
class TurnOrder:
    """Turns of more than one call, and how many of them were sent in their recorded order."""

    turns: int
    in_order: int


@dataclass(frozen=True)
class ReplayResult:
    source: str
    described: str
    calls: int
    assumptions: tuple[str, ...]  # one line per cause: which calls, what was assumed
    speed: float | None  # the level compared (1x), None when it did not run
    rows: tuple[ComparedRow, ...] = ()
    largest: str | None = None  # the line naming the largest difference
    tokens: TokenMatch | None = None
    order: TurnOrder | None = None

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def compare(
    recording: Recording, levels: Mapping[str, Sequence[RequestRecord]], assumptions: Sequence[str],
    *, speed: float = 1.0,
) -> ReplayResult:  # fmt: skip
    """The replay's result: the recording, what was assumed, and the calls against their replay at `speed`
    (`levels`: each level's records by label)."""
    label = Level("speed", speed).label
    records = levels.get(label)
    common = {
        "source": recording.source,
        "described": recording.described,
        "calls": len(recording.calls),
        "assumptions": tuple(assumptions),
    }
    if not records:
        return ReplayResult(speed=None, **common)  # type: ignore[arg-type]
    calls = recording.calls
    count = len(calls)
    recorded = [call for call in calls if not call.failed]
    replayed = [record for record in records if record.ok and record.recorded]
    rows = []
    for position, bucket in enumerate(names.BUCKETS):
        rows.append(
            _row(
                bucket, "bucket", [call.buckets_ns[position] if call.buckets_ns else 0 for call in recorded],
                [record.buckets_ns.get(bucket, 0) for record in replayed],
            )
        )  # fmt: skip
    rows.append(
        _row(STAGE_CALL, "stage", [call.duration_ns for call in recorded], [r.duration_ns for r in replayed])
    )
    return ReplayResult(
        speed=speed, rows=tuple(rows), largest=largest_difference(rows), tokens=_tokens(calls, replayed, count),
        order=_order(calls, records, count), **common,  # type: ignore[arg-type]
    )  # fmt: skip


def _row(part: str, kind: str, recorded_ns: Sequence[int], replayed_ns: Sequence[int]) -> ComparedRow:
    before = sorted(value / NS for value in recorded_ns)
    after = sorted(value / NS for value in replayed_ns)
    return ComparedRow(
        part, kind, len(before), quantile(before, 0.5), quantile(before, 0.95), len(after),
        quantile(after, 0.5), quantile(after, 0.95),
    )  # fmt: skip


def largest_difference(rows: Sequence[ComparedRow]) -> str | None:
    """The bucket and quantile whose replayed value is furthest from the recorded one, in words, and the
    call's own p95 beside it (the buckets add up to the call: the call alone would always be the largest)."""
    found: tuple[float, str, str, float, float] | None = None
    for row in rows:
        if row.kind != "bucket" or not (row.recorded_count and row.replayed_count):
            continue
        for name, before, after in (
            ("p50", row.recorded_p50, row.replayed_p50),
            ("p95", row.recorded_p95, row.replayed_p95),
        ):
            if found is None or abs(after - before) > found[0]:
                found = (abs(after - before), row.part, name, before, after)
    if found is None:
        return None
    _, part, name, before, after = found
    said = f"largest difference: {part} {name}, {_change(before, after)}"
    call = next(
        (row for row in rows if row.kind == "stage" and row.recorded_count and row.replayed_count), None
    )
    if call is not None:
        said += f"; the call's p95, {_change(call.recorded_p95, call.replayed_p95)}"
    return said


def _change(before: float, after: float) -> str:
    ratio = f", {after / before:.1f}x" if before > 0 and after > 0 else ""
    sign = "+" if after >= before else "-"
    return (
        f"{format_seconds(before)} recorded, {format_seconds(after)} replayed ({sign}{format_seconds(abs(after - before))}"
        f"{ratio})"
    )


def _tokens(calls: Sequence[RecordedCall], replayed: Sequence[RequestRecord], count: int) -> TokenMatch:
    inputs: list[int] = []
    outputs: list[int] = []
    for record in replayed:
        call = calls[record.index % count]
        if call.input_tokens is not None and record.input_tokens is not None:
            inputs.append(abs(record.input_tokens - call.input_tokens))
        if call.output_tokens is not None and record.output_tokens is not None:
            outputs.append(abs(record.output_tokens - call.output_tokens))
    return TokenMatch(
        len(inputs),
        inputs.count(0),
        max(inputs, default=0),
        len(outputs),
        outputs.count(0),
        max(outputs, default=0),
    )


def _order(calls: Sequence[RecordedCall], records: Sequence[RequestRecord], count: int) -> TurnOrder:
    """For each turn of several calls: were its calls sent in their recorded order (by when they were sent)?"""
    sent: dict[str, list[tuple[int, int]]] = {}
    for record in records:
        if record.issued_ns:
            call = calls[record.index % count]
            sent.setdefault(call.turn, []).append((record.issued_ns, call.number))
    turns = in_order = 0
    for pairs in sent.values():
        if len(pairs) < 2:
            continue
        turns += 1
        numbers = [number for _, number in sorted(pairs)]
        in_order += numbers == sorted(numbers)
    return TurnOrder(turns, in_order)


def token_words(tokens: TokenMatch) -> str:
    return (
        f"input tokens as recorded for {tokens.input_exact} of {tokens.compared_input} requests (most off by "
        f"{tokens.input_most_off}); output tokens for {tokens.output_exact} of {tokens.compared_output} (most off "
        f"by {tokens.output_most_off})"
    )
