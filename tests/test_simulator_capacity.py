"""The shipped simulator's capacity model, `llmspans load` finding its knee, and `llmspans demo --load`.

The model's scheduler is also the tests' vLLM simulator's (tests/test_vllm_simulator.py covers the
queue order, KV pressure, preemption and the prefix cache through it); here: what a user of
`python -m llmspans.tools.simulator --slots N` sees over HTTP, and that the load demo finds the knee
at the slot count and leaves nothing running.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmspans.tools import load_demo
from llmspans.tools.simulator import Capacity, SimulatedServer
from llmspans.tools.simulator import main as simulator_main
from llmspans.vllm import ServerMetrics
from tests.timing import retry_timing

ROOT = Path(__file__).resolve().parents[1]


def _chat(max_tokens: int, prompt_words: int, *, stream: bool = True) -> dict[str, Any]:
    return {
        "model": "sim-model", "stream": stream, "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": " ".join(f"w{i}" for i in range(prompt_words))}],
    }  # fmt: skip


def _wait_for(predicate: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return False


@contextmanager
def _posting(client: httpx.Client, count: int, body: dict[str, Any]) -> Iterator[None]:
    """`count` requests sent at once from threads; the block runs while they are in flight."""
    threads = [
        threading.Thread(target=client.post, args=("/chat/completions",), kwargs={"json": body})
        for _ in range(count)
    ]
    for thread in threads:
        thread.start()
    try:
        yield
    finally:
        for thread in threads:
            thread.join()


def _metrics(server: SimulatedServer) -> dict[str, tuple[dict[str, str], float]]:
    text = httpx.get(f"{server.url}/metrics").text
    return {
        sample.name: (sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


@pytest.fixture
def two_slots() -> Iterator[SimulatedServer]:
    """Two batch slots; a request of 20 tokens decodes for 20 x 50 ms: a wide window to look at the queue."""
    capacity = Capacity(slots=2, prefill_per_token=0.001, decode_per_token=0.05, model="sim-model")
    with SimulatedServer(capacity=capacity) as server:
        yield server


def test_slots_bound_what_runs_the_rest_wait_and_metrics_say_so_in_vllms_names(
    two_slots: SimulatedServer,
) -> None:
    engine = two_slots.engine
    assert engine is not None
    with httpx.Client(base_url=two_slots.base_url, timeout=30) as client, _posting(client, 5, _chat(20, 8)):
        assert _wait_for(lambda: engine.state()[:2] == (3, 2)), engine.state()
        metrics = _metrics(two_slots)
    # Read while 3 waited and 2 ran (the 5 requests last a second at least): the gauges agree.
    labels, waiting = metrics["vllm:num_requests_waiting"]
    assert labels == {"engine": "0", "model_name": "sim-model"}
    assert waiting == 3
    assert metrics["vllm:num_requests_running"][1] == 2
    assert 0 < metrics["vllm:kv_cache_usage_perc"][1] <= 1
    after = _metrics(two_slots)
    assert after["vllm:num_requests_running"][1] == after["vllm:num_requests_waiting"][1] == 0
    assert after["vllm:generation_tokens_total"][1] == 5 * 20
    assert after["vllm:prompt_tokens_total"][1] == 5 * 8


def test_the_first_token_comes_after_the_prefill_and_each_next_one_a_decode_step_later() -> None:
    capacity = Capacity(slots=1, prefill_per_token=0.002, decode_per_token=0.02)
    with SimulatedServer(capacity=capacity) as server, httpx.Client(base_url=server.base_url) as client:
        with client.stream("POST", "/chat/completions", json=_chat(6, 100)) as response:
            body = "".join(response.iter_text())
        whole = client.post("/chat/completions", json=_chat(3, 10, stream=False)).json()
        assert server.wait_idle()
        streamed = server.requests[0]
    assert len(streamed.chunk_sent_ns) == len(streamed.chunk_due_ns) == 6
    # 100 prompt tokens at 2 ms: the first token no sooner than 200 ms after the request arrived.
    assert streamed.chunk_due_ns[0] - streamed.arrived_ns >= 200e6
    # Each next token a decode step (20 ms) after the one before, each written once it was due.
    gaps = [later - earlier for earlier, later in itertools.pairwise(streamed.chunk_due_ns)]
    assert min(gaps) >= 20e6 - 1e3  # the stamps are perf_counter() seconds, to the microsecond
    assert all(sent >= due for sent, due in zip(streamed.chunk_sent_ns, streamed.chunk_due_ns, strict=True))
    assert '"finish_reason":"length"' in body
    assert whole["choices"][0]["finish_reason"] == "length"
    assert whole["usage"]["completion_tokens"] == 3


def test_llmspans_vllm_reads_the_simulators_metrics(two_slots: SimulatedServer) -> None:
    with ServerMetrics(two_slots.base_url, interval=0.05) as sampler:
        assert _wait_for(lambda: "vllm.num_requests_waiting" in sampler.span_attributes())
        attributes = sampler.span_attributes()
    assert attributes["vllm.num_requests_waiting"] == 0
    assert attributes["vllm.num_requests_running"] == 0
    assert attributes["vllm.kv_cache_usage"] == 0.0


def test_a_full_queue_is_rejected_with_503() -> None:
    capacity = Capacity(slots=1, decode_per_token=0.05, max_waiting=1)
    with (
        SimulatedServer(capacity=capacity) as server,
        httpx.Client(base_url=server.base_url, timeout=30) as client,
    ):
        engine = server.engine
        assert engine is not None
        with _posting(client, 2, _chat(10, 4)):
            assert _wait_for(lambda: engine.state()[:2] == (1, 1)), engine.state()
            rejected = client.post("/chat/completions", json=_chat(10, 4))
    assert rejected.status_code == 503
    assert "queue is full" in rejected.json()["error"]["message"]


def test_without_a_capacity_model_the_simulator_answers_at_once_and_has_no_metrics(
    server: SimulatedServer,
) -> None:
    assert server.engine is None
    assert httpx.get(f"{server.url}/metrics").status_code == 404


def test_bad_capacity_settings_say_what_to_pass(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="slots must be a positive int"):
        Capacity(slots=0)
    with pytest.raises(ValueError, match="decode_per_token must be a non-negative number"):
        Capacity(decode_per_token=-1)
    with pytest.raises(SystemExit):
        simulator_main(["--decode-per-token", "0.01"])
    assert "part of the capacity model: add --slots N" in capsys.readouterr().err


@retry_timing
def test_llmspans_load_against_it_finds_the_knee_at_its_slot_count_named_as_the_servers_queue(
    tmp_path: Path,
) -> None:
    """The command a user types, against `--slots 4`: the knee between 4 and 8, first_token grew, the
    server's waiting rose while running stayed at its 4 slots: "the queue is on the server"."""
    capacity = Capacity(slots=4, prefill_per_token=0.0015, decode_per_token=0.015)
    with SimulatedServer(capacity=capacity, record=False) as server:
        done = subprocess.run(
            [sys.executable, "-m", "llmspans", "load", server.base_url, "--model", "sim-model", "--concurrency",
             "2,4,8", "--requests", "12", "--prompt-tokens", "100", "--max-tokens", "8", "--provider", "vllm",
             "--max-retries", "0", "--json"],
            cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert (result["knee"]["before"], result["knee"]["at"]) == ("concurrency=4", "concurrency=8"), result[
        "summary"
    ]
    assert result["verdict"]["grew"] == "first_token"
    assert result["verdict"]["finding"] == "server_queue"
    assert "the queue is on the server" in result["summary"]
    server_at = {level["level"]["label"]: level["server"] for level in result["levels"]}
    assert server_at["concurrency=8"]["running_max"] == 4
    assert server_at["concurrency=8"]["waiting_mean"] >= server_at["concurrency=4"]["waiting_mean"] + 1


def _env(folder: Path) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("OTEL_", "LLMSPANS_"))}
    env["LLMSPANS_TRACES_FILE"] = str(folder / "traces.jsonl")
    return env


