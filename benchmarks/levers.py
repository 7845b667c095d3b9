"""What the levers cost (issue 26): a prompt cap's estimate, a capped call, a cache lookup, a watched call,
a hedged call.

The estimate runs on every capped call, before the request leaves, so its time is added to the call's
first_token. Measured here for a short prompt (one 100-character message) and a 100 KB one, with each
estimator: characters/4, a Hugging Face tokenizer and a tiktoken encoding (both a byte-level BPE of 2,000
merges trained here by tests/support/trained_tokenizers.py, since OpenAI's own encodings need a download this
machine cannot make). Then what a call pays for the levers: their own work on one call record (opened,
estimated, its usage compared, finished), best of many turns against the same record without them; and
over a whole non-streamed openai call against an in-memory transport (no network, the method of
benchmarks/inprocess.py), the median of paired differences, which a shared machine makes noisy. Last, a
`with llmspans.cache_lookup(...)` block against an `@llmspans.stage` call. Then a hedged client against an
instrumented one without a hedge, over loopback to simulators in processes of their own (so the CPU
counted is the client's alone), sync and async, whole and streamed, as the median of paired blocks: a call
whose backup is never sent (what every call of a hedged client pays), a call whose backup is sent (both
copies answer after 30 ms and the hedge fires after 10 ms; sync and async), and the per-chunk cost of a
hedged stream of 2,000 chunks. Spans are made, recorded and dropped unencoded; metrics go to llmspans' own
aggregation, as `configure()` sets them up.

    python benchmarks/levers.py            # a few minutes on 2 cores
    python benchmarks/levers.py --quick    # checks that it runs
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests/support/trained_tokenizers.py: the tokenizers trained here

MODEL = "gpt-4o-mini"


def _providers() -> None:
    from opentelemetry import metrics, trace
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

    from llmspans import _telemetry
    from llmspans._aggregation import Aggregation

    class Dropped(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(Dropped()))
    trace.set_tracer_provider(provider)
    meter_provider = MeterProvider()  # no reader: recorded into llmspans' aggregation, never exported
    _telemetry.aggregate_with(meter_provider, Aggregation())
    metrics.set_meter_provider(meter_provider)
    _telemetry.pick_up_providers()


def _cpu_best(function: Callable[[], Any], number: int, repeat: int) -> float:
    """The best CPU µs per run of `function`."""
    return min(timeit.repeat(function, number=number, repeat=repeat, timer=time.process_time)) / number * 1e6


def estimate_costs(quick: bool) -> list[tuple[str, str, float, int]]:
    """(estimator, prompt, µs per estimate, tokens) for each estimator and prompt size."""
    from llmspans import _prompt
    from tests.support.trained_tokenizers import as_tiktoken, sample_text, train_bpe

    bpe = train_bpe(vocab_size=2000)
    estimators: list[Any] = [
        _prompt.CHARACTERS, _prompt.HuggingFace(bpe, "trained-bpe"), _prompt.Tiktoken(as_tiktoken(bpe)),
    ]  # fmt: skip
    prompts = {"short (100 chars)": sample_text(100), "100 KB": sample_text(100_000)}
    rows = []
    for estimator in estimators:
        for label, text in prompts.items():
            body = {"model": MODEL, "messages": [{"role": "system", "content": "Be brief."},
                                                 {"role": "user", "content": text}]}  # fmt: skip

            def estimate(estimator: Any = estimator, body: dict[str, Any] = body) -> int:
                texts, tokens = _prompt.prompt_pieces(body)
                return int(estimator.count(texts)) + tokens

            tokens = estimate()
            large = len(text) > 1000
            number = 1 if large else 200
            repeat = 3 if quick else (15 if large else 30)
            times = timeit.repeat(estimate, number=number, repeat=repeat, timer=time.process_time)
            rows.append((estimator.name, label, statistics.median(times) / number * 1e6, tokens))
    return rows


def lever_work(quick: bool) -> list[tuple[str, float]]:
    """µs the levers add to one call record (opened, estimated, usage compared, finished), each the best of
    many runs taken in turns with the plain record's; and the plain record's own µs."""
    from llmspans import _prompt
    from llmspans._call import CallRecord
    from tests.support.trained_tokenizers import sample_text

    cap = _prompt.PromptCap(1_000_000, None, "chars")
    bodies = {size: {"model": MODEL, "messages": [{"role": "user", "content": sample_text(chars)}]}
              for size, chars in (("short", 100), ("100 KB", 100_000))}  # fmt: skip

    def call(capped: dict[str, Any] | None = None) -> None:
        record = CallRecord(operation="chat", model=MODEL, provider="openai", stream=False)
        if capped is not None:
            cap.apply(record, capped)
        record.input_tokens = 40
        record.finish("completed")

    number, repeat = (50, 3) if quick else (400, 30)

    def added(variant: Callable[[], None]) -> float:
        plain_best = variant_best = float("inf")
        for turn in range(repeat):
            order = (call, variant) if turn % 2 else (variant, call)
            for function in order:
                took = _cpu_best(function, number, 1)
                if function is call:
                    plain_best = min(plain_best, took)
                else:
                    variant_best = min(variant_best, took)
        return variant_best - plain_best

    return [
        ("capped, short prompt (chars/4)", added(lambda: call(bodies["short"]))),
        ("capped, 100 KB prompt (chars/4)", added(lambda: call(bodies["100 KB"]))),
        ("watched: the window takes its duration", _cpu_best(_window_feed(), 10_000, repeat)),
        ("neither: the call record itself", _cpu_best(call, number, repeat)),
    ]


def _window_feed() -> Callable[[], None]:
    """What a call watched by a cache's window adds at its end: its duration handed over."""
    from llmspans import _cache

    window = _cache.CallDurations()
    record = _Done()
    record.shape = type("Shape", (), {"span_attributes": {"gen_ai.request.model": MODEL}})()
    return lambda: window.finished(record, "completed", 1_000_000)


