"""The report's engine candidates, each reading an OTLP-JSON lines file into the per-span facts the analysis
needs (ids, parent, name, kind, times, status, stage, the six buckets, budget): how fast, how much memory.

    python benchmarks/report_engines.py ENGINE FILE      # ENGINE: json, orjson, msgspec, duckdb, polars

`benchmarks/report.py --engines` runs each in a child process of its own and prints MB/s and peak RSS.
Only the extraction is timed here: the analysis after it (trace nesting, own time, limiter timelines) is
the same Python for every engine. Each prints the span count and a checksum so they can be compared.
DuckDB and Polars are optional (`pip install duckdb polars`); the chosen engine (msgspec) is a dependency.
"""

import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

STAGE = "llmspans.stage"
FIRST_TOKEN = "llmspans.bucket.first_token"
Fact = tuple[str, str, str, str, int, int, int, bool, Any, float]


def _value(value: dict[str, Any]) -> Any:
    for key in ("stringValue", "doubleValue", "boolValue"):
        if key in value:
            return value[key]
    if "intValue" in value:
        return int(value["intValue"])
    return None


def _from_documents(documents: Iterator[Any]) -> Iterator[Fact]:
    for document in documents:
        for resource_spans in document.get("resourceSpans", ()):
            for scope_spans in resource_spans.get("scopeSpans", ()):
                for span in scope_spans.get("spans", ()):
                    attributes = {item["key"]: _value(item["value"]) for item in span.get("attributes", ())}
                    yield (
                        span["traceId"], span["spanId"], span.get("parentSpanId", ""), span["name"],
                        span.get("kind", 0), int(span["startTimeUnixNano"]), int(span["endTimeUnixNano"]),
                        span.get("status", {}).get("code") == 2, attributes.get(STAGE),
                        attributes.get(FIRST_TOKEN, 0.0),
                    )  # fmt: skip


def _lines(path: Path) -> Iterator[bytes]:
    with path.open("rb") as file:
        yield from file


def std_json(path: Path) -> Iterator[Fact]:
    return _from_documents(json.loads(line) for line in _lines(path) if line.strip())


def orjson_engine(path: Path) -> Iterator[Fact]:
    import orjson

    return _from_documents(orjson.loads(line) for line in _lines(path) if line.strip())


def msgspec_engine(path: Path) -> Iterator[Fact]:
    import msgspec

    class AnyValue(msgspec.Struct):
        stringValue: str | None = None
        doubleValue: float | None = None
        boolValue: bool | None = None
        intValue: str | int | None = None

    class KeyValue(msgspec.Struct):
        key: str
        value: AnyValue

    class Status(msgspec.Struct, frozen=True):
        code: int | str = 0

    class Span(msgspec.Struct):
        traceId: str
        spanId: str
        name: str
        startTimeUnixNano: str
        endTimeUnixNano: str
        parentSpanId: str = ""
        kind: int | str = 0
        attributes: list[KeyValue] = []
        status: Status = Status()

    class ScopeSpans(msgspec.Struct):
        spans: list[Span] = []

    class ResourceSpans(msgspec.Struct):
        scopeSpans: list[ScopeSpans] = []

    class Document(msgspec.Struct):
        resourceSpans: list[ResourceSpans] = []

    decoder = msgspec.json.Decoder(Document)
    for line in _lines(path):
        if not line.strip():
            continue
        for resource_spans in decoder.decode(line).resourceSpans:
            for scope_spans in resource_spans.scopeSpans:
                for span in scope_spans.spans:
                    stage = None
                    first_token = 0.0
                    for item in span.attributes:
                        if item.key == STAGE:
                            stage = item.value.stringValue
                        elif item.key == FIRST_TOKEN:
                            first_token = item.value.doubleValue or 0.0
                    yield (
                        span.traceId, span.spanId, span.parentSpanId, span.name, int(span.kind),
                        int(span.startTimeUnixNano), int(span.endTimeUnixNano), span.status.code == 2, stage,
                        first_token,
                    )  # fmt: skip