def _children() -> set[int]:
    """This process's live child processes (from /proc)."""
    mine = str(os.getpid())
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[1] == mine:
                found.add(int(entry.name))
    return found


def _refused(url: str) -> bool:
    host, port = re.fullmatch(r"http://([\d.]+):(\d+)/v1", url).groups()  # type: ignore[union-attr]
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


_STARTED = re.compile(r"at (http://127\.0\.0\.1:\d+/v1),\s+process (\d+):")


@retry_timing
def test_demo_load_shows_the_knee_at_the_slots_in_under_a_minute_and_leaves_nothing_running(
    tmp_path: Path,
) -> None:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "llmspans", "demo", "--load"],
        cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())
    assert elapsed < 60, elapsed
    assert "$ llmspans load http://127.0.0.1:" in text
    assert "knee between 4 concurrent and 8 concurrent" in text, done.stdout
    assert "p95 first_token went" in text
    assert "the queue is on the server" in text
    assert "running stayed at 4: every batch slot was busy" in text
    match = _STARTED.search(text)
    assert match is not None, text
    url, pid = match.group(1), int(match.group(2))
    # The simulator is gone, its port closed.
    assert not Path(f"/proc/{pid}").exists()
    assert _refused(url)
    assert (tmp_path / "traces.jsonl").stat().st_size > 0