def call_costs(quick: bool) -> list[tuple[str, float, float]]:
    """(what, median added µs per call, interquartile range) from paired blocks of whole openai calls."""
    import httpx2
    import openai

    import llmspans
    from llmspans import _cache
    from tests.support.trained_tokenizers import sample_text

    answer = json.dumps({
        "id": "c1", "object": "chat.completion", "created": 1, "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello."}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
    }).encode()  # fmt: skip

    class Transport(httpx2.BaseTransport):  # type: ignore[misc]
        def handle_request(self, request: Any) -> Any:
            return httpx2.Response(200, headers={"content-type": "application/json"}, content=answer)

    def client(**instrument: Any) -> Any:
        http = openai.DefaultHttpxClient(transport=Transport())
        made = openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="k", max_retries=0, http_client=http)
        return llmspans.instrument(made, **instrument)

    plain, capped = client(), client(max_prompt_tokens=1_000_000, prompt_tokenizer="chars")
    short = [{"role": "user", "content": sample_text(100)}]
    long = [{"role": "user", "content": sample_text(100_000)}]

    def block(target: Any, messages: list[dict[str, str]], n: int, watching: bool = False) -> float:
        if watching:
            _cache.watch()
        else:
            _cache.stop_watching()
        started = time.process_time()
        for _ in range(n):
            target.chat.completions.create(model=MODEL, messages=messages)
        return (time.process_time() - started) / n

    n, repeats = (20, 3) if quick else (300, 25)
    arms = {
        "capped call, short prompt (chars/4)": (lambda: block(capped, short, n), lambda: block(plain, short, n)),
        "capped call, 100 KB prompt (chars/4)": (lambda: block(capped, long, n // 4), lambda: block(plain, long, n // 4)),
        "call with a cache declared (window)": (lambda: block(plain, short, n, True), lambda: block(plain, short, n)),
    }  # fmt: skip
    rows = []
    for what, (with_lever, without) in arms.items():
        with_lever()
        without()  # warm
        added = []
        for repeat in range(repeats):
            if repeat % 2:
                a = with_lever()
                b = without()
            else:
                b = without()
                a = with_lever()
            added.append((a - b) * 1e6)
        quartiles = statistics.quantiles(added, n=4)
        rows.append((what, statistics.median(added), quartiles[2] - quartiles[0]))
    _cache.stop_watching()
    return rows


def lookup_cost(quick: bool) -> tuple[float, float, float]:
    """CPU µs per `with llmspans.cache_lookup(...)` block (a hit, priced from a full window), per
    `@llmspans.stage` call of an empty function, and per bare block."""
    import llmspans
    from llmspans import _cache

    window = _cache.watch()
    for duration in range(1, 257):  # a full window: the median of 256 values on every hit
        window.finished(_Done(), "completed", duration * 1_000_000)
    semantic = llmspans.cache_lookup("semantic")

    def looked_up() -> None:
        with semantic as lookup:
            lookup.hit = True

    @llmspans.stage("plain")
    def staged() -> None:
        pass

    def bare() -> None:
        pass

    number, repeat = (100, 3) if quick else (2000, 15)
    try:
        return (
            _cpu_best(looked_up, number, repeat),
            _cpu_best(staged, number, repeat),
            _cpu_best(bare, number, repeat),
        )
    finally:
        _cache.stop_watching()


def _simulator(*arguments: str) -> tuple[Any, str]:
    """A simulator in a process of its own (its CPU is not the client's), and its base URL."""
    import subprocess

    process = subprocess.Popen(
        [sys.executable, "-m", "llmspans.tools.simulator", *arguments], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    return process, process.stdout.readline().strip()


def hedge_costs(
    quick: bool,
    calls: int = 200,
    blocks: int = 21,
    meter: Callable[[Callable[[], Any]], float] | None = None,
    only: str = "",
    in_memory: bool = False,
) -> list[tuple[str, float, float, float]]:
    """(what, median added CPU µs per call or per chunk, interquartile range, the median of the client without
    a hedge) of a hedged client against a client without a hedge, over loopback; with `meter`
    (`floor.Instructions.measure`), what it measures (instructions) per call or chunk instead. The last figure
    lets a ratio be read in one run (the hedge's share of a call, whatever the machine). `in_memory`: the
    unfired rows on benchmarks/inprocess.py's in-memory transports (no socket, no server, one thread: a
    count that repeats to the instruction), the fired rows left out."""
    import asyncio

    import openai

    import llmspans

    processes: list[Any] = []
    if in_memory:
        import inprocess

        short_url, long_url = "memory:8", "memory:2000"
        factories = {short_url: inprocess.clients(8), long_url: inprocess.clients(2000)}
    else:
        short, short_url = _simulator("--chunks", "8", "--usage", "chunk")
        long, long_url = _simulator("--chunks", "2000")
        processes = [short, long]
    messages = [{"role": "user", "content": "what does a hedge cost"}]
    try:

        def sync(url: str, hedge: Any) -> Any:
            if in_memory:
                return llmspans.instrument(factories[url]["sync"](False), hedge=hedge)
            return llmspans.instrument(openai.OpenAI(base_url=url, api_key="k", max_retries=0), hedge=hedge)

        def async_(url: str, hedge: Any) -> Any:
            if in_memory:
                return llmspans.instrument(factories[url]["async"](False), hedge=hedge)
            return llmspans.instrument(
                openai.AsyncOpenAI(base_url=url, api_key="k", max_retries=0), hedge=hedge
            )

        never = llmspans.Hedge(after=30)  # a backup due after 30 s: never sent here
        fires = llmspans.Hedge(after=0.01)
        slow = {"x_sim": {"header_delay": 0.03}}

        def measured(block: Callable[[], None], n: int) -> float:
            if meter is not None:
                # The collector off inside a block (the meter collects before it): a full pass would land in
                # either arm by chance, and its millions of instructions swamp a hedge's thousands.
                gc.disable()
                try:
                    counted = meter(block)
                finally:
                    gc.enable()
                return counted / n / 1e6  # shown as "µs": millions of instructions, read as thousands
            started = time.process_time()
            block()
            return (time.process_time() - started) / n

        def sync_block(client: Any, n: int, stream: bool, body: dict[str, Any] | None = None) -> float:
            def calls() -> None:
                for _ in range(n):
                    result = client.chat.completions.create(
                        model=MODEL, messages=messages, stream=stream, extra_body=body
                    )
                    if stream:
                        for _chunk in result:
                            pass

            return measured(calls, n)

        loop = asyncio.new_event_loop()

        def async_block(client: Any, n: int, stream: bool, body: dict[str, Any] | None = None) -> float:
            async def calls() -> None:
                for _ in range(n):
                    result = await client.chat.completions.create(
                        model=MODEL, messages=messages, stream=stream, extra_body=body
                    )
                    if stream:
                        async for _chunk in result:
                            pass

            return measured(lambda: loop.run_until_complete(calls()), n)

        n, repeats = (10, 3) if quick else (calls, blocks)
        plain_s, hedged_s = sync(short_url, None), sync(short_url, never)
        fired_s = sync(short_url, fires)
        plain_a, hedged_a = async_(short_url, None), async_(short_url, never)
        fired_a = async_(short_url, fires)
        plain_l, hedged_l = sync(long_url, None), sync(long_url, never)
        arms: dict[str, tuple[Callable[[], float], Callable[[], float], float]] = {
            "sync call, not fired": (
                lambda: sync_block(hedged_s, n, False), lambda: sync_block(plain_s, n, False), 1
            ),
            "sync stream, not fired": (lambda: sync_block(hedged_s, n, True), lambda: sync_block(plain_s, n, True), 1),
            "async call, not fired": (lambda: async_block(hedged_a, n, False), lambda: async_block(plain_a, n, False), 1),
            "async stream, not fired": (
                lambda: async_block(hedged_a, n, True), lambda: async_block(plain_a, n, True), 1
            ),
            "sync call, fired (both copies 30 ms)": (
                lambda: sync_block(fired_s, max(2, n // 4), False, slow),
                lambda: sync_block(plain_s, max(2, n // 4), False, slow), 1,
            ),
            "async call, fired (both copies 30 ms)": (
                lambda: async_block(fired_a, max(2, n // 4), False, slow),
                lambda: async_block(plain_a, max(2, n // 4), False, slow), 1,
            ),
            "sync stream of 2,000 chunks, per chunk": (
                lambda: sync_block(hedged_l, max(2, n // 20), True), lambda: sync_block(plain_l, max(2, n // 20), True),
                2000,
            ),
        }  # fmt: skip
        rows = []
        for what, (with_hedge, without, per) in arms.items():
            if only not in what or (in_memory and "fired (" in what):
                continue
            with_hedge()
            without()  # warm
            added, plain = [], []
            for repeat in range(repeats):
                if repeat % 2:
                    a, b = with_hedge(), without()
                else:
                    b, a = without(), with_hedge()
                added.append((a - b) * 1e6 / per)
                plain.append(b * 1e6 / per)
            quartiles = statistics.quantiles(added, n=4)
            rows.append(
                (what, statistics.median(added), quartiles[2] - quartiles[0], statistics.median(plain))
            )
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
        return rows
    finally:
        for process in processes:
            process.terminate()
            process.wait()


class _Done:
    """What the window reads of a finished call."""

    error_type = None
    shape = type("Shape", (), {"span_attributes": {}})()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny counts: checks that it runs")
    parser.add_argument(
        "--hedge-only", action="store_true", help="only the hedged client against one without"
    )
    parser.add_argument("--calls", type=int, default=200, help="calls per hedge block (default 200)")
    parser.add_argument("--blocks", type=int, default=21, help="paired hedge blocks (default 21)")
    parser.add_argument(
        "--instructions", action="store_true",
        help="the hedge's cost in instructions, under valgrind's callgrind (floor.py's shim; implies --hedge-only)",
    )  # fmt: skip
    parser.add_argument(
        "--only", default="", help="only the hedge rows whose name holds this, e.g. 'not fired'"
    )
    parser.add_argument(
        "--in-memory", action="store_true",
        help="the unfired rows on in-memory transports (no socket, no server): a count that repeats; fired rows left out",
    )  # fmt: skip
    parser.add_argument("--shim", help=argparse.SUPPRESS)
    parser.add_argument("--out-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.instructions and args.shim is None:
        return _under_callgrind(args)
    _providers()
    if args.hedge_only or args.instructions:
        _print_hedge_costs(args)
        return 0

    print("The estimate (prompt_pieces + count), median CPU per prompt:")
    print(f"  {'estimator':<28} {'prompt':<18} {'µs':>10} {'tokens':>8}")
    for name, prompt, micros, tokens in estimate_costs(args.quick):
        print(f"  {name:<28} {prompt:<18} {micros:>10.1f} {tokens:>8}")
    print("\nThe levers' own work on one call record (CPU µs added, best of 30 turns):")
    for what, micros in lever_work(args.quick):
        print(f"  {what:<40} {micros:>8.1f} µs")
    print("\nAdded CPU per non-streamed openai call, median of paired blocks (IQR):")
    for what, median, spread in call_costs(args.quick):
        print(f"  {what:<40} {median:>8.1f} µs  (IQR {spread:.1f})")
    looked_up, staged, bare = lookup_cost(args.quick)
    print(f"\nCPU per cache_lookup block (a hit, priced from a full window): {looked_up:.1f} µs; per "
          f"@llmspans.stage call {staged:.1f} µs; per bare block {bare:.2f} µs (best of 15)")  # fmt: skip
    _print_hedge_costs(args)
    return 0


def _print_hedge_costs(args: argparse.Namespace) -> None:
    meter = None
    if args.instructions:
        import floor

        meter = floor.Instructions(args.shim, args.out_file).measure
        print(
            "\nAdded instructions of a hedged client over one without a hedge (every thread), median of paired blocks:"
        )
    else:
        where = "in memory" if args.in_memory else "over loopback"
        print(
            f"\nAdded CPU of a hedged client over one without a hedge, {where}, median of paired blocks (IQR):"
        )
    unit = "instructions" if args.instructions else "µs"
    rows = hedge_costs(args.quick, args.calls, args.blocks, meter, args.only, args.in_memory)
    for what, median, spread, plain in rows:
        per = "per chunk" if "per chunk" in what else "per call"
        print(
            f"  {what:<40} {median:>10.2f} {unit} {per}  (IQR {spread:.2f}; without a hedge {plain:.2f}, "
            f"so {median / plain:.1%} of it)",
            flush=True,
        )


def _under_callgrind(args: argparse.Namespace) -> int:
    """Run the hedge's blocks again in a child under callgrind, instructions counted inside each block only."""
    import shutil
    import subprocess
    import tempfile

    import floor

    if shutil.which("valgrind") is None or not Path("/usr/include/valgrind/callgrind.h").exists():
        print("--instructions needs valgrind and its headers (apt-get install valgrind)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="llmspans-levers-") as tmp:
        shim = floor._build_shim(Path(tmp))
        out_file = str(Path(tmp) / "levers.callgrind")
        command = [
            "valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out_file}",
            sys.executable, __file__, "--instructions", "--shim", str(shim), "--out-file", out_file,
            "--calls", str(args.calls), "--blocks", str(args.blocks), "--only", args.only,
            *(["--quick"] if args.quick else []), *(["--in-memory"] if args.in_memory else []),
        ]  # fmt: skip
        return subprocess.run(command, check=False, stderr=subprocess.DEVNULL).returncode


if __name__ == "__main__":
    raise SystemExit(main())
