"""The examples of the README and docs/: found in the Markdown, run as a reader would run them.

`blocks(path)` finds every fenced code block of a page with what the page says about it (a comment line
`<!-- example: ... -->` right above the fence). `python -m tests.support.doc_examples` runs the pages it is
given and prints one JSON line per example: each page's Python blocks in order, in one namespace, in a
process of its own forked from this one (which has imported llmspans and the openai SDK once, so a page
costs a fork, not an interpreter and its imports), in a scratch directory of its own; then the page's
shell blocks marked `run`, with bash, in the same directory. tests/test_docs.py drives it against the
simulator; docs/development.md says the rules to the writers.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import logging
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYTHON = ("python", "py")
SHELL = ("bash", "sh", "shell", "console")

_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})\s*(?P<info>.*)$")
_DIRECTIVE = re.compile(r"^<!--\s*example:\s*(?P<what>.*?)\s*-->$")
_TITLE = re.compile(r"""title=["'](?P<title>[^"']+)["']""")
_SNIPPET = re.compile(r"""^--8<--\s+["'](?P<path>[^"':]+)["']\s*$""")
SHELL_BOUND_S = 60.0  # a hung shell example is stopped; the examples chosen to run take a few seconds
PAGE_BOUND_S = 120.0  # the same for one process of Python examples


@dataclass(frozen=True)
class Block:
    """One fenced code block: where it is, its language, its code, and what the page says about it."""

    path: str  # relative to the repository, as a test id
    line: int  # the line of the code's first line, 1-based
    lang: str
    code: str
    directive: str | None  # "run", "not run: why", "new process", or None
    title: str | None  # `title="chat.py"`: also written to that file

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def is_python(self) -> bool:
        return self.lang in PYTHON

    @property
    def is_shell(self) -> bool:
        return self.lang in SHELL

    @property
    def runs(self) -> bool:
        return self.is_python or (self.is_shell and self.directive == "run")


def pages(root: Path = ROOT) -> list[Path]:
    """The README and every page of the site."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def blocks(path: Path, root: Path = ROOT) -> list[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    index = 0
    while index < len(lines):
        opening = _FENCE.match(lines[index])
        if not opening:
            index += 1
            continue
        fence, info = opening["fence"], opening["info"].strip()
        lang = info.split()[0].lower() if info else ""
        title = _TITLE.search(info)
        end = index + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        previous = next((lines[i].strip() for i in range(index - 1, -1, -1) if lines[i].strip()), "")
        directive = _DIRECTIVE.match(previous)
        code_lines = [_include(line, root) for line in lines[index + 1 : end]]
        found.append(
            Block(
                path=path.relative_to(root).as_posix(), line=index + 2, lang=lang, code="\n".join(code_lines) + "\n",
                directive=directive["what"] if directive else None, title=title["title"] if title else None,
            )
        )  # fmt: skip
        index = end + 1
    return found


def _include(line: str, root: Path) -> str:
    """A snippet line (`--8<-- "examples/rag_turn.py"`) is the file it names, as the site shows it."""
    snippet = _SNIPPET.match(line.strip())
    return (root / snippet["path"]).read_text(encoding="utf-8").rstrip("\n") if snippet else line


def substitute(code: str, places: Mapping[str, str]) -> str:
    """The placeholder servers of the text (`http://localhost:8000/v1`, ...) become the test's own."""
    for placeholder, actual in places.items():
        code = code.replace(placeholder, actual)
    return code


# --- running ---------------------------------------------------------------------------------------


def _segments(python: Sequence[Block]) -> Iterator[list[Block]]:
    """A page's Python blocks, cut where one says `new process`."""
    current: list[Block] = []
    for block in python:
        if block.directive == "new process" and current:
            yield current
            current = []
        current.append(block)
    if current:
        yield current


