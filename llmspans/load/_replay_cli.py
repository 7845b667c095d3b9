"""`llmspans load URL --model M --replay SOURCE [--speed 1,2] [--window 10m] [--limit N]`: the replay's options.

SOURCE is a traces file (`--replay FILE`), or one of the report's other sources: `--replay --tempo URL
--service S [--since 1h]` or `--replay --jaeger URL --service S [--since 1h]` (read through
`llmspans.report._sources`, as `llmspans report` reads them). With `--replay`, `--service` names the
recorded service (the load's own spans keep `llmspans-load`). A source with no LLM call, or options that do
not fit together, is a ValueError whose message is the one line `llmspans load` prints (exit code 2).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from llmspans.load._model import SHAPE_SPEED
from llmspans.load._replay import DEFAULT_LIMIT, NoCalls, Recording, read_recording, recording_lines
from llmspans.load._replay_table import ReplayResult, compare
from llmspans.load._replay_workload import (
    Built,
    ReplayWorkload,
    ServerFacts,
    build_workload,
)
from llmspans.load._requests import RequestRecord
from llmspans.load._workload import (
    DEFAULT_LEVEL_SECONDS,
    DEFAULT_MAX_REQUESTS,
    DEFAULT_MAX_SECONDS,
    DEFAULT_MAX_TOKENS,
    Messages,
    Plan,
    captured_prompts,
    parse_levels,
    parse_prompt_tokens,
    parse_slo,
)
from llmspans.report._cli import Usage as ReportUsage
from llmspans.report._sources import SpanSource, parse_duration
from llmspans.report._spans import ReportInputError

DEFAULT_SINCE_S = 3600.0
MAX_SPEEDS = 16  # a sweep's levels at most (it doubles from the first speed)
# A level issues for the recorded span at its speed, and this much more: a turn's later calls wait for the
# calls before them, which a slower server makes later than recorded.
LEVEL_SLACK_S = DEFAULT_LEVEL_SECONDS
REPLAY_ONLY = ("speed", "window", "limit", "tempo", "jaeger", "since", "no_shared_prefixes")
NOT_WITH_REPLAY = {
    "concurrency": "--concurrency", "rate": "--rate", "prompts": "--prompts", "requests": "--requests",
    "no_stream": "--no-stream",
}  # fmt: skip


def add_arguments(load: argparse.ArgumentParser) -> None:
    replay = load.add_argument_group(
        "replay", "send the traffic a recording holds: --replay FILE, --replay --tempo URL --service S, or "
        "--replay --jaeger URL --service S (docs/load-replay.md)",
    )  # fmt: skip
    replay.add_argument(
        "--replay", nargs="?", const="", metavar="FILE",
        help="replay the LLM calls of a traces file (or, with no FILE, of --tempo or --jaeger): each call one "
        "request of its shape, at its recorded offset divided by the speed",
    )  # fmt: skip
    replay.add_argument(
        "--speed", metavar="S,S,...", help="replay at these multiples of the recorded pace, a level each (1)"
    )
    replay.add_argument(
        "--window",
        metavar="DURATION",
        help="replay at most this much recorded time from the first call, e.g. 10m",
    )
    replay.add_argument(
        "--limit", type=int, metavar="N", help=f"replay at most the N earliest calls ({DEFAULT_LIMIT})"
    )
    replay.add_argument(
        "--tempo", metavar="URL", help="read the recording from Grafana Tempo (needs --service)"
    )
    replay.add_argument("--jaeger", metavar="URL", help="read the recording from Jaeger v2 (needs --service)")
    replay.add_argument(
        "--since", metavar="DURATION", help="with --tempo or --jaeger: the recent window searched (1h)"
    )
    replay.add_argument(
        "--no-shared-prefixes", action="store_true",
        help="give every replayed prompt a prefix of its own, even where the recorded calls shared one (what "
        "the server's prefix cache is worth: run with and without)",
    )  # fmt: skip


@dataclass
class Replay:
    """A replay being prepared and run: its recording, its requests, and at the end its result."""

    recording: Recording
    shared_prefixes: bool
    captured: Mapping[tuple[str, str], Messages] | None = None
    captured_source: str | None = None
    built: Built | None = None

    def build(self, args: argparse.Namespace, facts: ServerFacts, salt: int = 0) -> ReplayWorkload:
        tokens, _ = parse_prompt_tokens(args.prompt_tokens)
        self.built = build_workload(
            self.recording, model=args.model, facts=facts, seed=args.seed, prompt_tokens=tokens,
            max_tokens=args.max_tokens if args.max_tokens is not None else DEFAULT_MAX_TOKENS,
            shared_prefixes=self.shared_prefixes, endpoint=args.endpoint, captured=self.captured,
            captured_source=self.captured_source, salt=salt,
        )  # fmt: skip
        return self.built.workload

    def plan(self, args: argparse.Namespace) -> tuple[ReplayWorkload, Plan]:
        """The workload (before the server is measured: `measure`) and the plan: each speed a level."""
        workload = self.build(args, ServerFacts(ignore_eos=args.provider == "vllm"))
        levels = parse_levels(args.speed or "1", SHAPE_SPEED)
        slowest = min(level.value for level in levels)
        span_s = self.recording.span_ns / 1e9
        given_levels = len(levels) if not args.sweep else MAX_SPEEDS
        count = len(self.recording.calls)
        if args.sweep and len(levels) > 1:
            raise ValueError(
                "--sweep starts from one speed (e.g. --speed 1 --sweep) and finds the others itself"
            )
        plan = Plan(
            shape=SHAPE_SPEED, levels=levels, sweep=args.sweep, requests_per_level=count,
            level_seconds=args.level_seconds if args.level_seconds is not None else span_s / slowest + LEVEL_SLACK_S,
            max_requests=args.max_requests if args.max_requests is not None else max(DEFAULT_MAX_REQUESTS, count * given_levels),
            max_seconds=args.max_seconds if args.max_seconds is not None else max(
                DEFAULT_MAX_SECONDS, sum(span_s / level.value + LEVEL_SLACK_S for level in levels)
            ),
            knee_factor=args.knee_factor, slo=parse_slo(args.slo) if args.slo else {},
        )  # fmt: skip
        if {"ttft", "tpot"} & set(plan.slo) and not any(request.stream for request in workload.requests):
            raise ValueError(
                "--slo ttft and tpot need streamed calls, and none of the recorded calls streamed"
            )
        return workload, plan

    def measure(self, args: argparse.Namespace, api_key: str, run_id: str) -> ReplayWorkload:
        """The server measured (its tokens per word, whether it takes ignore_eos) and the requests sized by it;
        their words drawn for this run alone (a server's prefix cache keeps what an earlier run sent)."""
        from llmspans.load._replay_probe import probe

        assert self.built is not None
        endpoints = [request.endpoint for request in self.built.workload.requests]
        facts = probe(args.base_url, args.model, endpoints, api_key=api_key, provider=args.provider)
        return self.build(args, facts, salt=int(run_id, 16))

    def result(self, records: Mapping[str, Sequence[RequestRecord]]) -> ReplayResult:
        assert self.built is not None
        return compare(self.recording, records, [*recording_lines(self.recording), *self.built.assumptions])


def prepare(args: argparse.Namespace) -> Replay | None:
    """The replay the arguments ask for (its source read), or None without --replay; ValueError otherwise."""
    if args.replay is None:
        given = [f"--{name.replace('_', '-')}" for name in REPLAY_ONLY if getattr(args, name, None)]
        if given:
            raise ValueError(f"{given[0]} goes with --replay (e.g. --replay FILE {given[0]} ...)")
        return None
    for name, option in NOT_WITH_REPLAY.items():
        if getattr(args, name, None):
            raise ValueError(f"{option} does not go with --replay: the recording says what to send and when")
    if args.shared_prefix:
        raise ValueError(
            "--shared-prefix does not go with --replay: the recording says which prompts shared one"
        )
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be 1 or more calls, got {args.limit}")
    window_s = parse_duration(args.window, "--window") if args.window else None
    try:
        source, label = _source(args)
        recording = read_recording(
            source, label=label, service=args.service, window_s=window_s, limit=args.limit or DEFAULT_LIMIT
        )
    except (ReportInputError, NoCalls, ReportUsage) as error:
        raise ValueError(str(error)) from None
    replay = Replay(recording, shared_prefixes=not args.no_shared_prefixes)
    if args.prompts_from:
        replay.captured = captured_prompts(args.prompts_from)
        replay.captured_source = args.prompts_from
    return replay


def _source(args: argparse.Namespace) -> tuple[SpanSource, str]:
    """The report's source the arguments name, and how the replayed spans name it."""
    chosen = [
        name
        for name, given in (("FILE", args.replay), ("--tempo", args.tempo), ("--jaeger", args.jaeger))
        if given
    ]
    if len(chosen) != 1:
        raise ValueError(
            "--replay takes one source: a traces FILE, --tempo URL --service S or --jaeger URL --service S"
            + (f" (got {' and '.join(chosen)})" if chosen else "")
        )
    since_s = parse_duration(args.since) if args.since else DEFAULT_SINCE_S
    if args.replay:
        from llmspans.report._sources.file import FileSource

        if args.since:
            raise ValueError("--since goes with --tempo or --jaeger; for a file, --window bounds the replay")
        file = FileSource([Path(args.replay)], progress=False)
        file.check()
        return file, args.replay
    if not args.service:
        raise ValueError(f"{chosen[0]} needs --service NAME: the recorded service whose calls to replay")
    if args.tempo:
        from llmspans.report._cli import ENV_TEMPO_TENANT, tempo_headers
        from llmspans.report._sources.tempo import fetch_tempo, shown_url

        traces = fetch_tempo(
            args.tempo, args.service, since_s, limit=args.limit or DEFAULT_LIMIT,
            tenant=os.environ.get(ENV_TEMPO_TENANT) or None, headers=tempo_headers(argparse.Namespace(header=None)),
        )  # fmt: skip
        return traces, f"tempo {shown_url(args.tempo)}"
    from llmspans.report._sources.jaeger import fetch_jaeger

    return fetch_jaeger(args.jaeger, args.service, since_s), f"jaeger {args.jaeger.rstrip('/')}"
