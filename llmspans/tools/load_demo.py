"""`llmspans demo --load`: a knee to look at without a vLLM.

It starts the shipped simulator with a capacity model in a child process (`python -m
llmspans.tools.simulator --slots 4 ...`: 4 batch slots, 2 ms of prefill per prompt token, 20 ms per
output token, vLLM's /metrics names; a request takes about a third of a second, long beside a busy
machine's hiccups), runs `llmspans load ... --provider vllm` against it in another
child process (the very command a user types, printed first, its output as it prints it), and stops
the simulator however the run ends. The load finds the knee between 4 and 8 concurrent users and names
what grew there: first_token, with the server's waiting requests rising and running pinned at 4, so "the
queue is on the server". Children, not threads: the load tool's timing is not shared with the server's,
and nothing is left running in this process (no thread, no port) when it returns.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TextIO

__all__ = ["LoadDemo", "run"]

_URL_TIMEOUT_S = 30.0  # the simulator prints its URL once it listens: an import and a bind
_STOP_TIMEOUT_S = 5.0
_WIDTH = 100
_INTERRUPTED = 130


@dataclass(frozen=True)
class LoadDemo:
    """The simulated server and the load that finds its knee (the defaults are what the README shows)."""

    slots: int = 4
    prefill_per_token: float = 0.002
    decode_per_token: float = 0.02
    model: str = "sim-model"
    concurrency: str = "1,2,4,8"
    prompt_tokens: int = 80
    max_tokens: int = 10
    slo: str = "ttft=300ms,e2e=600ms"

    def simulator_command(self) -> list[str]:
        return [
            sys.executable, "-m", "llmspans.tools.simulator", "--port", "0", "--slots", str(self.slots),
            "--prefill-per-token", repr(self.prefill_per_token), "--decode-per-token", repr(self.decode_per_token),
            "--model", self.model,
        ]  # fmt: skip

    def load_arguments(self, base_url: str) -> list[str]:
        """What follows `llmspans` on the command line."""
        return [
            "load", base_url, "--model", self.model, "--concurrency", self.concurrency,
            "--max-tokens", str(self.max_tokens), "--prompt-tokens", str(self.prompt_tokens),
            "--provider", "vllm", "--slo", self.slo,
        ]  # fmt: skip


def _say(stream: TextIO, text: str) -> None:
    print(textwrap.fill(text, _WIDTH, subsequent_indent="  ", break_on_hyphens=False), file=stream)


def _ignore_ctrl_c() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _read_url(process: subprocess.Popen[str]) -> str | None:
    """The simulator's first line (its base URL), or None if it ended or said nothing in time."""
    assert process.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        if not selector.select(_URL_TIMEOUT_S):
            return None
    line = process.stdout.readline().strip()
    return line if line.startswith("http://") else None


def _stop(process: subprocess.Popen[Any]) -> None:
    """End a child and reap it: SIGTERM (the simulator stops cleanly on it), then SIGKILL if need be."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    if process.stdout is not None:
        process.stdout.close()


def run(
    demo: LoadDemo | None = None,
    *,
    extra: Sequence[str] = (),
    out: TextIO | None = None,
    load_command: Sequence[str] | None = None,
) -> int:
    """Run the demo; the load's exit code (2 when the simulator did not start, 130 after Ctrl-C, when the
    load prints what it had). `extra` is passed to `llmspans load` (`--json`, `--html OUT.html`); with
    `--json`, stdout holds the load's document alone and the demo's own lines go to stderr.
    `load_command` replaces `python -m llmspans` (for tests)."""
    demo = demo or LoadDemo()
    say = out or (sys.stderr if "--json" in extra else sys.stdout)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # The simulator ignores Ctrl-C, which reaches every process of the terminal's group: it keeps serving
    # while the load finishes what it has in flight and prints it, then it is stopped here.
    simulator = subprocess.Popen(
        demo.simulator_command(), stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=env,
        preexec_fn=_ignore_ctrl_c,
    )  # fmt: skip
    load: subprocess.Popen[bytes] | None = None
    try:
        url = _read_url(simulator)
        if url is None:
            print("llmspans demo: the simulated server did not start", file=sys.stderr)
            return 2
        _say(
            say,
            f"llmspans demo --load: a SIMULATED vLLM-like server (no real model) at {url}, process "
            f"{simulator.pid}: {demo.slots} batch slots, {demo.prefill_per_token * 1e3:g} ms of prefill per prompt "
            f"token, {demo.decode_per_token * 1e3:g} ms per output token, vLLM's /metrics; loaded by:",
        )
        arguments = [*demo.load_arguments(url), *extra]
        print("$ llmspans " + " ".join(arguments), file=say, flush=True)
        command = list(load_command) if load_command is not None else [sys.executable, "-m", "llmspans"]
        load = subprocess.Popen([*command, *arguments], stdin=subprocess.DEVNULL, env=env)
        try:
            code = load.wait()
        except KeyboardInterrupt:  # Ctrl-C reached the load too: it prints what it has, then ends
            code = load.wait()
        if code == 0:
            print(file=say)
            _say(
                say,
                f"(simulated) the server runs {demo.slots} requests at once; past {demo.slots} users the others "
                "wait in its queue. The same against your own vLLM: llmspans load BASE_URL --model M "
                "--provider vllm",
            )
        return code
    except KeyboardInterrupt:  # before the load started, or a second Ctrl-C: stop everything now
        print("\nllmspans demo: interrupted", file=sys.stderr)
        return _INTERRUPTED
    finally:
        if load is not None:
            _stop(load)
        _stop(simulator)
        say.flush()