class _InternalErrors(logging.Handler):
    """llmspans logs an internal error once and carries on: in an example that is a failure."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "internal error" in message:
            self.seen.append(
                message
                + ("\n" + "".join(traceback.format_exception(*record.exc_info)) if record.exc_info else "")
            )


def _call_tests(namespace: dict[str, object]) -> None:
    """A page's test file (`title="test_chat.py"`): each test function is called as pytest would call it
    with the one fixture the pages use, `llmspans_capture` (pytest itself, with the dev extra's plugins,
    takes seconds to start)."""
    from llmspans.testing import capture

    for name, function in list(namespace.items()):
        if name.startswith("test_") and callable(function):
            with capture() as captured:
                function(captured)


def _run_segment(segment: Sequence[Block], places: Mapping[str, str], out: int) -> None:
    """In the forked child: run the blocks in one namespace and write one JSON line per block to `out`."""
    errors = _InternalErrors()
    logging.getLogger("llmspans").addHandler(errors)
    sys.path.insert(0, os.getcwd())
    namespace: dict[str, object] = {"__name__": "__main__"}
    failed = False
    for block in segment:
        started = time.perf_counter()
        if failed:
            result = {"id": block.id, "ok": False, "error": "not run: an earlier example on the page failed"}
        else:
            code = substitute(block.code, places)
            if block.title:
                Path(block.title).write_text(code, encoding="utf-8")
            try:
                exec(compile("\n" * (block.line - 1) + code, block.path, "exec"), namespace)
                if block.title and Path(block.title).name.startswith("test_"):
                    _call_tests(namespace)
                error = "".join(errors.seen)
            except BaseException:
                error = traceback.format_exc()
            failed = bool(error)
            result = {"id": block.id, "ok": not failed, "error": error}
        result["seconds"] = round(time.perf_counter() - started, 3)
        os.write(out, (json.dumps(result) + "\n").encode())


def _run_python(
    python: Sequence[Block], places: Mapping[str, str], workdir: Path
) -> Iterator[dict[str, object]]:
    for segment in _segments(python):
        reading, writing = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: its own directory and output, then the blocks, then a normal exit
            os.close(reading)
            code = 0
            try:
                os.chdir(workdir)
                log = os.open("output.txt", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                os.dup2(log, 1)
                os.dup2(log, 2)
                _run_segment(segment, places, writing)
                atexit._run_exitfuncs()  # flushes the exporters, as an interpreter's exit does
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        os.close(writing)
        reported: dict[str, dict[str, object]] = {}
        deadline = time.monotonic() + PAGE_BOUND_S
        buffer = b""
        with os.fdopen(reading, "rb", buffering=0) as pipe:
            while time.monotonic() < deadline:
                ready, _, _ = select.select([pipe], [], [], max(0.0, deadline - time.monotonic()))
                if not ready:
                    break
                chunk = pipe.read(65536)
                if not chunk:
                    break
                buffer += chunk
        for line in buffer.decode().splitlines():
            result = json.loads(line)
            reported[str(result["id"])] = result
        if time.monotonic() >= deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        for block in segment:
            yield reported.get(
                block.id,
                {
                    "id": block.id,
                    "ok": False,
                    "error": f"no result: the process stopped or took over {PAGE_BOUND_S:.0f} s",
                },
            )


def _run_shell(block: Block, places: Mapping[str, str], workdir: Path) -> dict[str, object]:
    started = time.perf_counter()
    environment = {
        **os.environ,
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
    }
    try:
        done = subprocess.run(
            ["bash", "-e", "-o", "pipefail", "-c", substitute(block.code, places)], cwd=workdir, env=environment,
            capture_output=True, text=True, timeout=SHELL_BOUND_S, stdin=subprocess.DEVNULL, check=False,
        )  # fmt: skip
        ok, error = (
            done.returncode == 0,
            ""
            if done.returncode == 0
            else f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}",
        )
    except subprocess.TimeoutExpired as timeout:
        ok, error = False, f"took over {SHELL_BOUND_S:.0f} s\n{timeout.stdout!r}"
    return {"id": block.id, "ok": ok, "error": error, "seconds": round(time.perf_counter() - started, 3)}


def run_pages(paths: Sequence[Path], places: Mapping[str, str], workdir: Path) -> Iterator[dict[str, object]]:
    for path in paths:
        page_blocks = blocks(path)
        directory = workdir / path.relative_to(ROOT).as_posix().replace("/", "_")
        directory.mkdir(parents=True, exist_ok=True)
        yield from _run_python([b for b in page_blocks if b.is_python], places, directory)
        for block in page_blocks:
            if block.is_shell and block.runs:
                yield _run_shell(block, places, directory)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("pages", nargs="*", type=Path, help="Markdown files (default: the README and docs/)")
    parser.add_argument(
        "--workdir", type=Path, required=True, help="a scratch directory; one folder per page"
    )
    parser.add_argument("--places", default="{}", help="JSON: placeholder URL -> the URL to use instead")
    args = parser.parse_args(argv)
    # What every page imports, once, before the forks: a page then costs a fork, not the imports.
    import httpx  # noqa: F401
    import openai

    import llmspans

    # And what a page's first client and first configure() would load: building the clients imports the
    # SDK's transport and resources, instrumenting them llmspans' adapters. No thread may be left running
    # before the forks (a child has none of its parent's threads).
    llmspans.instrument(openai.OpenAI(api_key="warm-up", base_url="http://127.0.0.1:9/v1"))
    llmspans.instrument(openai.AsyncOpenAI(api_key="warm-up", base_url="http://127.0.0.1:9/v1"))
    import opentelemetry.exporter.otlp.json.file
    import opentelemetry.exporter.otlp.proto.http.metric_exporter
    import opentelemetry.exporter.otlp.proto.http.trace_exporter
    import opentelemetry.sdk.metrics
    import opentelemetry.sdk.trace  # noqa: F401

    if threading.active_count() != 1:
        raise RuntimeError(f"a thread runs before the forks: {threading.enumerate()}")
    places = json.loads(args.places)
    for result in run_pages([p.resolve() for p in args.pages] or pages(), places, args.workdir):
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
