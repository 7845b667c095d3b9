"""The documentation keeps its word: every example in the README and docs/ runs, every public name is in
the API reference, every environment variable the package reads is on the configuration page.

The examples run against the shipped simulator (one for the whole module, with the capacity model so a
vLLM-like `/metrics` is there too) and a local OTLP receiver, through tests/support/doc_examples.py: one
process that imports llmspans once and forks a fresh process per page. The rules the pages follow are in
docs/development.md, "The documentation".
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import llmspans
from llmspans.tools.simulator import Capacity, SimulatedServer
from tests.support import doc_examples
from tests.support.local_http import serving
from tests.support.otlp_http import _Handler as OtlpHandler

ROOT = doc_examples.ROOT
ALL_BLOCKS = [block for page in doc_examples.pages() for block in doc_examples.blocks(page)]
RUN = [block for block in ALL_BLOCKS if block.runs]
SHELL = [block for block in ALL_BLOCKS if block.is_shell]
# The servers the text names, and the test's own in their place.
SERVER_PLACEHOLDERS = (
    "http://localhost:8000/v1", "http://127.0.0.1:8000/v1", "http://vllm-host:8000/v1",
    "http://replica-1:8000/v1", "http://replica-2:8000/v1",
)  # fmt: skip
OTLP_PLACEHOLDER = "http://localhost:4318"


@pytest.fixture(scope="module")
def example_results(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, dict[str, object]]]:
    """Run every example once, against one simulator and one OTLP receiver; results by block id."""
    # Fast per token, so the examples' calls take milliseconds; 4 slots and /metrics as vLLM has them.
    capacity = Capacity(slots=4, prefill_per_token=0.0001, decode_per_token=0.002)
    with (
        SimulatedServer(capacity=capacity, record=False) as simulator,
        serving(OtlpHandler, received=[]) as otlp,
    ):
        places = dict.fromkeys(SERVER_PLACEHOLDERS, simulator.base_url)
        places[OTLP_PLACEHOLDER] = f"http://127.0.0.1:{otlp.server_address[1]}"
        environment = {
            **os.environ,
            "OPENAI_BASE_URL": simulator.base_url,
            "OPENAI_API_KEY": "sk-docs-examples",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        }
        for variable in ("LLMSPANS_TRACES_FILE", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_TRACES_SAMPLER"):
            environment.pop(variable, None)  # the examples start from a plain environment
        workdir = tmp_path_factory.mktemp("doc-examples")
        done = subprocess.run(
            [sys.executable, "-m", "tests.support.doc_examples", "--workdir", str(workdir), "--places", json.dumps(places)],
            cwd=ROOT, env=environment, capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
        results = {}
        for line in done.stdout.splitlines():
            if line.startswith("{"):
                result = json.loads(line)
                results[result["id"]] = result
        assert done.returncode == 0, done.stderr[-4000:]
        # The configuration page's OTLP example exported to the receiver in place of localhost:4318.
        assert any(received.path == "/v1/traces" for received in otlp.received), "no OTLP export arrived"  # type: ignore[attr-defined]
        yield results


@pytest.mark.parametrize("block", RUN, ids=[block.id for block in RUN])
def test_the_example_runs(block: doc_examples.Block, example_results: dict[str, dict[str, object]]) -> None:
    result = example_results.get(block.id)
    assert result is not None, f"{block.id} was not run"
    assert result["ok"], f"{block.id} ({block.lang}) failed:\n{result['error']}"


def test_every_shell_example_says_whether_it_runs() -> None:
    unmarked = [
        block.id
        for block in SHELL
        if block.directive != "run" and not (block.directive or "").startswith("not run: ")
    ]
    assert not unmarked, (
        "mark each shell example `<!-- example: run -->` (run by this test, against the simulator) or "
        f"`<!-- example: not run: why -->` (and say which test covers it): {unmarked}"
    )


def test_the_pages_have_examples_to_run() -> None:
    """A parser that found nothing would pass every test above: the count says it did find them."""
    assert len([block for block in RUN if block.is_python]) >= 25
    assert len([block for block in RUN if block.is_shell]) >= 3


def test_every_environment_variable_the_package_reads_is_documented() -> None:
    read: set[str] = set()
    pattern = re.compile(r"""f?["']((?:LLMSPANS|OTEL|TIKTOKEN|DATA_GYM|OPENAI)_[A-Za-z0-9_{}]+)["']""")
    for source in (ROOT / "llmspans").rglob("*.py"):
        for name in pattern.findall(source.read_text(encoding="utf-8")):
            read.update(name.replace("{signal}", signal) for signal in ("TRACES", "METRICS"))
    configuration = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"`([A-Z][A-Z0-9_]+)`", configuration))
    assert len(read) > 20
    assert read <= documented, (
        f"read by llmspans/ but not in docs/configuration.md: {sorted(read - documented)}"
    )


@pytest.fixture(scope="module")
def built_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site as `mkdocs build --strict` makes it; .ci/run builds it once and names it here."""
    given = os.environ.get("LLMSPANS_DOCS_SITE")
    if given:
        return Path(given)
    site = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, capture_output=True, text=True, timeout=300,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return site


def test_every_public_name_is_in_the_api_reference(built_site: Path) -> None:
    page = (built_site / "reference" / "index.html").read_text(encoding="utf-8")
    anchors = set(re.findall(r'id="(llmspans\.[A-Za-z_][A-Za-z0-9_.]*)"', page))
    missing = [name for name in llmspans.__all__ if f"llmspans.{name}" not in anchors]
    assert not missing, f"in llmspans.__all__ but not in the API reference (docs/reference.md): {missing}"
    assert {"llmspans.testing.capture", "llmspans.vllm.ServerMetrics"} <= anchors