def test_the_demo_stops_its_simulator_whatever_the_load_does(capfd: pytest.CaptureFixture[str]) -> None:
    """In this process: the load (here a stand-in that reads the simulator's /metrics, then one that
    fails) ran while the simulator served; after, no child process, no new thread, the port closed."""
    threads_before = set(threading.enumerate())
    children_before = _children()
    probe = (
        "import sys, urllib.request; page = urllib.request.urlopen(sys.argv[2][:-3] + '/metrics').read().decode();"
        "sys.exit(0 if 'vllm:num_requests_running{' in page else 5)"
    )
    assert load_demo.run(load_command=[sys.executable, "-c", probe]) == 0
    assert load_demo.run(load_command=[sys.executable, "-c", "raise SystemExit(3)"]) == 3
    output = capfd.readouterr().out
    urls = [match.group(1) for match in _STARTED.finditer(" ".join(output.split()))]
    assert len(urls) == 2
    assert all(_refused(url) for url in urls)
    assert _children() == children_before
    assert set(threading.enumerate()) == threads_before
    # A simulator that cannot start (nonsense settings): exit 2, nothing left either.
    assert load_demo.run(load_demo.LoadDemo(slots=0)) == 2
    assert _children() == children_before


def test_ctrl_c_stops_the_demo_the_load_and_the_simulator(tmp_path: Path) -> None:
    """Ctrl-C reaches the whole foreground group (the demo, its simulator, its load): the load prints
    what it had and the demo exits 130 with its simulator reaped and the port closed."""
    demo = subprocess.Popen(
        [sys.executable, "-m", "llmspans", "demo", "--load"], cwd=tmp_path, env=_env(tmp_path),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert demo.stdout is not None
        seen = ""
        while "$ llmspans load" not in seen:
            line = demo.stdout.readline()
            assert line, seen
            seen += line
        assert demo.stderr is not None
        while not re.match(r"1 concurrent: \d+/\d+ done", demo.stderr.readline()):  # a level is done
            pass
        os.killpg(demo.pid, signal.SIGINT)
        out, err = demo.communicate(timeout=60)
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait()
    assert demo.returncode == 130, err
    match = _STARTED.search(" ".join(seen.split()))
    assert match is not None, seen
    assert not Path(f"/proc/{match.group(2)}").exists()
    assert _refused(match.group(1))
    assert "llmspans load: stopping" in err
    assert "concurrency=1 " in out  # the level done before Ctrl-C, printed all the same
