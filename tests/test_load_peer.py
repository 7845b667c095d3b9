"""`llmspans load` and `vllm bench serve` agree on the real vLLM: benchmarks/load_peer.py's rounds, bounded.

Server pinned to one CPU, each client to the other, the same 32 prompts of 100 words, 48 requests a round, 32 output tokens,
8 concurrent against `--max-num-seqs 4`, the tools alternating. TTFT p50 and requests/s must agree within
the rounds' own spread (`Comparison.agree`: the medians' difference at most the two tools' ranges added):
the machine's noise sets the tolerance, so it holds on a busy machine and still catches a tool that is
off by more than that noise. Rounds are added (up to `MAX_ROUNDS`) while the tools disagree, so three
lucky-tight rounds do not fail a sound tool. (CPU per request is compared against the zero-delay
simulator, where the clients are all there is: `python benchmarks/load_peer.py --targets sim`.)
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from tests.support.realservers import VLLM_STARTUP_TIMEOUT, find_install

ROOT = Path(__file__).resolve().parents[1]
ROUNDS = 3
MAX_ROUNDS = 5
REQUESTS = 48
# vLLM's start, then at most MAX_ROUNDS rounds of both tools (48 requests each at 2 requests/s or more,
# the slowest this busy machine gave, plus each tool's start).
pytestmark = pytest.mark.timeout(VLLM_STARTUP_TIMEOUT + MAX_ROUNDS * 2 * 60)


def _peer() -> object:
    spec = importlib.util.spec_from_file_location("load_peer", ROOT / "benchmarks" / "load_peer.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["load_peer"] = module
    spec.loader.exec_module(module)
    return module


def test_llmspans_load_and_vllm_bench_serve_agree_on_the_real_vllm(tmp_path: Path) -> None:
    install = find_install("vllm")
    peer: object = _peer()
    cpus = peer.two_cpus()  # type: ignore[attr-defined]
    if cpus is None:
        pytest.skip("client and server need a CPU each (taskset): this machine lets the tests use one")
    prompts = tmp_path / "prompts.jsonl"
    peer.write_prompts(prompts, 32, 100)  # type: ignore[attr-defined]
    with peer.real_vllm(cpus[0]) as target:  # type: ignore[attr-defined]
        target.tokenizer = str(install.vllm_model_dir)
        run = {"requests": REQUESTS, "concurrency": 8, "output_len": 32, "cpus": cpus, "scratch": tmp_path,
               "progress": False}  # fmt: skip
        comparison = peer.compare(target, install.vllm_python, prompts, rounds=ROUNDS, **run)  # type: ignore[attr-defined]
        rounds = ROUNDS
        while rounds < MAX_ROUNDS and not all(
            comparison.agree(label)[0] for label in ("TTFT p50", "requests/s")
        ):
            more = peer.compare(target, install.vllm_python, prompts, rounds=2, **run)  # type: ignore[attr-defined]
            for tool, figures in more.rounds.items():
                comparison.rounds[tool] += figures
            rounds += 2
    table = peer.table(comparison)  # type: ignore[attr-defined]
    for tool, figures in comparison.rounds.items():
        assert all(f.completed == REQUESTS for f in figures), (tool, table)
    for label in ("TTFT p50", "requests/s"):
        agree, difference, tolerance = comparison.agree(label)
        assert agree, f"{label}: medians {difference:.2f} apart, the rounds' spread {tolerance:.2f}\n{table}"
    print(f"\n{rounds} rounds, load average {os.getloadavg()[0]:.1f}\n{table}")