_SQL = """
WITH spans AS (
    SELECT unnest(ss.spans) AS s
    FROM (SELECT unnest(rs.scopeSpans) AS ss
          FROM (SELECT unnest(resourceSpans) AS rs FROM read_json(?, format='newline_delimited',
                maximum_object_size=1000000000, columns={'resourceSpans': 'STRUCT(scopeSpans STRUCT(spans
                STRUCT(traceId VARCHAR, spanId VARCHAR, parentSpanId VARCHAR, name VARCHAR, kind INTEGER,
                startTimeUnixNano VARCHAR, endTimeUnixNano VARCHAR, attributes STRUCT(key VARCHAR, value
                STRUCT(stringValue VARCHAR, doubleValue DOUBLE, boolValue BOOLEAN, intValue VARCHAR))[],
                status STRUCT(code INTEGER))[])[])[]'})))
)
SELECT s.traceId, s.spanId, coalesce(s.parentSpanId, ''), s.name, coalesce(s.kind, 0),
       CAST(s.startTimeUnixNano AS BIGINT), CAST(s.endTimeUnixNano AS BIGINT), coalesce(s.status.code, 0) = 2,
       list_extract(list_filter(s.attributes, lambda a: a.key = 'llmspans.stage'), 1).value.stringValue,
       coalesce(list_extract(list_filter(s.attributes, lambda a: a.key = 'llmspans.bucket.first_token'), 1)
                .value.doubleValue, 0.0)
FROM spans
"""


def duckdb_engine(path: Path) -> Iterator[Fact]:
    import duckdb

    connection = duckdb.connect()
    cursor = connection.execute(_SQL, [str(path)])
    while batch := cursor.fetchmany(10_000):
        yield from batch


def polars_engine(path: Path) -> Iterator[Fact]:
    import polars as pl

    value = pl.Struct({"stringValue": pl.String, "doubleValue": pl.Float64, "boolValue": pl.Boolean,
                       "intValue": pl.String})  # fmt: skip
    span = pl.Struct({
        "traceId": pl.String, "spanId": pl.String, "parentSpanId": pl.String, "name": pl.String,
        "kind": pl.Int64, "startTimeUnixNano": pl.String, "endTimeUnixNano": pl.String,
        "attributes": pl.List(pl.Struct({"key": pl.String, "value": value})),
        "status": pl.Struct({"code": pl.Int64}),
    })  # fmt: skip
    schema = {
        "resourceSpans": pl.List(pl.Struct({"scopeSpans": pl.List(pl.Struct({"spans": pl.List(span)}))}))
    }
    frame = (
        pl.scan_ndjson(path, schema=schema)
        .select(pl.col("resourceSpans").explode())
        .select(pl.col("resourceSpans").struct.field("scopeSpans").explode().alias("ss"))
        .select(pl.col("ss").struct.field("spans").explode().alias("s"))
        .drop_nulls()
        .select(pl.col("s").struct.unnest())
        .with_columns(
            pl.col("attributes")
            .list.eval(
                pl.element()
                .filter(pl.element().struct.field("key") == STAGE)
                .struct.field("value")
                .struct.field("stringValue")
            )
            .list.first()
            .alias("stage"),
            pl.col("attributes")
            .list.eval(
                pl.element()
                .filter(pl.element().struct.field("key") == FIRST_TOKEN)
                .struct.field("value")
                .struct.field("doubleValue")
            )
            .list.first()
            .fill_null(0.0)
            .alias("first_token"),
        )
        .select(
            "traceId",
            "spanId",
            pl.col("parentSpanId").fill_null(""),
            "name",
            pl.col("kind").fill_null(0),
            pl.col("startTimeUnixNano").cast(pl.Int64),
            pl.col("endTimeUnixNano").cast(pl.Int64),
            pl.col("status").struct.field("code").fill_null(0) == 2,
            "stage",
            "first_token",
        )
        .collect()
    )
    yield from frame.iter_rows()


ENGINES: dict[str, Callable[[Path], Iterator[Fact]]] = {
    "json": std_json, "orjson": orjson_engine, "msgspec": msgspec_engine, "duckdb": duckdb_engine,
    "polars": polars_engine,
}  # fmt: skip


def main() -> int:
    engine, path = sys.argv[1], Path(sys.argv[2])
    spans = 0
    checksum = 0.0
    traces: set[str] = set()
    for fact in ENGINES[engine](path):
        spans += 1
        checksum += fact[9]
        traces.add(fact[0])
    print(f"{engine}: {spans} spans, {len(traces)} traces, first_token sum {checksum:.6f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
