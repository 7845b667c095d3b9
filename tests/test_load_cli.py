"""`llmspans load` on the command line: bad arguments are one line and exit code 2, a host other than this
one is not loaded without asking, a run prints its tables (or JSON, or an HTML page) and writes its spans
where `configure()` says, and Ctrl-C stops it with what it has printed."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

from llmspans.__main__ import main
from llmspans.report._analysis import analyse_batches
from llmspans.report._sources.file import FileSource
from llmspans.tools.simulator import Behavior, SimulatedServer

FAST = Behavior(chunks=4, chunk_gap=0.001, usage="auto")


@pytest.fixture
def fast_server() -> Iterator[SimulatedServer]:
    with SimulatedServer(FAST, record=False) as server:
        yield server


@pytest.mark.parametrize(
    ("arguments", "says"),
    [
        (["--concurrency", "0"], "--concurrency takes positive whole numbers"),
        (["--concurrency", "1.5"], "--concurrency takes positive whole numbers"),
        (["--rate", "fast"], "--rate takes positive numbers"),
        (["--slo", "speed=1s"], "--slo knows ttft, tpot, e2e"),
        (["--slo", "ttft=-1"], "must be a positive number of seconds"),
        (["--prompt-tokens", "ten"], "--prompt-tokens takes N or N,STDDEV"),
        (["--max-tokens", "0"], "--max-tokens must be a positive whole number"),
        (["--knee-factor", "1"], "--knee-factor must be a number above 1"),
        (["--concurrency", "1,2", "--sweep"], "--sweep starts from one level"),
        (["--no-stream", "--slo", "ttft=1s"], "--slo ttft and tpot need streamed calls"),
        (["--prompts", "/nonexistent/prompts.jsonl"], "--prompts: cannot read"),
        (["--limiter-cap", "0"], "--limiter-cap must be 1 or more"),
        (["--workers", "0"], "--workers takes a whole number from 1 to 64, or auto"),
        (["--workers", "many"], "--workers takes a whole number from 1 to 64, or auto"),
        (["--workers", "2", "--limiter-cap", "2"], "--limiter-cap puts one Limiter in front of every call"),
        (["--generators", "2"], "--generators is for --ray (Ray actors); on one machine, --workers N"),
        (
            ["--ray", "--workers", "2"],
            "--workers is for one machine: with --ray, --generators N says how many",
        ),
        (["--ray=http://127.0.0.1:8000/v1"], "--ray takes a Ray address, got 'http://127.0.0.1:8000/v1'"),
        (
            ["--ray", "--replay", "tests/fixtures/embedded-default.jsonl"],
            "--replay runs on one machine (--workers N spreads it), not on --ray yet",
        ),
        (["--speed", "2"], "--speed goes with --replay"),
        (["--replay", "x.jsonl", "--concurrency", "2"], "--concurrency does not go with --replay"),
        (["--replay", "--tempo", "http://127.0.0.1:9"], "--tempo needs --service NAME"),
        (["--replay"], "--replay takes one source"),
        (["--replay", "/nonexistent.jsonl"], "/nonexistent.jsonl: no such file"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_code_2(
    arguments: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["load", "http://127.0.0.1:9/v1", "--model", "m", *arguments])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("llmspans load: ")
    assert says in err
    assert len(err.strip().splitlines()) == 1
    assert "Traceback" not in err


def test_a_bad_url_and_a_bad_prompts_file_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["load", "ftp://host/v1", "--model", "m"]) == 2
    assert "BASE_URL must be an http(s) URL" in capsys.readouterr().err
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('[{"role": "user", "content": "hi"}]\n{"nope": 1}\n')
    assert main(["load", "http://127.0.0.1:9/v1", "--model", "m", "--prompts", str(prompts)]) == 2
    assert "line 2 must be a list of messages" in capsys.readouterr().err
    traces = tmp_path / "traces.jsonl"
    traces.write_text('{"resourceSpans": []}\n')
    assert main(["load", "http://127.0.0.1:9/v1", "--model", "m", "--prompts-from", str(traces)]) == 2
    assert "no call span there carries gen_ai.input.messages" in capsys.readouterr().err


def test_another_host_is_not_loaded_without_asking(capsys: pytest.CaptureFixture[str]) -> None:
    """No terminal to ask on: the plan is shown and nothing is sent (the host does not even resolve)."""
    code = main(["load", "http://llm.example.invalid/v1", "--model", "m", "--concurrency", "1,2"])
    err = capsys.readouterr().err
    assert code == 2
    assert "not this machine" in err
    assert "at most 40 requests" in err
    assert err.strip().splitlines()[-1] == (
        "llmspans load: llm.example.invalid is not this machine and there is no terminal to ask: pass --yes to run anyway"
    )


def _cli(
    *arguments: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmspans", "load", *arguments], capture_output=True, text=True, timeout=timeout,
        env=env, check=False,
    )  # fmt: skip


def _env(tmp_path: Path) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("OTEL_", "LLMSPANS_"))}
    env["LLMSPANS_TRACES_FILE"] = str(tmp_path / "traces.jsonl")
    return env


def test_without_the_openai_sdk_it_says_how_to_install_it(tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['openai'] = None\n"
        "from llmspans.__main__ import main\n"
        "raise SystemExit(main(['load', 'http://127.0.0.1:9/v1', '--model', 'm']))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2
    assert (
        done.stderr.strip()
        == "llmspans load: llmspans load needs the openai SDK: pip install 'llmspans[openai]'"
    )


def test_a_target_that_does_not_answer_is_one_line(tmp_path: Path) -> None:
    done = _cli("http://127.0.0.1:9/v1", "--model", "m", "--max-retries", "0", env=_env(tmp_path))
    assert done.returncode == 2
    assert "llmspans load: the warm-up request to http://127.0.0.1:9/v1 failed: ConnectError" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_run_prints_json_writes_html_and_leaves_spans_the_report_splits_by_level(
    fast_server: SimulatedServer, tmp_path: Path
) -> None:
    html = tmp_path / "load.html"
    done = _cli(
        fast_server.base_url, "--model", "sim-model", "--concurrency", "1,2", "--requests", "6", "--json",
        "--html", str(html), "--slo", "e2e=5s", env=_env(tmp_path),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    assert [level["level"]["label"] for level in document["levels"]] == ["concurrency=1", "concurrency=2"]
    assert [level["completed"] for level in document["levels"]] == [6, 6]
    assert all(level["good"] == 6 for level in document["levels"])
    assert document["summary"]
    assert html.read_text().startswith("<!doctype html>")
    assert "1 concurrent: 6/6 done" in done.stderr
    source = FileSource([tmp_path / "traces.jsonl"])
    report = analyse_batches(source.batches, top=0)
    assert [(row.level, row.calls) for row in report.levels] == [("concurrency=1", 6), ("concurrency=2", 6)]
    assert {row.run_id for row in report.levels} == {document["run_id"]}


def test_ctrl_c_stops_the_run_and_prints_what_it_has(fast_server: SimulatedServer, tmp_path: Path) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "llmspans", "load", fast_server.base_url, "--model", "sim-model", "--concurrency",
         "1", "--requests", "100000"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(tmp_path),
    )  # fmt: skip
    try:
        # The run has begun (its Ctrl-C handler is in place) once its first request reached the server,
        # however long a busy machine takes to start the interpreter and import the SDK.
        deadline = time.monotonic() + 60
        while fast_server.connections_opened == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert fast_server.connections_opened > 0
        time.sleep(1.0)  # some requests go out
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 130, err
    assert "stopping" in err, err
    assert "Interrupted: " in out
    assert "concurrency=1" in out
    assert "Traceback" not in err


class _Stderr:
    """A running command's stderr, read line by line as it comes, on a thread of its own."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        assert process.stderr is not None
        self._thread = threading.Thread(target=self._read, args=(process.stderr,), daemon=True)
        self._thread.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.append(line)

    def wait_for(self, pattern: str, timeout: float = 120) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                found = re.search(pattern, line)
                if found:
                    return found
            time.sleep(0.05)
        raise AssertionError(f"no line matching {pattern!r} in {''.join(self.lines)}")

    def text(self) -> str:
        self._thread.join(30)
        return "".join(self.lines)


