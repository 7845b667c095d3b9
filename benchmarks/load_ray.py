"""What Ray costs the load generator: requests per CPU-second on Ray generators against worker processes.

`llmspans load --ray` sends from Ray actors; `--workers N` from processes of this machine. Both run the
same generator code, so what differs is what carries the parts and the records (Ray's actor calls, its
object store and its core worker's threads in each generator, against length-prefixed pickles over
pipes). This runs the same level both ways, alternately, against llmspans' simulator (4 streamed chunks,
no delay, in a child process), with the spans written by `configure()`'s embedded default to a traces
file as the command does: N worker processes, then N Ray generators on a cluster of N nodes of one CPU
each started here on the loopback (or the cluster at `--ray ADDRESS`). Per round and side: requests/s,
and requests per CPU-second of the load tool (the generators' processes and the runner's or driver's own,
as each level's CPU/request counts them), then the medians and their ratio. The target (DESIGN §5): Ray
at most 10 % fewer requests per CPU-second.

    python benchmarks/load_ray.py                  # 8 users, 2,000 requests a side, 3 rounds
    python benchmarks/load_ray.py --quick          # 200 requests, 1 round: checks that it runs
    python benchmarks/load_ray.py --rate 200 --requests 2000 --generators 2
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before Ray is imported: the loopback

import llmspans  # noqa: E402
from benchmarks.load import figure_of_record, start_simulator  # noqa: E402
from llmspans.load._model import SHAPE_CONCURRENCY, SHAPE_RATE, Level, LevelStats  # noqa: E402
from llmspans.load._ray import Fleet, connect, generator_setups  # noqa: E402
from llmspans.load._runner import Runner, new_run_id  # noqa: E402
from llmspans.load._workers import WorkerExport  # noqa: E402
from llmspans.load._workload import Plan, Workload  # noqa: E402

TARGET_SHARE = 0.9  # Ray's requests per CPU-second at least this share of the workers'


@dataclass
class Side:
    name: str
    stats: LevelStats
    wall_s: float

    @property
    def per_cpu_s(self) -> float:
        cpu = self.stats.generator_cpu_s or 0.0
        return self.stats.completed / cpu if cpu > 0 else 0.0


def _level(args: argparse.Namespace) -> Level:
    return Level(SHAPE_RATE, args.rate) if args.rate else Level(SHAPE_CONCURRENCY, args.concurrency)


def _side(name: str, args: argparse.Namespace, base_url: str, traces: Path, requests: int) -> Side:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    workload = Workload(model="sim-model", max_tokens=4, prompt_tokens=16)
    level = _level(args)
    plan = Plan(
        shape=level.shape, levels=(level,), requests_per_level=requests, level_seconds=600, max_requests=requests,
        max_seconds=900,
    )  # fmt: skip
    provider = trace.get_tracer_provider()
    assert isinstance(provider, TracerProvider)
    run_id = new_run_id()
    fleet = None
    if name == "ray":
        setups = generator_setups(
            workload, base_url=base_url, api_key="none", provider=None, max_retries=0, timeout=60, run_id=run_id,
            service_name="llmspans-load-ray-benchmark", client="httpx", limiter_cap=None, file_export=True,
        )  # fmt: skip
        fleet = Fleet(connect(None), args.generators, setups)
    runner = Runner(
        workload, plan, base_url=base_url, tracer_provider=provider, max_retries=0, run_id=run_id,
        workers=args.generators, export=WorkerExport("llmspans-load-ray-benchmark", traces), fleet=fleet,
    )  # fmt: skip
    started = time.perf_counter()
    outcome = asyncio.run(runner.run())
    wall = time.perf_counter() - started
    if outcome.failure is not None or len(outcome.levels) != 1:
        raise SystemExit(f"benchmarks/load_ray.py: {name}: {outcome.failure or outcome.notes}")
    (stats,) = outcome.levels
    return Side(name, stats, wall)


def _median_range(values: Sequence[float], digits: int = 1) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--generators", type=int, default=2, help="worker processes and Ray generators (2)")
    parser.add_argument("--concurrency", type=int, default=8, help="closed loop: users over them all (8)")
    parser.add_argument("--rate", type=float, default=None, help="open loop instead: requests per second")
    parser.add_argument("--requests", type=int, default=2000, help="requests a side a round (2000)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (3)")
    parser.add_argument("--ray", metavar="ADDRESS", help="an existing cluster (default: one started here)")
    parser.add_argument("--quick", action="store_true", help="200 requests, 1 round: checks that it runs")
    args = parser.parse_args(argv)
    requests, rounds = (200, 1) if args.quick else (args.requests, args.rounds)
    import ray

    cluster = None
    if args.ray:
        ray.init(address=args.ray, logging_level=logging.ERROR, log_to_driver=False)
    else:
        from ray.cluster_utils import Cluster

        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
        for _ in range(args.generators - 1):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level=logging.ERROR, log_to_driver=False)
    load_before = os.getloadavg()[0]
    level = _level(args)
    print(
        f"llmspans load at {level.words}, {requests} requests a side a round, {rounds} rounds, against a zero-delay "
        f"server (4 streamed chunks): {args.generators} worker processes against {args.generators} Ray generators "
        f"({'the cluster at ' + args.ray if args.ray else f'{args.generators} nodes of one CPU on the loopback'}); "
        f"{os.cpu_count()} CPUs here, load average {load_before:.1f} before the run"
    )
    process, base_url = start_simulator()
    sides: dict[str, list[Side]] = {"workers": [], "ray": []}
    try:
        with tempfile.TemporaryDirectory(prefix="llmspans-load-ray-benchmark-") as scratch:
            traces = Path(scratch) / "traces.jsonl"
            llmspans.configure(service_name="llmspans-load-ray-benchmark", traces_file=traces)
            for _ in range(rounds):
                for name in ("workers", "ray"):
                    side = _side(name, args, base_url, traces, requests)
                    sides[name].append(side)
                    print(
                        f"  {name:<8} {side.stats.completed:>5} requests, {side.stats.requests_per_s:8.1f} requests/s, "
                        f"{side.per_cpu_s:8.1f} requests per CPU-second ({(side.stats.cpu_per_request_s or 0) * 1e3:.2f} "
                        "ms of CPU a request)",
                        flush=True,
                    )
    finally:
        process.terminate()
        process.wait(10)
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
    print()
    print(f"  {'median (min-max)':<28}{'workers':>24}{'ray':>24}{'ratio':>8}")
    for label, figure in (
        ("requests/s", lambda side: side.stats.requests_per_s),
        ("requests per CPU-second", lambda side: side.per_cpu_s),
        ("CPU ms/request", lambda side: (side.stats.cpu_per_request_s or 0) * 1e3),
    ):
        workers = [figure(side) for side in sides["workers"]]
        on_ray = [figure(side) for side in sides["ray"]]
        ratio = statistics.median(on_ray) / statistics.median(workers) if statistics.median(workers) else 0.0
        digits = 2 if label.startswith("CPU") else 1
        print(
            f"  {label:<28}{_median_range(workers, digits):>24}{_median_range(on_ray, digits):>24}{ratio:>7.2f}x"
        )
    share = statistics.median(side.per_cpu_s for side in sides["ray"]) / statistics.median(
        side.per_cpu_s for side in sides["workers"]
    )
    verdict = "MET" if share >= TARGET_SHARE else "NOT met"
    print(
        f"Ray's requests per CPU-second at least {TARGET_SHARE:.0%} of the workers': {verdict} ({share:.2f}; load "
        f"average {os.getloadavg()[0]:.1f} after the run)"
    )
    figure_of_record("benchmarks/load_ray.py", argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