def _worker_run(server: SimulatedServer, tmp_path: Path) -> subprocess.Popen[str]:
    """Two workers at 40 requests/s, far more requests than will go: it runs until stopped."""
    return subprocess.Popen(
        [sys.executable, "-m", "llmspans", "load", server.base_url, "--model", "sim-model", "--rate", "40",
         "--workers", "2", "--requests", "100000", "--max-requests", "100000", "--max-seconds", "120"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(tmp_path),
    )  # fmt: skip


def _stdout(process: subprocess.Popen[str]) -> str:
    """What an ended command printed (its tables: far less than a pipe holds, so it could end)."""
    assert process.stdout is not None
    return process.stdout.read()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_ctrl_c_stops_every_worker_and_prints_what_they_had(
    fast_server: SimulatedServer, tmp_path: Path
) -> None:
    process = _worker_run(fast_server, tmp_path)
    stderr = _Stderr(process)
    try:
        ready = stderr.wait_for(r"2 worker processes ready \(pids (\d+), (\d+)\)")
        pids = [int(pid) for pid in ready.groups()]
        time.sleep(1.5)  # the level begins a tenth of a second after the workers are ready; requests go out
        process.send_signal(signal.SIGINT)
        process.wait(timeout=60)
    finally:
        process.kill()
    err, out = stderr.text(), _stdout(process)
    assert process.returncode == 130, err
    assert "stopping" in err, err
    assert "Interrupted: " in out
    level = next(line for line in out.splitlines() if line.startswith("  rate=40") and " 2 " in line)
    assert level.split()[1] == "2"  # the generator's table: two workers
    assert all(_gone(pid) for pid in pids)
    # Both workers' spans are in the traces file, and nothing else is left beside it.
    assert sorted(path.name for path in tmp_path.iterdir()) == ["traces.jsonl"]
    source = FileSource([tmp_path / "traces.jsonl"])
    report = analyse_batches(source.batches, top=0)
    assert [row.level for row in report.levels] == ["rate=40"]
    assert report.levels[0].calls > 0
    assert "Traceback" not in err


def test_a_worker_that_dies_is_named_and_the_run_ends(fast_server: SimulatedServer, tmp_path: Path) -> None:
    process = _worker_run(fast_server, tmp_path)
    stderr = _Stderr(process)
    try:
        ready = stderr.wait_for(r"2 worker processes ready \(pids (\d+), (\d+)\)")
        first, second = (int(pid) for pid in ready.groups())
        time.sleep(1.5)  # into the level
        os.kill(first, signal.SIGKILL)
        process.wait(timeout=90)  # never a wait for the dead one
    finally:
        process.kill()
    err, out = stderr.text(), _stdout(process)
    assert process.returncode == 1, err
    assert f"llmspans load: worker 1 (pid {first}) was killed by SIGKILL during rate=40" in err, err
    assert "No level ran." in out
    assert "40 requests/s is not reported: worker 1" in " ".join(out.split())
    assert _gone(second)
    assert "Traceback" not in err
